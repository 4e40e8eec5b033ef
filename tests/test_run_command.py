"""`run_command` runs real commands (workers/runtime/commands.py): argv without a shell, in the
profile's cwd, capped output, a process group killed on a timeout or a cancel, no secrets in
its environment. Every test here starts real processes."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import ApprovalRequired, RunContext
from pydantic_ai.models.test import TestModel
from pydantic_ai.usage import RunUsage

from coordinator import Profile, RunCommand
from tests.helpers import processes_with
from workers.runtime import commands
from workers.runtime.tools import CallAnswered, RunState, run_command

# How long a killed process may take to be gone (it is killed at once; a loaded machine is slow).
GONE_WITHIN_S = 5.0


def _run(command: str, cwd: Path, **config: Any) -> commands.CommandResult:
    return asyncio.run(commands.run(command, RunCommand(cwd=cwd, **config)))


def test_a_command_runs_in_the_profiles_directory_and_reports_its_exit_code(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    assert _run("cat notes.txt", tmp_path).text() == "exit 0\nhello\n"
    assert _run("pwd", tmp_path).output.strip() == str(tmp_path.resolve())
    failed = _run("sh -c 'echo out; echo err >&2; exit 3'", tmp_path)
    assert (failed.exit_code, failed.text()) == (3, "exit 3\nout\nerr\n"), "stderr is in the output"
    assert _run("sh -c 'kill -TERM $$'", tmp_path).text() == "killed by SIGTERM\n"


def test_shell_syntax_is_plain_arguments(tmp_path: Path) -> None:
    assert _run("echo a ; echo b", tmp_path).output == "a ; echo b\n"
    assert _run("echo a && echo b | cat", tmp_path).output == "a && echo b | cat\n"
    assert _run("echo $(whoami) `id` $HOME *", tmp_path).output == "$(whoami) `id` $HOME *\n"
    assert _run("echo x > out.txt", tmp_path).output == "x > out.txt\n"
    assert list(tmp_path.iterdir()) == [], "no redirection: no file was created"
    assert _run("echo 'one word' \"and another\" back\\ slash", tmp_path).output == "one word and another back slash\n"


def test_the_output_is_capped_with_what_was_cut_said(tmp_path: Path) -> None:
    digits = "0123456789" * 10
    capped = _run(f"echo {digits}", tmp_path, max_output_chars=20)
    assert capped.cut == 81
    assert capped.text() == "exit 0\n0123456789\n[... 81 characters cut ...]\n123456789\n"
    assert _run(f"echo {digits}", tmp_path, max_output_chars=101).cut == 0
    # Much more than the cap: drained to the end (the program never blocks on a full pipe).
    flood = _run("sh -c 'yes | head -c 5000000'", tmp_path, max_output_chars=100)
    assert flood.exit_code == 0 and flood.cut == 5_000_000 - 100
    assert flood.output.startswith("y\n" * 25) and flood.output.endswith("y\n" * 25)


def _none_left(argument: str) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while processes_with(argument):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# Each sleep is found on the host by its own length, which no other test starts.
CONFINED = pytest.mark.parametrize("sandbox", [True, False], ids=["sandboxed", "unconfined"])


@CONFINED
def test_a_timeout_kills_the_whole_process_group_quickly(tmp_path: Path, sandbox: bool) -> None:
    started = time.monotonic()
    result = _run("sh -c 'sleep 30.11 & sleep 30.12'", tmp_path, timeout_s=1, sandbox=sandbox)
    assert time.monotonic() - started < 1 + GONE_WITHIN_S
    assert result.exit_code is None and result.timed_out_after_s == 1
    assert result.text().startswith("timed out after 1s (its process group was killed)\n")
    assert _none_left("30.11"), "the background sleep was killed with its group"


@CONFINED
def test_what_a_command_leaves_running_is_stopped_when_it_exits(tmp_path: Path, sandbox: bool) -> None:
    result = _run("sh -c 'sleep 30.21 > /dev/null 2>&1 & echo started'", tmp_path, sandbox=sandbox)
    assert result.text() == "exit 0\nstarted\n"
    assert _none_left("30.21"), "what it left running was killed after it exited"


@CONFINED
def test_a_cancel_kills_the_process_group_and_propagates(tmp_path: Path, sandbox: bool) -> None:
    marker = tmp_path / "started.txt"

    async def cancel_midway() -> None:
        config = RunCommand(cwd=tmp_path, sandbox=sandbox)
        running = asyncio.create_task(commands.run("sh -c 'sleep 30.31 & echo $! > started.txt; wait'", config))
        deadline = time.monotonic() + GONE_WITHIN_S
        while not (marker.exists() and marker.read_text().endswith("\n")):
            assert time.monotonic() < deadline, "the command did not start"
            await asyncio.sleep(0.05)
        assert processes_with("30.31"), "it runs"
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    started = time.monotonic()
    asyncio.run(cancel_midway())
    assert _none_left("30.31")
    assert time.monotonic() - started < 2 * GONE_WITHIN_S


def test_commands_do_not_block_the_event_loop(tmp_path: Path) -> None:
    config = RunCommand(cwd=tmp_path)

    async def three_at_once() -> tuple[list[commands.CommandResult], int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        results = await asyncio.gather(*(commands.run("sleep 1", config) for _ in range(3)))
        ticker.cancel()
        return list(results), ticks

    started = time.monotonic()
    results, ticks = asyncio.run(three_at_once())
    assert time.monotonic() - started < 2.5, "the three ran at the same time"
    assert all(r.text() == "exit 0\n" for r in results)
    assert ticks >= 5, "the loop went on while they ran"


def test_the_environment_has_no_subq_setting_and_no_provider_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUBQ_REDIS_URL", "redis://:secret@redis:6379/0")
    monkeypatch.setenv("SUBQ_PROFILES", '{"x": {"api_key": "sk-secret"}}')
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-secret")
    monkeypatch.setenv("LANG", "C.UTF-8")
    output = _run("env", tmp_path).output
    names = {line.partition("=")[0] for line in output.splitlines()}
    assert not {n for n in names if n.startswith("SUBQ_")}
    assert "OPENAI_API_KEY" not in names and "ANTHROPIC_API_KEY" not in names
    assert "secret" not in output
    assert {"PATH", "HOME", "LANG"} <= names, "the rest is kept"
    assert f"PATH={os.environ['PATH']}" in output.splitlines()


@CONFINED
def test_what_cannot_run_is_a_short_error_result(tmp_path: Path, sandbox: bool) -> None:
    def run(command: str, cwd: Path = tmp_path) -> str:
        return _run(command, cwd, sandbox=sandbox).text()

    assert run("no-such-program-subq --help") == "Error: no-such-program-subq: program not found"
    assert run("X=1 rm -rf x") == "Error: X=1: program not found", "no shell: not an assignment"
    assert run("./missing.sh") == "Error: ./missing.sh: program not found"
    assert run("echo 'unbalanced") == "Error: cannot parse the command: no closing quotation"
    assert run("   ") == "Error: empty command"
    assert run("ls", tmp_path / "missing") == f"Error: the working directory {tmp_path / 'missing'} does not exist"
    (tmp_path / "data.txt").write_text("not a program")
    assert run("./data.txt") == "Error: ./data.txt: permission denied"
    long = _run("echo " + "x" * commands.MAX_COMMAND_CHARS, tmp_path, sandbox=sandbox)
    assert long.text() == f"Error: the command is longer than {commands.MAX_COMMAND_CHARS} characters"


# -- the tool ------------------------------------------------------------------------------


class Said:
    """Stands in for the run (coordinator.runs.Run) where the tool only says UI messages."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str]] = []

    def say(self, kind: str, text: str) -> None:
        self.messages.append((kind, text))


def _call(profile: Profile, command: str) -> tuple[str, list[tuple[str, str]]]:
    said = Said()
    ctx = RunContext(deps=RunState(run=said, profile=profile), model=TestModel(), usage=RunUsage())  # type: ignore[arg-type]
    try:
        text = asyncio.run(run_command(ctx, command))
    except CallAnswered as answered:  # a refusal or a denial: the text the model reads (counted by the toolset)
        text = answered.text
    return text, said.messages


def test_the_tool_refuses_where_the_profile_does_not_enable_it(tmp_path: Path) -> None:
    # No approval is asked (ApprovalRequired would be raised): nothing would run anyway.
    assert _call(Profile(), "ls") == ("Error: run_command is not enabled for this task's profile", [])
    assert _call(Profile(allow=["run_command"]), "ls") == (
        "Error: run_command is not enabled for this task's profile",
        [],
    )


def test_the_tool_runs_what_the_policy_allows_and_says_so(tmp_path: Path) -> None:
    profile = Profile(run_command=RunCommand(cwd=tmp_path), allow=["run_command:=echo hi"], deny=["run_command:rm"])
    assert _call(profile, "echo hi") == ("exit 0\nhi\n", [("command", "echo hi"), ("command_result", "exit 0\nhi\n")])
    denied, said = _call(profile, "rm -rf x")
    assert denied.startswith("Denied by policy: run_command") and said == []
    with pytest.raises(ApprovalRequired):
        _call(profile, "echo hi there")
    assert _call(profile, "echo 'hi") == ("Error: cannot parse the command: no closing quotation", []), "not asked"
