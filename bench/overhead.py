"""What subq costs per child on top of Celery and the agent library, against two bare baselines.

    python bench/overhead.py [--widths 100,1000] [--scale 1000,5000] [--repeats 3] [--concurrency 16] [--json]

One private embedded Redis, and two worker processes of the same settings
(`make_app(Settings)`: threads pool, `--concurrency` threads, prefetch 1, late
acks, task events on), each a real `celery worker` with its own queue. Three
modes, each a fan-out of `width` children, taking turns width by width:

- noop  (baseline a): `chord([bench.noop] * width, bench.join)`: what Celery costs;
- agent (baseline b): `chord([bench.agent] * width, bench.join)`, each header
  running the same pydantic-ai agent as a subq run on the same offline model with
  the same reply and usage, and no subq code: what Celery and the agent library cost;
- subq: `Coordinator.delegate(parent, specs)` of `width` offline children: run,
  record usage and cost, persist the conversation, write back onto the parent's
  todo items, close the batch, resume the parent.

Every mode is timed from publishing to its join: a bare chord's callback RPUSHes a
key the bench BLPOPs (not `AsyncResult.get()`, which polls every header's result
and so measures the caller); subq's `Coordinator.wait` blocks on the tree's
event stream. Per child, each mode reports:
- Redis round trips from the worker process (requests written by redis-py, counted
  inside the worker by bench/probe.py: Celery's broker and backend calls included),
  and of those, the ones its runs made (`by runs`: without the round trips the
  process makes on a clock, its lease renewal, stop watch, reconciler and paced
  event publishes, which are reported per second as `timed/s`);
- commands the Redis server ran (`INFO commandstats`, commands inside Lua included;
  the caller's and the idle fleet's commands are in this figure too);
- the worker process's CPU (user + system, /proc), and the Redis server's (its own
  `INFO cpu`: a step's Lua scripts run there, on the same cores);
- throughput (children per second of wall time);
- how long after the last child ended the parent was resumed (a chord's callback
  ran; subq's batch closed), p50 and p99 over every run of the width.
`--scale` times each mode at two widths, `--repeats` times each, and reports the ratio of
the median times.
docs/benchmarks.md has the figures and how to read them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from celery import chord  # noqa: E402

from bench import AGENT, JOIN, NOOP, STRETCH_ENV, TOOL_PATH, TOOLS_ENV  # noqa: E402
from bench.probe import read_counts  # noqa: E402
from bench.run import (  # noqa: E402
    RUN_TIMEOUT_S,
    BenchError,
    Sitting,
    check_write_back,
    child_message,
    clean_start,
    cpu_model,
    positive_int,
    progress,
    widths_arg,
)
from coordinator import Coordinator, Profile, Settings, SubqError  # noqa: E402
from coordinator.celery_app import make_app  # noqa: E402
from coordinator.loading import freeze_loaded  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402
from coordinator.local.fleet import WorkerFleet  # noqa: E402
from coordinator.settings import (  # noqa: E402
    DEFAULT_HEARTBEAT_LAPSE_S,
    DEFAULT_RECONCILE_GRACE_S,
    DEFAULT_RECONCILE_INTERVAL_S,
)

MODES = ("noop", "agent", "subq")
# How the sweep's report names each mode: (b) is the baseline, the same agent under plain Celery.
MODE_LABELS = {"noop": "no-op chord", "agent": "(b)", "subq": "subq"}
DEFAULT_WIDTHS = (100, 1000)
DEFAULT_SCALE = (1000, 5000)
DEFAULT_REPEATS = 3
# The reference setup: one worker process, 16 threads.
DEFAULT_CONCURRENCY = 16
# Before a run's counts are read: the workers' last acks and paced event publishes after the join land.
PROBE_SETTLE_S = 0.3
# --processes: both fleets idle this long after their runs, to take their own clocks' cost out of a child's.
DEFAULT_IDLE_S = 5.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    """One timed run of one mode at one width."""

    wall_s: float
    round_trips: int
    timed_round_trips: int  # made on a clock, not by a run (bench/probe.py)
    server_commands: int
    worker_cpu_s: float
    # The part of `worker_cpu_s` spent in the kernel: where threads that contend for one interpreter lock pay
    # for handing it over (futex calls, switches), while a process's own Python shows in user time.
    worker_system_s: float
    caller_cpu_s: float
    redis_cpu_s: float  # the Redis server's, all of its threads (INFO cpu)
    resumed_after_ms: float
    # How long after the run's start (before the delegation, or the chord's publish) its first child started:
    # what the workers wait on before they have work (subq: the delegation's commit; (b): the first message).
    first_started_ms: float
    by_command: Counter[str] = field(default_factory=Counter)
    server_by_command: Counter[str] = field(default_factory=Counter)
    # What both idle fleets cost the Redis server over this run's wall time (--processes, measured after the runs).
    redis_idle_s: float = 0.0


def process_cpu_s(pid: int) -> float:
    return sum(process_user_system_s(pid))


def process_user_system_s(pid: int) -> tuple[float, float]:
    """A process's user and system CPU seconds so far (utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def fleet_user_system_s(pids: Sequence[int]) -> tuple[float, float]:
    """Every process's user and system CPU seconds so far, summed."""
    split = [process_user_system_s(pid) for pid in pids]
    return sum(user for user, _ in split), sum(system for _, system in split)


def server_cpu_s(client: redis.Redis) -> float:
    """CPU seconds the Redis server has used so far (its own count, every thread of it)."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def server_commands(client: redis.Redis) -> Counter[str]:
    """Commands the server has run so far, by name (those inside Lua scripts included)."""
    return Counter(
        {name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in client.info("commandstats").items()}
    )


class Modes:
    """The three modes on one Redis and two probed worker processes."""

    def __init__(
        self,
        redis_url: str,
        concurrency: int,
        max_width: int,
        probe_dir: Path,
        log_dir: Path,
        latency_ms: int = 0,
        tool_calls: int = 0,
        tool_idempotent: bool = True,
        processes: int = 1,
        stretch: float = 1.0,
        grace_s: int | None = None,
    ) -> None:
        # Every child waits this long on its model (noop: sleeps it), the same message in every mode;
        # with `tool_calls`, it first calls a function tool that many times, one response each.
        self.latency_ms = latency_ms
        self.tool_calls = tool_calls
        self.message = child_message(latency_ms, tool_calls)
        # BLPOP waits for a whole run: the socket must wait as long (redis-py's default gives up sooner).
        self.client = redis.Redis.from_url(redis_url, socket_timeout=RUN_TIMEOUT_S + 30)
        self.probe_dir = probe_dir
        base = {"redis_url": redis_url, "worker_concurrency": concurrency, "max_fanout": max(256, max_width)}
        self.bare_settings = Settings(**base, queue="bench-bare")
        # --stretch: subq's clocks (the reconciler, lease renewal, and in the worker the stop watch, the
        # deliverer's poll and the progress pacer: bench/subq_worker.py) run that many times slower.
        timers: dict[str, Any] = {}
        if stretch != 1.0:
            timers = {
                "reconcile_interval_s": min(60.0, DEFAULT_RECONCILE_INTERVAL_S * stretch),
                "heartbeat_lapse_s": round(DEFAULT_HEARTBEAT_LAPSE_S * stretch),
            }
            os.environ[STRETCH_ENV] = str(stretch)
        if grace_s is not None:  # --grace-s: the reconciler looks at every child queued longer than this
            timers["reconcile_grace_s"] = grace_s
        # The tool-calling children's profile offers the same function tool as the bare agent, declared
        # idempotent (a lookup is) unless told otherwise: a response is then kept with its call's result,
        # not also before the call (docs/tools.md, section 11).
        idempotent = ["lookup"] if tool_idempotent else []
        tools = {"profiles": {"offline": Profile(tools=[TOOL_PATH], idempotent_tools=idempotent)}} if tool_calls else {}
        self.subq_settings = Settings(**base, **tools, **timers, queue="bench-subq")
        if tool_calls:
            os.environ[TOOLS_ENV] = "1"  # the bare worker offers the tool too, inherited at spawn
        self.bare_app, self.subq_app = make_app(self.bare_settings), make_app(self.subq_settings)
        self.coord = Coordinator(self.subq_settings, app=self.subq_app)
        os.environ["BENCH_PROBE_DIR"] = str(probe_dir)  # read by the workers' probe, inherited at spawn
        quiet = {"loglevel": "WARNING"}
        self.bare = WorkerFleet(
            self.bare_settings, processes, log_dir / "bare", app_module="bench.bare", name="bare", **quiet
        )
        self.subq = WorkerFleet(
            self.subq_settings, processes, log_dir / "subq", app_module="bench.subq_worker", **quiet
        )
        self.bare.wait_ready(ping=self.bare_app)
        self.subq.wait_ready(ping=self.subq_app)
        # This process delegates as `subq api` does, and `subq api` freezes what it has loaded
        # (coordinator/loading.py); it publishes every mode's fan-outs, so all of them run with it.
        freeze_loaded()

    def close(self) -> None:
        self.bare.stop()
        self.subq.stop()
        self.coord.close()
        self.client.close()
        self.bare_app.close()
        self.subq_app.close()

    def pids(self, mode: str) -> list[int]:
        return [proc.pid for proc in (self.subq if mode == "subq" else self.bare).procs]

    def trips(self, pids: Sequence[int]) -> Counter[str]:
        return sum((read_counts(self.probe_dir, pid) for pid in pids), Counter())

    def idle(self, seconds: float) -> Idle:
        """Both fleets idle for `seconds`: what each costs on its own clocks, per second."""
        time.sleep(PROBE_SETTLE_S)
        subq, bare = self.pids("subq"), self.pids("agent")
        trips_before, commands_before = self.trips(subq), server_commands(self.client)
        cpu_before = {pid: process_cpu_s(pid) for pid in (*subq, *bare)}
        redis_before, started_s = server_cpu_s(self.client), time.perf_counter()
        time.sleep(seconds)
        elapsed_s = time.perf_counter() - started_s
        redis_cpu_s, commands = server_cpu_s(self.client) - redis_before, server_commands(self.client) - commands_before
        time.sleep(PROBE_SETTLE_S)
        trips = self.trips(subq) - trips_before
        return Idle(
            redis_cpu_ms_per_s=redis_cpu_s * 1000 / elapsed_s,
            subq_cpu_ms_per_s=sum(process_cpu_s(pid) - cpu_before[pid] for pid in subq) * 1000 / elapsed_s,
            bare_cpu_ms_per_s=sum(process_cpu_s(pid) - cpu_before[pid] for pid in bare) * 1000 / elapsed_s,
            subq_trips_per_s={name: round(n / elapsed_s, 2) for name, n in trips.most_common(20)},
            commands_per_s={name: round(n / elapsed_s, 2) for name, n in commands.most_common(20)},
        )

    def run(self, mode: str, width: int, on_joined: Callable[[], object] | None = None) -> Sample:
        """One fan-out of `mode` at `width`, measured; `on_joined` is called where the run's own counts are read,
        before the bench's check of what the run wrote (its reads are not the run's)."""
        pids = self.pids(mode)
        time.sleep(PROBE_SETTLE_S)
        trips_before, (user_before, system_before) = self.trips(pids), fleet_user_system_s(pids)
        commands_before, redis_cpu_before = server_commands(self.client), server_cpu_s(self.client)
        started_s, caller_before_s = time.perf_counter(), time.process_time()
        started_epoch_s = time.time()
        joined = self._subq(width) if mode == "subq" else self._chord(mode, width)
        wall_s, caller_cpu_s = time.perf_counter() - started_s, time.process_time() - caller_before_s
        time.sleep(PROBE_SETTLE_S)
        trips = self.trips(pids) - trips_before
        # Counted before the check below: its reads verify the run, they are not part of it.
        commands = server_commands(self.client) - commands_before
        user_s, system_s = fleet_user_system_s(pids)
        worker_system_s = system_s - system_before
        worker_cpu_s = user_s - user_before + worker_system_s
        redis_cpu_s = server_cpu_s(self.client) - redis_cpu_before
        if on_joined is not None:
            on_joined()
        resumed_after_ms, first_started_s = joined() if callable(joined) else joined
        return Sample(
            wall_s=wall_s,
            round_trips=trips.pop("round_trips", 0),
            timed_round_trips=trips.pop("timed", 0),
            server_commands=sum(commands.values()),
            worker_cpu_s=worker_cpu_s,
            worker_system_s=worker_system_s,
            caller_cpu_s=caller_cpu_s,
            redis_cpu_s=redis_cpu_s,
            resumed_after_ms=resumed_after_ms,
            first_started_ms=(first_started_s - started_epoch_s) * 1000,
            by_command=trips,
            server_by_command=commands,
        )

    def _chord(self, mode: str, width: int) -> tuple[float, float]:
        """Publish the chord and wait for its callback; (its resume latency in ms, when its first child started)."""
        done_key = f"bench:done:{uuid.uuid4().hex}"
        if mode == "noop":
            header = [self.bare_app.signature(NOOP, args=(self.latency_ms,), immutable=True) for _ in range(width)]
        else:
            header = [self.bare_app.signature(AGENT, args=(self.message,), immutable=True) for _ in range(width)]
        chord(header, self.bare_app.signature(JOIN, kwargs={"done_key": done_key})).apply_async()
        reply = self.client.blpop([done_key], timeout=RUN_TIMEOUT_S)
        if reply is None:
            raise BenchError(f"{mode} chord of {width}: the callback did not run within {RUN_TIMEOUT_S:g}s")
        joined = json.loads(reply[1])
        if joined["results"] != width:
            raise BenchError(f"{mode} chord of {width}: the callback saw {joined['results']} results")
        return float(joined["after_last_ms"]), float(joined["first_started"])

    def _subq(self, width: int) -> Callable[[], tuple[float, float]]:
        """Delegate and wait; returns the check (untimed) that gives the resume latency in ms and when the first
        child started (epoch seconds: its timeline's first `running` mark)."""
        coord = self.coord
        todos = "\n".join(f"[ ] item {index}" for index in range(width))
        parent = coord.create_task("Benchmark parent: delegate every item.", todos=todos)
        specs = [{"description": f"item {index}", "message": self.message} for index in range(width)]
        batch = coord.delegate(parent.id, specs)
        status = coord.wait(parent.id, RUN_TIMEOUT_S).status

        def check() -> tuple[float, float]:
            check_write_back(coord, parent.id, width, status, responses=1 + self.tool_calls)
            ended = [
                float(coord.store.records.task_field(child_id, "finished_at") or 0) for child_id in batch.child_ids
            ]
            closed = float(self.client.hget(coord.store.keys.batch(parent.root_id, batch.id), "finished_at") or 0)
            if not closed or not all(ended):
                raise BenchError(f"subq width {width}: the batch or a child has no finished_at")
            started_ms = [_first_running_ms(coord.store.records.task_field(c, "timeline")) for c in batch.child_ids]
            return (closed - max(ended)) * 1000, min(started_ms) / 1000

        return check


def _first_running_ms(timeline: str | None) -> float:
    """When a task's first run started (epoch ms): its timeline's first `running` mark (coordinator/timeline.py)."""
    marks = json.loads(timeline or "{}").get("m", [])
    started = [t_ms for t_ms, state in marks if state == "running"]
    if not started:
        raise BenchError("a child's timeline has no running mark")
    return float(started[0])


@dataclass
class Idle:
    """Both fleets with nothing to do, per second: Redis's CPU, each fleet's, subq's round trips and the commands."""

    redis_cpu_ms_per_s: float
    subq_cpu_ms_per_s: float
    bare_cpu_ms_per_s: float
    subq_trips_per_s: dict[str, float]
    commands_per_s: dict[str, float]


def measure(
    modes: Modes, names: Sequence[str], widths: Sequence[int], repeats: int, warmup: int
) -> dict[str, dict[int, list[Sample]]]:
    for mode in names:
        progress(f"{mode}: warm-up at width {warmup}")
        modes.run(mode, warmup)
    samples: dict[str, dict[int, list[Sample]]] = {mode: {width: [] for width in widths} for mode in names}
    for width in widths:
        for repeat in range(repeats):
            for mode in names:  # taking turns: a burst of other work slows every mode alike
                sample = modes.run(mode, width)
                samples[mode][width].append(sample)
                progress(
                    f"{mode}: width {width} run {repeat + 1}/{repeats}: {sample.wall_s * 1000:.0f} ms, "
                    f"{sample.round_trips / width:.1f} round trips/child, {sample.worker_cpu_s * 1000 / width:.2f} "
                    f"ms CPU/child, resumed {sample.resumed_after_ms:.1f} ms after the last child, the first started "
                    f"{sample.first_started_ms:.0f} ms after the start"
                )
    return samples


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def summarise(samples: dict[str, dict[int, list[Sample]]]) -> list[dict[str, Any]]:
    rows = []
    for mode, by_width in samples.items():
        for width, runs in by_width.items():
            if not runs:
                continue
            top = sum((r.by_command for r in runs), Counter()).most_common(40)
            server_top = sum((r.server_by_command for r in runs), Counter()).most_common(40)
            rows.append(
                {
                    "mode": mode,
                    "width": width,
                    "runs": len(runs),
                    "children_per_s": round(width / statistics.median(r.wall_s for r in runs), 1),
                    "wall_ms": round(statistics.median(r.wall_s for r in runs) * 1000, 1),
                    "round_trips_per_child": round(statistics.median(r.round_trips for r in runs) / width, 2),
                    "run_round_trips_per_child": round(
                        statistics.median(r.round_trips - r.timed_round_trips for r in runs) / width, 2
                    ),
                    "timed_round_trips_per_s": round(
                        statistics.median(r.timed_round_trips / r.wall_s for r in runs), 1
                    ),
                    "server_commands_per_child": round(statistics.median(r.server_commands for r in runs) / width, 1),
                    "worker_cpu_ms_per_child": round(statistics.median(r.worker_cpu_s for r in runs) * 1000 / width, 2),
                    "worker_user_ms_per_child": round(
                        statistics.median(r.worker_cpu_s - r.worker_system_s for r in runs) * 1000 / width, 2
                    ),
                    "worker_system_ms_per_child": round(
                        statistics.median(r.worker_system_s for r in runs) * 1000 / width, 2
                    ),
                    "caller_cpu_ms_per_child": round(statistics.median(r.caller_cpu_s for r in runs) * 1000 / width, 2),
                    "redis_cpu_ms_per_child": round(statistics.median(r.redis_cpu_s for r in runs) * 1000 / width, 2),
                    "redis_cpu_ms_per_child_net": round(
                        statistics.median(r.redis_cpu_s - r.redis_idle_s for r in runs) * 1000 / width, 2
                    ),
                    "resumed_p50_ms": round(percentile([r.resumed_after_ms for r in runs], 0.5), 1),
                    "resumed_p99_ms": round(percentile([r.resumed_after_ms for r in runs], 0.99), 1),
                    "first_started_ms": round(statistics.median(r.first_started_ms for r in runs), 1),
                    "round_trips_by_command": {name: round(n / width / len(runs), 2) for name, n in top},
                    "server_commands_by_command": {name: round(n / width / len(runs), 2) for name, n in server_top},
                }
            )
    return rows


def print_report(rows: list[dict[str, Any]], scale: dict[str, float], facts: dict[str, Any]) -> None:
    for name, value in facts.items():
        print(f"{name + ':':16} {value}")
    print()
    header = (
        f"{'mode':>6} {'width':>6} {'children/s':>11} {'trips/child':>12} {'by runs':>8} {'timed/s':>8} "
        f"{'cmds/child':>11} "
        f"{'CPU ms/child':>13} {'caller CPU':>11} {'Redis CPU':>10} {'resumed p50':>12} {'p99 ms':>7} "
        f"{'1st start ms':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['mode']:>6} {r['width']:>6} {r['children_per_s']:>11.1f} {r['round_trips_per_child']:>12.2f} "
            f"{r['run_round_trips_per_child']:>8.2f} {r['timed_round_trips_per_s']:>8.1f} "
            f"{r['server_commands_per_child']:>11.1f} {r['worker_cpu_ms_per_child']:>13.2f} "
            f"{r['caller_cpu_ms_per_child']:>11.2f} {r['redis_cpu_ms_per_child']:>10.2f} "
            f"{r['resumed_p50_ms']:>12.1f} {r['resumed_p99_ms']:>7.1f} {r['first_started_ms']:>13.1f}"
        )
    print()
    by = {(r["mode"], r["width"]): r for r in rows}
    for width in sorted({r["width"] for r in rows}):
        subq, agent = by.get(("subq", width)), by.get(("agent", width))
        if subq and agent:
            print(
                f"width {width}: subq/agent throughput {subq['children_per_s'] / agent['children_per_s']:.2f}x; "
                f"subq's own worker CPU {subq['worker_cpu_ms_per_child'] - agent['worker_cpu_ms_per_child']:.2f} "
                f"ms/child; round trips by command: subq {subq['round_trips_by_command']}, "
                f"agent {agent['round_trips_by_command']}"
            )
    for mode, ratio in scale.items():
        print(f"scale {mode}: time({DEFAULT_SCALE[1]})/time({DEFAULT_SCALE[0]}) = {ratio:.2f}")


def sweep(
    url: str, tmp: Path, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[int, Idle], dict[str, int]]:
    """Each mode at each width on fleets of each of `args.processes` processes; rows carry `processes`.

    With `args.rounds` above 1 the sizes take turns, a round each (1, 8, 1, 8, ...: fleets started afresh
    every round), and each row is the median of its runs over the rounds: a spell in which this host runs
    slower falls on every size, not on one size's whole block of runs (the same code's CPU a child moved
    from 6.4 to 10.4 ms between two sweeps a few minutes apart, docs/benchmarks.md)."""
    samples: dict[int, dict[str, dict[int, list[Sample]]]] = {}
    idle_rounds: dict[int, list[Idle]] = {}
    repairs: Counter[str] = Counter()
    for round_index in range(args.rounds):
        for processes in args.processes:
            progress(f"{processes} process(es) a fleet: starting (round {round_index + 1}/{args.rounds})")
            modes = Modes(
                url, args.concurrency, max(args.widths), tmp / "probe", tmp / "logs" / f"{processes}-{round_index}",
                args.latency_ms, args.tool_calls, tool_idempotent=not args.tool_not_idempotent, processes=processes,
                stretch=args.stretch, grace_s=args.grace_s,
            )  # fmt: skip
            try:
                measured = measure(
                    modes, args.modes, args.widths, args.repeats, warmup=args.concurrency * 2 * processes
                )
                idle = modes.idle(args.idle_s)
                progress(
                    f"{processes} process(es) idle: Redis {idle.redis_cpu_ms_per_s:.1f} ms/s, subq's fleet "
                    f"{idle.subq_cpu_ms_per_s:.1f} ms/s, its round trips {idle.subq_trips_per_s}"
                )
                repairs += modes.coord.store.convergence.repairs()
            finally:
                modes.close()
            idle_rounds.setdefault(processes, []).append(idle)
            into = samples.setdefault(processes, {})
            for mode, by_width in measured.items():
                for width, runs in by_width.items():
                    # The Redis CPU both idle fleets cost over each run's wall time, taken out: a child's own.
                    into.setdefault(mode, {}).setdefault(width, []).extend(
                        replace(run, redis_idle_s=idle.redis_cpu_ms_per_s * run.wall_s / 1000) for run in runs
                    )
    rows = []
    for processes, by_mode in samples.items():
        for row in summarise(by_mode):
            row["processes"] = processes
            rows.append(row)
    return rows, {processes: mean_idle(idles) for processes, idles in idle_rounds.items()}, dict(repairs)


def mean_idle(idles: Sequence[Idle]) -> Idle:
    """One fleet size's idle figures over its rounds: the CPU figures' mean, the last round's counts."""
    return replace(
        idles[-1],
        redis_cpu_ms_per_s=statistics.mean(idle.redis_cpu_ms_per_s for idle in idles),
        subq_cpu_ms_per_s=statistics.mean(idle.subq_cpu_ms_per_s for idle in idles),
        bare_cpu_ms_per_s=statistics.mean(idle.bare_cpu_ms_per_s for idle in idles),
    )


# A sweep's rows by (processes, mode, width).
SweepRows = dict[tuple[int, str, int], dict[str, Any]]


def print_sweep(rows: list[dict[str, Any]], idles: dict[int, Idle], facts: dict[str, Any]) -> None:
    """The issue's table: (b) against subq a process count, CPU per child as workers + Redis."""
    for name, value in facts.items():
        print(f"{name + ':':16} {value}")
    by = {(r["processes"], r["mode"], r["width"]): r for r in rows}
    for width in sorted({r["width"] for r in rows}):
        _print_width_table(by, idles, width)
        _print_targets(by, idles, width)
    for processes, idle in sorted(idles.items()):
        print(
            f"idle, {processes} process(es): subq's round trips/s {idle.subq_trips_per_s}; commands/s {idle.commands_per_s}"
        )


def _print_width_table(by: SweepRows, idles: dict[int, Idle], width: int) -> None:
    """One width's table, a line a process count: (b)'s and subq's children/s and CPU per child, subq's Redis
    per child against a no-op chord's, and what the idle fleets cost on their own."""
    print(f"\nwidth {width}: CPU per child as workers + Redis (Redis net of both idle fleets' own)")
    header = (
        f"{'processes':>9} | {'(b) ch/s':>8} {'(b) CPU ms':>14} | {'subq ch/s':>9} {'subq CPU ms':>14} | "
        f"{'noop Redis':>10} {'subq/noop Redis':>15} | {'idle Redis ms/s':>15} {'idle subq ms/s':>14}"
    )
    print(header)
    print("-" * len(header))
    for processes in sorted(idles):
        agent, subq, noop = (by.get((processes, mode, width)) for mode in ("agent", "subq", "noop"))
        idle = idles[processes]
        print(
            f"{processes:>9} | {agent['children_per_s'] if agent else '-':>8} {_cpu(agent):>14} | "
            f"{subq['children_per_s'] if subq else '-':>9} {_cpu(subq):>14} | "
            f"{noop['redis_cpu_ms_per_child_net'] if noop else '-':>10} {_redis_ratio(subq, noop):>15} | "
            f"{idle.redis_cpu_ms_per_s:>15.1f} {idle.subq_cpu_ms_per_s:>14.1f}"
        )


def _cpu(row: dict[str, Any] | None) -> str:
    """A row's CPU per child as `workers + Redis` ms ("-" without the row)."""
    if row is None:
        return "-"
    return f"{row['worker_cpu_ms_per_child']:.1f} + {row['redis_cpu_ms_per_child_net']:.2f}"


def _redis_ratio(subq: dict[str, Any] | None, noop: dict[str, Any] | None) -> str:
    """subq's Redis CPU per child over a no-op chord's ("-" without both, or a no-op's that is not positive)."""
    if subq and noop and noop["redis_cpu_ms_per_child_net"] > 0:
        return f"{subq['redis_cpu_ms_per_child_net'] / noop['redis_cpu_ms_per_child_net']:.2f}x"
    return "-"


def total_ms(row: dict[str, Any]) -> float:
    """A row's CPU per child: workers + Redis net of the idle fleets."""
    return float(row["worker_cpu_ms_per_child"] + row["redis_cpu_ms_per_child_net"])


def growth_ms(
    by: SweepRows, width: int, first: int, last: int, figure: Callable[[dict[str, Any]], float] = total_ms
) -> dict[str, float]:
    """Each mode's `figure` (CPU per child, workers + Redis net) at `last` processes less at `first`, for the
    modes measured at both, in MODES' order."""
    grown = {}
    for mode in MODES:
        rows = by.get((first, mode, width)), by.get((last, mode, width))
        if rows[0] and rows[1]:
            grown[mode] = figure(rows[1]) - figure(rows[0])
    return grown


def _print_targets(by: SweepRows, idles: dict[int, Idle], width: int) -> None:
    """One width's figures against the issue's targets, from the fewest and the most processes measured."""
    first, last = min(idles), max(idles)

    def total(processes: int, mode: str) -> float | None:
        row = by.get((processes, mode, width))
        return None if row is None else total_ms(row)

    subq_first, subq_last, agent_first = total(first, "subq"), total(last, "subq"), total(first, "agent")
    if subq_first and agent_first:
        print(f"subq / (b) CPU per child at {first} process(es): {subq_first / agent_first:.2f}x (target 1.2x)")
    if subq_first and subq_last:
        print(f"subq CPU per child at {last} / at {first}: {subq_last / subq_first:.2f}x (target 1.1x)")
    growths = growth_ms(by, width, first, last)
    if growths:
        # In ms, beside a no-op chord's: what grows with the processes in Celery's own fleet, which a ratio
        # to subq's one-process figure hides (docs/benchmarks.md, "What grows is Celery's").
        print(
            f"CPU per child from {first} to {last} process(es), ms: "
            + ", ".join(f"{MODE_LABELS[mode]} {grown:+.2f}" for mode, grown in growths.items())
        )
        # The workers' part split: a process's own Python grows in user time; the kernel's share holds the
        # hand-overs of one interpreter lock between contending threads, which (b)'s pool threads pay at one
        # process and not at eight (docs/benchmarks.md, "User time and system time").
        for processes in (first, last):
            split = [
                f"{MODE_LABELS[mode]} {row['worker_user_ms_per_child']:.2f} / {row['worker_system_ms_per_child']:.2f}"
                for mode in MODES
                if (row := by.get((processes, mode, width)))
            ]
            print(f"workers' CPU per child at {processes} process(es), user / system, ms: " + ", ".join(split))
        users = growth_ms(by, width, first, last, lambda row: float(row["worker_user_ms_per_child"]))
        systems = growth_ms(by, width, first, last, lambda row: float(row["worker_system_ms_per_child"]))
        print(
            f"workers' CPU per child from {first} to {last} process(es), user / system, ms: "
            + ", ".join(f"{MODE_LABELS[mode]} {users[mode]:+.2f} / {systems[mode]:+.2f}" for mode in users)
        )
    subq_row, agent_row = by.get((last, "subq", width)), by.get((last, "agent", width))
    if subq_row and agent_row:
        print(
            f"subq / (b) throughput at {last}: {subq_row['children_per_s'] / agent_row['children_per_s']:.2f}x "
            "(target 1.0x)"
        )


def processes_arg(text: str) -> tuple[int, ...]:
    return widths_arg(text)


def modes_arg(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    if not names or any(name not in MODES for name in names):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(MODES)}, not {text!r}")
    return names


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/overhead.py", description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=widths_arg, default=DEFAULT_WIDTHS, help="fan-out widths (100,1000)")
    parser.add_argument(
        "--scale", type=widths_arg, default=DEFAULT_SCALE, help="two widths whose times are compared (1000,5000)"
    )
    parser.add_argument("--no-scale", action="store_true", help="skip the scale runs")
    parser.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS, help="runs per width (3)")
    parser.add_argument("--concurrency", type=positive_int, default=DEFAULT_CONCURRENCY, help="threads (16)")
    parser.add_argument("--modes", type=modes_arg, default=MODES, help="which modes to run (noop,agent,subq)")
    parser.add_argument(
        "--latency-ms", type=int, default=0, help="each child's model wait; noop sleeps it (0: answers at once)"
    )
    parser.add_argument(
        "--tool-calls", type=int, default=0, help="function-tool calls per child, one response each, before it answers"
    )
    parser.add_argument(
        "--tool-not-idempotent",
        action="store_true",
        help="subq's profile does not declare the tool idempotent: each response is also kept before its call",
    )
    parser.add_argument(
        "--processes",
        type=processes_arg,
        default=None,
        help="worker processes a fleet, one fleet size after the other (1,2,4,8): the CPU a child costs as the "
        "fleet grows, with each fleet's idle cost; runs --widths only (no scale runs)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="with --processes: the sizes take turns this many times, fleets started afresh each round; each "
        "figure is the median over the rounds (1)",
    )
    parser.add_argument(
        "--idle-s",
        type=float,
        default=DEFAULT_IDLE_S,
        help="with --processes: how long the idle fleets are measured (5)",
    )
    parser.add_argument(
        "--stretch",
        type=float,
        default=1.0,
        help="subq's own clocks (reconciler, heartbeat, stop watch, deliverer, pacer) this many times slower (1)",
    )
    parser.add_argument(
        "--grace-s",
        type=positive_int,
        default=None,
        help="subq's SUBQ_RECONCILE_GRACE_S (30): a short one has the reconciler look at each child queued longer "
        "during a wide run, and the report's repairs say whether it took any for lost",
    )
    parser.add_argument("--json", action="store_true", help="also print every figure as one JSON object")
    args = parser.parse_args(argv)
    if args.tool_calls < 0:
        parser.error("--tool-calls must be 0 or more")
    if args.latency_ms < 0:
        parser.error("--latency-ms must be 0 or more")
    if args.stretch <= 0 or args.idle_s <= 0:
        parser.error("--stretch and --idle-s must be above 0")
    if len(args.scale) != 2:
        parser.error("--scale takes exactly two widths")
    if args.rounds > 1 and args.processes is None:
        parser.error("--rounds takes turns between fleet sizes: it needs --processes")
    return args


def convergence_facts(grace_s: int, repairs: Mapping[str, int]) -> dict[str, str]:
    """The report's lines on the reconciler: the grace it waited, and its repairs by reason (none is expected:
    no worker dies and no message is lost in these runs)."""
    return {
        "reconcile grace": f"{grace_s} s",
        "repairs": ", ".join(f"{reason} {count}" for reason, count in sorted(repairs.items())) or "none",
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    clean_start()
    command = shlex.join(["python", "bench/overhead.py", *argv])
    sitting = Sitting()
    if args.processes:
        return main_sweep(args, command, sitting)
    max_width = max(*args.widths, *args.scale)
    with local_redis() as url, tempfile.TemporaryDirectory(prefix="subq-overhead-") as tmp:
        (Path(tmp) / "probe").mkdir()
        modes = Modes(
            url, args.concurrency, max_width, Path(tmp) / "probe", Path(tmp) / "logs", args.latency_ms, args.tool_calls,
            tool_idempotent=not args.tool_not_idempotent, grace_s=args.grace_s,
        )  # fmt: skip
        try:
            samples = measure(modes, args.modes, args.widths, args.repeats, warmup=args.concurrency * 2)
            scale: dict[str, float] = {}
            if not args.no_scale:
                small, large = args.scale
                for mode in args.modes:
                    # Medians of --repeats runs each: one wide run alone varies by a fifth.
                    times = {width: [] for width in (small, large)}
                    for _ in range(args.repeats):
                        for width in (small, large):
                            times[width].append(modes.run(mode, width).wall_s)
                    scale[mode] = statistics.median(times[large]) / statistics.median(times[small])
                    progress(f"{mode}: time({large})/time({small}) = {scale[mode]:.2f}")
            # The reconciler's repairs, by reason: none is expected here (no worker dies, no message is lost).
            repairs = modes.coord.store.convergence.repairs()
        except (BenchError, SubqError, redis.RedisError) as exc:
            traceback.print_exc()
            print(f"bench: error: {exc}", file=sys.stderr)
            return 1
        finally:
            modes.close()
    facts = {
        "command": command,
        "cpu": f"{cpu_model()}, {os.cpu_count()} cores",
        "workers": f"1 process per mode, pool threads, concurrency {args.concurrency}, prefetch 1",
        "model wait": f"{args.latency_ms} ms per child",
        "tool calls": f"{args.tool_calls} per child, one response each"
        + (", the tool not declared idempotent" if args.tool_not_idempotent else ", the tool declared idempotent"),
        "other work": sitting.other_work(),
        **convergence_facts(modes.subq_settings.reconcile_grace_s, repairs),  # the grace subq's fleet was handed
    }
    rows = summarise(samples)
    print_report(rows, scale, facts)
    if args.json:
        print(json.dumps({"facts": facts, "results": rows, "scale": scale}, indent=2))
    return 0


def main_sweep(args: argparse.Namespace, command: str, sitting: Sitting) -> int:
    uptime_before = Path("/proc/loadavg").read_text().split()[:3]
    with local_redis() as url, tempfile.TemporaryDirectory(prefix="subq-overhead-") as tmp:
        (Path(tmp) / "probe").mkdir()
        try:
            rows, idles, repairs = sweep(url, Path(tmp), args)
        except (BenchError, SubqError, redis.RedisError) as exc:
            traceback.print_exc()
            print(f"bench: error: {exc}", file=sys.stderr)
            return 1
    facts = {
        "command": command,
        "cpu": f"{cpu_model()}, {os.cpu_count()} cores",
        "workers": f"{','.join(map(str, args.processes))} processes a fleet, pool threads, concurrency "
        f"{args.concurrency}, prefetch 1" + (f", subq's clocks {args.stretch:g}x slower" if args.stretch != 1 else ""),
        "other work": sitting.other_work(),
        "load average": f"{' '.join(uptime_before)} before, {' '.join(Path('/proc/loadavg').read_text().split()[:3])} after",
        **convergence_facts(args.grace_s or DEFAULT_RECONCILE_GRACE_S, repairs),
    }
    print_sweep(rows, idles, facts)
    if args.json:
        print(json.dumps({"facts": facts, "results": rows, "idle": {n: vars(i) for n, i in idles.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
