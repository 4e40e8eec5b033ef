"""The dead-letter list: queue messages no worker could decode or validate, newest first."""

from __future__ import annotations

import json

import pydantic

from coordinator.deadletters import MAX_DEAD_LETTERS, DeadLetter
from coordinator.errors import CorruptError
from coordinator.store.base import Part, _strs, translate_redis_errors
from coordinator.store.protocol import DeadLetterAdd

__all__ = ["DeadLetterStore"]


class DeadLetterStore(Part):
    """Add, list, count and purge dead letters (`<prefix>:dead-letters`, capped at MAX_DEAD_LETTERS, and each
    message's mark, `<prefix>:dead-letter-marks`)."""

    @translate_redis_errors
    def add_dead_letter(self, entry: DeadLetter, digest: str) -> bool:
        """Keep `entry` at the head of the list, unless the message of `digest` is on it already
        (dead_letter_add.lua: a message that came back after its worker died, or a write sent again after its
        reply was lost); the oldest past the cap are dropped in the same step. True when it was kept."""
        return self.scripts(
            DeadLetterAdd(
                letters=self.keys.dead_letters(), marks=self.keys.dead_letter_marks(),
                entry=entry.model_dump_json(), digest=digest, max_entries=MAX_DEAD_LETTERS,
            )
        )  # fmt: skip

    @translate_redis_errors
    def dead_letters(self, limit: int) -> list[DeadLetter]:
        """The newest `limit` dead letters, newest first."""
        found = []
        for index, raw in enumerate(_strs(self.client.lrange(self.keys.dead_letters(), 0, limit - 1))):
            try:
                found.append(DeadLetter.model_validate(json.loads(raw)))
            except (ValueError, pydantic.ValidationError):
                raise CorruptError(f"Dead letter {index} (newest first) is corrupt") from None
        return found

    @translate_redis_errors
    def count_dead_letters(self) -> int:
        return int(self.client.llen(self.keys.dead_letters()))

    @translate_redis_errors
    def purge_dead_letters(self) -> int:
        """Delete every dead letter and their marks; returns how many there were (read and deleted in one step)."""
        key = self.keys.dead_letters()
        with self.client.pipeline(transaction=True) as pipe:
            pipe.llen(key)
            pipe.delete(key, self.keys.dead_letter_marks())
            count, _ = pipe.execute()
        return int(count)
