"""`subq run --follow`'s terminal view (coordinator/cli/live.py), drawn at many widths."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from coordinator.cli.live import tree_view
from coordinator.models import Approval, LiveState, TaskStatus, TodoItem, TodoStatus
from coordinator.tree import TreeNode

ROOT = "0123456789abcdef"
FIRST, SECOND = f"{ROOT}-aaaaaaaaaaaa", f"{ROOT}-bbbbbbbbbbbb"
APPROVAL = f"{ROOT}-a0123456789ab"


def _node(task_id: str, status: TaskStatus, text: str, tokens: int, cost_micros: int, **more: object) -> TreeNode:
    fields: dict[str, object] = {
        "id": task_id, "parent_id": None if task_id == ROOT else ROOT, "depth": 0 if task_id == ROOT else 1,
        "status": status, "description": text, "profile": "offline", "todo_id": None, "tokens": tokens,
        "cost_micros": cost_micros, "total_tokens": tokens, "total_cost_micros": cost_micros, "summary": "",
        "error": "", "todos": [], "children": [],
    }  # fmt: skip
    return TreeNode.model_validate(fields | more)


TREE = _node(
    ROOT, TaskStatus.DELEGATED, "Prepare the quarterly report for the board, with every figure checked twice",
    1_234_567, 99_999_999,
    todos=[
        TodoItem(id="t1", content="Collect the sales figures for Q3 from every region", status=TodoStatus.COMPLETED,
                 subtask_id=FIRST, tokens=13_500, cost_micros=21_000),
        TodoItem(id="t2", content="Write the executive summary", status=TodoStatus.IN_PROGRESS,
                 subtask_id=SECOND, tokens=27_000, cost_micros=1_234_567),
        TodoItem(id="t3", content="Publish", status=TodoStatus.PENDING),
    ],
    children=[
        _node(FIRST, TaskStatus.COMPLETED, "Collect the sales figures", 13_500, 21_000),
        _node(SECOND, TaskStatus.ACTIVE, "Write the summary", 27_000, 1_234_567),
    ],
)  # fmt: skip
LIVE = {
    ROOT: LiveState(task_id=ROOT, state="delegated", ts=0, requests=1),
    SECOND: LiveState(task_id=SECOND, state="waiting_approval", ts=0, requests=3),
}
WAITING = [
    Approval(id=APPROVAL, task_id=SECOND, root_id=ROOT, tool="run_command", args={"command": "make publish"},
             tool_call_id="call-1", created_at=0, deadline=1),
]  # fmt: skip


def _draw(width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(tree_view(TREE, LIVE, WAITING, width=width))
    return [line.rstrip() for line in out.getvalue().splitlines()]


@pytest.mark.parametrize("width", [60, 72, 80, 100, 160])
def test_the_view_fits_the_width_and_never_cuts_a_figure(width: int) -> None:
    lines = _draw(width)
    assert max(len(line) for line in lines) <= width
    row = {name: next(line for line in lines if name in line) for name in ("[x] Coll", "[-] Writ", "[ ] Publish")}
    assert re.search(r" 13500 +\$0\.021000$", row["[x] Coll"])
    assert re.search(r" 27000 +\$1\.234567$", row["[-] Writ"])
    assert row["[ ] Publish"].strip() == "[ ] Publish"  # no child yet: no figures
    assert lines[0] == f"Tree {ROOT}: total 1234567 tokens, $99.999999"
    assert any(re.search(r" 1234567 +\$99\.999999$", line) and line.startswith(ROOT) for line in lines)


def test_one_status_per_task_and_the_commands_for_a_waiting_approval() -> None:
    lines = _draw(100)
    first = next(line for line in lines if line.startswith("  -aaaaaaaaaaaa"))
    second = next(line for line in lines if line.startswith("  -bbbbbbbbbbbb"))
    assert "completed" in first and "active" not in first
    assert " to approve " in second and "active" not in second and second.split()[-3:] == ["3", "27000", "$1.234567"]
    text = "\n".join(lines)
    assert f"subq approve {APPROVAL}" in text and f"subq deny {APPROVAL} --feedback" in text
    assert 'run_command {"command": "make publish"}' in text and f"(task {SECOND})" in text
