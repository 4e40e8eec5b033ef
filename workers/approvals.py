"""`subq.expire_approval`: an unanswered tool approval counts as a denial when its time is up."""

from __future__ import annotations

from typing import Any

from coordinator import NotFoundError, StoreError
from coordinator.celery_app import EXPIRE_APPROVAL
from workers.app import app, settings
from workers.runtime.context import get_runtime

__all__ = ["expire_approval"]


@app.task(name=EXPIRE_APPROVAL, ignore_result=True, autoretry_for=(StoreError,), retry_backoff=2, max_retries=10)
def expire_approval(approval_id: Any) -> None:
    # Published with a countdown; Redis may deliver it more than once when the countdown
    # exceeds the visibility timeout, and deciding is once-only, so that is harmless.
    try:
        get_runtime(settings, app).lifecycle.expire_approval(str(approval_id))
    except NotFoundError:
        return  # its tree has expired
