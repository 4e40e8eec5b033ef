"""The run-lifecycle seam (coordinator/runs.py), driven in-process on a real Redis.

A run is driven by the same `run_child` the worker runs, on a queue no worker
consumes, so what the seam did in which order can be checked step by step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from coordinator import Coordinator, StoreError, TaskStatus, Usage, admission, budgets
from coordinator.celery_app import make_app
from coordinator.models import Spend
from coordinator.plane import Plane
from coordinator.runs import Ended, LeaseLost, Run
from tests.helpers import script, scripted_children, usage_step
from workers import observe
from workers.runtime import runner
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child


@pytest.fixture
def limited(idle_coordinator: Coordinator) -> Iterator[Coordinator]:
    """The idle coordinator with one running child per parent."""
    coord = Coordinator(idle_coordinator.settings.model_copy(update={"max_running_per_parent": 1}))
    yield coord
    coord.close()


def test_a_run_frees_its_slot_only_after_its_outcome_is_recorded(
    limited: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A per-parent limit of 1 must never show 2 running: the next child is admitted when
    the slot frees (in the run's end, end_run.lua), so the finished one must already be terminal by then."""
    parent_id, (first, second) = scripted_children(limited, "two children, one at a time")
    seen_at_admission: list[tuple[list[str], str]] = []
    real_started_again = admission.started_again

    def spy(plane: Plane, admitted: Sequence[str]) -> None:
        seen_at_admission.append((list(admitted), plane.store.records.status_of(first)[0]))
        real_started_again(plane, admitted)

    monkeypatch.setattr(admission, "started_again", spy)
    rt = build_runtime(limited.settings, make_app(limited.settings))

    run = rt.lifecycle.start(first)
    assert isinstance(run, Run), run
    assert run_child(rt, second).status == "queued", "the one slot is the first child's"
    assert limited.snapshot(parent_id)[second].state == "queued"
    assert run.end(Ended("completed", summary="a done")).status == "completed"

    assert seen_at_admission == [([second], TaskStatus.COMPLETED.value)]
    assert limited.store.runs.in_flight(parent_id)["running"] == 1, "the second child holds the slot now"
    assert run_child(rt, second).status == "completed"
    assert limited.store.runs.in_flight(parent_id)["running"] == 0
    assert limited.get_task(parent_id).status == TaskStatus.ACTIVE, "the last child's write-back closed the batch"


def _held(run: Run, cost_micros: int) -> Spend:
    """A response the run holds for its next step (as one whose tool calls are all idempotent is held)."""
    spend = Spend(request_key=f"{run.run_seq}:9", usage=Usage(tokens_in=100, tokens_out=10), cost_micros=cost_micros,
                  cost_source="test")  # fmt: skip
    run.writes.usage.append(spend)
    return spend


@pytest.mark.parametrize("found_by", ["its step", "its heartbeat", "its end"])
def test_a_response_held_by_a_run_whose_lease_lapsed_is_recorded_once(
    idle_coordinator: Coordinator, found_by: str
) -> None:
    """Redis away longer than the lease's lapse (or a stalled worker): the run's next step finds the lease gone, or
    its heartbeat did first (the run is fenced), or its last step, its end, does. The response it held was billed;
    it was dropped with the step's writes, and the task never showed it. Its heartbeat now records it, once, under
    the run's own request key."""
    coord = idle_coordinator
    rt = build_runtime(coord.settings, make_app(coord.settings))
    task = coord.create_task(script(usage_step()), run=True)
    run = rt.lifecycle.start(task.id)
    assert isinstance(run, Run), run
    spend = _held(run, 500_000)
    coord.client.delete(coord.store.keys.lease(task.id, task.id))  # it lapsed
    if found_by == "its heartbeat":
        run.fenced = True
    with pytest.raises(LeaseLost):
        if found_by == "its end":
            run.end(Ended("completed", summary="done"))
        else:
            run.flush() if found_by == "its step" else run.check_stop()
    run.lost()
    owed = rt.lifecycle.heartbeat.late_spends
    assert owed, "the heartbeat owes it"
    owed.record(coord.plane)
    record = coord.get_task(task.id)
    assert (record.cost_micros, record.usage.tokens_in) == (500_000, spend.usage.tokens_in)
    owed.owe(record, [spend], refused=False)  # the same response again (a beat's reply lost): written once
    owed.record(coord.plane)
    assert coord.get_task(task.id).cost_micros == 500_000


def test_a_run_whose_hand_back_redis_failed_is_abandoned(
    idle_coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker shutting down hands its run back; Redis failed that step. The error was raised inside the runner's
    `except HandBack`, past its other handlers: the run was never abandoned, and the heartbeat renewed the lease
    of a run that had ended until the process exited. Now its lease is freed and its held spend owed."""
    coord = idle_coordinator
    rt = build_runtime(coord.settings, make_app(coord.settings))
    task = coord.create_task(script(usage_step()), run=True)
    run = rt.lifecycle.start(task.id)
    assert isinstance(run, Run), run
    _held(run, 7_000)

    def refused(**_: object) -> None:
        raise StoreError("Redis refused a subq command: the test's")

    monkeypatch.setattr(run, "flush", refused)
    with pytest.raises(StoreError):
        runner.hand_back(run)
    assert not coord.client.exists(coord.store.keys.lease(task.id, task.id)), "its lease was freed"
    owed = rt.lifecycle.heartbeat.late_spends
    assert owed, "the spend it held is owed"
    owed.record(coord.plane)
    assert coord.get_task(task.id).cost_micros == 7_000


def test_a_final_response_held_past_a_cancel_is_recorded_by_the_runs_end(idle_coordinator: Coordinator) -> None:
    """The run's last response has no tool call: only its end writes it. A cancel landed first: the end's step
    refused the spend (the task had ended), and the run records it after, on its item too."""
    coord = idle_coordinator
    parent_id, (child, _) = scripted_children(coord, "a cancel before the end's step")
    rt = build_runtime(coord.settings, make_app(coord.settings))
    run = rt.lifecycle.start(child)
    assert isinstance(run, Run), run
    _held(run, 7_000)
    coord.cancel(child, "not needed")
    result = run.end(Ended("completed", summary="too late"))
    assert (result.status, result.cost_micros, result.usage.tokens_in) == ("cancelled", 7_000, 100), "its result too"
    record = coord.get_task(child)
    assert (record.cost_micros, record.tokens_in) == (7_000, 100), "the provider billed it"
    item = next(i for i in coord.get_todos(parent_id) if i.subtask_id == child)
    assert item.cost_micros == 7_000
    assert coord.get_task(parent_id).total_cost_micros == 7_000


def test_a_final_response_held_past_a_budget_stop_is_recorded_and_the_run_stops(
    idle_coordinator: Coordinator,
) -> None:
    """A sibling's spend took the parent's budget: the parent's subtree was stopped before this run's end. The
    end's step refuses the spend and answers `exhausted` (its own completion is not taken over a budget
    reached): the run records the spend, then ends as stopped. Before, the spend was dropped with its writes."""
    coord = idle_coordinator
    parent = coord.create_task("budgeted", todos="[ ] a\n[ ] b", budget_usd="0.01")
    batch = coord.delegate(parent.id, [{"description": d, "message": script(usage_step())} for d in "ab"])
    child, sibling = batch.child_ids
    rt = build_runtime(coord.settings, make_app(coord.settings))
    run = rt.lifecycle.start(child)
    assert isinstance(run, Run), run
    _held(run, 3_000)
    coord.store.runs.record_usage(sibling, "1:1", Usage(tokens_in=5), 10_000, "test")  # the budget is spent
    budgets.stop(coord.plane, parent.id)
    assert TaskStatus(coord.store.records.status_of(child)[0]).terminal
    run.end(Ended("completed", summary="too late"))
    assert coord.get_task(child).cost_micros == 3_000
    assert coord.get_task(parent.id).total_cost_micros == 13_000


def _budgeted_pair(coord: Coordinator) -> tuple[str, str, str]:
    """A parent with a budget of $0.01 (10,000 micro-USD) and two children that have spent nothing."""
    parent = coord.create_task("budgeted", todos="[ ] a\n[ ] b", budget_usd="0.01")
    batch = coord.delegate(parent.id, [{"description": d, "message": script(usage_step())} for d in "ab"])
    child, sibling = batch.child_ids
    return parent.id, child, sibling


def _budget_stops(coord: Coordinator, task_id: str) -> float:
    """The worker's count of budget stops (subq_budget_stops_total) for the profile of `task_id`."""
    labels = {"profile": coord.get_task(task_id).profile}
    return observe.REGISTRY.get_sample_value("subq_budget_stops_total", labels) or 0.0


def _stopped_on_its_budget(coord: Coordinator, parent_id: str, sibling: str) -> None:
    parent = coord.get_task(parent_id)
    assert (parent.status, parent.error_class) == (TaskStatus.FAILED, "BudgetExhausted"), parent.error
    assert "$0.012000" in (parent.error or ""), "the stop reports the figures, the late spend's among them"
    assert coord.get_task(sibling).status == TaskStatus.CANCELLED, "the sibling is stopped with the subtree"


def test_late_spend_that_takes_a_budget_over_stops_the_subtree_at_once(idle_coordinator: Coordinator) -> None:
    """A child cancelled alone held a response of $0.012; its end records it after the cancel (late spend), which
    takes its parent's subtree over the parent's $0.01. The subtree is stopped by that record, as a step that
    crossed the budget would stop it: before, nobody stopped it until the sibling's run took its next step, and
    a sibling in the middle of a long request went on paying for it."""
    coord = idle_coordinator
    parent_id, child, sibling = _budgeted_pair(coord)
    rt = build_runtime(coord.settings, make_app(coord.settings))
    run, other = rt.lifecycle.start(child), rt.lifecycle.start(sibling)
    assert isinstance(run, Run) and isinstance(other, Run), (run, other)
    _held(run, 12_000)
    coord.cancel(child, "not needed")
    assert coord.get_task(parent_id).total_cost_micros == 0, "nothing recorded yet: the budget still holds"
    stops_before = _budget_stops(coord, child)
    run.end(Ended("completed", summary="too late"))
    assert coord.get_task(child).cost_micros == 12_000, "the provider billed it"
    _stopped_on_its_budget(coord, parent_id, sibling)  # (its stop watch cancels the request the sibling's run is in)
    assert _budget_stops(coord, child) == stops_before + 1, "the worker counts the stop its late spend made"


def test_late_spend_stops_a_reached_budgets_subtree_only_while_its_top_has_not_ended(
    idle_coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Most late spend is that of runs a budget's own stop cancelled: its record names the holder that stop failed
    already, and a stop again would read the whole subtree to stop nothing (`budgets.stop_late`)."""
    coord = idle_coordinator
    parent_id, _, _ = _budgeted_pair(coord)
    stops: list[str] = []
    monkeypatch.setattr(budgets, "stop", lambda plane, holder_id, **_: stops.append(holder_id))
    assert not budgets.stop_late(coord.plane, None)
    assert budgets.stop_late(coord.plane, parent_id), "said stopped, for its caller to count"
    assert stops == [parent_id], "a holder that has not ended is stopped"
    coord.cancel(parent_id, "done with it")
    assert not budgets.stop_late(coord.plane, parent_id)
    assert stops == [parent_id], "one that has ended is not stopped again"


def test_late_spend_a_heartbeat_records_stops_the_subtree_whose_budget_it_takes_over(
    idle_coordinator: Coordinator,
) -> None:
    """The same spend, refused by Redis when its run tried, and kept by the worker's heartbeat (LateSpends) until
    Redis takes it: the beat that records it stops the subtree it took over the budget."""
    coord = idle_coordinator
    parent_id, child, sibling = _budgeted_pair(coord)
    coord.cancel(child, "not needed")
    spend = Spend(request_key="1:9", usage=Usage(tokens_in=100, tokens_out=10), cost_micros=12_000,
                  cost_source="test")  # fmt: skip
    owed = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.heartbeat.late_spends
    owed.owe(coord.get_task(child), [spend], refused=True)
    assert coord.get_task(sibling).status == TaskStatus.ACTIVE
    stops_before = _budget_stops(coord, child)
    owed.record(coord.plane)
    assert not owed, "recorded, so no longer owed"
    assert coord.get_task(parent_id).total_cost_micros == 12_000
    _stopped_on_its_budget(coord, parent_id, sibling)
    assert _budget_stops(coord, child) == stops_before + 1, "the worker counts the stop its heartbeat's record made"
