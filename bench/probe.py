"""Counting one worker process's Redis round trips, for bench/overhead.py.

Imported by a worker's app module when `BENCH_PROBE_DIR` is set (bench/bare.py,
bench/subq_worker.py). It counts every request redis-py writes to a socket
(`send_packed_command`: one per command, one per pipeline or transaction, one per
script call), by the name of the first command it carries, for every client in the
process: Celery's broker and result backend (kombu and redis-py) and subq's store
alike. The benchmark reads them without a Redis round trip of its own: it writes a token into
the process's FIFO, `<dir>/<pid>.ask`, and a thread of the process that waits on it writes the
totals to `<dir>/<pid>.json` with that token (`read_counts`). The thread costs nothing
between asks: one that wrote every 100 ms took 4.7 ms of CPU a second in each process, which
a fleet of eight processes paid eight times over and the benchmark counted as its children's
(docs/benchmarks.md, "The probe's own clock").

Round trips made on a clock rather than by a run are also counted apart, as
`timed`: the process's own threads that poll or renew (`TIMED_THREADS`) and the
publishes of the worker's buffered task events, which go out at most every
100 ms or 24 events at a time (workers/task_events.py). A run that takes longer gets more of them
without doing more, so a step's own cost is the rest.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from redis.connection import AbstractConnection

__all__ = ["install", "read_counts"]

# How long `read_counts` waits for a process to answer its ask.
ANSWER_TIMEOUT_S = 5.0
ANSWER_POLL_S = 0.002
# The answer's field that says which ask it answers: not a command.
TOKEN = "_token"
# BENCH_PROBE_SITES=1 also names the subq function that made each request (slow: diagnosis only).
SITES = bool(os.environ.get("BENCH_PROBE_SITES"))
# The worker's threads that make round trips on a clock: lease renewal, the stop watch, the reconciler.
TIMED_THREADS = ("subq-heartbeat", "subq-stop-watch", "subq-reconciler")
# Celery's events exchange, in the channel kombu publishes an event message on.
EVENT_CHANNEL = b"celeryev"
_counts: Counter[str] = Counter()
_lock = threading.Lock()


def _command_head(packed: Any) -> tuple[str, bytes]:
    """The command's name and its first argument (a PUBLISH's channel)."""
    # A packed request is bytes or a list of bytes chunks starting with "*<n>\r\n$<len>\r\n<NAME>\r\n$<len>\r\n<arg>".
    head = packed if isinstance(packed, (bytes, bytearray)) else (packed[0] if packed else b"")
    if isinstance(head, memoryview):
        head = head.tobytes()
    parts = bytes(head[:160]).split(b"\r\n")
    name = parts[2].decode(errors="replace").upper() if len(parts) > 2 else "?"
    return name, parts[4] if len(parts) > 4 else b""


def _call_site() -> str:
    frame = sys._getframe(2)
    names = []
    while frame is not None and len(names) < 3:
        path = frame.f_code.co_filename
        if ("/coordinator/" in path or "/workers/" in path) and "/store/base.py" not in path:
            names.append(frame.f_code.co_name)
        frame = frame.f_back  # type: ignore[assignment]
    return "<".join(names) or "celery"


def install(directory: Path) -> None:
    original = AbstractConnection.send_packed_command

    def counted(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        name, first_arg = _command_head(command)
        # Task events go out paced or 24 at a time, from whichever thread fills the buffer.
        timed = threading.current_thread().name.startswith(TIMED_THREADS) or (
            name == "PUBLISH" and EVENT_CHANNEL in first_arg
        )
        if SITES:
            name = f"{name} {_call_site()}"
        with _lock:
            _counts["round_trips"] += 1
            _counts[name] += 1
            if timed:
                _counts["timed"] += 1
        original(self, command, check_health)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
    path, ask = directory / f"{os.getpid()}.json", directory / f"{os.getpid()}.ask"
    directory.mkdir(parents=True, exist_ok=True)
    ask.unlink(missing_ok=True)  # a process of the same pid before, in the same folder
    os.mkfifo(ask)
    # Opened for reading and writing, so that a read waits for an ask instead of seeing no writer as EOF.
    fd = os.open(ask, os.O_RDWR)

    def answer() -> None:
        while True:
            tokens = os.read(fd, 4096).split()
            with _lock:
                text = json.dumps({**_counts, TOKEN: int(tokens[-1])})
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)

    threading.Thread(target=answer, name="bench-probe", daemon=True).start()


_asks = itertools.count(1)


def read_counts(directory: Path, pid: int) -> Counter[str]:
    """The totals the probed process `pid` has counted so far: asked for, and waited on."""
    token = next(_asks)
    answer = directory / f"{pid}.json"
    try:
        fd = os.open(directory / f"{pid}.ask", os.O_WRONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return Counter()  # not started yet, or not probed
    except OSError:  # no reader: the process has ended; what it said when last asked
        return _answered(answer, None) or Counter()
    try:
        os.write(fd, f"{token}\n".encode())
    finally:
        os.close(fd)
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while time.monotonic() < deadline:
        if (counts := _answered(answer, token)) is not None:
            return counts
        time.sleep(ANSWER_POLL_S)
    raise TimeoutError(f"worker {pid}'s probe did not answer within {ANSWER_TIMEOUT_S:g}s")


def _answered(path: Path, token: int | None) -> Counter[str] | None:
    """The counts in the answer at `path` if it answers `token` (None: whichever ask it answers), else None."""
    try:
        counts = json.loads(path.read_text())
    except (OSError, ValueError):
        return None if token is not None else Counter()
    if token is not None and counts.get(TOKEN) != token:
        return None
    counts.pop(TOKEN, None)
    return Counter(counts)


if os.environ.get("BENCH_PROBE_DIR"):
    install(Path(os.environ["BENCH_PROBE_DIR"]))
