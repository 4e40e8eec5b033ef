"""The bare-Celery side of the benchmark: `celery -A bench.bare worker`.

The app comes from subq's own `make_app(load_settings())`, so pool,
concurrency, prefetch, acks, serializer, result backend and events are exactly
those of a subq worker started with the same `SUBQ_` environment. Only the
tasks differ: a no-op header and a chord callback that announces the join.
"""

from __future__ import annotations

import threading
from typing import Any

import redis
from celery import Task

from bench import JOIN, NOOP
from coordinator.celery_app import make_app
from coordinator.settings import load_settings

__all__ = ["app", "join", "noop"]

settings = load_settings()
app = make_app(settings)

_lock = threading.Lock()
_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    # One client per worker process, built after any fork; shared by the pool's threads.
    global _client
    with _lock:
        if _client is None:
            assert settings.redis_url
            _client = redis.Redis.from_url(settings.redis_url)
        return _client


# Bound, like subq's own tasks, so both modes pay the same call path.
@app.task(name=NOOP, bind=True)
def noop(self: Task) -> None:
    return None


@app.task(name=JOIN, bind=True, ignore_result=True)
def join(self: Task, results: Any, done_key: str) -> None:
    # RPUSH the number of header results the join saw: the benchmark BLPOPs this key,
    # which wakes it the moment the callback ran and lets it check the count.
    _redis().rpush(done_key, len(results) if isinstance(results, list) else -1)
