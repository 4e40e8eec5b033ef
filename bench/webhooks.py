"""What outbound events cost a wide tree: the same fan-out with and without a subscription to every end.

    python bench/webhooks.py [--width 1000] [--repeats 3] [--workers 2] [--concurrency 16] [--answer-ms 200]
    python bench/webhooks.py --deliverer-only 1000 [--answer-ms 200] [--rate 12] [--of-tree] [--syscalls]

One private embedded Redis, one fleet of real `celery worker` processes, and a receiver on 127.0.0.1 that
takes `--answer-ms` to answer each POST (a slow service). Each run is a root agent on the offline model that
fans out `--width` one-step children (run_subagents) and completes; with a subscription, the root is
created with `webhooks=[{url, events: [task.*, child.*]}]`, so every end (the children's and the root's) is
a delivery. The two take turns, `--repeats` times each, after one warm-up of each.

Reported per mode: the tree's wall time (create to the root's end, the median), and with a subscription how
long after the root's end the last delivery arrived, how many event ids arrived, and how many arrived twice
after a 2xx; and the CPU seconds the workers, Redis and this process (the receiver) took during the tree,
and Redis's commands a task (those of scripts counted), figures a loaded machine blurs less than wall time.
The run fails (exit 1) if an end is missing or delivered twice. docs/benchmarks.md reads it.

`--deliverer-only N` times the deliverer alone (coordinator/outbound.py) in this process: N deliveries of
one root's events, no workers; the CPU its threads took a delivery. The events are all due at once, or with
`--rate R` written R a second, as a tree's ends come to one worker process (a 1,000-wide tree of 40 s on two
processes: about 12 a second each), where a claim finds fewer due at a time. With `--of-tree`, the events
are the ends of a real N-wide tree, run once by one worker beforehand and then sent again: each is another
task's, whose record the deliverer reads, as in a wide tree. With `--syscalls`, strace counts the loop
thread's system calls a delivery, by name (its CPU figure is then strace's, not the deliverer's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import cast

import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator import Coordinator, Settings, TaskStatus  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402
from coordinator.local.fleet import WorkerFleet  # noqa: E402
from coordinator.settings import DEFAULT_MAX_FANOUT  # noqa: E402
from workers.runtime.script import script_message  # noqa: E402

USAGE = {"input": 1000, "output": 500}
RUN_TIMEOUT_S = 900.0
# How long after the root's end every delivery may take to arrive (a slow receiver, a few workers).
DELIVERED_WITHIN_S = 600.0


def root_message(width: int) -> str:
    """A root that fans out `width` children of one step each, then completes."""
    child = {"reply": "done", "usage": USAGE}
    tasks = [{"description": f"item {n}", "message": script_message(f"item {n}", [child])} for n in range(width)]
    steps = [
        {"tool_calls": [{"name": "run_subagents", "args": {"tasks": tasks}}], "usage": USAGE},
        {"tool_calls": [{"name": "attempt_completion", "args": {"result": "all done"}}], "usage": USAGE},
    ]
    return script_message("Fan the items out.", steps)


class Receiver:
    """A slow webhook receiver on 127.0.0.1: each POST is answered 204 after `answer_s`; ids counted.

    Harness, not subq: one asyncio loop in a thread, reading each request's head and body by its
    Content-Length over HTTP/1.1 keep-alive (as any production server answers) and answering from a timer,
    so it costs a few tens of microseconds a POST. Its CPU is this process's, counted apart from subq's;
    a real receiver runs elsewhere. Every request's `webhook-id` is counted, so a repeat shows."""

    def __init__(self, answer_s: float) -> None:
        self.answer_s = answer_s
        self.ids: Counter[str] = Counter()
        self.last_s = 0.0
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self._server: asyncio.Server | None = None

        async def serve() -> None:
            self._server = await self.loop.create_server(lambda: _Exchange(self), "127.0.0.1", 0)
            started.set()

        threading.Thread(target=self.loop.run_forever, name="bench-receiver", daemon=True).start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop)
        started.wait()

    def answered(self, webhook_id: str) -> None:
        with self.lock:
            self.ids[webhook_id] += 1
            self.last_s = time.perf_counter()

    def count(self) -> int:
        with self.lock:
            return sum(self.ids.values())

    def mine(self, root_id: str) -> dict[str, int]:
        with self.lock:
            return {i: n for i, n in self.ids.items() if root_id in i}

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/hook"

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class _Exchange(asyncio.Protocol):
    """One connection of the receiver: requests read one after another, each answered after `answer_s`."""

    ANSWER = b"HTTP/1.1 204 No Content\r\n\r\n"

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].decode("latin-1").lower()
            sized = re.search(r"^content-length:\s*(\d+)", head, re.MULTILINE)
            length = int(sized[1]) if sized else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            found = re.search(r"^webhook-id:\s*(\S+)", head, re.MULTILINE)
            self.receiver.loop.call_later(self.receiver.answer_s, self.answer, found[1] if found else "")

    def answer(self, webhook_id: str) -> None:
        self.receiver.answered(webhook_id)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.ANSWER)


def deliverer_threads(pid: int) -> set[int]:
    """A worker's deliverer threads (native ids), named by py-spy's dump; none found without py-spy."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {int(m.group(1)) for m in re.finditer(r'^Thread (\d+) \([^)]*\): "subq-deliver', dump, re.MULTILINE)}


class Meter:
    """CPU seconds (user + system) of the worker processes, Redis and this process (the receiver), and the
    commands Redis ran: what a tree costs, whatever else the machine runs meanwhile. The workers' deliverer
    threads are counted apart too (`cpu_deliverer_s`): what delivery costs the workers, measured in them."""

    def __init__(self, fleet: WorkerFleet, redis_url: str) -> None:
        self.client = redis.Redis.from_url(redis_url)
        info = self.client.info("server")
        self.processes = {
            "workers": [psutil.Process(proc.pid) for proc in fleet.procs],
            "redis": [psutil.Process(int(info["process_id"]))],
            "receiver": [psutil.Process()],
        }
        self.deliverers = {p.pid: deliverer_threads(p.pid) for p in self.processes["workers"]}

    def read(self) -> dict[str, float]:
        figures: dict[str, float] = {}
        for name, processes in self.processes.items():
            figures[f"cpu_{name}_s"] = sum(sum(p.cpu_times()[:2]) for p in processes)
        figures["cpu_deliverer_s"] = sum(
            t.user_time + t.system_time
            for p in self.processes["workers"]
            for t in p.threads()
            if t.id in self.deliverers[p.pid]
        )
        stats = self.client.info("commandstats")
        figures["redis_calls"] = float(sum(int(v["calls"]) for v in stats.values()))
        return figures


def one_tree(coord: Coordinator, width: int, receiver: Receiver | None, meter: Meter) -> dict[str, float]:
    webhooks = [{"url": receiver.url, "events": ["task.*", "child.*"]}] if receiver is not None else None
    before = receiver.count() if receiver is not None else 0
    started = meter.read()
    started_s = time.perf_counter()
    root = coord.create_task(root_message(width), run=True, webhooks=webhooks)
    record = coord.wait(root.id, RUN_TIMEOUT_S)
    ended_s = time.perf_counter()
    ended = meter.read()
    if record.status != TaskStatus.COMPLETED:
        raise SystemExit(f"the tree {root.id} is {record.status.value}: {record.error}")
    figures = {"wall_s": ended_s - started_s}
    figures |= {name: round(ended[name] - started[name], 2) for name in ended if name.startswith("cpu_")}
    figures["redis_calls_a_task"] = round((ended["redis_calls"] - started["redis_calls"]) / (width + 1), 1)
    if receiver is not None:
        deadline = time.monotonic() + DELIVERED_WITHIN_S
        while receiver.count() - before < width + 1:
            if time.monotonic() > deadline:
                raise SystemExit(f"{receiver.count() - before} of {width + 1} ends delivered")
            time.sleep(0.1)
        time.sleep(2.0)  # a second copy, if any, would come now
        delivered = meter.read()
        figures |= {
            f"{name}_to_delivered": round(delivered[name] - started[name], 2)
            for name in delivered
            if name.startswith("cpu_")
        }
        mine = receiver.mine(root.id)
        figures |= {
            "delivered_after_end_s": receiver.last_s - ended_s,
            "event_ids": len(mine),
            "twice": sum(1 for n in mine.values() if n > 1),
        }
        if len(mine) != width + 1 or figures["twice"]:
            raise SystemExit(f"{len(mine)} event ids of {width + 1}; {figures['twice']} delivered twice")
    return figures


def tree_deliveries(coord: Coordinator, width: int, receiver: Receiver) -> tuple[str, list[str]]:
    """A `width`-wide tree run once by one worker with every end subscribed, its deliveries made: its root
    and its deliveries' ids, to send again (each end is another task's, as in a wide tree)."""
    with tempfile.TemporaryDirectory() as logs, WorkerFleet(coord.settings, 1, Path(logs)) as fleet:
        fleet.wait_ready()
        root = coord.create_task(root_message(width), run=True, webhooks=[{"url": receiver.url, "events": ["*"]}])
        coord.wait(root.id, RUN_TIMEOUT_S)
        while receiver.count() < width + 1:
            time.sleep(0.1)
    return root.id, [d.id for d in coord.deliveries(root.id)]


class Syscalls:
    """`strace -c` attached to threads of this process (harness): the system calls they make, by name.

    Started before the first event is released and stopped once the last is delivered; strace slows the
    traced threads, so a run with it says nothing of their CPU time."""

    def __init__(self, tids: list[int]) -> None:
        self.out = tempfile.NamedTemporaryFile(mode="r", suffix=".strace")  # noqa: SIM115 (closed in stop)
        args = ["strace", "-c", "-o", self.out.name] + [f"-p{tid}" for tid in tids]
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        for _ in tids:  # "strace: Process N attached", one line a thread
            self.proc.stderr.readline()

    def stop(self) -> dict[str, int]:
        """The calls made since the start, by name."""
        self.proc.send_signal(2)
        self.proc.wait()
        calls: dict[str, int] = {}
        for line in self.out.read().splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                calls[parts[-1]] = int(parts[3])
        self.out.close()
        return calls


def _deliverer_threads_cpu_s() -> tuple[float, float, float]:
    """The CPU seconds of this process's deliverer threads so far: each thread's CPU clock, and its user and
    system split from /proc (in clock ticks: 10 ms, a coarse split of a few hundred deliveries)."""
    cpu_s = user_s = system_s = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("subq-deliver") and thread.ident is not None:
            cpu_s += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            user_s += int(stat[11]) / os.sysconf("SC_CLK_TCK")
            system_s += int(stat[12]) / os.sysconf("SC_CLK_TCK")
    return cpu_s, user_s, system_s


def deliverer_cpu(deliveries: int, answer_s: float, rate: float, of_tree: bool, syscalls: bool = False) -> None:
    """The deliverer alone, in this process: `deliveries` events of one root (no workers, no runs) sent to
    the receiver, all due at once or `rate` a second; the CPU seconds its threads took a delivery
    (per-thread, /proc), whatever else runs. `of_tree`: the ends of a real `deliveries`-wide tree instead
    (`tree_deliveries`), sent again (an operator's redeliver) at that pace. `syscalls`: with strace on the
    deliverer's threads, the system calls a delivery instead of its CPU (`Syscalls`)."""
    from coordinator.outbound import Deliverer

    receiver = Receiver(answer_s)
    with local_redis() as redis_url:
        coord = Coordinator(
            Settings(
                redis_url=redis_url, queue="bench-webhooks", webhook_allow=["127.0.0.1"],
                max_fanout=max(DEFAULT_MAX_FANOUT, deliveries),
            )
        )  # fmt: skip
        if of_tree:
            root_id, ids = tree_deliveries(coord, deliveries, receiver)

            def release(n: int) -> None:
                coord.store.outbox.settle(root_id, ids[n], "pending")

            deliveries = len(ids)
        else:
            root_id = coord.create_task("Say hello.", run=False, webhooks=[{"url": receiver.url, "events": ["*"]}]).id

            def release(n: int) -> None:
                coord.store.outbox.add_event(root_id, root_id, "task.completed", {})

        before = receiver.count()
        deliverer = Deliverer(coord, lambda *_: None)
        stop = threading.Event()
        loop = threading.Thread(target=deliverer.run_forever, args=(stop,), name="subq-deliveries", daemon=True)
        if not rate:
            for n in range(deliveries):
                release(n)
        loop.start()
        # The loop's thread (the helpers resolve names and send Celery callbacks: none here).
        tracer = Syscalls([loop.native_id or 0]) if syscalls else None
        started_s = time.perf_counter()
        for n in range(deliveries if rate else 0):
            release(n)
            time.sleep(max(0.0, started_s + (n + 1) / rate - time.perf_counter()))
        while receiver.count() - before < deliveries or coord.store.outbox.pending_count() or not deliverer.idle():
            time.sleep(0.1)
        wall_s = time.perf_counter() - started_s
        calls = tracer.stop() if tracer is not None else {}
        cpu_s, user_s, system_s = _deliverer_threads_cpu_s()
        stop.set()
        twice = sum(1 for n in receiver.mine("").values() if n > 1 + of_tree)
        coord.close()
    receiver.shutdown()
    pace = (f"{rate:g} a second" if rate else "all due at once") + (", a tree's ends" if of_tree else "")
    print(f"{deliveries} deliveries ({pace}), receiver {answer_s * 1000:.0f} ms an answer: {wall_s:.1f} s, "
          f"the deliverer's threads {cpu_s / deliveries * 1e6:.0f} us of CPU a delivery (user "
          f"{user_s / deliveries * 1e6:.0f}, system {system_s / deliveries * 1e6:.0f}); {twice} twice")  # fmt: skip
    if tracer is not None:
        total = sum(calls.values())
        each = ", ".join(f"{name} {n / deliveries:.2f}" for name, n in sorted(calls.items(), key=lambda c: -c[1]))
        print(f"system calls of the loop's thread a delivery (strace -c; its CPU above is strace's): "
              f"{total / deliveries:.1f}: {each}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=16, help="threads a process")
    parser.add_argument("--answer-ms", type=int, default=200, help="how long the receiver takes to answer")
    parser.add_argument(
        "--deliverer-only", type=int, default=0, metavar="N",
        help="time the deliverer alone: N deliveries in this process, its threads' CPU a delivery",
    )  # fmt: skip
    parser.add_argument(
        "--rate", type=float, default=0.0, help="with --deliverer-only: events a second (0: all at once)"
    )
    parser.add_argument(
        "--of-tree", action="store_true",
        help="with --deliverer-only N: the ends of a real N-wide tree (run once by one worker), sent again",
    )  # fmt: skip
    parser.add_argument(
        "--syscalls", action="store_true",
        help="with --deliverer-only: count the loop thread's system calls a delivery (strace -c)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.deliverer_only:
        deliverer_cpu(args.deliverer_only, args.answer_ms / 1000, args.rate, args.of_tree, args.syscalls)
        return 0
    receiver = Receiver(args.answer_ms / 1000)
    runs: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
    with local_redis() as redis_url, tempfile.TemporaryDirectory() as logs:
        settings = Settings(
            redis_url=redis_url, queue="bench-webhooks", worker_concurrency=args.concurrency,
            max_fanout=max(DEFAULT_MAX_FANOUT, args.width), webhook_allow=["127.0.0.1"],
        )  # fmt: skip
        with WorkerFleet(settings, args.workers, Path(logs)) as fleet:
            fleet.wait_ready()
            coord = Coordinator(settings)
            meter = Meter(fleet, redis_url)
            try:
                for mode in ("without", "with"):  # warm-up
                    one_tree(coord, min(args.width, 100), receiver if mode == "with" else None, meter)
                for repeat in range(args.repeats):
                    for mode in ("without", "with"):
                        figures = one_tree(coord, args.width, receiver if mode == "with" else None, meter)
                        runs[mode].append(figures)
                        print(f"{mode} subscriptions, run {repeat + 1}: {json.dumps(figures)}", file=sys.stderr)
            finally:
                coord.close()
    receiver.shutdown()
    without = statistics.median(r["wall_s"] for r in runs["without"])
    with_ = statistics.median(r["wall_s"] for r in runs["with"])
    print(f"width {args.width}, {args.workers} x {args.concurrency} threads, receiver {args.answer_ms} ms an answer")
    print(f"tree wall time, median of {args.repeats}: without {without:.2f} s, with {with_:.2f} s "
          f"(ratio {with_ / without:.3f})")  # fmt: skip
    for name in ("workers", "deliverer", "redis", "receiver"):
        cpu = {mode: statistics.median(r[f"cpu_{name}_s"] for r in runs[mode]) for mode in runs}
        what = "workers' deliverer threads" if name == "deliverer" else name
        print(f"CPU of the {what} during the tree, median: without {cpu['without']:.2f} s, with {cpu['with']:.2f} s")
    others = {mode: statistics.median(r["cpu_workers_s"] - r["cpu_deliverer_s"] for r in runs[mode]) for mode in runs}
    pairs = [
        (w["cpu_workers_s"] - w["cpu_deliverer_s"]) - (o["cpu_workers_s"] - o["cpu_deliverer_s"])
        for o, w in zip(runs["without"], runs["with"], strict=True)
    ]
    print(f"CPU of the workers' other threads (the runs'), median: without {others['without']:.2f} s, "
          f"with {others['with']:.2f} s; pairs with - without: {', '.join(f'{d:+.2f}' for d in pairs)} s")  # fmt: skip
    to_delivered = statistics.median(r["cpu_deliverer_s_to_delivered"] for r in runs["with"])
    print(f"the workers' deliverer threads until every end was delivered: {to_delivered:.2f} s, "
          f"{to_delivered / (args.width + 1) * 1e6:.0f} us a delivery (median; 0 without py-spy to name them)")  # fmt: skip
    calls = {mode: statistics.median(r["redis_calls_a_task"] for r in runs[mode]) for mode in runs}
    print(f"Redis commands a task (scripts' own counted): without {calls['without']:.1f}, with {calls['with']:.1f}")
    after = statistics.median(r["delivered_after_end_s"] for r in runs["with"])
    print(f"every end delivered {after:.1f} s after the root's end (median); "
          f"{runs['with'][0]['event_ids']:.0f} event ids a tree, none twice")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
