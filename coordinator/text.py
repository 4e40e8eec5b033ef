"""Checks of a caller's text that every layer shares, with no import of its own (the clients use them too).

- `lone_surrogate`: where a string holds a lone surrogate, which JSON's `\\ud800` and a command-line argument that
  is not UTF-8 give Python, but no store can hold (Redis takes UTF-8, Lua's cjson refuses it) and no JSON encoder
  writes back.
- `ascii_digits`: whether a string is a whole number in ASCII digits. `str.isdigit` also takes "²", which `int()`
  refuses, and "٣", which it reads as 3.
- `stream_id`: whether a string is a Redis stream entry's id, `<ms>-<seq>`, each part within 64 bits (a larger
  one matches the pattern and Redis refuses it: "Invalid stream ID").
"""

from __future__ import annotations

__all__ = ["ascii_digits", "lone_surrogate", "stream_id"]

# The largest part of a stream entry id Redis reads (an unsigned 64-bit number).
MAX_STREAM_ID_PART = 2**64 - 1


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


def stream_id(text: str) -> bool:
    """Whether `text` is a Redis stream entry's id as Redis reads one: `<ms>-<seq>`, each within 64 bits."""
    ms, dash, seq = text.partition("-")
    return bool(dash) and ascii_digits(ms) and ascii_digits(seq) and max(int(ms), int(seq)) <= MAX_STREAM_ID_PART
