"""The offline model's planner (workers/runtime/planner.py): what it does for each state of a plan."""

from __future__ import annotations

from coordinator.models import TodoItem, TodoStatus
from coordinator.todos import parse_markdown
from workers.runtime.planner import LEAF_LATENCY_MS, LEAF_USAGE, PlanItem, next_step, plan_instructions, read_plan
from workers.runtime.script import parse_script

PLAN = "[ ] A\n[-] B: b1; then b2\n[ ] Then C\n[ ] D\n[x] E"


def _plan(
    linked: frozenset[str] | set[str] = frozenset(), done: frozenset[str] | set[str] = frozenset()
) -> list[PlanItem]:
    items = parse_markdown(PLAN)
    shown = [
        TodoItem(
            id=i.id,
            content=i.content,
            status=TodoStatus.COMPLETED if i.content[:1] in done else i.status,
            subtask_id=f"0123456789abcdef-{n:012x}" if i.content[:1] in linked else None,
        )
        for n, i in enumerate(items)
    ]
    plan = read_plan(plan_instructions(shown))
    assert plan is not None
    return plan


def test_the_plan_reads_back_from_the_instructions() -> None:
    plan = _plan(linked={"A"})
    assert [(p.content, p.status.value, p.linked) for p in plan] == [
        ("A", "pending", True), ("B: b1; then b2", "in_progress", False), ("Then C", "pending", False),
        ("D", "pending", False), ("E", "completed", False),
    ]  # fmt: skip
    assert read_plan("Some other instructions") is None and read_plan(None) is None


def test_a_group_in_parallel_then_a_sequential_step_then_the_rest_then_the_reply() -> None:
    items = {p.content[:1]: p for p in _plan()}
    first = next_step(_plan(), "Prepare the report", None)
    assert first is not None and [name for name, _ in first.tool_calls] == ["run_subagents"]
    tasks = first.tool_calls[0][1]["tasks"]
    assert [(t["description"], t["todo_id"]) for t in tasks] == [
        ("A", items["A"].id),
        ("B: b1; then b2", items["B"].id),
    ]
    leaf = parse_script(tasks[0]["message"])
    assert leaf is not None and leaf.steps[0].reply == "Done: A" and leaf.steps[0].latency_ms == LEAF_LATENCY_MS
    assert leaf.steps[0].usage is not None and leaf.steps[0].usage.model_dump() == LEAF_USAGE
    assert parse_script(tasks[1]["message"]) is None
    assert tasks[1]["message"] == "B\n\n[ ] b1\n[ ] then b2"  # a nested planner of its own steps

    second = next_step(_plan(linked={"A", "B"}), "Prepare the report", "A done; B done")
    assert second is not None and second.tool_calls[0][0] == "new_task"
    assert second.tool_calls[0][1]["todo_id"] == items["T"].id
    third = next_step(_plan(linked={"A", "B", "T"}), "Prepare the report", "C done")
    assert third is not None and third.tool_calls == [
        ("run_subagents", {"tasks": [third.tool_calls[0][1]["tasks"][0]]})
    ]
    assert third.tool_calls[0][1]["tasks"][0]["description"] == "D"
    last = next_step(_plan(linked={"A", "B", "T", "D"}, done={"A", "B", "T", "D"}), "Prepare the report", "D done")
    assert last is not None and last.reply == "Done: Prepare the report (5 of 5 plan items checked)"


def test_a_task_whose_message_lists_steps_writes_them_as_its_plan_first() -> None:
    step = next_step(None, "B\n\n[ ] b1\n[ ] then b2", None)
    assert step is not None and step.tool_calls == [("update_todo_list", {"todos": "[ ] b1\n[ ] then b2"})]


def test_no_plan_and_no_steps_leaves_the_default_reply() -> None:
    assert next_step(None, "Just say hello", None) is None
    assert next_step([], "Just say hello", None) is None


def test_a_refused_delegation_ends_the_run_instead_of_asking_again() -> None:
    step = next_step(_plan(), "p", "Error: the depth limit (SUBQ_MAX_DEPTH=2) is reached")
    assert step is not None and step.reply == "Stopped: Error: the depth limit (SUBQ_MAX_DEPTH=2) is reached"
