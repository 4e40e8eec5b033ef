"""subq as an MCP server (issue 41): /mcp on the real API over real HTTP, and `subq mcp` over real stdio,
with the official `mcp` client, against a real Redis and real `celery worker` processes.

Each scenario (tools/list, run_task, wait_task with progress, the figures against GET /v1/tasks/{id}, scopes
and ownership, the audit log, an approval decided, bad input) runs through both faces: the tools are one
definition (coordinator/mcp_tools.py), so both must answer alike. Over HTTP each scenario opens its own
sessions; over stdio each API key has one `subq mcp` process for the module, as an agent keeps one for its
whole session, and every scenario calls through it (a start is 3.5 s of CPU: one a key, not one a scenario);
a process found dead before a scenario is started again, so one scenario's failure stays its own.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, ExitStack, asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from coordinator import Coordinator, Settings, ids
from coordinator.access import ApiKeySpec, Scope, token_sha256
from coordinator.api import create_app
from coordinator.api.limits import is_open_route
from coordinator.cli import run_cli
from coordinator.cli.mcp import read_credentials
from coordinator.inputs import MAX_PROMPT_CHARS
from coordinator.local.fleet import WorkerFleet
from tests.agents import call, reply, subtask
from tests.helpers import REQUEST_TIMEOUT_S, ApiServer, api_settings, script

KEYS: dict[str, tuple[str, ...]] = {
    "team": ("submit", "read"),
    "other": ("submit", "read"),
    "viewer": ("read",),
    "oncall": ("decide", "read_all", "operate"),
}
TOKENS = {name: f"mcp-test-token-of-{name}-0123456789" for name in KEYS}
PLAN = "[ ] Collect the sales figures\n[ ] Summarise customer feedback\n[ ] Then write the executive summary"
SUBMIT_READ_TOOLS = {"run_task", "get_task", "wait_task", "get_tree", "cancel_task", "retry_task", "list_approvals"}

Connect = Callable[[str], AbstractAsyncContextManager[Client]]
# The keys whose sessions the stdio face opens (each scenario's names).
STDIO_KEYS = ("team", "oncall", "viewer")


def keys() -> dict[str, ApiKeySpec]:
    return {
        name: ApiKeySpec(token_sha256=token_sha256(TOKENS[name]), scopes=[Scope(s) for s in scopes])
        for name, scopes in KEYS.items()
    }


@pytest.fixture(scope="module")
def stack(settings: Settings, workers: WorkerFleet) -> Iterator[tuple[Coordinator, ApiServer]]:
    coord = Coordinator(api_settings(settings, api_keys=keys()))
    with ApiServer(create_app(coordinator=coord)) as api:
        yield coord, api
    coord.close()


def over_http(api: ApiServer) -> Connect:
    @asynccontextmanager
    async def connect(name: str) -> AsyncIterator[Client]:
        headers = {"Authorization": f"Bearer {TOKENS[name]}"}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60)) as http,
            Client(streamable_http_client(f"{api.url}/mcp", http_client=http)) as client,
        ):
            yield client

    return connect


@pytest.fixture(scope="module")
def portal() -> Iterator[BlockingPortal]:
    """One event loop (in a thread of its own) for the module's scenarios, so a session outlives a scenario."""
    with start_blocking_portal() as loop:
        yield loop


class StdioSessions:
    """A `subq mcp` process and its client session for each of STDIO_KEYS, open for the module.

    `alive()`, before each scenario, asks every session for its tools and opens again one that does not answer: a
    scenario whose failure took its process down fails alone, and the scenarios after it still test what they say.
    """

    def __init__(self, portal: BlockingPortal, api_url: str) -> None:
        self.portal, self.api_url = portal, api_url
        self.opened: dict[str, tuple[ExitStack, Client]] = {}
        for name in STDIO_KEYS:
            self._open(name)

    def _open(self, name: str) -> None:
        env = {"PATH": os.environ["PATH"], "SUBQ_API_URL": self.api_url, "SUBQ_API_TOKEN": TOKENS[name]}
        params = StdioServerParameters(command=sys.executable, args=["-m", "coordinator", "mcp"], env=env)
        session = ExitStack()
        self.opened[name] = session, session.enter_context(self.portal.wrap_async_context_manager(Client(params)))

    def _answers(self, client: Client) -> bool:
        async def ping() -> None:  # a request the server answers (MCP's own ping is deprecated), not the cache
            with anyio.fail_after(REQUEST_TIMEOUT_S):
                await client.list_tools(cache_mode="bypass")

        try:
            self.portal.call(ping)
        except Exception:  # a closed stream, a dead process, a timeout: whatever its transport raises
            return False
        return True

    def alive(self) -> dict[str, Client]:
        for name, (session, client) in list(self.opened.items()):
            if not self._answers(client):
                with suppress(Exception):  # closing what is already gone
                    session.close()
                self._open(name)
        return {name: client for name, (_session, client) in self.opened.items()}

    def close(self) -> None:
        for session, _client in self.opened.values():
            session.close()


@pytest.fixture(scope="module")
def stdio_sessions(portal: BlockingPortal, stack: tuple[Coordinator, ApiServer]) -> Iterator[StdioSessions]:
    _coord, api = stack
    sessions = StdioSessions(portal, api.url)
    yield sessions
    sessions.close()


def over_stdio(sessions: dict[str, Client]) -> Connect:
    @asynccontextmanager
    async def connect(name: str) -> AsyncIterator[Client]:
        yield sessions[name]

    return connect


@pytest.fixture(params=["http", "stdio"])
def face(request: pytest.FixtureRequest, stack: tuple[Coordinator, ApiServer]) -> tuple[str, Connect]:
    _coord, api = stack
    if request.param == "http":
        return request.param, over_http(api)
    return request.param, over_stdio(request.getfixturevalue("stdio_sessions").alive())


def run_in(portal: BlockingPortal, main: Callable[[], Awaitable[Any]]) -> Any:
    """Run a scenario on the module's event loop, where the stdio sessions live."""
    return portal.call(main)


def data(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    value: dict[str, Any] = result.structured_content
    return value


def refusal(result: Any) -> dict[str, Any]:
    assert result.is_error, result.structured_content
    value: dict[str, Any] = result.structured_content
    assert result.content[0].text == value["message"]
    return value


def audit(api: ApiServer) -> list[dict[str, Any]]:
    with api.client() as http:
        entries: list[dict[str, Any]] = http.get("/v1/audit", params={"limit": 50}).json()["entries"]
    return entries


def test_tools_list_follows_the_keys_scopes(face: tuple[str, Connect], portal: BlockingPortal) -> None:
    _name, connect = face

    async def main() -> None:
        async with connect("team") as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            assert names == SUBMIT_READ_TOOLS
            assert "decide_approval" not in names
        async with connect("oncall") as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            assert {"decide_approval", "list_approvals", "get_task", "cancel_task"} <= names
            assert "run_task" not in names
        async with connect("viewer") as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            assert names == {"get_task", "wait_task", "get_tree", "list_approvals"}

    run_in(portal, main)


def test_a_missing_token_is_refused_as_on_v1(stack: tuple[Coordinator, ApiServer]) -> None:
    _coord, api = stack
    response = httpx.post(
        f"{api.url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, timeout=REQUEST_TIMEOUT_S
    )
    assert response.status_code == 401
    assert response.json()["code"] == "unauthorized"
    assert response.headers["www-authenticate"] == "Bearer"
    # Not an open route: an agent's calls are not counted against SUBQ_API_OPEN_REQUESTS_PER_MIN with the probes'.
    assert not is_open_route("/mcp")


def test_run_wait_and_read_a_plan(
    face: tuple[str, Connect], portal: BlockingPortal, stack: tuple[Coordinator, ApiServer]
) -> None:
    name, connect = face
    _coord, api = stack

    async def main() -> None:
        async with connect("team") as client:
            run = data(await client.call_tool("run_task", {"prompt": "Prepare the Q3 report", "todos": PLAN}))
            # It answers as the tree starts, not when it ends: the record it gives has not ended (a wall-clock
            # bound here read 2.13 s on a loaded CI host, whose stdio server process was late, not subq).
            assert run["status"] in {"active", "queued", "running"} and run["id"] == run["root_id"]
            assert run["link"] == f"{api.url}/ui/tasks/{run['id']}"

            told: list[tuple[float, float | None, str | None]] = []

            async def progress(done: float, total: float | None, message: str | None) -> None:
                told.append((done, total, message))

            done = data(
                await client.call_tool("wait_task", {"task_id": run["id"], "timeout_s": 60}, progress_callback=progress)
            )
            assert done["status"] == "completed" and done["settled"], done
            assert told, "no progress notification"

            with api.client({"Authorization": f"Bearer {TOKENS['team']}"}) as http:
                record = http.get(f"/v1/tasks/{run['id']}").json()
            assert record["owner"] == "team"
            for field, theirs in (
                ("result", "summary"), ("output", "output"), ("tokens", None), ("cost_micros", "cost_micros"),
                ("total_tokens", "total_tokens"), ("total_cost_micros", "total_cost_micros"),
            ):  # fmt: skip
                expected = record["tokens_in"] + record["tokens_out"] if theirs is None else record[theirs]
                assert done[field] == expected, field
            assert data(await client.call_tool("get_task", {"task_id": run["id"]})) == done

            tree = data(await client.call_tool("get_tree", {"task_id": run["id"]}))
            assert [item["content"] for item in tree["todos"]] == PLAN.replace("[ ] ", "").splitlines()
            assert all(item["subtask_id"] and item["tokens"] > 0 and item["cost_micros"] > 0 for item in tree["todos"])
            assert tree["metadata"] == {} and tree["total_cost_micros"] == record["total_cost_micros"]

            conversation = await client.read_resource(f"subq://tasks/{run['id']}/conversation")
            assert '"ui_messages"' in conversation.contents[0].text
            exported = await client.read_resource(f"subq://tasks/{run['id']}/export")
            assert exported.contents[0].text.count('"history_item"') == 1 + len(tree["children"])

    run_in(portal, main)
    del name


def test_scopes_and_ownership_on_the_audit_log(
    face: tuple[str, Connect], portal: BlockingPortal, stack: tuple[Coordinator, ApiServer]
) -> None:
    name, connect = face
    coord, api = stack
    theirs = coord.create_task("Another team's tree", owner="other").id

    async def main() -> None:
        async with connect("viewer") as client:
            refused = refusal(await client.call_tool("run_task", {"prompt": "Not mine to start"}))
            assert refused["code"] == "forbidden"
            assert refused["message"] == "The API key 'viewer' lacks the scope this needs: needs scope 'submit'"
        async with connect("team") as client:
            for tool in ("get_task", "get_tree", "wait_task"):
                missing = refusal(await client.call_tool(tool, {"task_id": theirs}))
                assert missing == {"code": "not_found", "message": f"Unknown task: {theirs}", "field": "task_id"}
            with pytest.raises(MCPError, match=f"Unknown task: {theirs}"):
                await client.read_resource(f"subq://tasks/{theirs}/tree")

    run_in(portal, main)
    entries = audit(api)
    scope_refusals = [e for e in entries if e["actor"] == "viewer" and e["reason"] == "missing_scope"]
    assert scope_refusals and "needs scope 'submit'" in scope_refusals[0]["detail"]
    if name == "http":  # the in-process face names the tool; over stdio the API logs the route it mirrors
        assert scope_refusals[0]["target"] == "POST /mcp/run_task"
        hidden = [e for e in entries if e["actor"] == "team" and e["reason"] == "not_found"]
        assert hidden and hidden[0]["target"].startswith("POST /mcp/") and theirs in hidden[0]["detail"]
    else:
        assert scope_refusals[0]["target"] == "POST /v1/tasks"
        hidden = [e for e in entries if e["actor"] == "team" and e["reason"] == "not_found"]
        assert hidden and hidden[0]["target"].startswith("GET /v1/tasks/") and theirs in hidden[0]["detail"]


def test_bad_input_gets_the_apis_words_and_writes_nothing(
    face: tuple[str, Connect], portal: BlockingPortal, stack: tuple[Coordinator, ApiServer]
) -> None:
    _name, connect = face
    coord, api = stack
    bad_schema = {"type": "object", "properties": {"total": {"type": "integr"}}}
    cases = [
        {"prompt": "A typo", "promt": "x"},
        {"prompt": "x" * (MAX_PROMPT_CHARS + 1)},
        {"prompt": "A bad schema", "output_schema": bad_schema},
    ]
    before = coord.list_tasks(limit=1)[0]

    async def main() -> None:
        async with connect("team") as client:
            for args in cases:
                refused = refusal(await client.call_tool("run_task", args))
                with api.client({"Authorization": f"Bearer {TOKENS['team']}"}) as http:
                    response = http.post("/v1/tasks", json={**args, "run": True})
                assert response.status_code == 422
                assert refused == response.json(), args

    run_in(portal, main)
    assert coord.list_tasks(limit=1)[0] == before


def test_list_approvals_refuses_a_child_id_as_the_api_does(
    face: tuple[str, Connect], portal: BlockingPortal, stack: tuple[Coordinator, ApiServer]
) -> None:
    """A child id matched no root and answered "nothing waits", while the child's call waited for a person."""
    _name, connect = face
    _coord, api = stack
    child_id = f"{ids.new_root_id()}-{'0' * 12}"

    async def main() -> None:
        async with connect("team") as client:
            refused = refusal(await client.call_tool("list_approvals", {"root_id": child_id}))
        with api.client({"Authorization": f"Bearer {TOKENS['team']}"}) as http:
            response = http.get("/v1/approvals", params={"root_id": child_id})
        assert response.status_code == 422
        assert refused["code"] == response.json()["code"] and refused["field"] == "root_id", refused

    run_in(portal, main)


def test_an_approval_waits_and_is_decided(
    face: tuple[str, Connect], portal: BlockingPortal, stack: tuple[Coordinator, ApiServer]
) -> None:
    _name, connect = face
    child = subtask("Clean the build", call("run_command", command="echo cleaned"), reply("Cleaned."))
    prompt = script(call("new_task", **child), call("attempt_completion", result="Build cleaned"), text="Clean up.")

    async def main() -> None:
        async with connect("team") as client:
            root = data(await client.call_tool("run_task", {"prompt": prompt}))["id"]
            child_id, mine = "", list[dict[str, Any]]()
            deadline = time.monotonic() + 30
            while not mine:
                assert time.monotonic() < deadline, "the child never waited for approval"
                children = data(await client.call_tool("get_tree", {"task_id": root}))["children"]
                child_id = children[0]["id"] if children else ""
                waiting_for = (
                    child_id and data(await client.call_tool("get_task", {"task_id": child_id}))["waiting_for"]
                )
                if waiting_for == "approval":  # its wait is marked a moment before its approval is saved
                    mine = data(await client.call_tool("list_approvals", {"root_id": root}))["approvals"]
                await anyio.sleep(0.2)
            assert [a["task_id"] for a in mine] == [child_id]
            refused = refusal(
                await client.call_tool("decide_approval", {"approval_id": mine[0]["id"], "decision": "approve"})
            )
            assert "needs scope 'decide'" in refused["message"]
        async with connect("oncall") as client:
            decided = data(
                await client.call_tool("decide_approval", {"approval_id": mine[0]["id"], "decision": "approve"})
            )
            assert decided["status"] == "approved" and decided["decided_by"] == "oncall"
        async with connect("team") as client:
            done = data(await client.call_tool("wait_task", {"task_id": root, "timeout_s": 60}))
            assert done["status"] == "completed", done
            assert data(await client.call_tool("get_task", {"task_id": child_id}))["status"] == "completed"

    run_in(portal, main)


def test_subq_mcp_needs_an_api(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Without SUBQ_API_URL or --credentials, one line naming both; a credentials file gives the API's two values."""
    assert run_cli(["mcp"]) == 1
    said = capsys.readouterr().err.strip()
    assert said.count("\n") == 0 and "SUBQ_API_URL" in said and "--credentials" in said, said

    file = tmp_path / "credentials.env"
    file.write_text(
        "# The credentials of the stack `subq up` started\n"
        "export SUBQ_REDIS_URL='redis://:secret@127.0.0.1:6379/0'\n"
        f"export SUBQ_API_URL={shlex.quote('http://127.0.0.1:8000')}\n"
        f"export SUBQ_API_TOKEN={shlex.quote('a token; with $ and spaces')}\n"
        "subq_flower_password='not this'\n"
    )
    assert read_credentials(file) == {
        "SUBQ_API_URL": "http://127.0.0.1:8000",
        "SUBQ_API_TOKEN": "a token; with $ and spaces",
    }
    assert run_cli(["mcp", "--credentials", str(tmp_path / "missing.env")]) == 1
    assert "cannot read it" in capsys.readouterr().err
    # A quote left open, or bytes that are not text: one line, not a traceback.
    for name, content, words in (
        ("open-quote.env", b"# ok\nexport SUBQ_API_URL='http://127.0.0.1:8000\n", "line 2: No closing quotation"),
        ("binary.env", b"\xff\xfe\x00export", "not UTF-8 text"),
    ):
        bad = tmp_path / name
        bad.write_bytes(content)
        assert run_cli(["mcp", "--credentials", str(bad)]) == 1
        said = capsys.readouterr().err
        assert said == f"subq: --credentials {bad}: {words}\n", said


def test_cancel_and_retry_answer_as_the_api(stack: tuple[Coordinator, ApiServer]) -> None:
    _coord, api = stack
    connect = over_http(api)
    waits = script(call("run_command", command="echo waiting"), reply("Ran."), text="Wait for a person.")

    async def main() -> None:
        async with connect("team") as client:
            root = data(await client.call_tool("run_task", {"prompt": waits}))["id"]
            blank = refusal(await client.call_tool("cancel_task", {"task_id": root, "reason": " "}))
            assert blank == {"code": "invalid_input", "message": "reason must be a non-empty string", "field": "reason"}
            cancelled = data(await client.call_tool("cancel_task", {"task_id": root, "reason": "Not needed"}))
            assert cancelled["status"] == "cancelled" and cancelled["settled"]
            refused = refusal(await client.call_tool("retry_task", {"task_id": root}))
            with api.client({"Authorization": f"Bearer {TOKENS['team']}"}) as http:
                response = http.post(f"/v1/tasks/{root}/retry", json={})
            assert response.status_code == 409 and refused == response.json()
        async with connect("other") as client:
            hidden = refusal(await client.call_tool("cancel_task", {"task_id": root, "reason": "Not mine"}))
            assert hidden["message"] == f"Unknown task: {root}"

    anyio.run(main)


def test_an_idempotency_key_and_metadata_as_through_v1(stack: tuple[Coordinator, ApiServer]) -> None:
    coord, api = stack
    connect = over_http(api)
    key = f"mcp-{time.monotonic_ns()}"
    args = {
        "prompt": "Write a haiku about queues",
        "idempotency_key": key,
        "metadata": {"ticket": "T-41"},
        "priority": 5,
    }

    async def main() -> None:
        async with connect("team") as client:
            first = data(await client.call_tool("run_task", args))
            again = data(await client.call_tool("run_task", {**args, "prompt": "Something else"}))
            assert again["id"] == first["id"] and first["metadata"] == {"ticket": "T-41"}
        async with connect("other") as client:  # idempotency keys are per API key: another key's is its own tree
            assert data(await client.call_tool("run_task", args))["id"] != first["id"]
        done = coord.wait(first["id"], 60)
        assert done.metadata == {"ticket": "T-41"}
        assert (done.tenant, done.priority) == ("team", 5), "the key's tenant, as through /v1 (issue 42)"

    anyio.run(main)


def test_webhooks_are_passed_on_as_through_v1(
    face: tuple[str, Connect], portal: BlockingPortal, stack: tuple[Coordinator, ApiServer]
) -> None:
    """run_task takes POST /v1/tasks' webhooks and on_complete (issue 40) and hands them to the service as they are."""
    _name, connect = face
    coord, api = stack
    private = {"prompt": "Tell the intranet", "webhooks": [{"url": "http://10.0.0.7/hook"}]}

    async def main() -> str:
        async with connect("team") as client:
            refused = refusal(await client.call_tool("run_task", private))
            with api.client({"Authorization": f"Bearer {TOKENS['team']}"}) as http:
                response = http.post("/v1/tasks", json={**private, "run": True})
            assert response.status_code == 422 and refused == response.json()
            called = await client.call_tool("run_task", {"prompt": "Call back", "on_complete": "billing.task_done"})
            return str(data(called)["id"])

    root = run_in(portal, main)
    coord.wait(root, 60)
    deadline = time.monotonic() + 20
    with api.client({"Authorization": f"Bearer {TOKENS['team']}"}) as http:
        while not (deliveries := http.get(f"/v1/tasks/{root}/deliveries").json()["deliveries"]):
            assert time.monotonic() < deadline, "the tree's end was never handed to its on_complete"
            time.sleep(0.2)
    assert deliveries, deliveries
