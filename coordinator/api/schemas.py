"""The HTTP API's wire models: request bodies, response envelopes and the error shape.

Records cross the wire as the domain's own models (`TaskRecord`, `TodoItem`,
`HistoryItem`, `TreeNode`), so the server and `coordinator.client` share one
definition. Request bodies forbid unknown fields: a typo is a 422 naming the
field, not a silently ignored option.

This module imports only pydantic and the domain models (no FastAPI), so the
Python client can use it without loading the server.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, WithJsonSchema

from coordinator.deadletters import DeadLetter
from coordinator.models import (
    Approval,
    DelegationMode,
    HistoryItem,
    LiveState,
    SubtaskSpec,
    TaskRecord,
    TodoItem,
    TodoStatus,
)
from coordinator.todos import IgnoredLine

__all__ = [
    "ApprovalList",
    "CancelBody",
    "CreateTaskBody",
    "CreatedTask",
    "DeadLetterList",
    "DeadLettersPurged",
    "DecisionBody",
    "DelegateBody",
    "DelegationResult",
    "ErrorBody",
    "Health",
    "HistoryPage",
    "Liveness",
    "MessageList",
    "RedisHealth",
    "Snapshot",
    "TodoList",
    "TodosBody",
    "TodosUpdated",
    "WorkersHealth",
]

_INPUT = ConfigDict(extra="forbid", frozen=True)

# The todo-list grammar (coordinator/todos.py) validates an update and names the
# failing item (`todos.1.content`, code `invalid_todos`); the body model declares
# the accepted shapes for the OpenAPI document and leaves checking to it, so the
# API and the Python API refuse the same inputs with the same field paths.
_TODO_UPDATE_SCHEMA: dict[str, Any] = {
    "description": (
        "The plan: markdown checkbox lines ('[ ] pending', '[-] in progress', '[x] done'), "
        "or a list of {content, status} items"
    ),
    "anyOf": [
        {"type": "string", "examples": ["[ ] Collect figures\n[-] Summarise feedback"]},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "content": {"type": "string"},
                    "status": {"type": "string", "enum": [s.value for s in TodoStatus]},
                },
                "required": ["content"],
                "additionalProperties": False,
            },
        },
    ],
}
TodoUpdate = Annotated[Any, WithJsonSchema(_TODO_UPDATE_SCHEMA)]


class ErrorBody(BaseModel):
    """Every error response: a stable `code`, a message for people, and the offending field's path."""

    model_config = ConfigDict(frozen=True)

    code: str = Field(description="Stable machine-readable code, e.g. not_found, invalid_input, wrong_state")
    message: str
    field: str | None = Field(description="Dotted path of the offending input, e.g. subtasks.1.message")


class CreateTaskBody(BaseModel):
    """POST /v1/tasks. New optional fields (e.g. `budget_usd`) slot in as defaults, keeping old bodies valid."""

    model_config = _INPUT

    prompt: str = Field(min_length=1, description="The task's text")
    todos: TodoUpdate | None = None
    profile: str | None = Field(default=None, description="A configured model profile; the default when omitted")
    run: StrictBool = Field(
        default=False,
        description="true: start the task as an agent on the fleet; false: the caller owns it and delegates",
    )
    budget_usd: Decimal | None = Field(
        default=None, gt=0, max_digits=12, decimal_places=6,
        description="Most the whole tree may spend, in US dollars; it stops there (docs/control.md)",
    )  # fmt: skip
    idempotency_key: str | None = Field(
        default=None, min_length=1, max_length=200,
        description="A key of the caller's choosing: a retried request with the same key returns the first root",
    )  # fmt: skip


class CancelBody(BaseModel):
    """POST /v1/tasks/{task_id}/cancel."""

    model_config = _INPUT

    reason: str = Field(min_length=1, max_length=2000, description="Why: the parent and the history read it")


class DecisionBody(BaseModel):
    """POST /v1/approvals/{approval_id}."""

    model_config = _INPUT

    decision: Literal["approve", "deny"]
    feedback: str | None = Field(default=None, max_length=10_000, description="What the model is told on a denial")


class ApprovalList(BaseModel):
    """Tool calls waiting for a decision, oldest first."""

    model_config = ConfigDict(frozen=True)

    approvals: list[Approval]


class DeadLetterList(BaseModel):
    """Messages no worker could decode or validate, newest first; `count` is how many are kept in all."""

    model_config = ConfigDict(frozen=True)

    count: int
    dead_letters: list[DeadLetter]


class DeadLettersPurged(BaseModel):
    """DELETE /v1/dead-letters: how many dead letters were deleted."""

    model_config = ConfigDict(frozen=True)

    purged: int


class Snapshot(BaseModel):
    """The live state of every task of a tree."""

    model_config = ConfigDict(frozen=True)

    root_id: str
    tasks: dict[str, LiveState]


class DelegateBody(BaseModel):
    """POST /v1/tasks/{task_id}/subtasks."""

    model_config = _INPUT

    mode: DelegationMode = Field(default="parallel", description="parallel (all at once) or sequential (a chain)")
    # SubtaskSpec is the domain's own spec, so a field added there (budget_usd) reaches the API unchanged.
    subtasks: list[SubtaskSpec] = Field(min_length=1)


class TodosBody(BaseModel):
    """PUT /v1/tasks/{task_id}/todos: replaces the list; links and figures of existing items survive."""

    model_config = _INPUT

    todos: TodoUpdate


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
