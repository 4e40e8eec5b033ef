"""A Redis crash and restart with AOF `everysec` in the middle of a fan-out: every tree converges. And a
stopped run's late spend that a Redis away refused is recorded once it is back.

Redis is SIGKILLed (no shutdown, so up to a second of writes is lost), stays
down three seconds, and comes back from its append-only file on the same port.
A message taken off the queue just before the crash, a finish or an ack lost
with the last second: whatever was lost, the writes before it survive in order,
and the due list (written before each send) names every task that a lost
message should have moved on; the reconciler moves it on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from coordinator import Coordinator, Settings, StoreError, TaskRecord, Usage, heartbeat
from coordinator.celery_app import make_app
from coordinator.heartbeat import Heartbeat, LateSpends
from coordinator.local.embedded_redis import find_redis_server
from coordinator.local.fleet import WorkerFleet
from coordinator.local.ports import free_port
from coordinator.models import Spend
from coordinator.ports.steps import Ended
from coordinator.runs import Run
from tests.agents import agent, reply
from tests.helpers import eventually
from tests.test_faults import assert_converged
from workers.runtime.context import build_runtime

CHILDREN = 40
DOWN_S = 3


class RedisServer:
    """A redis-server with AOF everysec in `workdir`, which can be killed and started again."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url)
        eventually(lambda: _pings(client), "redis to answer", timeout_s=10, every_s=0.05)
        client.close()

    def crash(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """A clean stop (SHUTDOWN): every write so far is in the append-only file."""
        assert self.proc is not None
        client = redis.Redis.from_url(self.url)
        try:
            client.shutdown()
        except redis.ConnectionError:
            pass  # the server closed the connection as it went
        finally:
            client.close()
        self.proc.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@contextmanager
def restartable_redis(workdir: Path) -> Iterator[RedisServer]:
    workdir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.terminate()
            server.proc.wait(timeout=10)


def test_a_redis_crash_mid_fan_out_converges(settings: Settings, tmp_path: Path) -> None:
    with restartable_redis(tmp_path / "redis") as server:
        own = settings.model_copy(
            update={
                "redis_url": server.url,
                "queue": "subq-redis-restart",
                "heartbeat_lapse_s": 3,
                "reconcile_interval_s": 0.5,
                "reconcile_grace_s": 5,
                "visibility_timeout_s": 300,  # the reconciler, not the broker's backstop, must converge it
            }
        )
        with WorkerFleet(own, 2, tmp_path / "workers") as fleet:
            fleet.wait_ready()
            coord = Coordinator(own)
            try:
                parent = coord.create_task("Forty children")
                specs = [
                    {"description": f"c{n}", "message": agent({**reply(f"c{n} done"), "latency_ms": 700})}
                    for n in range(CHILDREN)
                ]
                coord.delegate(parent.id, specs)
                eventually(
                    lambda: sum(c.status.terminal for c in coord.get_children(parent.id)) >= 4 or None,
                    "the first children to end",
                )
                server.crash()
                time.sleep(DOWN_S)
                server.start()
                coord.wait(parent.id, 120)
                assert_converged(coord, parent.id)
                assert len(coord.get_children(parent.id)) == CHILDREN
                assert all(c.status.terminal for c in coord.get_children(parent.id))
            finally:
                coord.close()


@dataclass
class OneRun:
    """A private Redis that can be stopped, a coordinator and a worker's runtime on it, and one child's run."""

    server: RedisServer
    coord: Coordinator
    heartbeat: Heartbeat
    parent: TaskRecord
    run: Run

    def held(self, cost_micros: int = 900) -> Spend:
        """A response's spend the run holds for its next step."""
        run = self.run
        spend = Spend(f"{run.run_seq}:1", Usage(tokens_in=40), cost_micros=cost_micros, cost_source="t")
        run.writes.usage.append(spend)
        return spend


@contextmanager
def one_run(settings: Settings, workdir: Path) -> Iterator[OneRun]:
    with restartable_redis(workdir) as server:
        own = settings.model_copy(update={"redis_url": server.url, "queue": "subq-held-spend", "heartbeat_lapse_s": 3})
        coord = Coordinator(own)
        runtime = build_runtime(own, make_app(own))
        try:
            parent = coord.create_task("A parent", todos="[ ] one")
            (child_id,) = coord.delegate(parent.id, [{"description": "one", "message": "hello"}]).child_ids
            run = runtime.lifecycle.start(child_id)
            assert isinstance(run, Run), run
            yield OneRun(server, coord, runtime.lifecycle.heartbeat, parent, run)
        finally:
            runtime.coordinator.close()
            coord.close()


def test_a_stopped_runs_late_spend_that_redis_refused_is_recorded_once_it_is_back(
    settings: Settings, tmp_path: Path
) -> None:
    """A stop lands while a run holds a response its provider billed; the run's end reads the stop and records
    that spend after it (late spend), and Redis is away just then. The run's delivery is retried, finds its task
    stopped and runs nothing, so the spend lives only in the worker: its heartbeat records it once Redis is back,
    and clears the task's mark of spend still to record."""
    with one_run(settings, tmp_path / "redis") as it:
        it.coord.cancel(it.parent.id, "stopped")
        it.held()
        record_late = it.run._spent_before_the_stop

        def redis_goes_away(spends: list[Spend]) -> None:
            it.server.stop()
            record_late(spends)

        it.run._spent_before_the_stop = redis_goes_away  # type: ignore[method-assign]
        with pytest.raises(StoreError):
            it.run.end(Ended("completed", summary="done"))  # its last response, answered as the stop landed
        it.run.abandon()  # as the runner does when Redis fails a run; its delivery would be retried
        time.sleep(1.5)  # beats that find Redis still away
        assert it.heartbeat.late_spends, "kept while Redis is away"
        it.server.start()
        eventually(lambda: not it.heartbeat.late_spends or None, "the late spend to be recorded")
        assert it.coord.get_task(it.parent.id).total_cost_micros == 900
        assert it.coord.get_task(it.run.task_id).cost_micros == 900 and it.coord.finishing([it.run.task_id]) == []
        assert it.coord.get_task(it.parent.id).status.value == "cancelled"


def test_the_spend_a_run_held_when_redis_failed_its_step_is_recorded_once_it_is_back(
    settings: Settings, tmp_path: Path
) -> None:
    """A run holds a response's spend for its next step, and Redis is away for that step: the run is abandoned
    (its delivery retried, which makes the request again) and its heartbeat records the first response's spend
    once Redis is back, on the task and up its ancestors, once; it leaves the task's mark of spend still to
    record, which only a stopped run's own step sets and its own record clears."""
    with one_run(settings, tmp_path / "redis") as it:
        spend = it.held()
        it.server.stop()
        with pytest.raises(StoreError):
            it.run.flush()  # the check before its next model request
        it.run.abandon()  # as the runner does: the delivery is retried
        assert it.heartbeat.late_spends, "owed by the heartbeat"
        it.server.start()
        task_key = it.coord.store.keys.task(it.parent.root_id, it.run.task_id)
        it.coord.client.hset(task_key, "late_spend_at", "1")  # a newer run's mark, as if a stop refused its spend
        eventually(lambda: not it.heartbeat.late_spends or None, "the held spend to be recorded")
        assert it.coord.get_task(it.run.task_id).cost_micros == 900
        assert it.coord.get_task(it.parent.id).total_cost_micros == 900
        assert not it.coord.get_task(it.run.task_id).status.terminal, "left for the retried delivery to run"
        assert it.coord.client.hget(task_key, "late_spend_at") == "1", "the mark is the newer run's to clear"
        # Recorded again (as after a step whose reply was lost once it had run): written once.
        it.heartbeat.owe(it.run.task, [spend], refused=False)
        it.heartbeat.late_spends.record(it.heartbeat.plane)
        assert not it.heartbeat.late_spends
        assert it.coord.get_task(it.parent.id).total_cost_micros == 900


def test_late_spend_that_redis_keeps_refusing_is_kept_then_logged_as_lost(
    settings: Settings, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis refuses every try (nothing listens on its port): each beat tries the first spend owed and keeps them
    all, warning once each, until LATE_SPEND_KEEP_S has passed or the process's last try (its shutdown), which
    logs each as lost, with its figures."""
    gone = Coordinator(settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"}))
    task = TaskRecord(id="0123456789abcdef-000000000001", root_id="0123456789abcdef", status="cancelled", prompt="p",
                      profile="offline", runner="agent", created_at=1.0, updated_at=1.0)  # fmt: skip
    spend = Spend(request_key="1:1", usage=Usage(tokens_in=40, tokens_out=2), cost_micros=900, cost_source="t")
    tries: list[str] = []
    record_late = gone.store.runs.record_late_spend
    monkeypatch.setattr(
        gone.store.runs, "record_late_spend", lambda *a, **k: tries.append(a[0].id) or record_late(*a, **k)
    )
    owed = LateSpends()
    try:
        owed.owe(task, [spend], refused=True)
        owed.owe(task, [spend._replace(request_key="1:2")], refused=False)
        for _ in range(2):
            owed.record(gone.plane)
        assert owed, "kept for the next beat"
        assert len(tries) == 2, "one try a beat: the rest wait behind a refusal, which costs the client's retries"
        warned = [r.getMessage() for r in caplog.records if "the spend of" in r.getMessage()]
        assert len(warned) == 2, warned  # once each, not at every beat
        assert f"could not record the spend of 1 response(s) of {task.id}, 42 tokens, $0.000900" in warned[0]
        owed.record(gone.plane, last=True)
        assert not owed
        lost = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "the spend of" in r.getMessage()]
        assert len(lost) == 2 and all("lost the spend of 1 response(s)" in line for line in lost), lost
        caplog.clear()
        monkeypatch.setattr(heartbeat, "LATE_SPEND_KEEP_S", 0.0)
        owed.owe(task, [spend], refused=True)
        owed.record(gone.plane)
        assert not owed and "lost the spend" in caplog.text, "kept no longer than LATE_SPEND_KEEP_S"
    finally:
        gone.close()
