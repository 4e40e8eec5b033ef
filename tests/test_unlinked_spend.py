"""Unlinked spend: a child whose plan row was rewritten away still shows its cost, as the parent's unlinked spend.

Always, for every task: Σ item figures + unlinked figures == total − own
(docs/architecture.md, Money and tokens). These tests build the trees in a real Redis and write
the children back through the real write-back (`apply_children.lua`).
"""

from __future__ import annotations

from coordinator import Coordinator, TaskRecord, Usage
from coordinator.celery_app import make_app
from coordinator.models import Spend
from tests.agents import reply, subtask
from tests.helpers import Transport
from workers.runtime.context import build_runtime


def spend(coord: Coordinator, task_id: str, cost_micros: int, tokens_in: int) -> None:
    coord.store.runs.record_usage(task_id, f"test:{task_id}", Usage(tokens_in=tokens_in), cost_micros, "test")


def finish(coord: Coordinator, task_id: str, batch_id: str) -> None:
    coord.store.runs.finish_task(task_id, "completed", "done")
    build_runtime(coord.settings, make_app(coord.settings)).lifecycle.settle_batch(batch_id)


def assert_plan_adds_up(coord: Coordinator, task_id: str) -> TaskRecord:
    record = coord.get_task(task_id)
    items = coord.store.records.get_todos(task_id)
    own_tokens = record.tokens_in + record.tokens_out
    assert (
        sum(i.cost_micros for i in items) + record.unlinked_cost_micros == record.total_cost_micros - record.cost_micros
    )
    assert sum(i.tokens for i in items) + record.unlinked_tokens == record.total_tokens - own_tokens
    return record


def test_a_child_whose_row_was_rewritten_away_is_unlinked_spend(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    parent = coord.create_task("p", todos="[ ] A\n[ ] B")
    a, b = coord.get_todos(parent.id)
    batch = coord.delegate(parent.id, [subtask("A", reply("a"), todo_id=a.id), subtask("B", reply("b"), todo_id=b.id)])
    c1, c2 = batch.child_ids
    spend(coord, parent.id, 5, 50)
    coord.update_todos(parent.id, "[ ] B")  # A's row is gone and B keeps its own child: no row for c1
    spend(coord, c1, 700, 7000)
    spend(coord, c2, 300, 3000)
    finish(coord, c1, batch.id)
    finish(coord, c2, batch.id)

    record = assert_plan_adds_up(coord, parent.id)
    assert (record.unlinked_cost_micros, record.unlinked_tokens) == (700, 7000)
    (item,) = coord.store.records.get_todos(parent.id)
    assert (item.subtask_id, item.cost_micros) == (c2, 300)
    assert coord.get_task(parent.id).model_dump()["unlinked_cost_micros"] == 700, "the API shows it"


def test_a_child_applied_twice_adds_to_unlinked_spend_once(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    parent = coord.create_task("p", todos="[ ] A\n[ ] B")
    a, b = coord.get_todos(parent.id)
    batch = coord.delegate(parent.id, [subtask("A", reply("a"), todo_id=a.id), subtask("B", reply("b"), todo_id=b.id)])
    c1, _ = batch.child_ids
    coord.update_todos(parent.id, "[ ] B")
    spend(coord, c1, 700, 7000)
    coord.store.runs.finish_task(c1, "completed", "done")
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    for _ in range(3):  # a redelivered callback, the reconciler, the run's own end
        lifecycle.settle_batch(batch.id)
    assert coord.get_task(parent.id).unlinked_cost_micros == 700


def test_the_cli_shows_unlinked_spend_under_the_plan(idle_coordinator: Coordinator, transport: Transport) -> None:
    from tests.test_cli import cli

    coord = idle_coordinator
    parent = coord.create_task("p", todos="[ ] A\n[ ] B")
    a, b = coord.get_todos(parent.id)
    batch = coord.delegate(parent.id, [subtask("A", reply("a"), todo_id=a.id), subtask("B", reply("b"), todo_id=b.id)])
    coord.update_todos(parent.id, "[ ] B")
    spend(coord, batch.child_ids[0], 700, 7000)
    finish(coord, batch.child_ids[0], batch.id)
    env = transport.env(coord.settings)
    tree = cli("tree", parent.id, env=env)
    assert tree.returncode == 0, tree.stderr
    assert "unlinked spend (no row of the plan)      7000 tokens" in tree.stdout
    todos = cli("todos", parent.id, env=env)
    assert todos.stdout.splitlines()[-1] == "unlinked spend (no row of the plan): 7000 tokens, $0.000700"
    status = cli("status", parent.id, env=env)
    assert "  unlinked: 7000 tokens  $0.000700" in status.stdout


def test_a_finished_childs_row_rewritten_away_moves_its_figures_to_unlinked_spend_at_once(
    idle_coordinator: Coordinator,
) -> None:
    coord = idle_coordinator
    parent = coord.create_task("p", todos="[ ] A\n[ ] B")
    a, b = coord.get_todos(parent.id)
    batch = coord.delegate(parent.id, [subtask("A", reply("a"), todo_id=a.id), subtask("B", reply("b"), todo_id=b.id)])
    c1, c2 = batch.child_ids
    spend(coord, c1, 700, 7000)
    finish(coord, c1, batch.id)
    assert coord.store.records.get_todos(parent.id)[0].cost_micros == 700
    coord.update_todos(parent.id, "[ ] B")  # c1's row, with its figures, has no row to go to
    record = assert_plan_adds_up(coord, parent.id)
    assert record.unlinked_cost_micros == 700
    spend(coord, c2, 300, 3000)
    finish(coord, c2, batch.id)
    assert assert_plan_adds_up(coord, parent.id).unlinked_cost_micros == 700, "counted once"


def test_a_retried_row_shows_every_childs_spend(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    parent = coord.create_task("p", todos="[ ] A")
    (a,) = coord.get_todos(parent.id)
    first = coord.delegate(parent.id, [subtask("A", reply("a"), todo_id=a.id)])
    spend(coord, first.child_ids[0], 700, 7000)
    coord.store.runs.finish_task(first.child_ids[0], "failed", error="try again")
    build_runtime(coord.settings, make_app(coord.settings)).lifecycle.settle_batch(first.id)
    second = coord.delegate(parent.id, [subtask("A again", reply("a"), todo_id=a.id)])
    (item,) = coord.get_todos(parent.id)  # live: the second child has spent nothing yet
    assert (item.subtask_id, item.prior_subtask_ids, item.cost_micros) == (
        second.child_ids[0],
        (first.child_ids[0],),
        700,
    )
    spend(coord, second.child_ids[0], 300, 3000)
    assert coord.get_todos(parent.id)[0].cost_micros == 1000, "live: prior plus the running child's"
    finish(coord, second.child_ids[0], second.id)
    (item,) = coord.store.records.get_todos(parent.id)
    assert (item.cost_micros, item.tokens, item.status.value) == (1000, 10_000, "completed")
    assert_plan_adds_up(coord, parent.id)


def test_a_rewrite_that_drops_a_linked_row_moves_its_child_to_the_next_free_row(idle_coordinator: Coordinator) -> None:
    """Old [A -> c1, B], rewritten to [ ] B: c1's figures show on B, not on no row."""
    coord = idle_coordinator
    parent = coord.create_task("p", todos="[ ] A\n[ ] B")
    a, _ = coord.get_todos(parent.id)
    batch = coord.delegate(parent.id, [subtask("A", reply("a"), todo_id=a.id)])
    (c1,) = batch.child_ids
    coord.update_todos(parent.id, "[ ] B")
    spend(coord, c1, 700, 7000)
    finish(coord, c1, batch.id)
    (row,) = coord.store.records.get_todos(parent.id)
    assert (row.content, row.subtask_id, row.cost_micros, row.tokens) == ("B", c1, 700, 7000)
    assert assert_plan_adds_up(coord, parent.id).unlinked_cost_micros == 0


def test_spend_recorded_after_a_stop_keeps_the_plan_adding_up(idle_coordinator: Coordinator) -> None:
    """A run's response recorded after its task was stopped (record_late_spend.lua): a child written back already
    moves its parent's unlinked spend or its row, a child not written back yet is read whole when it is; twice
    is once."""
    coord = idle_coordinator
    parent = coord.create_task("p", todos="[ ] A\n[ ] B")
    a, b = coord.get_todos(parent.id)
    batch = coord.delegate(parent.id, [subtask("A", reply("a"), todo_id=a.id), subtask("B", reply("b"), todo_id=b.id)])
    c1, c2 = batch.child_ids
    coord.update_todos(parent.id, "[ ] B")  # c1 is on no row: its spend is the parent's unlinked spend
    spend(coord, c1, 700, 7000)
    coord.cancel(c1, "stopped")  # written back at once, with the 700 it had
    coord.cancel(c2, "stopped")
    held = Spend(request_key="1:2", usage=Usage(tokens_in=40, tokens_out=2), cost_micros=90, cost_source="test")
    for _ in range(2):
        assert coord.store.runs.record_late_spend(coord.get_task(c1), [held]).recorded in (0, 1)
        coord.store.runs.record_late_spend(coord.get_task(c2), [held])
    record = assert_plan_adds_up(coord, parent.id)
    assert (record.unlinked_cost_micros, record.unlinked_tokens) == (790, 7042)
    (item,) = coord.store.records.get_todos(parent.id)
    assert (item.subtask_id, item.cost_micros, item.tokens) == (c2, 90, 42)
    assert record.total_cost_micros == 880
    assert (coord.get_task(c1).requests, coord.get_task(c2).requests) == (2, 1), "the held one recorded once each"
    assert coord.store.runs.record_late_spend(coord.get_task(c2), [held]).recorded == 0


def test_spend_recorded_after_a_stop_on_a_child_not_written_back_yet_is_read_by_its_write_back(
    idle_coordinator: Coordinator,
) -> None:
    coord = idle_coordinator
    parent = coord.create_task("p", todos="[ ] A")
    (a,) = coord.get_todos(parent.id)
    batch = coord.delegate(parent.id, [subtask("A", reply("a"), todo_id=a.id)])
    (c1,) = batch.child_ids
    coord.store.runs.finish_task(c1, "cancelled", "stopped")  # ended, its write-back still to come
    held = Spend(request_key="1:1", usage=Usage(tokens_in=10), cost_micros=55, cost_source="test")
    assert coord.store.runs.record_late_spend(coord.get_task(c1), [held]).recorded == 1
    build_runtime(coord.settings, make_app(coord.settings)).lifecycle.settle_batch(batch.id)
    record = assert_plan_adds_up(coord, parent.id)
    assert (coord.get_todos(parent.id)[0].cost_micros, record.total_cost_micros) == (55, 55)
