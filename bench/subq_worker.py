"""subq's worker app with the Redis round-trip probe: `celery -A bench.subq_worker worker`.

With `BENCH_STRETCH=<k>` (bench/overhead.py --stretch), the process's own clocks that
are constants rather than settings run k times slower: the stop watch's poll, the
webhook deliverer's idle poll and the progress pacer; the reconciler's and the
heartbeat's are settings, which the bench stretches itself. Comparing a run so with a
plain one tells what those clocks cost a child.
"""

from __future__ import annotations

import os

import bench.probe  # noqa: F401  (installs the probe first, when BENCH_PROBE_DIR is set)
from bench import STRETCH_ENV
from workers.app import app

__all__ = ["app"]


def _stretch(factor: float) -> None:
    from coordinator import outbound
    from workers.runtime import agent_loop

    outbound.POLL_S *= factor
    agent_loop.LIVE_EVERY_S *= factor
    poll_s, full_look_s = agent_loop.StopWatch.__init__.__defaults__ or (
        agent_loop.CANCEL_POLL_S,
        agent_loop.FULL_LOOK_S,
    )
    agent_loop.StopWatch.__init__.__defaults__ = (poll_s * factor, full_look_s * factor)


if os.environ.get(STRETCH_ENV):
    _stretch(float(os.environ[STRETCH_ENV]))
