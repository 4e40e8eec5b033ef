"""Checks of free-form input shared by the service's operations (a prompt, a reason)."""

from __future__ import annotations

from coordinator.errors import ValidationError

__all__ = ["text_field"]


def text_field(value: object, field: str, max_chars: int) -> str:
    """A non-empty string of at most `max_chars`, or a ValidationError naming `field`."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{field} must be a non-empty string", field=field)
    if len(value) > max_chars:
        raise ValidationError(f"{field} is {len(value)} characters; the limit is {max_chars}", field=field)
    return value
