"""A task tree as one nested structure: every task with its todo items, own and total figures.

Used by the HTTP API (`GET /v1/tasks/{id}/tree`) and the CLI (`subq tree`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, ConfigDict

from coordinator.models import TaskStatus, TodoItem

if TYPE_CHECKING:
    from coordinator.models import TaskRecord

__all__ = ["TaskReader", "TreeNode", "build_tree"]


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
    error: str
    todos: list[TodoItem]
    children: list[TreeNode]


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
        error=f"{record.error_class}: {record.error}" if record.error else "",
        todos=coord.get_todos(record.id),
        children=[build_tree(coord, child) for child in record.child_ids],
    )
