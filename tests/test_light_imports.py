"""What importing the client, the wire models and `subq --help` loads: not the server side.

`import coordinator.client` needs httpx, pydantic and subq's models only, and
`subq --help` needs Typer only; Celery, kombu, redis-py, pydantic-settings and
the HTTP server are loaded by the commands that use them. Each check runs in a
fresh interpreter, since this process has imported everything already.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

# Top-level packages that only the service, the workers or the server need.
HEAVY = ["celery", "kombu", "redis", "pydantic_settings", "fastapi", "starlette", "uvicorn", "typer"]
# subq's own modules that load those, which the CLI imports only inside the commands that need them.
SERVER_SIDE = ["coordinator.service", "coordinator.settings", "coordinator.local.up", "coordinator.local.fleet"]
TIMEOUT_S = 60


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running `code`."""
    (modules,) = loaded_after_each(code)
    return modules


def loaded_after_each(*steps: str) -> list[set[str]]:
    """The modules one fresh interpreter has loaded after each of `steps`, run one after another in it."""
    shown = "import json as _json, sys as _sys\nprint(_json.dumps(sorted(_sys.modules)))\n"
    probe = "".join(f"{step}\n{shown}" for step in steps)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    return [set(json.loads(line)) for line in done.stdout.splitlines()[-len(steps) :]]


def heavy_in(modules: set[str], expected: list[str]) -> list[str]:
    return sorted(name for name in expected if any(m == name or m.startswith(f"{name}.") for m in modules))


@pytest.mark.parametrize("module", ["coordinator.client", "coordinator.api.schemas"])
def test_the_client_side_loads_no_server_dependency(module: str) -> None:
    modules = loaded_after(f"import {module}")
    assert module in modules
    assert heavy_in(modules, HEAVY) == []
    assert heavy_in(modules, SERVER_SIDE) == []


def test_subq_help_loads_only_typer() -> None:
    code = (
        "import contextlib, io\n"
        "from coordinator.cli import run_cli\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    assert run_cli(['--help']) == 0\n"
        "assert 'subq up' in out.getvalue()\n"
    )
    modules = loaded_after(code)
    assert heavy_in(modules, [m for m in HEAVY if m != "typer"]) == []
    assert heavy_in(modules, [*SERVER_SIDE, "coordinator.models"]) == []


# The provider SDKs: more than half of a worker's start when imported (their pydantic types).
PROVIDER_SDKS = ["openai", "anthropic"]


def test_a_worker_imports_no_provider_sdk_until_a_profile_names_one() -> None:
    imported = "import os\nos.environ['SUBQ_REDIS_URL'] = 'redis://127.0.0.1:1/0'\nimport workers.app"
    # What the worker's start runs (workers/maintenance.py): the SDKs of the profiles' providers, and no other.
    # One interpreter, its modules read after each step (a second one importing workers.app again cost 2 s of CPU).
    started = (
        "from coordinator import Profile\n"
        "from workers.runtime.providers import load_sdks\n"
        "assert load_sdks([Profile(), Profile(model='openai:gpt-4o-mini')]) == ['openai']"
    )
    at_import, modules = loaded_after_each(imported, started)
    assert "workers.app" in at_import and heavy_in(at_import, PROVIDER_SDKS) == []
    assert heavy_in(modules, PROVIDER_SDKS) == ["openai"]
    assert "pydantic_ai.models.openai" in modules


# The MCP SDK and subq's MCP tools: about 1 s of an API process's start, paid at the first /mcp request.
MCP_SIDE = ["mcp", "coordinator.mcp_tools", "pydantic_ai"]
API_CODE = (
    "import sys\n"
    "from fastapi.testclient import TestClient\n"
    "from coordinator import Settings\n"
    "from coordinator.api import create_app\n"
    "app = create_app(Settings(redis_url='redis://127.0.0.1:1/0', api_token='t' * 32))\n"
    "with TestClient(app):\n"  # the app's lifespan, as a served API runs it
    "    pass\n"
)


def test_an_api_process_loads_the_mcp_sdk_only_when_mcp_is_asked() -> None:
    assert heavy_in(loaded_after(API_CODE), MCP_SIDE) == []


def test_mcp_starts_at_its_first_request_in_each_lifespan() -> None:
    from fastapi.testclient import TestClient

    from coordinator import Settings
    from coordinator.api import create_app

    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0", api_token="t" * 32))
    headers = {"Authorization": "Bearer " + "t" * 32, "Accept": "application/json, text/event-stream"}
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    # Without the app's lifespan there is no session manager to start: refused, as before.
    assert TestClient(app).post("/mcp", json=listing, headers=headers).status_code == 503
    for _ in range(2):  # a lifespan's manager stops with it; the next lifespan starts its own
        with TestClient(app) as client:
            for _ in range(2):
                answer = client.post("/mcp", json=listing, headers=headers)
                assert answer.status_code == 200, answer.text
                assert '"name":"run_task"' in answer.text


def test_a_first_mcp_request_importing_while_the_lifespan_ends_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first /mcp request imports the MCP side in a thread; if the lifespan ends meanwhile, the request
    is answered 503 and starts no session manager (it started one that nothing stopped: review V4, item 6)."""
    import asyncio
    import importlib
    import threading

    from coordinator import Settings
    from coordinator.api import create_app
    from coordinator.api.mcp import McpEndpoint

    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0", api_token="t" * 32))
    (endpoint,) = [r.endpoint for r in app.router.routes if isinstance(getattr(r, "endpoint", None), McpEndpoint)]
    importing, imported = threading.Event(), threading.Event()
    real_import = importlib.import_module

    def slow_import(name: str, package: str | None = None) -> object:
        if name == "coordinator.mcp_tools":
            importing.set()
            imported.wait(TIMEOUT_S)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", slow_import)
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()
    headers = [
        (b"authorization", b"Bearer " + b"t" * 32),
        (b"accept", b"application/json, text/event-stream"),
        (b"content-type", b"application/json"),
    ]
    scope = {"type": "http", "method": "POST", "path": "/mcp", "raw_path": b"/mcp", "query_string": b"",
             "headers": headers, "scheme": "http", "server": ("testserver", 80), "client": ("127.0.0.1", 1),
             "root_path": "", "http_version": "1.1", "app": app}  # fmt: skip
    sent: list[dict[str, object]] = []

    bodies = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, object]:  # the body, then the client has gone
        return bodies.pop() if bodies else {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def the_lifespan_ends_during_the_import() -> list[asyncio.Task[object]]:
        async with endpoint.running():
            first = asyncio.create_task(endpoint(scope, receive, send))
            assert await asyncio.to_thread(importing.wait, TIMEOUT_S)
        imported.set()  # the import ends after the lifespan did
        await asyncio.wait_for(first, TIMEOUT_S)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    left = asyncio.run(the_lifespan_ends_during_the_import())
    assert sent and sent[0]["status"] == 503, sent
    assert endpoint.manager is None and left == [], "no session manager started"


# What `celery` imports before it reads its arguments (every subcommand, each installed plugin) and a worker never uses.
CELERY_UMBRELLA = ["celery.bin.celery", "celery.bin.amqp", "flower", "click_repl", "prompt_toolkit"]
WORKER_ENV = {"SUBQ_REDIS_URL": "redis://127.0.0.1:1/0"}


def test_python_m_workers_is_celerys_worker_command_without_the_umbrella() -> None:
    code = (
        "import contextlib, io, os, runpy, sys\n"
        f"os.environ.update({WORKER_ENV!r})\n"
        "sys.argv = ['workers', '--help']\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "    runpy.run_module('workers', run_name='__main__')\n"
        "assert 'Usage: subq worker [OPTIONS]' in out.getvalue(), out.getvalue()\n"
        "assert '--concurrency' in out.getvalue() and '--without-mingle' in out.getvalue()\n"
    )
    modules = loaded_after(code)
    assert "celery.bin.worker" in modules
    assert heavy_in(modules, CELERY_UMBRELLA) == []


def test_python_m_workers_refuses_a_bad_option_naming_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")} | WORKER_ENV
    done = subprocess.run(
        [sys.executable, "-m", "workers", "--concurrency", "many"],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Invalid value for '-c' / '--concurrency'" in done.stderr and "'many'" in done.stderr
    assert "ready." not in done.stdout + done.stderr  # it never started


def test_the_collector_is_off_only_while_a_process_loads() -> None:
    code = f"import gc, os\nos.environ.update({WORKER_ENV!r})\nimport workers.app\nassert gc.isenabled()\n"
    loaded_after(code)  # a worker serves with the collector on
    from coordinator.cli.common import loading

    assert gc.isenabled()
    with pytest.raises(RuntimeError), loading():
        assert not gc.isenabled()
        raise RuntimeError("a command's settings were refused")
    assert gc.isenabled()
