"""subq's benchmark: `python bench/run.py` (see docs/benchmarks.md).

Not part of the installed package: a script and the Celery app module its
bare-Celery worker processes load (`celery -A bench.bare worker`). The bare
tasks' names live here so the publisher can send them by name without
importing `bench.bare`, which builds its app from the worker's environment.
"""

NOOP = "bench.noop"
JOIN = "bench.join"
