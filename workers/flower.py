"""Flower's Celery app: `celery -A workers.flower flower`, which `subq flower` and `subq up` run.

The worker's app (its tasks registered, so Flower's `apply`/`async-apply` know
them), made Flower's by `workers.flower_setup.install`: sent events without
arguments, subq's app current (results and abort answer), a run's result from
its task's record, an abort of a run cancelling its subtree, and `/metrics` and
`/healthcheck` behind the same login as every other route.
"""

from __future__ import annotations

from workers.app import app, settings
from workers.flower_setup import install

__all__ = ["app", "settings"]

install(app)
