"""The todo-list grammar: parse, render, give stable ids, store.

A task's plan is a list of `TodoItem`s. Agents write it as markdown checkboxes
(`[ ] pending`, `[-] in progress`, `[x] done`) or as a JSON list of
`{"content", "status"?}` objects; the store keeps it as a hash of item JSON
(`to_hash` / `from_hash`). Which row a child's figures show on, across every
rewrite and delegation, is coordinator/todo_links.py (`merge`, `link_children`).
The rules are in docs/architecture.md ("Todo lists") and docs/todo-links.md.

Every function here is pure: it returns new lists and validates everything
before returning, so a rejected update leaves the caller's list as it was.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Mapping, Sequence

import pydantic

from coordinator.errors import CorruptError, TodoError
from coordinator.models import TodoItem, TodoStatus
from coordinator.text import drawn_as_nothing, shown_value

__all__ = [
    "IgnoredLine",
    "clean_content",
    "describe_ignored",
    "from_json",
    "ignored_lines",
    "normalise",
    "parse_json_items",
    "parse_markdown",
    "parse_update",
    "render_markdown",
    "to_json",
    "todo_id",
    "visible",
    "with_ids",
]

TODO_ID_HEX_CHARS = 12  # 48 bits: unique within any plan a person could read
# A plan is what a person reads and a parent's model keeps in its context: every update is stored whole,
# and every write-back reads one item of it. Bounded so that one update stays a few MB at the most.
MAX_TODO_ITEMS = 10_000
MAX_TODO_CONTENT_CHARS = 2_000
# The upstream grammar, `^(?:-\s*)?\[\s*([ xX\-~])\s*\]\s+(.+)$`, read in linear time: the
# mark (group 1) is a letter or sign, or absent when the box holds only spaces, at least one
# of them a plain space ("[ ]"; "[]" and "[\t]" are not boxes). The upstream pattern gave
# the box's spaces back one at a time to its mark: quadratic ("[" + 32k spaces + "x", 1.2 s).
_LINE_BREAK_RE = re.compile(r"\r\n?|\n")
LINE_RE = re.compile(r"^(?:-\s*+)?\[(?:\s*+([xX\-~])|(?=\s* )\s*+)\s*+\]\s+(.+)$")
_MARK_OF_STATUS = {TodoStatus.PENDING: " ", TodoStatus.IN_PROGRESS: "-", TodoStatus.COMPLETED: "x"}
# Agents also write "[X]" and "[~]"; they are read but never written back.
_STATUS_OF_MARK = {mark: status for status, mark in _MARK_OF_STATUS.items()}
_STATUS_OF_MARK |= {"X": TodoStatus.COMPLETED, "~": TodoStatus.IN_PROGRESS}
_JSON_KEYS = ("content", "status")
_STATUS_VALUES = frozenset(status.value for status in TodoStatus)
# Line breaks inside an item's content. Split on them and trim the pieces, rather than
# substitute `\s*[\r\n]+\s*`: that pattern backtracks over every run of spaces that no
# line break follows, quadratic in the run (16k spaces took 2.1 s).
_LINE_BREAKS_RE = re.compile(r"[\r\n]+")
# Format characters an editor writes unseen at a line's edges: a byte-order mark (a file saved by a Windows editor
# starts with one), zero-width spaces and joiners. Not whitespace to `str.strip`, one before a line's box hid the
# box from the grammar, and the item was dropped without a word.
_UNSEEN_EDGES = "\ufeff\u200b\u200c\u200d\u2060"
# Unicode's categories that never show a glyph of their own: controls, format characters (bidi marks, zero-width
# ones), surrogates, and the separators.
_UNSEEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zs", "Zl", "Zp"})
_EMPTY_HINT = (
    "write one item per line as '[ ] task', '[-] task' or '[x] task', or send a"
    ' JSON list of {"content": ..., "status": ...}; the list was left unchanged'
)


# A line that looks like a checkbox item but is not one of the grammar: a list marker
# ("* ", "+ ", "1. ", "2) ") before the box, an empty or unknown mark ("[]", "[?]"), no
# space or no text after the box. Between the brackets at most one mark (x, or a sign that
# is not a letter or digit) with spaces around it: "[link](url)", "[1]" footnotes and
# "[TODO]" tags do not look like a box.
# Possessive runs of spaces (`\s*+`): a run is never given back, so a line of many spaces
# with no closing bracket is read once, not once per space (quadratic: 20k spaces, 6 s).
NEAR_MISS_RE = re.compile(r"^([-*+]|\d{1,9}[.)])?\s*+\[(\s*+(?:[xX]|[^\w\s\[\]])?\s*+)\](.*)$")
# How many ignored lines an error message names; the rest are counted.
IGNORED_LINES_SHOWN = 3


class IgnoredLine(pydantic.BaseModel):
    """A line of a markdown update that looks like a plan item but is not one, and how to write it."""

    model_config = pydantic.ConfigDict(frozen=True)

    line: int  # from 1, as an editor numbers lines
    text: str
    suggestion: str

    def __str__(self) -> str:
        return f"line {self.line}: {shown_value(self.text)} is not a todo item; write {shown_value(self.suggestion)}"


def ignored_lines(update: object) -> list[IgnoredLine]:
    """The lines of a markdown update that look like items but do not match the grammar (none for JSON).

    The grammar stays the upstream one (docs/architecture.md, "Todo lists"); these
    lines are reported to whoever sent the update, with the line to write instead.
    """
    if not isinstance(update, str) or _is_json_list(update):
        return []
    found = []
    for number, line in enumerate(_markdown_lines(update), start=1):
        stripped = _trimmed(line)
        match = NEAR_MISS_RE.match(stripped) if "[" in stripped else None
        if match is None:
            continue
        marker, inner, after = match.groups()
        mark = inner.strip() or (" " if " " in inner else "")
        # What LINE_RE reads as an item, decided from the groups: no marker or "-", a known
        # mark (a space counts, "[]" has none), a space, then text.
        if marker in (None, "-") and mark in _STATUS_OF_MARK and after[:1].isspace() and after.strip():
            continue
        known = _MARK_OF_STATUS[_STATUS_OF_MARK[mark]] if mark in _STATUS_OF_MARK else " "
        content = clean_content(after) or "<what to do>"
        found.append(IgnoredLine(line=number, text=stripped, suggestion=f"[{known}] {content}"))
    return found


def describe_ignored(lines: Sequence[IgnoredLine]) -> str:
    """The first few ignored lines, for one line of an error or a tool result."""
    shown = "; ".join(str(line) for line in lines[:IGNORED_LINES_SHOWN])
    more = len(lines) - IGNORED_LINES_SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def normalise(content: str) -> str:
    """Content as ids see it: whitespace runs collapsed to one space, trimmed, case kept."""
    return " ".join(content.split())


def todo_id(content: str, occurrence: int) -> str:
    """The id of the `occurrence`-th (from 0) item whose normalised content is `content`'s."""
    digest = hashlib.sha256(f"{normalise(content)}\x00{occurrence}".encode())
    return digest.hexdigest()[:TODO_ID_HEX_CHARS]


def _markdown_lines(text: str) -> list[str]:
    """`text`'s lines, broken at "\r\n", "\n" or a lone "\r" (a producer that joins lines with it: its plan is
    still one item a line). Not str.splitlines, which also breaks on \x1c, \x85 or \u2028 inside content, so
    a rendered item would not read back as one item."""
    return _LINE_BREAK_RE.split(text)


def parse_markdown(text: str) -> list[TodoItem]:
    """Items of markdown checkbox lines; other lines are ignored. No item is a TodoError."""
    parsed: list[tuple[str, TodoStatus]] = []
    for number, line in enumerate(_markdown_lines(text), start=1):
        match = LINE_RE.match(_trimmed(line))
        if match and (content := clean_content(match.group(2))):
            if not visible(content):
                raise TodoError(
                    f"The todo update's line {number} is an item with no visible text ({content!a}): write what"
                    " to do after the box (the list was left unchanged)",
                    field="todos",
                )
            parsed.append((content, _STATUS_OF_MARK[match.group(1) or " "]))
    if not parsed:
        ignored = ignored_lines(text)
        if ignored:
            hint = describe_ignored(ignored) + " (the list was left unchanged)"
        elif (broken := _broken_json(text)) is not None:
            hint = f"it reads as the JSON form but is not a JSON list: {broken} (the list was left unchanged)"
        else:
            hint = _EMPTY_HINT
        raise TodoError(f"The todo update has no items: {hint}", field="todos")
    return with_ids(parsed, markdown=True)


def parse_json_items(items: object) -> list[TodoItem]:
    """Items of a list of `{"content": str, "status"?: str}` objects, or of its JSON text."""
    if isinstance(items, str):
        try:
            items = json.loads(items)
        except ValueError as exc:
            raise TodoError(f"The todo update is not valid JSON: {exc}", field="todos") from exc
        except RecursionError:  # "[[[[…": json gives up on deep nesting with RecursionError
            raise TodoError("The todo update is not valid JSON: nested too deeply", field="todos") from None
    if not isinstance(items, list):
        raise TodoError(f"The todo update must be a list of items, got {_json_kind(items)}", field="todos")
    parsed = [_json_item(index, entry) for index, entry in enumerate(items)]
    if not parsed:
        raise TodoError(f"The todo update has no items: {_EMPTY_HINT}", field="todos")
    return with_ids(parsed)


def parse_update(update: str | Sequence[object]) -> list[TodoItem]:
    """Items of an agent's update: markdown text, a JSON list, or the JSON text of one.

    Text whose stripped form starts with "[" and decodes as a JSON list is the
    JSON form; any other text is markdown. A list (or tuple) is the JSON form.
    """
    if isinstance(update, str):
        if _is_json_list(update):
            return parse_json_items(json.loads(update))
        return parse_markdown(update)
    # Sequence, not just list: list[object] is invariant, so a caller's
    # list[dict[str, str]] would not type-check against it. Bytes are excluded:
    # they are a sequence of ints, not of items.
    if isinstance(update, Sequence) and not isinstance(update, bytes | bytearray | memoryview):
        return parse_json_items(list(update))
    raise TodoError(
        f"The todo update must be markdown text or a list of items, got {_json_kind(update)}",
        field="todos",
    )


def render_markdown(items: Sequence[TodoItem]) -> str:
    """One `[ ]`/`[-]`/`[x]` line per item, in order; `parse_markdown` reads it back."""
    return "\n".join(f"[{_MARK_OF_STATUS[item.status]}] {item.content}" for item in items)


def to_json(items: Sequence[TodoItem]) -> str:
    """The stored form: a JSON array of item objects."""
    return json.dumps([item.model_dump(mode="json") for item in items], separators=(",", ":"))


ORDER_FIELD = "order"


def to_hash(items: Sequence[TodoItem]) -> dict[str, str]:
    """The stored form in Redis: a hash of item id -> item JSON, plus the order of the ids.

    One item can then be written back without decoding the whole list, so a
    fan-out of N children costs O(N), not O(N^2).
    """
    fields = {item.id: item.model_dump_json() for item in items}
    fields[ORDER_FIELD] = json.dumps([item.id for item in items], separators=(",", ":"))
    return fields


def from_hash(raw: Mapping[str, str]) -> list[TodoItem]:
    """Items of the stored hash form, in order; anything unreadable is a CorruptError."""
    if not raw:
        return []
    try:
        order = json.loads(raw[ORDER_FIELD])
    except (KeyError, ValueError):
        raise CorruptError("The stored todo list has no readable order", field="todos") from None
    if not isinstance(order, list) or not all(isinstance(i, str) for i in order):
        raise CorruptError("The stored todo list's order is not a list of ids", field="todos")
    missing = [i for i in order if i not in raw]
    if missing:
        raise CorruptError(f"The stored todo list lacks item {missing[0]}", field="todos")
    return from_json("[" + ",".join(raw[i] for i in order) + "]")


def from_json(text: str | bytes) -> list[TodoItem]:
    """Items of the stored form; anything undecodable is a CorruptError, never an empty list.

    Bytes are accepted as Redis returns them without `decode_responses`.
    """
    try:
        data = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise CorruptError(f"The stored todo list is not valid JSON: {exc}", field="todos") from exc
    if data == {}:
        return []  # Lua cjson encodes an empty table as an object
    if not isinstance(data, list):
        kind = _json_kind(data)
        raise CorruptError(f"The stored todo list is {kind}, not an array", field="todos")
    items: list[TodoItem] = []
    for index, raw in enumerate(data):
        try:
            items.append(TodoItem.model_validate(raw))
        except pydantic.ValidationError as exc:
            error = exc.errors()[0]
            path = ".".join(["todos", str(index), *(str(part) for part in error["loc"])])
            message = f"The stored todo item {index} is corrupt: {path}: {error['msg']}"
            raise CorruptError(message, field=path) from exc
    return items


def clean_content(content: str) -> str:
    """Content fit to render as one line and to store: trimmed, line breaks made spaces.

    Lone surrogates (which json.loads lets through from "\\ud800") become "?":
    they cannot be encoded as UTF-8 for Redis, nor decoded by Lua cjson.
    """
    content = content.encode("utf-8", "replace").decode("utf-8")
    pieces = (_trimmed(piece) for piece in _LINE_BREAKS_RE.split(content))
    return " ".join(piece for piece in pieces if piece)


def _trimmed(text: str) -> str:
    """`text` without whitespace nor unseen format characters (`_UNSEEN_EDGES`) at either end."""
    while (trimmed := text.strip().strip(_UNSEEN_EDGES)) != text:
        text = trimmed
    return text


def visible(content: str) -> bool:
    """Whether an item's content shows anything: a character that is no space, control or format character. A bidi
    override, a zero-width character or a Hangul filler alone made an item no one could read, which a list shown to
    a person must not hold. (A character this Python's Unicode does not know yet, a newer emoji, may show: it counts.)"""
    return any(
        not ch.isspace() and unicodedata.category(ch) not in _UNSEEN_CATEGORIES and not drawn_as_nothing(ch)
        for ch in content
    )


def with_ids(parsed: Sequence[tuple[str, TodoStatus]], *, markdown: bool = False) -> list[TodoItem]:
    """Items with ids numbered by occurrence among equal normalised contents; a TodoError past the bounds, naming
    the item's `content` in the JSON form, and `todos` in markdown's, which has no such path."""
    if len(parsed) > MAX_TODO_ITEMS:
        raise TodoError(
            f"The todo update has {len(parsed)} items; the limit is {MAX_TODO_ITEMS} (the list was left unchanged)",
            field="todos",
        )
    for index, (content, _) in enumerate(parsed):
        if len(content) > MAX_TODO_CONTENT_CHARS:
            raise TodoError(
                f"Todo item {index} is {len(content)} characters; the limit is {MAX_TODO_CONTENT_CHARS}"
                " (the list was left unchanged)",
                field="todos" if markdown else f"todos.{index}.content",
            )
    seen: dict[str, int] = {}
    items: list[TodoItem] = []
    for content, status in parsed:
        key = normalise(content)
        occurrence = seen.get(key, 0)
        seen[key] = occurrence + 1
        items.append(TodoItem(id=todo_id(content, occurrence), content=content, status=status))
    return items


def _json_item(index: int, entry: object) -> tuple[str, TodoStatus]:
    """The content and status of one JSON-form item, or a TodoError naming its index."""

    def bad(problem: str, key: str | None = None) -> TodoError:
        field = f"todos.{index}" if key is None else f"todos.{index}.{key}"
        return TodoError(f"Todo item {index} {problem}", field=field)

    if not isinstance(entry, dict):
        kind = _json_kind(entry)
        raise bad(f"must be an object with 'content' and an optional 'status', got {kind}")
    unknown = [str(key) for key in entry if key not in _JSON_KEYS]
    if unknown:
        names = ", ".join(repr(key) for key in unknown)
        raise bad(f"has unknown key(s) {names} (expected content, status)", unknown[0])
    content = entry.get("content")
    if content is not None and not isinstance(content, str):
        raise bad(f"content must be text, got {_json_kind(content)}", "content")
    if content is None or not (content := clean_content(content)):
        raise bad("has no content", "content")
    if not visible(content):
        raise bad(f"has no visible content ({content!a})", "content")
    status = entry.get("status", TodoStatus.PENDING.value)
    if not isinstance(status, str) or status not in _STATUS_VALUES:
        expected = "expected pending, in_progress or completed"
        raise bad(f"has an invalid status {status!r} ({expected})", "status")
    return content, TodoStatus(status)


def _broken_json(text: str) -> str | None:
    """What is wrong with an update that starts as JSON does (`[{`, `["`, `[[`, `[]`, `{`) but is no JSON list, or None
    for one that does not look like JSON: its error read as "no items" alone, which named no cause."""
    stripped = text.strip()
    if not (stripped.startswith("{") or re.match(r"\[\s*+[{\"\[\]]", stripped)):
        return None
    try:
        decoded = json.loads(stripped)
    except RecursionError:
        return "nested too deep"
    except ValueError as exc:
        return str(exc)
    return None if isinstance(decoded, list) else f"it is {_json_kind(decoded)}"


def _is_json_list(text: str) -> bool:
    """Whether update text is the JSON form: its stripped form starts with "[" and decodes as a list."""
    if not text.strip().startswith("["):
        return False
    try:
        decoded = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: "[[[[…" nested past json's limit
        return False  # "[ ] task" starts with "[" too: it is markdown
    return isinstance(decoded, list)


def _json_kind(value: object) -> str:
    """How a decoded JSON value is named in an error message."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    kinds |= {int: "a number", float: "a number", type(None): "null"}
    return kinds.get(type(value), f"a {type(value).__name__}")
