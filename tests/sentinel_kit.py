"""Redis Sentinel on 127.0.0.1, real processes: a master, its replicas and three sentinels.

`sentinel_set(workdir)` starts them on free ports (the redis-server the project
ships, run as `redis-server <conf> --sentinel` for a sentinel; with `tls`, Debian's,
every port TLS only), waits until each
sentinel knows the master, both replicas and the other sentinels, and stops
them all at the end. `kill_master()` SIGKILLs whichever process is the master
now; `wait_promoted(old)` waits for the sentinels to name another;
`planned_switch()` moves the master away as docs/deploy.md says (writes paused,
`SENTINEL FAILOVER`, the old master made a replica, writes resumed). The
sentinels decide fast: a master silent for `DOWN_AFTER_MS` is down.

With `password`, every node (`requirepass`, `masterauth`) and sentinel (`sentinel
auth-pass`, its own `requirepass`) has it, in the config file each reads, as
deploy/'s start scripts write it; with `min_replicas_to_write`, each node has that
`min-replicas-to-write`, the safeguard docs/deploy.md asks for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from coordinator import Coordinator, Settings, TaskRecord
from coordinator.local.embedded_redis import find_redis_server
from coordinator.local.fleet import WorkerFleet
from coordinator.local.ports import free_port
from tests.agents import STEP_COST_MICROS
from tests.helpers import eventually
from tests.tls_kit import TLS_REDIS_SERVER, Tls

MASTER_NAME = "subq"
# A master silent this long is subjectively down (deploy/ uses 5000; a test has no time for that).
DOWN_AFTER_MS = 1000
# The same for a set that speaks TLS only. A sentinel opens new links to a master it has just seen promoted,
# and takes it for down when no PING is answered within down-after of that: on a loaded host a TLS handshake
# outlasted 1000 ms twice, each time about a second after a failover, and a second failover followed.
TLS_DOWN_AFTER_MS = 3000
# A failover that stalls is tried again after twice this; a healthy one takes well under it.
FAILOVER_TIMEOUT_MS = 3000
QUORUM = 2
# A planned switch holds writes at most this long: a healthy one takes a second or two, a loaded host
# several; writes released before the old master is a replica would be lost, so it is generous.
SWITCH_PAUSE_MS = 60_000
# How long a replica may stay silent and still count for min-replicas-to-write (Redis's default).
MIN_REPLICAS_MAX_LAG_S = 10


@dataclass
class Server:
    """One redis-server process (data or sentinel) on its port."""

    port: int
    proc: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class SentinelSet:
    """A master, its replicas and three sentinels; `data` by port, so a promoted replica is found by its address."""

    workdir: Path
    data: dict[int, Server] = field(default_factory=dict)
    sentinels: list[Server] = field(default_factory=list)
    tls: Tls | None = None
    password: str | None = None

    @property
    def client_options(self) -> dict[str, Any]:
        """redis-py's options for a client of any server here (TLS ones when the set speaks TLS, its password)."""
        return _client_options(self.tls, self.password)

    def client(self, port: int, timeout_s: float = 2) -> redis.Redis:
        """A client of the server on `port` (data node or sentinel)."""
        return redis.Redis(port=port, decode_responses=True, socket_timeout=timeout_s, **self.client_options)

    @property
    def addresses(self) -> str:
        """SUBQ_REDIS_SENTINELS for these sentinels."""
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    def settings(self, base: Settings, **updates: object) -> Settings:
        """`base` on these sentinels instead of its Redis URL (validated, as the environment would be)."""
        fields = base.model_dump(exclude={"redis_url"}, exclude_none=True)
        fields.update(redis_sentinels=self.addresses, redis_sentinel_master=MASTER_NAME)
        if self.tls is not None:
            fields.update(self.tls.settings())
        if self.password is not None:
            fields.update(redis_password=self.password, redis_sentinel_password=self.password)
        fields.update(updates)
        return Settings(**fields)

    def sentinel_client(self, n: int = 0) -> redis.Redis:
        return self.client(self.sentinels[n].port)

    def master_port(self) -> int:
        """The master's port as a live sentinel names it."""
        for sentinel in self.sentinels:
            if not sentinel.alive():
                continue
            client = self.client(sentinel.port)
            try:
                _host, port = client.execute_command("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
                return int(port)
            except redis.RedisError:
                continue
            finally:
                client.close()
        raise AssertionError("no sentinel answers")

    def master_client(self) -> redis.Redis:
        return self.client(self.master_port(), timeout_s=5)

    def kill_master(self) -> int:
        """SIGKILL the master now (no shutdown, nothing flushed); its old port."""
        port = self.master_port()
        self.data[port].kill()
        return port

    def kill_master_losing(self, stall_s: float) -> tuple[int, list[int]]:
        """SIGKILL the master after its replicas have stalled (SIGSTOP) for `stall_s` while it took writes:
        its old port, and the bytes of its stream each replica had not acknowledged at the kill (the stalled
        ones acknowledge nothing). The promoted replica lacks those writes: asynchronous replication's
        window of loss, made certain instead of left to the host's pace."""
        master = self.master_port()
        replicas = [server for port, server in self.data.items() if port != master and server.alive()]
        for server in replicas:
            os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(stall_s)
            lost = replica_lag_bytes(self)
            self.data[master].kill()
        finally:
            for server in replicas:
                os.kill(server.proc.pid, signal.SIGCONT)
        return master, lost

    def wait_promoted(self, old_port: int, timeout_s: float = 30) -> int:
        """Wait until the sentinels name a master other than `old_port`, and it takes writes; its port."""

        def promoted() -> int | None:
            port = self.master_port()
            if port == old_port:
                return None
            client = self.client(port)
            try:
                role = client.execute_command("ROLE")[0]
                return port if role == "master" else None
            except redis.RedisError:
                return None
            finally:
                client.close()

        return int(eventually(promoted, "the sentinels to promote a replica", timeout_s=timeout_s, every_s=0.05))

    def switches(self) -> list[str]:
        """Each switch of master the sentinels logged ("old -> new" ports), first seen first: more than one
        means a second failover followed the first."""
        seen: dict[str, str] = {}  # the switch -> its earliest log time; each sentinel logs the same switch
        for sentinel in self.sentinels:
            log = self.workdir / f"sentinel-{sentinel.port}" / "sentinel.log"
            for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
                if "+switch-master" in line:  # "<pid>:X 06 Dec 2026 15:55:46.472 # +switch-master subq h old h new"
                    words = line.split()
                    switch, at = f"{words[-3]} -> {words[-1]}", words[4]
                    seen[switch] = min(seen.get(switch, at), at)
        return sorted(seen, key=seen.__getitem__)

    def planned_switch(self, timeout_s: float = 30) -> tuple[int, int]:
        """Move the master away as docs/deploy.md's "A planned switch" does; (old port, new port).

        Writes are paused on the master (`CLIENT PAUSE WRITE`), so nothing is written there
        that the promoted replica lacks; once every replica has the master's whole stream,
        `SENTINEL FAILOVER`; once the sentinels name the promoted replica, the old master is
        made its replica (the sentinels would do it themselves only about ten seconds later,
        and what it took meanwhile would be lost) and its writes are resumed: each paused
        command is answered READONLY, and its client sends it to the new master.
        """
        old = self.master_port()
        master = self.client(old, timeout_s=5)
        try:
            master.execute_command("CLIENT", "PAUSE", SWITCH_PAUSE_MS, "WRITE")
            try:
                wait_replicated(self, timeout_s)
                sentinel = self.sentinel_client()
                try:
                    assert sentinel.execute_command("SENTINEL", "FAILOVER", MASTER_NAME) in ("OK", True)
                finally:
                    sentinel.close()
                new = self.wait_promoted(old, timeout_s)
                master.execute_command("REPLICAOF", "127.0.0.1", new)
            finally:
                master.execute_command("CLIENT", "UNPAUSE")
        finally:
            master.close()
        return old, new

    def stop(self) -> None:
        for server in [*self.sentinels, *self.data.values()]:
            server.stop()


def _client_options(tls: Tls | None, password: str | None = None) -> dict[str, Any]:
    options = {} if tls is None else tls.client_options()
    return options if password is None else {**options, "password": password}


def _listen_args(port: int, tls: Tls | None) -> list[str]:
    """Where a server listens: `port` in the clear, or `port` TLS only (no clear port at all)."""
    if tls is None:
        return ["--port", str(port)]
    return ["--port", "0", "--tls-port", str(port), *tls.server_args()]


def _binary(tls: Tls | None) -> str:
    return find_redis_server() if tls is None else TLS_REDIS_SERVER


def _start(argv: list[str], port: int, tls: Tls | None, password: str | None) -> Server:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = Server(port, proc)
    client = redis.Redis(port=port, socket_timeout=1, **_client_options(tls, password))
    try:
        eventually(lambda: _pings(client), f"redis-server on port {port} to answer", timeout_s=10, every_s=0.05)
    finally:
        client.close()
    return server


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _private_conf(path: Path, text: str) -> Path:
    """A config file only its owner reads: a password in it is not on any command line."""
    path.touch(mode=0o600)
    path.write_text(text, encoding="utf-8")
    return path


def _data_server(
    workdir: Path, port: int, master_port: int | None, tls: Tls | None, password: str | None, min_replicas_to_write: int
) -> Server:
    folder = workdir / f"redis-{port}"
    folder.mkdir(parents=True)
    own = f"requirepass {password}\nmasterauth {password}\n" if password is not None else ""
    if min_replicas_to_write:
        own += f"min-replicas-to-write {min_replicas_to_write}\nmin-replicas-max-lag {MIN_REPLICAS_MAX_LAG_S}\n"
    argv = [
        _binary(tls), str(_private_conf(folder / "redis.conf", own)), *_listen_args(port, tls), "--bind", "127.0.0.1",
        "--dir", str(folder),
        "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--loglevel", "warning",
        "--logfile", str(folder / "redis.log"),
    ]  # fmt: skip
    if master_port is not None:
        argv += ["--replicaof", "127.0.0.1", str(master_port)]
    return _start(argv, port, tls, password)


def _sentinel(workdir: Path, port: int, master_port: int, tls: Tls | None, password: str | None) -> Server:
    folder = workdir / f"sentinel-{port}"
    folder.mkdir(parents=True)
    conf = folder / "sentinel.conf"  # a sentinel rewrites its own file as it learns: one file each
    args = _listen_args(port, tls)
    listen = "\n".join(f"{name.removeprefix('--')} {value}" for name, value in zip(args[::2], args[1::2], strict=True))
    # Its own password, and the set's to ask the nodes and the other sentinels (auth-pass), as deploy/'s sentinel.sh.
    auth = f"requirepass {password}\nsentinel auth-pass {MASTER_NAME} {password}\n" if password is not None else ""
    _private_conf(
        conf,
        f"{listen}\nbind 127.0.0.1\ndir {folder}\nlogfile {folder / 'sentinel.log'}\n"
        f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} {QUORUM}\n{auth}"
        f"sentinel down-after-milliseconds {MASTER_NAME} {TLS_DOWN_AFTER_MS if tls else DOWN_AFTER_MS}\n"
        f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
        f"sentinel parallel-syncs {MASTER_NAME} 2\n",
    )
    return _start([_binary(tls), str(conf), "--sentinel"], port, tls, password)


@contextmanager
def sentinel_set(
    workdir: Path,
    replicas: int = 2,
    sentinels: int = 3,
    tls: Tls | None = None,
    password: str | None = None,
    min_replicas_to_write: int = 0,
) -> Iterator[SentinelSet]:
    """A master with `replicas` replicas and `sentinels` sentinels, each known to every sentinel; stopped at the end.

    With `tls` every server listens on TLS only, replicates and is watched over TLS; with
    `password` every node and sentinel requires it; with `min_replicas_to_write` a master
    with fewer replicas refuses writes (NOREPLICAS).
    """
    kit = SentinelSet(workdir, tls=tls, password=password)
    try:
        master_port = free_port()
        kit.data[master_port] = _data_server(workdir, master_port, None, tls, password, min_replicas_to_write)
        for _ in range(replicas):
            port = free_port()
            kit.data[port] = _data_server(workdir, port, master_port, tls, password, min_replicas_to_write)
        for _ in range(sentinels):
            kit.sentinels.append(_sentinel(workdir, free_port(), master_port, tls, password))
        ports = [sentinel.port for sentinel in kit.sentinels]
        eventually(
            lambda: knows_everyone(ports, replicas, tls, password), "every sentinel to know the set", timeout_s=30
        )
        yield kit
    finally:
        kit.stop()


def knows_everyone(
    sentinel_ports: list[int], replicas: int, tls: Tls | None = None, password: str | None = None
) -> bool:
    """Whether each sentinel knows the master's `replicas` replicas (linked, up) and every other sentinel.

    `password`: the sentinels' own, where they have one (deploy/'s start scripts give them the set's).
    """
    for port in sentinel_ports:
        client = redis.Redis(
            port=port, password=password, decode_responses=True, socket_timeout=2, **_client_options(tls)
        )
        try:
            known_replicas = [r for r in client.execute_command("SENTINEL", "replicas", MASTER_NAME) if _up(r)]
            others = client.execute_command("SENTINEL", "sentinels", MASTER_NAME)
        except redis.RedisError:
            return False
        finally:
            client.close()
        if len(known_replicas) < replicas or len(others) < len(sentinel_ports) - 1:
            return False
    return True


def _up(replica: object) -> bool:
    """A replica as SENTINEL replicas describes it (a flat list or a dict, by client) that is linked and not down."""
    fields = replica if isinstance(replica, dict) else dict(zip(replica[::2], replica[1::2], strict=True))  # type: ignore[index]
    return "down" not in str(fields.get("flags", "")) and fields.get("master-link-status") == "ok"


def wait_replicated(kit: SentinelSet, timeout_s: float = 10) -> None:
    """Every replica has caught up with the master's offset (a test's starting line)."""
    master = kit.master_client()
    try:
        eventually(
            lambda: (
                all(
                    int(r["offset"]) >= int(master.info("replication")["master_repl_offset"])
                    for r in _replica_infos(master)
                )
                or None
            ),
            "the replicas to catch up",
            timeout_s=timeout_s,
        )
    finally:
        master.close()


def wait_relinked(kit: SentinelSet, replicas: int, timeout_s: float = 30) -> None:
    """The master the sentinels name has `replicas` replicas linked to it and online. After a failover the
    sentinels point the surviving replicas at the promoted one within seconds (longer on a loaded host); until
    then a write stands on the new master alone, and a second failover, which a loaded host can bring about
    (a master slow to answer for `DOWN_AFTER_MS`), would lose it."""

    def linked() -> bool | None:
        try:
            master = kit.master_client()
        except redis.RedisError:
            return None
        try:
            return sum(replica.get("state") == "online" for replica in _replica_infos(master)) >= replicas or None
        except redis.RedisError:
            return None
        finally:
            master.close()

    eventually(linked, "the replicas to follow the promoted master", timeout_s=timeout_s)


def _replica_infos(master: redis.Redis) -> list[dict[str, str]]:
    info = master.info("replication")
    return [info[f"slave{n}"] for n in range(int(info["connected_slaves"]))]


def replica_lag_bytes(kit: SentinelSet) -> list[int]:
    """How many bytes of the master's replication stream each replica has not acknowledged yet."""
    master = kit.master_client()
    try:
        offset = int(master.info("replication")["master_repl_offset"])
        return [offset - int(replica["offset"]) for replica in _replica_infos(master)]
    finally:
        master.close()


@contextmanager
def fleet_on(
    kit: SentinelSet, base: Settings, workers: int, log_dir: Path, **updates: object
) -> Iterator[tuple[Settings, Coordinator, WorkerFleet]]:
    """Real worker processes and a Coordinator on the set, with timings fit for a failover test.

    Leases lapse after 3 s and the reconciler looks every 0.5 s, repairing what is 5 s
    overdue: what a failover leaves is moved on within seconds. `updates` win.
    """
    own = kit.settings(base, heartbeat_lapse_s=3, reconcile_interval_s=0.5, reconcile_grace_s=5, **updates)
    with WorkerFleet(own, workers, log_dir) as fleet:
        fleet.wait_ready()
        coord = Coordinator(own)
        try:
            yield own, coord, fleet
        finally:
            coord.close()


def assert_each_request_once(parent: TaskRecord, kids: list[TaskRecord]) -> None:
    """The children of a fan-out across a Redis switch, each making one request a run: each child's figures are
    its requests', each recorded once, and the fan-out's total is its own and theirs. A child whose run the switch
    lost (its start or lease not on the master that took over, or its lease lapsed across it) is run again, and
    its provider billed both runs' requests: the first is recorded by that run's heartbeat when its end finds its
    lease gone, the second by the new run (before, the first was dropped, and such a child read one request). A
    switch costs a child one more run at most (a loaded host's sentinels have switched twice: three)."""
    runs = [(k.requests, k.cost_micros) for k in kids]
    assert all(cost == requests * STEP_COST_MICROS for requests, cost in runs), runs
    assert all(1 <= requests <= 3 for requests, _ in runs), runs
    # And the fan-out's total is its own requests and its children's, each once.
    assert parent.total_cost_micros == (parent.requests + sum(k.requests for k in kids)) * STEP_COST_MICROS
