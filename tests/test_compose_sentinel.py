"""docker-compose.yml with deploy/docker-compose.sentinel.yml comes up healthy, runs a tree, and fails over.

As tests/test_compose.py does for docker-compose.yml alone, with no Docker engine:
the two files merged as `docker compose -f docker-compose.yml -f
deploy/docker-compose.sentinel.yml` merges them (tests/compose_file.py), each
service runs as a local process with its own `command` and environment, in the
order of its depends_on, and its own healthcheck must pass. The Redis nodes and
sentinels run their start scripts (the Kubernetes component's, mounted) with `sh`,
Debian's redis-server and redis-cli first on PATH as the redis:7-alpine image has
them; subq's services run from the built wheel and find Redis through the sentinels.
Only host names (each 127.0.0.1), ports (every node listens on 6379 and every
sentinel on 26379 in its container: here each service gets a port of its own) and
mounted paths are rewritten.

A third file, as an operator's override would, sets the sentinels'
SENTINEL_DOWN_AFTER_MS to 1000 and SENTINEL_FAILOVER_TIMEOUT_MS to 3000 (the file
has 5000 and 30000): the same failover, 4 s sooner, and a stalled one tried again
after 6 s rather than a minute.

A tree runs to completion; then the master the sentinels name is SIGKILLed. Once
they promote a replica, the dead node's service is started again with its own
command, as `restart: unless-stopped` does (here after the promotion: a node away
longer than down-after-milliseconds), and must come back as a replica of the new
master, never as a second master; a second tree runs to completion with exact totals.
"""

from __future__ import annotations

import os
import shutil
import signal
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
import redis
import yaml

from coordinator.local.ports import free_port
from tests import compose_file
from tests.compose_file import Localizer
from tests.helpers import eventually
from tests.sentinel_kit import DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS, knows_everyone
from tests.test_compose import (
    API_TOKEN,
    HTTP_TIMEOUT_S,
    REDIS_PASSWORD,
    _env_file,
    _run_tree,
    _wait_for_workers,
    wait_healthy,
)
from tests.wheel_env import Service, Venv, started

# Building the wheel and its venv (once per run) can take minutes on a cold pip cache.
pytestmark = pytest.mark.timeout(600)

# The redis:7-alpine image's binaries; Debian's redis-server package is Redis 7 too, and brings redis-cli.
REDIS_BINARIES = (Path("/usr/bin/redis-server"), Path("/usr/bin/redis-cli"))
# redis:7-alpine's WORKDIR, and a VOLUME: a node's named volume is mounted there, and its script
# copies its config there and Redis writes its AOF there.
REDIS_WORKDIR = "/data"
# How often a healthcheck runs until it passes: often, as the test waits on it (Docker's interval is 5 s).
HEALTHCHECK_EVERY_S = 0.25
PROMOTION_TIMEOUT_S = 30
REPLICA_TIMEOUT_S = 20
POLL_EVERY_S = 0.05
REDIS_TIMEOUT_S = 2


def _override(project: Path, sentinels: list[str]) -> Path:
    """The operator's own override file: sentinels that decide sooner (the module docstring says why)."""
    faster = {"SENTINEL_DOWN_AFTER_MS": str(DOWN_AFTER_MS), "SENTINEL_FAILOVER_TIMEOUT_MS": str(FAILOVER_TIMEOUT_MS)}
    path = project / "docker-compose.faster-failover.yml"
    path.write_text(yaml.safe_dump({"services": {name: {"environment": dict(faster)} for name in sentinels}}))
    return path


def _container_port(spec: dict[str, Any]) -> int | None:
    """The port a service listens on inside its container: a node's or sentinel's from its environment,
    a subq service's from its published `ports`."""
    environment = spec.get("environment", {})
    for name in ("REDIS_PORT", "SENTINEL_PORT"):
        if name in environment:
            return int(environment[name])
    ports = spec.get("ports", [])
    return int(str(ports[0]).split(":")[-1]) if ports else None


def _waves(services: dict[str, Any]) -> list[list[str]]:
    """The services in the order Compose starts them: each wave once the services it depends on are healthy."""
    done: set[str] = set()
    waves: list[list[str]] = []
    while len(done) < len(services):
        wave = [name for name, spec in services.items() if name not in done and set(spec.get("depends_on", {})) <= done]
        assert wave, f"a depends_on cycle among {sorted(set(services) - done)}"
        waves.append(wave)
        done.update(wave)
    return waves


def _role(port: int) -> tuple[str, int | None]:
    """(master or slave, for a replica the port of its master once the link is up)."""
    # Every node and sentinel has .env's SUBQ_COMPOSE_REDIS_PASSWORD (tests/test_compose.py writes it).
    client = redis.Redis(port=port, password=REDIS_PASSWORD, decode_responses=True, socket_timeout=REDIS_TIMEOUT_S)
    try:
        role = client.execute_command("ROLE")
    finally:
        client.close()
    if role[0] == "master":
        return "master", None
    return role[0], int(role[2]) if role[3] == "connected" else None


class Container(NamedTuple):
    """A started service: its healthcheck, environment and working directory, and its process."""

    service: compose_file.Service
    env: dict[str, str]
    cwd: Path
    running: Service


class SentinelStack:
    """The merged file's services as local processes: each with its own port, folders and PATH."""

    def __init__(self, venv: Venv, project: Path, stack: ExitStack) -> None:
        self.venv, self.project, self.stack = venv, project, stack
        as_filed = compose_file.load(compose_file.SENTINEL_FILE)["services"]
        self.sentinel_names = [
            name for name, spec in as_filed.items() if "SENTINEL_NODE" in spec.get("environment", {})
        ]
        self.compose = compose_file.load(compose_file.SENTINEL_FILE, _override(project, self.sentinel_names))
        self.services: dict[str, Any] = self.compose["services"]
        self.node_names = [name for name, spec in self.services.items() if "REDIS_NODE" in spec["environment"]]
        listening = {name: port for name, spec in self.services.items() if (port := _container_port(spec))}
        self.port = {name: free_port() for name in listening}  # by service: its port on this machine
        self.own_ports = {name: {port: self.port[name]} for name, port in listening.items()}
        self.addresses = {f"{name}:{port}": f"127.0.0.1:{self.port[name]}" for name, port in listening.items()}
        self.master_name = self.services[self.sentinel_names[0]]["environment"]["SENTINEL_MASTER"]
        self.api_url = f"http://127.0.0.1:{self.port['api']}"
        self.running: dict[str, Service] = {}
        self.starts: dict[str, int] = {}  # by container host name: a restart logs to a file of its own
        self.redis_bin = project / "redis-image-bin"
        self.redis_bin.mkdir()
        for binary in REDIS_BINARIES:
            (self.redis_bin / binary.name).symlink_to(binary)

    def up(self, *replicas: tuple[str, str]) -> None:
        """Start services (or replicas), given as (service, container host name), together as Compose
        does once their dependencies are healthy; return once every healthcheck passes."""
        for container in [self.start(name, hostname) for name, hostname in replicas]:
            _healthy(*container)

    def start(self, name: str, hostname: str) -> Container:
        spec = self.services[name]
        paths = compose_file.mounts(name, spec, self.project)
        localize = Localizer(
            # Only the Redis side's names: a value that is only a host name is a node's own address,
            # but `subq worker`'s "worker" is a command.
            hosts={service: "127.0.0.1" for service in [*self.node_names, *self.sentinel_names]},
            ports=self.own_ports.get(name, {}),
            paths=paths,
            addresses=self.addresses,
        )
        service = compose_file.Service.of(name, self.project, localize, self.compose)
        if spec["image"].startswith("redis:"):
            base = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")}
            env = {**base, "PATH": f"{self.redis_bin}{os.pathsep}{base['PATH']}", **service.environment}
        else:
            env = self.venv.env(service.environment)
            # As tests/test_compose.py: the Celery node name its container would have.
            env["CELERY_WORKER_HOSTNAME"] = f"celery@{hostname}"
        env["HOSTNAME"] = hostname
        for local in map(Path, paths.values()):  # a volume's or tmpfs's folder; a bind mount's source exists
            if local.is_relative_to(self.project):
                local.mkdir(parents=True, exist_ok=True)
        # The image's working directory: a node's named volume, else a folder of this container's own.
        cwd = Path(paths.get(REDIS_WORKDIR) or self.project / f"{hostname}-workdir")
        cwd.mkdir(exist_ok=True)
        starts = self.starts[hostname] = self.starts.get(hostname, 0) + 1
        log = self.project / (f"{hostname}.log" if starts == 1 else f"{hostname}.{starts}.log")
        running = self.stack.enter_context(started(self.venv, service.command, log, env, cwd=cwd, name=hostname))
        self.running[hostname] = running
        return Container(service, env, cwd, running)

    def master(self) -> str:
        """The node the sentinels name as the master now (the first live sentinel to answer)."""
        by_port = {self.port[name]: name for name in self.node_names}
        for name in self.sentinel_names:
            client = redis.Redis(
                port=self.port[name], password=REDIS_PASSWORD, decode_responses=True, socket_timeout=REDIS_TIMEOUT_S
            )
            try:
                _host, port = client.execute_command("SENTINEL", "get-master-addr-by-name", self.master_name)
                return by_port[int(port)]
            except redis.RedisError:
                continue
            finally:
                client.close()
        raise AssertionError("no sentinel answers")


def _healthy(service: compose_file.Service, env: dict[str, str], cwd: Path, running: Service) -> None:
    """Run the service's own healthcheck until it passes, as Docker does, in the container's working directory."""
    wait_healthy(service, running, env, cwd, every_s=HEALTHCHECK_EVERY_S)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The compose project folder: the operator's .env (as tests/test_compose.py writes it) and volumes."""
    _env_file(tmp_path)
    return tmp_path


def test_compose_with_sentinel_comes_up_runs_a_tree_fails_over_and_takes_its_old_master_back(
    venv: Venv, project: Path
) -> None:
    for binary in REDIS_BINARIES:
        assert binary.exists(), f"{binary} is missing: install Debian's redis-server package (./scripts/test does)"
    assert shutil.which("sh"), "the start scripts and CMD-SHELL healthchecks run under sh"
    with ExitStack() as stack:
        services = SentinelStack(venv, project, stack)
        *redis_side, subq_side = _waves(services.services)
        for wave in redis_side:
            services.up(*[(name, name) for name in wave])
        assert services.master() == "redis", "the first start: REDIS_FIRST_MASTER is the master"
        assert sorted(subq_side) == ["api", "flower", "worker"], "subq's services start once the sentinels are healthy"
        worker = services.start("worker", "worker-1")
        services.up(("api", "api"), ("flower", "flower"))

        with httpx.Client(
            base_url=services.api_url, headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=HTTP_TIMEOUT_S
        ) as http:
            # The worker's own check waits 5 s for an answer when no node answers yet, on a host the
            # worker's own start keeps busy. Docker runs a first check only after `interval` (30 s);
            # here it runs once the API sees the worker's heartbeat.
            _wait_for_workers(http, 1)
            _healthy(*worker)
            _run_tree(http)

            # The sentinels can fail over only once each knows the replicas and the other sentinels.
            sentinel_ports = [services.port[name] for name in services.sentinel_names]
            replicas = len(services.node_names) - 1
            eventually(
                lambda: knows_everyone(sentinel_ports, replicas, password=REDIS_PASSWORD),
                "every sentinel to know the set",
                30,
            )
            first_master = services.master()  # "redis", unless the sentinels have failed over already
            killed = services.running[first_master]
            os.killpg(killed.proc.pid, signal.SIGKILL)  # the container killed: no shutdown, nothing flushed
            killed.proc.wait()

            def promoted() -> str | None:
                name = services.master()
                return name if name != first_master and _role(services.port[name])[0] == "master" else None

            eventually(promoted, "the sentinels to promote a replica", PROMOTION_TIMEOUT_S, POLL_EVERY_S)

            # `restart: unless-stopped`: the same service, its own command, its own volume.
            services.up((first_master, first_master))
            old_port = services.port[first_master]
            restarted = services.running[first_master]
            assert _role(old_port)[0] == "slave", f"{first_master} came back as a master:\n{restarted.tail()}"

            _run_tree(http)

            # On a loaded host a promoted master can miss the test's short down-after-milliseconds and be
            # failed over in turn: the old master must follow whichever node the sentinels name by then.
            def linked() -> bool:
                role = _role(old_port)
                assert role[0] == "slave", f"{first_master} turned master:\n{restarted.tail()}"
                return role == ("slave", services.port[services.master()])

            eventually(linked, f"{first_master} to replicate from the master", REPLICA_TIMEOUT_S, POLL_EVERY_S)

            # A replica promoted and failed over in turn is a master until the sentinels reconfigure it, which a
            # loaded host delays past the new master's promotion (two masters for that moment, a loaded run saw):
            # what must hold is that it comes down, to the one master the sentinels name.
            def masters() -> list[str]:
                return [name for name in services.node_names if _role(services.port[name])[0] == "master"]

            eventually(lambda: masters() == [services.master()], "one master, the one the sentinels name",
                       REPLICA_TIMEOUT_S, POLL_EVERY_S)  # fmt: skip
            assert first_master not in masters()
