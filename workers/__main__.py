"""`python -m workers [options]`: a subq worker, as `celery -A workers.app worker [options]` (workers/app.py)."""

from __future__ import annotations

import sys

from workers.app import main

main(sys.argv[1:])
