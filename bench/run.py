"""Subtasks per second: a bare Celery chord of no-ops against subq's full delegation pipeline.

    python bench/run.py [--widths 10,100,1000] [--repeats 3] [--workers 2] [--concurrency N] [--json]

One process tree, one private embedded Redis, and for each mode its own
fleet of real `celery worker` processes with the same settings (all from
`make_app(Settings)`; only the queue name differs), both fleets up at once:

- bare: `chord([bench.noop.si()] * width, bench.join.s(key))` on `celery -A
  bench.bare` workers, timed from publishing to the callback having run (it
  RPUSHes a key the benchmark BLPOPs).
- subq: `Coordinator.delegate(parent, specs)` on `celery -A workers.app`
  workers, children on the offline model with a one-step script (a reply with
  usage, no latency, so no model wait), timed until `Coordinator.wait(parent)`
  returns: delegate, run, record usage, write back, resume the parent. Every
  todo item is then checked for its link, status and figures.

Each mode warms up once (every pool thread runs a task) before it is timed;
each width is run `--repeats` times, the two modes taking turns, and the
median is reported. docs/benchmarks.md explains how to read the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# `python bench/run.py` puts bench/ on sys.path, not the project root that holds the `bench` package.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from celery import Celery, chord  # noqa: E402

from bench import JOIN, NOOP  # noqa: E402
from coordinator import Coordinator, Settings, SubqError, TaskStatus  # noqa: E402
from coordinator.celery_app import make_app  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402
from coordinator.local.fleet import WorkerFleet  # noqa: E402
from coordinator.settings import DEFAULT_CONCURRENCY, DEFAULT_MAX_FANOUT, DEFAULT_POOL  # noqa: E402
from workers.runtime.script import script_message  # noqa: E402

DEFAULT_WIDTHS = (10, 100, 1000)
DEFAULT_REPEATS = 3
# The upper bound of SUBQ_MAX_FANOUT, which the bench raises to its widest width.
MAX_WIDTH = 10_000
# One worker process per core of the 2-core reference machine.
DEFAULT_WORKERS = 2
# One chord or delegation; far above any healthy run, so a hang is an error, not a figure.
RUN_TIMEOUT_S = 600.0
# A child's one model request: realistic counts so the cost write-back has real figures to carry.
CHILD_TOKENS_IN = 1000
CHILD_TOKENS_OUT = 500


def child_message(latency_ms: int = 0, tool_calls: int = 0) -> str:
    """A benchmark child's message: `tool_calls` responses that each call one tool, then one model request
    that waits `latency_ms` and answers with text."""
    usage = {"input": CHILD_TOKENS_IN, "output": CHILD_TOKENS_OUT}
    calls: list[dict[str, object]] = [
        {"tool_calls": [{"name": "lookup", "args": {"key": f"k{n}"}}], "usage": usage} for n in range(tool_calls)
    ]
    step: dict[str, object] = {"reply": "done", "usage": usage}
    if latency_ms:
        step["latency_ms"] = latency_ms
    return script_message("Benchmark subtask: answer at once.", [*calls, step])


CHILD_MESSAGE = child_message()

BARE_QUEUE = "bench-bare"
SUBQ_QUEUE = "bench-subq"

# Seconds of one run, by width; `Runs` holds them by mode ("bare", "subq").
Timer = Callable[[int], float]
Runs = dict[str, dict[int, list[float]]]


class BenchError(Exception):
    """A run that did not do what it should (its figure would be meaningless)."""


# -- the two modes -----------------------------------------------------------------------


def time_bare(app: Celery, client: redis.Redis, width: int) -> float:
    """Seconds from publishing a chord of `width` no-ops to its callback having run."""
    done_key = f"bench:done:{uuid.uuid4().hex}"
    header = [app.signature(NOOP, immutable=True) for _ in range(width)]
    callback = app.signature(JOIN, kwargs={"done_key": done_key})
    started_s = time.perf_counter()
    chord(header, callback).apply_async()
    reply = client.blpop([done_key], timeout=RUN_TIMEOUT_S)
    elapsed_s = time.perf_counter() - started_s
    if reply is None:
        raise BenchError(f"bare chord of {width}: callback did not run within {RUN_TIMEOUT_S:g}s")
    seen = json.loads(reply[1])["results"]  # what the join saw (bench/bare.py)
    if seen != width:
        raise BenchError(f"bare chord of {width}: the callback saw {seen} results")
    return elapsed_s


def time_subq(coord: Coordinator, width: int) -> float:
    """Seconds from `delegate` of `width` offline children to `wait` returning the resumed parent."""
    todos = "\n".join(f"[ ] item {index}" for index in range(width))
    parent = coord.create_task("Benchmark parent: delegate every item.", todos=todos)
    specs = [{"description": f"item {index}", "message": CHILD_MESSAGE} for index in range(width)]
    started_s = time.perf_counter()
    coord.delegate(parent.id, specs)
    record = coord.wait(parent.id, RUN_TIMEOUT_S)
    elapsed_s = time.perf_counter() - started_s
    check_write_back(coord, parent.id, width, record.status)
    return elapsed_s


def check_write_back(coord: Coordinator, parent_id: str, width: int, status: TaskStatus, responses: int = 1) -> None:
    """Every todo item is linked, completed and carries its child's tokens (of `responses` responses) and cost."""
    if status != TaskStatus.ACTIVE:
        raise BenchError(f"subq width {width}: parent {parent_id} is {status.value} after wait, not active")
    items = coord.get_todos(parent_id)
    if len(items) != width:
        raise BenchError(f"subq width {width}: parent has {len(items)} todo items")
    expected_tokens = (CHILD_TOKENS_IN + CHILD_TOKENS_OUT) * responses
    for index, item in enumerate(items):
        if item.subtask_id is None or item.status.value != "completed" or item.tokens != expected_tokens:
            raise BenchError(
                f"subq width {width}: todo item {index} ({item.content!r}) has subtask_id={item.subtask_id}, "
                f"status={item.status.value}, tokens={item.tokens}; expected a child, completed, {expected_tokens}"
            )
    costs = {item.cost_micros for item in items}
    if len(costs) != 1 or 0 in costs:
        raise BenchError(f"subq width {width}: identical children wrote back the costs {sorted(costs)} (micro-USD)")


# -- measuring ---------------------------------------------------------------------------


def measure(timers: dict[str, Timer], widths: Sequence[int], repeats: int, warmup_width: int) -> Runs:
    """Warm each mode up once, then time every width `repeats` times, the modes taking turns.

    Taking turns (bare, subq, bare, subq, ...) rather than all of one mode first
    means a burst of other work on the machine slows both modes alike, so the
    ratio holds up even where the absolute figures do not.
    """
    for name, timer in timers.items():
        progress(f"{name}: warm-up at width {warmup_width}")
        timer(warmup_width)
    runs_s: Runs = {name: {width: [] for width in widths} for name in timers}
    for width in widths:
        for repeat in range(repeats):
            for name, timer in timers.items():
                elapsed_s = timer(width)
                runs_s[name][width].append(elapsed_s)
                progress(f"{name}: width {width} run {repeat + 1}/{repeats}: {elapsed_s * 1000:.0f} ms")
    return runs_s


def bench_settings(redis_url: str, args: argparse.Namespace, queue: str) -> Settings:
    return Settings(
        redis_url=redis_url,
        queue=queue,
        worker_concurrency=args.concurrency,
        # The default fan-out limit (256) would refuse width 1000; only the coordinator reads it.
        max_fanout=max(DEFAULT_MAX_FANOUT, *args.widths),
    )


def run(args: argparse.Namespace, log_dir: Path) -> tuple[Runs, str]:
    """Both modes on one private Redis; seconds per run by mode and width, and the Redis version."""
    # Every pool thread of every worker runs one task in the warm-up: imports, clients, lazy setup.
    warmup_width = args.workers * args.concurrency
    with local_redis() as redis_url:
        # The settings differ in the queue name only, so each fleet consumes its own mode's work.
        bare_settings = bench_settings(redis_url, args, BARE_QUEUE)
        subq_settings = bench_settings(redis_url, args, SUBQ_QUEUE)
        client = redis.Redis.from_url(redis_url)
        bare_app, subq_app = make_app(bare_settings), make_app(subq_settings)
        coord = Coordinator(subq_settings, app=subq_app)
        try:
            redis_version = str(client.info("server")["redis_version"])
            # WARNING, not INFO: two log lines per task would be part of what is timed.
            quiet = {"loglevel": "WARNING"}
            with (
                WorkerFleet(
                    bare_settings, args.workers, log_dir / "bare", app_module="bench.bare", name="bare", **quiet
                ) as bare,
                WorkerFleet(subq_settings, args.workers, log_dir / "subq", name="subq", **quiet) as subq,
            ):
                bare.wait_ready(ping=bare_app)
                subq.wait_ready(ping=subq_app)
                timers: dict[str, Timer] = {
                    "bare": lambda width: time_bare(bare_app, client, width),
                    "subq": lambda width: time_subq(coord, width),
                }
                runs_s = measure(timers, args.widths, args.repeats, warmup_width)
        finally:
            coord.close()
            client.close()
            bare_app.close()
            subq_app.close()
    return runs_s, redis_version


# -- reporting ---------------------------------------------------------------------------


def summarise(runs_s: Runs, widths: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for width in widths:
        bare_s, subq_s = statistics.median(runs_s["bare"][width]), statistics.median(runs_s["subq"][width])
        rows.append(
            {
                "width": width,
                "bare_median_ms": round(bare_s * 1000, 1),
                "subq_median_ms": round(subq_s * 1000, 1),
                "bare_subtasks_per_s": round(width / bare_s, 1),
                "subq_subtasks_per_s": round(width / subq_s, 1),
                "ratio_subq_over_bare": round(bare_s / subq_s, 3),
                "bare_runs_ms": [round(s * 1000, 1) for s in runs_s["bare"][width]],
                "subq_runs_ms": [round(s * 1000, 1) for s in runs_s["subq"][width]],
            }
        )
    return rows


def machine(args: argparse.Namespace, redis_version: str, other_work: str) -> dict[str, Any]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "?"

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "celery": version("celery"),
        "kombu": version("kombu"),
        "redis-py": version("redis"),
        "pydantic-ai": version("pydantic-ai-slim"),
        "redis-server": f"{redis_version} (embedded, AOF on)",
        "workers": f"{args.workers} processes x {args.concurrency} threads per mode (pool {DEFAULT_POOL}, prefetch 1)",
        # Other work on the machine slows both modes unevenly; a figure taken under load says so here.
        "other work": other_work,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def cpu_fact() -> str:
    """The processor and how many of its cores this process may use, as a bench's `cpu` fact says them."""
    return f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores this process may use"


def machine_busy_s() -> float | None:
    """CPU seconds all cores have been busy since boot (Linux /proc/stat), or None elsewhere."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user and nice)
    idle_ticks = fields[3] + fields[4]
    return (sum(fields) - idle_ticks) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its reaped children: the workers and Redis, once stopped."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class Sitting:
    """A bench's run from its start: the facts every report begins with (its command, the cores, and what
    share of the machine other processes used meanwhile)."""

    def __init__(self) -> None:
        self.busy_before_s, self.own_before_s, self.started_s = machine_busy_s(), own_cpu_s(), time.monotonic()

    def other_work(self) -> str:
        """The share of the machine that other processes used since the start. Read it once the bench has
        stopped (and reaped) its workers and Redis, so their CPU counts as the bench's own."""
        busy_after_s = machine_busy_s()
        if self.busy_before_s is None or busy_after_s is None:
            return "unknown (no /proc/stat)"
        other_s = max(busy_after_s - self.busy_before_s - (own_cpu_s() - self.own_before_s), 0.0)
        wall_s = time.monotonic() - self.started_s
        return f"{100 * other_s / (wall_s * (os.cpu_count() or 1)):.0f}% of all cores during the run"

    def facts(self, script: str, argv: Sequence[str]) -> dict[str, str]:
        return {"command": shlex.join(["python", script, *argv]), "cpu": cpu_fact(), "other work": self.other_work()}


def print_facts(facts: dict[str, str]) -> None:
    for name, value in facts.items():
        print(f"{name + ':':<12} {value}")


def print_table(rows: list[dict[str, Any]], facts: dict[str, Any], command: str, repeats: int) -> None:
    print(f"command: {command}")
    for name, value in facts.items():
        print(f"{name + ':':14} {value}")
    print(f"median of {repeats} runs per width; subtasks/s = width / wall time of the whole chord or delegation\n")
    columns = ("bare subtasks/s", "subq subtasks/s", "subq/bare", "bare ms", "subq ms")
    header = f"{'width':>6}  " + "  ".join(f"{name:>15}" if "/s" in name else f"{name:>9}" for name in columns)
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['width']:>6}  {row['bare_subtasks_per_s']:>15.1f}  {row['subq_subtasks_per_s']:>15.1f}  "
            f"{row['ratio_subq_over_bare']:>9.3f}  {row['bare_median_ms']:>9.1f}  {row['subq_median_ms']:>9.1f}"
        )


def progress(line: str) -> None:
    print(f"[bench] {line}", file=sys.stderr, flush=True)


# -- command line ------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/run.py",
        description="Subtasks per second of a bare Celery chord of no-ops and of subq's full delegation "
        "pipeline (offline children, no model wait), on the same embedded Redis and worker settings.",
    )
    parser.add_argument(
        "--widths",
        type=widths_arg,
        default=DEFAULT_WIDTHS,
        help="comma-separated fan-out widths (default: 10,100,1000)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=DEFAULT_REPEATS,
        help="timed runs per width; the median is reported (default: 3)",
    )
    parser.add_argument(
        "--workers", type=positive_int, default=DEFAULT_WORKERS, help="worker processes per mode (default: 2)"
    )
    parser.add_argument(
        "--concurrency", type=positive_int, default=DEFAULT_CONCURRENCY,
        help=f"threads per worker process (default: subq's own default, {DEFAULT_CONCURRENCY})",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    return parser.parse_args(argv)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def widths_arg(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(positive_int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, not {text!r}") from None
    if max(widths) > MAX_WIDTH:
        raise argparse.ArgumentTypeError(f"a width above {MAX_WIDTH} exceeds what SUBQ_MAX_FANOUT may allow")
    return widths


_interrupted_by: list[int] = []


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # Unwind like Ctrl-C, so every `finally` stops the workers and Redis this run started.
    # Remembered, because a terminal's Ctrl-C also stops the embedded Redis (same process
    # group) and the unwinding then often surfaces as a Redis connection error instead.
    _interrupted_by.append(signum)
    raise KeyboardInterrupt


def clean_start() -> None:
    """Figures must not depend on the caller's shell: every setting is the bench's or subq's
    default; and Ctrl-C or SIGTERM unwinds, so the workers and Redis a bench started stop."""
    for name in [name for name in os.environ if name.startswith("SUBQ_")]:
        del os.environ[name]
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    clean_start()
    command = shlex.join(["python", "bench/run.py", *argv])
    sitting = Sitting()
    with tempfile.TemporaryDirectory(prefix="subq-bench-") as log_dir:
        try:
            runs_s, redis_version = run(args, Path(log_dir))
        except (KeyboardInterrupt, Exception) as exc:
            if _interrupted_by or isinstance(exc, KeyboardInterrupt):
                print("bench: interrupted; the workers and Redis it started are stopped", file=sys.stderr)
                return 130
            if not isinstance(exc, (BenchError, SubqError, RuntimeError, redis.RedisError)):
                raise
            print(f"bench: error: {exc}", file=sys.stderr)
            return 1
    # Measured after `run` has stopped (and reaped) every worker and Redis, so their CPU counts as ours.
    busy_other = sitting.other_work()
    rows = summarise(runs_s, args.widths)
    facts = machine(args, redis_version, busy_other)
    print_table(rows, facts, command, args.repeats)
    if args.json:
        print(json.dumps({"command": command, "machine": facts, "repeats": args.repeats, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
