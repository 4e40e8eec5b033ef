"""The installed `subq` console script as a user starts it: a real process, its exit code and output.

tests/test_cli.py runs every command in-process through `run_cli`; these few prove
that the script the package installs reaches it, reads the SUBQ_ environment, and
exits with the code and prints the output the in-process tests check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator import Coordinator, Settings
from tests.helpers import state
from tests.test_bad_input import NO_TREE
from tests.test_cli import CALLER_ONLY, COMMANDS, UNKNOWN

SCRIPT = Path(sys.executable).parent / "subq"
TIMEOUT_S = 120


def script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`subq <args>` from the installed script, with `env` as its only SUBQ_ variables."""
    assert SCRIPT.is_file(), f"the package installs no `subq` script next to {sys.executable}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(CALLER_ONLY)}
    return subprocess.run(
        [str(SCRIPT), *args], env=base | (env or {}), capture_output=True, text=True, timeout=TIMEOUT_S
    )


@pytest.fixture
def env(settings: Settings) -> dict[str, str]:
    """The test Redis and prefix, and a queue no worker consumes, so a published message would stay countable."""
    return {
        "SUBQ_REDIS_URL": settings.redis_url or "",
        "SUBQ_KEY_PREFIX": "subqidle",  # the idle coordinator's (tests/conftest.py)
        "SUBQ_QUEUE": "subq-nobody",
    }


def test_the_script_prints_help() -> None:
    proc = script("--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage: " in proc.stdout and all(c in proc.stdout for c in COMMANDS)
    assert proc.stderr == ""
    bare = script()
    assert bare.returncode == 2 and all(c in bare.stdout for c in COMMANDS)


def test_the_script_exits_1_with_one_line_and_changes_nothing(
    idle_coordinator: Coordinator, env: dict[str, str]
) -> None:
    before = state(idle_coordinator, NO_TREE)
    proc = script("tree", UNKNOWN, env=env)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == f"subq: Unknown task: {UNKNOWN}\n" and proc.stdout == ""
    assert state(idle_coordinator, NO_TREE) == before


def test_the_script_prints_json_read_from_the_configured_redis(
    idle_coordinator: Coordinator, env: dict[str, str]
) -> None:
    parent = idle_coordinator.create_task("p", todos="[ ] first\n[x] second")
    proc = script("status", parent.id, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert (record["id"], record["status"], record["depth"], record["total_cost_micros"]) == (
        parent.id,
        "active",
        0,
        0,
    )
    todos = script("todos", parent.id, "--json", env=env)
    assert todos.returncode == 0, todos.stderr
    assert [(i["content"], i["status"]) for i in json.loads(todos.stdout)] == [
        ("first", "pending"),
        ("second", "completed"),
    ]
