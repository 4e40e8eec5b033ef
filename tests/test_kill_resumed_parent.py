"""A worker SIGKILLed in the middle of a resumed parent's run: the parent still completes, once.

The resumed run of an agent parent (`<parent>-r1`, published by the child that
closed its batch) must be found by the reconciler when its worker dies, like
any run: the due list names it from its start. It did not when the parent's own
publish (`delegation.publish`, which unwatches the parent once its batch is
published) ran after the batch had already closed and watched the parent for
its resume: the entry was removed, the resumed run started without one
(start_run.lua only moved an entry, ZADD XX), and its death left the parent
`active` for ever, with nothing queued and no child outstanding. The first test
builds that race in one process, with the resumed run starting before or after the late
unwatch, or never (its message lost: the late unwatch took the parent off only while it was
`delegated`, so the reconciler publishes the resume again); the second kills real workers
at several moments of a resumed run (bench/kill_resumed_parent.py is the same,
20 rounds, with a CPU load).

The clock is scaled down as in the fault suite (a 3 s lapse, a 0.5 s tick, a 3 s grace).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import kill_resumed_parent as bench
from coordinator import Coordinator, Settings, TaskStatus, dispatch
from coordinator.models import Batch, TaskRecord
from coordinator.reconciler import Reconciler
from coordinator.runs import Ended, Released, Run, RunLifecycle
from tests.agents import agent, reply

# The documented bound of a restart: the lapse (or the reconciler's leader lease, when the killed
# worker led it) plus a couple of ticks; and room to start the next run on a loaded 2-core machine.
RESTART_BOUND_S = bench.RESTART_BOUND_S + 3
# Then the resumed run's two requests are made again at most.
DONE_BOUND_S = RESTART_BOUND_S + 2 * bench.RESUMED_STEP_MS / 1000 + 3


@pytest.fixture
def private(settings: Settings) -> Iterator[Coordinator]:
    """Keys and a queue of their own, which no worker consumes: this test's reconciler is the only one."""
    own = settings.model_copy(
        update={
            "key_prefix": f"subqkrp{secrets.token_hex(4)}",  # nothing of another test is due
            "queue": "subq-krp-nobody",
            "heartbeat_lapse_s": bench.LAPSE_S,
            "reconcile_interval_s": bench.TICK_S,
            "reconcile_grace_s": bench.GRACE_S,
        }
    )
    coord = Coordinator(own)
    coord.client.delete(own.queue)
    yield coord
    coord.client.delete(own.queue)
    coord.close()


@pytest.mark.parametrize("resume_starts", ["before the unwatch", "after the unwatch", "never"])
def test_a_resumed_run_outlives_its_parents_late_unwatch(
    private: Coordinator, monkeypatch: pytest.MonkeyPatch, resume_starts: str
) -> None:
    coord = private
    lifecycle = RunLifecycle(coord, "krp-worker")
    root = coord.create_task(agent(reply("unused")), run=True)
    first = lifecycle.start(root.id)
    assert isinstance(first, Run)
    first.delegation = first.plan.delegate([{"description": "a", "message": agent(reply("a done"))}], "parallel", "c0")
    resumed: list[Run] = []
    publish_batch = dispatch.publish_batch

    def children_end_before_the_publisher_goes_on(app: object, batch: Batch, children: list[TaskRecord]) -> None:
        publish_batch(app, batch, children)  # type: ignore[arg-type]
        for child in children:
            run = lifecycle.start(child.id)
            assert isinstance(run, Run)
            run.end(Ended("completed", summary="a done"))  # the last one closes and publishes the resume
        assert coord.get_task(root.id).status == TaskStatus.ACTIVE and root.id in coord.store.convergence.watched()
        if resume_starts == "before the unwatch":
            started = lifecycle.start(root.id)
            assert isinstance(started, Run)
            resumed.append(started)

    monkeypatch.setattr(dispatch, "publish_batch", children_end_before_the_publisher_goes_on)
    first.end(Released("delegated"))  # publishes the batch, then unwatches the parent
    monkeypatch.undo()
    assert root.id in coord.store.convergence.watched(), "the late unwatch left the resumed parent on the due list"
    if resume_starts == "never":
        # The resume's message is lost before any worker takes it: the reconciler publishes it again.
        coord.client.delete(coord.settings.queue)
        reconciler = Reconciler(coord, "krp-reconciler")
        deadline = time.monotonic() + RESTART_BOUND_S
        while not coord.store.convergence.queued_task_ids(coord.settings.queue) and time.monotonic() < deadline:
            reconciler.tick()
            time.sleep(bench.TICK_S)
        assert coord.store.convergence.queued_task_ids(coord.settings.queue) == {root.id}, coord.store.runs.in_flight(
            root.id
        )
        return
    if not resumed:
        started = lifecycle.start(root.id)
        assert isinstance(started, Run)
        resumed.append(started)
    assert coord.store.records.task_field(root.id, "run_seq") == "2"
    assert root.id in coord.store.convergence.watched(), "a running resumed run is on the due list"

    coord.client.delete(coord.settings.queue)  # the worker that ran the resume consumed its message
    lifecycle.heartbeat.forget(resumed[0])  # and died: its lease is renewed no more
    reconciler = Reconciler(coord, "krp-reconciler")
    deadline = time.monotonic() + RESTART_BOUND_S
    repairs: dict[str, int] = {}
    while not repairs and time.monotonic() < deadline:
        repairs = dict(reconciler.tick() or {})
        time.sleep(bench.TICK_S)
    assert repairs == {"run-lost": 1}, (
        f"the dead resumed run was never published again: {coord.store.runs.in_flight(root.id)}"
    )
    assert coord.store.convergence.queued_task_ids(coord.settings.queue) == {root.id}


def test_a_worker_killed_in_a_resumed_parents_run(settings: Settings, tmp_path: Path) -> None:
    """Two rounds, killed at the run's start and just before its end (the bench adds more moments, and rounds).

    Its `after-end` moment is the bench's alone: a root's end is one script (end_run.lua), so a
    worker that dies after it leaves nothing to repair, which tests/test_faults.py covers for
    the ends that do send something (a chain step, a parent's resume)."""
    assert settings.redis_url
    own = bench.bench_settings(settings.redis_url.rsplit("/", 1)[0] + "/7")
    coord = Coordinator(own)
    coord.client.flushdb()
    # Three workers, not replaced: the two kills leave one.
    fleet = bench.Fleet(own, 3, tmp_path, replace=False)
    try:
        for index, moment in enumerate(["start", "before-end"]):
            result = bench.one_round(coord, fleet, index, moment, DONE_BOUND_S, bench.CHILD_MS)
            where = f"round {index} ({moment})"
            assert result.killed, f"{where}: {result.problems}"
            if not result.completed:
                pytest.fail(f"{where}: stuck: {bench.diagnose(coord, fleet, result.root_id)}")
            assert result.problems == [], f"{where}: {result.problems}"
            assert result.done_s is not None and result.done_s <= DONE_BOUND_S, f"{where}: {result}"
            assert result.restart_s is not None and result.restart_s <= RESTART_BOUND_S, f"{where}: {result}"
            assert coord.store.records.task_field(result.root_id, "run_seq") == "3", "run again once"
        assert coord.repairs() == {"run-lost": 2}
    finally:
        fleet.stop()
        coord.close()
