"""The worker process's Celery app and settings, built once from the `SUBQ_` environment.

The task modules (`workers.tasks`, `workers.maintenance`) import the app from
here to register on it; `workers.app`, the module `celery -A workers.app worker`
names, imports this and then those modules. So the app never imports the
modules that import it back (no import cycle), and an invalid setting still
stops the worker at start with one line naming the variable.
"""

from __future__ import annotations

from coordinator import ConfigError, load_settings
from coordinator.celery_app import make_app
from workers import observe

__all__ = ["app", "settings"]

try:
    settings = load_settings()
    app = make_app(settings)
    observe.install(settings.log_format)  # before Celery sets up the worker's loggers
except ConfigError as exc:
    raise SystemExit(f"subq worker: {exc}") from None
