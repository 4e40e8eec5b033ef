"""A worker's log lines, and the run that each line belongs to.

`SUBQ_LOG_FORMAT=text` (the default) keeps Celery's own lines, made for a
terminal. `SUBQ_LOG_FORMAT=json` writes one JSON object a line, for a log
pipeline: `timestamp`, `level`, `logger`, `message` (and `exc_info` with a
traceback). Either way, every line emitted while a run is in progress (in the
thread that runs it, the agent loop included) carries the run's `task_id`,
`root_id`, `batch_id` (null for a root), `worker` (the Celery node name) and
`delivery` (1 for a first delivery, 2 for a redelivery, ...) as JSON fields,
and `trace_id` when traces are on (docs/tracing.md).

The run's ids live in a context variable: `workers/tasks.py` opens it around
the run, and the run-lifecycle's start adds what only the task's record knows
(its root, batch and delivery count), through `LoggedRunLifecycle`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, replace
from typing import Any

from celery import signals
from pythonjsonlogger.json import JsonFormatter

from coordinator import SubtaskResult, current_trace_id
from coordinator.runs import Run, RunLifecycle

__all__ = ["LoggedRunLifecycle", "RunContext", "RunContextFilter", "current_run", "install", "run_context"]

# The fields of a JSON line besides the run's: Python's names on the left, the line's on the right.
JSON_FIELDS = "{levelname}{name}{message}"
JSON_RENAMES = {"levelname": "level", "name": "logger"}


@dataclass(frozen=True)
class RunContext:
    """The run a log line belongs to; None for what only the task's record knows, until the run starts."""

    task_id: str
    worker: str
    root_id: str | None = None
    batch_id: str | None = None
    delivery: int | None = None


_current: ContextVar[RunContext | None] = ContextVar("subq_run", default=None)


def current_run() -> RunContext | None:
    return _current.get()


@contextmanager
def run_context(task_id: str, worker: str) -> Iterator[RunContext]:
    """Lines logged inside belong to the run of `task_id` on `worker` (reset after: pool threads are reused)."""
    context = RunContext(task_id=task_id, worker=worker)
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


class LoggedRunLifecycle(RunLifecycle):
    """The run lifecycle, adding the started run's root, batch and delivery count to the log context."""

    def start(self, task_id: str) -> Run | SubtaskResult:
        started = super().start(task_id)
        context = _current.get()
        if isinstance(started, Run) and context is not None:
            task = started.task
            _current.set(replace(context, root_id=task.root_id, batch_id=task.batch_id, delivery=started.deliveries))
        return started


class RunContextFilter(logging.Filter):
    """Adds the current run's fields to a record (a JSON line shows them); lines outside a run get none.

    With traces on (docs/tracing.md), a line logged inside a span also gets its `trace_id`.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        context = _current.get()
        if context is not None:
            for name, value in asdict(context).items():
                setattr(record, name, value)
        trace_id = current_trace_id()
        if trace_id is not None:
            record.trace_id = trace_id
        return True


def json_formatter() -> logging.Formatter:
    return JsonFormatter(JSON_FIELDS, style="{", rename_fields=JSON_RENAMES, timestamp=True)


def install(log_format: str) -> None:
    """Once Celery has set up the worker's loggers, give their handlers the run's fields (and JSON)."""

    def configure(logger: logging.Logger, **_: Any) -> None:
        for handler in logger.handlers:
            if not any(isinstance(f, RunContextFilter) for f in handler.filters):
                handler.addFilter(RunContextFilter())
            if log_format == "json":
                handler.setFormatter(json_formatter())

    # Both signals: Celery's task logger (`celery.task`) has handlers of its own.
    signals.after_setup_logger.connect(configure, weak=False)
    signals.after_setup_task_logger.connect(configure, weak=False)
