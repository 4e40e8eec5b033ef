"""Every key a tree's steps make expires: the step that makes a key gives it its retention.

A key written with no expiry stays in Redis for good, so each lifecycle below ends with every
key of its tree holding a retention (`SUBQ_RESULT_RETENTION_S`). Runs are driven in-process by
the worker's own `run_child` (or a `Run` started and never ended, as a worker killed mid-run
leaves it), on a real Redis, with a queue no worker consumes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from coordinator import Coordinator, StoreError, TaskStatus, writeback
from coordinator.celery_app import make_app
from coordinator.keeper import RETRY_S, TreeKeeper
from coordinator.local.embedded_redis import local_redis
from coordinator.models import TodoStatus
from coordinator.reconciler import Reconciler
from coordinator.runs import Ended, Run
from tests.helpers import script, scripted_children, usage_step
from workers.runtime.context import Runtime, build_runtime
from workers.runtime.runner import run_child


@pytest.fixture
def runtime(idle_coordinator: Coordinator) -> Iterator[Runtime]:
    rt = build_runtime(idle_coordinator.settings, make_app(idle_coordinator.settings))
    yield rt
    rt.coordinator.close()


def keys_without_retention(coord: Coordinator, root_id: str) -> dict[str, int]:
    """The tree's keys whose time to live is not within the retention (-1: none), by name."""
    retention_s = coord.settings.result_retention_s
    keys = list(coord.client.scan_iter(f"{coord.settings.key_prefix}:{{{root_id}}}:*"))
    assert keys, f"tree {root_id} has no keys"
    ttls = {str(key): int(coord.client.ttl(key)) for key in keys}
    return {key: ttl for key, ttl in ttls.items() if not 0 < ttl <= retention_s}


def test_an_agent_root_that_runs_alone_leaves_every_key_with_a_retention(
    idle_coordinator: Coordinator, runtime: Runtime
) -> None:
    # A root that delegates nothing: its first run makes the tree's live hash and events stream.
    root = idle_coordinator.create_task(script(usage_step()), run=True)
    assert run_child(runtime, root.id).status == TaskStatus.COMPLETED
    assert keys_without_retention(idle_coordinator, root.root_id) == {}


@pytest.mark.parametrize("when", ["a caller root", "an agent root queued", "an agent root mid-run"])
def test_a_cancelled_root_leaves_every_key_with_a_retention(
    idle_coordinator: Coordinator, runtime: Runtime, when: str
) -> None:
    coord = idle_coordinator
    if when == "a caller root":
        root = coord.create_task("Plan the release.", todos="[ ] notes\n[ ] tag")
    else:
        root = coord.create_task(script(usage_step()), run=True)
    if when == "an agent root mid-run":
        # Its run started (its first UI message said) and its worker died before the run's end.
        run = runtime.lifecycle.start(root.id)
        assert isinstance(run, Run), run
        runtime.lifecycle.heartbeat.forget(run)
    assert coord.cancel(root.id, "not needed").status == TaskStatus.CANCELLED
    assert keys_without_retention(coord, root.root_id) == {}


@pytest.mark.parametrize("lapsed_before", ["its start", "its end"])
def test_a_run_that_outlives_its_trees_live_hash_gives_the_hash_a_retention_again(
    idle_coordinator: Coordinator, runtime: Runtime, lapsed_before: str
) -> None:
    """A run longer than the retention sees the tree's live hash lapse; the step that writes it again makes it."""
    coord = idle_coordinator
    parent_id, (first, second) = scripted_children(coord, "Two at once.")
    live = coord.store.keys.live(parent_id)
    if lapsed_before == "its start":
        coord.client.delete(live)
        assert run_child(runtime, first).status == TaskStatus.COMPLETED
    else:
        run = runtime.lifecycle.start(first)
        assert isinstance(run, Run), run
        coord.client.delete(live)
        assert run.end(Ended("completed", summary="a done")).status == TaskStatus.COMPLETED
    assert 0 < coord.client.ttl(live) <= coord.settings.result_retention_s
    assert run_child(runtime, second).status == TaskStatus.COMPLETED
    assert keys_without_retention(coord, parent_id) == {}


def test_a_child_written_back_after_its_trees_stream_lapsed_gives_the_stream_a_retention(
    idle_coordinator: Coordinator, runtime: Runtime
) -> None:
    """The reconciler writes back a child whose stop died before its write-back, long after: the stream it
    writes the child's `child_applied` event to lapsed meanwhile, and that event makes it again. (Its batch
    stays open: a closing child's `batch_done` refreshes the stream anyway.)"""
    coord = idle_coordinator
    parent_id, (first, second, third) = scripted_children(coord, "Three at once.", items="abc")
    assert run_child(runtime, first).status == TaskStatus.COMPLETED
    coord.store.batches.stop_tasks(
        [second], top_status="cancelled", status="cancelled", top_error="cancelled: not needed", error="not needed",
        top_class="Cancelled", error_class="Cancelled",
    )  # fmt: skip
    events = coord.store.keys.events(parent_id)
    coord.client.delete(events)
    writeback.settle_ended(coord.plane, coord.get_task(second))
    assert [fields["type"] for _, fields in coord.client.xrange(events)] == ["child_applied"]
    assert keys_without_retention(coord, parent_id) == {}
    assert run_child(runtime, third).status == TaskStatus.COMPLETED
    assert keys_without_retention(coord, parent_id) == {}


def test_a_child_that_ends_after_its_parents_keys_lapsed_ends_and_makes_none_of_them_again(
    idle_coordinator: Coordinator, runtime: Runtime
) -> None:
    """A batch open longer than a retention: its parent's record, plan, awaited set, batch and batch lines lapse
    before the last child ends. That child's end still ends it (its write-back finds its parent gone and writes
    nothing), and makes none of the lapsed keys again without a retention."""
    coord = idle_coordinator
    parent_id, (first, second) = scripted_children(coord, "Two at once.")
    assert run_child(runtime, first).status == TaskStatus.COMPLETED
    # Everything of the tree lapses but the last child's record (its run's start refreshes it).
    kept = coord.store.keys.task(parent_id, second)
    coord.client.delete(*(k for k in coord.client.scan_iter(match=f"{coord.store.keys.prefix}:{{{parent_id}}}:*")
                          if k != kept))  # fmt: skip
    assert run_child(runtime, second).status == TaskStatus.COMPLETED
    assert coord.get_task(second).status == TaskStatus.COMPLETED
    assert keys_without_retention(coord, parent_id) == {}
    assert not coord.client.exists(coord.store.keys.task(parent_id, parent_id)), "the parent is not made again"


def test_a_chains_step_that_ends_after_its_callers_record_lapsed_ends_and_makes_it_none_again(
    idle_coordinator: Coordinator, runtime: Runtime
) -> None:
    """A caller's record lapses before its batch's keys (none of its batch's steps refreshes it): the chain's
    steps still run and end, and neither the write-back nor the close makes the caller's hash again."""
    coord = idle_coordinator
    parent = coord.create_task("Two in a row.", todos="[ ] a\n[ ] b")
    first, second = coord.delegate(
        parent.id, [{"description": item, "message": script(usage_step())} for item in "ab"], mode="sequential"
    ).child_ids
    coord.client.delete(coord.store.keys.task(parent.id, parent.id))
    assert run_child(runtime, first).status == TaskStatus.COMPLETED
    assert run_child(runtime, second).status == TaskStatus.COMPLETED
    assert keys_without_retention(coord, parent.id) == {}
    assert not coord.client.exists(coord.store.keys.task(parent.id, parent.id)), "the caller is not made again"


def test_a_child_stopped_after_its_batch_lapsed_is_stopped_and_leaves_the_due_list(
    idle_coordinator: Coordinator,
) -> None:
    """A cancel of a child whose batch lapsed (running for longer than a retention) stops it and is done with it:
    there is nothing to write it back to, and neither the cancel nor the reconciler fails on that."""
    coord = idle_coordinator
    parent_id, (first, second) = scripted_children(coord, "Two at once.")
    kept = {coord.store.keys.task(parent_id, child) for child in (first, second)}
    coord.client.delete(*(k for k in coord.client.scan_iter(match=f"{coord.store.keys.prefix}:{{{parent_id}}}:*")
                          if k not in kept))  # fmt: skip
    assert coord.cancel(second, "not needed").status == TaskStatus.CANCELLED
    assert coord.client.zscore(coord.store.keys.due(), second) is None
    coord.store.convergence.watch([second], 0)  # as if the stop had died before it was done
    writeback.settle_ended(coord.plane, coord.get_task(second))  # the reconciler's repair
    assert coord.client.zscore(coord.store.keys.due(), second) is None
    assert keys_without_retention(coord, parent_id) == {}


def lapse_soon(coord: Coordinator, root_id: str, left_ms: int) -> dict[str, int]:
    """Leave each key of the tree that has a retention `left_ms` of it, as if nearly a retention had passed since it
    was last written; the keys left with none, by name, with their time to live (-1)."""
    none: dict[str, int] = {}
    for key in coord.client.scan_iter(match=f"{coord.store.keys.prefix}:{{{root_id}}}:*"):
        if coord.client.pttl(key) > 0:
            coord.client.pexpire(key, left_ms)
        else:
            none[str(key)] = int(coord.client.ttl(key))
    return none


def fresh_keeper(coord: Coordinator, tick_s: float = 2.0, **options: Any) -> TreeKeeper:
    """A keeper whose walk begins anew: where the last leader's stood (`<p>:keeper`) forgotten."""
    coord.client.delete(coord.store.keys.keeper())
    return TreeKeeper(coord.plane, tick_s, **options)


def keep_one_pass(keeper: TreeKeeper) -> int:
    """Every step of one pass of the keeper over the keyspace: how many keys it kept."""
    kept = keeper.step()
    while keeper.in_pass:
        kept += keeper.step()
    return kept


def test_a_tree_in_flight_keeps_its_keys_past_their_retention(idle_coordinator: Coordinator, runtime: Runtime) -> None:
    """A batch open for nearly a retention since its parent's keys were last written: the keeper gives each its
    retention again, the last child's end writes back onto its item and closes the batch. Without the keeper the
    parent's record, todo list and batch lapse first, and that end finds nothing to write back to."""
    coord = idle_coordinator
    retention_s = coord.settings.result_retention_s
    parent_id, (first, second) = scripted_children(coord, "Two at once.")
    assert run_child(runtime, first).status == TaskStatus.COMPLETED
    assert lapse_soon(coord, parent_id, 1500) == {}, "every key of the tree has a retention"

    keeper = fresh_keeper(coord, min_slice_keys=50)
    assert keep_one_pass(keeper) > 0
    time.sleep(2.0)
    assert keys_without_retention(coord, parent_id) == {}, "each key is there, kept for the retention"
    ttls = [coord.client.ttl(k) for k in coord.client.scan_iter(match=f"subqidle:{{{parent_id}}}:*")]
    assert min(ttls) > retention_s - 60

    assert run_child(runtime, second).status == TaskStatus.COMPLETED
    items = coord.get_todos(parent_id)
    assert [item.status for item in items] == [TodoStatus.COMPLETED] * 2
    assert [item.subtask_id for item in items] == [first, second]
    assert all(item.cost_micros > 0 for item in items)
    batch = coord.get_batch(coord.get_task(second).batch_id)
    assert batch.status == "done" and first in batch.result and second in batch.result
    assert keys_without_retention(coord, parent_id) == {}


@pytest.mark.parametrize("settled", ["an agent root ended", "a caller root idle"])
def test_a_settled_tree_is_not_kept(idle_coordinator: Coordinator, runtime: Runtime, settled: str) -> None:
    """A tree whose agent root has ended, or whose caller root is not delegated (a caller's root has no end of its
    own: it waits for its caller), lapses a retention after its last write: the keeper gives none of its keys more."""
    coord = idle_coordinator
    if settled == "an agent root ended":
        root = coord.create_task(script(usage_step()), run=True)
        assert run_child(runtime, root.id).status == TaskStatus.COMPLETED
    else:
        parent_id, children = scripted_children(coord, "Two at once.")
        for child in children:
            assert run_child(runtime, child).status == TaskStatus.COMPLETED
        root = coord.get_task(parent_id)
        assert root.status == TaskStatus.ACTIVE and root.runner == "caller"
    assert lapse_soon(coord, root.root_id, 60_000) == {}
    keep_one_pass(fresh_keeper(coord))
    ttls = [coord.client.ttl(k) for k in coord.client.scan_iter(match=f"subqidle:{{{root.root_id}}}:*")]
    assert ttls and all(0 < ttl <= 60 for ttl in ttls)


def test_a_runs_lease_is_not_kept(idle_coordinator: Coordinator, runtime: Runtime) -> None:
    """A run's lease lapses with its worker's heartbeat, which is how the reconciler finds a dead worker's run: the
    keeper gives it no retention, while the rest of its tree is kept."""
    coord = idle_coordinator
    parent_id, (first, _) = scripted_children(coord, "Two at once.")
    run = runtime.lifecycle.start(first)
    assert isinstance(run, Run), run
    runtime.lifecycle.heartbeat.forget(run)  # its worker died: nothing renews the lease
    lease = coord.store.keys.lease(parent_id, first)
    assert coord.store.keys.root_of_kept(lease) is None
    assert coord.store.keys.root_of_kept(coord.store.keys.task(parent_id, first)) == parent_id
    lapse_soon(coord, parent_id, 5000)
    keep_one_pass(fresh_keeper(coord))
    assert 0 < coord.client.pttl(lease) <= 5000
    assert coord.client.ttl(coord.store.keys.task(parent_id, first)) > coord.settings.result_retention_s - 60


@pytest.fixture
def hour_kept(idle_coordinator: Coordinator) -> Iterator[Coordinator]:
    """The idle coordinator's deployment with a retention of an hour."""
    coord = Coordinator(idle_coordinator.settings.model_copy(update={"result_retention_s": 3600}))
    yield coord
    coord.close()


def test_the_keeper_walks_the_keyspace_a_slice_a_tick_and_a_pass_a_quarter_retention(hour_kept: Coordinator) -> None:
    """A pass is SCAN steps of a slice each, one a tick; the next pass begins a quarter retention after this one
    began; a step long after the last (another process led meanwhile) begins a pass anew."""
    coord = hour_kept
    parent_id, _ = scripted_children(coord, "Two at once.")
    root_record = coord.store.keys.task(parent_id, parent_id)
    now = [1000.0]

    def keeper_pass(keeper: TreeKeeper) -> int:
        steps = 0
        while steps == 0 or keeper.in_pass:
            keeper.step()
            steps += 1
            now[0] += 2.0
        return steps

    keeper = fresh_keeper(coord, min_slice_keys=10, clock=lambda: now[0])
    lapse_soon(coord, parent_id, 5000)
    assert keeper_pass(keeper) > 1, "a pass of a slice of 10 keys takes more than one step"
    assert keys_without_retention(coord, parent_id) == {}
    assert 3540 < coord.client.ttl(root_record) <= 3600

    lapse_soon(coord, parent_id, 5000)
    assert keeper.step() == 0 and not keeper.in_pass, "the next pass is not due yet"
    assert coord.client.ttl(root_record) <= 5
    now[0] = 1000.0 + 900.0  # a quarter of the retention after the last pass began
    keeper_pass(keeper)
    assert 3540 < coord.client.ttl(root_record) <= 3600


def test_a_new_leader_goes_on_with_the_pass_where_the_last_one_left_it(
    hour_kept: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk's cursor is kept in Redis (`<p>:keeper`): the process that takes the lead goes on from it, so a
    fleet whose leader changes every few ticks still ends its passes."""
    coord = hour_kept
    scripted_children(coord, "Two at once.")
    first = fresh_keeper(coord, min_slice_keys=10)
    first.step()
    cursor, _ = coord.store.convergence.keeper_walk()
    assert first.in_pass and cursor != 0
    first.interrupt()  # it lost the lead
    scanned_from: list[int] = []
    tree_keys = coord.store.convergence.tree_keys

    def noted(cursor: int, count: int) -> tuple[int, dict[str, list[str]]]:
        scanned_from.append(cursor)
        return tree_keys(cursor, count)

    monkeypatch.setattr(coord.store.convergence, "tree_keys", noted)
    keep_one_pass(TreeKeeper(coord.plane, 2.0, min_slice_keys=10))
    assert scanned_from[0] == cursor, "the new leader's first SCAN goes on from the cursor the last one noted"
    assert coord.store.convergence.keeper_walk()[0] == 0, "and it ends the pass"


def test_a_slice_whose_keep_failed_is_looked_at_again(
    idle_coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis away in the middle of a step: one line in the log, and the step is made again `RETRY_S` later from the
    same cursor, so no tree of that slice waits for the next pass (three quarters of a retention) to be kept. On a
    Redis of its own, the tree's keys are all in the pass's first SCAN call, which was the whole pass."""
    with local_redis() as url:
        coord = Coordinator(idle_coordinator.settings.model_copy(update={"redis_url": url}))
        try:
            parent_id, _ = scripted_children(coord, "Two at once.")
            lapse_soon(coord, parent_id, 5000)
            now = [time.time()]
            keeper = TreeKeeper(coord.plane, 2.0, clock=lambda: now[0])
            keep = coord.store.convergence.keep_trees

            def away(by_root: Mapping[str, Sequence[str]], floor_s: float) -> int:
                raise StoreError("Redis is unreachable: gone for a moment")

            monkeypatch.setattr(coord.store.convergence, "keep_trees", away)
            with caplog.at_level(logging.WARNING, logger="coordinator.keeper"):
                assert keeper.step() == 0
            assert [r.getMessage() for r in caplog.records] == [
                "subq reconciler: keeping the trees in flight failed (Redis is unreachable: gone for a moment); it is "
                f"tried again in {RETRY_S:.0f} s"
            ]
            monkeypatch.setattr(coord.store.convergence, "keep_trees", keep)
            assert keeper.step() == 0, "not before the wait"
            now[0] += RETRY_S
            assert keeper.step() > 0
            assert (
                coord.client.ttl(coord.store.keys.task(parent_id, parent_id)) > coord.settings.result_retention_s - 60
            )
        finally:
            coord.close()


def test_the_reconcilers_tick_keeps_the_trees_in_flight(idle_coordinator: Coordinator) -> None:
    """The leader's tick steps the keeper: ticks until its pass ends keep a tree in flight."""
    coord = idle_coordinator
    parent_id, _ = scripted_children(coord, "Two at once.")
    lapse_soon(coord, parent_id, 5000)
    coord.client.delete(coord.store.keys.keeper())  # its walk begins anew
    reconciler = Reconciler(coord, "test")
    for _ in range(1000):
        assert reconciler.tick() is not None, "it leads"
        if not reconciler.keeper.in_pass:
            break
    ttls = [coord.client.ttl(k) for k in coord.client.scan_iter(match=f"subqidle:{{{parent_id}}}:*")]
    assert min(ttls) > coord.settings.result_retention_s - 60
