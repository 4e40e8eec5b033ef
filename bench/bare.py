"""The bare-Celery side of the benchmarks: `celery -A bench.bare worker`.

The app comes from subq's own `make_app(load_settings())`, so pool,
concurrency, prefetch, acks, serializer, result backend and events are exactly
those of a subq worker started with the same `SUBQ_` environment. Only the
tasks differ: two chord headers and a chord callback that announces the join.
- `bench.noop` does nothing (baseline (a): what Celery costs);
- `bench.agent` runs a pydantic-ai agent, as a Celery user without subq would:
  the same agent definition as a subq run (system prompt, orchestration tools,
  output types) on the same offline model, built once per process, run with
  `run_sync` (baseline (b): what Celery and the agent library cost).
Each header returns the time it ended, so the callback reports how long after
the last child's end it ran, with no Redis call of its own beyond the join.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from typing import Any

import redis
from celery import Task
from pydantic_ai import Agent, DeferredToolRequests, ToolOutput
from pydantic_ai.toolsets import FunctionToolset

import bench.probe  # noqa: F401  (installs the round-trip probe first, when BENCH_PROBE_DIR is set)
from bench import AGENT, JOIN, NOOP, TOOLS_ENV, lookup
from coordinator.celery_app import make_app
from coordinator.settings import load_settings
from workers.runtime.offline import OfflineModel
from workers.runtime.tools import ORCHESTRATION_PROMPT, RunState, attempt_completion, orchestration_tools

__all__ = ["agent", "app", "join", "noop"]

settings = load_settings()
app = make_app(settings)

_lock = threading.Lock()
_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    # One client per worker process, built after any fork; shared by the pool's threads.
    global _client
    with _lock:
        if _client is None:
            assert settings.redis_url
            _client = redis.Redis.from_url(settings.redis_url)
        return _client


# Bound, like subq's own tasks, so both modes pay the same call path.
@app.task(name=NOOP, bind=True)
def noop(self: Task, sleep_ms: int = 0) -> list[float]:
    started = time.time()
    if sleep_ms:  # bare Celery waiting as a subagent waits on its model (bench/overhead.py --latency-ms)
        time.sleep(sleep_ms / 1000)
    return [started, time.time()]


@functools.cache
def _agent() -> Agent[RunState, Any]:
    # With tool-calling children (bench/overhead.py --tool-calls), the same function tool as subq's profile.
    own = [FunctionToolset([lookup])] if os.environ.get(TOOLS_ENV) else []
    return Agent(
        deps_type=RunState,
        output_type=[str, ToolOutput(attempt_completion, name="attempt_completion"), DeferredToolRequests],
        system_prompt=f"You are a helpful assistant.\n\n{ORCHESTRATION_PROMPT}",
        toolsets=[orchestration_tools, *own],
    )


_model = OfflineModel()


@app.task(name=AGENT, bind=True)
def agent(self: Task, prompt: str) -> list[float]:
    started = time.time()
    result = _agent().run_sync(prompt, model=_model)
    if not isinstance(result.output, str) or not result.usage.output_tokens:
        raise RuntimeError(f"the baseline agent did not answer: {result.output!r}")
    return [started, time.time()]


@app.task(name=JOIN, bind=True, ignore_result=True)
def join(self: Task, results: Any, done_key: str) -> None:
    # RPUSH what the join saw: the benchmark BLPOPs this key, which wakes it the moment
    # the callback ran, and checks the count; `after_last_ms` is how long after the last
    # header ended the callback ran (the chord's "parent resumed" latency), and `first_started`
    # when the first header started (epoch seconds: the bench times it from its own start).
    # Each header's result is [started, ended].
    now = time.time()
    runs = [r for r in results if isinstance(r, list) and len(r) == 2] if isinstance(results, list) else []
    after_last_ms = (now - max(ended for _, ended in runs)) * 1000 if runs else -1.0
    first_started = min(started for started, _ in runs) if runs else -1.0
    done = {"results": len(runs), "after_last_ms": after_last_ms, "first_started": first_started}
    _redis().rpush(done_key, json.dumps(done))
