"""A dead letter: a queue message no worker could decode or validate, kept with the reason.

The worker's consumer boundary (`workers/poison.py`) builds one with
`dead_letter(...)` for each message it takes off the queue and cannot run; the
store keeps them on one capped list per key prefix (`<prefix>:dead-letters`),
newest first. The raw message is kept as text, cut to MAX_MESSAGE_CHARS, so a
producer's bug can be read back and fixed, and a huge message cannot fill Redis.
"""

from __future__ import annotations

import hashlib
import time

from pydantic import BaseModel, ConfigDict

__all__ = ["MAX_DEAD_LETTERS", "MAX_MESSAGE_CHARS", "MAX_REASON_CHARS", "DeadLetter", "dead_letter", "message_digest"]

# The list keeps the newest this many: enough to read a bad producer's pattern, small enough
# (at most ~650 MB of raw text in the worst case, far less in practice) to bound Redis memory.
MAX_DEAD_LETTERS = 10_000
# A task message is a few KB; 64 KiB shows any real one whole, and caps a runaway one.
MAX_MESSAGE_CHARS = 64 * 1024
# A reason is one line for people; an exception's text can be long (it may quote the message).
MAX_REASON_CHARS = 1000
# Task names and ids are short; anything longer is not one, and is cut like the rest.
MAX_NAME_CHARS = 200


class DeadLetter(BaseModel):
    """One message taken off a queue and not run: when, from where, why, and what it was."""

    model_config = ConfigDict(frozen=True)

    ts: float  # when the worker took it off the queue (Unix seconds)
    queue: str  # the Celery queue (Redis list) it came from
    reason: str  # why it could not be run, for people
    task: str | None = None  # the task name, when the message names one
    id: str | None = None  # the Celery task id, when the message has one
    message: str  # the raw message as text, cut to MAX_MESSAGE_CHARS
    truncated: bool = False  # whether `message` was cut


def dead_letter(
    queue: str, reason: str, raw: str | bytes, *, task: object = None, task_id: object = None
) -> DeadLetter:
    """The dead letter of `raw` (the queue entry, or the message as JSON), cut to the limits.

    `task` and `task_id` come from the message itself, so anything may arrive: they are
    kept only when they are strings. Bytes that are not UTF-8 are kept as escapes.
    """
    text = raw.decode("utf-8", errors="backslashreplace") if isinstance(raw, bytes) else raw
    return DeadLetter(
        ts=time.time(),
        queue=queue,
        reason=reason[:MAX_REASON_CHARS],
        task=task[:MAX_NAME_CHARS] if isinstance(task, str) else None,
        id=task_id[:MAX_NAME_CHARS] if isinstance(task_id, str) else None,
        message=text[:MAX_MESSAGE_CHARS],
        truncated=len(text) > MAX_MESSAGE_CHARS,
    )


def message_digest(identity: str | bytes) -> str:
    """What tells a message from another on the dead-letter list: the digest of its `identity`, for a message
    kombu delivered its delivery tag, task id and body (what it keeps when kombu gives it back, where its text
    gains `redelivered` and the queue read may differ), else its raw text."""
    whole = identity if isinstance(identity, bytes) else identity.encode("utf-8", "surrogatepass")
    return hashlib.sha256(whole).hexdigest()
