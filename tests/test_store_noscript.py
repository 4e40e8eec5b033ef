"""A server that forgets subq's scripts (a restarted Redis, a replica just promoted) on a real Redis: each step
still runs once, and no `SCRIPT LOAD` is needed (coordinator/store/base.py, `queue_script`).

The scripts are flushed before each step, and a `SCRIPT LOAD` made on the client lands where the step's
call does not (it loads, then the server forgets again): what a load on one pooled connection and a call
on another meet across a failover. Loading and sending EVALSHA again ran out of its two tries there
(`end_run`, 1 failover in 4 under load); the call sent by its text (EVAL) cannot. Every path is taken: a
script alone, an acknowledged one with its WAIT, a script and its reads in one transaction (a run's
start), and a batch of calls in one pipeline (the deliverer's).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.celery_app import make_app
from coordinator.store import base
from coordinator.store.outbox import Settled
from coordinator.store.protocol import SettleAndClaim
from tests.agents import agent, reply
from tests.test_security import park_approval
from workers.runtime.context import Runtime, build_runtime
from workers.runtime.runner import run_child

LEASE_MS = 60_000


class Forgetful:
    """A client's SCRIPT LOAD that reaches a server the next call does not: loaded, then forgotten at once."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.loads = 0
        self.load = client.script_load

    def __call__(self, text: str) -> str:
        self.loads += 1
        sha = self.load(text)
        self.client.script_flush()
        return sha


@pytest.fixture
def forgetful(settings: Settings) -> Iterator[tuple[Coordinator, Runtime, list[Forgetful]]]:
    # One replica asked for, none there: every acknowledged step sends its WAIT (1 ms, then counted short).
    own = settings.model_copy(
        update={
            "key_prefix": "subqnoscript",
            "queue": "subq-noscript-nobody",
            "redis_min_replicas": 1,
            "redis_replica_wait_ms": 1,
            "webhook_allow": ["127.0.0.1"],
        }
    )
    coord = Coordinator(own)
    rt = build_runtime(own, make_app(own))
    loaders = [Forgetful(coord.client), Forgetful(rt.coordinator.client)]
    coord.client.script_load = loaders[0]  # type: ignore[method-assign]
    rt.coordinator.client.script_load = loaders[1]  # type: ignore[method-assign]
    try:
        yield coord, rt, loaders
    finally:
        for key in coord.client.scan_iter("subqnoscript:*"):
            coord.client.delete(key)
        coord.client.delete(own.queue)
        rt.coordinator.close()
        coord.close()


def test_each_step_runs_once_when_the_server_forgot_its_script(
    forgetful: tuple[Coordinator, Runtime, list[Forgetful]],
) -> None:
    coord, rt, loaders = forgetful
    coord.client.script_flush()
    # A submit (tenant_submit, acknowledged) and a delegation (a transaction) on a server that knows no script.
    parent = coord.create_task(
        "a parent", todos="[ ] x\n[ ] y", webhooks=[{"url": "http://127.0.0.1:9/h", "events": ["*"]}]
    )
    batch = coord.delegate(
        parent.id,
        [{"description": "x", "message": agent(reply("x done"))}, {"description": "y", "message": agent(reply("y"))}],
    )
    first, second = batch.child_ids
    # The caller's parent waits on them: its mark is mark_timeline.lua, run inside the commit's MULTI by its text.
    assert coord.get_task(parent.id).waiting_for == "children"
    # A run's start (start_run and its reads in one transaction), its steps, and its end (end_run, acknowledged).
    coord.client.script_flush()
    assert run_child(rt, first).status == "completed"
    child = coord.get_task(first)
    assert (child.status, child.requests, child.summary) == (TaskStatus.COMPLETED, 1, "x done")
    assert [item.subtask_id for item in coord.get_todos(parent.id) if item.status == "completed"] == [first]
    # A cancel (stop_tasks, acknowledged).
    coord.client.script_flush()
    coord.cancel(parent.id, "stopped by the test")
    assert coord.get_task(second).status == TaskStatus.CANCELLED
    # The deliverer's step: a claim, then its outcomes settled with the next claim (settle_and_claim.lua).
    outbox = coord.store.outbox
    claimed = [c for c in outbox.settle_and_claim([], 10, LEASE_MS) if c.root_id == parent.id]
    assert claimed, "the tree's events were queued for its webhook"
    coord.client.script_flush()
    outbox.settle_and_claim([Settled(parent.id, c.delivery_id, "gone", last="HTTP 410") for c in claimed], 0, LEASE_MS)
    assert {d["state"] for d in outbox.deliveries(parent.id)} == {"gone"}
    assert [loader.loads for loader in loaders] == [0, 0], "each call went by its text, not SCRIPT LOAD"
    # EVAL keeps what it ran: the next call of a script finds it by its SHA.
    assert coord.client.script_exists(coord.store.core.scripts._scripts[SettleAndClaim.script].sha) == [True]


def test_an_approval_and_its_notice_commit_together_when_the_server_forgot_the_script(
    forgetful: tuple[Coordinator, Runtime, list[Forgetful]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_approval.lua writes the approval, its index and its `approval.requested` event in one script: a NOSCRIPT
    commits none of them, and the call by its text commits all three (before, writes sent beside the script in one
    MULTI could commit the approval without its event)."""
    coord, _, _ = forgetful
    root = coord.create_task("a root that asks", webhooks=[{"url": "http://127.0.0.1:9/h", "events": ["*"]}])
    pending_before: list[int] = []
    send = base.round_trip

    def counted(*args: Any, **kwargs: Any) -> list[Any]:
        pending_before.append(len(coord.store.approvals.pending_approval_ids()))
        return send(*args, **kwargs)

    monkeypatch.setattr(base, "round_trip", counted)
    coord.client.script_flush()
    approval = park_approval(coord, root.id)
    monkeypatch.undo()
    assert pending_before == [0, 0], "the NOSCRIPT wrote nothing; the script by its text wrote it all"
    assert coord.store.approvals.get_approval(approval.id).tool == "run_command"
    events = [e for e in coord.store.outbox.deliveries(root.id) if e["type"] == "approval.requested"]
    assert len(events) == 1
