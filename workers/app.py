"""The worker's Celery app: `celery -A workers.app worker` starts a subq worker.

It reads the same `SUBQ_` settings as everything else (workers/application.py
builds the app); importing this module also registers the `subq.*` tasks and
the worker's signal handlers on it.
"""

from __future__ import annotations

from workers import maintenance, outbound, tasks  # noqa: F401  (registers the subq.* tasks and signals)
from workers.application import app, settings

__all__ = ["app", "settings"]
