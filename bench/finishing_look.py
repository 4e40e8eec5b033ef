"""What one look at a stopped tree's finishing runs costs, walking the subtree and among named tasks.

    python bench/finishing_look.py [--width 1000] [--in-flight 16] [--looks 200]

After a stop every waiter (the clients' `wait`, MCP's `wait_task`, `subq run --follow`, the event stream,
`Coordinator.wait`) looks every 0.1 s, for up to a heartbeat lapse, at which of the subtree's runs may still
record spend (`Coordinator.finishing_runs`, GET /v1/tasks/{id}/finishing). Its first look walks the subtree;
each later one names the tasks the last found (`among`: the runs the stop caught in flight). This makes a root
with `--width` children on a private Redis (their messages go to a queue no worker reads, so none runs), then
times `--looks` looks of each kind, taking turns: the walk, and a look among `--in-flight` of the children.
It prints, per look, the median and 90th percentile of its wall time, the Redis server's CPU (INFO cpu, user
+ sys) and the commands the server ran (INFO commandstats). docs/benchmarks.md has figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.overhead import server_commands, server_cpu_s  # noqa: E402
from bench.run import positive_int  # noqa: E402
from coordinator import Coordinator, Settings  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402

DEFAULT_WIDTH = 1000
MAX_WIDTH = 10_000  # SUBQ_MAX_FANOUT's ceiling: one delegation makes the children
# A stop catches in flight what the fleet was running of the tree: a worker process's threads.
DEFAULT_IN_FLIGHT = 16
DEFAULT_LOOKS = 200
# Looks in a turn: enough that the server's CPU counters (ms resolution) move by tens of ms a turn.
TURN = 20


def _server(coord: Coordinator) -> tuple[float, int]:
    """The server's CPU seconds and the commands it ran so far, its INFO calls left out (bench/overhead.py's)."""
    commands = server_commands(coord.client)
    return server_cpu_s(coord.client), sum(commands.values()) - commands["info"]


def _turn(coord: Coordinator, look: Callable[[], object], walls_ms: list[float], totals: list[float]) -> None:
    """TURN looks, each's wall time noted; the server's CPU seconds and commands added to `totals`."""
    cpu_before, calls_before = _server(coord)
    for _ in range(TURN):
        started = time.perf_counter()
        look()
        walls_ms.append((time.perf_counter() - started) * 1000)
    cpu_after, calls_after = _server(coord)
    totals[0] += cpu_after - cpu_before
    totals[1] += calls_after - calls_before


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/finishing_look.py", description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=positive_int, default=DEFAULT_WIDTH, help="children of the root (1000)")
    parser.add_argument("--in-flight", type=positive_int, default=DEFAULT_IN_FLIGHT, help="tasks a later look names")
    parser.add_argument("--looks", type=positive_int, default=DEFAULT_LOOKS, help="looks of each kind (200)")
    given = parser.parse_args(argv)
    if given.in_flight > given.width:
        parser.error(f"--in-flight must be at most --width ({given.width}), not {given.in_flight}")
    if given.width > MAX_WIDTH:
        parser.error(f"--width must be at most {MAX_WIDTH}, not {given.width}")
    with local_redis() as url:
        settings = Settings(redis_url=url, key_prefix="subqbench", queue="subq-bench-nobody", max_fanout=given.width)
        coord = Coordinator(settings)
        root = coord.create_task("a wide root", todos="[ ] x")
        specs = [{"description": f"child {n}", "message": "hello"} for n in range(given.width)]
        children = coord.delegate(root.id, specs).child_ids
        among = children[: given.in_flight]
        kinds: dict[str, Callable[[], object]] = {
            f"walk of {given.width + 1} tasks": lambda: coord.finishing_runs(root.id),
            f"among {given.in_flight}": lambda: coord.finishing_runs(root.id, among=among),
        }
        for look in kinds.values():  # warm up: the pools' first connections
            look()
        walls_ms: dict[str, list[float]] = {kind: [] for kind in kinds}
        totals = {kind: [0.0, 0.0] for kind in kinds}
        for _ in range(max(1, given.looks // TURN)):
            for kind, look in kinds.items():
                _turn(coord, look, walls_ms[kind], totals[kind])
        print(
            f"a root with {given.width} children; {len(walls_ms[next(iter(kinds))])} looks of each kind, taking turns"
        )
        print(f"{'look':<24} {'wall ms p50':>12} {'p90':>8} {'server CPU ms':>14} {'commands':>9}")
        for kind, walls in walls_ms.items():
            cpu_s, calls = totals[kind]
            p90 = statistics.quantiles(walls, n=10)[-1]
            print(
                f"{kind:<24} {statistics.median(walls):>12.2f} {p90:>8.2f} "
                f"{cpu_s * 1000 / len(walls):>14.3f} {calls / len(walls):>9.1f}"
            )
        coord.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
