"""Python calls a child costs its worker, subq's run against (b)'s bare agent: a count that load does not move.

    python bench/run_calls.py [--children 100] [--modes agent,subq]

In this process, on a private embedded Redis: `subq` runs `--children` offline
children of one delegation through `run_child` (what `subq.run_task` runs: the
start step, the agent on the process's agent loop, the end step with its
write-back) from 16 threads; `agent` runs (b)'s agent (bench/bare.py) with
`run_sync` as many times. Every Python and C function call of the pool threads
and of the agents' loop is counted (`sys.setprofile`), after a warm-up, and
divided by the children. The stop watch's poll is left out: it runs on a clock,
not per child. No Celery: what the bench's worker processes add around a run
(the consumer, task events, the result backend) is not in it.

CPU figures on a shared 2-core host move by a third between runs of the same
code (docs/benchmarks.md); a count does not, so a change to a run's path can be
weighed here first, then timed with bench/overhead.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.overhead import modes_arg  # noqa: E402
from bench.run import child_message  # noqa: E402
from coordinator import Coordinator, Settings  # noqa: E402
from coordinator.celery_app import make_app  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402
from workers.runtime.agent_loop import StopWatch, tune_gc  # noqa: E402
from workers.runtime.context import build_runtime  # noqa: E402
from workers.runtime.runner import run_child  # noqa: E402

# The bench's worker threads (bench/overhead.py's --concurrency).
THREADS = 16
WARM_UP_CHILDREN = 32


class _Unpolled(StopWatch):
    """A stop watch that makes no look of its own: its poll runs on a clock, not per child."""

    def poll(self) -> None:
        return None


class Counter:
    """Calls made under `sys.setprofile` in every thread it is set on."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            with self._lock:
                self.calls += 1


def count(children: int, mode: str) -> float:
    """Calls a child of `mode` costs, counted over `children` of them."""
    tune_gc()
    with local_redis() as url:
        os.environ["SUBQ_REDIS_URL"] = url  # bench.bare reads its settings at import
        import bench.bare as bare

        settings = Settings(redis_url=url, worker_concurrency=THREADS, max_fanout=max(256, children))
        app = make_app(settings)
        coord = Coordinator(settings, app=app)
        runtime = build_runtime(settings, app)
        object.__setattr__(runtime, "stop_watch", _Unpolled(runtime.lifecycle))
        message = child_message()
        counter = Counter()
        counting = threading.Event()

        def subq(child_id: str) -> None:
            if counting.is_set():
                sys.setprofile(counter)
            result = run_child(runtime, child_id, progress=lambda info: None)
            sys.setprofile(None)
            if result.status != "completed":
                raise RuntimeError(f"a child did not complete: {result}")

        def agent(_: str) -> None:
            if counting.is_set():
                sys.setprofile(counter)
            bare._agent().run_sync(message, model=bare._model)
            sys.setprofile(None)

        def ids(width: int) -> Sequence[str]:
            if mode == "agent":
                return [str(n) for n in range(width)]
            parent = coord.create_task("Benchmark parent", todos="\n".join(f"[ ] item {n}" for n in range(width)))
            specs = [{"description": f"item {n}", "message": message} for n in range(width)]
            return coord.delegate(parent.id, specs).child_ids

        one: Callable[[str], None] = subq if mode == "subq" else agent
        try:
            with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(one, ids(WARM_UP_CHILDREN)))
                measured = ids(children)
                loop, _ = runtime.agent_loop._running_loop()
                on_loop(loop, lambda: sys.setprofile(counter))
                counting.set()
                list(pool.map(one, measured))
                counting.clear()
                on_loop(loop, lambda: sys.setprofile(None))
        finally:
            runtime.coordinator.close()
            coord.close()
        return counter.calls / children


def on_loop(loop: Any, call: Callable[[], None]) -> None:
    """Run `call` in the agents' loop's thread (sys.setprofile is per thread), and wait for it."""
    done = threading.Event()

    def then_done() -> None:
        call()
        done.set()

    loop.call_soon_threadsafe(then_done)
    done.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/run_calls.py", description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=100, help="children counted (100)")
    parser.add_argument("--modes", type=modes_arg, default=("agent", "subq"), help="agent,subq (the default)")
    args = parser.parse_args(argv)
    for mode in args.modes:
        if mode == "noop":
            continue
        print(f"{mode:5} {count(args.children, mode):9.0f} calls a child", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
