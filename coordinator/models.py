"""Pydantic models for everything that crosses a process boundary.

Task records, todo items, subtask specs and results, batches. Input models
forbid unknown fields; records read back from Redis are frozen. Money is
integer micro-USD (`cost_micros`) everywhere; dollars appear only when
rendered (`format_usd`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

__all__ = [
    "Batch",
    "DelegationMode",
    "SubtaskResult",
    "SubtaskSpec",
    "TaskRecord",
    "TaskStatus",
    "TodoItem",
    "TodoStatus",
    "Usage",
    "format_usd",
]

MICROS_PER_USD = 1_000_000

NonEmptyText = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


class TaskStatus(StrEnum):
    ACTIVE = "active"
    DELEGATED = "delegated"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED)


TERMINAL_STATUSES = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED})


class TodoStatus(StrEnum):
    PENDING = "pending"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


DelegationMode = Literal["parallel", "sequential"]


class Usage(BaseModel):
    """Token counts of one request or a sum of them.

    `tokens_in` counts every input token including cache reads and writes
    (DESIGN.md), so `tokens == tokens_in + tokens_out`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens_in: int = Field(default=0, ge=0)
    tokens_out: int = Field(default=0, ge=0)
    cache_reads: int = Field(default=0, ge=0)
    cache_writes: int = Field(default=0, ge=0)

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out


class TodoItem(BaseModel):
    """One line of a task's plan, with the figures of the child that carried it out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    content: str
    status: TodoStatus = TodoStatus.PENDING
    subtask_id: str | None = None
    tokens: int = Field(default=0, ge=0)
    cost_micros: int = Field(default=0, ge=0)


class SubtaskSpec(BaseModel):
    """What a parent asks one child to do."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    description: NonEmptyText = Field(max_length=500)
    message: NonEmptyText
    todo_id: str | None = None
    profile: str | None = None


class TaskRecord(BaseModel):
    """A task as stored: its place in the tree, status, own usage and subtree totals.

    Own counters are what this task's own model requests spent; `total_tokens`
    and `total_cost_micros` are own plus every descendant, rolled up atomically
    as each request is recorded, so no figure is ever a second copy.
    """

    model_config = ConfigDict(frozen=True)

    id: str
    parent_id: str | None = None
    root_id: str
    depth: int = 0
    status: TaskStatus
    prompt: str
    description: str = ""
    profile: str
    todo_id: str | None = None
    batch_id: str | None = None
    child_ids: list[str] = Field(default_factory=list)
    awaiting_ids: list[str] = Field(default_factory=list)
    tokens_in: int = 0
    tokens_out: int = 0
    cache_reads: int = 0
    cache_writes: int = 0
    cost_micros: int = 0
    requests: int = 0
    total_tokens: int = 0
    total_cost_micros: int = 0
    summary: str = ""
    error: str = ""
    error_class: str = ""
    cost_source: str = ""
    created_at: float
    updated_at: float
    finished_at: float | None = None

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out


class SubtaskResult(BaseModel):
    """What `subq.run_task` returns: small, JSON, never a traceback."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    child_id: str
    status: Literal["completed", "failed", "cancelled"]
    summary: str = ""
    usage: Usage = Field(default_factory=Usage)
    cost_micros: int = Field(default=0, ge=0)
    error: str | None = None
    error_class: str | None = None


class Batch(BaseModel):
    """One delegation: its children in dispatch order and, once done, the combined result."""

    model_config = ConfigDict(frozen=True)

    id: str
    parent_id: str
    root_id: str
    mode: DelegationMode
    child_ids: list[str]
    status: Literal["running", "done"] = "running"
    result: str = ""
    created_at: float
    finished_at: float | None = None


def format_usd(cost_micros: int) -> str:
    """Render integer micro-USD as dollars, keeping every micro."""
    sign = "-" if cost_micros < 0 else ""
    whole, frac = divmod(abs(cost_micros), MICROS_PER_USD)
    return f"{sign}${whole}.{frac:06d}"


def as_plain(value: Any) -> Any:
    """A JSON-ready copy of a model or list of models."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [as_plain(v) for v in value]
    return value
