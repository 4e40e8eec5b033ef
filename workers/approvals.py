"""`subq.expire_approval`: an unanswered tool approval counts as a denial when its time is up.

subq no longer publishes it: approval deadlines are timers the reconciler serves
(coordinator/reconciler.py). It stays registered so that a message an older
release queued is still consumed, not dead-lettered.
"""

from __future__ import annotations

from typing import Any

from coordinator import NotFoundError, StoreError
from coordinator.celery_app import EXPIRE_APPROVAL
from workers.app import app, settings
from workers.runtime.context import get_runtime

__all__ = ["expire_approval"]


@app.task(name=EXPIRE_APPROVAL, ignore_result=True, autoretry_for=(StoreError,), retry_backoff=2, max_retries=10)
def expire_approval(approval_id: Any) -> None:
    # Deciding is once-only, so a late or repeated message is harmless.
    try:
        get_runtime(settings, app).lifecycle.expire_approval(str(approval_id))
    except NotFoundError:
        return  # its tree has expired
