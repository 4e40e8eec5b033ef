"""Where a task's time went: the marks its state changes leave, and what is read from them.

Every script that changes a task's state (a run's start and end, admission, a delegation, a
batch's close, a decision, a stop) appends a mark, `[t_ms, state]`, to the task's timeline,
in the same call, so recording costs no Redis round trip of its own (docs/architecture.md,
"Where the time went"). A state lasts from its mark to the next one; the last lasts until now
(or is a point: an outcome). States:

| state              | the task is ...                                                   |
|--------------------|-------------------------------------------------------------------|
| `queued`           | published, waiting for a worker to take it                        |
| `running`          | run by a worker (or, for a caller's task, held by its caller)     |
| `wait:children`    | delegated, waiting for its children's batch to close              |
| `wait:approval`    | waiting for a person to decide its tool calls                      |
| `wait:admission`   | waiting for a run slot (per parent, per tree) or a start stagger  |
| `wait:rate_limit`  | inside a run: waiting for the provider's fleet-wide rate limit    |
| `wait:tool_limit`  | inside a run: waiting for a tool's fleet-wide limit               |
| `wait:provider`    | waiting for its model's provider to come back (an outage, a 429): |
|                    | inside the run, or with its worker given back (coordinator/endpoints.py) |
| `wait:retry`       | failed, until a person retried it: its `failed` mark, turned into |
|                    | this wait by the retry (coordinator/retry.py)                     |
| an outcome         | `completed`, `failed` or `cancelled`: the end; nothing follows it |

A point mark says something happened without changing the state: `compacted` (the run compacted
its conversation to fit its model's context window, docs/context.md) is written with the record
and followed by `running` again, at the same ms. `times_of` counts them (`compactions_ms`) and
reads the intervals as if they were not there.

The stored form (`TaskField.TIMELINE`, a field of the task hash) is a small JSON object,
marked by the Lua scripts alone (`timeline_add` in store/lua/hashes.lua; a Python transaction
that marks a task queues mark_timeline.lua in its MULTI) and opened by the Python that creates
records (`Timeline.begin`, one mark, nothing to fold):
`{"m": [[t_ms, state], ...], "f": {state: ms}, "n": folded, "t0": t_ms}`.
It is bounded: past `MAX_MARKS` marks the oldest `FOLD_MARKS` are folded into `f` (their
lengths by state) and `n`, so a task that waited thousands of times keeps its totals and its
latest intervals, never an unbounded field. Times are the writer's clock in ms, the clock
`created_at` and `finished_at` are written with.

A task that is not ended and whose last mark is a wait says what it waits for:
`waiting_for(timeline)`, one word (`approval`, `children`, `admission`, `rate_limit`,
`tool_limit`, `provider`), shown as `waiting_for` by the API, `subq status`, `subq tree` and
the web view. A wait inside a run writes its mark as it begins, so the word is true while it lasts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "FOLD_MARKS",
    "MAX_MARKS",
    "MAX_TOOL_CALLS",
    "OUTCOMES",
    "POINT_MARKS",
    "RUN_WAITS",
    "WAIT_PREFIX",
    "WAIT_REASONS",
    "CriticalStep",
    "Interval",
    "TaskTimes",
    "Timed",
    "Timeline",
    "ToolCallSpan",
    "critical_path",
    "critical_steps",
    "held_longest",
    "times_of",
    "tool_calls_of",
    "waiting_for",
]

# Marks kept before the oldest are folded, by hashes.lua's fold alone (declared here, beside the form
# they bound, and put into the Lua as its scripts are loaded): a few hundred bytes a task in the
# common case, at most some 6 KiB, which the run's start reads with the record.
MAX_MARKS = 200
# How many of the oldest marks one fold takes: half, so a fold happens once per 100 marks.
FOLD_MARKS = 100
OUTCOMES = ("completed", "failed", "cancelled")
# Marks of a moment within a state, not a state of their own (keep_compaction.lua writes `compacted`).
POINT_MARKS = ("compacted",)
# `retry`: from a failure to the retry a person made (retry.lua turns the `failed` mark into it).
WAIT_REASONS = ("children", "approval", "admission", "rate_limit", "tool_limit", "provider", "retry")
# Waits inside a run: the run goes on after them (they do not start a new run). A provider wait
# may give the worker back, and the run that goes on after it is the same run to a reader.
RUN_WAITS = ("rate_limit", "tool_limit", "provider")
WAIT_PREFIX = "wait:"


class Timeline(BaseModel):
    """The stored marks of one task (see the module's docstring for the form)."""

    model_config = ConfigDict(frozen=True)

    m: list[tuple[int, str]] = Field(default_factory=list)  # [t_ms, state], oldest first
    f: dict[str, int] = Field(default_factory=dict)  # ms by state of the marks folded away
    n: int = 0  # how many marks were folded
    t0: int | None = None  # the first mark's time, once marks were folded

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        """As stored: JSON text ('' or absent: no marks yet, a record from before timelines)."""
        if isinstance(data, (str, bytes)):
            return json.loads(data) if data else {}
        return {} if data is None else data

    @classmethod
    def begin(cls, t_ms: int, state: str) -> Timeline:
        return cls(m=[(t_ms, state)])

    def text(self) -> str:
        """The stored form (compact JSON; empty parts left out, as Lua's cjson writes them)."""
        out: dict[str, Any] = {"m": [list(mark) for mark in self.m]}
        if self.n:
            out.update(f=self.f, n=self.n, t0=self.t0)
        return json.dumps(out, separators=(",", ":"))


class Timed(Protocol):
    """What the critical path reads of a task (a TaskRecord is one)."""

    @property
    def id(self) -> str: ...

    @property
    def parent_id(self) -> str | None: ...

    @property
    def timeline(self) -> Timeline: ...


# The tool calls a task keeps on its timeline, newest (also in record_tool.lua): its counters
# (`tool_use`) count every call; the timeline shows the latest as spans within its runs.
MAX_TOOL_CALLS = 100


class ToolCallSpan(BaseModel):
    """One tool call that ran, as its task's timeline shows it: `[start_ms, end_ms, tool, outcome]` stored."""

    model_config = ConfigDict(frozen=True)

    start_ms: int
    end_ms: int
    tool: str
    outcome: str

    @model_validator(mode="before")
    @classmethod
    def _from_row(cls, data: Any) -> Any:
        if isinstance(data, (list, tuple)) and len(data) == 4:
            return {"start_ms": data[0], "end_ms": data[1], "tool": data[2], "outcome": data[3]}
        return data


def tool_calls_of(raw: Any) -> Any:
    """The stored `tool_calls` field (JSON text of rows; '' or absent: none) as rows for the model."""
    if isinstance(raw, (str, bytes)):
        return json.loads(raw) if raw else []
    return [] if raw is None else raw


class Interval(BaseModel):
    """One stretch of a task's time in one state."""

    model_config = ConfigDict(frozen=True)

    state: str  # queued | running | waiting
    reason: str | None = None  # a wait's reason (WAIT_REASONS); None for the others
    start_ms: int
    end_ms: int | None = None  # None: it goes on now
    ms: int  # its length (until now, while open)


class TaskTimes(BaseModel):
    """What a task's marks say: its intervals and where its time went, in ms, as of `as_of_ms`."""

    model_config = ConfigDict(frozen=True)

    as_of_ms: int | None = None  # what an open interval counts until: the last mark, or a live view's now
    queued_at_ms: int | None = None  # its first mark (creation)
    started_at_ms: int | None = None  # its first run's start
    ended_at_ms: int | None = None  # its outcome's mark
    outcome: str | None = None
    runs: int = 0  # runs started (a resumed parent has several)
    queue_ms: int = 0
    run_ms: int = 0
    wait_ms: int = 0  # every wait, whatever the reason
    wait_by_reason_ms: dict[str, int] = Field(default_factory=dict)
    wall_ms: int = 0  # from its first mark to its end (or now)
    folded_marks: int = 0  # marks folded away (their lengths are in the totals, not the intervals)
    compactions_ms: list[int] = Field(default_factory=list)  # when its runs compacted their conversation
    intervals: list[Interval] = Field(default_factory=list)


def _split(state: str) -> tuple[str, str | None]:
    if state.startswith(WAIT_PREFIX):
        return "waiting", state[len(WAIT_PREFIX) :]
    return state, None


def waiting_for(timeline: Timeline) -> str | None:
    """What a task waits for now, one word of WAIT_REASONS: its last mark's, when that is a wait (None while
    it is queued, runs, or has ended: an outcome is always its last mark)."""
    if not timeline.m:
        return None
    state = timeline.m[-1][1]
    return state[len(WAIT_PREFIX) :] if state.startswith(WAIT_PREFIX) else None


def times_of(timeline: Timeline, now_ms: int | None = None) -> TaskTimes:
    """The intervals and totals of `timeline`, as of `now_ms`: an open interval counts until then.

    Without `now_ms` they are as of the last mark, so two reads of one record say the same (an API's
    record does not change between reads unless the task does): the open interval has no end and
    counts 0 ms, and a live view adds `now - start_ms` itself (the web view and `subq tree --timeline`
    pass their now).
    """
    if not timeline.m:
        return TaskTimes()
    now = max(timeline.m[-1][0], timeline.m[-1][0] if now_ms is None else now_ms)
    points = [t for t, state in timeline.m if state in POINT_MARKS]
    marks = _states(timeline.m)
    totals: dict[str, int] = dict(timeline.f)
    intervals: list[Interval] = []
    runs, started, ended, outcome = 0, None, None, None
    previous = ""
    for i, (t, state) in enumerate(marks):
        if state in OUTCOMES:
            ended, outcome = t, state
            break
        end = marks[i + 1][0] if i + 1 < len(marks) else None
        length = max(0, (end if end is not None else max(now, t)) - t)
        totals[state] = totals.get(state, 0) + length
        kind, reason = _split(state)
        if state == "running" and previous not in ("running", *(WAIT_PREFIX + r for r in RUN_WAITS)):
            runs += 1
            started = t if started is None else started
        intervals.append(Interval(state=kind, reason=reason, start_ms=t, end_ms=end, ms=length))
        previous = state
    first = timeline.t0 if timeline.t0 is not None else marks[0][0]
    by_reason = {s[len(WAIT_PREFIX) :]: ms for s, ms in totals.items() if s.startswith(WAIT_PREFIX)}
    return TaskTimes(
        as_of_ms=now, queued_at_ms=first, started_at_ms=started, ended_at_ms=ended, outcome=outcome, runs=runs,
        queue_ms=totals.get("queued", 0), run_ms=totals.get("running", 0), wait_ms=sum(by_reason.values()),
        wait_by_reason_ms=by_reason, wall_ms=max(0, (ended if ended is not None else now) - first),
        folded_marks=timeline.n, compactions_ms=points, intervals=intervals,
    )  # fmt: skip


def _states(marks: Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    """The marks that change the state: point marks left out, and a mark that repeats the state before it."""
    out: list[tuple[int, str]] = []
    for t, state in marks:
        if state not in POINT_MARKS and not (out and out[-1][1] == state):
            out.append((t, state))
    return out


# A child's end and its parent's resume are written by one script on one clock; a batch closed by
# another path (the reconciler) may mark the parent a little later: a child that ended this long
# before its parent's wait for children ended still closed it.
CLOSE_SLACK_MS = 1000


class CriticalStep(BaseModel):
    """One stretch of the critical path: a task's own interval that the tree's wall time waited on."""

    model_config = ConfigDict(frozen=True)

    task_id: str
    interval: Interval


def critical_steps(records: Sequence[Timed], ends_ms: Mapping[str, int] | None = None) -> list[CriticalStep]:
    """What held the tree, in time order: walking the top task's intervals, each of its own (running, queued,
    waiting for a person, a limit, its provider) is a step; each wait for children is covered by the child
    that ended last within it (the one that closed the batch), whose own intervals are walked the same way.
    So a sequential delegation puts each step's child on the path, and a parent's own approval wait is a
    step of its own, not hidden behind the child that happened to end last. `ends_ms` may give each task's
    end (default: its outcome's mark, or now while open)."""
    if not records:
        return []
    walk = _CriticalWalk(records, ends_ms)
    walk.walk(next((r for r in records if r.parent_id is None), records[0]), set())
    return walk.steps


class _CriticalWalk:
    """`critical_steps`' walk of a tree's records: the steps found so far, and each task's end (read once)."""

    def __init__(self, records: Sequence[Timed], ends_ms: Mapping[str, int] | None) -> None:
        self.now = int(time.time() * 1000)
        self.by_parent: dict[str, list[Timed]] = {}
        for record in records:
            if record.parent_id:
                self.by_parent.setdefault(record.parent_id, []).append(record)
        self.ends = dict(ends_ms or {})
        self.steps: list[CriticalStep] = []

    def end_of(self, record: Timed) -> int:
        if record.id not in self.ends:
            ended = times_of(record.timeline, self.now).ended_at_ms
            self.ends[record.id] = ended if ended is not None else self.now
        return self.ends[record.id]

    def walk(self, record: Timed, seen: set[str]) -> None:
        seen.add(record.id)
        children = [c for c in self.by_parent.get(record.id, []) if c.id not in seen]
        intervals = times_of(record.timeline, self.now).intervals
        for interval in intervals:
            closing = self._closing(children, interval) if interval.reason == "children" else None
            if closing is not None:
                self.walk(closing, seen)
            else:  # its own interval; or its children are not among the records read: the wait itself is the step
                self.steps.append(CriticalStep(task_id=record.id, interval=interval))
        if children and not any(i.reason == "children" for i in intervals):
            # Marks without its waits for children (folded away, or a record from before timelines): the
            # child that ended last is what it waited on, as a parent resumes only when its last child ends.
            self.walk(max(children, key=self.end_of), seen)

    def _closing(self, children: Sequence[Timed], interval: Interval) -> Timed | None:
        """The child that closed a wait for children: the last to end within it (or just after, by the slack)."""
        until = interval.end_ms if interval.end_ms is not None else self.now
        closing = [c for c in children if interval.start_ms <= self.end_of(c) <= until] or [
            c for c in children if interval.start_ms <= self.end_of(c) <= until + CLOSE_SLACK_MS
        ]
        return max(closing, key=self.end_of) if closing else None


def critical_path(records: Sequence[Timed], ends_ms: Mapping[str, int] | None = None) -> list[str]:
    """The tasks on the critical path (`critical_steps`), top first, each once: the top task and every child
    that closed a batch it waited on, recursively."""
    if not records:
        return []
    top = next((r for r in records if r.parent_id is None), records[0])
    path = [top.id]
    for step in critical_steps(records, ends_ms):
        if step.task_id not in path:
            path.append(step.task_id)
    return path


def held_longest(records: Sequence[Timed], ends_ms: Mapping[str, int] | None = None) -> CriticalStep | None:
    """The longest step of the critical path that is not work: a wait (a person, a limit, a provider) or time
    in the queue; None when the tree only ran. What a reader asks first of a slow tree: what held it."""
    waits = [s for s in critical_steps(records, ends_ms) if s.interval.state != "running"]
    return max(waits, key=lambda s: s.interval.ms, default=None)
