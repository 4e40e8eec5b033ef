"""The Celery tasks: thin wrappers that validate input and hand off to plain functions.

Task names are the contract (`subq.<verb>`); producers send by name and need
not import this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import Task

from coordinator import CorruptError, StoreError, SubtaskResult, is_batch_id, is_task_id
from coordinator.celery_app import ADVANCE, RUN_TASK
from workers import submit as submission
from workers import task_events
from workers.application import app, settings
from workers.observe import run_context
from workers.runtime.context import get_runtime
from workers.runtime.runner import run_child

__all__ = ["advance", "progress_sender", "run_task", "submit"]

log = logging.getLogger(__name__)

# A Redis blip must not lose a run (its parent would wait forever): the delivery is
# retried with backoff. Every step is idempotent, so running one again is safe.
# Twenty retries, each wait drawn up to a doubling bound capped at a minute, span up to
# about a quarter of an hour. (A second delivery of a running task is answered at once:
# its run's start finds the lease held.) A stored entry that does not read (CorruptError)
# is no outage: trying again reads it the same, so the delivery fails at once with the
# error, for an operator to see.
RETRIED: dict[str, Any] = {
    "autoretry_for": (StoreError,),
    "dont_autoretry_for": (CorruptError,),
    "retry_backoff": 2,
    "retry_backoff_max": 60,
    "max_retries": 20,
}


# Any Celery producer starts a run by name (docs/celery-contract.md).
submit = submission.register(app, settings)
# A run's progress events ride the consumer's buffered task events.
task_events.install(app)


@app.task(name=RUN_TASK, bind=True, **RETRIED)
def run_task(self: Task, task_id: Any) -> dict[str, Any]:
    if not isinstance(task_id, str) or not is_task_id(task_id):
        log.error("subq.run_task: task_id must be a subq task id, got %r", task_id)
        return SubtaskResult(
            child_id=str(task_id)[:64], status="failed", error="task_id is not a subq task id",
            error_class="ValidationError",
        ).model_dump(mode="json")  # fmt: skip
    # Every line logged during the run carries its ids (workers/observe.py).
    with run_context(task_id, worker=str(self.request.hostname or "")):
        result = run_child(get_runtime(settings, app), task_id, progress=progress_sender(self))
        log.info("subq.run_task %s: %s", task_id, result.status)
    return result.model_dump(mode="json")


def progress_sender(task: Task) -> Callable[[dict[str, Any]], None]:
    """The runner's per-response progress as a `task-progress` event, which Flower shows.

    The event names this task's delivery as `Task.send_event` does, read here, in
    the thread that runs the task: the agent runs on the process's one event loop,
    another thread, where Celery's current request is not this task's. Progress is
    best effort: no retry, and a failed send is logged, so a broker hiccup never
    stalls or fails a subagent's run.
    """
    hostname, delivery_id = task.request.hostname, task.request.id

    def send(info: dict[str, Any]) -> None:
        try:
            # In a worker, the consumer's dispatcher buffers it with the task events around it
            # (workers/task_events.py); elsewhere (task.apply(), events off) it is published alone.
            buffered = task_events.buffered_dispatcher()
            if buffered is not None:
                buffered.send("task-progress", uuid=delivery_id, retry=False, **info)
                return
            with task.app.events.default_dispatcher(hostname=hostname) as dispatcher:
                dispatcher.send("task-progress", uuid=delivery_id, retry=False, **info)
        except Exception as exc:  # monitoring must not end a run
            log.warning("subq: could not send a task-progress event: %s", exc)

    return send


@app.task(name=ADVANCE, bind=True, ignore_result=True, **RETRIED)
def advance(self: Task, result: Any, batch_id: Any) -> None:
    """One step of a sequential batch has returned: write it back, start the next."""
    if _batch_id_ok(batch_id):
        get_runtime(settings, app).lifecycle.settle_batch(batch_id)


def _batch_id_ok(batch_id: Any) -> bool:
    if isinstance(batch_id, str) and is_batch_id(batch_id):
        return True
    log.error("subq write-back: batch_id must be a subq batch id, got %r", batch_id)
    return False
