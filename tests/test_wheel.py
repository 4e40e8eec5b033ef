"""The built wheel works once installed: what a user gets from pip, not the source checkout.

The wheel is built the way deploy/Dockerfile builds it (the same files, the same
`pip wheel` command), installed non-editable with the server extra's dependencies
into a fresh virtual environment, and run from an empty folder outside the checkout, so
nothing can be imported from the source tree by accident: `subq --help`, the
Python client, and `subq api` with `subq worker` against a real Redis.
"""

from __future__ import annotations

import signal
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.local.ports import free_port
from tests.wheel_env import BUILD_INPUTS, PIP_WHEEL, ROOT, Service, Venv, started

DOCKERFILE = ROOT / "deploy" / "Dockerfile"

# Building, creating the venv and installing the dependencies (tests/wheel_env.py, once
# per run) take a minute or two on a cold pip cache; the whole module gets this long per test.
pytestmark = pytest.mark.timeout(600)

# A cold API or worker imports FastAPI, Celery and pydantic-ai in seconds; a loaded CI host takes longer.
START_TIMEOUT_S = 90
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
    installed = 'pip install --no-cache-dir "$(echo /tmp/dist/*.whl)[server,otel]"'
    assert installed in dockerfile, "the image installs that wheel, with the server's packages"


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


def test_installed_redis_client_parses_replies_with_hiredis(venv: Venv) -> None:
    """Parsing a run's script replies in Python was most of a worker's own CPU (docs/benchmarks.md)."""
    done = venv.run("python", "-c", "from redis.utils import HIREDIS_AVAILABLE; print(HIREDIS_AVAILABLE)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", "the wheel's dependencies bring redis-py's compiled parser"


@contextmanager
def _started(venv: Venv, argv: list[str], log_dir: Path, **subq: str) -> Iterator[Service]:
    with started(venv, argv, log_dir / f"{argv[1]}.log", venv.env(**subq)) as service:
        yield service


def _wait_for_health(url: str, *services: Service, want_worker: bool = False) -> dict[str, Any]:
    """Poll GET /healthz until Redis is ok (and, with `want_worker`, a worker's heartbeat is seen)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for service in services:
            service.assert_running()
        try:
            body = httpx.get(f"{url}/healthz", timeout=HTTP_TIMEOUT_S).json()
        except httpx.HTTPError:  # not listening yet
            body = {}
        if body.get("redis", {}).get("ok") and (not want_worker or body["workers"]["count"] >= 1):
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

    with _started(venv, ["subq", "api", "--port", str(api_port)], tmp_path, **settings) as api:
        # Both start at once, as a deployment starts them (issue 43: one after the other, the API's start
        # was the worker's wait): its health is read with Redis ok, then with the worker's heartbeat.
        with _started(venv, ["subq", "worker", "--concurrency", "2"], tmp_path, **settings) as worker:
            health = _wait_for_health(url, api, worker)
            assert health["redis"]["ok"] is True
            health = _wait_for_health(url, api, worker, want_worker=True)
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
