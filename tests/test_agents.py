"""Agents that plan, delegate, wait without a worker and resume: real Redis, real workers.

Every scripted request reports the same usage (tests/agents.py: 13500 tokens,
21000 micro-USD priced as anthropic claude-sonnet-4-5), so every figure below
is a count of requests times that.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import Coordinator, Settings, TaskStatus, TodoStatus
from coordinator.export import FILE_NAMES
from coordinator.models import TaskRecord
from tests.agents import STEP_COST_MICROS, STEP_TOKENS, agent, call, calls, reply, subtask, tree_root
from tests.conftest import dedicated_fleet
from workers.runtime.tools import NEW_TASK_NOT_LAST

WAIT_S = 90


@pytest.fixture(scope="module")
def solo(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """One worker process with one slot: a parent that held its slot while waiting would deadlock."""
    with dedicated_fleet(settings, tmp_path_factory.mktemp("solo"), 1, queue="subq-solo", worker_concurrency=1) as (
        coord,
        _,
    ):
        yield coord


def _subtree(coord: Coordinator, task_id: str) -> list[TaskRecord]:
    record = coord.get_task(task_id)
    return [record, *(t for c in record.child_ids for t in _subtree(coord, c))]


def test_an_agent_tree_completes_on_one_worker_slot_with_exact_figures(solo: Coordinator) -> None:
    root = solo.create_task(tree_root(), run=True)
    done = solo.wait(root.id, WAIT_S)

    assert done.status == TaskStatus.COMPLETED, done.error
    assert done.summary == "Report ready"
    a, b, c = (solo.get_task(i) for i in done.child_ids)
    todos = solo.get_todos(root.id)
    assert [t.content for t in todos] == ["A", "B", "C"]
    assert all(t.status == TodoStatus.COMPLETED for t in todos)
    assert [t.subtask_id for t in todos] == [a.id, b.id, c.id]
    # Child B made three requests and its two nested children one each.
    assert (todos[1].tokens, todos[1].cost_micros) == (5 * STEP_TOKENS, 5 * STEP_COST_MICROS)
    assert todos[0].cost_micros == todos[2].cost_micros == STEP_COST_MICROS
    b1, b2 = (solo.get_task(i) for i in b.child_ids)
    assert [t.content for t in solo.get_todos(b.id)] == ["B1", "B2"]
    assert [t.subtask_id for t in solo.get_todos(b.id)] == [b1.id, b2.id]
    assert (b1.depth, b1.parent_id, b1.root_id) == (2, b.id, root.id)
    # The root made four requests: plan, fan out, mark done, complete.
    assert done.cost_micros == 4 * STEP_COST_MICROS
    assert done.total_cost_micros == 11 * STEP_COST_MICROS
    for task in _subtree(solo, root.id):
        children = [solo.get_task(i) for i in task.child_ids]
        assert task.total_cost_micros == task.cost_micros + sum(ch.total_cost_micros for ch in children)
        assert task.total_tokens == task.tokens + sum(ch.total_tokens for ch in children)
        history = solo.history_item(task.id)
        assert history.total_cost_micros == task.cost_micros
        assert history.subtree_cost * 1_000_000 == pytest.approx(task.total_cost_micros)
        assert history.subtree_cost_micros == task.total_cost_micros, "exactly"
        assert task.status == TaskStatus.COMPLETED
    # No parent was ever resumed twice: one resume per batch it delegated.
    assert solo.store.records.task_field(root.id, "resumes") == "1"
    assert solo.store.records.task_field(b.id, "resumes") == "2"
    assert [m["say"] for m in solo.messages(b.id)].count("subtask_result") == 2
    # The script carried across every resumption: each request consumed the next step.
    api = solo.messages(root.id, kind="api")
    assert sum(1 for m in api if m["kind"] == "response") == 4


def test_a_child_that_spent_then_failed_keeps_its_spend_up_the_tree(coordinator: Coordinator) -> None:
    failing = subtask(
        "fragile",
        call("update_todo_list", todos="[-] try once"),
        call("update_todo_list", todos="[-] try twice"),
        {"fail": "the provider refused the third request"},
    )
    root = coordinator.create_task(
        agent(call("run_subagents", tasks=[failing, subtask("fine", reply("ok"))]), reply("handled")), run=True
    )
    done = coordinator.wait(root.id, WAIT_S)
    fragile, fine = (coordinator.get_task(i) for i in done.child_ids)
    assert fragile.status == TaskStatus.FAILED and "refused the third request" in fragile.error
    assert fragile.cost_micros == fragile.total_cost_micros == 2 * STEP_COST_MICROS
    item = coordinator.get_todos(root.id)[0]
    assert (item.subtask_id, item.cost_micros) == (fragile.id, 2 * STEP_COST_MICROS)
    assert item.status != TodoStatus.COMPLETED
    assert done.status == TaskStatus.COMPLETED
    # root: fan out + reply; fragile: two requests before the failed one; fine: one.
    assert done.cost_micros == 2 * STEP_COST_MICROS
    assert done.total_cost_micros == done.cost_micros + 2 * STEP_COST_MICROS + STEP_COST_MICROS
    result = next(m for m in coordinator.messages(root.id) if m["say"] == "subtask_result")["text"]
    assert "[failed] fragile" in result and "ModelRequestRejectedError" in result


def _tool_results(coord: Coordinator, task_id: str) -> dict[str, str]:
    """tool name -> content of its result, across the task's conversation."""
    out = {}
    for message in coord.messages(task_id, kind="api"):
        for part in message["parts"]:
            if part.get("part_kind") == "tool-return":
                out[part["tool_name"]] = str(part["content"])
    return out


def test_refusals_go_back_to_the_model_and_change_nothing(coordinator: Coordinator) -> None:
    root = coordinator.create_task(
        agent(
            call("update_todo_list", todos="nothing that parses"),
            call("run_subagents", tasks=[{"description": "x", "message": "y", "profile": "nope"}]),
            call("run_subagents", tasks=[{"description": "x", "message": "y", "todo_id": "missing"}]),
            reply("gave up"),
        ),
        todos="[ ] keep me",
        run=True,
    )
    done = coordinator.wait(root.id, WAIT_S)
    assert done.status == TaskStatus.COMPLETED and done.child_ids == []
    assert [t.content for t in coordinator.get_todos(root.id)] == ["keep me"]
    texts = [part["content"] for m in coordinator.messages(root.id, kind="api") for part in m["parts"]
             if part.get("part_kind") == "tool-return"]  # fmt: skip
    assert any("The todo update has no items" in t for t in texts)
    assert any("Invalid profile: nope" in t and "no subtask was created" in t for t in texts)
    assert any("Unknown todo_id 'missing'" in t for t in texts)


def test_new_task_must_be_the_last_call_of_its_response(coordinator: Coordinator) -> None:
    root = coordinator.create_task(
        agent(
            calls(
                ("new_task", {"description": "first", "message": agent(reply("did it"))}),
                ("update_todo_list", {"todos": "[ ] should not happen"}),
            ),
            reply("after the subtask"),
        ),
        run=True,
    )
    done = coordinator.wait(root.id, WAIT_S)
    assert done.status == TaskStatus.COMPLETED
    assert len(done.child_ids) == 1
    assert [t.content for t in coordinator.get_todos(root.id)] == ["first"]
    assert _tool_results(coordinator, root.id)["update_todo_list"] == NEW_TASK_NOT_LAST


def test_the_depth_limit_is_refused_to_the_model(coordinator: Coordinator) -> None:
    depth = coordinator.settings.max_depth
    deepest = agent(call("new_task", description="too deep", message="x"), reply("stopped at the limit"))
    message = deepest
    for level in range(depth):  # wrap: each level delegates one step down
        message = agent(call("new_task", description=f"level {depth - level}", message=message), reply("up"))
    root = coordinator.create_task(message, run=True)
    done = coordinator.wait(root.id, WAIT_S)
    assert done.status == TaskStatus.COMPLETED
    bottom = done
    while bottom.child_ids:
        bottom = coordinator.get_task(bottom.child_ids[0])
    assert bottom.depth == depth and bottom.child_ids == []
    result = _tool_results(coordinator, bottom.id)["new_task"]
    assert f"SUBQ_MAX_DEPTH={depth} allows no deeper subtasks" in result
    assert bottom.summary == "stopped at the limit"


def test_export_writes_the_tree_as_folders(solo: Coordinator, tmp_path: Path) -> None:
    root = solo.create_task(tree_root(), run=True)
    solo.wait(root.id, WAIT_S)
    written = solo.export_tree(root.id, tmp_path)
    ids = {t.id for t in _subtree(solo, root.id)}
    assert {p.name for p in tmp_path.iterdir()} == ids
    assert len(written) == len(FILE_NAMES) * len(ids)
    for task_id in ids:
        folder = tmp_path / task_id
        api = json.loads((folder / "api_conversation_history.json").read_text())
        ui = json.loads((folder / "ui_messages.json").read_text())
        item = json.loads((folder / "history_item.json").read_text())
        todos = json.loads((folder / "todos.json").read_text())
        assert set(todos) == {"items", "unlinked_tokens", "unlinked_cost_micros"}
        assert api and api[0]["kind"] == "request"
        assert ui and all({"ts", "type", "text"} <= m.keys() for m in ui)
        for name in ("id", "number", "ts", "task", "tokens_in", "tokens_out", "cache_writes", "cache_reads",
                     "total_cost", "status", "parent_id", "root_id", "child_ids", "awaiting_ids",
                     "completed_by_child_id", "completion_result_summary"):  # fmt: skip
            assert name in item, name
        assert item["id"] == task_id and item["status"] == "completed"


def test_history_lists_tasks_by_recency_with_filters(solo: Coordinator) -> None:
    first = solo.create_task("first, caller-owned")
    root = solo.create_task(tree_root(), run=True)
    solo.wait(root.id, WAIT_S)
    page, _ = solo.list_tasks(limit=3)
    assert page[0].id in {t.id for t in _subtree(solo, root.id)}
    tree, cursor = solo.list_tasks(root_id=root.id, limit=500)
    assert {i.id for i in tree} == {t.id for t in _subtree(solo, root.id)} and cursor is None
    assert [i.ts for i in tree] == sorted((i.ts for i in tree), reverse=True)
    active, _ = solo.list_tasks(status="active", limit=500)
    assert first.id in {i.id for i in active} and root.id not in {i.id for i in active}
    numbers = [i.number for i in tree]
    assert len(set(numbers)) == len(numbers) and all(n > 0 for n in numbers)
    one, more = solo.list_tasks(root_id=root.id, limit=1)
    two, _ = solo.list_tasks(root_id=root.id, limit=1, cursor=more or 0)
    assert one[0].id != two[0].id
    with pytest.raises(Exception, match="status must be one of"):
        solo.list_tasks(status="finished")
