"""A run's `task-progress` events through the worker consumer's own buffered event dispatcher.

Celery's consumer keeps one event dispatcher (`consumer.event_dispatcher`, made by
its Events bootstep). Where the worker runs its event loop (the hub, as it does on
the Redis transport) that dispatcher buffers every `task-*` event: `send` only appends it to a list and asks the hub to flush, and
the hub publishes everything buffered as one `task.multi` message on its next
turn. Celery's own task-received/started/succeeded events from the pool threads
go that way. A progress event sent the same way costs a list append and, at most,
a wakeup of the hub, instead of a dispatcher, a producer and a PUBLISH of its own
(about 240 µs of CPU), and it shares its publish with the task events around it.

It is safe from another thread (a run's progress is sent from the process's
agent loop, see workers/runtime/agent_loop.py): the buffer is a list that
threads append to, the flush and every publish take the dispatcher's lock, and
the hub's `call_soon` takes its own lock and wakes the hub's poller from another
thread (kombu's waker), so a buffered event is published at once, not at the
hub's next timer, even while the worker is otherwise idle.

Celery asks the hub to flush at its next turn after every buffered event, so a
worker whose tasks end at different moments publishes nearly once per event:
2.0 publishes a child in a bench where each child made five tool calls. The
step replaces that request with one that flushes at most every
`EVENT_FLUSH_EVERY_S` (`FlushPacer`): the first event of a quiet spell arms a
timer, the events until it fires share its publish. Celery still flushes at
once when a buffer holds `buffer_limit` (24) events, so a busy worker is not
held back, and the step flushes what is left when the worker shuts down. An
event reaches Flower at most that much later.

`ConsumerEvents`, a consumer bootstep after Celery's Events step, remembers
which consumer runs in this process; `buffered_dispatcher()` answers with its
dispatcher while that one buffers task events, and with None otherwise (no
worker here, as under `task.apply()`; a forked pool child; events off or the
connection being restored; a worker without a hub), where a caller publishes
the event itself, as before.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from celery import Celery, bootsteps
from celery.events import EventDispatcher
from celery.worker.consumer.events import Events

__all__ = ["EVENT_FLUSH_EVERY_S", "TASK_GROUP", "ConsumerEvents", "FlushPacer", "buffered_dispatcher", "install"]

log = logging.getLogger(__name__)

# Celery's name for the group of `task-*` events, the one the consumer buffers.
TASK_GROUP = "task"
# The most often the worker publishes its buffered task events (a tenth of the run's progress pace).
EVENT_FLUSH_EVERY_S = 0.1


class FlushPacer:
    """Asks the hub for one flush of the buffered events, `EVENT_FLUSH_EVERY_S` after the first unflushed one.

    Called from any thread (pool threads, the agent loop, the hub itself). Only `call_soon` is
    safe from another thread, so the timer is armed on the hub, by a callback it runs.
    """

    def __init__(self, hub: Any, flush: Callable[[], None]) -> None:
        self._hub, self._flush = hub, flush
        self._armed = False
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if self._armed:
                return
            self._armed = True
        self._hub.call_soon(self._arm)

    def _arm(self) -> None:
        self._hub.call_later(EVENT_FLUSH_EVERY_S, self._fire)

    def _fire(self) -> None:
        # Disarmed before the flush: an event buffered while it publishes arms the next one.
        with self._lock:
            self._armed = False
        self._flush()


class _Running:
    """The consumer running in this process, and which process that is (a forked child is not it)."""

    consumer: Any = None
    pid = 0


def buffered_dispatcher() -> EventDispatcher | None:
    """The consumer's dispatcher, when it is in this process and buffers task events; else None."""
    consumer = _Running.consumer
    if consumer is None or _Running.pid != os.getpid():
        return None
    # Read at each send: the Events step replaces the dispatcher when the connection is restored.
    dispatcher = consumer.event_dispatcher
    if dispatcher is None or not dispatcher.enabled or TASK_GROUP not in dispatcher.buffer_group:
        return None
    return dispatcher


class ConsumerEvents(bootsteps.StartStopStep):  # type: ignore[misc]  # Celery ships no type hints
    """Remembers the consumer, once its Events step has made the dispatcher."""

    requires = (Events,)

    def start(self, c: Any) -> None:
        _Running.consumer, _Running.pid = c, os.getpid()
        if c.hub is None:
            return
        # The consumer's attribute, for the dispatcher the Events step makes when the connection
        # is restored; the dispatcher's, for the one it made before this step started.
        if not isinstance(c.on_send_event_buffered, FlushPacer):
            c.on_send_event_buffered = FlushPacer(c.hub, c._flush_events)
        if c.event_dispatcher is not None and c.event_dispatcher.on_send_buffered is not None:
            c.event_dispatcher.on_send_buffered = c.on_send_event_buffered

    def shutdown(self, c: Any) -> None:
        if _Running.consumer is c:
            _Running.consumer = None
        # Events waiting for the pacer's timer (this step stops before Celery's Events step closes the dispatcher).
        dispatcher = getattr(c, "event_dispatcher", None)
        if dispatcher is not None:
            try:
                dispatcher.flush()
            except Exception as exc:  # a broker gone at shutdown loses these events, as Celery's own would be
                log.warning("subq: the last task events were not published at shutdown: %s", exc)


def install(app: Celery) -> None:
    """Add the bootstep to the worker's consumer (before the worker starts it)."""
    app.steps["consumer"].add(ConsumerEvents)
