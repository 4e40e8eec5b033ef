"""`subq.submit`: start a run from any Celery producer that knows only the task name.

    send_task("subq.submit", kwargs={"prompt": ..., "todos"?, "profile"?, "run"?,
                                     "subtasks"?, "mode"?, "output_schema"?, "metadata"?,
                                     "webhooks"?, "on_complete"?, "priority"?, "tenant"?},
              queue=<SUBQ_QUEUE>)

The contract (kwargs, result, error codes) is docs/celery-contract.md. The task
is thin: `submit()` below reads the message with `SubmitInput`
(coordinator/inputs.py, whose fields and checks are the API's) and calls the
same `Coordinator` the API and the CLI use, so a bad submission gets the same
error (code, message, field) there as anywhere else. It returns the error as its JSON result instead
of raising: a producer in another language reads one JSON shape either way, and
a bad submission writes nothing and publishes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery, Task
from celery.worker.request import Request

from coordinator import Coordinator, Settings, SubmitInput, SubqError, ValidationError, ignored_lines
from coordinator.celery_app import SUBMIT, describe_args, describe_kwargs
from workers.runtime.context import get_runtime

__all__ = ["FIELDS", "SubmitRequest", "register", "submit"]

log = logging.getLogger(__name__)

FIELDS = tuple(SubmitInput.model_fields)


def submit(
    coord: Coordinator, args: Sequence[Any], kwargs: Mapping[str, Any], message_id: str | None = None
) -> dict[str, Any]:
    """Validate a submission and start it; `{"task_id", "batch_id"?}` or `{"error": {...}}`.

    Idempotent: by `idempotency_key` when given, else by the message's id, so a
    message delivered twice (a worker lost after starting it) makes one root.
    """
    try:
        return _submit(coord, args, kwargs, message_id)
    except SubqError as exc:
        return error_result(exc)


def error_result(exc: SubqError, **extra: str) -> dict[str, Any]:
    return {"error": {"code": exc.code, "message": exc.message, "field": exc.field}, **extra}


def _submit(
    coord: Coordinator, args: Sequence[Any], kwargs: Mapping[str, Any], message_id: str | None
) -> dict[str, Any]:
    """The message read with `SubmitInput` (its root's fields are the API's), then the service's own operation."""
    if args:
        raise ValidationError(
            f"subq.submit takes keyword arguments only (kwargs={{...}}), got {len(args)} positional", field="args"
        )
    given = SubmitInput.parse(kwargs)
    key = given.idempotency_key
    if key is None and message_id:
        key = f"subq.submit:{message_id}"
    # Lines that look like plan items but are not are named in the result, as the API does.
    near_misses = [line.model_dump() for line in ignored_lines(given.todos)]
    ignored = {"ignored_todo_lines": near_misses} if near_misses else {}
    if given.subtasks is None:
        task = coord.create_task(
            given.prompt, todos=given.todos, profile=given.profile, run=given.run, idempotency_key=key,
            output_schema=given.output_schema, metadata=given.metadata, webhooks=given.webhooks,
            on_complete=given.on_complete, tenant=given.tenant, priority=given.priority,
        )  # fmt: skip
        return {"task_id": task.id, **ignored}
    done = coord.submit(
        given.prompt,
        todos=given.todos,
        profile=given.profile,
        subtasks=given.subtasks,
        mode=given.mode or "parallel",
        idempotency_key=key,
        metadata=given.metadata,
        webhooks=given.webhooks,
        on_complete=given.on_complete,
        tenant=given.tenant,
        priority=given.priority,
    )
    if done.error is not None:
        return error_result(done.error, task_id=done.task.id)
    assert done.batch is not None
    return {"task_id": done.task.id, "batch_id": done.batch.id, **ignored}


class SubmitRequest(Request):  # type: ignore[misc]  # Celery ships no type hints
    """The worker-side request of `subq.submit`, with a safe argsrepr and kwargsrepr.

    Flower shows what the worker reports in its `task-received` event, which is the
    producer's `argsrepr`/`kwargsrepr` header. A producer that does not set them
    (any non-Python client, or Python's default `repr(kwargs)`) would put the whole
    prompt there, so the worker replaces both before the event is sent.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._argsrepr = describe_args(self.args if isinstance(self.args, (list, tuple)) else ())
        self._kwargsrepr = describe_kwargs(self.kwargs if isinstance(self.kwargs, dict) else {})


def register(app: Celery, settings: Settings) -> Task:
    """Register `subq.submit` on the worker's app (workers/tasks.py does, at import).

    A function rather than a module-level decorator, so this module imports
    without settings (its plain functions are tested directly), and because
    Celery's decorator is untyped, which mypy --strict refuses on a decorated
    function. A second delivery of one message returns the root the first made
    (the message id is its idempotency key).
    """

    def run_submit(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return submit(get_runtime(settings, app).coordinator, args, kwargs, message_id=self.request.id)

    task: Task = app.task(name=SUBMIT, bind=True, Request=SubmitRequest)(run_submit)
    return task
