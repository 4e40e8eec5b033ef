"""The Redis Sentinel start scripts (deploy/kubernetes/components/redis-sentinel/, mounted by Compose too), run for real: the set they start fails over, and a dead master comes back a replica.

Compose and the Kubernetes component start every Redis node and sentinel with
these two scripts. Here they run on 127.0.0.1 (each node on its own port, the
project's redis-server and redis-cli on PATH): three nodes and three sentinels
come up with the first master; the master is SIGKILLed and a replica promoted;
then the dead node is started again by its script, as a container restart
would, and must come back as a replica of the new master, not as a second one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import redis

from coordinator.local.embedded_redis import find_redis_server
from coordinator.local.ports import free_port
from tests.helpers import eventually
from tests.sentinel_kit import DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS, MASTER_NAME, Server, knows_everyone

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "deploy" / "kubernetes" / "components" / "redis-sentinel"
NODES = 3
SENTINELS = 3


class ScriptedSet:
    """Three nodes and three sentinels, each started by its start script."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.node_ports = [free_port() for _ in range(NODES)]
        self.sentinel_ports = [free_port() for _ in range(SENTINELS)]
        self.nodes: dict[int, Server] = {}
        self.sentinels: list[Server] = []
        bin_dir = str(Path(find_redis_server()).parent)  # redis-server and redis-cli
        sentinels = " ".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")},
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SENTINELS": sentinels,
            "SENTINEL_MASTER": MASTER_NAME,
            "REDIS_FIRST_MASTER": f"127.0.0.1:{self.node_ports[0]}",
        }

    def start_node(self, port: int) -> None:
        folder = self.workdir / f"node-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        env = {
            **self.env,
            "REDIS_NODE": "127.0.0.1",
            "REDIS_PORT": str(port),
            "REDIS_CONF": str(ROOT / "deploy" / "redis.conf"),
        }
        self.nodes[port] = _start(["sh", str(SCRIPTS / "redis-node.sh")], port, env, folder)

    def start_sentinel(self, port: int) -> None:
        folder = self.workdir / f"sentinel-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        env = {
            **self.env, "SENTINEL_NODE": "127.0.0.1", "SENTINEL_PORT": str(port), "SENTINEL_DIR": str(folder),
            "SENTINEL_DOWN_AFTER_MS": str(DOWN_AFTER_MS), "SENTINEL_FAILOVER_TIMEOUT_MS": str(FAILOVER_TIMEOUT_MS),
        }  # fmt: skip
        self.sentinels.append(_start(["sh", str(SCRIPTS / "sentinel.sh")], port, env, folder))

    def master_port(self) -> int | None:
        for server in self.sentinels:
            client = redis.Redis(port=server.port, decode_responses=True, socket_timeout=2)
            try:
                _host, port = client.execute_command("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
                return int(port)
            except (redis.RedisError, TypeError):
                continue
            finally:
                client.close()
        return None

    def stop(self) -> None:
        for server in [*self.sentinels, *self.nodes.values()]:
            server.stop()


def _start(argv: list[str], port: int, env: dict[str, str], cwd: Path) -> Server:
    log = (cwd / "out.log").open("ab")
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    client = redis.Redis(port=port, socket_timeout=1)
    try:
        eventually(lambda: _pings(client), f"the server on port {port}", timeout_s=10, every_s=0.05)
    finally:
        client.close()
    return Server(port, proc)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _role(port: int) -> tuple[str, int | None]:
    """(master or slave, the master's port for a replica whose link is up)."""
    client = redis.Redis(port=port, decode_responses=True, socket_timeout=2)
    try:
        role = client.execute_command("ROLE")
        if role[0] == "master":
            return "master", None
        return role[0], int(role[2]) if role[3] == "connected" else None
    finally:
        client.close()


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[ScriptedSet]:
    started = ScriptedSet(tmp_path)
    try:
        yield started
    finally:
        started.stop()


def _start_set(scripted: ScriptedSet) -> tuple[int, list[int]]:
    """The set's first start, every sentinel knowing it: (the first master's port, the replicas')."""
    first, *others = scripted.node_ports
    for port in scripted.node_ports:  # no sentinel answers yet: the first start, with REDIS_FIRST_MASTER
        scripted.start_node(port)
    for port in scripted.sentinel_ports:
        scripted.start_sentinel(port)
    assert _role(first) == ("master", None)
    eventually(lambda: all(_role(p) == ("slave", first) for p in others) or None, "both replicas linked", 15)
    eventually(lambda: knows_everyone(scripted.sentinel_ports, len(others)), "every sentinel to know the set", 30)
    assert scripted.master_port() == first
    return first, others


def test_the_scripts_start_a_set_that_fails_over_and_takes_its_old_master_back_as_a_replica(
    scripted: ScriptedSet,
) -> None:
    conf_before = (ROOT / "deploy" / "redis.conf").read_text()
    first, others = _start_set(scripted)
    for port in scripted.node_ports:  # a master without an answering replica refuses writes (docs/deploy.md)
        node = redis.Redis(port=port, decode_responses=True)
        assert node.config_get("min-replicas-*") == {"min-replicas-to-write": "1", "min-replicas-max-lag": "10"}
        node.close()

    scripted.nodes[first].kill()

    def another_master() -> int | None:
        port = scripted.master_port()
        return port if port != first else None

    promoted = eventually(another_master, "a replica promoted", 30, 0.05)
    assert promoted in others
    eventually(lambda: _role(promoted)[0] == "master" or None, "the promoted node to take writes", 10)

    scripted.start_node(first)  # a restart of the dead node's container: the sentinels name the new master
    # The master the sentinels name by then (on a loaded host a second failover may have followed).
    eventually(
        lambda: _role(first) == ("slave", scripted.master_port()) or None, "the old master back as a replica", 20
    )
    current = scripted.master_port()
    assert current in others and _role(current) == ("master", None)
    written = redis.Redis(port=current)
    written.set("after-the-failover", "1")
    written.close()
    follower = redis.Redis(port=first)
    eventually(lambda: follower.get("after-the-failover") == b"1" or None, "the old master to replicate", 10)
    follower.close()
    # A failover rewrites the nodes' configs (CONFIG REWRITE): their own copies, never the mounted file.
    assert (ROOT / "deploy" / "redis.conf").read_text() == conf_before


def test_a_master_back_before_the_sentinels_noticed_hands_over_and_loses_no_acknowledged_step(
    scripted: ScriptedSet,
) -> None:
    """The master's container restarted at once, its volume lost: the sentinels still name it.

    Started as the master, it would make the replicas resync from its empty data and drop
    a step they acknowledged; its script has a replica promoted first and follows it.
    """
    first, others = _start_set(scripted)
    master = redis.Redis(port=first)
    master.set("acknowledged", "kept")
    assert master.wait(2, 5000) == 2, "both replicas have it: a step acknowledged to its caller"
    master.close()

    scripted.nodes[first].kill()
    shutil.rmtree(scripted.workdir / f"node-{first}")  # the volume lost with the container
    scripted.start_node(first)  # at once: well within the sentinels' down-after-milliseconds

    assert scripted.master_port() in others, "a replica was promoted before the node started"

    # The master the sentinels name by then (on a loaded host a second failover may have followed). That second
    # failover may promote the node itself, once it has followed the first and synced from it (seen beside two
    # busy loops: the promoted replica missed a PING in its first second as master); its log says it followed.
    def rejoined() -> bool | None:
        named = scripted.master_port()
        return _role(first) == (("master", None) if named == first else ("slave", named)) or None

    eventually(rejoined, "the old master back as a replica (or promoted again after it followed)", 20)
    for port in scripted.node_ports:
        node = redis.Redis(port=port)
        has_it = partial(lambda client: client.get("acknowledged") == b"kept" or None, node)
        eventually(has_it, f"the acknowledged step on {port}", 10)
        node.close()
    log = (scripted.workdir / f"node-{first}" / "out.log").read_text()
    assert "a replica took over" in log, log
