"""A thousand children in flight on one worker process: all complete, each delivered to a run once.

    python bench/in_flight.py [--children 1000] [--latency-ms 8000] [--concurrency 1000] [--waves 1] [--json]

One private embedded Redis, one `celery -A workers.app worker` process of the
threads pool with `--concurrency` threads and default settings otherwise (the
15 s heartbeat lapse, the 2 s reconciler tick, the 30 s grace). A caller-owned
parent delegates `--children` children at once, each a one-step offline script
that waits `--latency-ms` on its model. Reported, once the parent has settled:
the wall time, how many children completed, how many were run more than once
(`run_seq` > 1), how many Celery deliveries of `subq.run_task` the worker
logged beyond one per child, and the reconciler's repairs. With `--waves 2`,
a first wave of as many children warms the worker up (its pool threads, their
event loops and connections) and the second is measured; the worker's resident
memory is sampled every 50 ms, and `rss_per_child_kb` is its peak during the
measured wave minus what it held before, per child in flight.
docs/benchmarks.md has the figures and how to read them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator import Coordinator, Settings, TaskStatus  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402
from coordinator.local.fleet import WorkerFleet  # noqa: E402
from workers.runtime.script import script_message  # noqa: E402

RECEIVED = re.compile(r"subq\.run_task\[([0-9a-f-]+)\] received")


def child_spec(n: int, latency_ms: int) -> dict[str, str]:
    step = {"reply": f"child {n} done", "usage": {"input": 1000, "output": 200}, "latency_ms": latency_ms}
    message = script_message(f"Child {n}.", [step])
    return {"description": f"child {n}", "message": message}


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> tuple[float, float]:
    """The process's (user, system) CPU time so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    return int(fields[11]) * tick_s, int(fields[12]) * tick_s


def profiler(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling the worker's threads (CPU only) into collapsed stacks at `out`, until SIGINT."""
    command = [
        "py-spy",
        "record",
        "-p",
        str(pid),
        "-o",
        str(out),
        "--format",
        "raw",
        "-r",
        "250",
        "--nonblocking",
        "--gil",
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(
    children: int, latency_ms: int, concurrency: int, waves: int = 1, profile: Path | None = None
) -> dict[str, object]:
    with local_redis() as url, tempfile.TemporaryDirectory(prefix="subq-in-flight-") as logs:
        settings = Settings(redis_url=url, worker_concurrency=concurrency, max_fanout=max(children, 256))
        with WorkerFleet(settings, 1, Path(logs)) as fleet:
            fleet.wait_ready()
            coord = Coordinator(settings)
            pid = fleet.procs[0].pid
            warm_ids: set[str] = set()
            for _ in range(waves - 1):  # warm-up waves, not measured
                warm = coord.create_task("A warm-up wave")
                warm_ids.update(coord.delegate(warm.id, [child_spec(n, latency_ms) for n in range(children)]).child_ids)
                coord.wait(warm.id, timeout_s=3600)
            rss_before_kb = rss_kb(pid)
            peak_kb = [rss_before_kb]
            # Connections to Redis, every client of the process and this one's included.
            peak_clients = [0]
            sampling = threading.Event()

            def sample() -> None:
                while not sampling.wait(0.05):
                    peak_kb[0] = max(peak_kb[0], rss_kb(pid))
                    peak_clients[0] = max(peak_clients[0], int(coord.client.info("clients")["connected_clients"]))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            parent = coord.create_task("A thousand children")
            cpu_before_s = cpu_s(pid)
            spy = profiler(pid, profile) if profile else None
            started = time.monotonic()
            batch = coord.delegate(parent.id, [child_spec(n, latency_ms) for n in range(children)])
            coord.wait(parent.id, timeout_s=3600)
            wall_s = time.monotonic() - started
            user_s, system_s = (after - before for after, before in zip(cpu_s(pid), cpu_before_s, strict=True))
            worker_cpu_s = user_s + system_s
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            sampling.set()
            sampler.join()
            records = coord.store.records.get_records(batch.child_ids)
            log = fleet.logs[0].read_text(errors="replace")
            deliveries = Counter(RECEIVED.findall(log))
            figures: dict[str, object] = {
                "children": children,
                "latency_ms": latency_ms,
                "concurrency": concurrency,
                "wall_s": round(wall_s, 2),
                "waves": waves,
                "worker_cpu_s": round(worker_cpu_s, 2),
                "worker_cpu_ms_per_child": round(worker_cpu_s * 1000 / children, 2),
                "worker_system_cpu_s": round(system_s, 2),
                "rss_before_mb": round(rss_before_kb / 1024, 1),
                "rss_peak_mb": round(peak_kb[0] / 1024, 1),
                "rss_per_child_kb": round((peak_kb[0] - rss_before_kb) / children, 1),
                "redis_clients_peak": peak_clients[0],
                "completed": sum(r.status == TaskStatus.COMPLETED for r in records),
                "statuses": dict(Counter(r.status.value for r in records)),
                "errors": dict(Counter(f"{r.error_class}: {r.error}"[:120] for r in records if r.error_class)),
                "run_more_than_once": sum(
                    int(coord.store.records.task_field(r.id, "run_seq") or 0) > 1 for r in records
                ),
                "extra_deliveries": sum(deliveries[c] - 1 for c in batch.child_ids if deliveries[c] > 1),
                "other_run_messages": sum(
                    n for cid, n in deliveries.items() if cid not in set(batch.child_ids) | warm_ids
                ),
                "repairs": coord.repairs(),
                "in_flight_after": coord.store.runs.in_flight(parent.id),
            }
            coord.close()
            return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=1000)
    parser.add_argument("--latency-ms", type=int, default=8000)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--waves", type=int, default=1, help="waves of children; all but the last warm up")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", type=Path, help="py-spy's collapsed stacks of the measured wave, to this file")
    args = parser.parse_args()
    figures = measure(args.children, args.latency_ms, args.concurrency, max(1, args.waves), args.profile)
    if args.json:
        print(json.dumps(figures))
    else:
        for name, value in figures.items():
            print(f"{name:>20}: {value}")
    ok = figures["completed"] == args.children and figures["run_more_than_once"] == 0
    return 0 if ok and figures["extra_deliveries"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
