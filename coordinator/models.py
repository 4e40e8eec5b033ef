"""Pydantic models for everything that crosses a process boundary.

Task records, todo items, subtask specs and results, batches. Input models
forbid unknown fields; records read back from Redis are frozen. Money is
integer micro-USD (`cost_micros`) everywhere; dollars appear only when
rendered (`format_usd`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from enum import StrEnum
from typing import Annotated, Any, Literal, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, computed_field, field_validator, model_validator

from coordinator.errors import NotFoundError
from coordinator.output_schema import OutputSchema
from coordinator.tenants import DEFAULT_PRIORITY, DEFAULT_TENANT
from coordinator.timeline import OUTCOMES, TaskTimes, Timeline, ToolCallSpan, times_of, tool_calls_of, waiting_for

__all__ = [
    "FINISHING_AMONG_MAX",
    "FINISHING_LOOK_S",
    "MAX_PROMPT_CHARS",
    "AdmissionLimits",
    "Approval",
    "Batch",
    "DelegationMode",
    "Delivery",
    "FinishingLook",
    "FinishingRuns",
    "HistoryItem",
    "LiveState",
    "Mark",
    "Outcome",
    "Retried",
    "RetryBatch",
    "RetryRefused",
    "RetrySkip",
    "RetryTask",
    "RunWrites",
    "Settled",
    "Spend",
    "StopHold",
    "SubtaskResult",
    "SubtaskSpec",
    "TaskRecord",
    "TaskStatus",
    "TodoItem",
    "TodoStatus",
    "ToolCallDone",
    "ToolOutcome",
    "ToolUse",
    "UiMessage",
    "Usage",
    "finishing_if_known",
    "format_usd",
    "live_status",
    "usd_to_micros",
]

MICROS_PER_USD = 1_000_000
# Between a waiter's looks at a stopped subtree's runs that may still record spend (`FinishingRuns`): a stopped
# run stops within a quarter second (its stop watch's poll).
FINISHING_LOOK_S = 0.1
# The most tasks a look over HTTP names (GET .../finishing?among=, the tasks a waiter's first look found: the runs
# a stop caught in flight), so that its URL stays a few KB, which every proxy passes. A client whose first look
# found more asks for the whole subtree at every look.
FINISHING_AMONG_MAX = 100

# The most characters of a task's own text: a root's prompt, a child's message (a page of instructions, a
# pasted document; the conversation, not the task's text, holds what a run reads in).
MAX_PROMPT_CHARS = 200_000

# (pydantic refuses a lone surrogate in a constrained string: "unable to parse raw data as a unicode string".)
NonEmptyText = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


class TaskStatus(StrEnum):
    ACTIVE = "active"
    DELEGATED = "delegated"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self.value in OUTCOMES  # timeline.py declares the ends once, for Python and the Lua

    @property
    def stopped(self) -> bool:
        """Ended by a stop (a cancel, a spent budget, a failure stopping the rest): a run it stopped may record
        what its provider billed after the task settled (late spend), so a waiter reads the figures once the
        subtree's `FinishingRuns` is empty. A completed task's runs all ended before it."""
        return self in (TaskStatus.CANCELLED, TaskStatus.FAILED)


class TodoStatus(StrEnum):
    PENDING = "pending"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


DelegationMode = Literal["parallel", "sequential"]


class Usage(BaseModel):
    """Token counts of one request or a sum of them.

    `tokens_in` counts every input token including cache reads and writes
    (docs/architecture.md, Money and tokens), so `tokens == tokens_in + tokens_out`.
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
    """One line of a task's plan, with the figures of the children that carried it out.

    `subtask_id` is the current child. A row retried by a later child keeps the
    earlier children's figures in `prior_*` (their sum, and their ids in order);
    `tokens` and `cost_micros` are what the row shows: prior plus the current
    child's subtree totals (docs/todo-links.md). Stored JSON without the prior
    fields reads as no earlier child.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    content: str
    status: TodoStatus = TodoStatus.PENDING
    subtask_id: str | None = None
    tokens: int = Field(default=0, ge=0)
    cost_micros: int = Field(default=0, ge=0)
    prior_subtask_ids: tuple[str, ...] = ()
    prior_tokens: int = Field(default=0, ge=0)
    prior_cost_micros: int = Field(default=0, ge=0)

    @field_validator("prior_subtask_ids", mode="before")
    @classmethod
    def _empty_lua_table(cls, value: object) -> object:
        # Lua cjson encodes an empty array as `{}`, so an item that a script decoded
        # and wrote back carries `{}` where it had `[]`.
        return () if value == {} else value


class SubtaskSpec(BaseModel):
    """What a parent asks one child to do."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    description: NonEmptyText = Field(max_length=500)
    message: NonEmptyText = Field(max_length=MAX_PROMPT_CHARS)
    todo_id: str | None = None
    profile: str | None = None
    budget_usd: Decimal | None = Field(default=None, gt=0, max_digits=12, decimal_places=6)
    # The JSON Schema the child's result data is held to (coordinator/output_schema.py); None: its profile's, if any.
    output_schema: OutputSchema = None


# How a tool call ended: it ran (ok, error, timeout), or it was answered without running (denied by a
# rule, or interrupted: cut off by its worker's death). A call replayed on resume was counted as it returned.
ToolOutcome = Literal["ok", "error", "timeout", "denied", "interrupted"]


class ToolUse(BaseModel):
    """One tool's calls on one task: how many ended each way, and how long those that ran took."""

    model_config = ConfigDict(frozen=True)

    outcomes: dict[ToolOutcome, int] = Field(default_factory=dict)
    ms: int = 0

    @property
    def calls(self) -> int:
        return sum(self.outcomes.values())


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
    # Root first, parent last; the usage roll-up adds each request to all of them.
    ancestors: list[str] = Field(default_factory=list)
    status: TaskStatus
    prompt: str
    description: str = ""
    profile: str
    todo_id: str | None = None
    # The batch this task belongs to (as a child), and the one it now waits on (as a parent).
    batch_id: str | None = None
    waiting_batch_id: str | None = None
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
    # Children's figures that no row of the plan carries (their row was rewritten away), so
    # that Σ item figures + unlinked == total − own, always (docs/architecture.md, Money and tokens).
    unlinked_tokens: int = 0
    unlinked_cost_micros: int = 0
    summary: str = ""
    error: str = ""
    error_class: str = ""
    # A failed model request's raw error body from the provider (JSON or text, cut to 4,000
    # characters); `error` is its one clear line.
    error_detail: str = ""
    cost_source: str = ""
    runner: Literal["caller", "agent"] = "caller"
    # 0 means no budget; otherwise the subtree stops once its total reaches it.
    budget_micros: int = 0
    number: int = 0
    completed_by_child_id: str | None = None
    # Times a person retried it after it failed (coordinator/retry.py); its spend before each stays counted.
    retries: int = 0
    # Its model requests that failed transiently (429, 5xx, a refused connection...) and were waited out and
    # sent again, across every run of it, parks included (docs/providers.md); none of them cost anything.
    transient_errors: int = 0
    created_at: float
    updated_at: float
    finished_at: float | None = None
    # The API key whose caller created the tree (docs/security.md); every task of a tree carries
    # its root's. '' for a tree made straight on Redis or through Celery: only read_all sees it.
    owner: str = ""
    # The task's tool calls by tool (its own, not its children's); none for a task that called none.
    tool_use: dict[str, ToolUse] = Field(default_factory=dict)
    # The marks its state changes left (coordinator/timeline.py); `times` is what they say.
    timeline: Timeline = Field(default_factory=Timeline)
    # Its latest tool calls that ran, each a span of its timeline (the newest MAX_TOOL_CALLS).
    tool_calls: list[ToolCallSpan] = Field(default_factory=list)
    # The JSON Schema its result's data is held to, given when it was created (None: none of its own;
    # its profile's `output_schema` then applies, if any). Stored as compact JSON text.
    output_schema: dict[str, Any] | None = None
    # The validated data of a completed task with a schema: a JSON value (stored as compact JSON text),
    # written atomically with its completed status; None for a task without one.
    output: Any = None
    # Its model's attempt_completion answers whose data broke the schema, each sent back with the errors.
    invalid_outputs: int = 0
    # The caller's tags for the tree (a job id, a customer), given with its root and copied to every
    # child as it is made, so a task read alone names its tree's (coordinator/inputs.py bounds them).
    metadata: dict[str, str] = Field(default_factory=dict)
    # Whom the tree runs for (coordinator/tenants.py): its owner key's tenant, else the key's name, else the
    # `tenant` given to subq.submit, else SUBQ_DEFAULT_TENANT; set on the root, copied to every child.
    tenant: str = DEFAULT_TENANT
    # The root's priority, 1-5 (5 starts first within its tenant's share), capped at the tenant's
    # `max_priority`; copied to every child. Records older than it read as the default.
    priority: int = DEFAULT_PRIORITY

    @field_validator("metadata", mode="before")
    @classmethod
    def _no_metadata(cls, value: Any) -> Any:
        # A record stored before metadata was kept (or a tree given none) reads as no tags.
        return {} if value is None else value

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _stored_tool_calls(cls, value: Any) -> Any:
        return tool_calls_of(value)

    @model_validator(mode="before")
    @classmethod
    def _opening_marks(cls, data: Any) -> Any:
        """A new record (or one stored before timelines) opens its timeline at its creation: queued for a
        worker, or held by its caller (coordinator/timeline.py); the store writes these marks with it."""
        if isinstance(data, dict) and not data.get("timeline") and data.get("created_at") is not None:
            state = "queued" if data.get("runner") == "agent" else "running"
            data = {**data, "timeline": Timeline.begin(round(float(data["created_at"]) * 1000), state)}
        return data

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out

    @property
    def usage(self) -> Usage:
        """Its own model requests' tokens, as a run reports them."""
        return Usage(
            tokens_in=self.tokens_in, tokens_out=self.tokens_out, cache_reads=self.cache_reads,
            cache_writes=self.cache_writes,
        )  # fmt: skip

    def without_content(self) -> TaskRecord:
        """The record as a caller that may change its tree but not read it sees it (an `operate` key's cancel or
        retry): where it stands and what it spent, not what it was asked, answered or tagged with."""
        return self.model_copy(update=dict(_NO_CONTENT))

    @computed_field  # type: ignore[prop-decorator]
    @property
    def times(self) -> TaskTimes:
        """Its intervals and where its time went (queue, runs, waits by reason, wall), read from `timeline`
        as of its last mark, so two reads of an unchanged task agree (a live view passes its now to
        `times_of`). Sent with the record; never stored (the marks are)."""
        return times_of(self.timeline)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def waiting_for(self) -> str | None:
        """What it waits for now, one word (`approval`, `children`, `admission`, `rate_limit`, `tool_limit`,
        `provider`), read from its timeline's last mark; None while it is queued, runs, or has ended."""
        return waiting_for(self.timeline)


# TaskRecord.without_content: the fields that carry a caller's or a model's words, each as a record without them.
_NO_CONTENT: dict[str, Any] = {
    "prompt": "", "description": "", "summary": "", "error": "", "error_detail": "", "output": None,
    "output_schema": None, "metadata": {}, "tool_use": {}, "tool_calls": [],
}  # fmt: skip


class SubtaskResult(BaseModel):
    """What `subq.run_task` returns: small, JSON, never a traceback.

    `delegated`, `queued` and `waiting_approval` mean the run released its worker
    before the task ended (to wait for its children, for a run slot, or for a
    decision); `running` means another run of the task holds it. Its final
    outcome reaches its parent when it ends (coordinator/writeback.py).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    child_id: str
    status: Literal["completed", "failed", "cancelled", "delegated", "queued", "waiting_approval", "running"]
    summary: str = ""
    usage: Usage = Field(default_factory=Usage)
    cost_micros: int = Field(default=0, ge=0)
    error: str | None = None
    error_class: str | None = None
    # A completed task's validated result data (its `output_schema`'s), a JSON value; None without one.
    output: Any = None


class UiMessage(BaseModel):
    """One entry of a task's UI messages, as AI coding tools show a task's progress."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ts: float
    type: Literal["say", "ask"] = "say"
    say: str | None = None
    ask: str | None = None
    text: str = ""


class HistoryItem(BaseModel):
    """A task's summary line in the history, in the layout AI coding tools export."""

    model_config = ConfigDict(frozen=True)

    id: str
    number: int
    ts: float
    task: str
    tokens_in: int
    tokens_out: int
    cache_writes: int
    cache_reads: int
    total_cost: float
    total_cost_micros: int
    total_tokens: int
    subtree_cost: float
    status: TaskStatus
    parent_id: str | None
    root_id: str
    depth: int
    todo_id: str | None
    child_ids: list[str]
    awaiting_ids: list[str]
    completed_by_child_id: str | None
    completion_result_summary: str
    # The tree's caller metadata (TaskRecord.metadata); a default, so an older server's page still reads.
    metadata: dict[str, str] = Field(default_factory=dict)
    # The tree's tenant and priority (TaskRecord's); defaults, so an older server's page still reads.
    tenant: str = DEFAULT_TENANT
    priority: int = DEFAULT_PRIORITY
    # The subtree's cost exactly (`subtree_cost` is a float of it): `total_cost_micros` is the task's own here, as
    # Roo-Code's history item's `totalCost` is, where a task record's is its subtree's. None from an older server.
    subtree_cost_micros: int | None = None

    @classmethod
    def of(cls, record: TaskRecord) -> HistoryItem:
        return cls(
            id=record.id,
            number=record.number,
            ts=record.created_at,
            task=record.prompt,
            tokens_in=record.tokens_in,
            tokens_out=record.tokens_out,
            cache_writes=record.cache_writes,
            cache_reads=record.cache_reads,
            total_cost=record.cost_micros / MICROS_PER_USD,
            total_cost_micros=record.cost_micros,
            total_tokens=record.total_tokens,
            subtree_cost=record.total_cost_micros / MICROS_PER_USD,
            subtree_cost_micros=record.total_cost_micros,
            status=record.status,
            parent_id=record.parent_id,
            root_id=record.root_id,
            depth=record.depth,
            todo_id=record.todo_id,
            child_ids=record.child_ids,
            awaiting_ids=record.awaiting_ids,
            completed_by_child_id=record.completed_by_child_id,
            completion_result_summary=record.summary,
            metadata=record.metadata,
            tenant=record.tenant,
            priority=record.priority,
        )


class BatchRef(BaseModel):
    """What the write-back of one child needs of its batch (not the list of all its children)."""

    model_config = ConfigDict(frozen=True)

    id: str
    parent_id: str
    root_id: str


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
    # The delegation tool call of an agent parent, answered with `result` on resume.
    tool_call_id: str = ""
    created_at: float
    finished_at: float | None = None


# The fields in which one delegation's children differ; they share every other one (NewChildren). Each child
# gives all of them but its history number, which the commit takes (NewChildren.records).
CHILD_OWN_FIELDS = ("id", "prompt", "description", "profile", "todo_id", "budget_micros", "output_schema", "number")
_GIVEN_OWN_FIELDS = frozenset(CHILD_OWN_FIELDS) - {"number"}


@dataclass(frozen=True)
class NewChildren:
    """A delegation's children before they are written: one record all of them share, validated once,
    and each child's own values of CHILD_OWN_FIELDS (from subtask specs validated already). A
    1000-wide delegation builds and stores its children from the shared part instead of making and
    encoding 1000 records whole, which its first child waits on (docs/architecture.md, "A parallel
    delegation, step by step"). `shared`'s own fields are the first child's, replaced in each child."""

    shared: TaskRecord
    own: list[dict[str, Any]]

    def __post_init__(self) -> None:
        # Every own field given, none other: one left out would silently take the first child's value.
        for values in self.own:
            if values.keys() != _GIVEN_OWN_FIELDS:
                number = ": the commit takes each one's number" if "number" in values else ""
                raise ValueError(f"a child's own values are {sorted(_GIVEN_OWN_FIELDS)}, not {sorted(values)}{number}")

    def records(self, first_number: int) -> list[TaskRecord]:
        """The children's records, their history numbers from `first_number` on (taken at the commit).

        Not validated again (their values were), and siblings share what they do not own, nested values
        included (`metadata`, `ancestors`, `timeline`): a record is never changed in place."""
        return [
            self.shared.model_copy(update={**values, "number": first_number + n}) for n, values in enumerate(self.own)
        ]


@dataclass(frozen=True)
class RetryTask:
    """One failed task of a retry's plan (coordinator/retry.py, store.retries): `run` (active again, its
    run published next) or `wait` (delegated again on the batch re-opened for it, its conversation cut
    to its first `keep` messages of `length`)."""

    task_id: str
    role: Literal["run", "wait"]
    slot: str | None = None  # the batch whose slot it takes again (its own batch), if any
    keep: int = 0
    length: int = 0


@dataclass(frozen=True)
class RetryBatch:
    """A batch of the plan: `open` (running: a slot of it is opened again) or `closed` (re-opened)."""

    batch_id: str
    state: Literal["open", "closed"]
    parent_id: str


@dataclass(frozen=True)
class RetryRefused:
    """The script found a part of the plan no longer true: nothing was written."""

    target: str  # the task or batch id
    why: str  # missing|status|caller|budget|leased|conversation|batch|parent|chain
    detail: str


class RetrySkip(BaseModel):
    """A failed task a tree's retry left as it is, and why (its parent went on with its result, ...)."""

    model_config = ConfigDict(frozen=True)

    task_id: str
    reason: str


DeliveryState = Literal["pending", "retrying", "delivered", "gone", "given_up"]


class Delivery(BaseModel):
    """One event's delivery to one subscription (GET /v1/tasks/{id}/deliveries, `subq deliveries`,
    docs/webhooks.md): where it goes (a URL without its query, or `celery:<task>@<queue>`; never a
    secret), its state, its attempts, the next one's time and the last answer."""

    model_config = ConfigDict(frozen=True)

    id: str  # `<event id>.<subscription>`
    event_id: str  # the `webhook-id` a receiver sees; the same on every attempt
    type: str
    task_id: str
    target: str
    state: DeliveryState
    attempts: int = 0
    created_at: float
    next_at: float | None = None
    last: str = ""
    last_at: float | None = None

    def without_content(self) -> Delivery:
        """As a caller that may redeliver but not read the tree sees it (an `operate` key): its state and
        attempts, not where it goes nor what the receiver answered (TaskRecord.without_content)."""
        return self.model_copy(update={"target": "", "last": ""})


class Retried(BaseModel):
    """What a retry did (POST /v1/tasks/{id}/retry, `subq retry`): the tasks it sent to run again, children
    before parents; the parents that wait again on a re-opened batch, to resume with the new results; and,
    for a tree's retry, the failed tasks it left, each with why."""

    model_config = ConfigDict(frozen=True)

    task: TaskRecord  # the task named, as it is after the retry
    retried: list[str] = Field(default_factory=list)
    reopened: list[str] = Field(default_factory=list)
    skipped: list[RetrySkip] = Field(default_factory=list)

    def without_content(self) -> Retried:
        """As a caller that may retry the tree but not read it sees it (TaskRecord.without_content)."""
        return self.model_copy(update={"task": self.task.without_content()})


class FinishingRuns(BaseModel):
    """The tasks of a subtree whose runs may still record spend (GET /v1/tasks/{id}/finishing): each holds its
    lease, or has spend a stop refused and not yet recorded. A stopped tree's figures are final once none is
    left; a waiter waits at most `lapse_s` from its first look (a run whose worker died records nothing, and its
    lease lapses within that span)."""

    model_config = ConfigDict(frozen=True)

    task_id: str
    task_ids: list[str]
    lapse_s: float  # the heartbeat lapse: how long a stopped run may still take to record its spend


@dataclass
class StopHold:
    """A waiter's hold after a stop, one rule for `Coordinator.wait`, the event stream, the clients, MCP's
    `wait_task` and `subq run --follow`: it looks at the subtree's `FinishingRuns` until none is left, or for its lapse from the
    first look, and never past the waiter's own `deadline` (monotonic s): `while hold.due() and hold.holds(<a
    look>): <sleep look_in_s()>`; then the waiter reads the task again."""

    deadline: float
    until: float | None = None
    last: FinishingRuns | None = None  # the last look: a waiter that keeps state looks again among these only
    # Whether the next look walks the subtree: the first does, and one more once none of the tasks the walk found
    # is left, for a run that began since (a child a stop's later pass reached after its run started).
    walk: bool = True

    def holds(self, runs: FinishingRuns | None) -> bool:
        """Whether to look again (`look_in_s` later) before the answer. None: nothing is known to wait for (an
        API older than this look, or the task gone meanwhile)."""
        if runs is None:
            return False
        walked, self.last = self.walk, runs
        if self.until is None:
            self.until = min(self.deadline, time.monotonic() + runs.lapse_s)
        if runs.task_ids:
            self.walk = False
        elif walked:
            return False
        else:
            self.walk = True
        return time.monotonic() < self.until

    @property
    def among(self) -> list[str] | None:
        """What the next look looks at: the tasks the last one found (a stopped subtree starts no run but one a
        stop's pass had not reached yet, which the walk at the end finds), or None for a walk."""
        return None if self.walk or self.last is None else self.last.task_ids

    def due(self) -> bool:
        """Whether a look is still due: the hold's end (or, before the first look, the deadline) is ahead."""
        return time.monotonic() < (self.deadline if self.until is None else self.until)

    def look_in_s(self) -> float:
        """When the next look is due: FINISHING_LOOK_S, or less at the hold's end."""
        end = self.deadline if self.until is None else self.until
        return max(0.0, min(FINISHING_LOOK_S, end - time.monotonic()))


class FinishingLook(Protocol):
    """`finishing_runs` as every face has it: the subtree's runs that may still record spend, or with `among`
    (a waiter's last look, `StopHold.among`) those of its tasks only."""

    def __call__(self, task_id: str, /, *, among: Sequence[str] | None = None) -> FinishingRuns: ...


def finishing_if_known(look: FinishingLook, task_id: str, among: Sequence[str] | None = None) -> FinishingRuns | None:
    """`look(task_id, among=among)`, a `finishing_runs`, as a polling waiter asks it: None when the route or the
    task is not known (an API older than the route, or the task gone since it was read), so the wait answers with
    what it has."""
    try:
        return look(task_id, among=among)
    except NotFoundError:
        return None


class Approval(BaseModel):
    """A tool call waiting for (or given) a human decision."""

    model_config = ConfigDict(frozen=True)

    id: str
    task_id: str
    root_id: str
    tool: str
    args: dict[str, Any]
    tool_call_id: str
    todo_id: str | None = None
    todo_content: str | None = None
    status: Literal["pending", "approved", "denied", "expired"] = "pending"
    feedback: str | None = None
    created_at: float
    deadline: float
    decided_at: float | None = None
    # The API key that decided (its name), or `local` for a decision made straight on Redis;
    # None until decided, and for an expiry.
    decided_by: str | None = None


class LiveState(BaseModel):
    """One task's live status, as published on its tree's stream and in the snapshot."""

    model_config = ConfigDict(frozen=True)

    task_id: str
    parent_id: str | None = None
    depth: int = 0
    state: Literal[
        "queued", "running", "delegated", "waiting_approval", "waiting_provider", "completed", "failed", "cancelled"
    ]
    ts: float
    tool: str | None = None
    text: str | None = None
    requests: int = 0
    cost_micros: int = 0
    # What a queued or parked task waits for (`admission`, `provider`) and why, in words (for admission:
    # `tenant <name> is at its weighted share while other tenants wait`, coordinator/admission.py).
    waiting_for: str | None = None
    reason: str | None = None


def usd_to_micros(usd: Decimal) -> int:
    """Dollars as integer micro-USD, rounded half up: the one rounding of money, for prices and budgets."""
    return int((usd * MICROS_PER_USD).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def format_usd(cost_micros: int) -> str:
    """Render integer micro-USD as dollars, keeping every micro."""
    sign = "-" if cost_micros < 0 else ""
    whole, frac = divmod(abs(cost_micros), MICROS_PER_USD)
    return f"{sign}${whole}.{frac:06d}"


def live_status(record: TaskRecord, state: str, **fields: object) -> str:
    """A task's live status as stored in its tree's live hash (JSON)."""
    live = {
        "task_id": record.id, "parent_id": record.parent_id, "depth": record.depth, "state": state,
        "ts": time.time(), **fields,
    }  # fmt: skip
    return json.dumps(live)


@dataclass(frozen=True)
class AdmissionLimits:
    """How many children of one parent, and tasks of one tree, may hold a run slot at once
    (0: no cap), and the spacing of a tree's starts (SUBQ_MAX_RUNNING_PER_PARENT,
    SUBQ_MAX_RUNNING_PER_ROOT, SUBQ_START_STAGGER_MS)."""

    per_parent: int = 0
    per_tree: int = 0
    stagger_ms: int = 0

    def applies_to(self, record: TaskRecord) -> bool:
        """Whether a run of `record` is admitted and frees a slot: a child, with some limit set (a root always runs)."""
        return record.parent_id is not None and bool(self.per_parent or self.per_tree or self.stagger_ms)


@dataclass(frozen=True)
class Settled:
    """A delivery attempt's outcome to record (`store.outbox.settle_and_claim`): as `settle`'s arguments."""

    root_id: str
    delivery_id: str
    state: str  # delivered, retrying, given_up, gone
    last: str = ""  # the last answer or error, cut
    next_at: float = 0.0  # epoch s of the next attempt, when retrying
    # The delivery's attempts as its claim read them: an outcome other than delivered is recorded only while
    # they still are (a call re-sent after its reply was lost records nothing twice); -1: whatever they are.
    attempts: int = -1


@dataclass(frozen=True, eq=False, slots=True)  # eq=False: an attempt's token, found again by identity
class ClaimedDelivery:
    """A claimed delivery with what its attempt needs (`store.outbox.settle_and_claim`): its entry, its
    subscription's (event patterns, target) (None when gone) and its task's record: the fields an event
    carries (store.outbox's EVENT_FIELDS; for a Celery callback the whole record); None when it expired."""

    root_id: str
    delivery_id: str
    entry: dict[str, Any]
    found: tuple[str, dict[str, Any]] | None
    record: dict[str, Any] | None
    refused: str = ""  # what of its stored data did not decode: given up, not attempted ('' when it did)


class Spend(NamedTuple):
    """One response's usage and cost (or a tool call's price), as a run keeps it until its next step."""

    request_key: str  # unique per request of the task: `<run seq>:<request no>`, or `tool:<call id, URL-quoted>`
    usage: Usage
    cost_micros: int
    cost_source: str


class Mark(NamedTuple):
    """A timeline mark a run's own clock took between steps (coordinator/timeline.py)."""

    t_ms: int
    state: str


@dataclass
class RunWrites:
    """What a run did since its last step, written at its next one in the same round trip.

    A run's hot path is a start, one step before each model request after the first,
    and an end: each is one script call that writes these and makes the step's checks.
    """

    conversation: list[str] = field(default_factory=list)  # model messages, one JSON entry each
    ui_messages: list[str] = field(default_factory=list)  # JSON
    usage: list[Spend] = field(default_factory=list)
    live: str = ""  # the latest live status (JSON), or '' when unchanged
    # Timeline marks (t ms, state) the run's own clock took between steps: a wait inside the run
    # (a rate or tool limit) and its end, the wait the run leaves its task in (coordinator/timeline.py).
    marks: list[Mark] = field(default_factory=list)

    def clear(self) -> None:
        self.conversation, self.ui_messages, self.usage, self.live = [], [], [], ""
        self.marks = []


class Outcome(NamedTuple):
    """How a run ends its task, as its end writes it (store/protocol.py: end_run)."""

    status: str
    summary: str = ""
    error: str = ""
    error_class: str = ""
    output_json: str = ""  # a completed typed task's data, compact JSON; '' for none
    invalid_outputs: int = 0
    error_detail: str = ""  # an unsuccessful end's raw error body (a failed model request's); '' for none


@dataclass(frozen=True)
class ToolCallDone:
    """A tool call that returned (or was answered without running), as its run's step records it."""

    tool_call_id: str
    tool: str
    outcome: str  # ok, error, timeout, denied, interrupted
    result_json: str | None = None  # the result to keep for a resume; None: nothing to keep
    ms: int = 0  # how long it ran; 0 when it did not run
