"""Several tool calls in one response, as real models make them: every call answered, and counted as what it was.

A completion called beside other tools is answered "not taken"; the other calls
run, or wait for a human's decision, and the model is asked again with every
result (docs/agents.md, "Several calls in one response"). Each call's outcome
(`ok`, `denied`, `error`) is on its task's `tool_use` and in its UI lines. The
runs go through a real worker process, the decisions through the coordinator.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from coordinator import Coordinator, Profile, RunCommand, Settings, TaskStatus
from coordinator.settings import McpServer
from tests.agents import agent, call, calls, reply
from tests.conftest import dedicated_fleet
from tests.helpers import eventually
from tests.mcp_kit import server


class Batched(NamedTuple):
    coord: Coordinator
    folder: Path  # run_command's working directory
    repo: Path  # the MCP git server's repository


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def batched(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Batched]:
    folder = tmp_path_factory.mktemp("commands")
    repo = tmp_path_factory.mktemp("repo")
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "tests@example.invalid")
    _git(repo, "config", "user.name", "subq tests")
    (repo / "README.md").write_text("hello\n")
    _git(repo, "add", "README.md")
    _git(repo, "commit", "-q", "-m", "first commit")
    command, args = server(tmp_path_factory.mktemp("pids") / "pids", repo)
    profiles = {
        # run_command guarded by approval_tools (the default), one deny rule.
        "guarded": Profile(run_command=RunCommand(cwd=folder), deny=["run_command:rm"]),
        "tooled": Profile(tools=["tests.tool_kit:add_numbers"]),
        "git": Profile(mcp_servers=[McpServer(name="git", command=command, args=args)], approval_tools=[]),
    }
    own = settings.model_copy(update={"profiles": {**settings.profiles, **profiles}})
    with dedicated_fleet(own, tmp_path_factory.mktemp("batched"), 1, queue="subq-batched") as (coord, _):
        yield Batched(coord, folder, repo)


def _says(coord: Coordinator, task_id: str, kind: str) -> list[str]:
    return [m["text"] for m in coord.messages(task_id) if m.get("say") == kind]


def _outcomes(coord: Coordinator, task_id: str) -> dict[str, dict[str, int]]:
    return {tool: dict(use.outcomes) for tool, use in coord.get_task(task_id).tool_use.items()}


def _parts(coord: Coordinator, task_id: str) -> list[dict[str, Any]]:
    """Every part of the conversation, in order, each with the kind of message it is in."""
    messages = [json.loads(m) for m in coord.store.records.conversation(task_id)]
    return [{**part, "in": message["kind"]} for message in messages for part in message.get("parts", [])]


def _batched_run(coord: Coordinator, command: str) -> tuple[str, str]:
    """A task whose first response calls run_command and attempt_completion together; (task id, approval id)."""
    steps = (
        calls(("run_command", {"command": command}), ("attempt_completion", {"result": "claimed before it ran"})),
        call("attempt_completion", result="done after reading the command's result"),
    )
    task = coord.create_task(agent(*steps), profile="guarded", run=True)
    approvals = eventually(lambda: coord.list_approvals(task.root_id) or None, "the call waits for a decision", 60)
    assert [(a.tool, a.args) for a in approvals] == [("run_command", {"command": command})]
    return task.id, approvals[0].id


def test_a_batched_completion_waits_for_an_approved_call_which_runs_once(batched: Batched) -> None:
    coord, folder = batched.coord, batched.folder
    task_id, approval_id = _batched_run(coord, "mkdir approved")
    waiting = coord.get_task(task_id)
    assert not waiting.status.terminal, "the completion did not end the task while a call waited"
    assert not (folder / "approved").exists(), "nothing ran before the decision"
    assert _says(coord, task_id, "completion_not_taken") == ["attempt_completion waits for run_command"]
    coord.decide(approval_id, "approve")
    done = coord.wait(task_id, 60)
    assert done.status == TaskStatus.COMPLETED, done.error
    assert done.summary == "done after reading the command's result", "the completion came after the command"
    assert (folder / "approved").is_dir()
    assert _says(coord, task_id, "command") == ["mkdir approved"], "it ran exactly once"
    assert _outcomes(coord, task_id) == {"run_command": {"ok": 1}}
    parts = _parts(coord, task_id)
    returns = [(p["tool_name"], p["content"]) for p in parts if p["part_kind"] == "tool-return"]
    assert [tool for tool, _ in returns] == ["attempt_completion", "run_command", "attempt_completion"]
    assert returns[0][1].startswith("Not taken: this response also called run_command")
    assert returns[1][1].startswith("exit 0")
    last_call = [p for p in parts if p["part_kind"] == "tool-call"][-1]
    assert (last_call["tool_name"], last_call["args"]["result"]) == ("attempt_completion", done.summary)
    # The model was asked again after the command's result was in the conversation.
    command_result = next(p for p in parts if p.get("tool_name") == "run_command" and p["part_kind"] == "tool-return")
    assert parts.index(command_result) < parts.index(last_call)
    assert coord.get_task(task_id).requests == 2


def test_a_batched_completion_after_a_denied_call_lets_the_model_read_the_denial(batched: Batched) -> None:
    coord, folder = batched.coord, batched.folder
    task_id, approval_id = _batched_run(coord, "mkdir denied")
    coord.decide(approval_id, "deny", feedback="not on a Friday")
    done = coord.wait(task_id, 60)
    assert done.status == TaskStatus.COMPLETED, done.error
    assert done.summary == "done after reading the command's result"
    assert not (folder / "denied").exists(), "a denied call never runs"
    assert _says(coord, task_id, "command") == []
    assert _outcomes(coord, task_id) == {"run_command": {"denied": 1}}
    assert _says(coord, task_id, "tool_denied") == [
        'run_command({"command": "mkdir denied"}): denied by a person: not on a Friday'
    ]
    parts = _parts(coord, task_id)
    denial = next(p for p in parts if p["part_kind"] == "tool-return" and p["tool_name"] == "run_command")
    assert (denial["content"], denial["outcome"]) == ("not on a Friday", "denied")
    last_call = [p for p in parts if p["part_kind"] == "tool-call"][-1]
    assert parts.index(denial) < parts.index(last_call), "the model read the denial before it completed"


def test_a_completion_beside_calls_that_run_at_once_is_asked_again_with_their_results(batched: Batched) -> None:
    coord = batched.coord
    steps = (
        calls(("add_numbers", {"a": 2, "b": 3}), ("attempt_completion", {"result": "early"}), ("add_numbers", {"a": 1, "b": 1})),
        call("attempt_completion", result="5 and 2"),
    )  # fmt: skip
    task = coord.create_task(agent(*steps), profile="tooled", run=True)
    done = coord.wait(task.id, 60)
    assert (done.status, done.summary) == (TaskStatus.COMPLETED, "5 and 2")
    assert _outcomes(coord, task.id) == {"add_numbers": {"ok": 2}}, "the call after the completion ran too"
    results = [p["content"] for p in _parts(coord, task.id) if p["part_kind"] == "tool-return"]
    assert results[:2] == [5, 2] or sorted(r for r in results if isinstance(r, int)) == [2, 5]
    assert done.requests == 2


def test_a_policy_denied_call_counts_as_denied(batched: Batched) -> None:
    coord, folder = batched.coord, batched.folder
    (folder / "keep").write_text("still here")
    task = coord.create_task(agent(call("run_command", command="rm keep"), reply("tried")), profile="guarded", run=True)
    assert coord.wait(task.id, 60).status == TaskStatus.COMPLETED
    assert (folder / "keep").read_text() == "still here"
    assert _outcomes(coord, task.id) == {"run_command": {"denied": 1}}
    (line,) = _says(coord, task.id, "tool_denied")
    assert line.startswith("run_command: Denied by policy: run_command")


def test_calls_that_cannot_run_are_errors_with_their_lines(batched: Batched) -> None:
    """Arguments that fail validation, and a tool the task lacks: error results, `tool_error`/`error` lines,
    counted as `error`; the run goes on."""
    coord = batched.coord
    steps = (
        calls(("add_numbers", {"a": "two", "b": 3}), ("read_file", {"path": "/etc/passwd"})),
        reply("gave up"),
    )
    task = coord.create_task(agent(*steps), profile="tooled", run=True)
    done = coord.wait(task.id, 60)
    assert (done.status, done.summary) == (TaskStatus.COMPLETED, "gave up")
    assert _outcomes(coord, task.id) == {"add_numbers": {"error": 1}, "read_file": {"error": 1}}
    (invalid,) = _says(coord, task.id, "tool_error")
    assert invalid.startswith("add_numbers: invalid arguments: ") and "a" in invalid
    assert [line.split(":")[1].strip() for line in _says(coord, task.id, "error")] == [
        "read_file is not a tool of this task"
    ]
    answered = {p["tool_name"] for p in _parts(coord, task.id) if p.get("tool_call_id") and p["in"] == "request"}
    assert answered == {"add_numbers", "read_file"}, "each call has its answer in the conversation"


def test_a_failed_mcp_call_counts_as_an_error_with_its_line(batched: Batched) -> None:
    coord = batched.coord
    steps = (call("git_show", repo_path=str(batched.repo), revision="no-such-revision"), reply("looked"))
    task = coord.create_task(agent(*steps), profile="git", run=True)
    done = coord.wait(task.id, 120)
    assert done.status == TaskStatus.COMPLETED, done.error
    assert _outcomes(coord, task.id) == {"git_show": {"error": 1}}
    (line,) = _says(coord, task.id, "tool_error")
    assert line.startswith("git_show: Error: ") and "no-such-revision" in line
    (result,) = [p["content"] for p in _parts(coord, task.id) if p["part_kind"] == "tool-return"]
    assert result.startswith("Error: ")
