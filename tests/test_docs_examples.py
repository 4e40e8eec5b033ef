"""The docs' first tool example runs as written: docs/tools.md's step 1, copied into a shell.

Its lines (a profiles file, a CSV, `subq tools`, `subq run --profile demo --follow`)
run in bash in an empty folder, against real worker processes started after the
file exists (as `subq up` would be, where SUBQ_PROFILES_FILE is set). Once it
failed with `Invalid profile: demo`, naming no profile and no file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from coordinator import Settings
from coordinator.local.fleet import settings_env
from tests.conftest import dedicated_fleet

ROOT = Path(__file__).resolve().parent.parent
STEP_ONE = "1. **A Python function**"


def _step_one() -> tuple[str, str]:
    """docs/tools.md's step 1: its shell block (as a reader copies it, unindented) and the reply it promises."""
    text = (ROOT / "docs" / "tools.md").read_text()
    step = text[text.index(STEP_ONE) : text.index("2. **An MCP server**")]
    block = re.search(r"```sh\n(.*?)\n\s*```", step, re.DOTALL)
    reply = re.search(r"`(Done: sales_total returned [^`]+)`", step)
    assert block and reply, step
    return textwrap.dedent(block.group(1)), reply.group(1)


def _bash(script: str, folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `subq` is the venv's
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=folder, env={**env, "PATH": path},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_first_tool_example_runs_as_written(settings: Settings, tmp_path: Path) -> None:
    script, reply = _step_one()
    folder = tmp_path / "reader"
    folder.mkdir()
    lines = script.splitlines()
    run_at = next(i for i, line in enumerate(lines) if line.startswith("subq run "))
    # Before the stack is up: the files, and the check that needs no worker.
    env = {k: v for k, v in settings_env(settings).items() if k != "SUBQ_PROFILES"}
    before = _bash("\n".join(lines[:run_at]), folder, env)
    assert before.returncode == 0, before.stderr
    assert re.search(r"^\s*sales_total\s+coordinator\.local\.example_tools:sales_total$", before.stdout, re.M)
    # The workers read the same file (settings_env passes SUBQ_PROFILES_FILE on).
    own = settings.model_copy(update={"profiles": {}, "profiles_file": folder / "profiles.toml"})
    with dedicated_fleet(own, tmp_path / "logs", 1, queue="subq-docs") as (coord, _):
        env = {k: v for k, v in settings_env(coord.settings).items() if k != "SUBQ_PROFILES"}
        whole = _bash(script, folder, env)
    assert whole.returncode == 0, whole.stderr
    assert reply in whole.stdout, whole.stdout


def test_without_its_profiles_file_the_error_says_what_is_known_and_where(settings: Settings, tmp_path: Path) -> None:
    script, _ = _step_one()
    env = {k: v for k, v in settings_env(settings).items() if k not in ("SUBQ_PROFILES", "SUBQ_PROFILES_FILE")}
    tools = [line for line in script.splitlines() if line.startswith("subq tools ")]
    refused = _bash("\n".join(tools), tmp_path, env)
    assert refused.returncode != 0
    assert refused.stderr == "subq: Invalid profile: demo (known: offline (built in); SUBQ_PROFILES_FILE is not set)\n"


def test_the_audit_docs_name_every_action_and_refusal_reason() -> None:
    """docs/api.md and docs/security.md list the audit log's actions and the refusals' reasons by hand: each
    value the code records is named where a reader looks for it."""
    from typing import get_args

    from coordinator.audit import Action, RefusalReason

    api = (ROOT / "docs" / "api.md").read_text()
    action_line = re.search(r"- `action`: (.*?);\n- ", api, re.S)
    reason_line = re.search(r"- `reason`, for a refusal: (.*?); `detail`", api, re.S)
    metric_row = re.search(r"\| `subq_refused_requests_total` \|.*\n", api)
    security = (ROOT / "docs" / "security.md").read_text()
    security_line = re.search(r"`subq_refused_requests_total` \((.*?)\), fleet-wide", security, re.S)
    assert action_line and reason_line and metric_row and security_line
    for action in get_args(Action):
        assert f"`{action}`" in action_line.group(1), action
    for reason in get_args(RefusalReason):
        for where in (reason_line.group(1), metric_row.group(0), security_line.group(1)):
            assert f"`{reason}`" in where, (reason, where)


def test_the_cli_docs_ids_are_ids_subq_reads() -> None:
    """An id in docs/cli.md's example commands is one `subq` takes (an approval id with 13 hex digits was not)."""
    from coordinator import ids

    commands = "\n".join(line for line in (ROOT / "docs" / "cli.md").read_text().splitlines() if "$ subq" in line)
    examples = set(re.findall(r"\b[0-9a-f]{16}(?:-[0-9a-z]+)?\b", commands))
    assert examples
    for example in examples:
        assert ids.root_of(example) == example[:16], example
