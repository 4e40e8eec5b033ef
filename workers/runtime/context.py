"""What a worker process needs to run subq tasks: settings, the Coordinator, the run-lifecycle seam.

Built once per process on first use (after any fork), shared by the pool's
threads: redis-py clients are thread-safe through their connection pool.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from celery import Celery

from coordinator import Coordinator, Settings, redis_client
from coordinator.runs import RunLifecycle
from workers.observe import WorkerRunHooks, count_replica_shortfalls
from workers.runtime.agent_loop import AgentLoop, ProgressPacer, StopWatch
from workers.runtime.profile_tools import Toolbox
from workers.runtime.sandbox import Sandbox

__all__ = ["CONNECTION_WAIT_S", "SPARE_CONNECTIONS", "Runtime", "build_runtime", "built_runtime", "get_runtime"]


@dataclass(frozen=True)
class Runtime:
    settings: Settings
    coordinator: Coordinator
    lifecycle: RunLifecycle
    # Every run's agent of the process runs on this one loop, watched by this one poll.
    agent_loop: AgentLoop = field(default_factory=AgentLoop)
    stop_watch: StopWatch = field(init=False)
    # ... and its runs' progress events go out together from it.
    progress_pacer: ProgressPacer = field(default_factory=ProgressPacer)
    # Each profile's tools and agent, built once per process.
    toolbox: Toolbox = field(init=False)
    # What the process's sandboxed commands may not see (subq's own files).
    sandbox: Sandbox = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_watch", StopWatch(self.lifecycle))
        object.__setattr__(self, "toolbox", Toolbox(self.settings))
        object.__setattr__(self, "sandbox", Sandbox.of(self.settings))


_lock = threading.Lock()
_runtime: Runtime | None = None


# Connections beyond one per pool thread: the heartbeat, the reconciler, the consumer's dead letters.
SPARE_CONNECTIONS = 16
# A thread that finds every connection busy waits this long for one before its call fails.
CONNECTION_WAIT_S = 20


def build_runtime(settings: Settings, app: Celery) -> Runtime:
    # One connection per pool thread, and a pool that makes a thread wait rather than fail:
    # redis-py's default pool refuses a 101st connection, which failed runs at random once
    # more than about 100 ran at once in one process (bench/in_flight.py measured it).
    client = redis_client(
        settings, max_connections=settings.worker_concurrency + SPARE_CONNECTIONS, pool_timeout_s=CONNECTION_WAIT_S
    )
    coordinator = Coordinator(settings, client=client, app=app)
    count_replica_shortfalls(coordinator.replica_shortfalls)
    return Runtime(settings, coordinator, RunLifecycle(coordinator, hooks=WorkerRunHooks()))


def built_runtime() -> Runtime | None:
    """This process's runtime if a run or the reconciler built it, else None (nothing to hand back or add)."""
    return _runtime


def get_runtime(settings: Settings, app: Celery) -> Runtime:
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = build_runtime(settings, app)
        return _runtime
