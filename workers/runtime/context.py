"""What a worker process needs to run subq tasks: settings, the Coordinator, the run-lifecycle seam.

Built once per process on first use (after any fork), shared by the pool's
threads: redis-py clients are thread-safe through their connection pool.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import redis
from celery import Celery

from coordinator import Coordinator, Settings
from coordinator.runs import RunLifecycle

__all__ = ["Runtime", "build_runtime", "get_runtime"]


@dataclass(frozen=True)
class Runtime:
    settings: Settings
    coordinator: Coordinator
    lifecycle: RunLifecycle


_lock = threading.Lock()
_runtime: Runtime | None = None


def build_runtime(settings: Settings, app: Celery) -> Runtime:
    client = redis.Redis.from_url(settings.require_redis_url(), decode_responses=True)
    coordinator = Coordinator(settings, client=client, app=app)
    return Runtime(settings, coordinator, RunLifecycle(coordinator))


def get_runtime(settings: Settings, app: Celery) -> Runtime:
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = build_runtime(settings, app)
        return _runtime
