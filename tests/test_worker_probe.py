"""The workers' health checks, run for real: they pass while the pod's own worker answers, and fail once it is gone.

Kubernetes: overlays/dev (one Redis, SUBQ_REDIS_URL) and overlays/ha (Redis Sentinel,
SUBQ_REDIS_SENTINELS and SUBQ_REDIS_SENTINEL_MASTER) are rendered by `kubectl kustomize`
as tests/test_kubernetes.py renders them. The worker pod's own command (`subq worker`)
runs in the pod's own environment (its envFrom ConfigMap and Secret, then its env, each
Secret key resolved and each $(VAR) expanded as the kubelet does; Redis's password, the
Secret's SUBQ_KUBERNETES_REDIS_PASSWORD, the local Redis's), and
its startupProbe and livenessProbe commands run as the kubelet runs an exec probe: the
argv as rendered, in that environment, with HOSTNAME the pod's name, within the probe's
timeoutSeconds. Compose: the worker's healthcheck of docker-compose.yml, alone and
merged with deploy/docker-compose.sentinel.yml, runs in the Compose worker's own
environment (tests/compose_file.py) with HOSTNAME the container's name.

The worker's Celery node is `celery@<pod name>`, as `celery worker` names it in its pod
(there `socket.gethostname()` is the pod's name; here CELERY_WORKER_HOSTNAME gives it).
Every check exits 0 while that worker runs; under Sentinel, also again after the master
is SIGKILLed and a replica promoted; and each exits non-zero with one line naming the
node once the worker has stopped.

The only rewrites are where Redis listens: the in-cluster names (Service subq-redis,
the sentinel pods of StatefulSet subq-sentinel, Compose's `redis` and `sentinel-N`)
become a local redis-server and the sentinels of tests/sentinel_kit.py; the worker's
metrics port becomes a free one (a pod has a network of its own, this host does not);
PATH starts with this environment's bin folder, as the image's has subq's Python.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from coordinator import Settings, worker_ping
from coordinator.local.embedded_redis import local_redis
from coordinator.local.fleet import WorkerFleet, settings_env
from coordinator.local.ports import free_port
from tests import compose_file
from tests.compose_file import Localizer
from tests.helpers import eventually
from tests.sentinel_kit import MASTER_NAME, SentinelSet, sentinel_set
from tests.test_kubernetes import REDIS_PASSWORD_KEY, _kustomize, _one, _project, pod_env
from tests.tls_kit import make_tls

# A worker pod's name as its ReplicaSet makes it: the pod's HOSTNAME, and its Celery node's host.
POD = "subq-worker-7c9d5b8f4-q2x8z"
NODE = f"celery@{POD}"
# This environment's bin folder: `subq`, `celery` and `python` as the image has them on PATH.
BIN = Path(sys.executable).parent
# How long after the master's SIGKILL the worker and the checks may take to find the promoted one.
FAILOVER_TIMEOUT_S = 60
# A stopped worker's warm shutdown: it has no run to hand back, so it exits well within this.
STOP_TIMEOUT_S = 35
# How often a check is tried again until it passes (the startup probe's period is 10 s; the test waits on it).
CHECK_EVERY_S = 1.0
# The worst case adds up the pod's startup allowance (120 s), the failover's and the worker's stop.
pytestmark = pytest.mark.timeout(600)


@dataclass(frozen=True)
class Check:
    """One health check as its runner runs it: argv, environment, and the time it is given."""

    name: str
    argv: list[str]
    env: dict[str, str]
    timeout_s: float


@dataclass(frozen=True)
class Outcome:
    check: Check
    returncode: int | None  # None: killed at its timeout
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"{self.check.name} {self.check.argv}: exit {self.returncode}\n{self.stdout}{self.stderr}"


def _run(checks: list[Check], cwd: Path) -> list[Outcome]:
    """Run every check at once (they are independent, as the kubelet's and Docker's are); their outcomes."""
    procs = [
        subprocess.Popen(c.argv, env=c.env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in checks
    ]
    outcomes = []
    for check, proc in zip(checks, procs, strict=True):
        try:
            out, err = proc.communicate(timeout=check.timeout_s)
            outcomes.append(Outcome(check, proc.returncode, out, err))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            outcomes.append(Outcome(check, None, out, err))
    return outcomes


def _until_all_pass(
    checks: list[Check], cwd: Path, worker: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float
) -> list[Outcome]:
    """Run the checks every second until each passes in one round, as the probes are tried; fail with the last round."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert worker.poll() is None, f"the worker exited (code {worker.returncode}):\n{_tail(log)}"
        outcomes = _run(checks, cwd)
        failed = [o for o in outcomes if o.returncode != 0]
        if not failed:
            return outcomes
        if time.monotonic() > deadline:
            shown = "\n".join(map(str, failed))
            raise AssertionError(f"not every check passed {what} within {timeout_s:g} s:\n{shown}\n{_tail(log)}")
        time.sleep(CHECK_EVERY_S)


def _ready(worker: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Wait for the worker's own log to say it is ready, before the first round of checks.

    A round starts a process a check, 1.2 s of CPU each (issue 43: 27 of them were half this file's
    CPU); rounds tried while the worker still starts only fail, more of them the more loaded the host.
    """
    line = f"{NODE} ready."

    def up() -> bool:
        assert worker.poll() is None, f"the worker exited (code {worker.returncode}):\n{_tail(log)}"
        return line in _tail(log, chars=1_000_000)

    eventually(up, f"{line!r} in the worker's log", timeout_s)


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def _base_env() -> dict[str, str]:
    """This process's environment without subq's settings, PATH with this environment's bin folder first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def overlays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    project = _project(tmp_path_factory.mktemp("deploy") / "kubernetes")
    out = {}
    for overlay in ("dev", "ha"):
        done = _kustomize(project / "overlays" / overlay)
        assert done.returncode == 0, done.stderr
        out[overlay] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


def _worker_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = _one(docs, "Deployment", "subq-worker")["spec"]["template"]["spec"]["containers"]
    (container,) = containers
    return container


def _pod_env(docs: list[dict[str, Any]], container: dict[str, Any], redis_password: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it (tests/test_kubernetes.py's pod_env: envFrom,
    then env, Secret keys resolved and $(VAR) expanded), with Redis's password as the operator's
    secrets.env gives it: the local Redis's."""
    return pod_env(docs, container, {REDIS_PASSWORD_KEY: redis_password})


def _in_cluster_redis(docs: list[dict[str, Any]], env: dict[str, str], local_url: str) -> dict[str, str]:
    """SUBQ_REDIS_URL names Service subq-redis on its port; here the local Redis on its own. The password
    stays the one the pod made from the Secret, which must be the local Redis's."""
    url, local = urlsplit(env["SUBQ_REDIS_URL"]), urlsplit(local_url)
    service = _one(docs, "Service", url.hostname)
    assert url.port in [port["port"] for port in service["spec"]["ports"]], env["SUBQ_REDIS_URL"]
    assert url.password == local.password, "the URL carries the Secret's password"
    netloc = url.netloc.rsplit("@", 1)[0] + f"@{local.hostname}:{local.port}"
    return {**env, "SUBQ_REDIS_URL": url._replace(netloc=netloc).geturl()}


def _in_cluster_sentinels(docs: list[dict[str, Any]], env: dict[str, str], kit: SentinelSet) -> dict[str, str]:
    """SUBQ_REDIS_SENTINELS names each pod of StatefulSet subq-sentinel through its headless Service; here the kit's."""
    service, sentinels = _one(docs, "Service", "subq-sentinel"), _one(docs, "StatefulSet", "subq-sentinel")
    assert service["spec"]["clusterIP"] == "None" and sentinels["spec"]["serviceName"] == "subq-sentinel"
    assert sentinels["spec"]["replicas"] == len(kit.sentinels)
    (port,) = [p["port"] for p in service["spec"]["ports"]]
    pods = [f"subq-sentinel-{n}.subq-sentinel:{port}" for n in range(len(kit.sentinels))]
    assert env["SUBQ_REDIS_SENTINELS"].split(",") == pods, env["SUBQ_REDIS_SENTINELS"]
    assert env["SUBQ_REDIS_SENTINEL_MASTER"] == MASTER_NAME, "the name the sentinels watch"
    return {**env, "SUBQ_REDIS_SENTINELS": kit.addresses}


def _pod_checks(container: dict[str, Any], env: dict[str, str]) -> list[Check]:
    """The container's startup and liveness probes, as the kubelet runs them in the pod."""
    checks = []
    for kind in ("startupProbe", "livenessProbe"):
        probe = container[kind]
        checks.append(Check(kind, probe["exec"]["command"], {**env, "HOSTNAME": POD}, probe["timeoutSeconds"]))
    return checks


def _compose_check(
    project: Path, compose: dict[str, Any], addresses: dict[str, str], redis_password: str | None = None
) -> Check:
    """The Compose worker's healthcheck, in its own environment (`.env`, then `environment`), Redis rewritten.

    `redis_password`: the local Redis's, as the operator's .env gives it (SUBQ_COMPOSE_REDIS_PASSWORD).
    """
    env_file = compose_file.read_env_file(compose_file.ROOT / ".env.example")  # the operator's copy
    if redis_password is not None:
        env_file["SUBQ_COMPOSE_REDIS_PASSWORD"] = redis_password
    (project / ".env").write_text("".join(f"{key}={value}\n" for key, value in env_file.items()))
    service = compose_file.Service.of("worker", project, Localizer(addresses=addresses), compose)
    env = {**_base_env(), **service.environment, "HOSTNAME": POD}  # the container's host name
    return Check("compose healthcheck", service.healthcheck, env, service.healthcheck_timeout_s)


def _startup_allowance_s(container: dict[str, Any]) -> float:
    """How long the kubelet lets the startup probe fail before it restarts the container."""
    probe = container["startupProbe"]
    return float(probe["periodSeconds"] * probe["failureThreshold"])


@contextmanager
def _pod_worker(
    container: dict[str, Any], env: dict[str, str], log: Path, cwd: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """The container's own command in its environment, its Celery node named as in the pod; stopped at the end."""
    own = {**env, "CELERY_WORKER_HOSTNAME": NODE, "HOSTNAME": POD, "SUBQ_WORKER_METRICS_PORT": str(free_port())}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            container["command"], env=own, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the worker's process group, as the kubelet stops a pod; SIGKILL past the grace."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _pass_while_up_fail_once_stopped(
    checks: list[Check], container: dict[str, Any], env: dict[str, str], workdir: Path, kit: SentinelSet | None = None
) -> None:
    log = workdir / "worker.log"
    with _pod_worker(container, env, log, workdir) as worker:
        # As the startup probe does: tried until the worker answers, for as long as the pod is given, all told
        # (the wait for its log's "ready" line counts against the same allowance).
        allowance_s, started = _startup_allowance_s(container), time.monotonic()
        _ready(worker, log, allowance_s)
        left_s = max(0.0, allowance_s - (time.monotonic() - started))
        outcomes = _until_all_pass(checks, workdir, worker, log, "once started", left_s)
        for outcome in outcomes:
            assert outcome.stdout.strip() == f"{NODE}: pong", outcome
        if kit is not None:
            # The master SIGKILLed: the worker and each check find the replica the sentinels promote.
            old = kit.kill_master()
            kit.wait_promoted(old)
            _until_all_pass(checks, workdir, worker, log, "after the failover", FAILOVER_TIMEOUT_S)
        _stop(worker)
        assert worker.returncode is not None
    _each_fails_in_one_line(checks, workdir, "did not answer")


def _each_fails_in_one_line(checks: list[Check], cwd: Path, why: str) -> None:
    """Each check exits non-zero within its time, saying on one line of stderr which node and why."""
    for outcome in _run(checks, cwd):
        assert outcome.returncode not in (0, None), outcome
        assert outcome.stdout == "", outcome
        lines = outcome.stderr.splitlines()
        assert len(lines) == 1 and NODE in lines[0] and why in lines[0], outcome


def test_with_one_redis_the_checks_pass_while_the_pods_worker_answers_and_fail_once_it_stops(
    overlays: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = overlays["dev"]
    container = _worker_container(docs)
    with local_redis() as url:
        parts = urlsplit(url)  # the embedded Redis has a password (issue 39)
        assert parts.password
        env = {**_base_env(), **_in_cluster_redis(docs, _pod_env(docs, container, parts.password), url)}
        compose = compose_file.load()
        local = f"{parts.hostname}:{parts.port}"
        compose_check = _compose_check(tmp_path, compose, {"redis:6379": local}, parts.password)
        checks = [*_pod_checks(container, env), compose_check]
        _pass_while_up_fail_once_stopped(checks, container, env, tmp_path)
    # Redis gone as well: each says the broker is unreachable (where, not its password), rather than waiting.
    _each_fails_in_one_line(checks, tmp_path, f"the broker (redis://{local}/0) is unreachable")


def test_under_sentinel_the_checks_pass_while_the_pods_worker_answers_through_a_failover_and_fail_once_it_stops(
    overlays: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = overlays["ha"]
    container = _worker_container(docs)
    # tests/sentinel_kit.py's set has no password: the Secret's is empty here (SUBQ_REDIS_PASSWORD and
    # SUBQ_REDIS_SENTINEL_PASSWORD come from it; test_kubernetes checks they do, and that KEDA's match).
    given = _pod_env(docs, container, "")
    assert "SUBQ_REDIS_URL" not in given, "the ha overlay names the sentinels alone"
    assert given["SUBQ_REDIS_PASSWORD"] == given["SUBQ_REDIS_SENTINEL_PASSWORD"] == ""
    with sentinel_set(tmp_path / "redis") as kit:
        env = {**_base_env(), **_in_cluster_sentinels(docs, given, kit)}
        compose = compose_file.load(compose_file.SENTINEL_FILE)
        named = compose["services"]["worker"]["environment"]["SUBQ_REDIS_SENTINELS"].split(",")
        assert len(named) == len(kit.sentinels), named
        addresses = {name: f"127.0.0.1:{s.port}" for name, s in zip(named, kit.sentinels, strict=True)}
        checks = [*_pod_checks(container, env), _compose_check(tmp_path, compose, addresses)]
        _pass_while_up_fail_once_stopped(checks, container, env, tmp_path, kit)
        for sentinel in kit.sentinels:
            sentinel.stop()
        # No sentinel left to name the master: each says so, rather than waiting for an answer.
        _each_fails_in_one_line(checks, tmp_path, "no sentinel of SUBQ_REDIS_SENTINELS answers")


def test_the_check_reaches_a_worker_through_sentinels_that_speak_tls_only(settings: Settings, tmp_path: Path) -> None:
    """SUBQ_REDIS_TLS and its files reach the check's broker and its questions to the sentinels, as the worker's."""
    with sentinel_set(tmp_path / "sentinels", replicas=1, tls=make_tls(tmp_path / "tls")) as kit:
        own = kit.settings(settings, key_prefix="subqprobetls", queue="subq-probe-tls")
        with WorkerFleet(own, 1, tmp_path / "workers") as fleet:
            fleet.wait_ready()
            (node,) = fleet.nodes
            answers = [node, "celery@no-such-pod"]
            argv = [sys.executable, "-m", "coordinator.worker_ping"]
            env = settings_env(own)
            done = [subprocess.run([*argv, n], env=env, capture_output=True, text=True, timeout=60) for n in answers]
    assert (done[0].returncode, done[0].stdout, done[0].stderr) == (0, f"{node}: pong\n", ""), done[0]
    assert done[1].returncode == 1 and done[1].stdout == "", done[1]
    assert done[1].stderr.count("\n") == 1 and "celery@no-such-pod did not answer" in done[1].stderr, done[1]
    assert "(TLS) of the sentinels" in done[1].stderr, "the broker named as subq's settings give it"


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["celery@"], 2, "'celery@' is not a Celery node name"),  # HOSTNAME empty where the probe ran
        (["subq-worker-1"], 2, "is not a Celery node name (name@host"),
        ([NODE], 1, f"worker ping: {NODE}: Invalid setting SUBQ_REDIS_URL: not set"),  # no Redis configured
    ],
    ids=["no host", "no name", "no redis"],
)
def test_a_check_that_cannot_ping_says_why_in_one_line(
    argv: list[str], code: int, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert worker_ping.main(argv) == code
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and says in err, err
