"""CPU a process of subq's costs to start: a worker to `ready.`, the API to serving, a CLI command.

    python bench/process_start.py [--runs 7] [--tree DIR]

Starts a private embedded Redis and, `--runs` times each, in turn:
- a worker as the tests' fleet starts one (`python -m workers`, and `celery -A workers.app worker`
  for comparison), with the tests' settings (a 16-thread pool, the offline profile): its CPU
  (user + system, from /proc, its children's included) when its log says `ready.`;
- `subq api`: its CPU when /livez first answers;
- `subq history` (reads Redis, prints a table): its CPU to its exit.

Prints each figure's median, min and max in seconds. `--tree DIR` runs the processes on another
checkout's code (`git archive <commit> | tar -x -C DIR`) with this interpreter, to compare
two commits on one machine in one sitting (issue 43, point 5). Use CPU, not wall: a loaded host
stretches wall time, not the work a start does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from coordinator import OFFLINE_PROFILE, Profile, RunCommand, Settings
from coordinator.local.embedded_redis import local_redis
from coordinator.local.fleet import settings_env

# How long one process may take to be ready on a loaded 2-core host before the run gives up.
START_TIMEOUT_S = 120
# How often a start is checked for: a start takes seconds, a check costs the bench microseconds.
POLL_S = 0.05
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """The process's user + system CPU, and its reaped children's, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICKS_PER_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def started(argv: list[str], env: dict[str, str], tree: Path, ready: Callable[[Path], bool]) -> float:
    """Start `argv` in `tree`; its CPU once `ready(log)` holds; then stop it (its process group)."""
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        proc = subprocess.Popen(argv, env=env, cwd=tree, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not ready(Path(log.name)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{argv[1:4]} did not start:\n{Path(log.name).read_text()[-2000:]}")
                time.sleep(POLL_S)
            return cpu_s(proc.pid)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()


def worker(argv: list[str]) -> Callable[[dict[str, str], Path], float]:
    def run(env: dict[str, str], tree: Path) -> float:
        node = ["-n", f"bench{time.monotonic_ns()}@%h", "--loglevel", "INFO", "--without-mingle", "--without-gossip"]
        return started([sys.executable, *argv, *node], env, tree, lambda log: b"ready." in log.read_bytes())

    return run


def api(env: dict[str, str], tree: Path) -> float:
    port = free_port()

    def serving(_: Path) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=1):
                return True
        except OSError:
            return False

    argv = [sys.executable, "-m", "coordinator", "api", "--host", "127.0.0.1", "--port", str(port)]
    return started(argv, env | {"SUBQ_API_TOKEN": "t" * 32}, tree, serving)


def history(env: dict[str, str], tree: Path) -> float:
    before = os.times()
    subprocess.run([sys.executable, "-m", "coordinator", "history"], env=env, cwd=tree, capture_output=True, check=True)
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


STARTS = {
    "worker (python -m workers)": worker(["-m", "workers"]),
    "worker (celery -A workers.app worker)": worker(["-m", "celery", "-A", "workers.app", "worker"]),
    "api to serving (subq api)": api,
    "cli (subq history)": history,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    tree: Path = args.tree.resolve()
    if not (tree / "workers" / "__main__.py").exists():  # a tree from before `python -m workers`
        del STARTS["worker (python -m workers)"]
    with local_redis() as url, tempfile.TemporaryDirectory() as commands:
        settings = Settings(
            redis_url=url, key_prefix="subqbench", queue="subq-bench", worker_concurrency=16,
            profiles={OFFLINE_PROFILE: Profile(run_command=RunCommand(cwd=Path(commands)))},
        )  # fmt: skip
        env = settings_env(settings)
        figures: dict[str, list[float]] = {name: [] for name in STARTS}
        for _ in range(args.runs):  # in turn, so a drift in the host's load touches each alike
            for name, start in STARTS.items():
                figures[name].append(start(env, tree))
    print(f"tree {tree}, {args.runs} runs each, CPU seconds (user + system): median (min - max)")
    for name, values in figures.items():
        print(f"  {name:40} {statistics.median(values):5.2f} ({min(values):.2f} - {max(values):.2f})")
    print(json.dumps({name: statistics.median(values) for name, values in figures.items()}))


if __name__ == "__main__":
    main()
