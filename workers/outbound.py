"""A worker's deliverer of outbound events (coordinator/outbound.py): one thread per worker process.

Hooked on `worker_ready`, beside the reconciler (workers/maintenance.py): the
thread claims due deliveries from Redis and makes their attempts in a pool of
`SUBQ_WEBHOOK_CONCURRENCY` threads of its own, so a slow or dead receiver holds
those and never a subagent's run slot. Everything it works from is in Redis: a
worker killed mid-attempt leaves its claims to lapse, and any worker takes them
then.
"""

from __future__ import annotations

import threading
from typing import Any

from celery.signals import worker_ready

from coordinator.outbound import Deliverer
from workers.application import app, settings
from workers.runtime.context import get_runtime

__all__ = ["start_deliverer"]


def start_deliverer(**_: Any) -> None:
    coordinator = get_runtime(settings, app).coordinator

    def send_task(name: str, args: list[Any], task_id: str, queue: str) -> None:
        # By name, as a producer sends `subq.submit` the other way: subq needs no import of the caller's code.
        coordinator.app.send_task(name, args=args, task_id=task_id, queue=queue)

    deliverer = Deliverer(coordinator, send_task)
    threading.Thread(
        target=deliverer.run_forever, args=(threading.Event(),), name="subq-deliveries", daemon=True
    ).start()


# weak=False: a module function that must live as long as the worker (as workers/maintenance.py's).
worker_ready.connect(start_deliverer, weak=False)
