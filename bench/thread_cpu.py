"""A worker's CPU per child, thread by thread: (b)'s fleet against subq's, width by width.

    python bench/thread_cpu.py [--processes 1] [--width 600] [--modes agent,subq] [--profile DIR] [--rate HZ]

bench/overhead.py's fleets (one private Redis, a bare fleet and a subq fleet of
`--processes` processes, 16 threads each); after a warm-up each mode runs one
fan-out of `--width` children while every thread's CPU is read from
/proc/<pid>/task/*/stat every 50 ms (a thread that ends during the run keeps
its last reading). Threads are named by `py-spy dump` after the run (a pool's
numbered threads summed under one name; one that ended before it is `?`, such
as subq's stop watch, which ends with the process's last run). Each thread's
context switches a child, voluntary (it waited: a lock, a socket) and
involuntary (the kernel pre-empted it), are read from
/proc/<pid>/task/*/status before and after the run. `--profile DIR`
also writes py-spy's GIL-holding samples (100 Hz, collapsed stacks) of each
worker process to DIR, where the Python of each thread's CPU shows.
docs/benchmarks.md ("Where a child's worker CPU goes") has the figures.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.overhead import Modes, modes_arg  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# How often the threads' CPU is read during a run: a thread that ends keeps its last reading.
SAMPLE_EVERY_S = 0.05
# py-spy's sampling rate with --profile (samples a second of each process).
PROFILE_RATE_HZ = 100
THREAD_LINE = re.compile(r'Thread (\d+) \((\w+)\): "(.*)"')

Threads = dict[tuple[int, int], float]


def spy() -> str:
    return shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


def threads_cpu_s(pids: Sequence[int]) -> Threads:
    """Each live thread's user + system CPU seconds, by (pid, tid)."""
    cpu: Threads = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # it ended meanwhile
            cpu[(pid, int(tid))] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return cpu


def threads_switches(pids: Sequence[int]) -> dict[tuple[int, int], tuple[int, int]]:
    """Each live thread's (voluntary, involuntary) context switches so far, by (pid, tid)."""
    switches: dict[tuple[int, int], tuple[int, int]] = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue  # it ended meanwhile
            counts = dict(line.split(":\t") for line in status.splitlines() if "ctxt_switches" in line)
            switches[(pid, int(tid))] = (
                int(counts["voluntary_ctxt_switches"]),
                int(counts["nonvoluntary_ctxt_switches"]),
            )
    return switches


def thread_names(pids: Sequence[int]) -> dict[int, str]:
    """Each live thread's Python name (a pool's number dropped), from py-spy's dump."""
    names: dict[int, str] = {}
    for pid in pids:
        dump = subprocess.run([spy(), "dump", "--nonblocking", "-p", str(pid)], capture_output=True, text=True)
        for line in dump.stdout.splitlines():
            if found := THREAD_LINE.match(line):
                names[int(found.group(1))] = re.sub(r"_\d+$", "_N", found.group(3))
    return names


def record(out: Path, pid: int, rate_hz: int = PROFILE_RATE_HZ) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid`'s threads while they hold the GIL, into collapsed stacks at `out`, until SIGINT."""
    command = [spy(), "record", "--nonblocking", "--threads", "--gil", "-r", str(rate_hz), "-f", "raw"]
    return subprocess.Popen(
        [*command, "-o", str(out), "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


# A thread name's figures a child: CPU ms, and voluntary and involuntary context switches.
Row = tuple[float, float, float]


def measure(
    modes: Modes, mode: str, width: int, profile: Path | None, rate_hz: int = PROFILE_RATE_HZ
) -> dict[str, Row]:
    """One run of `mode` at `width`: CPU ms and context switches per child, by thread name. A thread's
    switches are read before and after the run (one that ended meanwhile is left out of them)."""
    pids = modes.pids(mode)
    spies = []
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        spies = [record(profile / f"{mode}-{len(pids)}-{pid}.txt", pid, rate_hz) for pid in pids]
        time.sleep(1.0)  # py-spy attached
    before, switched_before = threads_cpu_s(pids), threads_switches(pids)
    latest: Threads = dict(before)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_EVERY_S):
            latest.update(threads_cpu_s(pids))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    run = modes.run(mode, width)
    done.set()
    sampler.join()
    latest.update(threads_cpu_s(pids))
    switched = threads_switches(pids)
    for one in spies:
        one.send_signal(signal.SIGINT)
        one.wait()
    names = thread_names(pids)
    by_name: dict[str, Row] = {}
    for (pid, tid), cpu_s in latest.items():
        name = names.get(tid, "?")
        voluntary, involuntary = switched.get((pid, tid), (0, 0))
        voluntary_before, involuntary_before = switched_before.get((pid, tid), (0, 0))
        ms, v, i = by_name.get(name, (0.0, 0.0, 0.0))
        by_name[name] = (
            ms + (cpu_s - before.get((pid, tid), 0.0)) * 1000 / width,
            v + (voluntary - voluntary_before) / width if (pid, tid) in switched else v,
            i + (involuntary - involuntary_before) / width if (pid, tid) in switched else i,
        )
    total = [sum(row[n] for row in by_name.values()) for n in (1, 2)]
    by_name["(the processes' own count)"] = (run.worker_cpu_s * 1000 / width, total[0], total[1])
    return by_name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/thread_cpu.py", description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=1, help="worker processes a fleet (1)")
    parser.add_argument("--width", type=int, default=600, help="children of the measured fan-out (600)")
    parser.add_argument("--modes", type=modes_arg, default=("agent", "subq"), help="agent,subq (the default)")
    parser.add_argument("--profile", type=Path, help="py-spy's GIL samples of each worker process, to this folder")
    parser.add_argument("--rate", type=int, default=PROFILE_RATE_HZ, help="py-spy's samples a second (100)")
    args = parser.parse_args(argv)
    if not Path(spy()).exists():  # it names the threads, with or without --profile
        parser.error("needs py-spy, which names each thread: pip install py-spy (into the venv that runs this)")
    with tempfile.TemporaryDirectory() as tmp, local_redis() as url:
        modes = Modes(url, 16, args.width, Path(tmp) / "probe", Path(tmp) / "logs", processes=args.processes)
        try:
            for mode in args.modes:
                modes.run(mode, 32 * args.processes)  # warm-up
            for mode in args.modes:
                load = Path("/proc/loadavg").read_text().split()[:3]
                print(f"{'':5} {'':14} {'thread':36} {'CPU':>14}  switches a child: voluntary, involuntary")
                for name, (ms, voluntary, involuntary) in sorted(
                    measure(modes, mode, args.width, args.profile, args.rate).items(), key=lambda i: -i[1][0]
                ):
                    print(
                        f"{mode:5} {args.processes} process(es) {name:36} {ms:6.2f} ms/child  "
                        f"{voluntary:6.2f} {involuntary:6.2f}"
                    )
                print(f"{mode:5} load average before: {' '.join(load)}", flush=True)
        finally:
            modes.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
