"""Counting one worker process's Redis round trips, for bench/overhead.py.

Imported by a worker's app module when `BENCH_PROBE_DIR` is set (bench/bare.py,
bench/subq_worker.py). It counts every request redis-py writes to a socket
(`send_packed_command`: one per command, one per pipeline or transaction, one per
script call), by the name of the first command it carries, for every client in the
process: Celery's broker and result backend (kombu and redis-py) and subq's store
alike. A thread writes the totals to `<dir>/<pid>.json` every 100 ms, so the
benchmark reads them without adding a Redis round trip of its own.

Round trips made on a clock rather than by a run are also counted apart, as
`timed`: the process's own threads that poll or renew (`TIMED_THREADS`) and the
publishes of the worker's buffered task events, which go out at most every
100 ms or 24 events at a time (workers/task_events.py). A run that takes longer gets more of them
without doing more, so a step's own cost is the rest.
"""

from __future__ import annotations

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

FLUSH_S = 0.1
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
    path = directory / f"{os.getpid()}.json"

    def flush() -> None:
        while True:
            with _lock:
                text = json.dumps(dict(_counts))
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
            time.sleep(FLUSH_S)

    threading.Thread(target=flush, name="bench-probe", daemon=True).start()


def read_counts(directory: Path, pid: int) -> Counter[str]:
    """The totals a probed process wrote last (empty before its first flush)."""
    try:
        return Counter(json.loads((directory / f"{pid}.json").read_text()))
    except (OSError, ValueError):
        return Counter()


if os.environ.get("BENCH_PROBE_DIR"):
    install(Path(os.environ["BENCH_PROBE_DIR"]))
