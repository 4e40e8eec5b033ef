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


def state(coord: Coordinator) -> tuple[dict[str, object], int]:
    """Every subq key with its value, and the length of the coordinator's Celery queue."""
    client: redis.Redis = coord.client
    return coord.store.snapshot(), int(client.llen(coord.settings.queue))
