"""Checks of a caller's text that every layer shares, with no import of its own (the clients use them too).

- `lone_surrogate`: where a string holds a lone surrogate, which JSON's `\\ud800` and a command-line argument that
  is not UTF-8 give Python, but no store can hold (Redis takes UTF-8, Lua's cjson refuses it) and no JSON encoder
  writes back.
- `ascii_digits`: whether a string is a whole number in ASCII digits. `str.isdigit` also takes "²", which `int()`
  refuses, and "٣", which it reads as 3.
"""

from __future__ import annotations

__all__ = ["ascii_digits", "lone_surrogate"]


def lone_surrogate(text: str) -> str | None:
    """Where `text` holds a lone surrogate (`'\\ud800' at character 3`), or None when it has none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{text[exc.start]!a} at character {exc.start + 1}"
    return None


def ascii_digits(text: str) -> bool:
    """Whether `text` is one or more ASCII digits, and nothing else."""
    return text.isascii() and text.isdigit()
