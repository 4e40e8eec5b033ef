"""A task tree as one nested structure (every task with its todo items, own and total figures),
and the same drawn as text.

The structure is what the HTTP API (`GET /v1/tasks/{id}/tree`) and the CLI
(`subq tree`) answer with; the text is what the CLI prints of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, computed_field

from coordinator.models import TaskStatus, TodoItem, ToolUse, format_usd
from coordinator.timeline import TaskTimes, Timeline, ToolCallSpan, times_of, waiting_for

if TYPE_CHECKING:
    from coordinator.models import TaskRecord

__all__ = [
    "MARKS",
    "TaskReader",
    "TreeNode",
    "build_tree",
    "cut",
    "describe",
    "duration",
    "metadata_line",
    "render_tree",
    "tools_line",
    "unlinked_line",
    "walk",
]


class TreeNode(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    parent_id: str | None
    depth: int
    status: TaskStatus
    description: str
    profile: str
    todo_id: str | None
    tokens: int
    cost_micros: int
    total_tokens: int
    total_cost_micros: int
    unlinked_tokens: int = 0
    unlinked_cost_micros: int = 0
    summary: str
    # The validated object of a task that had an output schema (docs/agents.md, "Typed results"); None otherwise.
    output: Any = None
    invalid_outputs: int = 0
    error: str
    # The tree's caller metadata (the same on every task of it: TaskRecord.metadata).
    metadata: dict[str, str] = Field(default_factory=dict)
    todos: list[TodoItem]
    children: list[TreeNode]
    # The task's own tool calls by tool: how each ended, and the time of those that ran.
    tool_use: dict[str, ToolUse] = Field(default_factory=dict)
    # The marks of its state changes (coordinator/timeline.py), and what they say.
    timeline: Timeline = Field(default_factory=Timeline)
    tool_calls: list[ToolCallSpan] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def times(self) -> TaskTimes:
        return times_of(self.timeline)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def waiting_for(self) -> str | None:
        """What it waits for now, one word (as `TaskRecord.waiting_for`)."""
        return waiting_for(self.timeline)


class TaskReader(Protocol):
    """What a tree is read from: the Coordinator on Redis (the API's tree is built from it)."""

    def get_task(self, task_id: str, /) -> TaskRecord: ...
    def get_todos(self, task_id: str, /) -> list[TodoItem]: ...


def build_tree(coord: TaskReader, task_id: str) -> TreeNode:
    record = coord.get_task(task_id)
    return TreeNode(
        id=record.id,
        parent_id=record.parent_id,
        depth=record.depth,
        status=record.status,
        description=record.description or record.prompt[:200],
        profile=record.profile,
        todo_id=record.todo_id,
        tokens=record.tokens,
        cost_micros=record.cost_micros,
        total_tokens=record.total_tokens,
        total_cost_micros=record.total_cost_micros,
        unlinked_tokens=record.unlinked_tokens,
        unlinked_cost_micros=record.unlinked_cost_micros,
        summary=record.summary,
        output=record.output,
        invalid_outputs=record.invalid_outputs,
        error=f"{record.error_class}: {record.error}" if record.error else "",
        metadata=record.metadata,
        todos=coord.get_todos(record.id),
        children=[build_tree(coord, child) for child in record.child_ids],
        tool_use=record.tool_use,
        timeline=record.timeline,
        tool_calls=record.tool_calls,
    )


# -- drawn as text ----------------------------------------------------------------------

MARKS = {"pending": "[ ]", "in_progress": "[-]", "completed": "[x]"}
# Wide enough to tell tasks apart, narrow enough that a tree line fits a terminal.
DESCRIPTION_CHARS = 48
TODO_CHARS = 40


def render_tree(node: TreeNode, notes: dict[str, str] | None = None) -> list[str]:
    """An indented tree: each task with own/total figures, its todo items under it, then its children.

    The tree's metadata is drawn once, under the top task: every task below carries the same."""
    tags = [f"{'|   ' if node.children else '    '}metadata: {metadata_line(node.metadata)}"] if node.metadata else []
    return [_task_line(node, notes), *tags, *_below(node, "", notes or {})]


def metadata_line(metadata: dict[str, str]) -> str:
    """A tree's metadata on one line, keys in order: `customer=acme, ticket=T-1234` (--json has it exactly)."""
    return ", ".join(f"{key}={value}" for key, value in sorted(metadata.items()))


def _below(node: TreeNode, prefix: str, notes: dict[str, str]) -> list[str]:
    inner = prefix + ("|   " if node.children else "    ")
    lines = [f"{inner}error: {node.error}"] if node.error else []
    if node.tool_use:
        lines.append(f"{inner}tools: {tools_line(node.tool_use)}")
    width = min(max((len(i.content) for i in node.todos), default=0), TODO_CHARS)
    for item in node.todos:
        link = f"  -> {item.subtask_id}" if item.subtask_id else ""
        lines.append(
            f"{inner}{MARKS[item.status.value]} {cut(item.content, width):<{width}}  "
            f"{item.tokens:>8} tokens  {format_usd(item.cost_micros):>10}{link}"
        )
    if node.unlinked_tokens or node.unlinked_cost_micros:
        lines.append(unlinked_line(inner, node.unlinked_tokens, node.unlinked_cost_micros))
    for index, child in enumerate(node.children):
        last = index == len(node.children) - 1
        lines.append(f"{prefix}{'`-- ' if last else '|-- '}{_task_line(child, notes)}")
        lines += _below(child, prefix + ("    " if last else "|   "), notes)
    return lines


def _task_line(node: TreeNode, notes: dict[str, str] | None) -> str:
    note = f"  {notes[node.id]}" if notes and node.id in notes else ""
    return (
        f"{node.id}  {node.status.value}{waiting_note(node.waiting_for)}  {describe(node)}  "
        f"own {node.tokens} tokens {format_usd(node.cost_micros)}, "
        f"total {node.total_tokens} tokens {format_usd(node.total_cost_micros)}, "
        f"wall {duration(times_of(node.timeline, int(time.time() * 1000)).wall_ms)}{note}"
    )


def waiting_note(reason: str | None) -> str:
    """What a task waits for, after its status: ` waiting_for approval` (the API's field and word)."""
    return f" waiting_for {reason}" if reason else ""


def tools_line(tool_use: dict[str, ToolUse]) -> str:
    """A task's tool calls in one line: `git_log 2 calls 0.34 s, add 1 call (1 denied) 0.00 s`."""
    parts = []
    for tool, use in sorted(tool_use.items()):
        others = [f"{n} {outcome}" for outcome, n in sorted(use.outcomes.items()) if outcome != "ok"]
        label = f"{use.calls} call{'s' if use.calls != 1 else ''}" + (f" ({', '.join(others)})" if others else "")
        parts.append(f"{tool} {label} {use.ms / 1000:.2f} s")
    return ", ".join(parts)


def unlinked_line(indent: str, tokens: int, cost_micros: int) -> str:
    """The line under a plan for its children's spend that no row carries, so the rows add up."""
    return f"{indent}    unlinked spend (no row of the plan)  {tokens:>8} tokens  {format_usd(cost_micros):>10}"


def duration(ms: int) -> str:
    """A length for a person: `850 ms`, `12.4 s`, `3 m 05 s`, `2 h 04 m`."""
    if ms < 1000:
        return f"{ms} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    if ms < 3_600_000:
        return f"{ms // 60_000} m {ms // 1000 % 60:02d} s"
    return f"{ms // 3_600_000} h {ms // 60_000 % 60:02d} m"


def walk(node: TreeNode) -> Iterator[TreeNode]:
    yield node
    for child in node.children:
        yield from walk(child)


def describe(node: TreeNode) -> str:
    first = (node.description.strip().splitlines() or [""])[0]
    return repr(cut(first, DESCRIPTION_CHARS))


def cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"
