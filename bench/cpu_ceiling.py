"""What the machine itself gives N processes of pure Python: a ceiling to read a fleet's speedup against.

    python bench/cpu_ceiling.py [--processes 1,8,14,16] [--rounds 200000] [--repeats 3] [--json]

For each count P of `--processes` in turn, P processes start together (a barrier) and each does
the same fixed work: `--rounds` JSON round-trips of a small record, the kind of pure-Python work
an agent's step is made of; the median of `--repeats` tries is kept. A count's speedup is its
round-trips a second over the first count's (with 1 first: P if every process had a core of its
own, less where cores are shared: hyper-threads, a busy host). A fleet's speedup in
bench/scaling.py is bounded by the same cores, though its own one-process figure moves from run
to run (docs/benchmarks.md, "On a lent many-core machine"). It reports; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.overhead import processes_arg  # noqa: E402
from bench.run import BenchError, Sitting, positive_int, print_facts, progress  # noqa: E402

# A record the size of a child's usage and item, round-tripped as the work unit.
RECORD = {"id": "t" * 32, "status": "done", "tokens": {"input": 1200, "output": 340}, "cost_usd": "0.019500"}
# How long the processes of a count may take to be ready together: a fork, on the slowest host.
START_TIMEOUT_S = 60.0


def work(rounds: int, barrier: Barrier) -> None:
    """The fixed work of one process, begun when every process of its count is ready."""
    barrier.wait()
    for _ in range(rounds):
        json.loads(json.dumps(RECORD))


def wall_s(processes: int, rounds: int) -> float:
    """Seconds from the common start until the last of `processes` processes has done its work."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes + 1, timeout=START_TIMEOUT_S)
    workers = [context.Process(target=work, args=(rounds, barrier)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    barrier.wait()
    started_s = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed_s = time.perf_counter() - started_s
    # A process that failed ended early: its count's time would read too short.
    if failed := [worker.exitcode for worker in workers if worker.exitcode != 0]:
        raise BenchError(f"{len(failed)} of {processes} processes failed (exit codes {failed})")
    return elapsed_s


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/cpu_ceiling.py", description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=processes_arg, default=(1, 8, 14, 16), help="counts, in turn (1,8,14,16)")
    parser.add_argument("--rounds", type=positive_int, default=200000, help="JSON round-trips a process (200000)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="tries of each count; the median is kept (3)")
    parser.add_argument("--json", action="store_true", help="also print every figure as one JSON object")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    sitting = Sitting()
    rows: list[dict[str, Any]] = []
    first_per_s = 0.0
    for processes in args.processes:
        progress(f"{processes} process(es), {args.repeats} tries")
        try:
            median_wall_s = statistics.median(wall_s(processes, args.rounds) for _ in range(args.repeats))
        except BenchError as exc:
            print(f"bench: error: {exc}", file=sys.stderr)
            return 1
        per_s = processes * args.rounds / median_wall_s
        first_per_s = first_per_s or per_s
        speedup = round(per_s / first_per_s, 2)
        rows.append(
            {
                "processes": processes,
                "wall_s": round(median_wall_s, 4),
                "rounds_per_s": round(per_s),
                "speedup": speedup,
            }
        )
    facts = sitting.facts("bench/cpu_ceiling.py", argv)
    print_facts(facts)
    print(f"{'processes':>9} {'wall s':>7} {'speedup':>8}")
    for row in rows:
        print(f"{row['processes']:>9} {row['wall_s']:>7.3f} {row['speedup']:>7.2f}x")
    if args.json:
        print(json.dumps({"facts": facts, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
