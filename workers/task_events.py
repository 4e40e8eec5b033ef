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

`ConsumerEvents`, a consumer bootstep after Celery's Events step, remembers
which consumer runs in this process; `buffered_dispatcher()` answers with its
dispatcher while that one buffers task events, and with None otherwise (no
worker here, as under `task.apply()`; a forked pool child; events off or the
connection being restored; a worker without a hub), where a caller publishes
the event itself, as before.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery, bootsteps
from celery.events import EventDispatcher
from celery.worker.consumer.events import Events

__all__ = ["TASK_GROUP", "ConsumerEvents", "buffered_dispatcher", "install"]

# Celery's name for the group of `task-*` events, the one the consumer buffers.
TASK_GROUP = "task"


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

    def shutdown(self, c: Any) -> None:
        if _Running.consumer is c:
            _Running.consumer = None


def install(app: Celery) -> None:
    """Add the bootstep to the worker's consumer (before the worker starts it)."""
    app.steps["consumer"].add(ConsumerEvents)
