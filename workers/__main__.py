"""`python -m workers [options]`: a subq worker, as `celery -A workers.app worker [options]` (workers/app.py)."""

from __future__ import annotations

import sys

from celery import maybe_patch_concurrency

# As the `celery` command does before it imports anything else: `-P gevent` or `-P eventlet` patches the
# standard library first (neither pool is installed with subq; this keeps `-P` meaning what Celery says).
maybe_patch_concurrency(sys.argv)

from workers.app import main  # noqa: E402  (after the patching above)

main(sys.argv[1:])
