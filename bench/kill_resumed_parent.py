"""A worker SIGKILLed in the middle of a resumed parent's run, round after round: does the parent complete?

    python bench/kill_resumed_parent.py [--rounds 20] [--workers 3] [--load 0] [--deadline-s 90] [--json]

One private embedded Redis and `--workers` worker processes (each a fleet of
its own, so one can be killed and replaced), with the clock scaled down as the
fault suite scales it (a 3 s heartbeat lapse, a 0.5 s reconciler tick, a 3 s
grace; docs/architecture.md, "Convergence"). Each round, a root agent delegates
a few children; when the last one ends, the batch closes and the root's
*resumed* run is published (`<root>-r1`). As soon as that run is running (its
run sequence reads 2 and it holds its lease), the worker process group that
received it is SIGKILLed, at a moment that varies round by round:

- `start`: at once, while the run starts;
- `mid-wait`: halfway through its first model request (an offline step with `latency_ms`);
- `before-end`: a moment before its last model response, just before it ends;
- `after-end`: the crash point of coordinator/faults.py (`SUBQ_FAULT_CRASH_AT=after-end`)
  on a dedicated worker, which alone consumes the queue while the resume is published: the
  root's end is recorded (terminal, its lease, due-list entry and slot freed, all in
  `end_run.lua`), and the process dies before it returns.

A fresh worker replaces the killed one, so the fleet keeps its size. The
figures of a round: `restart_s`, from the kill to the start of the root's next
run (the reconciler published it again once the lease lapsed); `done_s`, from
the kill to the root's `completed`. The documented bound of the restart is the
lapse plus a couple of ticks (here the reconciler's 5 s leader lease, when the
killed worker led it, is longer than the 3 s lapse); a round whose root is not completed within
`--deadline-s` is stuck: its root's record, lease, due-list entry, queue, batch,
the reconciler's leader and the workers' log lines about it are printed, and
the exit status is 1. Every completed round is checked for exactly-once: each
child ran once, the root's total is the sum of every own cost, each todo item
holds its child's total, the batch closed once, and nothing is left in flight.

`--load N` starts N processes that spin on the CPU beside the fleet (the
project's machine has 2 cores), to stretch every step as a loaded host does.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator import Coordinator, Settings, TaskStatus  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402
from coordinator.local.fleet import WorkerFleet  # noqa: E402
from workers.runtime.script import script_message  # noqa: E402

MOMENTS = ("start", "mid-wait", "before-end", "after-end")
LAPSE_S = 3
TICK_S = 0.5
GRACE_S = 3
# The documented bound of a restart: the lapse plus a couple of ticks. A kill of the worker that
# leads the reconciler waits for its leader lease too (reconciler.py: three ticks, at least 5 s),
# longer than this bench's 3 s lapse (the defaults' 15 s lapse is longer than their 6 s lease).
LEADER_LAPSE_S = max(3 * TICK_S, 5.0)
RESTART_BOUND_S = max(LAPSE_S, LEADER_LAPSE_S) + 2 * TICK_S
QUEUE = "subq-kill-parent"
CHILDREN = 3
USAGE = {"input": 1000, "output": 500, "cache_write": 2000, "cache_read": 10_000}
# The resumed run's two model requests: long enough to be caught mid-wait and just before its end.
RESUMED_STEP_MS = 1500
# How far before the end of its last request a `before-end` kill lands.
BEFORE_END_MS = 150
# The children answer after this by default: long enough that all are running before the first
# ends (the `after-end` rounds need that; quick children make the batch close sooner).
CHILD_MS = 400
POLL_S = 0.02
# A worker started at once under load may take this long before it consumes.
READY_TIMEOUT_S = 120.0
# After its root completed, a round's leases, slots and due-list entries are released within this.
SETTLE_TIMEOUT_S = 20.0
# Waiting for a root's first run and its children, before the kill: a stuck setup, not a stuck resume.
SETUP_TIMEOUT_S = 60.0


def bench_settings(url: str) -> Settings:
    return Settings(
        redis_url=url,
        queue=QUEUE,
        worker_concurrency=4,
        heartbeat_lapse_s=LAPSE_S,
        reconcile_interval_s=TICK_S,
        reconcile_grace_s=GRACE_S,
        task_time_limit_s=60,
        visibility_timeout_s=600,  # far beyond a round: the reconciler, not the broker, converges it
    )


def root_script(child_ms: int) -> str:
    """Delegate CHILDREN children, then (the resumed run) two slow requests and complete."""
    children = [
        {
            "description": f"child {n}",
            "message": script_message(
                f"child {n}", [{"reply": f"child {n} done", "usage": USAGE, "latency_ms": child_ms}]
            ),
        }
        for n in range(CHILDREN)
    ]
    return script_message(
        "Delegate, then finish slowly.",
        [
            {"tool_calls": [{"name": "run_subagents", "args": {"tasks": children}}], "usage": USAGE},
            {
                "tool_calls": [{"name": "update_todo_list", "args": {"todos": "[x] children"}}],
                "usage": USAGE,
                "latency_ms": RESUMED_STEP_MS,
            },
            {
                "tool_calls": [{"name": "attempt_completion", "args": {"result": "all done"}}],
                "usage": USAGE,
                "latency_ms": RESUMED_STEP_MS,
            },
        ],
    )


@dataclass
class Round:
    index: int
    moment: str
    killed: bool = False
    restart_s: float | None = None
    done_s: float | None = None
    completed: bool = False
    problems: list[str] = field(default_factory=list)
    root_id: str = ""


class Fleet:
    """Single-process worker fleets, so one can be killed and replaced; and the crash worker."""

    def __init__(self, settings: Settings, size: int, log_dir: Path, *, replace: bool = True) -> None:
        self.settings = settings
        self.replace = replace  # a killed worker is replaced, so the fleet keeps its size
        self.log_dir = log_dir
        self.generation = 0
        self.workers: list[WorkerFleet] = []
        self.gone: list[WorkerFleet] = []
        self.crash: WorkerFleet | None = None
        for _ in range(size):
            self.workers.append(self._start(settings))
        for worker in self.workers:
            worker.wait_ready(READY_TIMEOUT_S)

    def _start(self, settings: Settings, kind: str = "w") -> WorkerFleet:
        self.generation += 1
        name = f"{kind}{self.generation}-"
        return WorkerFleet(settings, 1, self.log_dir / f"{name}", name=name)

    def holder_of(self, celery_id: str) -> WorkerFleet | None:
        """The live worker that received the Celery task `celery_id` (its log says so)."""
        needle = f"subq.run_task[{celery_id}] received"
        for worker in [*self.workers, *([self.crash] if self.crash else [])]:
            if worker.procs[0].poll() is None and needle in worker.logs[0].read_text(errors="replace"):
                return worker
        return None

    def kill_and_replace(self, worker: WorkerFleet) -> None:
        os.killpg(worker.procs[0].pid, signal.SIGKILL)
        worker.procs[0].wait()
        self.workers.remove(worker)
        self.gone.append(worker)
        if self.replace:
            self.workers.append(self._start(self.settings))  # ready-checked before the next round

    def all_ready(self) -> None:
        for worker in self.workers:
            worker.wait_ready(READY_TIMEOUT_S)

    def start_crash_worker(self, coord: Coordinator) -> None:
        """A worker that dies at `after-end`, consuming nothing until `hand_queue_to_crash`."""
        own = self.settings.model_copy(update={"fault_crash_at": "after-end", "worker_concurrency": 1})
        self.crash = self._start(own, "crash")
        self.crash.wait_ready(READY_TIMEOUT_S)
        _consume(coord, self.crash, False)

    def hand_queue_to_crash(self, coord: Coordinator) -> None:
        """From now on only the crash worker takes new messages (the others finish what they hold)."""
        for worker in self.workers:
            _consume(coord, worker, False)
        assert self.crash is not None
        _consume(coord, self.crash, True)

    def hand_queue_back(self, coord: Coordinator) -> None:
        for worker in self.workers:
            _consume(coord, worker, True)

    def logs_about(self, task_id: str, lines: int = 15) -> dict[str, list[str]]:
        out = {}
        for worker in [*self.workers, *self.gone, *([self.crash] if self.crash else [])]:
            text = worker.logs[0].read_text(errors="replace").splitlines()
            out[f"{worker.nodes[0]} (pid {worker.procs[0].pid}, rc {worker.procs[0].poll()})"] = [
                line for line in text if task_id in line or "reconciler" in line or "Error" in line
            ][-lines:]
        return out

    def stop(self) -> None:
        for worker in [*self.workers, *([self.crash] if self.crash else [])]:
            worker.stop()


def _consume(coord: Coordinator, worker: WorkerFleet, on: bool) -> None:
    """Celery's remote control: start or stop a worker's consumer of the queue (its runs go on)."""
    control = coord.app.control
    call = control.add_consumer if on else control.cancel_consumer
    replies = call(QUEUE, destination=worker.nodes, reply=True, timeout=10)
    if not replies:
        raise RuntimeError(f"{worker.nodes[0]} did not answer {'add' if on else 'cancel'}_consumer")


def spin() -> None:  # a background CPU burner (--load)
    while True:
        pass


@contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    burners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(processes)]
    for burner in burners:
        burner.start()
    try:
        yield
    finally:
        for burner in burners:
            burner.terminate()
            burner.join()


def wait_for(probe: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(POLL_S)
    raise TimeoutError(f"never saw {what} within {timeout_s:g} s")


def resumed_start_s(coord: Coordinator, task_id: str) -> float:
    """When the task's latest run started (epoch s): its timeline's last `running` mark."""
    return max(t_ms for t_ms, state in coord.get_task(task_id).timeline.m if state == "running") / 1000


def run_seq(coord: Coordinator, task_id: str) -> int:
    return int(coord.store.records.task_field(task_id, "run_seq") or 0)


def one_round(coord: Coordinator, fleet: Fleet, index: int, moment: str, deadline_s: float, child_ms: int) -> Round:
    result = Round(index, moment)
    crash = moment == "after-end"
    if crash:
        fleet.start_crash_worker(coord)
    # The crash worker must see every child running before the first ends.
    root = coord.create_task(root_script(max(child_ms, CHILD_MS) if crash else child_ms), run=True)
    result.root_id = root.id
    try:
        if crash:
            # Every child running on the fleet: then the resume, published by the last one, goes
            # to the crash worker, the only one consuming by then.
            wait_for(
                lambda: (
                    coord.get_task(root.id).status == TaskStatus.DELEGATED
                    and coord.store.runs.in_flight(root.id)["leases"] == CHILDREN
                ),
                SETUP_TIMEOUT_S,
                "every child running",
            )
            fleet.hand_queue_to_crash(coord)
            crash_worker = fleet.crash
            assert crash_worker is not None
            try:
                crash_worker.procs[0].wait(timeout=SETUP_TIMEOUT_S)
            finally:
                fleet.hand_queue_back(coord)
            killed_at = time.monotonic()
            fleet.gone.append(crash_worker)
            fleet.crash = None
            if crash_worker.procs[0].returncode != -signal.SIGKILL:
                result.problems.append(f"the crash worker exited with {crash_worker.procs[0].returncode}")
            killed_seq = run_seq(coord, root.id)
        else:
            wait_for(
                lambda: run_seq(coord, root.id) >= 2 and coord.store.runs.in_flight(root.id)["leases"] >= 1,
                SETUP_TIMEOUT_S,
                "the resumed run running",
            )
            worker = wait_for(lambda: fleet.holder_of(f"{root.id}-r1"), 10, "the worker of the resumed run")
            delay_s = {
                "start": 0.0,
                "mid-wait": RESUMED_STEP_MS / 2000,
                "before-end": (2 * RESUMED_STEP_MS - BEFORE_END_MS) / 1000,
            }[moment]
            # From the run's own start (its `running` mark, written by its start step), not from when this
            # poll saw it: on a loaded host the poll is late by more than BEFORE_END_MS, and a kill timed
            # from it landed after the run had ended.
            time.sleep(max(0.0, resumed_start_s(coord, root.id) + delay_s - time.time()))
            killed_seq = run_seq(coord, root.id)
            fleet.kill_and_replace(worker)
            killed_at = time.monotonic()
        result.killed = True
        deadline = killed_at + deadline_s
        while time.monotonic() < deadline:
            if result.restart_s is None and run_seq(coord, root.id) > killed_seq:
                result.restart_s = round(time.monotonic() - killed_at, 2)
            if coord.get_task(root.id).status == TaskStatus.COMPLETED:
                result.done_s = round(time.monotonic() - killed_at, 2)
                result.completed = True
                break
            time.sleep(POLL_S)
        if result.completed:
            result.problems += exactly_once(coord, root.id)
    except TimeoutError as exc:
        result.problems.append(str(exc))
    return result


def exactly_once(coord: Coordinator, root_id: str) -> list[str]:
    """What is wrong with a completed round: runs twice, totals, a batch closed twice, leftovers."""
    problems = []
    records = [coord.get_task(t) for t in coord.store.records.tree_task_ids(root_id)]
    root = coord.get_task(root_id)
    if root.summary != "all done":
        problems.append(f"root summary {root.summary!r}")
    own = sum(r.cost_micros for r in records)
    if root.total_cost_micros != own:
        problems.append(f"root total {root.total_cost_micros} != sum of own costs {own}")
    for child in coord.get_children(root_id):
        if child.status != TaskStatus.COMPLETED or run_seq(coord, child.id) != 1:
            problems.append(f"child {child.id}: {child.status.value}, ran {run_seq(coord, child.id)} times")
    for item in coord.get_todos(root_id):
        if item.subtask_id and item.cost_micros != coord.get_task(item.subtask_id).total_cost_micros:
            problems.append(f"todo {item.id} holds {item.cost_micros}, its child's total differs")
    closes = [m["say"] for m in coord.messages(root_id)].count("subtask_result")
    if closes != 1 or coord.store.records.task_field(root_id, "resumes") != "1":
        problems.append(f"batch closed {closes} times, resumes {coord.store.records.task_field(root_id, 'resumes')}")
    empty = {"running": 0, "admission": 0, "awaiting": 0, "leases": 0, "watched": 0}
    try:
        wait_for(lambda: coord.store.runs.in_flight(root_id) == empty, SETTLE_TIMEOUT_S, "nothing in flight")
    except TimeoutError:
        problems.append(f"left in flight: {coord.store.runs.in_flight(root_id)}")
    return problems


def diagnose(coord: Coordinator, fleet: Fleet, root_id: str) -> dict[str, Any]:
    """Everything that tells why a root did not move on: its record, lease, due entry, queue, batch, leader."""
    store, keys, client = coord.store, coord.store.keys, coord.client
    record = coord.get_task(root_id)
    batch_id = next((c.batch_id for c in coord.get_children(root_id) if c.batch_id), None)
    lease = keys.lease(root_id, root_id)
    due_at = store.convergence.watched().get(root_id)
    return {
        "root": record.model_dump(mode="json", exclude={"prompt"}),
        "root_hash": {k: v for k, v in client.hgetall(keys.task(root_id, root_id)).items() if k != "prompt"},
        "lease": {"token": client.get(lease), "ttl_ms": client.pttl(lease)},
        "due_in_s": None if due_at is None else round(due_at - time.time(), 2),
        "in_flight": store.runs.in_flight(root_id),
        "queue_len": client.llen(QUEUE),
        "queued_ids": sorted(store.convergence.queued_task_ids(QUEUE)),
        "unacked": client.hlen("unacked"),
        "batch": coord.get_batch(batch_id).model_dump(mode="json") if batch_id else None,
        "children": {c.id: (c.status.value, run_seq(coord, c.id)) for c in coord.get_children(root_id)},
        "leader": store.convergence.leader(),
        "workers_beat_s_ago": {w: round(time.time() - at, 1) for w, at in store.convergence.workers().items()},
        "repairs": store.convergence.repairs(),
        "logs": fleet.logs_about(root_id),
    }


def measure(rounds: int, workers: int, load: int, deadline_s: float, seed: int, child_ms: int) -> dict[str, Any]:
    moments = [MOMENTS[i % len(MOMENTS)] for i in range(rounds)]
    random.Random(seed).shuffle(moments)
    results: list[Round] = []
    stuck: list[dict[str, Any]] = []
    with (
        local_redis() as url,
        tempfile.TemporaryDirectory(prefix="subq-kill-parent-") as logs,
        cpu_load(load),
    ):
        settings = bench_settings(url)
        fleet = Fleet(settings, workers, Path(logs))
        coord = Coordinator(settings)
        try:
            for index, moment in enumerate(moments):
                fleet.all_ready()
                result = one_round(coord, fleet, index, moment, deadline_s, child_ms)
                results.append(result)
                print(_row(result), file=sys.stderr, flush=True)
                if not result.completed or result.problems:
                    report = diagnose(coord, fleet, result.root_id)
                    stuck.append({"round": index, "moment": moment, **report})
                    print(json.dumps(report, indent=1, default=str), file=sys.stderr, flush=True)
            repairs = coord.repairs()
        finally:
            coord.close()
            fleet.stop()
    done = [r.done_s for r in results if r.completed and r.done_s is not None]
    restarts = [r.restart_s for r in results if r.restart_s is not None]
    return {
        "rounds": len(results),
        "completed": sum(r.completed for r in results),
        "clean": sum(r.completed and not r.problems for r in results),
        "load_processes": load,
        "child_ms": child_ms,
        "done_s_median": round(statistics.median(done), 2) if done else None,
        "done_s_max": max(done) if done else None,
        "restart_s_median": round(statistics.median(restarts), 2) if restarts else None,
        "restart_s_max": max(restarts) if restarts else None,
        "restart_bound_s": RESTART_BOUND_S,
        "restarts_within_bound": sum(s <= RESTART_BOUND_S for s in restarts),
        "repairs": repairs,
        "results": [asdict(r) for r in results],
        "stuck": stuck,
    }


def _row(r: Round) -> str:
    return (
        f"{r.index:>5} {r.moment:>12} {r.restart_s!s:>10} {r.done_s!s:>8} "
        f"{'yes' if r.completed else 'STUCK':>9} {'; '.join(r.problems)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--load", type=int, default=0, help="background CPU-spinning processes")
    parser.add_argument("--deadline-s", type=float, default=90.0, help="a root not completed by then is stuck")
    parser.add_argument("--seed", type=int, default=1, help="the order of the kill moments")
    parser.add_argument("--child-ms", type=int, default=CHILD_MS, help="each child's model latency")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print(f"{'round':>5} {'moment':>12} {'restart_s':>10} {'done_s':>8} {'completed':>9} problems", file=sys.stderr)
    figures = measure(args.rounds, args.workers, args.load, args.deadline_s, args.seed, args.child_ms)
    if args.json:
        print(json.dumps(figures, default=str))
    else:
        for key in ("rounds", "completed", "clean", "load_processes", "child_ms", "done_s_median", "done_s_max",
                    "restart_s_median", "restart_s_max", "restart_bound_s", "restarts_within_bound", "repairs"):  # fmt: skip
            print(f"{key:>18}: {figures[key]}")
    return 0 if figures["clean"] == figures["rounds"] else 1


if __name__ == "__main__":
    sys.exit(main())
