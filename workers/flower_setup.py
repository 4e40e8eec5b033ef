"""Flower's side of subq: no prompt on screen, a run's result from its record, abort as cancel, every route behind auth.

`subq flower` (and `subq up`) run `celery -A workers.flower flower`; that module
calls `install(app)` on the worker's app before Flower starts, which does four
things in Flower's process only:

1. **Sent events carry no arguments.** Any producer's `task-sent` event carries
   its own `argsrepr`/`kwargsrepr`; a producer that sets none (Python's default,
   or a hand-built message) puts the whole prompt there, and Celery's event state
   lets a `task-sent` that arrives after the worker's `task-received` overwrite
   the worker's summary (its merge rules keep `task-received` fields only when
   *that* event comes late). subq's own producers compute a safe summary when they
   publish, but Flower cannot tell their sent events from anyone else's, so for
   every `subq.*` task it drops `args` and `kwargs` from sent events: they come
   only from the worker's `task-received`, which subq's workers compute
   (workers/submit.py). A queued task shows its name and id, no arguments,
   until a worker receives it.
2. **subq's app is the current app**, so Flower's `/api/task/result/<id>` and
   `/api/task/abort/<id>` (which build `AsyncResult(id)` on the current app)
   reach subq's result backend instead of Celery's disabled default one.
3. **That backend answers for runs.** subq's runs store no Celery result (the
   task's record in Redis is the result), so for a run's Celery id (the task id,
   or a resume's `<id>-r<n>`...) it answers from the task's record; an abort of a run cancels that
   task's subtree (`Coordinator.cancel`), and an abort of anything else changes
   nothing (subq has no other abortable task, and Celery's abort would write
   `ABORTED` over a finished task's stored result).
4. **`/metrics` and `/healthcheck` ask for the login too.** Flower checks its
   basic auth (or OAuth cookie) per handler method, with `tornado.web.authenticated`,
   and its Prometheus and health-check handlers have none: anyone who reaches
   Flower's port would read every task name and worker host name from `/metrics`.
   Their `prepare` makes Flower's own check before any method runs.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import flower.events
import flower.views
import flower.views.monitor
import tornado.web
from celery import Celery, states
from celery.contrib.abortable import ABORTED

from coordinator import Coordinator, NotFoundError, SubqError, TaskRecord, task_of_run_id
from coordinator.celery_app import FollowingSentinelBackend, PublishOnlyRedisBackend, result_backend_url

__all__ = [
    "ABORT_REASON",
    "LOGIN_REQUIRED_HANDLERS",
    "RedactedEventsState",
    "RunResultBackend",
    "RunResultSentinelBackend",
    "install",
    "redact_event",
    "run_meta",
]

log = logging.getLogger(__name__)

ABORT_REASON = "aborted in Flower"
# Flower's handlers that answer without its login (Flower 2.x: no `authenticated` on their get()).
LOGIN_REQUIRED_HANDLERS: tuple[type[Any], ...] = (flower.views.monitor.Metrics, flower.views.monitor.Healthcheck)
# Marks a handler's prepare() as already wrapped, so a second install() does not wrap it twice.
_WRAPPED = "_subq_login_required"


def redact_event(event: dict[str, Any]) -> dict[str, Any]:
    """The event as Flower may keep it: a `subq.*` task's sent event without its arguments."""
    if event.get("type") == "task-sent" and str(event.get("name") or "").startswith("subq."):
        event.pop("args", None)
        event.pop("kwargs", None)
    return event


def run_meta(record: TaskRecord) -> dict[str, Any]:
    """A task record as the Celery result meta of its runs: its outcome and figures, never its prompt.

    An ended task is `SUCCESS` whatever its status, as `subq.run_task` itself is:
    it never raises for a failed or cancelled subagent, it returns the outcome
    (and Flower's task list, built from the worker's events, shows `SUCCESS`).
    A task that has not ended is `STARTED`, with no result yet.
    """
    if not record.status.terminal:
        return {"task_id": record.id, "status": states.STARTED, "result": None, "traceback": None, "children": []}
    result = {
        "task_id": record.id,
        "status": record.status.value,
        "summary": record.summary,
        "output": record.output,  # a typed task's validated data (None for a task with no output schema)
        "error": record.error or None,
        "tokens": record.total_tokens,
        "cost_micros": record.total_cost_micros,
    }
    return {"task_id": record.id, "status": states.SUCCESS, "result": result, "traceback": None, "children": []}


class RunResultBackend(PublishOnlyRedisBackend):
    """subq's Redis result backend, answering for runs from their task's record (Flower's process only)."""

    _coordinators: dict[int, Coordinator] = {}  # noqa: RUF012  (one per app, shared by Flower's threads)
    _lock = threading.Lock()

    def _coordinator(self) -> Coordinator:
        with self._lock:
            coord = self._coordinators.get(id(self.app))
            if coord is None:
                coord = self._coordinators[id(self.app)] = Coordinator(self.app.subq_settings, app=self.app)
            return coord

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        # A run's outcome is its task's: the record answers for every run of a task, whether
        # Celery stored something for that message (a by-name send, a run revoked while
        # queued) or, as for subq's own runs (ignore_result), nothing.
        run_of = task_of_run_id(task_id)
        if run_of is not None:
            try:
                return run_meta(self._coordinator().get_task(run_of))
            except NotFoundError:
                pass
        meta: dict[str, Any] = super()._get_task_meta_for(task_id)
        return meta

    def store_result(self, task_id: str, result: Any, state: str, *args: Any, **kwargs: Any) -> Any:
        if state != ABORTED:
            return super().store_result(task_id, result, state, *args, **kwargs)
        run_of = task_of_run_id(task_id)
        if run_of is None:
            log.warning("subq: abort of %s changes nothing: only a run (subq.run_task) can be aborted", task_id)
            return result
        try:
            self._coordinator().cancel(run_of, ABORT_REASON)
        except SubqError as exc:  # an ended or unknown task: nothing to stop, and its result stays as it was
            log.warning("subq: abort of %s changes nothing: %s", task_id, exc.message)
        return result


class RunResultSentinelBackend(RunResultBackend, FollowingSentinelBackend):
    """`RunResultBackend` on the master Redis Sentinel names (`FollowingSentinelBackend`)."""


def install(app: Celery) -> None:
    """Make `app` Flower's: redacted sent events, the current app, the run-aware result backend."""
    settings = app.subq_settings
    if settings is None:
        raise TypeError("install() takes subq's app (coordinator.celery_app.make_app)")
    app.conf.result_backend = result_backend_url(settings, RunResultBackend, RunResultSentinelBackend)
    # Flower's result and abort handlers build AsyncResult(id) on the current app, in
    # its IO loop thread and its executor's threads: the default app covers them all.
    app.set_default()
    app.set_current()
    _redact_flower_events()
    _require_login(LOGIN_REQUIRED_HANDLERS)
    _refuse_frames()


class RedactedEventsState(flower.events.EventsState):  # type: ignore[misc]  # Flower ships no type hints
    """Flower's event state, taking every event through `redact_event` first.

    Module-level, so that Flower's persistent mode (`--persistent`) can pickle it.
    """

    def event(self, event: dict[str, Any]) -> Any:
        return super().event(redact_event(event))


def _redact_flower_events() -> None:
    """Flower builds its state from the name `flower.events.EventsState` when it starts, after this runs.

    Flower offers no hook of its own for its events, so the name is rebound.
    """
    flower.events.EventsState = RedactedEventsState


def _refuse_frames() -> None:
    """Flower's pages in no other site's frame: its Revoke, Terminate and Abort buttons (Abort stops a subtree)
    would be a click away for a page that framed them over a browser that keeps the login (clickjacking).
    Flower sets neither header; subq's own web view sets both."""
    base = flower.views.BaseHandler
    if getattr(base.set_default_headers, _WRAPPED, False):
        return
    flowers = base.set_default_headers

    def set_default_headers(handler: Any) -> None:
        flowers(handler)
        handler.set_header("X-Frame-Options", "DENY")
        handler.set_header("Content-Security-Policy", "frame-ancestors 'none'")

    setattr(set_default_headers, _WRAPPED, True)
    base.set_default_headers = set_default_headers


def _require_login(handlers: tuple[type[Any], ...]) -> None:
    """Make each handler check Flower's login before any of its methods runs.

    Flower's pages and API methods are wrapped in `tornado.web.authenticated`, which
    reads `current_user`: Flower's `get_current_user` answers 401 for a missing or
    wrong basic-auth header, and (with OAuth) `authenticated` sends a browser without
    the cookie to the login page. The same decorator on `prepare`, which Tornado runs
    before every method (GET, HEAD, OPTIONS...), gives these handlers exactly that
    check, Flower's own, without copying its code or touching its routes; with
    `--no-auth`, where Flower's every route is open, these stay open too.
    """
    for handler in handlers:
        prepare = handler.prepare
        if getattr(prepare, _WRAPPED, False):
            continue
        checked = tornado.web.authenticated(prepare)
        setattr(checked, _WRAPPED, True)
        handler.prepare = checked
