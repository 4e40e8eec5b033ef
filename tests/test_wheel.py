"""The built wheel works once installed: what a user gets from pip, not the source checkout.

The wheel is built the way deploy/Dockerfile builds it (the same files, the same
`pip wheel` command), installed non-editable with its dependencies into a fresh
virtual environment, and run from an empty folder outside the checkout, so
nothing can be imported from the source tree by accident: `subq --help`, the
Python client, and `subq api` with `subq worker` against a real Redis.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.local_redis import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"

# Building, creating the venv and installing the dependencies take a minute or two
# on a cold pip cache; the whole module gets this long per test.
pytestmark = pytest.mark.timeout(600)

# What deploy/Dockerfile copies into its build stage: the wheel is built from these alone.
BUILD_INPUTS = ("pyproject.toml", "README.md", "coordinator", "workers")
# The Dockerfile runs the same command, as `python -m pip wheel --no-deps . -w /dist`.
# Build isolation on: pip installs the build requirements pyproject.toml names
# (setuptools>=69, wheel) from the index, whatever this environment has.
PIP_WHEEL = ("-m", "pip", "wheel", "--no-deps")
BUILD_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 420
COMMAND_TIMEOUT_S = 60
# A cold API or worker imports FastAPI, Celery and pydantic-ai in seconds; a loaded CI host takes longer.
START_TIMEOUT_S = 90
# A warm shutdown of an idle worker or API takes a second or two.
STOP_TIMEOUT_S = 30
POLL_EVERY_S = 0.25
HTTP_TIMEOUT_S = 5
# Keys and a queue of this test's own on the session's shared Redis.
KEY_PREFIX = "subqwheel"
QUEUE = "subq-wheel"
API_TOKEN = "wheel-test-token"
# The offline model answers "Done: <first line>" without a network call.
AGENT_PROMPT = "Say hello from the installed wheel"
# The worker imports the agent runner (pydantic-ai, genai-prices) on its first task: seconds,
# or tens of seconds on a loaded CI host.
AGENT_TIMEOUT_S = 120


@dataclass(frozen=True)
class Venv:
    """A virtual environment with the wheel installed, and a way to run its commands."""

    root: Path
    site_packages: Path
    workdir: Path  # an empty folder outside the checkout: the working directory of every command

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def env(self, **subq: str) -> dict[str, str]:
        """This environment's PATH first; nothing from the caller's Python or SUBQ_ settings leaks in."""
        leaky = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
        env = {k: v for k, v in os.environ.items() if k not in leaky and not k.startswith("SUBQ_")}
        env.update(PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(self.root))
        env["PYTHONNOUSERSITE"] = "1"  # no packages from ~/.local either
        env.update({f"SUBQ_{name.upper()}": value for name, value in subq.items()})
        return env

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / argv[0]), *argv[1:]],
            cwd=self.workdir,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )


def _run_checked(argv: list[str], timeout_s: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a build step; fail with its output (not just an exit code) when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    assert done.returncode == 0, (
        f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )
    return done


def _copy_build_inputs(dest: Path) -> Path:
    """The files the Dockerfile copies, without bytecode; a copy, so the build writes nothing into the checkout.

    (setuptools builds in the source folder, and a stale build/lib there would leak
    files that no longer exist, such as a module moved into a package, into the wheel.)
    """
    dest.mkdir()
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _copy_build_inputs(tmp_path_factory.mktemp("build") / "src")


@pytest.fixture(scope="module")
def wheel(source_copy: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _run_checked([sys.executable, *PIP_WHEEL, str(source_copy), "-w", str(dist)], BUILD_TIMEOUT_S)
    (built,) = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("venv")
    _run_checked([sys.executable, "-m", "venv", "--clear", str(root)], COMMAND_TIMEOUT_S)
    python = str(root / "bin" / "python")
    # The wheel file itself (not the checkout, not -e), with its runtime dependencies and
    # no dev extras. pip's cache is left on: dependencies come from it when it has them.
    # --no-compile: byte-compiling every installed module took 6 of 15 s; the few modules
    # the commands below import are compiled as they are imported.
    install = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-compile", str(wheel)]
    _run_checked(install, INSTALL_TIMEOUT_S)
    site = _run_checked([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], COMMAND_TIMEOUT_S)
    return Venv(root=root, site_packages=Path(site.stdout.strip()), workdir=tmp_path_factory.mktemp("cwd"))


# Modules, Lua scripts, and the web view's templates, script and stylesheet (no CDN: they ship here).
SHIPPED_SUFFIXES = (".py", ".lua", ".html", ".js", ".css")


def _files_to_ship(tree: Path) -> set[str]:
    """Every module, Lua script, web asset and py.typed of the two top-level packages in a source tree, as wheel paths."""
    return {
        path.relative_to(tree).as_posix()
        for top in ("coordinator", "workers")
        for path in (tree / top).rglob("*")
        if (path.suffix in SHIPPED_SUFFIXES or path.name == "py.typed") and "__pycache__" not in path.parts
    }


def test_wheel_holds_every_source_file_and_nothing_else(wheel: Path, source_copy: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    packaged = {name for name in names if ".dist-info/" not in name}
    # The same set: no subpackage (coordinator.api was once left out), Lua script or
    # py.typed missing, and no tests/, bench/ or other stray top-level folder.
    assert packaged == _files_to_ship(source_copy)
    assert "coordinator/api/app.py" in packaged
    assert {"coordinator/py.typed", "workers/py.typed"} <= packaged
    assert any(name.endswith(".lua") for name in packaged)
    assert {"coordinator/web/static/subq.js", "coordinator/web/templates/tree.html"} <= packaged


def test_dockerfile_builds_the_same_wheel() -> None:
    """No Docker engine runs here: the image's build steps are checked to be the ones tested above."""
    dockerfile = DOCKERFILE.read_text()
    build_stage = dockerfile.split("\nFROM ")[1]
    copied = [word for line in build_stage.splitlines() if line.startswith("COPY ") for word in line.split()[1:-1]]
    assert sorted(copied) == sorted(BUILD_INPUTS)
    assert f"RUN python {' '.join(PIP_WHEEL)} . -w /dist" in build_stage
    assert "pip install --no-cache-dir /tmp/dist/*.whl" in dockerfile, "the final image installs that wheel"


def test_installed_cli_lists_its_commands(venv: Venv) -> None:
    done = venv.run("subq", "--help")
    assert done.returncode == 0, done.stderr
    for command in ("up", "worker", "api", "run", "tree"):
        assert command in done.stdout


def test_installed_package_is_the_one_imported(venv: Venv) -> None:
    done = venv.run(
        "python",
        "-c",
        "import coordinator, coordinator.api, coordinator.client\n"
        "from coordinator.client import SubqClient\n"
        "print(coordinator.__file__)",
    )
    assert done.returncode == 0, done.stderr
    imported_from = Path(done.stdout.strip())
    assert imported_from.is_relative_to(venv.site_packages), f"imported {imported_from}, not the installed wheel"


@dataclass(frozen=True)
class Service:
    """An installed command running in a process group of its own, with its output in `log`."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} log ---\n" + self.log.read_text(errors="replace")[-chars:]

    def assert_running(self) -> None:
        assert self.proc.poll() is None, f"{self.name} exited {self.proc.returncode}:\n{self.tail()}"

    def stop(self) -> int:
        """A clean stop: SIGTERM to the whole group (what Docker and systemd send), then its exit code."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)


@contextmanager
def _started(venv: Venv, argv: list[str], log_dir: Path, **subq: str) -> Iterator[Service]:
    """Start an installed command; its group is killed at the end if it is still up, so nothing outlives the test."""
    name = " ".join(argv[:2])
    log = log_dir / f"{argv[1]}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(venv.bin / argv[0]), *argv[1:]],
            cwd=venv.workdir,
            env=venv.env(**subq),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield Service(name, proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for_health(url: str, *services: Service, worker_node: str | None = None) -> dict[str, Any]:
    """Poll GET /healthz until Redis is ok (and, with `worker_node`, that worker answered the API's ping)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for service in services:
            service.assert_running()
        try:
            body = httpx.get(f"{url}/healthz", timeout=HTTP_TIMEOUT_S).json()
        except httpx.HTTPError:  # not listening yet
            body = {}
        if body.get("redis", {}).get("ok") and (worker_node is None or worker_node in body["workers"]["names"]):
            return body
        time.sleep(POLL_EVERY_S)
    logs = "\n".join(service.tail() for service in services)
    raise AssertionError(f"no healthy answer from {url}/healthz within {START_TIMEOUT_S}s (last: {body}):\n{logs}")


def _run_offline_agent(url: str, worker: Service) -> dict[str, Any]:
    """Start a root agent on the fleet over the API (the default offline model) and wait for its end."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=HTTP_TIMEOUT_S) as http:
        created = http.post("/v1/tasks", json={"prompt": AGENT_PROMPT, "run": True})
        assert created.status_code == 201, created.text
        deadline = time.monotonic() + AGENT_TIMEOUT_S
        while time.monotonic() < deadline:
            task: dict[str, Any] = http.get(f"/v1/tasks/{created.json()['id']}").json()
            if task["status"] in ("completed", "failed", "cancelled"):
                assert task["status"] == "completed", f"{task}\n{worker.tail()}"
                return task
            time.sleep(POLL_EVERY_S)
    raise AssertionError(f"the agent did not finish within {AGENT_TIMEOUT_S}s (last: {task}):\n{worker.tail()}")


def test_installed_api_and_worker_serve(venv: Venv, redis_url: str, tmp_path: Path) -> None:
    settings = {"redis_url": redis_url, "key_prefix": KEY_PREFIX, "queue": QUEUE, "api_token": API_TOKEN}
    api_port = free_port()
    url = f"http://127.0.0.1:{api_port}"
    # `subq worker` has no node name option: Celery's default, celery@<host>, is what the API's ping sees.
    worker_node = f"celery@{socket.gethostname()}"

    with _started(venv, ["subq", "api", "--port", str(api_port)], tmp_path, **settings) as api:
        health = _wait_for_health(url, api)
        assert health["redis"]["ok"] is True

        with _started(venv, ["subq", "worker", "--concurrency", "2"], tmp_path, **settings) as worker:
            health = _wait_for_health(url, api, worker, worker_node=worker_node)
            assert health["status"] == "ok" and health["workers"]["count"] >= 1
            # The token from SUBQ_API_TOKEN guards the task routes of the installed API.
            assert httpx.get(f"{url}/v1/tasks", timeout=HTTP_TIMEOUT_S).status_code == 401
            # The web view's assets and templates come from the installed wheel.
            script = httpx.get(f"{url}/ui/static/subq.js", timeout=HTTP_TIMEOUT_S)
            assert script.status_code == 200 and "EventSource" in script.text
            login = httpx.get(f"{url}/ui/", timeout=HTTP_TIMEOUT_S, follow_redirects=True)
            assert login.status_code == 200 and 'name="token"' in login.text

            # One offline agent through both installed halves: the API's Lua scripts, the
            # worker's pydantic-ai runner and genai-prices' price data all come from the venv.
            task = _run_offline_agent(url, worker)
            assert task["summary"] == f"Done: {AGENT_PROMPT}"
            assert task["cost_micros"] > 0 and task["cost_source"].startswith("genai-prices")

            assert worker.stop() == 0, f"the worker did not stop cleanly:\n{worker.tail()}"

        # uvicorn finishes its graceful shutdown, then re-raises the SIGTERM it caught.
        assert api.stop() in (0, -signal.SIGTERM), f"the API did not stop cleanly:\n{api.tail()}"
        assert "Application shutdown complete" in api.tail()
