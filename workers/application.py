"""The worker process's Celery app and settings, built once from the `SUBQ_` environment.

The task modules (`workers.tasks`, `workers.maintenance`) import the app from
here to register on it; `workers.app`, the module `celery -A workers.app worker`
names, imports this and then those modules. So the app never imports the
modules that import it back (no import cycle), and an invalid setting still
stops the worker at start with one line naming the variable.

A worker whose Redis has no password (SUBQ_REDIS_URL without one, or no
SUBQ_REDIS_PASSWORD under Sentinel) says so in one warning line at its start
(`coordinator.password_warning`, issue 39): its runs' commands may
run unconfined (sandbox = false), and such a Redis takes orders from any local process.
A worker whose Redis refuses its credentials stops at start with one line saying so
(`coordinator.credentials_refused`), rather than trying its broker again forever.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_init

from coordinator import ConfigError, credentials_refused, load_settings, password_warning
from coordinator.celery_app import make_app
from workers import observe

__all__ = ["app", "settings"]

log = logging.getLogger(__name__)

try:
    settings = load_settings()
    app = make_app(settings)
    observe.install(settings.log_format)  # before Celery sets up the worker's loggers
    unprotected = password_warning(settings)
except ConfigError as exc:
    raise SystemExit(f"subq worker: {exc}") from None


def _warn_unprotected_redis(**_: Any) -> None:
    # At worker_init, not at import: Flower and `subq tools` import this module too, and
    # the line belongs to the worker's start, once per worker (its main process).
    if unprotected is not None:
        log.warning("subq worker: warning: %s", unprotected)


def _refuse_refused_credentials(**_: Any) -> None:
    # A wrong password is no outage: Celery would try its broker again forever (it waits out an outage however
    # long), one log line a try, and run nothing. The worker stops at start with the one line that says why.
    # SystemExit, not an exception: Celery logs and ignores a receiver's exceptions.
    refused = credentials_refused(settings)
    if refused is not None:
        log.critical("subq worker: %s", refused)
        raise SystemExit(f"subq worker: {refused}")


# By call, not decorator: Celery's decorators are untyped (mypy --strict); weak=False keeps it alive.
worker_init.connect(_warn_unprotected_redis, weak=False)
worker_init.connect(_refuse_refused_credentials, weak=False)
