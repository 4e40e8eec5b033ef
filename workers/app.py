"""The worker's Celery app: `celery -A workers.app worker` starts a subq worker.

It reads the same `SUBQ_` settings as everything else; an invalid setting stops
the worker at start with one line naming the variable.
"""

from __future__ import annotations

from coordinator import ConfigError, load_settings
from coordinator.celery_app import make_app
from workers import logs

__all__ = ["app", "settings"]

try:
    settings = load_settings()
    app = make_app(settings)
    logs.install(settings.log_format)  # before Celery sets up the worker's loggers
except ConfigError as exc:
    raise SystemExit(f"subq worker: {exc}") from None

from workers import maintenance, tasks  # noqa: F401  (registers the subq.* tasks and signals)
