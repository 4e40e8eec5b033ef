"""What fair shares between tenants cost a lone tenant: its throughput with them on against off.

    python bench/fair_share.py [--children 400] [--repeats 5] [--concurrency 16] [--processes 2] [--json]

One private embedded Redis and two fleets of `--processes` real `celery worker` processes of
`--concurrency` threads, alike but for the tenants table: `off` has none (fair shares off, nothing of them
read or written), `on` gives every tenant a weight of 2 (fair shares on: each run takes and frees a fleet slot
of its tenant, each batch is announced, each worker's beat writes its concurrency and the policies; there is
one tenant, so none is ever parked for another). Each fleet has its own queue and key prefix. The two take
turns, `--repeats` times each: a caller's root delegates `--children` offline children that answer at once
(no model latency: the bench times subq's own steps, where fair shares cost anything), timed from the
delegation to its batch's close, with the CPU the fleet's processes and the Redis server used meanwhile. It
prints the median throughput of each and their ratio (on / off; issue 42 asks for at least 0.95), and the
median CPU per child (on a host whose CPUs bound the fleet, throughput is the CPUs over it: the figure a
loaded host can still measure). docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator import Coordinator, Settings  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402
from coordinator.local.fleet import WorkerFleet  # noqa: E402
from coordinator.tenants import TenantPolicy  # noqa: E402
from workers.runtime.script import script_message  # noqa: E402

# Wide enough that a batch is many fleet-fulls (16 threads), short enough for a quick run.
DEFAULT_CHILDREN = 400
DEFAULT_REPEATS = 5
DEFAULT_CONCURRENCY = 8
DEFAULT_PROCESSES = 2
MODES = ("off", "on")


def child_spec(n: int) -> dict[str, str]:
    step = {"reply": f"child {n} done", "usage": {"input": 1000, "output": 200}}
    return {"description": f"child {n}", "message": script_message(f"Child {n}.", [step])}


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far."""
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) * tick_s
    return total


def redis_cpu_s(coord: Coordinator) -> float:
    info = coord.client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def one_batch(coord: Coordinator, children: int, pids: list[int]) -> tuple[float, float]:
    """Seconds from delegating `children` to the batch's close, and the CPU seconds the fleet's processes and
    the Redis server used meanwhile (the other fleet is idle)."""
    root = coord.create_task("a fan-out")
    cpu_before = cpu_s(pids) + redis_cpu_s(coord)
    started = time.monotonic()
    coord.delegate(root.id, [child_spec(n) for n in range(children)])
    coord.wait(root.id, timeout_s=3600)
    return time.monotonic() - started, cpu_s(pids) + redis_cpu_s(coord) - cpu_before


def measure(children: int, repeats: int, concurrency: int, processes: int) -> dict[str, object]:
    with local_redis() as url, tempfile.TemporaryDirectory(prefix="subq-fair-") as logs, ExitStack() as stack:
        coords: dict[str, Coordinator] = {}
        pids: dict[str, list[int]] = {}
        for mode in MODES:
            tenants = {"*": TenantPolicy(weight=2)} if mode == "on" else {}
            settings = Settings(
                redis_url=url, worker_concurrency=concurrency, max_fanout=max(children, 256), queue=f"bench-{mode}",
                key_prefix=f"bench{mode}", tenants=tenants,
            )  # fmt: skip
            fleet = stack.enter_context(WorkerFleet(settings, processes, Path(logs) / mode))
            fleet.wait_ready()
            pids[mode] = [proc.pid for proc in fleet.procs]
            coords[mode] = Coordinator(settings)
            stack.callback(coords[mode].close)
        for mode in MODES:  # a warm-up batch each, not measured
            one_batch(coords[mode], children, pids[mode])
        walls: dict[str, list[float]] = {mode: [] for mode in MODES}
        cpus: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(repeats):
            for mode in MODES:
                wall_s, cpu = one_batch(coords[mode], children, pids[mode])
                walls[mode].append(wall_s)
                cpus[mode].append(cpu)
        assert coords["on"].store.fair.capacity() == processes * concurrency, "the on fleet's beat counted it"
        per_s = {mode: children / statistics.median(walls[mode]) for mode in MODES}
        cpu_ms = {mode: 1000 * statistics.median(cpus[mode]) / children for mode in MODES}
        return {
            "children": children, "repeats": repeats, "processes": processes, "concurrency": concurrency,
            "wall_s": {mode: [round(w, 3) for w in walls[mode]] for mode in MODES},
            "children_per_s": {mode: round(per_s[mode], 1) for mode in MODES},
            "ratio_on_off": round(per_s["on"] / per_s["off"], 3),
            # On a fleet its CPUs bound (a loaded host, or a busy one), throughput is CPUs / CPU per child.
            "cpu_ms_per_child": {mode: round(cpu_ms[mode], 2) for mode in MODES},
            "cpu_ratio_off_on": round(cpu_ms["off"] / cpu_ms["on"], 3),
        }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/fair_share.py", description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=DEFAULT_CHILDREN, help="children per batch (400)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="batches per mode (5)")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="threads per process (8)")
    parser.add_argument("--processes", type=int, default=DEFAULT_PROCESSES, help="worker processes per fleet (2)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    figures = measure(args.children, args.repeats, args.concurrency, args.processes)
    if args.json:
        print(json.dumps(figures))
    else:
        for mode in MODES:
            walls = ", ".join(f"{w:.2f}" for w in figures["wall_s"][mode])  # type: ignore[index]
            print(f"{mode:>3}: {figures['children_per_s'][mode]:7.1f} children/s (walls {walls} s)")  # type: ignore[index]
            print(f"{mode:>3}: {figures['cpu_ms_per_child'][mode]:7.2f} CPU ms per child (workers and Redis)")  # type: ignore[index]
        print(f"throughput on / off: {figures['ratio_on_off']}; CPU per child off / on: {figures['cpu_ratio_off_on']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
