"""subq's benchmarks: `python bench/run.py`, `python bench/overhead.py` (see docs/benchmarks.md).

Not part of the installed package: scripts and the Celery app modules their
worker processes load (`celery -A bench.bare worker`, `celery -A
bench.subq_worker worker`). The bare tasks' names live here so the publisher can
send them by name without importing `bench.bare`, which builds its app from the
worker's environment.
"""

NOOP = "bench.noop"
# The function tool of the tool-calling children (`--tool-calls`): both sides offer the same one.
TOOL_PATH = "bench:lookup"
# The environment variable that tells the bare worker to offer it too.
TOOLS_ENV = "BENCH_TOOLS"
# The environment variable that stretches a subq worker's own clocks by its factor (bench/subq_worker.py).
STRETCH_ENV = "BENCH_STRETCH"
AGENT = "bench.agent"
JOIN = "bench.join"


def lookup(key: str) -> str:
    """Look a key up (a benchmark tool: returns at once, so the figures are subq's and the library's own)."""
    return f"value of {key}"
