"""The Celery tasks: thin wrappers that validate input and hand off to plain functions.

Task names are the contract (`subq.<verb>`); producers send by name and need
not import this module.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task

from coordinator.dispatch import ADVANCE, GATHER, RUN_TASK
from coordinator.errors import StoreError
from coordinator.ids import is_task_id
from coordinator.models import SubtaskResult
from workers import delegation
from workers.app import app, settings
from workers.runtime.context import get_runtime
from workers.runtime.runner import run_child

__all__ = ["advance", "gather", "run_task"]

log = logging.getLogger(__name__)

# A Redis blip must not lose a callback (the parent would wait forever) nor fail a
# chord header: store errors are retried with backoff. Every step is idempotent, so
# running one again is safe. Ten tries with backoff capped at a minute span ~6 minutes.
RETRY_STORE_ERRORS: dict[str, Any] = {
    "autoretry_for": (StoreError,),
    "retry_backoff": True,
    "retry_backoff_max": 60,
    "max_retries": 10,
}


@app.task(name=RUN_TASK, bind=True, **RETRY_STORE_ERRORS)
def run_task(self: Task, task_id: Any) -> dict[str, Any]:
    if not isinstance(task_id, str) or not is_task_id(task_id):
        log.error("subq.run_task: task_id must be a subq task id, got %r", task_id)
        return SubtaskResult(
            child_id=str(task_id)[:64], status="failed", error="task_id is not a subq task id",
            error_class="ValidationError",
        ).model_dump(mode="json")  # fmt: skip
    return run_child(get_runtime(settings, app), task_id).model_dump(mode="json")


@app.task(name=GATHER, bind=True, ignore_result=True, **RETRY_STORE_ERRORS)
def gather(self: Task, results: Any, batch_id: str) -> None:
    if not isinstance(results, list):
        log.error("subq.gather(%s): results must be a list, got %r", batch_id, type(results).__name__)
        results = []
    delegation.gather(get_runtime(settings, app), batch_id, results)


@app.task(name=ADVANCE, bind=True, ignore_result=True, **RETRY_STORE_ERRORS)
def advance(self: Task, result: Any, batch_id: str) -> None:
    if delegation.advance(get_runtime(settings, app), batch_id, result):
        # Stop the rest of the chain (celery/celery#3550: the supported way since 4.0).
        self.request.chain = None
