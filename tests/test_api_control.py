"""The control endpoints and client methods: cancel, approvals, snapshot, budgets over HTTP."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coordinator import Coordinator, NotFoundError, StateError
from coordinator.client import SubqClient
from tests.agents import USAGE, agent, call, reply
from tests.helpers import TOKEN, ApiServer, quiet
from tests.test_api import assert_refused, wait_settled

WAIT_S = 60
UNKNOWN_APPROVAL = "0123456789abcdef-a0123456789ab"


@pytest.fixture(scope="module")
def client(live_api: ApiServer) -> Iterator[SubqClient]:
    with SubqClient(live_api.url, token=TOKEN) as subq:
        yield subq


def _slow() -> str:
    return agent({"reply": "never", "usage": USAGE, "latency_ms": 20_000})


def _create(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/tasks", json={"prompt": "p", **body})
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def test_cancel_over_http(live: Coordinator, live_http: httpx.Client) -> None:
    parent = _create(live_http)
    child = live_http.post(
        f"/v1/tasks/{parent['id']}/subtasks", json={"subtasks": [{"description": "slow", "message": _slow()}]}
    ).json()["child_ids"][0]
    response = live_http.post(f"/v1/tasks/{parent['id']}/cancel", json={"reason": "wrong plan"})
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "cancelled" and response.json()["error"] == "cancelled: wrong plan"
    assert live_http.get(f"/v1/tasks/{child}").json()["status"] == "cancelled"
    quiet(live, parent["id"])  # the child's stopped run may still be writing its last words
    assert_refused(live, live_http, "POST", f"/v1/tasks/{parent['id']}/cancel", 409, "wrong_state", "task_id",
                   "has already ended", json={"reason": "again"})  # fmt: skip
    assert_refused(live, live_http, "POST", "/v1/tasks/0123456789abcdef/cancel", 404, "not_found", "task_id",
                   json={"reason": "x"})  # fmt: skip
    assert_refused(live, live_http, "POST", f"/v1/tasks/{parent['id']}/cancel", 422, "invalid_input", "reason",
                   json={"reason": ""})  # fmt: skip
    assert_refused(live, live_http, "POST", f"/v1/tasks/{parent['id']}/cancel", 422, "invalid_input", "force",
                   json={"reason": "x", "force": True})  # fmt: skip


def test_approvals_over_http(live: Coordinator, live_http: httpx.Client) -> None:
    parent = _create(live_http, todos="[ ] deploy")
    risky = agent(call("run_command", command="make deploy"), reply("deployed"))
    live_http.post(
        f"/v1/tasks/{parent['id']}/subtasks", json={"subtasks": [{"description": "deploy", "message": risky}]}
    )
    deadline = time.monotonic() + 30
    while not (pending := live_http.get("/v1/approvals", params={"root_id": parent["id"]}).json()["approvals"]):
        assert time.monotonic() < deadline, "no approval request"
        time.sleep(0.1)
    (approval,) = pending
    assert approval["tool"] == "run_command" and approval["args"] == {"command": "make deploy"}
    assert approval["todo_content"] == "deploy" and approval["status"] == "pending"
    path = f"/v1/approvals/{approval['id']}"
    # The approval is saved before its run has parked: on a loaded host the run's release (its lease, its live
    # status) still fell between assert_refused's two reads of the tree.
    quiet(live, parent["id"])
    assert_refused(live, live_http, "POST", path, 422, "invalid_input", "decision", json={"decision": "maybe"})
    response = live_http.post(path, json={"decision": "approve"})
    assert response.status_code == 200 and response.json()["status"] == "approved"
    assert wait_settled(live_http, parent["id"])["status"] == "active"
    assert_refused(live, live_http, "POST", path, 409, "wrong_state", "approval_id", "already approved",
                   json={"decision": "deny"})  # fmt: skip
    assert_refused(live, live_http, "POST", f"/v1/approvals/{UNKNOWN_APPROVAL}", 404, "not_found", "approval_id",
                   json={"decision": "approve"})  # fmt: skip
    assert_refused(live, live_http, "POST", "/v1/approvals/junk", 404, "not_found", "approval_id",
                   json={"decision": "approve"})  # fmt: skip
    assert_refused(live, live_http, "GET", "/v1/approvals", 422, "invalid_input", "root_id", params={"root_id": "x"})


def test_snapshot_and_budget_over_http(live: Coordinator, live_http: httpx.Client) -> None:
    spender = agent(*[call("update_todo_list", todos=f"[-] step {n}") for n in range(4)], reply("done"))
    parent = _create(live_http, budget_usd="0.03", todos="[ ] spend")
    child = live_http.post(
        f"/v1/tasks/{parent['id']}/subtasks", json={"subtasks": [{"description": "spender", "message": spender}]}
    ).json()["child_ids"][0]
    record = wait_settled(live_http, parent["id"])
    assert record["status"] == "failed" and record["error_class"] == "BudgetExhausted"
    assert record["budget_micros"] == 30_000
    snapshot = live_http.get(f"/v1/tasks/{parent['id']}/snapshot").json()
    assert snapshot["root_id"] == parent["id"] and snapshot["tasks"][child]["state"] == "cancelled"
    quiet(live, parent["id"])  # the stopped child's run may still be unwinding (its last step), on a loaded host
    assert_refused(live, live_http, "GET", f"/v1/tasks/{child}/snapshot", 422, "invalid_input", "task_id",
                   "is not a root task")  # fmt: skip
    for bad in (0, "-1", "abc", 1e20):
        assert_refused(live, live_http, "POST", "/v1/tasks", 422, "invalid_input", "budget_usd",
                       json={"prompt": "p", "budget_usd": bad})  # fmt: skip


def test_the_client_controls_a_tree(client: SubqClient) -> None:
    parent = client.create_task("p", budget_usd="1.00")
    assert parent.budget_micros == 1_000_000
    risky = agent(call("run_command", command="rm -rf build"), reply("did it"))
    client.delegate(
        parent.id, [{"description": "clean", "message": risky}, {"description": "slow", "message": _slow()}]
    )
    deadline = time.monotonic() + 30
    while not (pending := client.list_approvals(parent.id)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    denied = client.decide(pending[0].id, "deny", feedback="use make clean")
    assert denied.status == "denied" and denied.feedback == "use make clean"
    live_states = client.snapshot(parent.id)
    assert parent.id in live_states
    cancelled = client.cancel(parent.id, "enough")
    assert cancelled.status.value == "cancelled"
    with pytest.raises(StateError, match="already ended"):
        client.cancel(parent.id, "again")
    with pytest.raises(NotFoundError):
        client.decide(UNKNOWN_APPROVAL, "approve")
    with pytest.raises(StateError, match="already denied"):
        client.decide(pending[0].id, "approve")
