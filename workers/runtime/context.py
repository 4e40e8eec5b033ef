"""What a worker process needs to run subq tasks: settings, the Coordinator, the Celery app.

Built once per process on first use (after any fork), shared by the pool's
threads: redis-py clients are thread-safe through their connection pool.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import redis
from celery import Celery

from coordinator.service import Coordinator
from coordinator.settings import Settings
from coordinator.store import Store

__all__ = ["Runtime", "build_runtime", "get_runtime"]


@dataclass(frozen=True)
class Runtime:
    settings: Settings
    coordinator: Coordinator

    @property
    def store(self) -> Store:
        return self.coordinator.store

    @property
    def app(self) -> Celery:
        return self.coordinator.app


_lock = threading.Lock()
_runtime: Runtime | None = None


def build_runtime(settings: Settings, app: Celery) -> Runtime:
    client = redis.Redis.from_url(settings.require_redis_url(), decode_responses=True)
    return Runtime(settings, Coordinator(settings, client=client, app=app))


def get_runtime(settings: Settings, app: Celery) -> Runtime:
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = build_runtime(settings, app)
        return _runtime
