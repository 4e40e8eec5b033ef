"""A worker's background duties: the reconciler's loop, and handing runs back on shutdown.

Hooked on Celery's worker signals, in the worker's main process (the default
threads pool runs the subagents in that process too):
- `worker_ready`: a daemon thread runs `Reconciler.tick` every
  `SUBQ_RECONCILE_INTERVAL_S`; every worker runs one and the leader lease lets
  one of them work at a time, so no extra service is deployed. Each tick also
  beats the process's heartbeat (`<p>:workers`), idle or not.
- `worker_ready` also tunes the garbage collector for many runs in flight
  (`workers/runtime/agent_loop.py`).
- `worker_init`: every profile's tools are imported and checked (workers/runtime/profile_tools.py),
  a bad entry stops the worker at start with one line; with `SUBQ_WORKER_METRICS_PORT` set, the process serves its own
  Prometheus metrics (workers/observe.py) there; a port it cannot take stops
  the worker at start with one line naming the setting.
- `worker_shutting_down` (SIGTERM, SIGINT, SIGQUIT): every run of this process
  hands itself back at its next step boundary, within `SUBQ_SHUTDOWN_GRACE_S`
  (coordinator/runs.py), while Celery's warm shutdown waits for them.
- `worker_shutdown` (and `worker_process_shutdown` in a prefork child): the
  profiles' MCP servers this process started are stopped
  (workers/runtime/mcp_servers.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from celery.signals import (
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from coordinator import ConfigError
from coordinator.reconciler import Reconciler
from workers import observe
from workers.application import app, settings
from workers.runtime import mcp_servers, profile_tools
from workers.runtime.agent_loop import tune_gc
from workers.runtime.context import get_runtime

__all__ = ["reconcile_forever"]

log = logging.getLogger(__name__)


def reconcile_forever(reconciler: Reconciler, interval_s: float, stop: threading.Event | None = None) -> None:
    """Tick until `stop` is set (never, in a worker: the thread dies with the process)."""
    stop = stop or threading.Event()
    # The first beat at once, not after a tick's wait: a worker that answers pings counts as
    # present on /readyz from its start (a fresh fleet read `degraded` for its first tick).
    while True:
        started = time.monotonic()
        try:
            reconciler.beat()
            reconciler.tick()
        except Exception:  # Redis down, a bad record: log it and try again next tick
            log.exception("subq reconciler: a tick failed")
        if time.monotonic() - started > interval_s:
            log.warning("subq reconciler: a tick took %.1f s", time.monotonic() - started)
        if stop.wait(interval_s):
            return


def _start_reconciler(sender: Any = None, **_: Any) -> None:
    name = f"{getattr(sender, 'hostname', 'worker')}:{os.getpid()}"
    reconciler = Reconciler(get_runtime(settings, app).coordinator, name)
    threading.Thread(
        target=reconcile_forever, args=(reconciler, settings.reconcile_interval_s), name="subq-reconciler", daemon=True
    ).start()


def _serve_metrics(**_: Any) -> None:
    if settings.worker_metrics_port is None:
        return
    try:
        observe.serve(settings.worker_metrics_port, settings.worker_metrics_host)
    except ConfigError as exc:
        # SystemExit, not an exception: Celery logs and ignores a receiver's exceptions, and a
        # worker nobody can scrape would look idle on every dashboard.
        log.critical("subq worker: %s", exc)
        raise SystemExit(f"subq worker: {exc}") from None


def _check_tools(**_: Any) -> None:
    """Every profile's tools import and fit together, or the worker stops at start with one line."""
    try:
        profile_tools.check(settings)
    except ConfigError as exc:
        log.critical("subq worker: %s", exc)
        raise SystemExit(f"subq worker: {exc}") from None
    for line in profile_tools.policy_warnings(settings):
        log.warning("subq worker: warning: %s", line)


def _stop_mcp_servers(**_: Any) -> None:
    """The MCP servers this process started stop with it (each once its runs have ended)."""
    mcp_servers.stop_all()


def _hand_back_runs(**_: Any) -> None:
    get_runtime(settings, app).lifecycle.drain(settings.shutdown_grace_s)


# Connected by call, not by decorator: Celery's decorators are untyped (mypy --strict);
# weak=False because the receivers are module functions that must live as long as the worker.
worker_init.connect(_check_tools, weak=False)
worker_init.connect(_serve_metrics, weak=False)
worker_ready.connect(_start_reconciler, weak=False)
worker_ready.connect(tune_gc, weak=False)
worker_process_init.connect(tune_gc, weak=False)  # each child of the prefork pool
worker_shutting_down.connect(_hand_back_runs, weak=False)
worker_shutdown.connect(_stop_mcp_servers, weak=False)
worker_process_shutdown.connect(_stop_mcp_servers, weak=False)  # each child of the prefork pool
