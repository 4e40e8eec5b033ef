"""subq's benchmarks: `python bench/run.py`, `python bench/overhead.py` (see docs/benchmarks.md).

Not part of the installed package: scripts and the Celery app modules their
worker processes load (`celery -A bench.bare worker`, `celery -A
bench.subq_worker worker`). The bare tasks' names live here so the publisher can
send them by name without importing `bench.bare`, which builds its app from the
worker's environment.
"""

NOOP = "bench.noop"
AGENT = "bench.agent"
JOIN = "bench.join"
