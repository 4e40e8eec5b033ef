"""What the pages show, read through the Coordinator: a page of roots, a tree, a conversation.

Plain functions over the same service operations the API uses, so a figure on
a page is the figure the API returns for the same task.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections import Counter
from collections.abc import Mapping, Set
from dataclasses import dataclass, field

from coordinator import ids
from coordinator.errors import ValidationError
from coordinator.inputs import MAX_CURSOR, meta_pairs, visible_text
from coordinator.models import Approval, Delivery, HistoryItem, LiveState, TaskRecord, TaskStatus, TodoItem
from coordinator.service import MAX_PAGE, Coordinator
from coordinator.tenants import check_tenant_name
from coordinator.text import ascii_digits, digits_within
from coordinator.timeline import (
    WAIT_REASONS,
    CriticalStep,
    Interval,
    TaskTimes,
    critical_path,
    held_longest,
    times_of,
)
from coordinator.tree import duration

__all__ = [
    "DEFAULT_ROOTS_PER_PAGE",
    "MAX_ROOTS_PER_PAGE",
    "FoldedChild",
    "RootFilter",
    "RootPage",
    "TaskView",
    "TimelineView",
    "TreeView",
    "call_text",
    "data_text",
    "find_roots",
    "parse_root_filter",
    "read_timeline",
    "read_tree",
]

DEFAULT_ROOTS_PER_PAGE = 25
# A page an operator can scan by eye; the API's history pages go to MAX_PAGE.
MAX_ROOTS_PER_PAGE = 200
# Most history entries one page request reads while looking for matching roots: a
# rare filter over a long history then answers in bounded time with a "more" link.
MAX_SCANNED_PER_PAGE = 20_000
MAX_TEXT_CHARS = 200
# A tool call as the approval box and its confirmation show it: long enough for any
# command an operator should approve by reading it; past it, a marker says how much is cut.
MAX_CALL_CHARS = 2_000
ROOT_FILTER_PARAMS = ("status", "q", "meta", "tenant", "since", "until", "cursor", "limit")


@dataclass(frozen=True)
class RootFilter:
    status: TaskStatus | None = None
    text: str = ""
    # One `key=value` the root's metadata must hold (the API's `meta.<key>`; one field in the form).
    meta: tuple[str, str] | None = None
    tenant: str = ""  # only the trees run for this tenant ('' for any)
    since: dt.date | None = None  # inclusive, UTC
    until: dt.date | None = None  # inclusive, UTC
    cursor: int = 0
    limit: int = DEFAULT_ROOTS_PER_PAGE

    def query(self, cursor: int) -> dict[str, str]:
        """This filter as query parameters, at another cursor (the "next page" link)."""
        params = {
            "status": self.status.value if self.status else "",
            "q": self.text,
            "meta": self.meta_text,
            "tenant": self.tenant,
            "since": self.since.isoformat() if self.since else "",
            "until": self.until.isoformat() if self.until else "",
            "limit": str(self.limit) if self.limit != DEFAULT_ROOTS_PER_PAGE else "",
            "cursor": str(cursor) if cursor else "",
        }
        return {name: value for name, value in params.items() if value}

    @property
    def meta_text(self) -> str:
        """The metadata filter as the form's field holds it: `key=value`, or '' for none."""
        return f"{self.meta[0]}={self.meta[1]}" if self.meta else ""


@dataclass(frozen=True)
class RootPage:
    roots: list[HistoryItem]
    next_cursor: int | None


def parse_root_filter(params: Mapping[str, str]) -> RootFilter:
    """The roots page's query string as a filter; a ValidationError naming the parameter otherwise."""
    for name in params:
        if name not in ROOT_FILTER_PARAMS:
            raise ValidationError(
                f"{name}: unknown query parameter (this page takes {', '.join(ROOT_FILTER_PARAMS)})", field=name
            )
    status_text = params.get("status", "").strip()
    status = None
    if status_text:
        try:
            status = TaskStatus(status_text)
        except ValueError:
            allowed = ", ".join(s.value for s in TaskStatus)
            raise ValidationError(f"status must be one of {allowed}, not {status_text!r}", field="status") from None
    text = params.get("q", "").strip()
    if len(text) > MAX_TEXT_CHARS:
        raise ValidationError(f"q: at most {MAX_TEXT_CHARS} characters", field="q")
    meta_text = params.get("meta", "").strip()
    meta = next(iter(meta_pairs([meta_text], "meta").items())) if meta_text else None
    tenant = params.get("tenant", "").strip()
    if tenant:
        check_tenant_name(tenant)
    since, until = _date(params, "since"), _date(params, "until")
    if since and until and since > until:
        raise ValidationError(f"since ({since}) is after until ({until})", field="since")
    cursor = _integer(params, "cursor", 0, 0, MAX_CURSOR)
    limit = _integer(params, "limit", DEFAULT_ROOTS_PER_PAGE, 1, MAX_ROOTS_PER_PAGE)
    return RootFilter(
        status=status, text=text, meta=meta, tenant=tenant, since=since, until=until, cursor=cursor, limit=limit
    )


def _date(params: Mapping[str, str], name: str) -> dt.date | None:
    value = params.get(name, "").strip()
    if not value:
        return None
    try:
        day = dt.date.fromisoformat(value)
    except ValueError:
        raise ValidationError(f"{name} must be a date as YYYY-MM-DD, not {value!r}", field=name) from None
    # (The last day Python counts to has no next day, whose start is where `until` reads up to.)
    if day == dt.date.max:
        raise ValidationError(f"{name} must be a date up to {dt.date.max - dt.timedelta(days=1)}", field=name)
    return day


def _integer(params: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    value = params.get(name, "").strip()
    if not value:
        return default
    # The length first: Python refuses to read a number of more than 4,300 digits (a 500 where a 422 was due).
    if not ascii_digits(value) or not digits_within(value, len(str(high))) or not low <= int(value) <= high:
        raise ValidationError(f"{name} must be a whole number from {low} to {high}, not {value!r}", field=name)
    return int(value)


def _day_start_s(day: dt.date) -> float:
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC).timestamp()


def call_text(approval: Approval, max_chars: int = MAX_CALL_CHARS) -> str:
    """A tool call as one readable line: `tool(name="value", n=3)`, every value as JSON.

    JSON writes a quote, a newline or a control character in an argument as an
    escape, so a model cannot make the call look shorter or different than it is
    (nor break out into text of its own in the confirmation); characters that
    hide or reorder text are escaped too. Cut at `max_chars`, with a marker.
    """
    inner = ", ".join(
        f"{_arg_name(name)}={json.dumps(value, ensure_ascii=False)}" for name, value in approval.args.items()
    )
    text = visible_text(f"{approval.tool}({inner})")
    if len(text) > max_chars:
        text = text[:max_chars] + f" … ({len(text) - max_chars} more characters not shown)"
    return text


# An argument's name as written bare: an identifier. An MCP tool takes any names its model sends, and a name
# holding a quote, a parenthesis or a line break (`path="/tmp/x")` and a new line) made the call read as another.
ARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _arg_name(name: str) -> str:
    return name if ARG_NAME.fullmatch(name) else json.dumps(name, ensure_ascii=False)


def data_text(value: object) -> str:
    """A typed task's output as the page shows it: JSON, indented, every string's hidden characters escaped
    (`visible_text`); the template escapes it for HTML, so a `<script>` in the data is text on the page."""
    return visible_text(json.dumps(value, indent=2, ensure_ascii=False))


def find_roots(coord: Coordinator, wanted: RootFilter, owner: str | None = None) -> RootPage:
    """Roots newest first that match `wanted`, one page, over the API's history (`list_tasks`);
    with `owner`, only the trees that key created (a `read` key's view)."""
    since_s = _day_start_s(wanted.since) if wanted.since else None
    before_s = _day_start_s(wanted.until + dt.timedelta(days=1)) if wanted.until else None
    text = wanted.text.casefold()
    status = wanted.status.value if wanted.status else None
    # Matched in the history's own scan, as a status is (its children carry it too, and are skipped below).
    metadata = dict([wanted.meta]) if wanted.meta else None
    tenant = wanted.tenant or None
    found: list[HistoryItem] = []
    cursor, scanned = wanted.cursor, 0
    while True:
        items, next_cursor = coord.list_tasks(
            status=status, limit=MAX_PAGE, cursor=cursor, owner=owner, metadata=metadata, tenant=tenant
        )
        for n, item in enumerate(items):
            if since_s is not None and item.ts < since_s:
                return RootPage(found, None)  # the history is newest first: all the rest is older
            if item.depth != 0 or (before_s is not None and item.ts >= before_s):
                continue
            if text and text not in item.task.casefold():
                continue
            found.append(item)
            if len(found) == wanted.limit:
                # The cursor just past this item, counted as list_tasks counts (it skips expired tasks).
                after = coord.list_tasks(
                    status=status, limit=n + 1, cursor=cursor, owner=owner, metadata=metadata, tenant=tenant
                )
                return RootPage(found, after[1])
        scanned += len(items)
        if next_cursor is None:
            return RootPage(found, None)
        cursor = next_cursor
        if scanned >= MAX_SCANNED_PER_PAGE:
            return RootPage(found, cursor)


@dataclass(frozen=True)
class FoldedChild:
    """A child shown as one row of its parent's folded children: its figures, and a link to its page."""

    record: TaskRecord
    state: str

    @property
    def wall_ms(self) -> int:
        return times_of(self.record.timeline, int(time.time() * 1000)).wall_ms


@dataclass(frozen=True)
class TaskView:
    """One task of a tree as the page shows it: its record, plan, live state and waiting approvals."""

    record: TaskRecord
    todos: list[TodoItem]
    state: str  # one status: the record's once ended, else the live state (running, queued, ...)
    approvals: list[Approval]
    children: list[TaskView] = field(default_factory=list)
    # Children of a wide fan-out the page folds into one table (as the timeline folds their bars).
    folded: list[FoldedChild] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.record.status.terminal

    @property
    def has_unlinked(self) -> bool:
        return bool(self.record.unlinked_tokens or self.record.unlinked_cost_micros)


@dataclass(frozen=True)
class TreeView:
    root_id: str
    top: TaskView
    approvals: list[Approval]
    timeline: TimelineView | None = None
    # The tree's deliveries of outbound events, newest first, at most DELIVERIES_SHOWN (docs/webhooks.md).
    deliveries: list[Delivery] = field(default_factory=list)


# The deliveries panel shows the newest ones; `subq deliveries` and the API list them all.
DELIVERIES_SHOWN = 50


# -- the timeline: every task of the tree on one time axis ------------------------------------

# The bars are drawn in an SVG box this many units wide, stretched to the row (so no inline
# style is needed: the page's CSP allows none); a segment is at least MIN_SEGMENT wide to be seen.
AXIS_UNITS = 1000
MIN_SEGMENT_UNITS = 2.0
# A parent with more children than this shows its critical child and the latest to end, and
# folds the rest into a group that opens on demand, so a 1,000-child tree stays readable.
SIBLINGS_SHOWN = 12
GROUP_AT = 40
# The axis's ticks, besides 0.
AXIS_TICKS = 4


@dataclass(frozen=True)
class Segment:
    """One interval of a task's bar: its state (`queued`, `running`, `wait-<reason>`), where it is drawn."""

    state: str
    start_ms: int
    end_ms: int
    open: bool  # still going on (its end is now)
    x: float
    width: float
    held: bool = False  # the critical path's longest wait: what held the tree

    @property
    def label(self) -> str:
        return self.state.replace("wait-", "waiting: ").replace("_", " ")


@dataclass(frozen=True)
class ToolMark:
    """A tool call that ran, drawn as a thin span over its task's bar."""

    tool: str
    outcome: str
    start_ms: int
    end_ms: int
    x: float
    width: float


@dataclass(frozen=True)
class TimelineRow:
    """One task's bar: its place in the tree, its segments, its end's mark and its figures."""

    record: TaskRecord
    times: TaskTimes
    state: str
    critical: bool
    segments: list[Segment]
    end_x: float | None  # where its outcome's mark is drawn, once it ended
    tools: list[ToolMark] = field(default_factory=list)
    # Where its runs compacted their conversation to fit the model's window (times.compactions_ms): (ms, x).
    compactions: list[tuple[int, float]] = field(default_factory=list)

    @property
    def start_ms(self) -> int:
        return self.times.queued_at_ms or 0

    @property
    def end_ms(self) -> int | None:
        return self.times.ended_at_ms


@dataclass(frozen=True)
class TimelineGroup:
    """Siblings folded into one line (a wide fan-out): how many, their span, and their rows on demand."""

    parent_id: str
    depth: int
    count: int
    by_state: dict[str, int]
    x: float
    width: float
    start_ms: int
    end_ms: int
    rows: list[TimelineRow]


@dataclass(frozen=True)
class TimelineView:
    """The tree's waterfall: rows (and groups of rows) in tree order on one axis from `t0_ms`."""

    t0_ms: int
    span_ms: int
    now_ms: int
    ticks: list[tuple[float, str]]
    items: list[TimelineRow | TimelineGroup]
    critical: list[str]
    wall_ms: int
    held: CriticalStep | None = None  # the critical path's longest wait (timeline.held_longest)

    @property
    def held_label(self) -> str:
        """`waiting: approval` (or `queued`): what held the tree, as a segment of its kind is labelled."""
        if self.held is None:
            return ""
        interval = self.held.interval
        return f"waiting: {interval.reason.replace('_', ' ')}" if interval.reason else interval.state

    @property
    def reasons(self) -> list[str]:
        return [f"wait-{reason}" for reason in WAIT_REASONS]

    @property
    def folded_ids(self) -> set[str]:
        """The tasks whose bars are in a folded group (and, below, whose sections the page folds)."""
        return {row.record.id for item in self.items if isinstance(item, TimelineGroup) for row in item.rows}


def read_timeline(
    records: list[TaskRecord], states: Mapping[str, str], now_ms: int | None = None, keep: Set[str] = frozenset()
) -> TimelineView:
    """The waterfall of `records` (the first is the top of the tree shown, the rest its subtree in tree
    order): each task's intervals placed on one axis, the critical path marked, wide fan-outs grouped
    (a task in `keep`, one waiting for a person, is never folded away)."""
    waterfall = _Waterfall(records, states, int(time.time() * 1000) if now_ms is None else now_ms, keep)
    waterfall.place(records[0])
    return waterfall.view()


class _Waterfall:
    """One tree's timeline as read_timeline builds it: the axis (from the first queued to the last end), and
    the rows placed on it in tree order."""

    def __init__(self, records: list[TaskRecord], states: Mapping[str, str], now_ms: int, keep: Set[str]) -> None:
        self.states, self.now_ms, self.keep = states, now_ms, keep
        self.times = {r.id: times_of(r.timeline, now_ms) for r in records}
        # A task that has not ended ends now, on the axis and on the critical path.
        self.ends = {i: t.ended_at_ms if t.ended_at_ms is not None else now_ms for i, t in self.times.items()}
        starts = [t.queued_at_ms for t in self.times.values() if t.queued_at_ms is not None]
        self.t0_ms = min(starts) if starts else now_ms
        self.span_ms = max([self.t0_ms + 1, *self.ends.values()]) - self.t0_ms
        self.critical = critical_path(records, self.ends)
        self.held = held_longest(records, self.ends)
        self.children_of: dict[str, list[TaskRecord]] = {}
        for record in records[1:]:
            self.children_of.setdefault(record.parent_id or "", []).append(record)
        self.items: list[TimelineRow | TimelineGroup] = []

    def x(self, t_ms: int) -> float:
        return round((t_ms - self.t0_ms) / self.span_ms * AXIS_UNITS, 2)

    def width(self, start_ms: int, end_ms: int) -> float:
        """A span's width on the axis, at least MIN_SEGMENT_UNITS so that it can be seen."""
        return max(MIN_SEGMENT_UNITS, self.x(end_ms) - self.x(start_ms))

    def state_of(self, record: TaskRecord) -> str:
        return self.states.get(record.id, record.status.value)

    def segment(self, record: TaskRecord, interval: Interval) -> Segment:
        end_ms = interval.end_ms if interval.end_ms is not None else self.now_ms
        state = interval.state if interval.reason is None else f"wait-{interval.reason}"
        held = self.held
        holds = held is not None and held.task_id == record.id and held.interval.start_ms == interval.start_ms
        return Segment(
            state,
            interval.start_ms,
            end_ms,
            interval.end_ms is None,
            self.x(interval.start_ms),
            self.width(interval.start_ms, end_ms),
            holds,
        )

    def row(self, record: TaskRecord) -> TimelineRow:
        times = self.times[record.id]
        return TimelineRow(
            record,
            times,
            self.state_of(record),
            record.id in self.critical,
            [self.segment(record, interval) for interval in times.intervals],
            self.x(times.ended_at_ms) if times.ended_at_ms is not None else None,
            [
                ToolMark(c.tool, c.outcome, c.start_ms, c.end_ms, self.x(c.start_ms), self.width(c.start_ms, c.end_ms))
                for c in record.tool_calls
            ],
            [(ms, self.x(ms)) for ms in times.compactions_ms],
        )

    def place(self, record: TaskRecord) -> None:
        """`record`'s row, then its children's in order; past GROUP_AT children, those not shown are one group."""
        self.items.append(self.row(record))
        children = self.children_of.get(record.id, [])
        shown = self.shown(children)
        for child in children:
            if child.id in shown:
                self.place(child)
        rest = [c for c in children if c.id not in shown]
        if rest:  # none when every one is shown (a narrow fan-out, or every one waits for a person)
            self.items.append(self.group(record, rest))

    def shown(self, children: list[TaskRecord]) -> set[str]:
        """Which of a parent's children get rows of their own: all up to GROUP_AT; past it the critical child,
        the latest to end and the ones in `keep` stand out, and the rest fold into a group that opens on demand."""
        if len(children) <= GROUP_AT:
            return {c.id for c in children}
        latest = sorted(children, key=lambda c: self.ends[c.id], reverse=True)[:SIBLINGS_SHOWN]
        return {c.id for c in latest} | {c.id for c in children if c.id in self.critical or c.id in self.keep}

    def group(self, parent: TaskRecord, rest: list[TaskRecord]) -> TimelineGroup:
        """The folded children's line. A folded child's own subtree is on its page (its bar links there),
        not in the group."""
        first_ms = min(self.times[c.id].queued_at_ms or self.t0_ms for c in rest)
        last_ms = max(self.ends[c.id] for c in rest)
        by_state = Counter(self.state_of(c) for c in rest)
        return TimelineGroup(
            parent.id,
            rest[0].depth,
            len(rest),
            dict(sorted(by_state.items())),
            self.x(first_ms),
            self.width(first_ms, last_ms),
            first_ms,
            last_ms,
            [self.row(c) for c in rest],
        )

    def view(self) -> TimelineView:
        span_ms = self.span_ms
        ticks = [
            (round(AXIS_UNITS * n / AXIS_TICKS, 2), duration(span_ms * n // AXIS_TICKS)) for n in range(AXIS_TICKS + 1)
        ]
        return TimelineView(self.t0_ms, span_ms, self.now_ms, ticks, self.items, self.critical, span_ms, self.held)


def read_tree(coord: Coordinator, task_id: str) -> TreeView:
    """The subtree of `task_id` with every task's figures, plan, live state and pending approvals.

    Every record is read first (each task's children in one round trip), so the timeline can say which
    siblings of a wide fan-out it folds; the page folds the same ones below, as one table of their
    figures, and reads the plan of none of them (a 1,000-child page read 1,000 plans)."""
    root_id = ids.root_of(task_id)
    top_record = coord.get_task(task_id)  # NotFoundError for an unknown id, before anything else
    live: dict[str, LiveState] = coord.snapshot(root_id)
    approvals = coord.list_approvals(root_id)
    waiting: dict[str, list[Approval]] = {}
    for approval in approvals:
        waiting.setdefault(approval.task_id, []).append(approval)
    records: list[TaskRecord] = []
    children_of: dict[str, list[TaskRecord]] = {}
    states: dict[str, str] = {}

    def gather(record: TaskRecord) -> None:
        records.append(record)
        state = record.status.value
        if not record.status.terminal and record.id in live:
            state = live[record.id].state
        states[record.id] = state
        children_of[record.id] = coord.get_children(record.id) if record.child_ids else []
        for child in children_of[record.id]:
            gather(child)

    gather(top_record)
    timeline = read_timeline(records, states, keep=set(waiting))
    folded = timeline.folded_ids

    def view(record: TaskRecord) -> TaskView:
        children = [view(child) for child in children_of[record.id] if child.id not in folded]
        hidden = [FoldedChild(child, states[child.id]) for child in children_of[record.id] if child.id in folded]
        todos = coord.get_todos(record.id)
        return TaskView(record, todos, states[record.id], waiting.get(record.id, []), children, hidden)

    top = view(top_record)
    deliveries = coord.deliveries(root_id)[::-1][:DELIVERIES_SHOWN]
    return TreeView(
        root_id=root_id, top=top, approvals=[a for a in approvals if a.task_id in _ids(top)], timeline=timeline,
        deliveries=deliveries,
    )  # fmt: skip


def _ids(node: TaskView) -> set[str]:
    found = {node.record.id}
    for child in node.children:
        found |= _ids(child)
    return found
