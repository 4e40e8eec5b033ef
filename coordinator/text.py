"""Checks of a caller's text that every layer shares, with no import of its own (the clients use them too).

- `lone_surrogate`: where a string holds a lone surrogate, which JSON's `\\ud800` and a command-line argument that
  is not UTF-8 give Python, but no store can hold (Redis takes UTF-8, Lua's cjson refuses it) and no JSON encoder
  writes back.
- `ascii_digits`: whether a string is a whole number in ASCII digits. `str.isdigit` also takes "²", which `int()`
  refuses, and "٣", which it reads as 3.
- `shows`, `all_shown`: whether a character (every character of a text) is drawn as itself: printable, and
  not one of the printable characters Unicode draws as nothing (a variation selector, a Hangul filler).
- `stream_id`: whether a string is a Redis stream entry's id, `<ms>-<seq>`, each part within 64 bits (a larger
  one matches the pattern and Redis refuses it: "Invalid stream ID").
"""

from __future__ import annotations

import re

__all__ = [
    "SHOWN_VALUE_CHARS",
    "all_shown",
    "ascii_digits",
    "cut_value",
    "digits_within",
    "drawn_as_nothing",
    "lone_surrogate",
    "shown_value",
    "shows",
    "stream_id",
]

# The largest part of a stream entry id Redis reads (an unsigned 64-bit number).
MAX_STREAM_ID_PART = 2**64 - 1
MAX_STREAM_ID_DIGITS = len(str(MAX_STREAM_ID_PART))
# The most of a value an error quotes: enough to recognise it. Quoted whole, a 900,000-character todo_id or profile
# name made a 900 KB error, in an API answer and in the context of the model whose delegation was refused.
SHOWN_VALUE_CHARS = 80


def digits_within(text: str, most: int) -> bool:
    """Whether `text` (ASCII digits) is a number of at most `most` digits, leading zeros aside: checked before
    `int()`, which refuses a number of more than 4,300 digits (a 500 where a 422 was due)."""
    return len(text.lstrip("0")) <= most


def cut_value(value: str, max_chars: int = SHOWN_VALUE_CHARS) -> str:
    """`value` as an error shows it: its first `max_chars` characters, and `...` if it is longer."""
    return value if len(value) <= max_chars else value[:max_chars] + "..."


def shown_value(value: str, max_chars: int = SHOWN_VALUE_CHARS) -> str:
    """`cut_value` quoted (its repr)."""
    return repr(cut_value(value, max_chars))


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
    # The length first: Python refuses to read a number of more than 4,300 digits (a 500 where a 422 was due).
    return (
        bool(dash)
        and all(ascii_digits(part) and digits_within(part, MAX_STREAM_ID_DIGITS) for part in (ms, seq))
        and max(int(ms), int(seq)) <= MAX_STREAM_ID_PART
    )


# Characters Python counts printable that are drawn as nothing: the Default_Ignorable_Code_Point of Unicode's
# DerivedCoreProperties (every range, though its format characters are non-printable already): the variation
# selectors (256 of them, one per byte value: a string of them carries any bytes, unseen), the Hangul fillers, the
# combining grapheme joiner, Mongolian free variation selectors and Khmer's inherent vowels.
_DRAWN_AS_NOTHING = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f"
    "\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0000-\U000e0fff]"
)


def drawn_as_nothing(ch: str) -> bool:
    """Whether the character is one Unicode draws as nothing (`_DRAWN_AS_NOTHING`), printable to Python or not."""
    return bool(_DRAWN_AS_NOTHING.match(ch))


def shows(ch: str) -> bool:
    """Whether the character is drawn as itself: printable (Python's: not Unicode's Other nor Separator, but the ASCII
    space) and not one of the printable characters drawn as nothing (`_DRAWN_AS_NOTHING`)."""
    return ch.isprintable() and not drawn_as_nothing(ch)


def all_shown(text: str) -> bool:
    """Whether every character of `text` is drawn as itself (`shows`), checked in C."""
    return text.isprintable() and not _DRAWN_AS_NOTHING.search(text)
