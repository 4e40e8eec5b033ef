"""Tools of the compaction tests (tests/test_compaction.py), named by import path in their profiles."""

from __future__ import annotations

# One result of `read_chunk`: 8 KB, as issue 34's acceptance has it.
CHUNK_BYTES = 8 * 1024
_WORDS = ("the", "quick", "survey", "found", "seven", "ledgers", "with", "figures", "for", "each", "quarter", "and",
          "a", "note", "on", "every", "change")  # fmt: skip


def read_chunk(n: int) -> str:
    """Read chunk `n` of the report (8 KB of text)."""
    head = f"chunk {n}: "
    words: list[str] = []
    size = len(head)
    i = 0
    while size < CHUNK_BYTES:
        word = f"{_WORDS[(i * 7 + n) % len(_WORDS)]}{i % 97}"
        words.append(word)
        size += len(word) + 1
        i += 1
    return (head + " ".join(words))[:CHUNK_BYTES]
