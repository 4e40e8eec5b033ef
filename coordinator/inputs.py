"""Checks of free-form input shared by the service's operations (a prompt, a reason), and error lines."""

from __future__ import annotations

from coordinator.errors import ValidationError

__all__ = ["MAX_ERROR_CHARS", "one_line", "text_field"]

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
