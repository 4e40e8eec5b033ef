"""`subq run --follow`'s view on a terminal, drawn with rich: one table fitted to the width.

One row per task (indented by depth) with one status, its subtree's tokens and
cost; under it one row per todo item with the figures of the child that carries
it, updated live; then every tool call waiting for a decision, with the
commands that approve or deny it. Descriptions and items are cut with an
ellipsis to fit the terminal; figures and ids are never cut or wrapped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from coordinator.inputs import visible_text
from coordinator.models import Approval, LiveState, TaskStatus, format_usd
from coordinator.tree import MARKS, TreeNode

__all__ = ["task_status", "tree_view"]

# Each level of the tree indents its rows by this many spaces: visible, but cheap in width.
INDENT = 2
# Below this the task column is cut however wide the terminal: a narrower one wraps instead.
MIN_TASK_CHARS = 16
# Spaces between two columns (one cell of padding on each side).
COLUMN_GAP = 2
# A tool call's arguments are shown up to this many characters: enough to recognise it.
APPROVAL_ARGS_CHARS = 60
# A live state's word in the view, where the state's own name is long for a narrow column.
STATUS_WORDS = {"waiting_approval": "to approve", "waiting_provider": "provider down"}
STATUS_STYLE = {
    "completed": "green",
    "failed": "red",
    "cancelled": "yellow",
    "waiting_approval": "bold magenta",
    "waiting_provider": "bold red",
    "running": "cyan",
    "delegated": "blue",
}


def task_status(node: TreeNode, live: LiveState | None) -> str:
    """One status per task: the record's once it has ended, otherwise its live state (running, waiting ...)."""
    if node.status.terminal or live is None:
        return node.status.value
    return live.state


def tree_view(
    node: TreeNode, live: dict[str, LiveState], approvals: Sequence[Approval], *, width: int, footer: str = ""
) -> RenderableType:
    """The whole view for a terminal `width` columns wide: the table of tasks and items, the approvals waiting, `footer`."""
    rows: list[Row] = []
    _add_task(rows, node, live, depth=0)
    widths = [max([len(title), *(len(row[n].plain) for row in rows)]) for n, (title, _) in enumerate(FIGURE_COLUMNS, 1)]
    # Only the first column gives way to a narrow terminal (cut with an ellipsis); the
    # others are as wide as their widest cell, so a figure or an id is never cut.
    first_width = max(MIN_TASK_CHARS, width - sum(widths) - COLUMN_GAP * len(widths))
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, COLUMN_GAP // 2))
    table.add_column("task / plan item", overflow="ellipsis", no_wrap=True, max_width=first_width)
    for (title, justify), column_width in zip(FIGURE_COLUMNS, widths, strict=True):
        table.add_column(title, justify=justify, no_wrap=True, width=column_width)
    for row in rows:
        table.add_row(*row)
    parts: list[RenderableType] = [
        Text(f"Tree {node.id}: total {node.total_tokens} tokens, {format_usd(node.total_cost_micros)}", style="bold"),
        table,
    ]
    for approval in approvals:
        args = json.dumps(approval.args)
        shown = args if len(args) <= APPROVAL_ARGS_CHARS else args[: APPROVAL_ARGS_CHARS - 1] + "…"
        parts.append(
            Text.assemble(
                ("waiting for approval: ", "bold magenta"),
                f"{visible_text(approval.tool)} {shown}  (task {approval.task_id})\n",
                "  approve: ",
                (f"subq approve {approval.id}", "bold"),
                "\n  deny:    ",
                (f"subq deny {approval.id} --feedback '…'", "bold"),
            )
        )
    if footer:
        parts.append(Text(footer, style="dim"))
    return Group(*parts)


Row = tuple[Text, Text, Text, Text, Text]
FIGURE_COLUMNS: tuple[tuple[str, Literal["left", "right"]], ...] = (
    ("status", "left"),
    ("req", "right"),
    ("tokens", "right"),
    ("cost", "right"),
)


def _add_task(rows: list[Row], node: TreeNode, live: dict[str, LiveState], depth: int) -> None:
    state = live.get(node.id)
    status = task_status(node, state)
    pad = " " * (INDENT * depth)
    # A model's words reach the operator's terminal: its escapes are shown as text, never acted on.
    first_line = visible_text((node.description.strip().splitlines() or [""])[0])
    # A child's id is its root's id and a suffix: the suffix alone tells the rows apart and
    # leaves the width to the description (`subq tree` and the approvals print whole ids).
    shown_id = node.id.removeprefix(node.id.split("-", 1)[0]) if node.parent_id else node.id
    rows.append(
        (
            Text(f"{pad}{shown_id}  {first_line}", style="bold" if depth == 0 else ""),
            Text(STATUS_WORDS.get(status, status), style=STATUS_STYLE.get(status, "")),
            Text(str(state.requests) if state is not None else ""),
            Text(str(node.total_tokens)),
            Text(format_usd(node.total_cost_micros)),
        )
    )
    inner = " " * (INDENT * (depth + 1))
    if node.error and node.status in (TaskStatus.FAILED, TaskStatus.CANCELLED):
        rows.append((Text(f"{inner}error: {visible_text(node.error)}", style="red"), Text(), Text(), Text(), Text()))
    for item in node.todos:
        linked = item.subtask_id is not None
        rows.append(
            (
                Text(f"{inner}{MARKS[item.status.value]} {visible_text(item.content)}"),
                Text(),
                Text(),
                Text(str(item.tokens) if linked else ""),
                Text(format_usd(item.cost_micros) if linked else ""),
            )
        )
    if node.unlinked_tokens or node.unlinked_cost_micros:
        rows.append(
            (
                Text(f"{inner}unlinked spend (no row of the plan)", style="dim"),
                Text(),
                Text(),
                Text(str(node.unlinked_tokens)),
                Text(format_usd(node.unlinked_cost_micros)),
            )
        )
    for child in node.children:
        _add_task(rows, child, live, depth + 1)
