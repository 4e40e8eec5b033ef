"""The offline model's planner: with no script, a task that has a plan carries it out by delegating its items.

It is what makes a first run show subq's point: `subq run "…" --todos plan.md`
on the offline model fans the items out as children, nests and sequences them
where the plan says so, and completes with every item checked. It is NOT a real
model: the convention below is all it understands (docs/offline-model.md).

- The plan is the task's todo list, which an offline task sees in its
  instructions (`plan_instructions`, added by workers/runtime/tools.py); a task
  with no list whose message holds plan lines (`[ ] step`) first writes them
  as its list (a nested child, below).
- Each request, the items that are neither checked nor linked to a child are
  open. Consecutive open items run in parallel (one `run_subagents`); an item
  that starts with `Then ` runs alone, after everything above it ended
  (`new_task`); the items after it form the next group.
- An item with steps after a colon, separated by semicolons (`Check the
  ledger: orders; refunds`), goes to a child whose message lists those steps as
  its plan, so it fans them out in its turn (nesting, to any depth the settings
  allow). An item that ends with a call of one of the task's tools, written
  `name(key=value, ...)` with literal values (`Total the sales with
  sales_total(path="q3.csv")`), goes to a child without a script whose message
  is the item: it makes that call, then replies with the tool's result (a task
  whose message is such a line, and that has no plan, does the same). Any
  other item goes to a leaf child with a script: one reply, with the usage and
  latency below.
- With no open item left, it replies `Done: …`: the run completes. A
  delegation the coordinator refused, a tool call that failed and a call that
  was denied end the run with that result (`Stopped: …`), rather than asking
  again.

Everything is decided from the plan, the task message, the tools the task
has and the last tool result, so a run resumed from its persisted conversation
goes on where it was.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
from collections.abc import Collection, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from coordinator import TodoError, TodoItem, TodoStatus, parse_markdown, render_markdown
from workers.runtime.script import final_reply, script_message

__all__ = [
    "LEAF_LATENCY_MS",
    "LEAF_USAGE",
    "PLAN_TAG",
    "PlanStep",
    "next_step",
    "plan_instructions",
    "read_plan",
    "tool_call",
]

# The line that opens the plan in an offline task's instructions; the plan's JSON follows it.
PLAN_TAG = "subq-offline-plan:"
# What a leaf child's one request reports: the size of a real Claude call that reads a
# cached context and writes a short answer (input excludes cache, as in the script grammar).
LEAF_USAGE = {"input": 1200, "output": 400, "cache_write": 2000, "cache_read": 8000}
# Long enough that a parallel fan-out is seen running side by side in `subq run --follow`.
LEAF_LATENCY_MS = 1500
# A last tool result that starts with one of these ends the run with it: an error (a refused
# delegation, a tool that failed, a call a human denied) or the policy's denial.
STOPS = ("Error", "Denied by policy:")
_THEN = re.compile(r"^then\b[\s:,]*", re.IGNORECASE)
# "Head: step; step": a head without a colon of its own, then at least two steps.
_NESTED = re.compile(r"^(?P<head>[^:]+):\s*(?P<steps>[^;]+(?:;[^;]*)+)$")
# Where a call `name(...)` may start in a line: a name, then an opening parenthesis.
_CALL_START = re.compile(r"\b(?P<name>[A-Za-z_]\w*)\(")
# How many places a line names one of the task's tools that are tried as the start of its call:
# each try parses the rest of the line, so a line naming them thousands of times stays cheap.
MAX_CALL_TRIES = 4


class PlanItem(BaseModel):
    """An item as the planner sees it: enough to pick and link it."""

    model_config = ConfigDict(frozen=True)

    id: str
    content: str
    status: TodoStatus
    linked: bool


class PlanStep(BaseModel):
    """The planner's answer to one request: tool calls to make, or the final reply."""

    model_config = ConfigDict(frozen=True)

    tool_calls: list[tuple[str, dict[str, Any]]] = []
    reply: str | None = None


def plan_instructions(items: Sequence[TodoItem]) -> str:
    """The task's plan, as an offline task's instructions carry it to the offline model."""
    plan = [
        {"id": i.id, "content": i.content, "status": i.status.value, "linked": i.subtask_id is not None} for i in items
    ]
    return f"{PLAN_TAG}\n{json.dumps(plan)}"


def read_plan(instructions: str | None) -> list[PlanItem] | None:
    """The plan in a request's instructions; None when they carry none."""
    if not instructions or PLAN_TAG not in instructions:
        return None
    raw = instructions.split(PLAN_TAG, 1)[1].strip().split("\n", 1)[0]
    try:
        return [PlanItem.model_validate(entry) for entry in json.loads(raw)]
    except (ValueError, TypeError, ValidationError):
        return None


def next_step(
    plan: list[PlanItem] | None, message: str, last_tool_result: str | None, tools: Collection[str] = ()
) -> PlanStep | None:
    """What the planner does for this request; None when the task has no plan (the model's default applies).

    `tools` are the names of the tools the task has (its requests offer them): an item, or a
    task message, that ends with a call of one of them makes that call (`tool_call`).
    """
    if last_tool_result is not None and last_tool_result.startswith(STOPS):
        return PlanStep(reply=f"Stopped: {last_tool_result}")
    if not plan:
        lines = _plan_lines(message)
        if lines:
            return PlanStep(tool_calls=[("update_todo_list", {"todos": lines})])
        call = tool_call(_first_line(message), tools)
        if call is None:
            return None
        if last_tool_result is None:
            return PlanStep(tool_calls=[call])
        return PlanStep(reply=f"Done: {call[0]} returned {last_tool_result}")
    open_items = [item for item in plan if not item.linked and item.status != TodoStatus.COMPLETED]
    if not open_items:
        done = sum(item.status == TodoStatus.COMPLETED for item in plan)
        return PlanStep(reply=f"{final_reply(message)} ({done} of {len(plan)} plan items checked)")
    if _THEN.match(open_items[0].content):
        first = open_items[0]
        return PlanStep(tool_calls=[("new_task", {**_subtask(first, tools)})])
    group = []
    for item in open_items:
        if _THEN.match(item.content):
            break
        group.append(_subtask(item, tools))
    return PlanStep(tool_calls=[("run_subagents", {"tasks": group})])


def tool_call(line: str, tools: Collection[str]) -> tuple[str, dict[str, Any]] | None:
    """The call of one of `tools` that ends `line`, as (name, arguments); None if it ends with none.

    The call is written `name(key=value, ...)`: keyword arguments whose values are
    literals (strings, numbers, booleans, None, and lists and dicts of these), read
    with `ast.literal_eval`, never run.
    """
    text = line.rstrip()
    if not text.endswith(")"):
        return None
    starts = (m for m in _CALL_START.finditer(text) if m.group("name") in tools)
    for start in itertools.islice(starts, MAX_CALL_TRIES):
        try:
            call = ast.parse(text[start.start() :], mode="eval").body
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or call.args:
                continue
            if any(k.arg is None for k in call.keywords):  # **kwargs
                continue
            args = {str(k.arg): ast.literal_eval(k.value) for k in call.keywords}
            json.dumps(args, allow_nan=False)  # what a model sends: JSON (a set, bytes or 1e999 is not)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            continue
        return start.group("name"), args
    return None


def _subtask(item: PlanItem, tools: Collection[str]) -> dict[str, Any]:
    """The child that carries `item` out: a planner of its steps if it has some, a tool's caller if it
    ends with a call of one of the task's tools (its profile's, which the child shares), else a scripted leaf."""
    text = _THEN.sub("", item.content, count=1) or item.content
    nested = _NESTED.match(text)
    if nested is not None:
        steps = [step.strip() for step in nested.group("steps").split(";") if step.strip()]
        message = nested.group("head").strip() + "\n\n" + "\n".join(f"[ ] {step}" for step in steps)
    elif tool_call(text, tools) is not None:
        message = text
    else:
        step = {"reply": f"Done: {text}", "usage": LEAF_USAGE, "latency_ms": LEAF_LATENCY_MS}
        message = script_message(text, [step])
    return {"description": item.content, "message": message, "todo_id": item.id}


def _first_line(message: str) -> str:
    return next((line for line in message.splitlines() if line.strip()), "")


def _plan_lines(message: str) -> str:
    """The lines of a task message that are plan items (a nested child's steps), as one update ("" if none)."""
    try:
        return render_markdown(parse_markdown(message))
    except TodoError:
        return ""
