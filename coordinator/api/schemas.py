"""The HTTP API's wire models: request bodies, response envelopes and the error shape.

Request bodies are the operations' own inputs (coordinator/inputs.py): the API,
`subq.submit` and the CLI read an input with one model each, so they refuse the
same inputs in the same words. They forbid unknown fields: a typo is a 422
naming the field, not a silently ignored option. Records cross the wire as the
domain's own models (`TaskRecord`, `TodoItem`, `HistoryItem`, `TreeNode`), so
the server and `coordinator.client` share one definition.

This module imports only pydantic and the domain models (no FastAPI), so the
Python client can use it without loading the server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from coordinator.audit import AuditEntry
from coordinator.deadletters import DeadLetter
from coordinator.inputs import CancelInput, CreateTaskInput, DecisionInput, DelegateInput, TodosInput
from coordinator.models import Approval, DelegationMode, Delivery, HistoryItem, LiveState, TaskRecord, TodoItem
from coordinator.todos import IgnoredLine

__all__ = [
    "ApprovalList",
    "AuditPage",
    "CancelInput",
    "CreateTaskInput",
    "CreatedTask",
    "DeadLetterList",
    "DeadLettersPurged",
    "DecisionInput",
    "DelegateInput",
    "DelegationResult",
    "DeliveryList",
    "ErrorBody",
    "Health",
    "HistoryPage",
    "Liveness",
    "MessageList",
    "RedisHealth",
    "Snapshot",
    "TodoList",
    "TodosInput",
    "TodosUpdated",
    "WorkersHealth",
]


class ErrorBody(BaseModel):
    """Every error response: a stable `code`, a message for people, and the offending field's path."""

    model_config = ConfigDict(frozen=True)

    code: str = Field(description="Stable machine-readable code, e.g. not_found, invalid_input, wrong_state")
    message: str
    field: str | None = Field(description="Dotted path of the offending input, e.g. subtasks.1.message")


class ApprovalList(BaseModel):
    """Tool calls waiting for a decision, oldest first."""

    model_config = ConfigDict(frozen=True)

    approvals: list[Approval]


class DeliveryList(BaseModel):
    """A tree's deliveries of outbound events, oldest event first (docs/webhooks.md)."""

    model_config = ConfigDict(frozen=True)

    deliveries: list[Delivery]


class DeadLetterList(BaseModel):
    """Messages no worker could decode or validate, newest first; `count` is how many are kept in all."""

    model_config = ConfigDict(frozen=True)

    count: int
    dead_letters: list[DeadLetter]


class AuditPage(BaseModel):
    """GET /v1/audit: entries newest first, and the cursor of the next (older) page, or null."""

    model_config = ConfigDict(frozen=True)

    entries: list[AuditEntry]
    next_before: str | None = None


class DeadLettersPurged(BaseModel):
    """DELETE /v1/dead-letters: how many dead letters were deleted."""

    model_config = ConfigDict(frozen=True)

    purged: int


class Snapshot(BaseModel):
    """The live state of every task of a tree."""

    model_config = ConfigDict(frozen=True)

    root_id: str
    tasks: dict[str, LiveState]


class DelegationResult(BaseModel):
    """The committed delegation: its batch and the children's ids in dispatch order."""

    model_config = ConfigDict(frozen=True)

    batch_id: str
    parent_id: str
    mode: DelegationMode
    child_ids: list[str]


class TodoList(BaseModel):
    model_config = ConfigDict(frozen=True)

    task_id: str
    todos: list[TodoItem]


_IGNORED_LINES = (
    "Lines of a markdown plan that look like items but do not match the grammar "
    "('* [ ] x', '1. [ ] x', '[] x'), so were not read as items: each with its line number "
    "and the line to write instead"
)


class TodosUpdated(TodoList):
    """The list as updated, and the lines of the update that were not read as items."""

    ignored_lines: list[IgnoredLine] = Field(default_factory=list, description=_IGNORED_LINES)


class CreatedTask(TaskRecord):
    """The new root, and the lines of its plan that were not read as items."""

    ignored_todo_lines: list[IgnoredLine] = Field(default_factory=list, description=_IGNORED_LINES)


class MessageList(BaseModel):
    model_config = ConfigDict(frozen=True)

    task_id: str
    kind: Literal["ui", "api"]
    messages: list[dict[str, Any]]


class HistoryPage(BaseModel):
    """A page of the history, newest first; pass `next_cursor` back as `cursor` for the next one."""

    model_config = ConfigDict(frozen=True)

    items: list[HistoryItem]
    next_cursor: int | None


class RedisHealth(BaseModel):
    model_config = ConfigDict(frozen=True)

    ok: bool
    latency_ms: float | None = None
    error: str | None = None


class WorkersHealth(BaseModel):
    """Worker nodes whose heartbeat is within `SUBQ_HEARTBEAT_LAPSE_S`.

    `names` stays in the shape for older clients and is always empty: the health
    routes are open, and Celery node names carry host names (`celery@<host>`).
    """

    model_config = ConfigDict(frozen=True)

    count: int
    names: list[str] = Field(default_factory=list)
    error: str | None = None


class Health(BaseModel):
    """`ok`: Redis answers and workers beat; `degraded`: Redis answers, no worker beat lately; `down`: no Redis.

    Read from a cache at most a second old (docs/api.md, "Health").
    """

    model_config = ConfigDict(frozen=True)

    status: Literal["ok", "degraded", "down"]
    redis: RedisHealth
    workers: WorkersHealth


class Liveness(BaseModel):
    """GET /livez: the process serves requests (nothing else is checked)."""

    model_config = ConfigDict(frozen=True)

    status: Literal["ok"] = "ok"
