"""Where a worker process's agents run: one event loop for all of them, and one stop watch.

A pool thread takes a Celery message, starts the run, and hands the agent's
coroutine to the process's one event loop (a thread of its own), then blocks
until the coroutine ends; it ends the run itself. Measured with 1000 runs that
each wait 1 s on their model, in one process: a pydantic-ai run costs about
2.5 ms of CPU on one shared loop against about 4.9 ms on an event loop per
pool thread, because a thousand threads that each wake their own loop spend
the difference taking the interpreter lock from each other (docs/benchmarks.md).
A coroutine runs in a copy of its pool thread's context, so the log lines of a
run (workers/observe.py) keep its ids.

A sync function tool runs in the process's own pool of threads
(`SYNC_CALL_THREADS`, kept for the life of the process), handed to pydantic-ai
with `Agent.using_thread_executor`. Left to pydantic-ai's default (anyio's
worker threads, tied to the task that started them), every call on the shared
loop started a thread and held the loop until it ran: 12% of the loop's time in
a bench of children making five tool calls each (docs/benchmarks.md).

Blocking calls made inside the coroutine (the store's, before each model
request and by the orchestration tools) hold the loop while Redis answers: a
few a run, each well under a millisecond, against the seconds a model takes.

While callbacks are ready, asyncio's loop asks its selector for I/O with no wait at every
turn: an `epoll_wait` that lets go of the interpreter lock, which one of the pool's threads
takes, so the loop, where every agent runs, waits for the lock back at every turn. The
loop's selector (`PacedSelector`) skips such a poll when the last one is under
`BUSY_POLL_EVERY_S` old: a busy loop still sees its sockets every millisecond, and an idle
one waits on them as before. Measured before and after in turns (bench/overhead.py, one
process, width 1000): a child's worker CPU 5.3-5.7 ms against 5.9-6.6, throughput
1.14-1.17x the bare agent's against 0.98-1.05x (docs/benchmarks.md).

The stop watch replaces a poll per run: every `CANCEL_POLL_S` it reads one
count that every stop moves (`RunLifecycle.stops_so_far`), and only when it
moved (or `FULL_LOOK_S` has passed) the status of every run of the process in
flight, in one round trip (`RunLifecycle.must_stop`); each run that must stop
has its model request abandoned at once. A thousand runs in flight that wait
on their models cost one small read a poll, not a thousand status reads (at
one read per run a poll, a run that waited 30 s on its model cost 120).
The poll is a timer of the agents' loop, armed while a run is watched: a
thread of its own, waking and taking the interpreter lock from the busy loop
for each step of its read, cost a child 0.66 ms of CPU at 8 processes against
0.07 at 1 on a busy 2-core host (bench/thread_cpu.py, docs/benchmarks.md); on
the loop, which is awake anyway, the read is one small blocking call like
those above.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import gc
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pydantic_ai import Agent

from coordinator import StoreError
from coordinator.runs import LIVE_EVERY_S, Run, RunLifecycle
from workers.runtime.thread_holds import HoldingExecutor

__all__ = [
    "BUSY_POLL_EVERY_S",
    "CANCEL_POLL_S",
    "FULL_LOOK_S",
    "GC_GEN0_OBJECTS",
    "SYNC_CALL_THREADS",
    "AgentLoop",
    "PacedSelector",
    "ProgressPacer",
    "StopWatch",
    "tune_gc",
]

log = logging.getLogger(__name__)

# How often the runs in flight look for a cancel of their own: a cancel stops a model
# request within this (plus the time to unwind), for one small read per process.
CANCEL_POLL_S = 0.25
# How often the watch reads every watched run's status even though no stop was counted: a
# task whose tree expired, or one stopped by a process that died before counting the stop,
# stops its run within this.
FULL_LOOK_S = 5.0

# The most sync tool calls a process runs at once; more wait for a thread (their timeouts still
# run). Threads are started as calls need them and kept: a blocking tool (a file, an HTTP call)
# holds one for its length, sixteen runs each making a few calls at once fit.
SYNC_CALL_THREADS = 64

# While the agents' loop has callbacks ready, it looks for I/O at most this often (PacedSelector).
BUSY_POLL_EVERY_S = 0.001

# The youngest generation is collected after this many allocations (Python's default: 700).
# With a thousand runs in flight on one event loop most young objects are still alive at a
# collection, and the default collected them again and again: it doubled a run's CPU
# (docs/architecture.md). The objects made at import are frozen out of every collection.
GC_GEN0_OBJECTS = 10_000

T = TypeVar("T")


def tune_gc(**_: Any) -> None:
    """Collect less often, and never the objects made at import (a worker's start signals call it)."""
    gc.freeze()
    gc.set_threshold(GC_GEN0_OBJECTS, *gc.get_threshold()[1:])


class PacedSelector(selectors.DefaultSelector):
    """The platform's selector, which skips a look with no wait (`timeout` 0: the loop has callbacks ready)
    made within `poll_every_s` of the last look. A wait (`timeout` None or above 0) always looks."""

    def __init__(self, poll_every_s: float = BUSY_POLL_EVERY_S) -> None:
        super().__init__()
        self._poll_every_s = poll_every_s
        self._looked_at = time.monotonic()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0 and time.monotonic() - self._looked_at < self._poll_every_s:
            return []
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        self._looked_at = time.monotonic()
        return ready


class AgentLoop:
    """The process's one event loop, started on first use (and again in a forked child)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sync_calls: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = 0

    def _running_loop(self) -> tuple[asyncio.AbstractEventLoop, concurrent.futures.ThreadPoolExecutor]:
        with self._lock:
            alive = self._thread is not None and self._thread.is_alive() and self._pid == os.getpid()
            if self._loop is None or self._sync_calls is None or not alive:
                loop = asyncio.SelectorEventLoop(PacedSelector())
                thread = threading.Thread(target=loop.run_forever, name="subq-agents", daemon=True)
                thread.start()
                # A forked child inherits the parent's pool without its threads: it makes its own.
                sync_calls = HoldingExecutor(SYNC_CALL_THREADS, thread_name_prefix="subq-tool")
                self._loop, self._thread, self._sync_calls, self._pid = loop, thread, sync_calls, os.getpid()
            return self._loop, self._sync_calls

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop, in a copy of the caller's context; block until it ends and return its result."""
        loop, sync_calls = self._running_loop()
        context = contextvars.copy_context()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def settle(task: asyncio.Task[T]) -> None:
            if task.cancelled():
                done.cancel()
            elif (exc := task.exception()) is not None:
                done.set_exception(exc)
            else:
                done.set_result(task.result())

        def start() -> None:
            if done.set_running_or_notify_cancel():
                loop.create_task(_with_sync_calls(coro, sync_calls), context=context).add_done_callback(settle)
            else:
                coro.close()

        loop.call_soon_threadsafe(start)
        return done.result()


async def _with_sync_calls(coro: Coroutine[Any, Any, T], sync_calls: concurrent.futures.Executor) -> T:
    # pydantic-ai reads its executor from a context variable: set inside the run's own task.
    with Agent.using_thread_executor(sync_calls):
        return await coro


class StopWatch:
    """The runs of this process that wait on a model, and one poll that stops those whose task was stopped.

    The poll runs on the loop of the watched runs (`_tick`), at once when the first run is watched, then
    every `poll_s` while any is; with none watched no timer is left (an idle process keeps no clock).
    """

    def __init__(
        self, lifecycle: RunLifecycle, poll_s: float = CANCEL_POLL_S, full_look_s: float = FULL_LOOK_S
    ) -> None:
        self._lifecycle = lifecycle
        self._poll_s = poll_s
        self._full_look_s = full_look_s
        # The stop count at the last full look, and when the next one is due regardless.
        self._stops_seen: int | None = None
        self._full_look_due = 0.0
        self._lock = threading.Lock()
        # By lease token, as the heartbeat keeps them: a task's stalled older run and its newer run may both be
        # watched in one process, and each is stopped on its own.
        self._watched: dict[str, tuple[Run, asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        # The loop whose timer polls, while one is armed (a forked child's new loop arms its own).
        self._ticking_on: asyncio.AbstractEventLoop | None = None

    def watch(self, run: Run) -> asyncio.Future[None]:
        """A future (of the running loop) that is set when `run` must stop; call `forget` when it ends."""
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._watched[run.token] = (run, loop, stop)
            arm = self._ticking_on is not loop
            if arm:
                self._ticking_on = loop
        if arm:
            loop.call_soon(self._tick, loop)
        return stop

    def forget(self, run: Run) -> None:
        with self._lock:
            watched = self._watched.get(run.token)
            if watched is not None and watched[0] is run:
                del self._watched[run.token]

    def poll(self) -> None:
        """One look at every watched run: set the stop of each that must stop now."""
        with self._lock:
            watched = dict(self._watched)
        if not watched:
            return
        runs = [run for run, _, _ in watched.values()]
        try:
            # The count first: a stop made after it is read moves it for the next poll.
            stops = self._lifecycle.stops_so_far()
            if stops == self._stops_seen and time.monotonic() < self._full_look_due:
                stopping = self._lifecycle.must_stop_here(runs)
            else:
                stopping = self._lifecycle.must_stop(runs)
                self._stops_seen, self._full_look_due = stops, time.monotonic() + self._full_look_s
        except StoreError as exc:  # a Redis blip is not a stop (it once ended runs as `cancelled`)
            log.warning("subq: the stop check of %d run(s) failed: %s", len(watched), exc)
            return
        for run in stopping:
            _, loop, stop = watched[run.token]
            loop.call_soon_threadsafe(_set, stop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """A poll on `loop`, then the next one `poll_s` after this one began, while a run is watched."""
        with self._lock:
            if self._ticking_on is not loop:
                return  # a timer left on a loop that is no longer the watch's
            if not self._watched:  # an idle process keeps no clock: `watch` arms the timer again
                self._ticking_on = None
                return
        started = time.monotonic()
        try:
            self.poll()
        except Exception:  # never let the watch die: every run in flight relies on it
            log.exception("subq: the stop watch failed")
        loop.call_later(max(0.0, self._poll_s - (time.monotonic() - started)), self._tick, loop)


class ProgressPacer:
    """The progress events of every run of the process, sent together at most every `LIVE_EVERY_S`.

    A run says it has progress to show (`due`, on the loop) and hands the function that sends its
    latest; the pacer calls every due run's at once, on one timer of the loop. Sent in one burst,
    they land in the worker's event buffer together and go out as one publish (workers/task_events.py):
    sixteen runs making quick tool calls cost one publish a quarter second, not one each per step.
    The first after a quiet spell goes at once; a run's last may follow its end by `LIVE_EVERY_S`.
    """

    def __init__(self) -> None:
        self._due: dict[str, Callable[[], None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._sent_at_s = 0.0

    def due(self, run_key: str, send: Callable[[], None]) -> None:
        self._due[run_key] = send
        if self._timer is None:
            wait_s = max(0.0, LIVE_EVERY_S - (time.monotonic() - self._sent_at_s))
            self._timer = asyncio.get_running_loop().call_later(wait_s, self._send)

    def _send(self) -> None:
        self._timer, self._sent_at_s = None, time.monotonic()
        due, self._due = self._due, {}
        for send in due.values():
            send()


def _set(stop: asyncio.Future[None]) -> None:
    if not stop.done():
        stop.set_result(None)
