"""A worker's background duties: the reconciler's loop, and handing runs back on shutdown.

Hooked on Celery's worker signals, in the worker's main process (the default
threads pool runs the subagents in that process too):
- `worker_ready`: a daemon thread runs the reconciler: the leader ticks every
  `SUBQ_RECONCILE_INTERVAL_S`; every worker runs one and the leader lease lets
  one of them work at a time, so no extra service is deployed. The thread also
  beats the process's heartbeat (`<p>:workers`), idle or not, every third of
  `SUBQ_HEARTBEAT_LAPSE_S` (as a run's lease is renewed), and counts the fleet.
- Clocks kept for the whole fleet run slower as it grows (`fleet_paced_s`,
  coordinator/reconciler.py): a
  non-leader's bid for the lead, and the webhook deliverer's idle poll
  (workers/outbound.py). Each process of N keeps them N times slower, so the
  fleet as a whole keeps the rate of one process whatever its size: an idle
  fleet of 8 made 8 times the claims and bids of one, each a round trip and
  the interpreter's lock taken from the runs (bench/overhead.py --processes,
  docs/benchmarks.md).
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
  (workers/runtime/mcp_servers.py), and the model latencies its runs measured
  since the heartbeat's last beat are added to the fleet's histogram.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery.signals import (
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from celery.worker import state as worker_state

from coordinator import ConfigError, task_of_run_id
from coordinator.reconciler import Reconciler
from workers import observe
from workers.application import app, settings
from workers.runtime import mcp_servers, profile_tools, providers
from workers.runtime.agent_loop import tune_gc
from workers.runtime.context import built_runtime, get_runtime

__all__ = ["fleet_size", "held_runs"]

log = logging.getLogger(__name__)

# This process's reconciler, once started: it knows the fleet's size as of its last beat.
_reconciler: Reconciler | None = None


def fleet_size() -> int:
    """The worker processes of this one's fleet as of its reconciler's last beat (1 before the first)."""
    return _reconciler.fleet_size if _reconciler is not None else 1


def held_runs() -> list[str]:
    """The tasks whose run message this process holds, started or not (Celery's worker state).

    Its reconciler's beat lists them (`<p>:reserved`): a message taken off the queue sits in the
    worker's memory until a thread is free to start its run, and on a loaded host that wait
    outlasted the reconciler's grace, so a run that was never lost was published again.
    """
    # `tuple(dict)` copies the keys in one step under the interpreter's lock, while the consumer
    # thread adds and removes requests.
    return [task for task in map(task_of_run_id, tuple(worker_state.requests)) if task]


def _start_reconciler(sender: Any = None, **_: Any) -> None:
    global _reconciler
    name = f"{getattr(sender, 'hostname', 'worker')}:{os.getpid()}"
    reconciler = _reconciler = Reconciler(get_runtime(settings, app).coordinator, name, held_runs)
    threading.Thread(
        target=reconciler.run_forever, args=(threading.Event(),), name="subq-reconciler", daemon=True
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
    # Before the first run, not inside it: a provider's SDK takes seconds to import.
    providers.load_sdks(list(settings.all_profiles().values()))


def _stop_mcp_servers(**_: Any) -> None:
    """The MCP servers this process started stop with it (each once its runs have ended)."""
    mcp_servers.stop_all()


def _flush_heartbeat(**_: Any) -> None:
    """The latencies of the runs since the heartbeat's last beat, which a sleeping beat thread would not add,
    and the late spend it has not recorded yet, tried a last time (a process that never built its runtime ran
    nothing)."""
    runtime = built_runtime()
    if runtime is not None:
        heartbeat = runtime.lifecycle.heartbeat
        heartbeat.late_spends.record(heartbeat.plane, last=True)
        heartbeat.add_latencies()


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
worker_shutdown.connect(_flush_heartbeat, weak=False)
worker_process_shutdown.connect(_stop_mcp_servers, weak=False)  # each child of the prefork pool
worker_process_shutdown.connect(_flush_heartbeat, weak=False)
