"""The agent library's own floor: N runs of subq's agent at once on one event loop, no Celery, no Redis.

    python bench/agent_floor.py [--runs 1000] [--latency-ms 1000] [--gc default|tuned] [--json]

Each run is subq's agent (its system prompt, tools and output types, built as a
worker builds it) on a pydantic-ai FunctionModel that waits `--latency-ms` and
answers once with text. What a worker process cannot beat with that many
subagents waiting on their models: the wall time of the wave, and the CPU a
run costs. `--gc tuned` collects garbage as a subq worker does
(workers/runtime/agent_loop.py). A warm-up wave of 50 runs first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart  # noqa: E402
from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: E402
from pydantic_ai.usage import RequestUsage  # noqa: E402

from coordinator import Settings  # noqa: E402
from coordinator.runs import Run  # noqa: E402
from workers.runtime.agent_loop import tune_gc  # noqa: E402
from workers.runtime.profile_tools import load_profile  # noqa: E402
from workers.runtime.runner import build_agent  # noqa: E402
from workers.runtime.tools import RunState  # noqa: E402

WARM_UP_RUNS = 50


async def wave(runs: int, latency_s: float) -> None:
    async def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        await asyncio.sleep(latency_s)
        return ModelResponse(parts=[TextPart("done")], usage=RequestUsage(input_tokens=1000, output_tokens=200))

    model = FunctionModel(answer)
    settings = Settings()
    agent = build_agent(load_profile("offline", settings), False)

    async def one(n: int) -> None:
        # No tool is called (the model answers with text at once), so the run's state has no coordinator's
        # handle: only what the agent's own hooks read (an untyped run, its profile's limits).
        state = RunState(run=cast(Run, None), profile=settings.profile("offline"))
        async with agent.iter(f"Task {n}.", model=model, deps=state) as run:
            async for _ in run:
                pass

    await asyncio.gather(*(one(n) for n in range(runs)))


def measure(runs: int, latency_ms: int, tuned: bool) -> dict[str, object]:
    if tuned:
        tune_gc()
    asyncio.run(wave(WARM_UP_RUNS, latency_ms / 1000))
    cpu_before_s, started_s = time.process_time(), time.monotonic()
    asyncio.run(wave(runs, latency_ms / 1000))
    wall_s, cpu_s = time.monotonic() - started_s, time.process_time() - cpu_before_s
    return {
        "runs": runs,
        "latency_ms": latency_ms,
        "gc": "tuned" if tuned else "default",
        "wall_s": round(wall_s, 2),
        "cpu_ms_per_run": round(cpu_s * 1000 / runs, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--latency-ms", type=int, default=1000)
    parser.add_argument("--gc", choices=["default", "tuned"], default="tuned")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = measure(args.runs, args.latency_ms, args.gc == "tuned")
    print(json.dumps(figures) if args.json else "\n".join(f"{k:>15}: {v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
