"""Checks of input shared by the service's operations (a prompt, a reason, a page, a budget), and error lines.

Light on purpose (no Redis, no Celery): the CLI runs the same checks before it
sends a request to the HTTP API, whose schema would otherwise refuse some of
these inputs in its own words (docs/cli.md: the same errors either way).
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from coordinator import ids
from coordinator.errors import ValidationError
from coordinator.models import TaskStatus, usd_to_micros

__all__ = [
    "DEFAULT_PAGE",
    "MAX_ERROR_CHARS",
    "MAX_PAGE",
    "MAX_PROMPT_CHARS",
    "check_dead_letter_limit",
    "check_history_query",
    "one_line",
    "text_field",
    "to_micros",
    "visible_text",
]

MAX_PROMPT_CHARS = 200_000
# History pages: enough for a screen, bounded so one call stays cheap.
DEFAULT_PAGE = 50
MAX_PAGE = 500

# One line of an error is enough to act on; no traceback crosses over.
MAX_ERROR_CHARS = 300


def text_field(value: object, field: str, max_chars: int) -> str:
    """A non-empty string of at most `max_chars`, or a ValidationError naming `field`."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{field} must be a non-empty string", field=field)
    if len(value) > max_chars:
        raise ValidationError(f"{field} is {len(value)} characters; the limit is {max_chars}", field=field)
    return value


def one_line(text: str, max_chars: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line, whitespace collapsed, cut to `max_chars` with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= max_chars else line[: max_chars - 1] + "…"


def visible_text(text: str) -> str:
    """`text` as it may be shown: every non-printable character but the new line written as its escape.

    A model's words (a plan item, an error, a tool call's arguments) reach an
    operator's terminal and browser. On a terminal an ESC starts a sequence (clear
    the screen, retitle the window, write the clipboard with OSC 52) and a CR
    overwrites the line; anywhere, a bidi override or a zero-width character makes
    text read as something other than it is. Written as `\\x1b`, `\\r`, `\\u202e`,
    they are only text. (Python's non-printable: Unicode's Other and Separator
    categories, but the ASCII space.)
    """
    return "".join(ch if ch == "\n" or ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def check_history_query(status: str | None, root_id: str | None, limit: int, cursor: int) -> None:
    """A history query's filters and page, or a ValidationError naming the first bad one."""
    if status is not None and status not in {s.value for s in TaskStatus}:
        allowed = ", ".join(s.value for s in TaskStatus)
        raise ValidationError(f"status must be one of {allowed}, not {status!r}", field="status")
    if not 1 <= limit <= MAX_PAGE:
        raise ValidationError(f"limit must be between 1 and {MAX_PAGE}", field="limit")
    if cursor < 0:
        raise ValidationError("cursor must not be negative", field="cursor")
    if root_id is not None:
        ids.root_of(root_id, field="root_id")


def check_dead_letter_limit(limit: object) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ValidationError(f"limit must be an integer between 1 and {MAX_PAGE}", field="limit")


def to_micros(value: object, field: str) -> int:
    """A budget in USD as integer micro-USD (0: none); a positive number or an error naming the field."""
    if value is None:
        return 0
    try:
        number = isinstance(value, (int, float, str, Decimal)) and not isinstance(value, bool)
        usd = Decimal(str(value)) if number else None
    except InvalidOperation:
        usd = None
    if usd is None or not usd.is_finite() or usd <= 0:
        raise ValidationError(f"{field} must be a positive number of US dollars, not {value!r}", field=field)
    micros = usd_to_micros(usd)
    if micros < 1:
        raise ValidationError(f"{field} must be at least one micro-dollar (0.000001)", field=field)
    return micros
