"""Helpers shared by the tests: offline-model scripts and 'nothing changed' checks."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import httpx
import pytest
import redis
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr
from redis.connection import AbstractConnection

from coordinator import Coordinator, Settings, delegation, ids
from coordinator.models import Batch
from coordinator.store.keys import glob_escaped
from workers.runtime.script import script_message

if TYPE_CHECKING:
    from coordinator.outbound import Deliverer

T = TypeVar("T")


def eventually(probe: Callable[[], T | None], what: str, timeout_s: float = 30.0, every_s: float = 0.25) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(every_s)
    raise AssertionError(f"never saw {what} within {timeout_s:g}s")


def repairs_reach(count: Callable[[], int], at_least: int, what: str, timeout_s: float = 30.0) -> int:
    """A reconciler's repair count once it reaches `at_least`: the reconciler counts a repair just after it
    makes it, so the tree it repaired may end before the count is written."""
    eventually(lambda: count() >= at_least, what, timeout_s)
    return count()


# A tree's whole event stream in one read (its cap, store/base.py EVENTS_MAXLEN).
EVENTS_READ = 10_000


class HostLag:
    """How late a thread of this process woke while in the block: the host's load, measured beside a bound.

    A bound on how soon something happens in another process (a cancel reaching a run) holds on an idle
    host; on a loaded one every process is scheduled late alike. `bound_s(promise_s)` is the promise plus
    the worst lateness seen while the block ran, twice over (the subject's process wakes late too, at
    least once more on its way), so the bound measures subq, not the host.
    """

    TICK_S = 0.01

    def __init__(self) -> None:
        self.worst_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="host-lag", daemon=True)

    def _watch(self) -> None:
        while True:
            asleep_at = time.monotonic()
            if self._stop.wait(self.TICK_S):
                return
            self.worst_s = max(self.worst_s, time.monotonic() - asleep_at - self.TICK_S)

    def __enter__(self) -> HostLag:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def bound_s(self, promise_s: float) -> float:
        return promise_s + 2 * self.worst_s


def most_at_once(coord: Coordinator, root_id: str, tasks: set[str]) -> int:
    """The most of `tasks` in flight at once, by the order of the tree's event stream: a task is in flight
    from its run's start (a `live` event, `running`) to its end (`task_status`).

    A poll of the live states sees what is running only when it looks, and a loaded host can
    miss a short run; the stream holds every start and end in the order Redis took them.
    """
    started: set[str] = set()
    ended: set[str] = set()
    most = 0
    for _, event in coord.read_events(root_id, count=EVENTS_READ):
        task = event.get("task_id")
        if task not in tasks or task in ended:
            continue
        if event["type"] == "task_status":
            started.discard(task)
            ended.add(task)
        elif event["type"] == "live" and event.get("state") == "running":
            started.add(task)
            most = max(most, len(started))
    return most


def quiet(coord: Coordinator, *roots: str, still_s: float = 0.5, timeout_s: float = 15.0) -> None:
    """Wait until the trees stop changing (runs that were stopped have finished unwinding)."""
    deadline = time.monotonic() + timeout_s
    last = state(coord, *roots)
    while time.monotonic() < deadline:
        time.sleep(still_s)
        now = state(coord, *roots)
        if now == last:
            return
        last = now
    raise AssertionError(f"trees {roots} kept changing for {timeout_s:g}s")


def delegate_as_its_run(coord: Coordinator, task_id: str, subtasks: list[Any], mode: str = "parallel") -> Batch:
    """Delegate from an agent's task as its own run does, under a lease's token: only its run may (a delegation
    from outside is refused). The lease is given back before the publish, which then takes the task off the due
    list as a run's end would."""
    lease = coord.store.keys.lease(ids.root_of(task_id), task_id)
    coord.client.set(lease, "a-test-run", px=60_000)
    try:
        batch, children = delegation.commit(coord.plane, task_id, subtasks, mode, token="a-test-run")
    finally:
        coord.client.delete(lease)
    delegation.publish(coord.plane, batch, children)
    return batch


def script(*steps: dict[str, Any], text: str = "Do the subtask.") -> str:
    """A task message carrying an offline-model script."""
    return script_message(text, steps)


def scripted_children(coord: Coordinator, prompt: str, items: str = "ab") -> tuple[str, list[str]]:
    """A caller parent with one todo item per letter of `items`, and a child delegated onto each that answers at once
    (`usage_step`): the parent's id (a root's: its tree's too) and its children's, in order."""
    parent = coord.create_task(prompt, todos="\n".join(f"[ ] {item}" for item in items))
    batch = coord.delegate(parent.id, [{"description": item, "message": script(usage_step())} for item in items])
    return parent.id, list(batch.child_ids)


def usage_step(
    reply: str = "done", input: int = 1000, output: int = 500, cache_write: int = 2000, cache_read: int = 10_000
) -> dict[str, Any]:
    return {
        "reply": reply,
        "usage": {"input": input, "output": output, "cache_write": cache_write, "cache_read": cache_read},
    }


def state(coord: Coordinator, *roots: str) -> tuple[dict[str, object], int]:
    """subq's keys with their values, and the length of the coordinator's Celery queue.

    With `roots`, only those trees' keys (and the root and approval indexes): trees of
    earlier tests may still be settling in the background (a stopped run writes its
    last UI message as it unwinds), and must not count as a change made here. Only
    those keys are read (SCAN MATCH per tree), so the cost does not grow with the
    keys earlier tests left. Without `roots`, every key of the prefix, except the
    counters every delegation bumps (history index, numbering, metrics, rate windows) and the tenants'
    submit windows (each lapses a minute after its last submit).
    """
    client: redis.Redis = coord.client
    prefix = coord.settings.key_prefix
    if roots:
        shared = [f"{prefix}:roots", f"{prefix}:approvals"]
        trees = [key for root in roots for key in _scan(client, f"{glob_escaped(prefix)}:{{{glob_escaped(root)}}}:*")]
        keys = _read(client, [*shared, *trees])
    else:
        volatile = (f"{prefix}:tasks", f"{prefix}:task-number", f"{prefix}:metrics:", f"{prefix}:rate:")
        # A tenant's submit window lapses a minute after its last submit, whenever that falls (snapshot_of too).
        lapsing = re.compile(rf"{re.escape(prefix)}:tenant:\{{[^}}]*\}}:submits$")
        every = _scan(client, f"{glob_escaped(prefix)}:*")
        keys = _read(client, [key for key in every if not key.startswith(volatile) and not lapsing.match(key)])
    return keys, int(client.llen(coord.settings.queue))


# How state() reads each type of key: by content, never DUMP (a set's serialised
# order can change on rehashing without any write; its members are sorted below).
_READERS: dict[str, Callable[[Any, str], object]] = {
    "string": lambda pipe, key: pipe.get(key),
    "hash": lambda pipe, key: pipe.hgetall(key),
    "list": lambda pipe, key: pipe.lrange(key, 0, -1),
    "set": lambda pipe, key: pipe.smembers(key),
    "zset": lambda pipe, key: pipe.zrange(key, 0, -1, withscores=True),
    "stream": lambda pipe, key: pipe.xrange(key),
}


def _scan(client: redis.Redis, pattern: str) -> set[str]:
    return {_text(key) for key in client.scan_iter(match=pattern, count=1000)}


def _read(client: redis.Redis, keys: list[str]) -> dict[str, object]:
    """{key: (type, value)} of those of `keys` that exist; two pipelined round trips."""
    keys = sorted(set(keys))
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.type(key)
        kinds = [_text(kind) for kind in pipe.execute()]
    present = [(key, kind) for key, kind in zip(keys, kinds, strict=True) if kind in _READERS]
    with client.pipeline(transaction=False) as pipe:
        for key, kind in present:
            _READERS[kind](pipe, key)
        values = pipe.execute()
    return {
        key: (kind, sorted(_text(m) for m in value) if kind == "set" else value)
        for (key, kind), value in zip(present, values, strict=True)
    }


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# How long a worker or `subq tools` that the tests start may take to check its settings and stop:
# beside two busy loops on 2 cores, each took 40 s to refuse a profile whose MCP server is down (issue 43).
CHECK_TIMEOUT_S = 180
# A request to a test's API: httpx's own default is 5 s, which a loaded host's first request to a fresh
# server (its imports, a uvicorn thread beside a worker fleet) has missed; the answer is checked, not its speed.
REQUEST_TIMEOUT_S = 30.0

TOKEN = "test-token-5f0c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START_TIMEOUT_S = 15


class ApiServer:
    """A real uvicorn server for `app` on a free 127.0.0.1 port, run in a thread; a context manager."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        # proxy_headers off, as `subq api` runs it: forwarded headers count only from SUBQ_API_TRUSTED_PROXIES.
        config = uvicorn.Config(
            app, log_config=None, access_log=False, timeout_graceful_shutdown=2, proxy_headers=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> ApiServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def client(self, headers: dict[str, str] | None = None, timeout_s: float = 30) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=AUTH if headers is None else headers, timeout=timeout_s)


# A test server is shared by a whole module whose tests send wrong tokens on purpose, all
# from 127.0.0.1: far more than a person would. tests/test_security.py sets small limits.
TEST_AUTH_ATTEMPTS_PER_MIN = 100_000


def api_settings(settings: Settings, **update: Any) -> Settings:
    return settings.model_copy(
        update={"api_token": SecretStr(TOKEN), "api_auth_attempts_per_min": TEST_AUTH_ATTEMPTS_PER_MIN, **update}
    )


@contextmanager
def api_coordinator(settings: Settings, prefix: str, queue: str) -> Iterator[Coordinator]:
    """A coordinator of the API's test settings on keys of its own (`prefix`) and a queue no worker reads; its keys
    are removed after."""
    coord = Coordinator(api_settings(settings, key_prefix=prefix, queue=queue))
    try:
        yield coord
    finally:
        for key in coord.client.scan_iter(f"{prefix}:*"):
            coord.client.delete(key)
        coord.close()


def api_server(coord: Coordinator, **update: Any) -> ApiServer:
    """A real API server of `coord`, its settings changed by `update` (a context manager)."""
    from coordinator.api import create_app

    return ApiServer(create_app(coord.settings.model_copy(update=update), coordinator=coord))


class Transport:
    """How a CLI test reaches subq: straight to Redis, or through a real API server (`subq --api-url`).

    `env(settings)` is the SUBQ_ environment that reaches the keys and queue of
    `settings` that way. The API variant gives no Redis URL at all, so a command
    that still needed Redis would fail; it starts one server per distinct prefix
    and queue and keeps it for the module (a context manager).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._servers: dict[tuple[str, str], tuple[Coordinator, ApiServer]] = {}

    def env(self, settings: Settings) -> dict[str, str]:
        if self.name == "redis":
            return {
                "SUBQ_REDIS_URL": settings.redis_url or "",
                "SUBQ_KEY_PREFIX": settings.key_prefix,
                "SUBQ_QUEUE": settings.queue,
            }
        return {"SUBQ_API_URL": self.server(settings).url, "SUBQ_API_TOKEN": TOKEN}

    def server(self, settings: Settings) -> ApiServer:
        """The module's API server over the keys and queue of `settings`."""
        key = (settings.key_prefix, settings.queue)
        if key not in self._servers:
            from coordinator.api import create_app

            coord = Coordinator(api_settings(settings))
            server = ApiServer(create_app(coordinator=coord)).__enter__()
            self._servers[key] = (coord, server)
        return self._servers[key][1]

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        for coord, server in self._servers.values():
            server.__exit__()
            coord.close()
        self._servers.clear()


def start_worker_with(settings: Settings, **subq: str) -> subprocess.CompletedProcess[str]:
    """`celery -A workers.app worker` on the session's Redis with these SUBQ_ settings only; it is expected to stop."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")}
    env |= {"SUBQ_REDIS_URL": settings.redis_url or "", **subq}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "workers.app", "worker"],
        cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
    )  # fmt: skip


def subq_tools(settings: Settings, *args: str, through_cli: bool = False) -> subprocess.CompletedProcess[str]:
    """`subq tools` (the check a worker makes at start) with exactly these settings.

    The command execs `python -m workers.runtime.profile_tools`, which this runs directly unless
    `through_cli`: the CLI's own process before the exec cost 1.2 s of CPU a call on 2 cores (issue 43),
    and tests/test_profile_tools.py and tests/test_mcp.py run the whole command.
    """
    from coordinator.local.fleet import settings_env

    command = ["coordinator", "tools"] if through_cli else ["workers.runtime.profile_tools"]
    return subprocess.run(
        [sys.executable, "-m", *command, *args], env=settings_env(settings),
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
    )  # fmt: skip


def assert_worker_refuses(settings: Settings, log_dir: Path, line: str) -> None:
    """A worker with these settings stops at start, and its log says `line`; `subq tools` says it too."""
    from coordinator.local.fleet import WorkerFleet

    checked = subq_tools(settings)
    assert checked.returncode == 1 and checked.stderr == f"subq: {line}\n", checked.stderr
    fleet = WorkerFleet(settings, 1, log_dir)
    try:
        assert fleet.procs[0].wait(timeout=CHECK_TIMEOUT_S) != 0, "the worker refused to start"
    finally:
        fleet.stop()
    assert line in fleet.logs[0].read_text(errors="replace")


def processes_with(argument: str) -> list[int]:
    """The live pids (zombies left out) whose command line holds `argument`, read from /proc; a
    sandboxed command's own pids are its namespace's, so a test finds its processes this way."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # not a process, or it ended meanwhile
        if argument.encode() in words and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def profiles_refused(profiles: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> str:
    """The one line settings refuse `SUBQ_PROFILES=profiles` with (it fails the test if they take them)."""
    from coordinator import ConfigError
    from coordinator.settings import load_settings

    monkeypatch.setenv("SUBQ_PROFILES", json.dumps(profiles))
    with pytest.raises(ConfigError) as caught:
        load_settings()
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def connections_counted(accepted: list[object], at_least: int) -> int:
    """How many connections a `counting_listener` has accepted, once it has at least `at_least`: its thread
    counts one a moment after the client connected, on a loaded host after the client's command has ended.
    Connections are accepted in the order they came, so one counted late was not lost by an earlier check."""
    eventually(lambda: len(accepted) >= at_least or None, f"the listener to count {at_least} connection(s)")
    return len(accepted)


@contextmanager
def counting_listener(host: str = "127.0.0.1") -> Iterator[tuple[int, list[object]]]:
    """A TCP listener on `host` (0.0.0.0: every address of this machine) that counts the connections it
    accepts: (its port, the accepted connections)."""
    server = socket.create_server((host, 0))
    accepted: list[object] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        server.close()


def requests_sent(monkeypatch: pytest.MonkeyPatch, *thread_names: str) -> list[str]:
    """The first command of each request written to Redis from now on, in order: from this thread and from
    the threads named `thread_names` only. Another thread of the process (a heartbeat's, a reconciler's)
    writes on its own clock: a fresh clone's suite once counted a ZADD of one inside a child's run.
    `monkeypatch.undo()` stops the count."""
    sent: list[str] = []
    original = AbstractConnection.send_packed_command
    caller = threading.current_thread()

    def counted(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        here = threading.current_thread()
        if here is caller or here.name in thread_names:
            head = bytes(command if isinstance(command, bytes) else command[0])[:40]
            sent.append(head.split(b"\r\n")[2].decode())
        original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    return sent


def snapshot_of(coord: Coordinator, *roots: str) -> dict[str, object]:
    """Every key of the prefix with its value (`Metrics.snapshot`: the fleet's shared keys, the due list and the
    metrics included), less the keys of trees other than `roots`: an earlier test's tree may still settle, or
    its keys expire, meanwhile (a lease another test left lapsed between two snapshots of a loaded run).
    A tenant's submit window is left out too: it lapses a minute after the last submit, on no tree's clock
    (a fresh clone's slow run once read it before a duplicate callback and not after). The fleet's `reserved`
    set keeps only the runs of `roots`: each worker's beat rewrites it on the worker's clock (a quiet fresh
    clone's run once saw a beat drop another tree's held run between two snapshots), and holding none of theirs
    it counts as absent (another saw the beat take the set's last entry away, and the key with it)."""
    prefix = re.escape(coord.settings.key_prefix)
    ours = {f"{coord.settings.key_prefix}:{{{root}}}:" for root in roots}
    tree_key = re.compile(rf"{prefix}:\{{[^}}]*\}}:")
    submit_window = re.compile(rf"{prefix}:tenant:\{{[^}}]*\}}:submits$")
    reserved = coord.store.keys.reserved()
    kept = {
        key: value
        for key, value in coord.store.metrics.snapshot().items()
        if (not (found := tree_key.match(key)) or found.group(0) in ours) and not submit_window.match(key)
    }
    if reserved in kept:
        kind, members = cast(tuple[str, list[tuple[str, float]]], kept[reserved])
        ours_reserved = [(m, score) for m, score in members if m.startswith(roots)]
        if ours_reserved:
            kept[reserved] = (kind, ours_reserved)
        else:  # only other trees' runs, or none: as absent (a beat that took the last of them away deletes the key)
            del kept[reserved]
    return kept


def step_until(deliverer: Deliverer, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """The deliverer's loop, step by step in the test's thread, until `done` (a loaded host is given time)."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        deliverer.step()
        deliverer.wait(0.1)
