"""Redis over TLS, real servers (Debian's redis-server, built with TLS): under Sentinel, and one Redis by its URL.

Under Sentinel every server of the set listens on TLS only (no clear port at all),
replicates and is watched over TLS (tests/sentinel_kit.py with `tls`), and asks
each client for a certificate, as Redis does by default. subq is given the
SUBQ_REDIS_TLS settings: a real worker (its store, Celery's broker and result
backend on kombu's and Celery's sentinel transports), the Coordinator and the
CLI run trees on it, before and after the master is SIGKILLed and a replica
promoted, and a real Flower reaches the workers and reads each root's result. A client that does not trust the servers' CA is refused, with the
certificate's error. One Redis takes TLS in its `rediss://` URL, as
docs/configuration.md says; a fleet runs a tree on one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.local.fleet import WorkerFleet, settings_env
from coordinator.local.ports import free_port
from coordinator.local.up import Service
from coordinator.redis_clients import redis_client, tls_options
from tests.agents import STEP_COST_MICROS, TREE_REQUESTS, TREE_TASKS, tree_root
from tests.helpers import eventually
from tests.sentinel_kit import SentinelSet, fleet_on, sentinel_set, wait_relinked
from tests.test_faults import assert_converged
from tests.tls_kit import HOST, TLS_REDIS_SERVER, Tls, make_tls

WAIT_S = 120
FLOWER_USER, FLOWER_PASSWORD = "flower-tls", "flower-tls-password"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return make_tls(tmp_path_factory.mktemp("tls"))


def _run_tree(coord: Coordinator) -> str:
    """The acceptance tree, run to its end; its root's id, every total checked."""
    root = coord.create_task(tree_root(), run=True)
    done = coord.wait(root.id, WAIT_S)
    assert done.status == TaskStatus.COMPLETED and done.summary == "Report ready", done
    assert_converged(coord, root.id)
    tasks = [coord.get_task(t) for t in coord.store.records.tree_task_ids(root.id)]
    assert len(tasks) == TREE_TASKS
    assert sum(t.requests for t in tasks) == TREE_REQUESTS
    assert done.total_cost_micros == TREE_REQUESTS * STEP_COST_MICROS
    return root.id


def _cli_tree(settings: Settings, root_id: str) -> dict[str, object]:
    """`subq tree ID --json`, given exactly these settings by its environment.

    It runs in this process (tests/test_cli.py's cli): a CLI process costs 1.5 s of CPU (issue 43).
    """
    from tests.test_cli import cli

    env = {name: value for name, value in settings_env(settings).items() if name.startswith("SUBQ_")}
    proc = cli("tree", root_id, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    tree: dict[str, object] = json.loads(proc.stdout)
    return tree


def _refuses_clear_text(port: int) -> bool:
    """Whether the server on `port` drops a client that speaks without TLS."""
    client = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.ConnectionError:
        return True
    finally:
        client.close()
    return False


@pytest.fixture
def tls_fleet(settings: Settings, tls: Tls, tmp_path: Path) -> Iterator[tuple[SentinelSet, Settings, Coordinator]]:
    # Every node refuses writes without a replica, as docs/deploy.md asks: beside two busy loops a sentinel once
    # took the promoted master for down and promoted the other replica, and the old master went on taking the
    # tree's steps, alone, until it was made a replica ten seconds later, which dropped them (a child lost).
    with sentinel_set(tmp_path / "sentinels", tls=tls, min_replicas_to_write=1) as kit:
        with fleet_on(kit, settings, 1, tmp_path / "workers", key_prefix="subqtls", queue="subq-tls") as started:
            own, coord, _fleet = started
            yield kit, own, coord


def test_a_fleet_on_tls_sentinels_runs_trees_before_and_after_a_failover(
    tls_fleet: tuple[SentinelSet, Settings, Coordinator], tmp_path: Path
) -> None:
    kit, own, coord = tls_fleet
    ports = [*kit.data, *(s.port for s in kit.sentinels)]
    assert all(_refuses_clear_text(port) for port in ports), "every server of the set speaks TLS only"

    with _flower(own, tmp_path) as flower:
        first = _run_tree(coord)
        tree = _cli_tree(own, first)
        assert tree["total_cost_micros"] == TREE_REQUESTS * STEP_COST_MICROS, tree
        _flower_sees(flower, first)

        old = kit.kill_master()
        kit.wait_promoted(old)
        # Once the surviving replica follows the promoted master: beside two busy loops, a tree run while none
        # did (each step warned its write reached no replica) was lost to a second failover, which a master slow
        # to answer brought about: its root read completed, then delegated.
        wait_relinked(kit, 1)
        second = _run_tree(coord)
        assert second != first
        assert _cli_tree(own, second)["status"] == "completed"
        assert coord.get_task(first).status == TaskStatus.COMPLETED, "the first tree is on the promoted replica too"
        _flower_sees(flower, second)


@contextmanager
def _flower(settings: Settings, folder: Path) -> Iterator[httpx.Client]:
    """`subq flower` in its own process, given these settings by its environment; a client signed in to it."""
    port = free_port()
    env = {k: v for k, v in settings_env(settings).items() if not k.startswith("FLOWER_")}
    env |= {"SUBQ_FLOWER_USER": FLOWER_USER, "SUBQ_FLOWER_PASSWORD": FLOWER_PASSWORD}
    argv = [sys.executable, "-m", "coordinator", "flower", "--port", str(port)]
    with Service("Flower", argv, env, folder / "flower.log") as flower:
        flower.wait_listening(HOST, port)
        with httpx.Client(base_url=f"http://{HOST}:{port}", auth=(FLOWER_USER, FLOWER_PASSWORD), timeout=30) as client:
            yield client


def _flower_sees(flower: httpx.Client, root_id: str) -> None:
    """Flower reaches the fleet over TLS: the workers answer its broadcast, and the root's result is read."""

    def workers() -> dict[str, object] | None:
        answer = flower.get("/api/workers", params={"refresh": "1"})
        return answer.json() if answer.status_code == 200 and answer.json() else None

    assert eventually(workers, "the workers to answer Flower", timeout_s=60)
    result = flower.get(f"/api/task/result/{root_id}")
    assert result.status_code == 200, result.text
    assert result.json()["state"] == "SUCCESS" and result.json()["result"]["status"] == "completed", result.json()


def test_a_client_that_does_not_trust_the_servers_ca_is_refused(settings: Settings, tls: Tls, tmp_path: Path) -> None:
    other_ca = make_tls(tmp_path / "other")
    with sentinel_set(tmp_path / "sentinels", replicas=0, sentinels=1, tls=tls) as kit:
        trusted = redis_client(kit.settings(settings))
        assert trusted.ping()
        trusted.close()
        # The system's CAs (no SUBQ_REDIS_TLS_CA_FILE) and another CA: neither signed the servers' certificate.
        for ca_file in (None, other_ca.ca_file):
            distrustful = kit.settings(settings, redis_tls_ca_file=ca_file)
            client = redis_client(distrustful, retry=Retry(NoBackoff(), 0))  # not the 30 s a failover is given
            sentinel = f"127.0.0.1:{kit.sentinels[0].port}"
            why = f"no sentinel of SUBQ_REDIS_SENTINELS answers: {sentinel}: .*CERTIFICATE_VERIFY_FAILED"
            with pytest.raises(redis.ConnectionError, match=why):
                client.ping()
            client.close()
            # The same options, straight to the master: its certificate is refused too.
            direct = redis.Redis(port=kit.master_port(), ssl=True, **tls_options(distrustful))
            with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                direct.ping()
            direct.close()


def test_one_redis_takes_tls_in_its_rediss_url(settings: Settings, tls: Tls, tmp_path: Path) -> None:
    port = free_port()
    folder = tmp_path / "redis"
    folder.mkdir()
    server = subprocess.Popen(
        [TLS_REDIS_SERVER, "--port", "0", "--tls-port", str(port), "--bind", HOST, "--dir", str(folder),
         "--save", "", "--appendonly", "no", *tls.server_args()],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        query = urlencode(
            {"ssl_cert_reqs": "required", "ssl_ca_certs": tls.ca_file, "ssl_certfile": tls.cert_file,
             "ssl_keyfile": tls.key_file}
        )  # fmt: skip
        own = settings.model_copy(
            update={
                "redis_url": f"rediss://{HOST}:{port}/0?{query}",
                "key_prefix": "subqrediss",
                "queue": "subq-rediss",
            }
        )
        probe = redis.Redis.from_url(own.redis_url or "")
        eventually(lambda: _pings(probe), "the TLS redis-server to answer", timeout_s=10, every_s=0.05)
        probe.close()
        assert _refuses_clear_text(port)
        with WorkerFleet(own, 1, tmp_path / "workers") as fleet:
            fleet.wait_ready()
            coord = Coordinator(own)
            try:
                root = _run_tree(coord)
                assert _cli_tree(own, root)["status"] == "completed"
            finally:
                coord.close()
    finally:
        server.terminate()
        server.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
