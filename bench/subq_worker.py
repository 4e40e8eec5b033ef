"""subq's worker app with the Redis round-trip probe: `celery -A bench.subq_worker worker`."""

from __future__ import annotations

import bench.probe  # noqa: F401  (installs the probe first, when BENCH_PROBE_DIR is set)
from workers.app import app

__all__ = ["app"]
