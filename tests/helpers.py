"""Helpers shared by the tests: offline-model scripts and 'nothing changed' checks."""

from __future__ import annotations

import json
from typing import Any

import redis

from coordinator import Coordinator


def script(*steps: dict[str, Any], text: str = "Do the subtask.") -> str:
    """A task message carrying an offline-model script."""
    return f"{text}\n\n```subq-script\n{json.dumps({'steps': list(steps)})}\n```\n"


def usage_step(
    reply: str = "done", input: int = 1000, output: int = 500, cache_write: int = 2000, cache_read: int = 10_000
) -> dict[str, Any]:
    return {
        "reply": reply,
        "usage": {"input": input, "output": output, "cache_write": cache_write, "cache_read": cache_read},
    }


def state(coord: Coordinator, *roots: str) -> tuple[dict[str, object], int]:
    """subq's keys with their values, and the length of the coordinator's Celery queue.

    With `roots`, only those trees' keys (and the root and approval indexes): trees of
    earlier tests may still be settling in the background (a stopped run writes its
    last UI message as it unwinds), and must not count as a change made here.
    Counters every delegation bumps (history index, numbering, metrics) are left out.
    """
    prefix = coord.settings.key_prefix
    volatile = (f"{prefix}:tasks", f"{prefix}:task-number", f"{prefix}:metrics:", f"{prefix}:rate:")
    keys = {k: v for k, v in coord.store.snapshot().items() if not k.startswith(volatile)}
    if roots:
        shared = (f"{prefix}:roots", f"{prefix}:approvals")
        keys = {k: v for k, v in keys.items() if k in shared or any(f"{{{r}}}" in k for r in roots)}
    client: redis.Redis = coord.client
    return keys, int(client.llen(coord.settings.queue))
