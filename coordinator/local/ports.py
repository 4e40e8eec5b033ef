"""Choosing a port for a local server to listen on, and checking one is free.

A port the kernel hands out for `bind(0)` comes from its ephemeral range, the
same range it takes the local port of every outgoing connection from. Between
choosing such a port and the server binding it (a redis-server or a worker
starting, seconds on a loaded host), any process's connection can take it, and
the server fails with "address in use" (CI twice, in `subq up`'s test and in
the metrics test). So `free_port` chooses below that range, where the kernel
never assigns a port on its own, and checks the port binds.

A check that a port binds says nothing of a port this process chose a moment ago for
a server that has not bound it yet: two choices in one process could meet (a test's
node and sentinel both got 19376 once, 1 in about 1,500 for six ports), and the
second server failed on "address in use". So a port handed out is not chosen again
by the same process for HOLD_S. The hold is this process's only: another process choosing
at the same moment can still meet it, as rarely as any two random picks among ~22,000.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

__all__ = ["free_port", "port_free"]

# Linux names its ephemeral range here; elsewhere (macOS: 49152-65535) its default floor is a safe bound.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768
# Below this sit the well-known and commonly configured ports (databases, proxies, 8080...).
CHOOSE_FROM = 10_000
# A host with every such port taken is broken; the bound turns a hang into an error.
MAX_TRIES = 1000
# How long a port this process handed out is not handed out again: longer than a server takes to bind it
# on a loaded host (a worker's start, seconds); few ports are handed out in 300 s next to the ~22,000 to choose from.
HOLD_S = 300.0

# The ports this process handed out, with when (monotonic s); free_port runs in threads too.
_handed_out: dict[int, float] = {}
_handed_out_lock = threading.Lock()


def cannot_listen_on(host: str) -> str | None:
    """Why no server could listen on `host` at all (a name that does not resolve, an address of another machine),
    or None: a port taken there is another matter (`port_free`)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on `host`:`port` now (bound as servers bind, with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn, Tornado and redis-server bind
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports free on every address, below the kernel's ephemeral range.

    Free on 0.0.0.0 means free on 127.0.0.1 too, so the port suits a server on either
    (worker i of a local fleet serves its metrics on the first + i). None of them was handed out by this
    process in the last HOLD_S.
    """
    low = _ephemeral_low()
    with _handed_out_lock:
        now_s = time.monotonic()
        for port, at_s in list(_handed_out.items()):
            if now_s - at_s >= HOLD_S:
                del _handed_out[port]
        for _ in range(MAX_TRIES):
            first = random.randrange(CHOOSE_FROM, low - count) if low - count > CHOOSE_FROM else _any_port()
            chosen = range(first, first + count)
            if not any(port in _handed_out for port in chosen) and all(port_free("0.0.0.0", p) for p in chosen):
                _handed_out.update(dict.fromkeys(chosen, now_s))
                return first
    raise OSError(f"no {count} consecutive free ports found in {MAX_TRIES} tries")


def _any_port() -> int:
    """One the kernel chooses: only for a host whose ephemeral range leaves nothing below it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
