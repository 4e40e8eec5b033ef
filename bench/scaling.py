"""How throughput grows with worker processes, subq against (b), and a wide wave of waiting children.

    python bench/scaling.py [--processes 1,8,14] [--width 1000] [--runs 2]
                            [--wave 2000] [--wave-processes 8] [--wave-threads 250] [--wave-latency-ms 1000] [--json]

Made for a lent many-core machine (issue 43, point 4; bench/device.sh runs it there with the
wheels carried, docs/benchmarks.md says how), and runs anywhere: on 2 cores it shows what 2
cores allow. It reports and asserts nothing.

Each run, for each fleet size P of `--processes` in turn: bench/overhead.py's fleets (one
private Redis, a bare fleet and a subq fleet of P processes, 16 threads each) run, after a
warm-up, one fan-out of `--width` offline children that answer at once, (b) then subq,
timed from publishing to the parent's resume (the chord's callback, subq's batch closed and
its parent resumed). A size's speedup is its children per second over the first size's, in
the same run and mode; each row also says how long after the run's start its first child
started (what is paid before any child runs, so does not spread over processes: subq's parent
and delegation, (b)'s chord and its publish, and a worker's pick-up). Then the
wave, once a run: `--wave` children that each wait `--wave-latency-ms` on their model, given at
once to a fleet of `--wave-processes` processes of `--wave-threads` threads, (b) then subq (a
warm-up wave of the same shape first, so the threads exist): the time from the delegation (or
the chord's publish) to the parent's resume (the callback). Every subq run checks each todo
item's write-back (bench/overhead.py).

Issue 43's targets on 16 cores: 1 -> 8 processes at least 7x, 1 -> 14 at least 11x, the
2000 x 1-s wave on 8 x 250 threads within 2.5 s, two runs each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.overhead import DEFAULT_CONCURRENCY, Modes, processes_arg  # noqa: E402
from bench.run import (  # noqa: E402
    BenchError,
    Sitting,
    clean_start,
    positive_int,
    print_facts,
    progress,
)
from coordinator import SubqError  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402

# (b) and subq: the bare agent under plain Celery, and subq's run of the same agent.
SCALING_MODES = ("agent", "subq")
# The targets: speedup at a fleet size, and the wave's wall time.
SPEEDUP_TARGETS = {8: 7.0, 14: 11.0}
WAVE_TARGET_S = 2.5


def scaling_run(url: str, tmp: Path, run: int, processes: Sequence[int], width: int) -> list[dict[str, Any]]:
    """One run of both modes at each fleet size: children/s, CPU a child, and the speedup over the first size."""
    rows: list[dict[str, Any]] = []
    first: dict[str, float] = {}
    for size in processes:
        progress(f"run {run}: {size} process(es) a fleet")
        modes = Modes(url, DEFAULT_CONCURRENCY, width, tmp / "probe", tmp / "logs" / f"{run}-{size}", processes=size)
        try:
            for mode in SCALING_MODES:
                modes.run(mode, DEFAULT_CONCURRENCY * 2 * size)  # every pool thread has run a child
            for mode in SCALING_MODES:
                sample = modes.run(mode, width)
                per_s = width / sample.wall_s
                first.setdefault(mode, per_s)
                rows.append(
                    {
                        "run": run,
                        "processes": size,
                        "mode": mode,
                        "children_per_s": round(per_s, 1),
                        "speedup": round(per_s / first[mode], 2),
                        "worker_cpu_ms_per_child": round(sample.worker_cpu_s * 1000 / width, 2),
                        "redis_cpu_ms_per_child": round(sample.redis_cpu_s * 1000 / width, 2),
                        # What does not spread over processes: what runs before the first child starts (the
                        # parent and its delegation, or the chord's publish) and the resume after the last ends.
                        "first_started_ms": round(sample.first_started_ms, 1),
                        "resumed_after_ms": round(sample.resumed_after_ms, 1),
                        "caller_cpu_ms": round(sample.caller_cpu_s * 1000, 1),
                    }
                )
        finally:
            modes.close()
    return rows


def wave_run(
    url: str, tmp: Path, run: int, children: int, processes: int, threads: int, latency_ms: int
) -> dict[str, float]:
    """The wall seconds, (b)'s and subq's, of one wave of `children` waiting `latency_ms` each on a fleet of
    processes x threads."""
    progress(f"run {run}: the wave, {children} children x {latency_ms} ms on {processes} x {threads} threads")
    modes = Modes(
        url, threads, children, tmp / "probe", tmp / "logs" / f"{run}-wave", latency_ms=latency_ms, processes=processes
    )
    walls_s: dict[str, float] = {}
    try:
        for mode in SCALING_MODES:
            modes.run(mode, children)  # the warm-up wave: the pool's threads and their connections made
            walls_s[mode] = round(modes.run(mode, children).wall_s, 3)
    finally:
        modes.close()
    return walls_s


def report(rows: Sequence[dict[str, Any]], waves: Sequence[dict[str, float]], args: argparse.Namespace) -> None:
    print(f"\nwidth {args.width}, {DEFAULT_CONCURRENCY} threads a process")
    print(
        f"{'run':>3} {'processes':>9} | {'(b) ch/s':>9} {'speedup':>7} {'1st ms':>6} | "
        f"{'subq ch/s':>9} {'speedup':>7} {'1st ms':>6} {'target':>7}"
    )
    by = {(row["run"], row["processes"], row["mode"]): row for row in rows}
    for run in range(1, args.runs + 1):
        for size in args.processes:
            bare, subq = by[(run, size, "agent")], by[(run, size, "subq")]
            target = SPEEDUP_TARGETS.get(size) if size != args.processes[0] else None
            print(
                f"{run:>3} {size:>9} | {bare['children_per_s']:>9.1f} {bare['speedup']:>6.2f}x "
                f"{bare['first_started_ms']:>6.0f} | {subq['children_per_s']:>9.1f} {subq['speedup']:>6.2f}x "
                f"{subq['first_started_ms']:>6.0f} {f'>= {target:g}x' if target else '':>7}"
            )
    shape = f"{args.wave} children x {args.wave_latency_ms} ms on {args.wave_processes} x {args.wave_threads} threads"
    print("1st ms: how long after the run's start its first child started (subq: the parent and its delegation;")
    print("        (b): the chord and its publish; both: a worker's pick-up)")
    for run, walls_s in enumerate(waves, 1):
        print(
            f"wave {run}: {shape}: (b) {walls_s['agent']:.2f} s, subq {walls_s['subq']:.2f} s "
            f"(subq's target {WAVE_TARGET_S:g} s when it is 2000 x 1000 ms on 8 x 250)"
        )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/scaling.py", description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=processes_arg, default=(1, 8, 14), help="fleet sizes, in turn (1,8,14)")
    parser.add_argument("--width", type=positive_int, default=1000, help="children of each timed fan-out (1000)")
    parser.add_argument("--runs", type=positive_int, default=2, help="runs of the whole sweep and wave (2)")
    parser.add_argument("--wave", type=int, default=2000, help="children of the wave (2000); 0: no wave")
    parser.add_argument("--wave-processes", type=positive_int, default=8, help="the wave's worker processes (8)")
    parser.add_argument("--wave-threads", type=positive_int, default=250, help="threads a process in the wave (250)")
    parser.add_argument(
        "--wave-latency-ms", type=positive_int, default=1000, help="each wave child's model wait (1000)"
    )
    parser.add_argument("--json", action="store_true", help="also print every figure as one JSON object")
    args = parser.parse_args(argv)
    if args.wave < 0:
        parser.error(f"--wave must be 0 or more, not {args.wave}")
    if len(set(args.processes)) != len(args.processes):
        parser.error(f"--processes names a fleet size twice: {','.join(map(str, args.processes))}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    clean_start()
    sitting = Sitting()
    rows: list[dict[str, Any]] = []
    waves: list[dict[str, float]] = []
    with local_redis() as url, tempfile.TemporaryDirectory(prefix="subq-scaling-") as tmp:
        (Path(tmp) / "probe").mkdir()
        try:
            for run in range(1, args.runs + 1):
                rows += scaling_run(url, Path(tmp), run, args.processes, args.width)
                if args.wave:
                    shape = (args.wave, args.wave_processes, args.wave_threads, args.wave_latency_ms)
                    waves.append(wave_run(url, Path(tmp), run, *shape))
        except (BenchError, SubqError, redis.RedisError) as exc:
            traceback.print_exc()
            print(f"bench: error: {exc}", file=sys.stderr)
            return 1
    facts = sitting.facts("bench/scaling.py", argv)
    print_facts(facts)
    report(rows, waves, args)
    if args.json:
        print(json.dumps({"facts": facts, "results": rows, "waves_s": waves}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
