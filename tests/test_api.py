"""The HTTP API against a real uvicorn server on 127.0.0.1, real Redis and the real worker fleet.

Two servers: `idle` publishes to a queue no worker consumes and keeps its keys
under a prefix of its own, so every refusal can be checked to have changed
nothing (no key, no published message); `live` is served by the session's
worker processes, for the runs that must really happen.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import httpx2
import pytest
import redis
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from coordinator import ConfigError, Coordinator, Settings, StoreError, TaskRecord, Usage, ValidationError
from coordinator.api import create_app
from coordinator.api import events as api_events
from coordinator.api import ops as api_ops
from coordinator.api.ops import HEALTH_CACHE_TTL_S, SubqCollector
from coordinator.celery_app import make_app
from coordinator.cli.views import follow_run
from coordinator.client import SubqClient
from coordinator.local.embedded_redis import local_redis
from coordinator.local.ports import free_port
from coordinator.models import FINISHING_AMONG_MAX, Spend, finishing_if_known, format_usd
from coordinator.ports.steps import Ended
from coordinator.runs import Run
from tests.agents import STEP_COST_MICROS, STEP_TOKENS, tree_root
from tests.conftest import WORKER_PROCESSES
from tests.helpers import REQUEST_TIMEOUT_S, TOKEN, ApiServer, api_settings, eventually, script, state, usage_step
from tests.test_bad_input import NO_TREE
from workers.runtime.context import build_runtime

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
ONE_STEP_TOKENS = 13_500
ONE_STEP_COST_MICROS = 21_000
WAIT_S = 90


def closed_port() -> int:
    """A loopback port nothing listens on: connections to it are refused at once."""
    return free_port()


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def idle(settings: Settings) -> Iterator[Coordinator]:
    """A coordinator whose messages nobody consumes, with keys of its own (exact 'nothing changed' checks)."""
    coord = Coordinator(api_settings(settings, key_prefix="subqapi", queue="subq-api-idle"))
    coord.client.delete("subq-api-idle")
    yield coord
    coord.client.delete("subq-api-idle")
    for key in coord.client.scan_iter("subqapi:*"):
        coord.client.delete(key)
    coord.close()


@pytest.fixture(scope="module")
def idle_api(idle: Coordinator) -> Iterator[ApiServer]:
    with ApiServer(create_app(coordinator=idle)) as server:
        yield server


# Clients are shared per module: building one (its TLS context) costs a few hundred ms.
@pytest.fixture(scope="module")
def idle_http(idle_api: ApiServer) -> Iterator[httpx.Client]:
    with idle_api.client() as http:
        yield http


@pytest.fixture(scope="module")
def anon_http(idle_api: ApiServer) -> Iterator[httpx.Client]:
    """No Authorization header at all."""
    with idle_api.client(headers={}) as http:
        yield http


@pytest.fixture
def parent(idle: Coordinator) -> TaskRecord:
    return idle.create_task("A parent", todos="[ ] one\n[ ] two")


def spec(n: int = 0, **extra: Any) -> dict[str, Any]:
    return {"description": f"child {n}", "message": script(usage_step(f"child {n} done")), **extra}


def wait_settled(http: httpx.Client, task_id: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
    """Poll GET /v1/tasks/{id} until it settles (terminal, or a caller-owned task no longer delegated)."""
    deadline = time.monotonic() + timeout_s
    while True:
        record: dict[str, Any] = http.get(f"/v1/tasks/{task_id}").json()
        terminal = record["status"] in ("completed", "failed", "cancelled")
        if terminal or (record["runner"] == "caller" and record["status"] != "delegated"):
            return record
        assert time.monotonic() < deadline, f"task {task_id} still {record['status']}"
        time.sleep(0.1)


def iter_sse(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The events of a server-sent event stream as they arrive: {id, event, data}."""
    current: dict[str, Any] = {"id": None, "event": "message", "data": []}
    for line in response.iter_lines():
        if line.startswith(":"):
            continue
        if not line:
            if current["data"]:
                yield {**current, "data": json.loads("\n".join(current["data"]))}
            current = {"id": None, "event": "message", "data": []}
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            current["data"].append(value)
        else:
            current[name] = value


def read_sse(response: httpx.Response) -> list[dict[str, Any]]:
    """Every event until the server ends the stream."""
    return list(iter_sse(response))


def _roots_in(path: str) -> list[str]:
    """The root ids in a request path (with none, only the root and approval indexes are compared)."""
    return sorted(set(re.findall(r"(?<![0-9a-f])([0-9a-f]{16})(?![0-9a-f])", path))) or [NO_TREE]


def assert_refused(
    coord: Coordinator,
    http: httpx.Client,
    method: str,
    path: str,
    status: int,
    code: str,
    field: str | None,
    message: str = "",
    **request: Any,
) -> httpx.Response:
    # The live coordinator shares its Redis with other tests' trees, which may still be
    # settling: compare only the trees this request could touch (the ids in its path).
    before = state(coord, *_roots_in(path))
    response = http.request(method, path, **request)
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"code", "message", "field"}
    assert (body["code"], body["field"]) == (code, field), body
    assert message in body["message"]
    assert "Traceback" not in response.text
    assert state(coord, *_roots_in(path)) == before, "a refused request changed Redis or published a message"
    return response


# -- happy paths ---------------------------------------------------------------------------


def test_create_task_returns_the_record_and_it_reads_back(idle: Coordinator, idle_http: httpx.Client) -> None:
    response = idle_http.post("/v1/tasks", json={"prompt": "Prepare the report", "todos": "[ ] Collect\n[-] Write"})
    assert response.status_code == 201
    created = TaskRecord.model_validate(response.json())
    assert (created.status, created.runner, created.prompt, created.profile) == (
        "active",
        "caller",
        "Prepare the report",
        "offline",
    )
    record = response.json()
    assert record.pop("ignored_todo_lines") == []  # every line of the plan was an item
    assert idle_http.get(f"/v1/tasks/{created.id}").json() == record
    assert idle.get_task(created.id) == created
    todos = idle_http.get(f"/v1/tasks/{created.id}/todos").json()
    assert todos["task_id"] == created.id
    assert [(t["content"], t["status"]) for t in todos["todos"]] == [("Collect", "pending"), ("Write", "in_progress")]


def test_create_with_json_todos_and_a_profile(idle_http: httpx.Client) -> None:
    body = {"prompt": "x", "todos": [{"content": "a"}, {"content": "b", "status": "completed"}], "profile": "offline"}
    created = idle_http.post("/v1/tasks", json=body).json()
    todos = idle_http.get(f"/v1/tasks/{created['id']}/todos").json()["todos"]
    assert [(t["content"], t["status"]) for t in todos] == [("a", "pending"), ("b", "completed")]


def test_run_true_publishes_the_agent_run(idle: Coordinator, idle_http: httpx.Client) -> None:
    queued = idle.client.llen("subq-api-idle")
    created = idle_http.post("/v1/tasks", json={"prompt": "an agent", "run": True}).json()
    assert created["runner"] == "agent"
    assert idle.client.llen("subq-api-idle") == queued + 1


def test_concurrent_requests_each_get_their_own_task(idle: Coordinator, idle_api: ApiServer) -> None:
    """Handlers run in a thread pool over one Coordinator: parallel creates and publishes must not mix."""
    queued = idle.client.llen("subq-api-idle")
    count = 16

    def create(n: int) -> dict[str, Any]:
        with idle_api.client() as http:
            response = http.post("/v1/tasks", json={"prompt": f"agent {n}", "run": True})
            assert response.status_code == 201, response.text
            return response.json()  # type: ignore[no-any-return]

    with ThreadPoolExecutor(count) as pool:
        created = list(pool.map(create, range(count)))
    assert sorted(c["prompt"] for c in created) == sorted(f"agent {n}" for n in range(count))
    assert len({c["id"] for c in created}) == count
    assert idle.client.llen("subq-api-idle") == queued + count


def test_put_todos_replaces_the_list_in_either_form(idle_http: httpx.Client, parent: TaskRecord) -> None:
    response = idle_http.put(f"/v1/tasks/{parent.id}/todos", json={"todos": "[x] one\n[ ] two\n[ ] three"})
    assert response.status_code == 200
    first = response.json()["todos"]
    assert [(t["content"], t["status"]) for t in first] == [
        ("one", "completed"),
        ("two", "pending"),
        ("three", "pending"),
    ]
    json_form = [{"content": "two", "status": "in_progress"}, {"content": "four"}]
    second = idle_http.put(f"/v1/tasks/{parent.id}/todos", json={"todos": json_form}).json()["todos"]
    assert [(t["content"], t["status"]) for t in second] == [("two", "in_progress"), ("four", "pending")]
    assert second[0]["id"] == first[1]["id"], "an item keeps its id across a status change"
    assert idle_http.get(f"/v1/tasks/{parent.id}/todos").json()["todos"] == second


def test_delegate_commits_and_publishes(idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord) -> None:
    queued = idle.client.llen("subq-api-idle")
    items = idle.get_todos(parent.id)
    body = {"mode": "parallel", "subtasks": [spec(0, todo_id=items[1].id), spec(1), spec(2)]}
    response = idle_http.post(f"/v1/tasks/{parent.id}/subtasks", json=body)
    assert response.status_code == 202
    result = response.json()
    assert set(result) == {"batch_id", "parent_id", "mode", "child_ids"}
    assert (result["parent_id"], result["mode"], len(result["child_ids"])) == (parent.id, "parallel", 3)
    assert idle.get_batch(result["batch_id"]).child_ids == result["child_ids"]
    assert idle.get_task(parent.id).status == "delegated"
    assert idle.get_todos(parent.id)[1].subtask_id == result["child_ids"][0], "the explicit todo_id won"
    assert idle.client.llen("subq-api-idle") > queued


def test_mode_defaults_to_parallel_and_takes_sequential(
    idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord
) -> None:
    result = idle_http.post(f"/v1/tasks/{parent.id}/subtasks", json={"subtasks": [spec()]}).json()
    assert result["mode"] == "parallel"
    other = idle.create_task("seq parent")
    result = idle_http.post(
        f"/v1/tasks/{other.id}/subtasks", json={"mode": "sequential", "subtasks": [spec(), spec(1)]}
    ).json()
    assert result["mode"] == "sequential"
    assert idle.get_batch(result["batch_id"]).mode == "sequential"


def test_tree_and_history(idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord) -> None:
    batch = idle.delegate(parent.id, [spec(n) for n in range(3)])
    tree = idle_http.get(f"/v1/tasks/{parent.id}/tree").json()
    assert (tree["id"], tree["status"], tree["depth"]) == (parent.id, "delegated", 0)
    assert [c["id"] for c in tree["children"]] == batch.child_ids
    assert [t["subtask_id"] for t in tree["todos"][:2]] == batch.child_ids[:2]
    assert all(c["children"] == [] and c["depth"] == 1 for c in tree["children"])

    whole = idle_http.get("/v1/tasks", params={"root_id": parent.id}).json()
    ids = [i["id"] for i in whole["items"]]
    assert sorted(ids) == sorted([parent.id, *batch.child_ids]) and ids[-1] == parent.id, "newest first"
    assert whole["next_cursor"] is None
    pages: list[str] = []
    cursor: int | None = 0
    while cursor is not None:
        page = idle_http.get("/v1/tasks", params={"root_id": parent.id, "limit": 3, "cursor": cursor}).json()
        assert len(page["items"]) <= 3
        pages += [i["id"] for i in page["items"]]
        cursor = page["next_cursor"]
    assert pages == ids
    delegated = idle_http.get("/v1/tasks", params={"root_id": parent.id, "status": "delegated"}).json()
    assert [i["id"] for i in delegated["items"]] == [parent.id]
    assert delegated["items"][0]["child_ids"] == batch.child_ids
    newest = idle_http.get("/v1/tasks", params={"limit": 1}).json()
    assert len(newest["items"]) == 1 and newest["next_cursor"] == 1


def test_messages_of_a_task(idle_http: httpx.Client, parent: TaskRecord) -> None:
    for kind in ("ui", "api"):
        body = idle_http.get(f"/v1/tasks/{parent.id}/messages", params={"kind": kind}).json()
        assert body == {"task_id": parent.id, "kind": kind, "messages": []}


def test_end_to_end_three_offline_children_write_back_their_figures(live: Coordinator, live_http: httpx.Client) -> None:
    created = live_http.post(
        "/v1/tasks", json={"prompt": "Plan and delegate", "todos": "[ ] T1\n[ ] T2\n[ ] T3\n[ ] T4"}
    )
    parent_id = created.json()["id"]
    items = live_http.get(f"/v1/tasks/{parent_id}/todos").json()["todos"]
    body = {"mode": "parallel", "subtasks": [spec(n, todo_id=items[n]["id"]) for n in range(3)]}
    batch = live_http.post(f"/v1/tasks/{parent_id}/subtasks", json=body).json()

    done = wait_settled(live_http, parent_id)

    assert done["status"] == "active"
    todos = live_http.get(f"/v1/tasks/{parent_id}/todos").json()["todos"]
    for n in range(3):
        assert todos[n]["subtask_id"] == batch["child_ids"][n]
        assert (todos[n]["tokens"], todos[n]["cost_micros"]) == (ONE_STEP_TOKENS, ONE_STEP_COST_MICROS)
        assert todos[n]["status"] == "completed"
    assert todos[3]["subtask_id"] is None
    assert (done["total_tokens"], done["total_cost_micros"]) == (3 * ONE_STEP_TOKENS, 3 * ONE_STEP_COST_MICROS)
    assert (done["tokens_in"], done["cost_micros"]) == (0, 0), "the caller-owned parent spent nothing itself"
    ui = live_http.get(f"/v1/tasks/{parent_id}/messages").json()["messages"]
    assert [m["say"] for m in ui if m.get("say") == "subtask_result"] == ["subtask_result"]
    child = live_http.get(f"/v1/tasks/{batch['child_ids'][0]}/messages", params={"kind": "api"}).json()["messages"]
    assert child and child[0]["kind"] == "request"
    history = live_http.get("/v1/tasks", params={"root_id": parent_id, "status": "completed"}).json()["items"]
    assert {i["id"] for i in history} == set(batch["child_ids"])
    assert all(i["total_cost_micros"] == ONE_STEP_COST_MICROS for i in history)


def test_an_agent_run_seen_through_the_tree(live_http: httpx.Client) -> None:
    root_id = live_http.post("/v1/tasks", json={"prompt": tree_root(), "run": True}).json()["id"]
    with live_http.stream("GET", f"/v1/tasks/{root_id}/events", timeout=WAIT_S) as response:
        events = read_sse(response)  # the stream ends when the agent has ended
    assert events[-1] == {"id": None, "event": "end", "data": {"task_id": root_id, "status": "completed"}}

    tree = live_http.get(f"/v1/tasks/{root_id}/tree").json()
    assert (tree["status"], tree["summary"]) == ("completed", "Report ready")
    assert [t["content"] for t in tree["todos"]] == ["A", "B", "C"]
    assert all(t["status"] == "completed" for t in tree["todos"])
    a, b, c = tree["children"]
    assert [t["subtask_id"] for t in tree["todos"]] == [a["id"], b["id"], c["id"]]
    assert [g["description"] for g in b["children"]] == ["B1", "B2"]
    assert all(g["depth"] == 2 and g["status"] == "completed" for g in b["children"])
    assert (tree["todos"][1]["tokens"], tree["todos"][1]["cost_micros"]) == (5 * STEP_TOKENS, 5 * STEP_COST_MICROS)
    assert (tree["cost_micros"], tree["total_cost_micros"]) == (4 * STEP_COST_MICROS, 11 * STEP_COST_MICROS)
    assert tree["total_tokens"] == 11 * STEP_TOKENS
    statuses = [e["data"] for e in events if e["data"].get("type") == "task_status"]
    assert {"task_id": root_id, "status": "completed", "type": "task_status"} in statuses


# -- events (SSE) --------------------------------------------------------------------------


def test_events_of_a_delegation_end_when_the_parent_settles(live: Coordinator, live_http: httpx.Client) -> None:
    parent = live.create_task("Delegate two", todos="[ ] a\n[ ] b")
    slow = {"description": "slow", "message": script({**usage_step("slow done"), "latency_ms": 1500})}
    batch = live.delegate(parent.id, [spec(0), slow])
    events: list[dict[str, Any]] = []
    with live_http.stream("GET", f"/v1/tasks/{parent.id}/events", timeout=WAIT_S) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        # (Whether the first event comes while the children run is the host's timing: the stream replays the
        # tree's history from its start either way, and ends only after `batch_done`, checked below.)
        events.extend(iter_sse(response))

    entries, end = events[:-1], events[-1]
    assert end["event"] == "end" and end["data"] == {"task_id": parent.id, "status": "active"}
    assert all(e["event"] == "message" and e["id"] for e in entries)
    ids = [tuple(map(int, e["id"].split("-"))) for e in entries]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    types = [e["data"]["type"] for e in entries]
    assert types[0] == "delegated" and entries[0]["data"]["batch_id"] == batch.id
    applied = [e["data"]["child_id"] for e in entries if e["data"]["type"] == "child_applied"]
    assert sorted(applied) == sorted(batch.child_ids)
    assert types.index("batch_done") > max(i for i, t in enumerate(types) if t == "child_applied")

    # Resuming after the first event replays the rest, and ends again at once.
    resume = {"Last-Event-ID": entries[0]["id"]}
    with live_http.stream("GET", f"/v1/tasks/{parent.id}/events", headers=resume) as response:
        again = read_sse(response)
    assert [e["id"] for e in again[:-1]] == [e["id"] for e in entries[1:]]
    assert again[-1]["event"] == "end"


def test_events_of_a_settled_caller_task_end_at_once(idle: Coordinator, idle_http: httpx.Client) -> None:
    task = idle.create_task("nothing delegated")
    started = time.monotonic()
    with idle_http.stream("GET", f"/v1/tasks/{task.id}/events") as response:
        events = read_sse(response)
    assert events == [{"id": None, "event": "end", "data": {"task_id": task.id, "status": "active"}}]
    assert time.monotonic() - started < 5


def _noting_caller(method: Callable[..., T], callers: set[str], calls: list[str] | None = None) -> Callable[..., T]:
    """`method`, noting in `callers` the subq module that called it (`api.routes` for coordinator.api.routes), past
    `models.finishing_if_known`, the lookup the polling waiters share; and each call's first argument in `calls`."""

    def noted(*args: Any, **kwargs: Any) -> T:
        frame = sys._getframe(1)
        while frame.f_code is finishing_if_known.__code__ and frame.f_back is not None:
            frame = frame.f_back
        callers.add(frame.f_globals["__name__"].removeprefix("coordinator."))
        if calls is not None:
            calls.append(args[0])
        return method(*args, **kwargs)

    return noted


def test_a_stopped_trees_events_end_once_its_runs_spend_is_recorded(
    idle: Coordinator,
    idle_api: ApiServer,
    parent: TaskRecord,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop lands while a child's run holds a response its provider billed. Every waiter holds its answer
    until the run records it after the stop (late spend), so the figures it gives are final: the stream's `end`,
    `Coordinator.wait`, the HTTP clients' `wait` (GET .../finishing), MCP's `wait_task` over /mcp and the last
    draw of `subq run --follow`."""
    (child_id,) = idle.delegate(parent.id, [spec()]).child_ids
    runtime = build_runtime(idle.settings, make_app(idle.settings))
    try:
        run = runtime.lifecycle.start(child_id)
        assert isinstance(run, Run), run
        idle.cancel(parent.id, "stopped")
        events: list[dict[str, Any]] = []

        def follow() -> None:
            with idle_api.client() as http, http.stream("GET", f"/v1/tasks/{parent.id}/events", timeout=WAIT_S) as r:
                events.extend(read_sse(r))

        def client_wait() -> TaskRecord:
            with SubqClient(idle_api.url, token=TOKEN) as client:
                return client.wait(parent.id, WAIT_S)

        async def mcp_call() -> dict[str, Any]:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with (
                httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(WAIT_S)) as http,
                Client(streamable_http_client(f"{idle_api.url}/mcp", http_client=http)) as mcp,
            ):
                done = await mcp.call_tool("wait_task", {"task_id": parent.id, "timeout_s": WAIT_S})
            assert done.structured_content is not None, done
            return done.structured_content

        # Who has looked at the stopped runs, by the module that asked: each waiter is holding once it has.
        lookers: set[str] = set()
        monkeypatch.setattr(idle, "finishing_runs", _noting_caller(idle.finishing_runs, lookers))
        # Each waiter walks the subtree at its first look, then looks again only among the tasks it found.
        walks: list[str] = []
        monkeypatch.setattr(idle, "subtree_ids", _noting_caller(idle.subtree_ids, set(), walks))
        with ThreadPoolExecutor(5) as pool:
            followed, waited = pool.submit(follow), pool.submit(idle.wait, parent.id, WAIT_S)
            client_waited, mcp_waited = pool.submit(client_wait), pool.submit(anyio.run, mcp_call)
            viewed = pool.submit(follow_run, idle, parent.id)  # not a terminal: its lines, then the final tree
            # The stream looks from a worker thread of anyio's (threads.run): its caller is anyio's.
            every = {"anyio.to_thread", "service", "api.routes", "api.mcp", "cli.views"}  # in the order above
            deadline = time.monotonic() + WAIT_S
            # (A copy of the set: the waiters' threads add to it meanwhile.)
            while not every <= {"anyio.to_thread" if n.startswith("anyio") else n for n in lookers.copy()}:
                assert time.monotonic() < deadline, f"only {sorted(lookers)} of {sorted(every)} looked"
                time.sleep(0.05)
            eventually(lambda: len(walks) >= len(every) or None, "each waiter's first look to walk the subtree")
            time.sleep(0.3)  # a few looks more each: one that did not hold would have answered by now
            assert len(walks) == len(every), f"{len(walks)} walks of the subtree by {len(every)} waiters"
            assert not followed.done(), f"the stream ended while a run of the tree could still record spend: {events}"
            for name, waiter in (("wait", waited), ("client", client_waited), ("mcp", mcp_waited), ("view", viewed)):
                assert not waiter.done(), f"{name} answered while a run of the tree could still record spend"
            assert idle.finishing_runs(parent.id).task_ids == [child_id]
            spent = Spend(request_key=f"{run.run_seq}:1", usage=Usage(tokens_in=40), cost_micros=900, cost_source="t")
            run.writes.usage.append(spent)
            # Its end finds the task stopped, lets go of its lease and refuses the spend; the run records it next.
            # In between, the refusal's mark holds the stream, not the lease.
            marked: list[list[str]] = []
            record_late = run._spent_before_the_stop

            def late(spends: list[Spend]) -> None:
                marked.append(idle.finishing([child_id]))
                record_late(spends)

            run._spent_before_the_stop = late  # type: ignore[method-assign]
            run.end(Ended("completed", summary="done"))  # its last response, answered as the stop landed
            assert marked == [[child_id]]
            followed.result(timeout=WAIT_S)
            assert waited.result(timeout=WAIT_S).total_cost_micros == 900
            assert client_waited.result(timeout=WAIT_S).total_cost_micros == 900
            answered = mcp_waited.result(timeout=WAIT_S)
            assert (answered["settled"], answered["total_cost_micros"]) == (True, 900), answered
            assert viewed.result(timeout=WAIT_S) == 1, "a cancelled run's view exits 1"
        assert events[-1]["event"] == "end" and events[-1]["data"]["status"] == "cancelled"
        assert idle.get_task(parent.id).total_cost_micros == 900
        assert idle.finishing([child_id]) == [] and idle.finishing_runs(parent.id).task_ids == []
        final_tree = capsys.readouterr().out.split("\n\n")[-1]
        assert parent.id in final_tree and format_usd(900) in final_tree, final_tree
    finally:
        runtime.coordinator.close()


def test_finishing_names_the_runs_that_may_still_record_spend(
    idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord
) -> None:
    """GET /v1/tasks/{id}/finishing: the subtree's tasks whose run holds its lease, and the lapse that bounds a
    wait for them; an unknown task is a 404 that changes nothing."""
    (child_id,) = idle.delegate(parent.id, [spec()]).child_ids
    lapse_s = idle.settings.heartbeat_lapse_s
    assert idle_http.get(f"/v1/tasks/{parent.id}/finishing").json() == {
        "task_id": parent.id, "task_ids": [], "lapse_s": lapse_s,
    }  # fmt: skip
    runtime = build_runtime(idle.settings, make_app(idle.settings))
    try:
        run = runtime.lifecycle.start(child_id)
        assert isinstance(run, Run), run
        for task_id in (parent.id, child_id):
            answer = idle_http.get(f"/v1/tasks/{task_id}/finishing")
            assert answer.status_code == 200 and answer.json()["task_ids"] == [child_id], answer.text
        # A later look names the tasks of the last (`among`): only those are looked at, the subtree not walked.
        walks: list[str] = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(idle, "subtree_ids", _noting_caller(idle.subtree_ids, set(), walks))
            looks = ((child_id, [child_id]), (parent.id, []), (f"{parent.id},{child_id}", [child_id]), ("", []))
            for among, found in looks:
                answer = idle_http.get(f"/v1/tasks/{parent.id}/finishing", params={"among": among})
                assert answer.status_code == 200, answer.text
                assert answer.json() == {"task_id": parent.id, "task_ids": found, "lapse_s": lapse_s}, among
        assert walks == [], "a look among named tasks walked the subtree"
        run.end(Ended("completed", summary="done"))
        assert idle_http.get(f"/v1/tasks/{parent.id}/finishing").json()["task_ids"] == []
        answer = idle_http.get(f"/v1/tasks/{parent.id}/finishing", params={"among": child_id})
        assert answer.json()["task_ids"] == [], "its run let go of the lease"
    finally:
        runtime.coordinator.close()
    before = state(idle)
    unknown = f"{parent.root_id}-{'0' * 12}"
    missing = idle_http.get(f"/v1/tasks/{unknown}/finishing")
    assert missing.status_code == 404 and missing.json()["message"] == f"Unknown task: {unknown}", missing.text
    assert state(idle) == before


def test_a_look_among_tasks_not_of_the_tree_is_refused_and_changes_nothing(
    idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord
) -> None:
    """`among` names tasks of the path's tree, at most FINISHING_AMONG_MAX of them, or the look is a 422 that
    names the first that is not, and changes nothing."""
    (child_id,) = idle.delegate(parent.id, [spec()]).child_ids
    other = idle.create_task("another tree", profile="offline")
    path = f"/v1/tasks/{parent.id}/finishing"
    refused = {
        "nope": "among: 'nope' is not a task of the tree of",
        f"{child_id},": "among: '' is not a task of the tree of",
        other.id: f"among: '{other.id}' is not a task of the tree of {parent.id}",
        f"{child_id},{other.id}-{'0' * 12}": f"among: '{other.id}-{'0' * 12}' is not a task of the tree of",
        f"{parent.id}-b{'0' * 12}": "is not a task of the tree of",  # a batch's id, of the same tree
        "x" * 5000: "among: '" + "x" * 64 + "' is not",  # shown cut short
        ",".join([child_id] * (FINISHING_AMONG_MAX + 1)): f"among names 101 task ids; at most {FINISHING_AMONG_MAX}",
    }
    for among, message in refused.items():
        assert_refused(idle, idle_http, "GET", path, 422, "invalid_input", "among", message, params={"among": among})


def test_events_send_keepalive_comments(
    idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_events, "KEEPALIVE_S", 0.2)
    idle.delegate(parent.id, [spec()])  # nobody runs the child: the stream stays open
    lines: list[str] = []
    with idle_http.stream("GET", f"/v1/tasks/{parent.id}/events", timeout=10) as response:
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith(":"):
                break
    assert lines[-1].startswith(": ping"), lines
    assert any(line.startswith("data:") and '"delegated"' in line for line in lines)


def test_events_end_with_an_error_event_when_redis_fails_mid_stream(idle: Coordinator, parent: TaskRecord) -> None:
    flaky = Coordinator(idle.settings, client=idle.client)
    real_status_of = flaky.store.records.status_of
    calls = 0

    def status_of(task_id: str) -> tuple[str, str]:
        nonlocal calls
        calls += 1
        if calls > 2:  # the route's check and the stream's first look succeed
            raise StoreError("Redis is unreachable: connection reset")
        return real_status_of(task_id)

    flaky.store.records.status_of = status_of  # type: ignore[method-assign]
    flaky.delegate(parent.id, [spec()])  # stays delegated: the stream would run on
    with ApiServer(create_app(coordinator=flaky)) as server, server.client() as http:
        with http.stream("GET", f"/v1/tasks/{parent.id}/events", timeout=10) as response:
            events = read_sse(response)
    assert events[0]["data"]["type"] == "delegated"
    assert events[-1] == {
        "id": None,
        "event": "error",
        "data": {"code": "store_error", "message": "Redis is unreachable: connection reset", "field": None},
    }


# -- errors --------------------------------------------------------------------------------

# A well-formed delivery id (GET /v1/tasks/{id}/deliveries lists real ones).
DELIVERY_ID = "evt_0123456789abcdef_1.0"
# Every operation behind the token, with a body that would succeed.
GUARDED = [
    ("POST", "/v1/tasks", {"prompt": "x"}),
    ("POST", "/v1/tasks/{id}/subtasks", {"subtasks": [{"description": "d", "message": "m"}]}),
    ("GET", "/v1/tasks/{id}", None),
    ("GET", "/v1/tasks/{id}/todos", None),
    ("PUT", "/v1/tasks/{id}/todos", {"todos": "[ ] z"}),
    ("GET", "/v1/tasks/{id}/tree", None),
    ("GET", "/v1/tasks/{id}/finishing", None),
    ("GET", "/v1/tasks/{id}/messages", None),
    ("GET", "/v1/tasks/{id}/events", None),
    ("GET", "/v1/tasks", None),
    ("POST", "/v1/tasks/{id}/cancel", {"reason": "x"}),
    ("POST", "/v1/tasks/{id}/retry", {"failed": False}),
    ("GET", "/v1/tasks/{id}/snapshot", None),
    ("GET", "/v1/tasks/{id}/deliveries", None),
    ("POST", "/v1/tasks/{id}/deliveries/{delivery_id}/redeliver", None),
    ("GET", "/v1/approvals", None),
    # 404 of an unknown approval: tests/test_api_control.py
    ("POST", "/v1/approvals/{approval_id}", {"decision": "approve"}),
    ("GET", "/v1/dead-letters", None),
    ("DELETE", "/v1/dead-letters", None),
    ("GET", "/v1/audit", None),
    ("GET", "/v1/tenants", None),
]


def test_every_v1_operation_is_guarded(idle_http: httpx.Client) -> None:
    document = idle_http.get("/openapi.json").json()
    operations = {
        (method.upper(), path.replace("{task_id}", "{id}"))
        for path, item in document["paths"].items()
        for method, op in item.items()
        if path.startswith("/v1/")
    }
    assert operations == {(m, p) for m, p, _ in GUARDED}, "a new endpoint needs its 401 and 404 tests"
    for path, item in document["paths"].items():
        for op in item.values():
            assert ("security" in op) == path.startswith("/v1/"), path


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
@pytest.mark.parametrize(
    ("authorization", "message"),
    [(None, "Missing bearer token"), ("Bearer wrong-token", "Invalid bearer token"), (f"Basic {TOKEN}", "Missing")],
)
def test_401_without_the_right_token(
    idle: Coordinator,
    anon_http: httpx.Client,
    parent: TaskRecord,
    method: str,
    path: str,
    body: Any,
    authorization: str | None,
    message: str,
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = assert_refused(
        idle, anon_http, method, path.format(id=parent.id, approval_id=f"{parent.id}-a0123456789ab", delivery_id=DELIVERY_ID), 401, "unauthorized", "Authorization", message,
        json=body, headers=headers,
    )  # fmt: skip
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", ["/healthz", "/livez", "/readyz", "/metrics", "/openapi.json", "/docs"])
def test_open_endpoints_need_no_token(anon_http: httpx.Client, path: str) -> None:
    assert anon_http.get(path).status_code == 200


@pytest.mark.parametrize(("method", "path", "body"), [g for g in GUARDED if "{id}" in g[1]])
@pytest.mark.parametrize(
    ("task_id", "message"),
    [
        ("0123456789abcdef", "Unknown task: 0123456789abcdef"),
        ("0123456789abcdef-0123456789ab", "Unknown task: 0123456789abcdef-0123456789ab"),
        ("not-an-id", "'not-an-id' is not a subq task or batch id"),
    ],
)
def test_404_for_unknown_ids(
    idle: Coordinator, idle_http: httpx.Client, method: str, path: str, body: Any, task_id: str, message: str
) -> None:
    assert_refused(
        idle, idle_http, method, path.format(id=task_id, delivery_id=DELIVERY_ID), 404, "not_found", "task_id", message,
        json=body,
    )  # fmt: skip


def test_404_and_405_for_unknown_routes(idle: Coordinator, idle_http: httpx.Client) -> None:
    assert_refused(idle, idle_http, "GET", "/v2/tasks", 404, "not_found", None, "No such endpoint: GET /v2/tasks")
    response = assert_refused(idle, idle_http, "DELETE", "/v1/tasks", 405, "method_not_allowed", None)
    assert response.headers["allow"]  # (Starlette names the first matching route's methods only)


def test_409_delegating_from_a_delegated_parent(idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord) -> None:
    idle.delegate(parent.id, [spec()])
    assert_refused(
        idle,
        idle_http,
        "POST",
        f"/v1/tasks/{parent.id}/subtasks",
        409,
        "wrong_state",
        "task_id",
        f"Task {parent.id} is delegated, not active",
        json={"subtasks": [spec(1)]},
    )


def test_409_delegating_into_an_agents_task(idle: Coordinator, idle_http: httpx.Client) -> None:
    """Only an agent's own run delegates from its task: one from outside would leave it `delegated` with no call
    to resume, its run doing nothing and its children's results never reaching its model."""
    agent = idle.create_task("an agent's own plan", todos="[ ] one", run=True)
    assert_refused(
        idle, idle_http, "POST", f"/v1/tasks/{agent.id}/subtasks", 409, "wrong_state", "task_id",
        f"Task {agent.id} is run by its agent: only its own run delegates from it", json={"subtasks": [spec()]},
    )  # fmt: skip
    assert idle.get_task(agent.id).status.value == "active"


def test_409_at_the_depth_limit(settings: Settings) -> None:
    flat = Coordinator(api_settings(settings, key_prefix="subqapi", queue="subq-api-idle", max_depth=0))
    root = flat.create_task("no subtasks allowed")
    with ApiServer(create_app(coordinator=flat)) as server, server.client() as http:
        assert_refused(
            flat, http, "POST", f"/v1/tasks/{root.id}/subtasks", 409, "wrong_state", "task_id",
            "SUBQ_MAX_DEPTH=0 allows no deeper subtasks", json={"subtasks": [spec()]},
        )  # fmt: skip
    flat.close()


def _body_of_size(size: int) -> bytes:
    body = json.dumps({"prompt": ""}).encode()
    return json.dumps({"prompt": "x" * (size - len(body))}).encode()


def test_413_for_a_body_over_the_limit(idle: Coordinator, idle_http: httpx.Client) -> None:
    limit = idle.settings.api_max_body_bytes
    json_type = {"Content-Type": "application/json"}
    at_limit = _body_of_size(limit)
    assert len(at_limit) == limit
    # At the limit the body is read and parsed: the service refuses the prompt's length.
    assert_refused(
        idle,
        idle_http,
        "POST",
        "/v1/tasks",
        422,
        "invalid_input",
        "prompt",
        "the limit is",
        content=at_limit,
        headers=json_type,
    )
    over = _body_of_size(limit + 1)
    assert_refused(
        idle,
        idle_http,
        "POST",
        "/v1/tasks",
        413,
        "body_too_large",
        None,
        "SUBQ_API_MAX_BODY_BYTES",
        content=over,
        headers=json_type,
    )

    def chunked() -> Iterator[bytes]:  # no Content-Length: the streamed size is counted
        for start in range(0, len(over), 64 * 1024):
            yield over[start : start + 64 * 1024]

    response = assert_refused(
        idle, idle_http, "POST", "/v1/tasks", 413, "body_too_large", None, content=chunked(), headers=json_type
    )
    assert "content-length" not in response.request.headers


def test_413_comes_before_parsing_and_auth(idle: Coordinator, anon_http: httpx.Client, parent: TaskRecord) -> None:
    over = b"{" * (idle.settings.api_max_body_bytes + 1)  # not even JSON
    assert_refused(idle, anon_http, "PUT", f"/v1/tasks/{parent.id}/todos", 413, "body_too_large", None, content=over)


# A wrong type, a missing or unknown field in pydantic's words; a blank or over-long text in the
# service's (coordinator.inputs.CreateTaskInput runs its checks), as `subq run` and subq.submit word them.
CREATE_422 = [
    ({}, "invalid_input", "prompt", "prompt: Field required"),
    ({"prompt": "x", "colour": "red"}, "invalid_input", "colour", "colour: Extra inputs are not permitted"),
    ({"prompt": ""}, "invalid_input", "prompt", "prompt must be a non-empty string"),
    ({"prompt": "  \n "}, "invalid_input", "prompt", "prompt must be a non-empty string"),
    ({"prompt": 5}, "invalid_input", "prompt", "Input should be a valid string"),
    ({"prompt": "x", "run": "yes"}, "invalid_input", "run", "Input should be a valid boolean"),
    ({"prompt": "x", "idempotency_key": ""}, "invalid_input", "idempotency_key", "idempotency_key must be a non-empty"),
    ({"prompt": "x", "idempotency_key": "k" * 201}, "invalid_input", "idempotency_key", "is 201 characters; the limit"),
    ({"prompt": "x", "idempotency_key": 7}, "invalid_input", "idempotency_key", "Input should be a valid string"),
    ({"prompt": "x", "idempotency_key": "ci\nabc"}, "invalid_input", "idempotency_key", "must be printable: no line"),
    ({"prompt": "x", "profile": "gpt-9"}, "invalid_profile", "profile", "Invalid profile: gpt-9"),
    ({"prompt": "x", "todos": "just prose"}, "invalid_todos", "todos", "The todo update has no items"),
    (
        {"prompt": "x", "todos": [{"content": "a"}, {"content": " "}]},
        "invalid_todos",
        "todos.1.content",
        "Todo item 1 has no content",
    ),
    ({"prompt": "x", "todos": {"content": "a"}}, "invalid_todos", "todos", "must be markdown text or a list"),
    # An empty name read as the default profile, which the caller did not name.
    ({"prompt": "x", "profile": ""}, "invalid_profile", "profile", "profile must not be empty: leave it out"),
    # str.isdigit takes these: "٣" was read as 3, and "²" failed int() past the check.
    ({"prompt": "x", "priority": "٣"}, "invalid_input", "priority", "priority must be an integer from 1 to 5"),
    ({"prompt": "x", "priority": "²"}, "invalid_input", "priority", "priority must be an integer from 1 to 5"),
    ({"prompt": "x", "todos": [{"content": "a" * 2001}]}, "invalid_todos", "todos.0.content",
     "Todo item 0 is 2001 characters; the limit is 2000"),
    ({"prompt": "x", "todos": "[ ] a\n" * 10_001}, "invalid_todos", "todos",
     "The todo update has 10001 items; the limit is 10000"),
]  # fmt: skip


def test_a_retried_create_with_the_same_key_returns_the_first_root(idle: Coordinator, idle_http: httpx.Client) -> None:
    body = {"prompt": "once", "run": True, "idempotency_key": f"req-{time.time_ns()}"}
    first = idle_http.post("/v1/tasks", json=body)
    queued = idle.client.llen(idle.settings.queue)
    again = idle_http.post("/v1/tasks", json=body)
    assert first.status_code == again.status_code == 201
    assert again.json()["id"] == first.json()["id"]
    assert idle.client.llen(idle.settings.queue) == queued, "its run was not published a second time"
    other = idle_http.post("/v1/tasks", json={**body, "idempotency_key": body["idempotency_key"] + "-2"})
    assert other.json()["id"] != first.json()["id"]


def test_a_key_holding_a_line_break_is_no_other_api_keys_key(idle: Coordinator) -> None:
    """An API key's idempotency key is claimed as its name, a line break, and the key: a caller with no API key
    (the Python API, subq.submit) whose key was `ci`, a line break and `abc` was answered with key ci's tree."""
    theirs = idle.create_task("ci's", idempotency_key="abc", owner="ci")
    with pytest.raises(ValidationError, match="must be printable") as caught:
        idle.create_task("not ci's", idempotency_key="ci\nabc")
    assert caught.value.field == "idempotency_key"
    assert idle.create_task("not ci's", idempotency_key="abc").id != theirs.id


@pytest.mark.parametrize(("body", "code", "field", "message"), CREATE_422)
def test_422_create(idle: Coordinator, idle_http: httpx.Client, body: Any, code: str, field: str, message: str) -> None:
    assert_refused(idle, idle_http, "POST", "/v1/tasks", 422, code, field, message, json=body)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{", "The request body is not valid JSON"),
        (b"[]", "body: Input should be a valid dictionary"),
        (b"", "body: Field required"),
    ],
)
def test_422_for_a_body_that_is_no_object(
    idle: Coordinator, idle_http: httpx.Client, content: bytes, message: str
) -> None:
    headers = {"Content-Type": "application/json"}
    assert_refused(
        idle, idle_http, "POST", "/v1/tasks", 422, "invalid_input", None, message, content=content, headers=headers
    )


DELEGATE_422 = [
    ({}, "invalid_input", "subtasks", "subtasks: Field required"),
    ({"subtasks": []}, "invalid_input", "subtasks", "List should have at least 1 item"),
    ({"subtasks": [spec()], "mode": "sideways"}, "invalid_input", "mode", "Input should be 'parallel' or 'sequential'"),
    ({"subtasks": [spec()], "wait": True}, "invalid_input", "wait", "Extra inputs are not permitted"),
    ({"subtasks": [spec(0), {"description": "d", "message": ""}]}, "invalid_input", "subtasks.1.message",
     "subtasks.1.message: String should have at least 1 character"),
    ({"subtasks": [spec(0), {"description": "d", "message": "  "}]}, "invalid_input", "subtasks.1.message", ""),
    ({"subtasks": [spec(0, colour="red")]}, "invalid_input", "subtasks.0.colour", "Extra inputs are not permitted"),
    ({"subtasks": [{"message": "m"}]}, "invalid_input", "subtasks.0.description", "Field required"),
    ({"subtasks": [spec(0), spec(1, profile="gpt-9")]}, "invalid_profile", "subtasks.1.profile", "Invalid profile: gpt-9"),
    ({"subtasks": [spec(0), spec(1, todo_id="nope")]}, "invalid_todos", "subtasks.1.todo_id", "Unknown todo_id 'nope'"),
    ({"subtasks": "do it"}, "invalid_input", "subtasks", "Input should be a valid list"),
    ({"subtasks": [spec(0), spec(1, profile="")]}, "invalid_profile", "subtasks.1.profile", "must not be empty"),
    ({"subtasks": [spec(0), {"description": "d", "message": "m" * 200_001}]}, "invalid_input", "subtasks.1.message",
     "subtasks.1.message: String should have at most 200000 characters"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "code", "field", "message"), DELEGATE_422)
def test_422_delegate(
    idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord, body: Any, code: str, field: str, message: str
) -> None:
    path = f"/v1/tasks/{parent.id}/subtasks"
    assert_refused(idle, idle_http, "POST", path, 422, code, field, message, json=body)


# A lone surrogate is valid JSON ("\\ud800") but no text: no store can hold it, and no JSON encoder writes it back.
# It was a 500 and, for a prompt, a tenant's root counted for a tree never written (a refused root used up its
# quota); a profile's error quoting it was a 500 too. Sent as raw bytes: httpx's own encoder cannot write one.
SURROGATE_422 = [
    ("POST", "/v1/tasks", b'{"prompt": "a\\ud800b"}', "invalid_input", "prompt",
     "prompt holds a lone surrogate '\\ud800' at character 2, which is no character"),
    ("POST", "/v1/tasks", b'{"prompt": "x", "profile": "\\ud800"}', "invalid_profile", "profile",
     "Invalid profile: \\ud800"),
    ("POST", "/v1/tasks/{id}/cancel", b'{"reason": "\\udc80 stop"}', "invalid_input", "reason",
     "reason holds a lone surrogate '\\udc80' at character 1"),
    ("POST", "/v1/tasks/{id}/subtasks", b'{"subtasks": [{"description": "d", "message": "\\ud800"}]}',
     "invalid_input", "subtasks.0.message", "unable to parse raw data as a unicode string"),
    # Taken, its tree's deliveries could not be listed, and no request line carries it.
    ("POST", "/v1/tasks", b'{"prompt": "x", "webhooks": [{"url": "https://hooks.example.com/\\ud800"}]}',
     "invalid_input", "webhooks.0.url", "holds a lone surrogate '\\ud800' at character 27"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "content", "code", "field", "message"), SURROGATE_422)
def test_422_for_a_lone_surrogate(
    idle: Coordinator,
    idle_http: httpx.Client,
    parent: TaskRecord,
    method: str,
    path: str,
    content: bytes,
    code: str,
    field: str,
    message: str,
) -> None:
    headers = {"Content-Type": "application/json"}
    url = path.format(id=parent.id)
    assert_refused(idle, idle_http, method, url, 422, code, field, message, content=content, headers=headers)


def test_an_unknown_id_is_shown_cut(idle: Coordinator, idle_http: httpx.Client) -> None:
    """A refused id is the caller's text, of any length: the error shows its first 80 characters."""
    response = assert_refused(idle, idle_http, "GET", "/v1/tasks/" + "z" * 5000, 404, "not_found", "task_id")
    assert f"Unknown id: '{'z' * 80}...' is not a subq task" in response.json()["message"]
    assert len(response.text) < 400


def test_422_delegate_over_the_fanout_limit(idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord) -> None:
    width = idle.settings.max_fanout + 1
    body = {"subtasks": [{"description": f"d{n}", "message": "m"} for n in range(width)]}
    message = f"{width} subtasks exceed SUBQ_MAX_FANOUT={idle.settings.max_fanout}"
    assert_refused(
        idle, idle_http, "POST", f"/v1/tasks/{parent.id}/subtasks", 422, "invalid_input", "subtasks", message, json=body
    )


def test_422_same_todo_for_two_children(idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord) -> None:
    todo = idle.get_todos(parent.id)[0].id
    body = {"subtasks": [spec(0, todo_id=todo), spec(1, todo_id=todo)]}
    assert_refused(
        idle, idle_http, "POST", f"/v1/tasks/{parent.id}/subtasks", 422, "invalid_todos", "subtasks.1.todo_id",
        "is used by two subtasks", json=body,
    )  # fmt: skip


TODOS_422 = [
    ({}, "invalid_input", "todos", "todos: Field required"),
    ({"todos": "just prose, no items"}, "invalid_todos", "todos", "The todo update has no items"),
    ({"todos": ""}, "invalid_todos", "todos", "The todo update has no items"),
    ({"todos": []}, "invalid_todos", "todos", "The todo update has no items"),
    ({"todos": [{"content": "ok", "status": "done"}]}, "invalid_todos", "todos.0.status", "invalid status 'done'"),
    ({"todos": [{"content": "ok"}, {"content": ""}]}, "invalid_todos", "todos.1.content", "Todo item 1 has no content"),
    ({"todos": 7}, "invalid_todos", "todos", "must be markdown text or a list"),
    ({"todos": "[ ] a", "extra": 1}, "invalid_input", "extra", "Extra inputs are not permitted"),
]


@pytest.mark.parametrize(("body", "code", "field", "message"), TODOS_422)
def test_422_todo_update_keeps_the_list(
    idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord, body: Any, code: str, field: str, message: str
) -> None:
    assert_refused(idle, idle_http, "PUT", f"/v1/tasks/{parent.id}/todos", 422, code, field, message, json=body)
    assert [t.content for t in idle.get_todos(parent.id)] == ["one", "two"]


QUERY_422 = [
    ("/v1/tasks?limit=0", "limit", "greater than or equal to 1"),
    ("/v1/tasks?limit=501", "limit", "less than or equal to 500"),
    ("/v1/tasks?limit=ten", "limit", "valid integer"),
    ("/v1/tasks?cursor=-1", "cursor", "greater than or equal to 0"),
    ("/v1/tasks?cursor=99999999999999999999", "cursor", "less than or equal to"),
    ("/v1/tasks?status=sleeping", "status", "Input should be 'active', 'delegated'"),
    ("/v1/tasks?root_id=not-a-root", "root_id", "String should match pattern"),
    ("/v1/tasks?root_id=0123456789abcdef-0123456789ab", "root_id", "String should match pattern"),
    ("/v1/tasks/{id}/messages?kind=xml", "kind", "Input should be 'ui' or 'api'"),
]


@pytest.mark.parametrize(("url", "field", "message"), QUERY_422)
def test_422_bad_query_parameters(
    idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord, url: str, field: str, message: str
) -> None:
    assert_refused(idle, idle_http, "GET", url.format(id=parent.id), 422, "invalid_input", field, message)


@pytest.mark.parametrize(
    ("event_id", "message"),
    [
        ("yesterday", "String should match pattern"),
        # Past 64 bits it matched the pattern, and the stream began with an `error` event saying Redis had failed.
        ("99999999999999999999999-0", "last-event-id must be an event id as <ms>-<n>, each part at most 1844"),
        ("1-18446744073709551616", "last-event-id must be an event id as <ms>-<n>"),
    ],
)
def test_422_bad_last_event_id(
    idle: Coordinator, idle_http: httpx.Client, parent: TaskRecord, event_id: str, message: str
) -> None:
    assert_refused(
        idle, idle_http, "GET", f"/v1/tasks/{parent.id}/events", 422, "invalid_input", "last-event-id",
        message, headers={"Last-Event-ID": event_id},
    )  # fmt: skip


def test_500_hides_the_exception(idle: Coordinator, caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Coordinator):
        def get_task(self, task_id: str) -> TaskRecord:
            raise RuntimeError("secret internal detail")

    broken = Broken(idle.settings, client=idle.client)
    with ApiServer(create_app(coordinator=broken)) as server, server.client() as http:
        response = http.get("/v1/tasks/0123456789abcdef")
    assert response.status_code == 500
    assert response.json() == {
        "code": "internal_error",
        "message": "Internal server error; the server log has the details",
        "field": None,
    }
    assert "secret" not in response.text and "Traceback" not in response.text
    assert any("secret internal detail" in str(r.exc_info) for r in caplog.records if r.exc_info), (
        "logged on the server"
    )


def test_503_when_redis_is_down(settings: Settings) -> None:
    down = Coordinator(api_settings(settings, redis_url=f"redis://127.0.0.1:{closed_port()}/0"))
    with ApiServer(create_app(coordinator=down)) as server, server.client() as http:
        task = http.get("/v1/tasks/0123456789abcdef")
        assert task.status_code == 503
        assert (task.json()["code"], task.json()["field"]) == ("store_error", None)
        assert task.json()["message"].startswith("Redis is unreachable")
        assert http.get("/metrics").status_code == 503
        health = http.get("/healthz")
        started = time.monotonic()
        ready = http.get("/readyz")
        ready_s = time.monotonic() - started
        live = http.get("/livez")
    assert health.status_code == 503
    body = health.json()
    assert (body["status"], body["redis"]["ok"], body["workers"]["count"]) == ("down", False, 0)
    assert "Redis is unreachable" in body["redis"]["error"]
    # Liveness does not depend on Redis (a restart would not bring it back); readiness does, quickly.
    assert (live.status_code, live.json()) == (200, {"status": "ok"})
    assert ready.status_code == 503 and ready.json()["status"] == "down" and ready_s < 3
    down.close()


def test_a_publish_the_broker_refuses_is_a_503_and_the_task_it_made_is_kept(
    idle: Coordinator, idle_http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu's OperationalError after the store's write (a master that died, a restart past its retries) was a 500
    `internal_error`, which a script takes for a failure and runs again: a second tree. It is a 503 the client may
    retry, `broker_error` as the CLI's exit 69 reads it, and the root it made stands, due for the reconciler."""
    import kombu.exceptions

    from coordinator import dispatch

    def refused(*_args: Any, **_kwargs: Any) -> None:
        lost = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        raise kombu.exceptions.OperationalError(str(lost)) from lost  # as kombu re-raises it

    monkeypatch.setattr(dispatch, "publish_run", refused)
    before = set(idle.client.scan_iter("subqapi:*:task:*"))
    answer = idle_http.post("/v1/tasks", json={"prompt": "Say hello.", "run": True})
    assert answer.status_code == 503, answer.text
    assert answer.json()["code"] == "broker_error" and "the change is kept" in answer.json()["message"]
    (made,) = set(idle.client.scan_iter("subqapi:*:task:*")) - before
    task_id = made.rsplit(":", 1)[-1]
    assert task_id in idle.store.convergence.watched(), "due: the reconciler publishes its run"

    def acl(*_args: Any, **_kwargs: Any) -> None:
        refusal = redis.ResponseError("NOPERM this user has no permissions to run the 'lpush' command")
        raise kombu.exceptions.OperationalError(str(refusal)) from refusal

    monkeypatch.setattr(dispatch, "publish_run", acl)
    refused_by_acl = idle_http.post("/v1/tasks", json={"prompt": "Say hello.", "run": True})
    assert (refused_by_acl.status_code, refused_by_acl.json()["code"]) == (500, "internal_error"), "no outage"


# -- auth configuration --------------------------------------------------------------------


def test_auth_disabled_explicitly_works_without_a_token_and_warns(
    idle: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    open_settings = idle.settings.model_copy(update={"api_token": None, "api_auth_disabled": True})
    with caplog.at_level(logging.WARNING, logger="coordinator.api"):
        app = create_app(open_settings, coordinator=idle)
    warnings = [r.getMessage() for r in caplog.records if r.name == "coordinator.api" and r.levelno == logging.WARNING]
    assert any("SUBQ_API_AUTH_DISABLED=true" in w and "WITHOUT authentication" in w for w in warnings)
    with ApiServer(app) as server, server.client(headers={}) as http:
        created = http.post("/v1/tasks", json={"prompt": "open"})
        assert created.status_code == 201
        assert http.get(f"/v1/tasks/{created.json()['id']}").status_code == 200
        assert all(
            "security" not in op for item in http.get("/openapi.json").json()["paths"].values() for op in item.values()
        )


def test_with_auth_disabled_a_request_by_a_name_a_page_could_rebind_is_refused_and_changes_nothing(
    idle: Coordinator,
) -> None:
    """DNS rebinding: a web page whose own name now resolves to 127.0.0.1 sent the browser's requests (a submit,
    an approval) to an open local server as same-origin ones. They name the page's host; a local one cannot."""
    open_settings = idle.settings.model_copy(update={"api_token": None, "api_auth_disabled": True})
    with ApiServer(create_app(open_settings, coordinator=idle)) as server, server.client(headers={}) as http:
        before = len(idle.list_tasks(limit=100)[0])
        for path in ("/v1/tasks", "/ui/", "/mcp"):
            refused = http.post(path, json={"prompt": "rebound"}, headers={"Host": "rebound.example:8000"})
            assert refused.status_code == 403, (path, refused.text)
            body = refused.json()
            assert body["field"] == "Host" and "'rebound.example:8000'" in body["message"], body
            assert "http://127.0.0.1:<port>" in body["message"]
        assert len(idle.list_tasks(limit=100)[0]) == before, "nothing submitted"
        for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "app.localhost", "10.1.2.3"):
            assert http.post("/v1/tasks", json={"prompt": "local"}, headers={"Host": host}).status_code == 201, host
    # With a token, a name is how a deployment is reached: no such check.
    with ApiServer(create_app(idle.settings, coordinator=idle)) as server, server.client() as http:
        assert http.get("/v1/tasks", params={"limit": 1}, headers={"Host": "subq.internal"}).status_code == 200


@pytest.mark.parametrize("token", [None, ""])
def test_no_token_and_auth_not_disabled_is_a_config_error(settings: Settings, token: str | None) -> None:
    bare = settings.model_copy(update={"api_token": SecretStr(token) if token is not None else None})
    with pytest.raises(ConfigError, match="SUBQ_API_TOKEN") as caught:
        create_app(bare)
    assert caught.value.field == "SUBQ_API_TOKEN"
    assert "SUBQ_API_AUTH_DISABLED=true" in caught.value.message


def test_create_app_reads_the_environment(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBQ_REDIS_URL", redis_url)
    with pytest.raises(ConfigError, match="SUBQ_API_TOKEN"):
        create_app()
    monkeypatch.setenv("SUBQ_API_TOKEN", TOKEN)
    with ApiServer(create_app()) as server, server.client() as http:
        assert http.get("/v1/tasks", params={"limit": 1}).status_code == 200
        assert http.get("/v1/tasks", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_uvicorn_factory_starts_and_warns_when_auth_is_disabled(redis_url: str) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")}
    env.update(SUBQ_REDIS_URL=redis_url, SUBQ_API_AUTH_DISABLED="true", SUBQ_KEY_PREFIX="subqapi")
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "coordinator.api:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "Application startup complete" in line or proc.poll() is not None:
                break
        assert any("SUBQ_API_AUTH_DISABLED=true" in line and "WITHOUT authentication" in line for line in lines), lines
        assert (
            httpx.get(f"http://127.0.0.1:{port}/v1/tasks", params={"limit": 1}, timeout=REQUEST_TIMEOUT_S).status_code
            == 200
        )
    finally:
        proc.terminate()
        proc.wait(10)


# -- health and metrics --------------------------------------------------------------------


def test_healthz_with_workers(live_http: httpx.Client) -> None:
    asked = time.monotonic()
    body = live_http.get("/healthz").json()
    again = live_http.get("/readyz").json()
    cached = time.monotonic() - asked < HEALTH_CACHE_TTL_S  # a loaded host may take longer: then read anew
    assert body["status"] == "ok"
    assert body["redis"]["ok"] is True and body["redis"]["latency_ms"] >= 0
    # Each worker node once (its heartbeat, not a broadcast ping); no names on an open route (they carry host names).
    assert body["workers"]["count"] >= WORKER_PROCESSES and body["workers"]["names"] == []
    assert again == body or not cached, "the same reading, from the cache"


def test_health_counts_nodes_whose_heartbeat_is_within_the_lapse(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Longer than a loaded host takes between two requests: the second is read from the cache.
    monkeypatch.setattr(api_ops, "HEALTH_CACHE_TTL_S", 3.0)
    with local_redis() as own_url:
        coord = Coordinator(api_settings(settings, redis_url=own_url, heartbeat_lapse_s=30))
        now = time.time()
        beats = {
            "celery@a:11": now,  # a node's reconciler
            "celery@a:12": now,  # the same node restarted: counted once
            "celery@b:13": now - 10,
            "host-c:14": now,  # a run's heartbeat, not a node
            "celery@d:15": now - 60,  # lapsed
        }
        coord.client.zadd(coord.store.keys.workers(), beats)
        with ApiServer(create_app(coordinator=coord)) as server, server.client(headers={}) as http:
            ready = http.get("/readyz")
            coord.client.delete(coord.store.keys.workers())
            cached = http.get("/readyz").json()
            time.sleep(3.1)  # past HEALTH_CACHE_TTL_S
            read_again = http.get("/readyz").json()
        coord.close()
    assert ready.status_code == 200
    assert ready.json()["workers"] == {"count": 2, "names": [], "error": None}
    assert cached["workers"]["count"] == 2, "read at most once a HEALTH_CACHE_TTL_S"
    assert (read_again["status"], read_again["workers"]["count"]) == ("degraded", 0)


def test_healthz_degraded_without_workers(settings: Settings) -> None:
    with local_redis() as lonely_url:
        lonely = Coordinator(api_settings(settings, redis_url=lonely_url))
        with ApiServer(create_app(coordinator=lonely)) as server, server.client(headers={}) as http:
            response = http.get("/healthz")
            ready = http.get("/readyz")
        lonely.close()
    # Ready with no worker: the API takes work, which waits in the queue.
    assert response.status_code == ready.status_code == 200
    body = response.json()
    assert (body["status"], body["redis"]["ok"], body["workers"]["count"]) == ("degraded", True, 0)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_report_tasks_spend_queue_and_latency(settings: Settings) -> None:
    coord = Coordinator(api_settings(settings, key_prefix="subqmetrics", queue="subq-metrics"))
    for key in coord.client.scan_iter("subqmetrics:*"):
        coord.client.delete(key)
    coord.client.delete("subq-metrics")
    first = coord.create_task("one root")
    second = coord.create_task("another root")
    batch = coord.delegate(second.id, [spec()])
    child = batch.child_ids[0]
    coord.store.runs.record_usage(child, "r:1", Usage(tokens_in=100, tokens_out=10), 1234, "test")
    coord.store.runs.record_usage(first.id, "r:1", Usage(tokens_in=10), 66, "test")
    coord.store.metrics.add_latencies([50, 300, 70_000])
    for reason in ("run-lost", "run-lost", "ended-not-written-back"):
        coord.store.convergence.count_repair(reason)
    coord.client.lpush(coord.store.keys.dead_letters(), '{"reason": "test"}')

    with ApiServer(create_app(coordinator=coord)) as server, server.client(headers={}) as http:
        response = http.get("/metrics")
        again = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = _samples(response.text)
    assert samples == _samples(again.text), "a scrape changes nothing"
    tasks = {dict(labels)["status"]: v for (name, labels), v in samples.items() if name == "subq_tasks"}
    assert tasks == {"active": 2, "delegated": 1, "completed": 0, "failed": 0, "cancelled": 0}
    assert samples[("subq_root_spend_micro_usd", ())] == 1234 + 66, "each root's total, the child's spend once"
    assert samples[("subq_queue_depth", (("queue", "subq-metrics"),))] == coord.client.llen("subq-metrics") > 0
    buckets = {
        dict(labels)["le"]: v
        for (name, labels), v in samples.items()
        if name == "subq_model_request_latency_seconds_bucket"
    }
    assert (buckets["0.1"], buckets["0.25"], buckets["0.5"], buckets["60"], buckets["120"], buckets["+Inf"]) == (
        1,
        1,
        2,
        2,
        3,
        3,
    )
    assert samples[("subq_repairs_total", (("reason", "run-lost"),))] == 2
    assert samples[("subq_repairs_total", (("reason", "ended-not-written-back"),))] == 1
    assert samples[("subq_dead_letters", ())] == 1
    assert samples[("subq_model_request_latency_seconds_count", ())] == 3
    assert samples[("subq_model_request_latency_seconds_sum", ())] == pytest.approx(70.35)
    assert "over the 1000 most recent tasks" in response.text, "HELP says the figures are bounded"
    assert b"subq_tasks" not in generate_latest(REGISTRY), "no process-global metrics"

    window = _samples(generate_latest_of(SubqCollector(coord, recent_tasks=1)))
    assert sum(v for (name, _), v in window.items() if name == "subq_tasks") == 1
    for key in coord.client.scan_iter("subqmetrics:*"):
        coord.client.delete(key)
    coord.client.delete("subq-metrics")
    coord.close()


def test_a_runs_model_latency_reaches_the_fleets_histogram_with_its_workers_next_beat(
    live: Coordinator, live_http: httpx.Client
) -> None:
    """A run's latency is added by its worker's heartbeat, not by its steps (coordinator/store/metrics.py's
    LatencyTally): /metrics shows it within a beat of the run's end, a third of the lapse, allowed the whole lapse."""

    def half_to_five_s() -> float:
        """Requests of 0.5 to 5 s (this run's 0.7 s, however late a loaded host's loop answers it)."""
        samples = _samples(live_http.get("/metrics").text)
        bucket = {
            dict(labels)["le"]: v
            for (name, labels), v in samples.items()
            if name == "subq_model_request_latency_seconds_bucket"
        }
        return bucket["5"] - bucket["0.5"]

    before = half_to_five_s()
    root = live.create_task(script({**usage_step("timed"), "latency_ms": 700}), run=True)
    assert live.wait(root.id, WAIT_S).status == "completed"
    deadline = time.monotonic() + live.settings.heartbeat_lapse_s
    while half_to_five_s() < before + 1:
        assert time.monotonic() < deadline, "the run's latency never reached the fleet's histogram"
        time.sleep(0.2)


def generate_latest_of(collector: SubqCollector) -> str:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()
