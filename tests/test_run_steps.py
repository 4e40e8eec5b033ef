"""A run's hot path in three script calls (start_run, flush_run, end_run), on a real Redis.

Runs are driven in-process by the same `run_child` the worker runs, on a queue no
worker consumes, so each step's effect (and its cost in Redis requests) is checked
exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator import Coordinator, TaskStatus
from coordinator.celery_app import make_app
from coordinator.runs import Ended, Run, RunStopped
from tests.agents import STEP_COST_MICROS, agent, reply
from tests.helpers import requests_sent, script, scripted_children, snapshot_of, usage_step
from workers.runtime import runner
from workers.runtime.agent_loop import StopWatch
from workers.runtime.context import Runtime, build_runtime
from workers.runtime.runner import run_child


class _Unpolled(StopWatch):
    """A stop watch that makes no look of its own: its reads are not the steps' under test."""

    def poll(self) -> None:
        return None


@pytest.fixture
def rt(idle_coordinator: Coordinator) -> Iterator[Runtime]:
    runtime = build_runtime(idle_coordinator.settings, make_app(idle_coordinator.settings))
    yield runtime
    runtime.coordinator.close()


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every request a child's run writes to Redis, by its first command: the test's own thread (the pool
    thread's part of the run) and the agents' loop."""
    return requests_sent(monkeypatch, "subq-agents")


def test_a_child_that_answers_at_once_costs_its_worker_two_requests(
    idle_coordinator: Coordinator, rt: Runtime, requests: list[str]
) -> None:
    coord = idle_coordinator
    parent_id, (warm_up, child_id) = scripted_children(coord, "two children")
    run_child(rt, warm_up)  # connects and loads the scripts, once per process
    # The steps' requests alone: the stop watch's poll (a GET every CANCEL_POLL_S while a run is watched)
    # would come in too on a loaded host, where the child takes longer than a poll.
    object.__setattr__(rt, "stop_watch", _Unpolled(rt.lifecycle))
    requests.clear()

    result = run_child(rt, child_id)

    assert result.status == "completed"
    # The start is its script and the reads of the record and the conversation, in one MULTI/EXEC.
    assert Counter(requests) == {"MULTI": 1, "EVALSHA": 1}, f"start and end only, not {requests}"
    # ... and those two did everything: the run ended, its item is written, the batch closed.
    item = coord.get_todos(parent_id)[1]
    assert (item.status.value, item.cost_micros) == ("completed", result.cost_micros)
    assert coord.get_task(parent_id).status == TaskStatus.ACTIVE
    assert coord.store.runs.in_flight(parent_id) == {"running": 0, "admission": 0, "awaiting": 0, "leases": 0,
                                                     "watched": 0}  # fmt: skip
    says = [m["say"] for m in coord.messages(child_id)]
    assert says[0] == "task" and says[-1] == "completion_result"


def test_the_last_of_three_children_closes_the_batch_once_with_every_line(
    idle_coordinator: Coordinator, rt: Runtime
) -> None:
    coord = idle_coordinator
    parent = coord.create_task("three children", todos="[ ] a\n[ ] b\n[ ] c")
    specs = [
        {"description": "first", "message": agent(reply("one"))},
        {"description": "second", "message": agent({"fail": "no way"})},
        {"description": "third", "message": agent(reply("three\n  lines"))},
    ]
    batch = coord.delegate(parent.id, specs)
    # All three start before any ends, so each end sees the others' state as it is then.
    runs = [rt.lifecycle.start(child_id) for child_id in batch.child_ids]
    assert all(isinstance(run, Run) for run in runs)
    ended = [
        Ended("completed", summary="one"),
        Ended("failed", error="no way", error_class="ModelRequestRejectedError"),
        Ended("completed", summary="three\n  lines"),
    ]
    for run, outcome in zip(reversed(runs), reversed(ended), strict=True):  # the last one ends first
        assert isinstance(run, Run)
        run.end(outcome)

    record = coord.get_task(parent.id)
    assert record.status == TaskStatus.ACTIVE and record.awaiting_ids == []
    closes = [m for m in coord.messages(parent.id) if m["say"] == "subtask_result"]
    assert len(closes) == 1, "closed exactly once"
    lines = closes[0]["text"].splitlines()
    items = coord.get_todos(parent.id)
    assert lines[0] == "Subtask results (parallel, 2 of 3 completed):"
    assert (
        lines[1] == f"1. [completed] first (task {batch.child_ids[0]}, todo {items[0].id}): one (0 tokens, $0.000000)"
    )
    assert lines[2].startswith(f"2. [failed] second (task {batch.child_ids[1]}, todo {items[1].id}): ")
    assert lines[2].endswith("ModelRequestRejectedError: no way (0 tokens, $0.000000)")
    assert lines[3].endswith("three lines (0 tokens, $0.000000)"), "a summary is one line in the result"
    assert coord.get_batch(batch.id).result == closes[0]["text"]


def test_a_redelivered_end_changes_nothing(idle_coordinator: Coordinator, rt: Runtime) -> None:
    coord = idle_coordinator
    parent = coord.create_task("one child", todos="[ ] a")
    (child_id,) = coord.delegate(parent.id, [{"description": "a", "message": agent(reply("done"))}]).child_ids
    assert run_child(rt, child_id).status == "completed"
    before = snapshot_of(coord, parent.root_id)

    again = run_child(rt, child_id)  # the message delivered a second time

    assert again.status == "completed" and again.cost_micros == STEP_COST_MICROS
    assert snapshot_of(coord, parent.root_id) == before


def test_a_response_that_reaches_the_parents_budget_stops_the_subtree(
    idle_coordinator: Coordinator, rt: Runtime
) -> None:
    coord = idle_coordinator
    parent = coord.create_task("a tight budget", todos="[ ] a\n[ ] b", budget_usd=STEP_COST_MICROS / 1_000_000)
    first, second = coord.delegate(
        parent.id, [{"description": d, "message": agent(reply(f"{d} done"))} for d in "ab"]
    ).child_ids

    result = run_child(rt, first)

    assert result.status == "cancelled", "the response that spent the budget stops its own run too"
    assert result.cost_micros == STEP_COST_MICROS, "and what it spent is recorded"
    assert coord.get_task(second).status == TaskStatus.CANCELLED
    assert coord.get_task(parent.id).status == TaskStatus.FAILED
    assert coord.get_task(parent.id).total_cost_micros == STEP_COST_MICROS


def test_a_tool_of_a_run_whose_task_was_stopped_writes_nothing(idle_coordinator: Coordinator, rt: Runtime) -> None:
    coord = idle_coordinator
    parent = coord.create_task("one child", todos="[ ] a")
    (child_id,) = coord.delegate(parent.id, [{"description": "a", "message": script(usage_step())}]).child_ids
    run = rt.lifecycle.start(child_id)
    assert isinstance(run, Run)
    coord.cancel(child_id, reason="stopped from outside")
    before = snapshot_of(coord, parent.root_id)

    with pytest.raises(RunStopped):
        run.plan.update_todos("[ ] written after the stop")

    assert snapshot_of(coord, parent.root_id) == before, "the plan of a stopped task is not written"
    assert run.stopped(None).status == "cancelled"
    run.end(run.stopped(None))
    assert "stopped from outside" in coord.get_task(child_id).error


def test_a_run_past_its_time_limit_fails_with_the_limit_named(idle_coordinator: Coordinator) -> None:
    # The threads pool does not enforce Celery's time limit: the runner does (workers/runtime/runner.py).
    settings = idle_coordinator.settings.model_copy(update={"task_time_limit_s": 1})
    runtime = build_runtime(settings, make_app(settings))
    try:
        parent = idle_coordinator.create_task("one slow child", todos="[ ] a")
        slow = {**usage_step(), "latency_ms": 30_000}
        (child_id,) = idle_coordinator.delegate(parent.id, [{"description": "a", "message": script(slow)}]).child_ids

        result = run_child(runtime, child_id)

        assert (result.status, result.error_class) == ("failed", "TimeLimit"), result
        assert "SUBQ_TASK_TIME_LIMIT_S=1" in (result.error or "")
        assert idle_coordinator.get_task(child_id).status == TaskStatus.FAILED
    finally:
        runtime.coordinator.close()


def test_a_stopped_run_whose_unwinding_outlasts_the_time_limit_ends_at_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The time limit covers a stopped run's unwinding too (a tool's cleanup that awaits): the worker's thread is
    not held past it, as under asyncio.wait_for."""
    cleanup_s, limit_s = 30.0, 1.0

    async def slow_to_stop(*_: Any) -> Any:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(cleanup_s)  # ignores the cancel for a while
            raise

    class Watch:
        def watch(self, _run: Any) -> asyncio.Future[None]:
            stop = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(0.1, stop.set_result, None)  # the task is stopped at once
            return stop

        def forget(self, _run: Any) -> None:
            pass

    monkeypatch.setattr(runner, "_drive", slow_to_stop)
    rt = SimpleNamespace(stop_watch=Watch())
    started = time.monotonic()
    with pytest.raises(runner.StopRun):
        asyncio.run(runner._run_agent(rt, SimpleNamespace(), None, None, limit_s))  # type: ignore[arg-type]
    assert time.monotonic() - started < cleanup_s / 3, "held past the limit by the agent's unwinding"
