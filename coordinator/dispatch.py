"""Publishing work by task name: the coordinator never imports `workers`.

A parallel delegation is a group of `subq.run_task` messages, one per child:
each child writes itself back as it ends and the last one closes the batch
(coordinator/writeback.py), so no chord callback is needed, and subq's own runs
store no Celery result (`ignore_result`): the system of record is the task's
record in Redis. A Celery chord would store every child's result and count it in
a join, about 4.4 Redis round trips and 10 server commands per child
(bench/overhead.py), for a callback that found the batch already closed.
A sequential delegation is a chain built a step at a time: each step is one
`subq.run_task`, and the run that ends the step's child writes it back and
publishes the next step (coordinator/runs.py, `Run.end`). (A child that itself
delegates releases its worker and ends later, so the next step cannot be queued
up front; see docs/architecture.md.) Each step was once followed by a chained
`subq.advance` that wrote the same step back a second time; it is still
registered for such messages published before, and never published now.

The Celery task id of a task's first run is the task id, of its n-th
resume `<task id>-r<n>`, of a restart after a wait `<task id>-q<hex>`, and of a
run published again after one was lost `<task id>-x<n>`, so a publish retried after a failure names the same
Celery tasks, and the runner's lease makes a second delivery a no-op.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from celery import Celery, group
from celery.canvas import Signature
from celery.events import EventDispatcher

from coordinator import tracing
from coordinator.celery_app import RUN_TASK
from coordinator.models import Batch, TaskRecord

__all__ = [
    "SentEvents",
    "publish_again",
    "publish_batch",
    "publish_group",
    "publish_restart",
    "publish_retry",
    "publish_run",
    "publish_step",
    "run_signature",
]

log = logging.getLogger(__name__)

# A group's messages go to Redis in pipelines of this many: few round trips, and the first
# children reach the workers while the caller still prepares the rest of a wide batch.
PUBLISH_BATCH_MESSAGES = 16

# Flower shows argsrepr; keep it readable and short, never the prompt itself.
DESCRIPTION_REPR_CHARS = 60


def run_signature(app: Celery, task: TaskRecord, run_no: int = 0) -> Signature:
    # Never the prompt: a root has no description, and then shows none.
    argsrepr = f"task={task.id} parent={task.parent_id or '-'} todo={task.todo_id or '-'}"
    # Whom it runs for, and its priority: a checked name and a digit, safe to show (coordinator/tenants.py).
    argsrepr += f" tenant={task.tenant} priority={task.priority}"
    if task.description:
        argsrepr += f" desc={task.description[:DESCRIPTION_REPR_CHARS]!r}"
    if run_no:
        argsrepr += f" resume={run_no}"
    celery_id = task.id if run_no == 0 else f"{task.id}-r{run_no}"
    # No Celery result: the task's record is the result (a producer that sends
    # `subq.run_task` by name without this option still gets one).
    return app.signature(
        RUN_TASK, args=(task.id,), task_id=celery_id, immutable=True, argsrepr=argsrepr, ignore_result=True
    )


def publish_run(app: Celery, task: TaskRecord, run_no: int = 0) -> None:
    """Start (run_no 0) or resume (run_no n) an agent task on the fleet."""
    if run_no:
        with tracing.span("subq.resume", task_id=task.id, resume=run_no):
            run_signature(app, task, run_no).apply_async()
    else:
        run_signature(app, task, run_no).apply_async()


def publish_restart(app: Celery, task: TaskRecord, countdown_s: float = 0) -> None:
    """Start a run that waited (for a run slot or a stagger), outside any chord."""
    signature = run_signature(app, task)
    signature.set(task_id=f"{task.id}-q{secrets.token_hex(4)}")
    signature.apply_async(countdown=countdown_s or None)


def publish_again(app: Celery, task: TaskRecord, attempt: int) -> None:
    """A run of the task once more: its run was lost (a dead worker, a lost message) or handed back.

    Outside any chord: the task's end writes it back and closes its batch itself.
    """
    signature = run_signature(app, task)
    signature.set(task_id=f"{task.id}-x{attempt}")
    signature.apply_async()


def publish_retry(app: Celery, task: TaskRecord, retry_no: int) -> None:
    """A failed task's run once more, as a person asked (coordinator/retry.py): `<task>-t<n>`, the n-th retry."""
    signature = run_signature(app, task)
    signature.set(task_id=f"{task.id}-t{retry_no}")
    signature.apply_async()


def publish_batch(app: Celery, batch: Batch, children: list[TaskRecord]) -> None:
    with tracing.span("subq.publish", batch_id=batch.id, mode=batch.mode, children=len(children)):
        if batch.mode == "parallel":
            publish_group(app, [run_signature(app, child) for child in children])
        else:
            publish_step(app, children[0])


def publish_group(app: Celery, signatures: list[Signature]) -> None:
    """The signatures as one Celery group on one producer: their messages in Redis pipelines
    (kombu's producer batch, a round trip for PUBLISH_BATCH_MESSAGES messages instead of one
    each), then their `task-sent` events in one message."""
    with app.producer_or_acquire() as producer:
        sent = SentEvents(app, producer)
        with producer.batch(max_size=PUBLISH_BATCH_MESSAGES):
            group(signatures).apply_async(producer=producer, event_dispatcher=sent)
        # Reached once every message is published. A publish that fails discards the messages
        # of its pipeline not sent yet and sends no event; the batch is published again
        # (coordinator/delegation.py), and a child published twice runs once (its run's lease).
        sent.flush_sent()


class SentEvents(EventDispatcher):  # type: ignore[misc]  # Celery ships no type hints
    """The `task-sent` events of one group's publish, published together as one `task.multi` message.

    Celery publishes a message's sent event with `event_dispatcher.publish(...)`
    (app.amqp's `send_task_message`), through the message's producer, right after
    the message itself, so one PUBLISH a child; `publish` never buffers, whatever
    the dispatcher's `buffer_group`. This dispatcher keeps each event instead, made
    as Celery makes it (same fields, hostname, clock), and `flush_sent` publishes them
    in one message, a list, as Celery's workers send their own buffered task events:
    Flower and every event receiver read a `task.multi` message event by event. The
    caller flushes them once the messages are published (`publish_group`).
    Sent events are monitoring: a failed flush is logged, and the publish stands.
    """

    def __init__(self, app: Celery, producer: Any) -> None:
        # Disabled, like Celery's own sent-event dispatcher: it publishes through the given producer.
        super().__init__(producer.connection, app=app, enabled=False, buffer_while_offline=False)
        self._sent_producer = producer
        self._sent: list[dict[str, Any]] = []
        self._publish_options: dict[str, Any] = {}

    def publish(self, type: str, fields: dict[str, Any], producer: Any, blind: bool = False, **options: Any) -> None:
        self._sent.append(self._prepare_event(type, fields, blind=blind))
        self._publish_options = options  # the message's retry and retry policy

    def flush_sent(self) -> None:
        """Publish the events kept so far, as one message."""
        sent, self._sent = self._sent, []
        if not sent:
            return
        try:
            with self.mutex:
                self._publish(sent, self._sent_producer, "task.multi", **self._publish_options)
        except Exception as exc:  # monitoring must not fail a publish that succeeded
            log.warning("subq: could not send %d task-sent events: %s", len(sent), exc)


def publish_step(app: Celery, child: TaskRecord) -> None:
    """One step of a sequential batch: the child's run, which writes the step back when its child ends
    (a process that dies before that leaves the step on the due list, for the reconciler)."""
    run_signature(app, child).apply_async()
