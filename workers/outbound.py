"""A worker's deliverer of outbound events (coordinator/outbound.py): one thread per worker process.

Hooked on `worker_ready`, beside the reconciler (coordinator/reconciler.py): the
thread claims due deliveries from Redis and makes up to `SUBQ_WEBHOOK_CONCURRENCY`
attempts at once on its own non-blocking sockets (two helper threads resolve host
names and send Celery callbacks), so a slow or dead receiver holds those and never
a subagent's run slot. Everything it works from is in Redis: a
worker killed mid-attempt leaves its claims to lapse, and any worker takes them
then. An idle deliverer looks for due deliveries less often the longer it stays
idle (from `POLL_S` to `IDLE_QUIET_S`), and at the fleet's pace: each of N processes
N times less often (at most every `IDLE_POLL_MAX_S`), so an idle fleet looks about
once a second whatever its size (`IdlePace`, coordinator/reconciler.py).
"""

from __future__ import annotations

import threading
from typing import Any

from celery.signals import worker_ready

from coordinator import outbound
from coordinator.outbound import Deliverer
from coordinator.reconciler import IdlePace
from workers.application import app, settings
from workers.maintenance import fleet_size
from workers.runtime.context import get_runtime

__all__ = ["IDLE_POLL_MAX_S", "IDLE_QUIET_S", "start_deliverer"]

# After an idle spell a process looks this often (POLL_S at first, doubling): an approval or a tree's end
# still reaches its sink within a second or two, for a quarter of the idle polls.
IDLE_QUIET_S = 1.0
# An idle deliverer of a large fleet looks at least this often: a burst of due deliveries found by one
# process is joined by the others' free slots within this.
IDLE_POLL_MAX_S = 2.0


def start_deliverer(**_: Any) -> None:
    coordinator = get_runtime(settings, app).coordinator

    def send_task(name: str, args: list[Any], task_id: str, queue: str) -> None:
        # By name, as a producer sends `subq.submit` the other way: subq needs no import of the caller's code.
        coordinator.app.send_task(name, args=args, task_id=task_id, queue=queue)

    deliverer = Deliverer(coordinator, send_task)
    deliverer.idle_wait_s = IdlePace(outbound.POLL_S, IDLE_QUIET_S, IDLE_POLL_MAX_S, fleet_size).wait_s
    threading.Thread(
        target=deliverer.run_forever, args=(threading.Event(),), name="subq-deliveries", daemon=True
    ).start()


# weak=False: a module function that must live as long as the worker (as workers/maintenance.py's).
worker_ready.connect(start_deliverer, weak=False)
