"""What the pages show, read through the Coordinator: a page of roots, a tree, a conversation.

Plain functions over the same service operations the API uses, so a figure on
a page is the figure the API returns for the same task.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from coordinator import ids
from coordinator.errors import ValidationError
from coordinator.inputs import visible_text
from coordinator.models import Approval, HistoryItem, LiveState, TaskRecord, TaskStatus, TodoItem
from coordinator.service import MAX_PAGE, Coordinator

__all__ = [
    "DEFAULT_ROOTS_PER_PAGE",
    "MAX_ROOTS_PER_PAGE",
    "RootFilter",
    "RootPage",
    "TaskView",
    "TreeView",
    "call_text",
    "find_roots",
    "parse_root_filter",
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
ROOT_FILTER_PARAMS = ("status", "q", "since", "until", "cursor", "limit")
# The history index holds cursor offsets; above this an offset cannot be a real position.
MAX_CURSOR = 2**53


@dataclass(frozen=True)
class RootFilter:
    status: TaskStatus | None = None
    text: str = ""
    since: dt.date | None = None  # inclusive, UTC
    until: dt.date | None = None  # inclusive, UTC
    cursor: int = 0
    limit: int = DEFAULT_ROOTS_PER_PAGE

    def query(self, cursor: int) -> dict[str, str]:
        """This filter as query parameters, at another cursor (the "next page" link)."""
        params = {
            "status": self.status.value if self.status else "",
            "q": self.text,
            "since": self.since.isoformat() if self.since else "",
            "until": self.until.isoformat() if self.until else "",
            "limit": str(self.limit) if self.limit != DEFAULT_ROOTS_PER_PAGE else "",
            "cursor": str(cursor) if cursor else "",
        }
        return {name: value for name, value in params.items() if value}


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
    since, until = _date(params, "since"), _date(params, "until")
    if since and until and since > until:
        raise ValidationError(f"since ({since}) is after until ({until})", field="since")
    cursor = _integer(params, "cursor", 0, 0, MAX_CURSOR)
    limit = _integer(params, "limit", DEFAULT_ROOTS_PER_PAGE, 1, MAX_ROOTS_PER_PAGE)
    return RootFilter(status=status, text=text, since=since, until=until, cursor=cursor, limit=limit)


def _date(params: Mapping[str, str], name: str) -> dt.date | None:
    value = params.get(name, "").strip()
    if not value:
        return None
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise ValidationError(f"{name} must be a date as YYYY-MM-DD, not {value!r}", field=name) from None


def _integer(params: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    value = params.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or not low <= int(value) <= high:
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
    inner = ", ".join(f"{name}={json.dumps(value, ensure_ascii=False)}" for name, value in approval.args.items())
    text = visible_text(f"{approval.tool}({inner})")
    if len(text) > max_chars:
        text = text[:max_chars] + f" … ({len(text) - max_chars} more characters not shown)"
    return text


def find_roots(coord: Coordinator, wanted: RootFilter) -> RootPage:
    """Roots newest first that match `wanted`, one page, over the API's history (`list_tasks`)."""
    since_s = _day_start_s(wanted.since) if wanted.since else None
    before_s = _day_start_s(wanted.until + dt.timedelta(days=1)) if wanted.until else None
    text = wanted.text.casefold()
    status = wanted.status.value if wanted.status else None
    found: list[HistoryItem] = []
    cursor, scanned = wanted.cursor, 0
    while True:
        items, next_cursor = coord.list_tasks(status=status, limit=MAX_PAGE, cursor=cursor)
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
                return RootPage(found, coord.list_tasks(status=status, limit=n + 1, cursor=cursor)[1])
        scanned += len(items)
        if next_cursor is None:
            return RootPage(found, None)
        cursor = next_cursor
        if scanned >= MAX_SCANNED_PER_PAGE:
            return RootPage(found, cursor)


@dataclass(frozen=True)
class TaskView:
    """One task of a tree as the page shows it: its record, plan, live state and waiting approvals."""

    record: TaskRecord
    todos: list[TodoItem]
    state: str  # one status: the record's once ended, else the live state (running, queued, ...)
    approvals: list[Approval]
    children: list[TaskView] = field(default_factory=list)

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


def read_tree(coord: Coordinator, task_id: str) -> TreeView:
    """The subtree of `task_id` with every task's figures, plan, live state and pending approvals."""
    root_id = ids.root_of(task_id)
    top_record = coord.get_task(task_id)  # NotFoundError for an unknown id, before anything else
    live: dict[str, LiveState] = coord.snapshot(root_id)
    approvals = coord.list_approvals(root_id)
    waiting: dict[str, list[Approval]] = {}
    for approval in approvals:
        waiting.setdefault(approval.task_id, []).append(approval)

    def view(record: TaskRecord) -> TaskView:
        state = record.status.value
        if not record.status.terminal and record.id in live:
            state = live[record.id].state
        children = [view(coord.get_task(child_id)) for child_id in record.child_ids]
        todos = coord.get_todos(record.id)
        return TaskView(record, todos, state, waiting.get(record.id, []), children)

    top = view(top_record)
    return TreeView(root_id=root_id, top=top, approvals=[a for a in approvals if a.task_id in _ids(top)])


def _ids(node: TaskView) -> set[str]:
    found = {node.record.id}
    for child in node.children:
        found |= _ids(child)
    return found
