"""How long a SIGKILLed worker's subagent waits before another worker resumes it, with default settings.

    python bench/kill_resume.py [--latency-ms 20000] [--json]

One private embedded Redis and two worker processes with default settings
(a 15 s heartbeat lapse, a 2 s reconciler tick). A child waiting on its model
runs on the first worker; a second worker starts; the first is SIGKILLed; the
figure is the time from the kill until the child's second run has started on
the survivor (its run sequence reads 2). The child then completes. With the
defaults the bound is the lapse plus about two ticks (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator import Coordinator, Settings, TaskStatus  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402
from coordinator.local.fleet import WorkerFleet  # noqa: E402
from workers.runtime.script import script_message  # noqa: E402

POLL_S = 0.05


def measure(latency_ms: int) -> dict[str, object]:
    with local_redis() as url, tempfile.TemporaryDirectory(prefix="subq-kill-") as logs:
        settings = Settings(redis_url=url, worker_concurrency=4)
        first = WorkerFleet(settings, 1, Path(logs) / "first", name="first")
        second: WorkerFleet | None = None
        try:
            first.wait_ready()
            coord = Coordinator(settings)
            parent = coord.create_task("One slow child")
            step = {"reply": "slow done", "usage": {"input": 1000, "output": 200}, "latency_ms": latency_ms}
            message = script_message("Wait on the model.", [step])
            (child,) = coord.delegate(parent.id, [{"description": "slow", "message": message}]).child_ids
            while coord.store.runs.in_flight(parent.id)["leases"] == 0:
                time.sleep(POLL_S)
            second = WorkerFleet(settings, 1, Path(logs) / "second", name="second")
            second.wait_ready()
            os.killpg(first.procs[0].pid, signal.SIGKILL)
            killed = time.monotonic()
            while coord.store.records.task_field(child, "run_seq") != "2":
                time.sleep(POLL_S)
            resumed_s = time.monotonic() - killed
            coord.wait(parent.id, timeout_s=latency_ms / 1000 + 60)
            record = coord.get_task(child)
            figures: dict[str, object] = {
                "resumed_after_kill_s": round(resumed_s, 2),
                "completed": record.status == TaskStatus.COMPLETED,
                "requests": record.requests,
                "repairs": coord.repairs(),
            }
            coord.close()
            return figures
        finally:
            for fleet in (first, second):
                if fleet is not None:
                    fleet.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=int, default=20_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = measure(args.latency_ms)
    print(json.dumps(figures) if args.json else "\n".join(f"{k:>22}: {v}" for k, v in figures.items()))
    return 0 if figures["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
