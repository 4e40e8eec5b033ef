"""Several tool calls in one response, as real models make them: every call answered, and counted as what it was.

A completion called beside other tools is answered "not taken"; the other calls
run, or wait for a human's decision, and the model is asked again with every
result (docs/agents.md, "Several calls in one response"). Each call's outcome
(`ok`, `denied`, `error`) is on its task's `tool_use` and in its UI lines. The
runs go through a real worker process, the decisions through the coordinator.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from coordinator import Coordinator, Profile, RunCommand, Settings, TaskStatus
from coordinator.api import create_app
from coordinator.cli.views import status_lines
from coordinator.local.fleet import settings_env
from coordinator.settings import McpServer, Price, ToolLimit
from coordinator.tree import render_tree
from tests.agents import agent, call, calls, reply
from tests.conftest import dedicated_fleet
from tests.helpers import TOKEN, ApiServer, api_settings, eventually
from tests.mcp_kit import START_S, server
from tests.model_server import ModelServer, Turn
from tests.model_server import call as batched_call
from tests.test_cli import cli


class Batched(NamedTuple):
    coord: Coordinator
    folder: Path  # run_command's working directory
    repo: Path  # the MCP git server's repository
    api: ApiServer  # the HTTP API and web view on the same Redis
    provider: ModelServer  # an OpenAI-compatible server on loopback that batches its calls


# What a real model did (Qwen2.5-Coder on llama.cpp's server): a guarded call and the completion in one
# response; asked again, the completion alone.
PROVIDER_TURNS = [
    Turn(calls=[batched_call("run_command", command="mkdir from-provider"),
                batched_call("attempt_completion", result="committed (claimed before it ran)")]),
    Turn(calls=[batched_call("attempt_completion", result="created from-provider")]),
]  # fmt: skip


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
    provider = ModelServer(PROVIDER_TURNS).start()
    profiles = {
        # run_command guarded by approval_tools (the default), one deny rule.
        "guarded": Profile(run_command=RunCommand(cwd=folder), deny=["run_command:rm"]),
        "tooled": Profile(tools=["tests.tool_kit:add_numbers", "tests.tool_kit:even_only"]),
        "git": Profile(
            mcp_servers=[McpServer(name="git", command=command, args=args, timeout_s=START_S)], approval_tools=[]
        ),
        # One call of `crowd` at a time, fleet-wide: a second waits for the first's slot.
        "limited": Profile(tools=["tests.tool_kit:crowd"], tool_limits={"crowd": ToolLimit(concurrency=1)}),
        # A hosted-style model on an OpenAI-compatible endpoint, run_command guarded as by default.
        "hosted": Profile(
            model="openai:test-model",
            base_url=provider.base_url,
            api_key=provider.key,
            price=Price(input_per_mtok=Decimal(3), output_per_mtok=Decimal(15)),
            run_command=RunCommand(cwd=folder),
        ),
    }
    own = settings.model_copy(update={"profiles": {**settings.profiles, **profiles}})
    os.environ["TOOL_KIT_MARKS"] = str(tmp_path_factory.mktemp("marks"))  # the worker inherits it (crowd's folder)
    try:
        with dedicated_fleet(own, tmp_path_factory.mktemp("batched"), 1, queue="subq-batched") as (coord, _):
            api_coord = Coordinator(api_settings(coord.settings))
            try:
                with ApiServer(create_app(coordinator=api_coord)) as api:
                    yield Batched(coord, folder, repo, api, provider)
            finally:
                api_coord.close()
    finally:
        del os.environ["TOOL_KIT_MARKS"]
        provider.stop()


def _subq(coord: Coordinator, *args: str) -> subprocess.CompletedProcess[str]:
    """The `subq` command, as a user runs it, on the coordinator's Redis: run in this process (tests/test_cli.py's
    `cli`; a process of its own cost each 1.5 s of CPU on 2 cores, and tests/test_cli.py runs `subq` as one)."""
    env = {k: v for k, v in settings_env(coord.settings).items() if k.startswith("SUBQ_")}
    return cli(*args, env=env)


def _waiting_everywhere(batched: Batched, task_id: str) -> dict[str, object]:
    """What each face says the task waits for: the record, `subq status`, `subq tree`, the API, the web view."""
    coord = batched.coord
    with httpx.Client(base_url=batched.api.url, timeout=30) as http:
        api = http.get(f"/v1/tasks/{task_id}", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert http.post("/ui/login", data={"token": TOKEN, "next": "/ui/"}).status_code == 303
        page = http.get(f"/ui/tasks/{task_id}/fragment").text
    status = _subq(coord, "status", task_id)
    tree = _subq(coord, "tree", task_id)
    return {
        "record": coord.get_task(task_id).waiting_for,
        "status": "waiting_for approval" in status.stdout.splitlines()[0],
        "status_lines": "waiting_for approval" in status_lines(coord.get_task(task_id))[0],
        "tree": "waiting_for approval" in tree.stdout.splitlines()[0],
        "drawn": "waiting_for approval" in render_tree(coord.tree(task_id))[0],
        "api": api["waiting_for"],
        "web": 'data-field="waiting_for"' in page and "waiting_for approval" in page,
    }


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
    assert _waiting_everywhere(batched, task_id) == {
        "record": "approval", "status": True, "status_lines": True, "tree": True, "drawn": True, "api": "approval",
        "web": True,
    }  # fmt: skip
    no_result = _subq(coord, "result", task_id)
    assert no_result.returncode == 1 and no_result.stdout == ""
    assert no_result.stderr == f"subq: task {task_id} is active waiting_for approval: no result yet\n"
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
    assert done.waiting_for is None
    result = _subq(coord, "result", task_id)
    assert (result.returncode, result.stdout) == (0, "done after reading the command's result\n"), result.stderr
    record = _subq(coord, "result", task_id, "--json")
    assert json.loads(record.stdout)["summary"] == done.summary and json.loads(record.stdout)["id"] == task_id
    # The web timeline names what held the tree: the longest of its waits (the API's intervals say which).
    waits = [i for i in done.times.intervals if i.state != "running"]
    longest = max(waits, key=lambda i: i.ms)
    with httpx.Client(base_url=batched.api.url, timeout=30) as http:
        assert http.post("/ui/login", data={"token": TOKEN, "next": "/ui/"}).status_code == 303
        page = http.get(f"/ui/tasks/{task_id}/fragment").text
    held = re.search(r'class="tl-held" data-task-id="([^"]+)" data-state="([^"]+)" data-ms="(\d+)"', page)
    assert held, page
    assert held.groups() == (task_id, longest.reason or longest.state, str(longest.ms))
    assert 'class="seg wait-approval held"' in page or longest.reason != "approval"


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
    assert _says(coord, task_id, "tool_denied") == ['run_command({"command": "mkdir denied"}): denied: not on a Friday']
    parts = _parts(coord, task_id)
    denial = next(p for p in parts if p["part_kind"] == "tool-return" and p["tool_name"] == "run_command")
    assert (denial["content"], denial["outcome"]) == ("not on a Friday", "denied")
    last_call = [p for p in parts if p["part_kind"] == "tool-call"][-1]
    assert parts.index(denial) < parts.index(last_call), "the model read the denial before it completed"
    result = _subq(coord, "result", task_id)
    assert (result.returncode, result.stdout) == (0, "done after reading the command's result\n")


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


def test_a_task_waiting_for_a_tools_limit_says_so_while_it_waits(batched: Batched) -> None:
    coord = batched.coord
    steps = (calls(("crowd", {"seconds": 5}), ("crowd", {"seconds": 5})), reply("both ran"))
    task = coord.create_task(agent(*steps), profile="limited", run=True)
    # Written as the wait begins: seen while the first call still runs (nothing counted yet), not after it.
    eventually(
        lambda: (record := coord.get_task(task.id)).waiting_for == "tool_limit" and not record.tool_use,
        "the task waiting for crowd's limit while the first call runs",
        60,
    )
    done = coord.wait(task.id, 60)
    assert (done.status, done.waiting_for) == (TaskStatus.COMPLETED, None)
    assert _outcomes(coord, task.id) == {"crowd": {"ok": 2}}
    assert "tool_limit" in done.times.wait_by_reason_ms


def test_subq_result_of_a_failed_task_is_its_error(batched: Batched) -> None:
    coord = batched.coord
    task = coord.create_task(agent({"fail": "the provider refused the request"}), profile="tooled", run=True)
    assert coord.wait(task.id, 60).status == TaskStatus.FAILED
    result = _subq(coord, "result", task.id)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"subq: task {task.id} failed, no result: ")
    assert "the provider refused the request" in result.stderr and result.stderr.count("\n") == 1


def test_an_unknown_profile_names_the_known_ones_and_where_they_were_read_from(batched: Batched) -> None:
    coord = batched.coord
    refused = _subq(coord, "run", "Total the Q3 sales", "--profile", "demo")
    assert refused.returncode == 1 and refused.stdout == ""
    line = refused.stderr.strip()
    assert line.startswith("subq: Invalid profile: demo (known: ") and "\n" not in line
    # The test's settings give every profile through SUBQ_PROFILES (the built-in offline among them).
    assert f"{', '.join(sorted(coord.settings.all_profiles()))} (SUBQ_PROFILES)" in line
    assert line.endswith("SUBQ_PROFILES_FILE is not set)")


def test_a_provider_that_batches_gets_a_result_for_every_call_of_its_response(batched: Batched) -> None:
    """Over an OpenAI-compatible API: the approval is queued, and the request after it carries a result for
    each call of the batched response (the providers' APIs require one), the completion's saying not taken."""
    coord, folder, provider = batched.coord, batched.folder, batched.provider
    task = coord.create_task("Make the folder from-provider.", profile="hosted", run=True)
    approvals = eventually(lambda: coord.list_approvals(task.root_id) or None, "the call waits for a decision", 60)
    assert [(a.tool, a.args) for a in approvals] == [("run_command", {"command": "mkdir from-provider"})]
    assert coord.get_task(task.id).waiting_for == "approval" and not (folder / "from-provider").exists()
    coord.decide(approvals[0].id, "approve")
    done = coord.wait(task.id, 60)
    assert (done.status, done.summary) == (TaskStatus.COMPLETED, "created from-provider"), done.error
    assert (folder / "from-provider").is_dir() and _says(coord, task.id, "command") == ["mkdir from-provider"]
    assert _outcomes(coord, task.id) == {"run_command": {"ok": 1}}
    answered = [s for s in provider.seen if s.status == 200]
    assert len(answered) == 2, "one request for the batch, one after every call of it was answered"
    results = {m["tool_call_id"]: m["content"] for m in answered[1].body["messages"] if m.get("role") == "tool"}
    assert set(results) == {"call_0_0", "call_0_1"}
    assert results["call_0_0"].startswith("exit 0")
    assert "Not taken: this response also called run_command" in results["call_0_1"]


def test_a_tool_that_asks_the_model_to_call_again_counts_that_call_as_an_error(batched: Batched) -> None:
    coord = batched.coord
    steps = (call("even_only", n=3), call("even_only", n=4), reply("four"))
    task = coord.create_task(agent(*steps), profile="tooled", run=True)
    done = coord.wait(task.id, 60)
    assert (done.status, done.summary) == (TaskStatus.COMPLETED, "four"), done.error
    assert _outcomes(coord, task.id) == {"even_only": {"error": 1, "ok": 1}}
    assert _says(coord, task.id, "tool_error") == ["even_only: 3 is odd: call even_only with an even number"]
