"""Redis Sentinel, real servers (tests/sentinel_kit.py): the store follows a failover, and an acknowledged step survives it.

One process, no fleet: runs are driven in-process (`run_child`), so each test
shows one thing. The store's clients (the Coordinator's, a worker's blocking
pool) go on writing through a failover that also takes a sentinel. A step a
caller sees acknowledged (a submit, a delegation, a decision, a cancel) returns
only once a replica has it (`WAIT`): held while every replica is stopped, on
the promoted replica when the master is SIGKILLed right after, counted when no
replica answers in time, and not waited for at all with no replica asked for.
A planned switch (docs/deploy.md's: writes paused, `SENTINEL FAILOVER`, the old
master made a replica) loses no acknowledged submit over a window that runs well
past the promotion; a master that refuses writes for lack of replicas
(`min-replicas-to-write`, which every node of these sets has, as deploy.md asks)
holds a step until it has them, and a sentinel that names a replica is not
followed. Celery's broker and subq's result backends reach the master through
kombu's and Celery's sentinel transports. tests/test_sentinel_fleet.py runs the
same with real workers. Every node and sentinel here has a password.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from redis.sentinel import SentinelConnectionPool

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.api.ops import SubqCollector
from coordinator.celery_app import make_app
from coordinator.local.fleet import WorkerFleet
from coordinator.redis_clients import FollowingConnection, failover_retry, redis_client
from tests.agents import agent, call, reply
from tests.helpers import eventually
from tests.sentinel_kit import MASTER_NAME, SentinelSet, sentinel_set, wait_relinked, wait_replicated
from workers import observe
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child

# What docs/deploy.md asks of every node: a master with no replica refuses writes.
MIN_REPLICAS_TO_WRITE = 1
# A planned switch's submits go on until this many more were acknowledged after the promotion: the old
# master's replica is moved to the new one about a second after it, and the old master itself about ten.
SUBMITS_AFTER_PROMOTION = 200
# ... or until this long after the promotion has passed (a loaded host makes ~50 submits a second).
SUBMITS_AFTER_PROMOTION_S = 120


@pytest.fixture
def kit(tmp_path: Path) -> Iterator[SentinelSet]:
    """A set of its own, for a test that kills its master or switches it."""
    with sentinel_set(
        tmp_path / "sentinels", password=secrets.token_urlsafe(16), min_replicas_to_write=MIN_REPLICAS_TO_WRITE
    ) as started:
        yield started


@pytest.fixture(scope="module")
def steady(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    """A set the module's tests share: they stop and resume replicas, and kill nothing."""
    with sentinel_set(
        tmp_path_factory.mktemp("steady"),
        password=secrets.token_urlsafe(16),
        min_replicas_to_write=MIN_REPLICAS_TO_WRITE,
    ) as started:
        yield started


def _settings(kit: SentinelSet, base: Settings, **updates: object) -> Settings:
    # A queue no worker consumes: the runs of these tests are driven here, in-process.
    return kit.settings(base, **{"key_prefix": "subqsentinel", "queue": "subq-sentinel-nobody", **updates})


def _waits(client: redis.Redis) -> int:
    """How many WAIT commands this server has answered."""
    return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def _replicas(kit: SentinelSet) -> list[int]:
    master = kit.master_port()
    return [port for port, server in kit.data.items() if port != master and server.alive()]


def test_the_store_follows_a_failover_and_goes_on_writing(kit: SentinelSet, settings: Settings) -> None:
    """The master and the first sentinel SIGKILLed: the two others promote a replica, and every write goes on."""
    own = _settings(kit, settings)
    coord = Coordinator(own)
    # A worker's client: a blocking pool, sentinel-managed (workers/runtime/context.py).
    pool_client = redis_client(own, max_connections=2, pool_timeout_s=5)
    try:
        before = coord.create_task("before the failover", todos="[ ] a\n[ ] b")
        pool_client.set("subqsentinel:probe", "1")
        wait_replicated(kit)
        # The master's machine dies, and with it the sentinel every client asks first.
        old = kit.kill_master()
        kit.sentinels[0].kill()
        # Sent while the sentinels have not yet promoted anyone: the client retries until they have.
        during = coord.create_task("during the failover")
        assert pool_client.incr("subqsentinel:probe") == 2
        new = kit.wait_promoted(old)
        assert new != old
        wait_relinked(kit, 1)  # a second failover, which a loaded host can bring about, keeps what follows
        after = coord.create_task("after the failover")
        for task in (before, during, after):
            assert coord.get_task(task.id).prompt == task.prompt
        assert [item.content for item in coord.get_todos(before.id)] == ["a", "b"]
        promoted = kit.client(new)
        assert promoted.execute_command("ROLE")[0] == "master"
        promoted.close()
    finally:
        pool_client.close()
        coord.close()


def test_a_command_in_flight_when_the_master_dies_is_sent_again_to_the_promoted_one(
    kit: SentinelSet, settings: Settings
) -> None:
    """A blocking read the master never answered (the API's event stream, `wait`) lands on the promoted replica.

    redis-py would send it again to the dead master's address until its retries ran out
    (coordinator/redis_clients.py, `FollowingConnection`).
    """
    client = redis_client(_settings(kit, settings))
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(client.xread({"subqsentinel:inflight": "$"}, block=4000))
        except redis.RedisError as exc:
            outcome.append(exc)

    try:
        assert client.ping()
        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.3)  # the XREAD is on the master's connection, blocked
        old = kit.kill_master()
        started = time.monotonic()
        new = kit.wait_promoted(old)
        reader.join(30)
        assert not reader.is_alive() and outcome and not isinstance(outcome[0], Exception), outcome
        assert time.monotonic() - started < 15, "sent again to the promoted master, not the dead one until given up"
        assert client.connection_pool.connection_class is FollowingConnection
        wait_relinked(kit, 1)
        assert new != old and client.set("subqsentinel:after", "1")

        def on_the_named_master() -> bool | None:
            # Read through the first live sentinel, whose view may lag the others' for a moment after a
            # failover (seen once under load: it named a node the write had not reached yet).
            master = kit.master_client()
            try:
                return master.get("subqsentinel:after") == "1" or None
            except redis.RedisError:
                return None
            finally:
                master.close()

        eventually(on_the_named_master, "the write on the master the sentinels name", timeout_s=10)
    finally:
        client.close()


def test_acknowledged_steps_are_on_the_promoted_replica(kit: SentinelSet, settings: Settings) -> None:
    """A submit, a delegation, a decision and a cancel, each acknowledged; the master dies at once after."""
    own = _settings(kit, settings)
    coord = Coordinator(own)
    rt = build_runtime(own, make_app(own))
    try:
        master = kit.master_client()
        waits_before = _waits(master)
        # A decision: a run parks two calls for approval; one is decided before the kill.
        decided_task = coord.create_task(agent(call("run_command", command="make a"), reply("made a")), run=True)
        pending_task = coord.create_task(agent(call("run_command", command="make b"), reply("made b")), run=True)
        assert run_child(rt, decided_task.id).status == "waiting_approval"
        assert run_child(rt, pending_task.id).status == "waiting_approval"
        (decided,) = coord.list_approvals(decided_task.id)
        (pending,) = coord.list_approvals(pending_task.id)
        assert coord.decide(decided.id, "deny", feedback="not now").status == "denied"
        # A delegation, committed (its children are queued: no worker consumes this queue).
        parent = coord.create_task("a parent", todos="[ ] x\n[ ] y")
        batch = coord.delegate(parent.id, [{"description": "x", "message": "x"}, {"description": "y", "message": "y"}])
        # A cancel of a tree with a queued child.
        doomed = coord.create_task("to cancel")
        coord.delegate(doomed.id, [{"description": "z", "message": "z"}])
        coord.cancel(doomed.id, "stopped by the test")
        submitted = coord.create_task("submitted last")
        assert _waits(master) > waits_before, "the acknowledged steps sent WAIT"
        master.close()

        old = kit.kill_master()  # at once: no wait for the replicas beyond what each step waited
        kit.wait_promoted(old)
        wait_relinked(kit, 1)  # the steps below stand through a second failover

        assert coord.store.approvals.get_approval(decided.id).status == "denied"
        assert coord.get_task(submitted.id).prompt == "submitted last"
        assert coord.get_task(parent.id).status == TaskStatus.DELEGATED
        assert [c.id for c in coord.get_children(parent.id)] == batch.child_ids
        assert {item.subtask_id for item in coord.get_todos(parent.id)} == set(batch.child_ids)
        assert coord.get_task(doomed.id).status == TaskStatus.CANCELLED
        assert all(c.status == TaskStatus.CANCELLED for c in coord.get_children(doomed.id))
        # The approval that was pending across the failover is decided on the new master, and its run resumes.
        assert coord.decide(pending.id, "approve").status == "approved"
        assert run_child(rt, pending_task.id).status == "completed"
        assert run_child(rt, decided_task.id).status == "completed"
        assert coord.get_task(decided_task.id).summary == "made a"
    finally:
        rt.coordinator.close()
        coord.close()


def _then_set(step: Callable[[], object], done: threading.Event) -> None:
    step()
    done.set()


def test_a_step_is_acknowledged_only_once_a_replica_has_it(steady: SentinelSet, settings: Settings) -> None:
    """With every replica stopped, a submit (a transaction) and a cancel (a script) wait in WAIT until one is back."""
    coord = Coordinator(_settings(steady, settings, redis_replica_wait_ms=20_000))
    stopped = _replicas(steady)
    try:
        doomed = coord.create_task("to cancel")
        wait_replicated(steady)
        steps = {
            "submit": lambda: coord.create_task("a submit no replica has yet"),
            "cancel": lambda: coord.cancel(doomed.id, "stopped while the replicas were"),
        }
        for name, step in steps.items():
            for port in stopped:
                os.kill(steady.data[port].proc.pid, signal.SIGSTOP)
            done = threading.Event()
            worker = threading.Thread(target=_then_set, args=(step, done))
            worker.start()
            assert not done.wait(1.0), f"the {name} was acknowledged before any replica had it"
            os.kill(steady.data[stopped[0]].proc.pid, signal.SIGCONT)
            assert done.wait(5.0), f"the {name} was not acknowledged once a replica was back"
            worker.join()
            for port in stopped[1:]:
                os.kill(steady.data[port].proc.pid, signal.SIGCONT)
        assert coord.store.core.replica_shortfalls.count == 0
    finally:
        for port in stopped:
            os.kill(steady.data[port].proc.pid, signal.SIGCONT)
        coord.close()


def test_a_step_no_replica_acknowledges_in_time_stands_and_is_counted(
    steady: SentinelSet, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    coord = Coordinator(_settings(steady, settings, redis_replica_wait_ms=200))
    stopped = _replicas(steady)
    try:
        for port in stopped:
            os.kill(steady.data[port].proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        task = coord.create_task("no replica in time")
        assert time.monotonic() - started >= 0.2, "it waited SUBQ_REDIS_REPLICA_WAIT_MS"
        assert coord.get_task(task.id).prompt == "no replica in time", "the step stands on the master"
        # One for the submit: its commit's WAIT, which covers its tenant's quota count (tenant_submit) too.
        shortfalls = coord.replica_shortfalls()
        assert shortfalls == caplog.text.count("acknowledged by 0 of the 1 replica(s)") == 1
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SubqCollector(coord))
        assert f"subq_replica_shortfalls_total {float(shortfalls)}" in generate_latest(registry).decode()
        # A worker's metrics port reports its own store's count the same way.
        observe.count_replica_shortfalls(coord.replica_shortfalls)
        try:
            assert f"subq_replica_shortfalls_total {float(shortfalls)}" in generate_latest(observe.REGISTRY).decode()
        finally:
            observe.count_replica_shortfalls(lambda: 0)
    finally:
        for port in stopped:
            os.kill(steady.data[port].proc.pid, signal.SIGCONT)
        coord.close()


def test_no_wait_when_no_replica_is_asked_for(steady: SentinelSet, settings: Settings) -> None:
    """SUBQ_REDIS_MIN_REPLICAS=0 under Sentinel: the steps are sent as with one Redis, without WAIT."""
    coord = Coordinator(_settings(steady, settings, redis_min_replicas=0))
    master = steady.master_client()
    try:
        before = _waits(master)
        parent = coord.create_task("no wait", todos="[ ] x")
        coord.delegate(parent.id, [{"description": "x", "message": "x"}])
        coord.cancel(parent.id, "done")
        assert _waits(master) == before
    finally:
        master.close()
        coord.close()


def test_a_planned_switch_loses_no_acknowledged_step(kit: SentinelSet, settings: Settings) -> None:
    """docs/deploy.md's planned switch while two callers submit without pause: every submit acknowledged is there.

    The submits go on until SUBMITS_AFTER_PROMOTION more were acknowledged after the switch, past the
    moment the old master's replicas follow the new one. `SENTINEL FAILOVER` alone lost 15 to 334 a
    run: what the old master took after the promotion, acknowledged (WAIT) by its other replica, which
    then resynced from the promoted one, and, without min-replicas-to-write, what it took in the ten
    seconds before the sentinels made it a replica (docs/deploy.md, "A planned switch").
    """
    coord = Coordinator(_settings(kit, settings))
    # A caller idle across the switch: its pooled connection still leads to the old master, now a replica.
    idle = Coordinator(_settings(kit, settings))
    doomed = idle.create_task("cancelled after the switch")
    acknowledged: list[tuple[float, str]] = []
    failed: list[BaseException] = []
    stop = threading.Event()

    def submit_until_stopped() -> None:
        while not stop.is_set():
            try:
                task_id = coord.create_task("submitted across a planned switch").id
            except Exception as exc:  # every submit is held and sent again, none fails
                failed.append(exc)
                return
            acknowledged.append((time.monotonic(), task_id))

    callers = [threading.Thread(target=submit_until_stopped) for _ in range(2)]
    try:
        for caller in callers:
            caller.start()
        eventually(lambda: len(acknowledged) >= 20 or None, "submits before the switch", timeout_s=30)
        old, new = kit.planned_switch()
        promoted_at = time.monotonic()  # the sentinels name the new master, and the old one is its replica
        before = len(acknowledged)
        eventually(
            lambda: len(acknowledged) >= before + SUBMITS_AFTER_PROMOTION or bool(failed) or None,
            "submits after the promotion",
            timeout_s=SUBMITS_AFTER_PROMOTION_S,
        )
    finally:
        stop.set()
        for caller in callers:
            caller.join()
    try:
        assert failed == []
        assert new != old
        after = [task_id for at, task_id in acknowledged if at > promoted_at]
        assert len(after) >= SUBMITS_AFTER_PROMOTION
        missing = [
            (at - promoted_at, task_id) for at, task_id in acknowledged if not coord.store.records.task_exists(task_id)
        ]
        assert missing == [], (
            f"{len(missing)} of {len(acknowledged)} acknowledged submits lost; the first, as (s after the "
            f"sentinels named the new master, id): {missing[:5]}"
        )
        node = kit.client(old)
        try:
            assert node.execute_command("ROLE")[:2] == ["slave", "127.0.0.1"], "the old master is a replica"
        finally:
            node.close()
        # Its script meets READONLY there (on Redis 6.2 inside "Error running script"), and is sent to the new master.
        idle.cancel(doomed.id, "after the switch")
        assert coord.get_task(doomed.id).status == TaskStatus.CANCELLED
    finally:
        idle.close()
        coord.close()


def test_a_master_short_of_replicas_holds_a_step_until_it_has_them(steady: SentinelSet, settings: Settings) -> None:
    """NOREPLICAS (min-replicas-to-write) is neither acknowledged nor failed: the step is sent again until taken."""
    coord = Coordinator(_settings(steady, settings))
    master = steady.master_client()
    try:
        master.config_set("min-replicas-to-write", len(steady.data))  # one more than it has
        done = threading.Event()
        submitted: list[str] = []
        caller = threading.Thread(
            target=_then_set, args=(lambda: submitted.append(coord.create_task("held for a replica").id), done)
        )
        caller.start()
        assert not done.wait(1.5), "a step the master refused was acknowledged"
        master.config_set("min-replicas-to-write", MIN_REPLICAS_TO_WRITE)
        assert done.wait(20), "the step was not sent again once the master took writes"
        caller.join()
        assert coord.get_task(submitted[0]).prompt == "held for a replica"
    finally:
        master.config_set("min-replicas-to-write", MIN_REPLICAS_TO_WRITE)
        master.close()
        coord.close()


def test_a_runs_start_short_of_replicas_is_held_until_it_has_them(steady: SentinelSet, settings: Settings) -> None:
    """A run's start is its script and its reads in one MULTI/EXEC: the script's NOREPLICAS comes back nested in
    EXEC's reply, not alone, and is held as one that comes alone is (before, it failed the start at once)."""
    own = _settings(steady, settings)
    coord = Coordinator(own)
    rt = build_runtime(own, make_app(own))
    master = steady.master_client()
    try:
        task = coord.create_task("started once the master takes writes", run=True)  # on a queue nobody reads
        master.config_set("min-replicas-to-write", len(steady.data))  # one more than it has
        done = threading.Event()
        started: list[object] = []
        caller = threading.Thread(target=_then_set, args=(lambda: started.append(rt.lifecycle.start(task.id)), done))
        caller.start()
        assert not done.wait(1.5), "a start the master refused went on, or failed"
        master.config_set("min-replicas-to-write", MIN_REPLICAS_TO_WRITE)
        assert done.wait(20), "the start was not sent again once the master took writes"
        caller.join()
        (run,) = started
        assert getattr(run, "deliveries", None) == 1, f"the run started once: {run}"
    finally:
        master.config_set("min-replicas-to-write", MIN_REPLICAS_TO_WRITE)
        master.close()
        rt.coordinator.close()
        coord.close()


class _Lagging:
    """Sentinels that have not heard of a switch yet: they name `stale` first, then `current`."""

    def __init__(self, stale: int, current: int) -> None:
        self.answers = [stale, current]
        self.asked = 0

    def discover_master(self, service_name: str) -> tuple[str, int]:
        self.asked += 1
        return "127.0.0.1", self.answers[min(self.asked, len(self.answers)) - 1]


def test_a_connection_named_a_replica_asks_the_sentinels_again(steady: SentinelSet) -> None:
    """The first answer names a replica: the connection finds it is one (ROLE), and never sends it the write."""
    replica, master = _replicas(steady)[0], steady.master_port()
    probe = steady.client(replica)
    lagging = _Lagging(stale=replica, current=master)
    pool = SentinelConnectionPool(
        MASTER_NAME, lagging, connection_class=FollowingConnection, retry=failover_retry(), **steady.client_options
    )
    client = redis.Redis(connection_pool=pool)
    try:
        refused_before = _refused_sets(probe)
        assert client.set("subqsentinel:named-a-replica", "1")
        assert lagging.asked == 2
        assert _refused_sets(probe) == refused_before, "the write went to the replica"
    finally:
        client.close()
        probe.close()


def _refused_sets(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_set", {}).get("rejected_calls", 0))


def test_celerys_broker_and_result_backend_reach_the_master(steady: SentinelSet, settings: Settings) -> None:
    """kombu's sentinel transport publishes to the master; subq's result backends (the publisher's, Flower's) store there."""
    from workers.flower_setup import RunResultSentinelBackend, install

    own = _settings(steady, settings, queue="subq-sentinel-celery")
    app = make_app(own)
    master = steady.master_client()
    try:
        master.delete("subq-sentinel-celery")
        app.send_task("subq.run_task", args=["0123456789abcdef"], task_id="sentinel-probe", ignore_result=True)
        assert master.llen("subq-sentinel-celery") == 1, "the message is on the master's queue"
        assert type(app.backend).__name__ == "PublishOnlySentinelBackend"
        app.backend.store_result("sentinel-result", {"ok": True}, "SUCCESS")
        assert app.backend.get_task_meta("sentinel-result")["result"] == {"ok": True}
        assert master.exists("celery-task-meta-sentinel-result")
        flower_app = make_app(own)
        install(flower_app)
        assert isinstance(flower_app.backend, RunResultSentinelBackend)
        assert flower_app.backend.get_task_meta("sentinel-result")["result"] == {"ok": True}
    finally:
        master.delete("subq-sentinel-celery", "celery-task-meta-sentinel-result")
        master.close()


def test_a_workers_stats_reach_flower_and_carry_no_password(
    steady: SentinelSet, settings: Settings, tmp_path: Path
) -> None:
    """`inspect stats` (Flower's worker page, `celery inspect stats`) answers on Sentinel, with no secret in it.

    The broker's transport options hold the sentinels' client options: a redis-py `Retry`, which no JSON
    encoder takes (the worker logged "Control command error" and sent nothing), and the sentinels' password.
    """
    own = _settings(steady, settings, queue="subq-sentinel-stats")
    with WorkerFleet(own, 1, tmp_path / "workers") as fleet:
        fleet.wait_ready()
        app = make_app(own)
        inspect = app.control.inspect(destination=fleet.nodes, timeout=2)
        replies = eventually(inspect.stats, "the worker's stats", timeout_s=20)
        [(_node, stats)] = replies.items()
        options = stats["broker"]["transport_options"]
        assert options["master_name"] == MASTER_NAME and options["sentinel_kwargs"]["password"] == "********", options
        assert steady.password and steady.password not in json.dumps(replies)
        conf = inspect.conf()  # Celery's own `conf` reply masks it too
        assert conf[fleet.nodes[0]]["broker_transport_options"]["master_name"] == MASTER_NAME
        assert steady.password not in json.dumps(conf)
        assert "Control command error" not in fleet.logs[0].read_text(errors="replace")
