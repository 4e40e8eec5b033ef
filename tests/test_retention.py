"""Every key a tree's steps make expires: the step that makes a key gives it its retention.

A key written with no expiry stays in Redis for good, so each lifecycle below ends with every
key of its tree holding a retention (`SUBQ_RESULT_RETENTION_S`). Runs are driven in-process by
the worker's own `run_child` (or a `Run` started and never ended, as a worker killed mid-run
leaves it), on a real Redis, with a queue no worker consumes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coordinator import Coordinator, TaskStatus, writeback
from coordinator.celery_app import make_app
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
