"""The `subq` command as a user runs it: real processes, real exit codes and messages."""

from __future__ import annotations

import os
import subprocess
import re
import sys
import uuid

import psutil
import pytest
import redis

from coordinator import Coordinator, Settings
from tests.helpers import script, usage_step


def subq(*args: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")}
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        env=base | (env or {}), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def test_demo_runs_on_an_embedded_redis_and_leaves_nothing_behind() -> None:
    marker = uuid.uuid4().hex  # inherited by everything the demo starts
    proc = subq("demo", env={"DEMO_TEST_MARKER": marker})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    url = re.search(r"embedded Redis at (redis://\S+) ", out)
    assert url is not None, out
    for item in ("Collect the sales figures for Q3", "Write the executive summary"):
        line = next(line for line in out.splitlines() if item in line)
        assert line.strip().startswith("[x]") and "$0.0" in line
    assert "Parent total cost: $0.079950 (47950 tokens" in out
    assert "genai-prices" in out and "offline model" in out
    assert _processes_marked(marker) == []  # workers (redis-server rewrites its environ, so:)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url.group(1), socket_connect_timeout=1).ping()


def _processes_marked(marker: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.environ().get("DEMO_TEST_MARKER") == marker:
                found.append(" ".join(proc.info["cmdline"] or []))
        except psutil.Error:
            continue
    return found


def test_help_everywhere() -> None:
    for command in ([], ["demo"], ["worker"], ["status"], ["todos"]):
        proc = subq(*command, "--help")
        assert proc.returncode == 0 and "Usage: " in proc.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["status", "0123456789abcdef"], {}, "subq: Invalid setting SUBQ_REDIS_URL: not set"),
        (["status", "0123456789abcdef"], {"SUBQ_MAX_DEPTH": "deep"}, "subq: Invalid setting SUBQ_MAX_DEPTH"),
        (["status", "not-an-id"], None, "subq: Unknown id: 'not-an-id' is not a subq task or batch id"),
        (["status", "0123456789abcdef"], None, "subq: Unknown task: 0123456789abcdef"),
        (["demo", "--workers", "0"], {}, "Invalid value for '--workers'"),
    ],
)
def test_errors_are_one_line_and_a_nonzero_exit(
    settings: Settings, args: list[str], env: dict[str, str] | None, message: str
) -> None:
    proc = subq(*args, env={"SUBQ_REDIS_URL": settings.redis_url or "", "SUBQ_KEY_PREFIX": "subqtest"} if env is None else env)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_status_and_todos_show_the_figures(coordinator: Coordinator, settings: Settings) -> None:
    parent = coordinator.create_task("p", todos="[ ] first\n[ ] second")
    batch = coordinator.delegate(parent.id, [{"description": "c", "message": script(usage_step())}])
    coordinator.wait(parent.id, 60)
    env = {"SUBQ_REDIS_URL": settings.redis_url or "", "SUBQ_KEY_PREFIX": settings.key_prefix}
    todos = subq("todos", parent.id, env=env)
    assert todos.returncode == 0, todos.stderr
    assert f"[x] first  ({batch.child_ids[0]}: 13500 tokens, $0.021000)" in todos.stdout
    assert "[ ] second" in todos.stdout
    status = subq("status", parent.id, "--json", env=env)
    assert '"total_cost_micros": 21000' in status.stdout
