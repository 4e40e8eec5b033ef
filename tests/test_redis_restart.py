"""A Redis crash and restart with AOF `everysec` in the middle of a fan-out: every tree converges.

Redis is SIGKILLed (no shutdown, so up to a second of writes is lost), stays
down three seconds, and comes back from its append-only file on the same port.
A message taken off the queue just before the crash, a finish or an ack lost
with the last second: whatever was lost, the writes before it survive in order,
and the due list (written before each send) names every task that a lost
message should have moved on; the reconciler moves it on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from coordinator import Coordinator, Settings
from coordinator.local.embedded_redis import find_redis_server
from coordinator.local.fleet import WorkerFleet
from coordinator.local.ports import free_port
from tests.agents import agent, reply
from tests.helpers import eventually
from tests.test_faults import assert_converged

CHILDREN = 40
DOWN_S = 3


class RedisServer:
    """A redis-server with AOF everysec in `workdir`, which can be killed and started again."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url)
        eventually(lambda: _pings(client), "redis to answer", timeout_s=10, every_s=0.05)
        client.close()

    def crash(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@contextmanager
def restartable_redis(workdir: Path) -> Iterator[RedisServer]:
    workdir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.terminate()
            server.proc.wait(timeout=10)


def test_a_redis_crash_mid_fan_out_converges(settings: Settings, tmp_path: Path) -> None:
    with restartable_redis(tmp_path / "redis") as server:
        own = settings.model_copy(
            update={
                "redis_url": server.url,
                "queue": "subq-redis-restart",
                "heartbeat_lapse_s": 3,
                "reconcile_interval_s": 0.5,
                "reconcile_grace_s": 5,
                "visibility_timeout_s": 300,  # the reconciler, not the broker's backstop, must converge it
            }
        )
        with WorkerFleet(own, 2, tmp_path / "workers") as fleet:
            fleet.wait_ready()
            coord = Coordinator(own)
            try:
                parent = coord.create_task("Forty children")
                specs = [
                    {"description": f"c{n}", "message": agent({**reply(f"c{n} done"), "latency_ms": 700})}
                    for n in range(CHILDREN)
                ]
                coord.delegate(parent.id, specs)
                eventually(
                    lambda: sum(c.status.terminal for c in coord.get_children(parent.id)) >= 4 or None,
                    "the first children to end",
                )
                server.crash()
                time.sleep(DOWN_S)
                server.start()
                coord.wait(parent.id, 120)
                assert_converged(coord, parent.id)
                assert len(coord.get_children(parent.id)) == CHILDREN
                assert all(c.status.terminal for c in coord.get_children(parent.id))
            finally:
                coord.close()
