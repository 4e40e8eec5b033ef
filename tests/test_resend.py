"""A step whose reply was lost after it ran, and which the connection sends again, is applied once.

Under Sentinel a client sends a command again after a connection error (`failover_retry`): a
master killed right after a step ran, or a read slower than the connection's timeout, loses the
reply of a step that ran, and the step goes again as it was. Each test here loses one step's reply
for real: the request is sent to a real Redis, which runs it and answers; the answer is read off the
socket and thrown away, and the socket is shut, so the client's read finds the connection closed and
its retry sends the same bytes again on a new one. The step must know itself and answer as it did
(coordinator/store/fields.py: `run_token`, `last_step`, `end_reply`, a claim's token, a close's
`close_reply`).
"""

from __future__ import annotations

import json
import secrets
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection
from redis.retry import Retry

from coordinator import ConflictError, Coordinator, TaskStatus, Usage, dead_letter, ids, message_digest, writeback
from coordinator.audit import Actor
from coordinator.celery_app import make_app
from coordinator.models import AdmissionLimits, Approval, RunWrites, Spend, SubtaskSpec, ToolCallDone
from coordinator.ports.steps import Ended
from coordinator.redis_clients import FAILOVER_ERRORS
from coordinator.replies import FairHealed
from coordinator.runs import Run
from coordinator.store import Store
from coordinator.store import base as store_base
from coordinator.store.base import RESEND_MARK_S
from coordinator.store.fair import NO_FAIR_SHARES, FairShares
from coordinator.store.fields import TaskField
from tests.agents import STEP_COST_MICROS, agent, reply
from tests.helpers import script, usage_step
from workers.runtime.context import Runtime, build_runtime
from workers.runtime.runner import run_child

# How long the server may take to answer the step whose reply is lost (a loaded host is slow).
ANSWER_WITHIN_S = 30.0


def _retrying(store: Store) -> None:
    """The store's connections retry as a Sentinel client's do (FAILOVER_ERRORS), from their next connect; and
    the server knows every script, so a step's first send runs it (a NOSCRIPT, whose loss is harmless, would not)."""
    pool = store.client.connection_pool
    pool.connection_kwargs["retry"] = Retry(NoBackoff(), 3, FAILOVER_ERRORS)
    pool.reset()
    for known in store.runs.scripts._scripts.values():
        store.client.script_load(known.script)


class LostReplies:
    """Loses the reply of the next request that carries every one of `markers`, once it is armed (`lose`)."""

    def __init__(self) -> None:
        self.markers: list[bytes] = []
        self.lost = 0

    def lose(self, *markers: str) -> None:
        self.markers = [m.encode() for m in markers]

    def after_send(self, connection: AbstractConnection, packed: bytes) -> None:
        if not self.markers or not all(m in packed for m in self.markers):
            return
        self.markers = []
        sock = connection._sock  # type: ignore[attr-defined]
        # The server has run the request once its answer arrives; read it all and drop it.
        readable, _, _ = select.select([sock], [], [], ANSWER_WITHIN_S)
        assert readable, "the server did not answer the step"
        while select.select([sock], [], [], 0.2)[0]:
            if not sock.recv(1 << 20):
                break
        sock.shutdown(socket.SHUT_RDWR)
        self.lost += 1


@pytest.fixture
def lost(monkeypatch: pytest.MonkeyPatch) -> LostReplies:
    replies = LostReplies()
    original = AbstractConnection.send_packed_command

    def send(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        original(self, command, check_health)
        packed = command if isinstance(command, bytes) else b"".join(command)
        replies.after_send(self, bytes(packed))

    monkeypatch.setattr(AbstractConnection, "send_packed_command", send)
    return replies


@pytest.fixture
def rt(idle_coordinator: Coordinator) -> Iterator[Runtime]:
    runtime = build_runtime(idle_coordinator.settings, make_app(idle_coordinator.settings))
    _retrying(runtime.coordinator.store)
    yield runtime
    runtime.coordinator.close()


def _sha(store: Store, name: str) -> str:
    return str(store.runs.scripts._scripts[name].sha)


def _started(rt: Runtime, task_id: str) -> Run:
    run = rt.lifecycle.start(task_id)
    assert isinstance(run, Run), f"the run did not start: {run}"
    return run


def _child(coord: Coordinator, message: str) -> tuple[str, str]:
    parent = coord.create_task("one child", todos="[ ] a")
    (child_id,) = coord.delegate(parent.id, [{"description": "a", "message": message}]).child_ids
    return parent.id, child_id


@pytest.fixture
def running(idle_coordinator: Coordinator, rt: Runtime) -> Run:
    """A child's run, started."""
    _, child_id = _child(idle_coordinator, script(usage_step()))
    return _started(rt, child_id)


@pytest.fixture
def fair_prefix(idle_coordinator: Coordinator) -> Iterator[Coordinator]:
    """A coordinator of a key prefix of its own (fair shares' fleet-wide keys are the prefix's), cleaned up after."""
    coord = Coordinator(idle_coordinator.settings.model_copy(update={"key_prefix": f"subqfair{secrets.token_hex(3)}"}))
    yield coord
    for key in coord.client.scan_iter(coord.store.keys.all_pattern()):
        coord.client.delete(key)
    coord.close()


def _risky_call(root_id: str) -> Approval:
    """An approval of the root's tool call, as a worker parks a risky call."""
    return Approval(
        id=ids.new_approval_id(root_id), task_id=root_id, root_id=root_id, tool="run_command",
        args={"command": "make deploy"}, tool_call_id="call-1", created_at=time.time(), deadline=time.time() + 600,
    )  # fmt: skip


def _closes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, bool]]:
    """The closes whose caller went on to resume the parent (writeback.resumed), as they were told."""
    closes: list[tuple[str, int, bool]] = []
    close = writeback.resumed

    def closed(plane: Any, parent: str, resumes: int, resume: bool) -> bool:
        closes.append((parent, resumes, resume))
        return close(plane, parent, resumes, resume)

    monkeypatch.setattr(writeback, "resumed", closed)
    return closes


def _ui_texts(coord: Coordinator, task_id: str) -> list[str]:
    return [str(m.get("text", "")) for m in coord.store.records.ui_messages(task_id)]


def test_a_start_sent_again_after_it_ran_starts_the_run_once(
    idle_coordinator: Coordinator, rt: Runtime, lost: LostReplies
) -> None:
    coord = idle_coordinator
    _, child_id = _child(coord, script(usage_step(), text="The child's prompt."))
    lost.lose(_sha(rt.coordinator.store, "start_run"))

    run = _started(rt, child_id)  # before, the resend found its own lease and answered 'leased'

    assert lost.lost == 1
    assert run.deliveries == 1
    assert coord.store.records.task_fields(child_id)["deliveries"] == "1"
    assert len([text for text in _ui_texts(coord, child_id) if text.startswith("The child's prompt.")]) == 1
    run.end(Ended("completed", summary="done"))
    assert coord.get_task(child_id).status == TaskStatus.COMPLETED


def test_a_step_sent_again_after_it_ran_writes_its_messages_once(
    idle_coordinator: Coordinator, rt: Runtime, running: Run, lost: LostReplies
) -> None:
    coord, run, child_id = idle_coordinator, running, running.task.id
    writes = RunWrites(conversation=['{"said": "once"}'], ui_messages=['{"ts": 1, "type": "say", "text": "once"}'])
    lost.lose(_sha(rt.coordinator.store, "flush_run"))

    stepped = rt.coordinator.store.runs.flush_run(run.task, run.token, writes)

    assert lost.lost == 1
    assert stepped.leased and stepped.status == "active"
    assert coord.store.records.conversation(child_id) == ['{"said": "once"}']
    assert _ui_texts(coord, child_id).count("once") == 1
    # A later step of the same run is written, as any step is.
    again = RunWrites(conversation=['{"said": "twice"}'])
    assert rt.coordinator.store.runs.flush_run(run.task, run.token, again).leased
    assert coord.store.records.conversation(child_id) == ['{"said": "once"}', '{"said": "twice"}']


def test_a_step_that_refused_its_spend_sent_again_still_says_so(
    idle_coordinator: Coordinator, rt: Runtime, running: Run, lost: LostReplies
) -> None:
    """A stop landed before the step that carries a held response: the step refuses its spend, and its reply is
    lost. The resend finds the step written; it still says the spend was refused, so the run records it after
    (record_late_spend, once per request key)."""
    coord, run, child_id = idle_coordinator, running, running.task.id
    coord.cancel(child_id, "stopped")
    spend = Spend(request_key=f"{run.run_seq}:1", usage=Usage(tokens_in=40), cost_micros=900, cost_source="test")
    run.writes.usage.append(spend)
    lost.lose(_sha(rt.coordinator.store, "flush_run"))

    assert TaskStatus(run.flush().status).terminal

    assert lost.lost == 1
    record = coord.get_task(child_id)
    assert (record.cost_micros, record.requests) == (900, 1), "recorded once, after the stop"


# With the run's own writes; and with none, the usual case: the run's writes went out just before a call that
# must not run twice (the tool journal), and each later call of the same response has only its own result.
@pytest.mark.parametrize("conversation", [['{"a": 1}'], []], ids=["with-run-writes", "alone"])
def test_a_tool_step_sent_again_after_it_ran_counts_its_call_once(
    idle_coordinator: Coordinator, rt: Runtime, running: Run, lost: LostReplies, conversation: list[str]
) -> None:
    coord, run, child_id = idle_coordinator, running, running.task.id
    call = ToolCallDone(tool_call_id="call-1", tool="lookup", outcome="ok", result_json='"found"', ms=12)
    lost.lose(_sha(rt.coordinator.store, "record_tool"))

    writes = RunWrites(conversation=list(conversation))
    stepped = rt.coordinator.store.runs.record_tool_call(run.task, run.token, writes, call)

    assert lost.lost == 1 and stepped.leased
    fields = coord.store.records.task_fields(child_id)
    assert fields["tool:lookup:ok"] == "1" and fields["tool:lookup:ms"] == "12"
    assert len(json.loads(fields["tool_calls"])) == 1
    assert coord.store.records.conversation(child_id) == conversation


def test_an_end_sent_again_after_it_ran_answers_as_it_did(
    idle_coordinator: Coordinator, rt: Runtime, lost: LostReplies, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = idle_coordinator
    parent_id, child_id = _child(coord, agent(reply("done")))
    closes = _closes(monkeypatch)
    lost.lose(_sha(rt.coordinator.store, "end_run"))

    # Before, the resend found the lease gone and answered 'fenced': the run raised LeaseLost, and its
    # caller never sent what the closed batch needs (the reconciler did, a grace period later).
    result = run_child(rt, child_id)

    assert lost.lost == 1
    assert result.status == "completed" and result.cost_micros == STEP_COST_MICROS
    assert [parent for parent, _, _ in closes] == [parent_id], "the end's caller heard the batch closed, and sent on"
    assert coord.get_todos(parent_id)[0].cost_micros == STEP_COST_MICROS, "written back once"
    assert coord.get_task(parent_id).total_cost_micros == STEP_COST_MICROS
    assert coord.store.records.task_fields(child_id)["deliveries"] == "1"


# The decision's own step; and the resume's claim it makes next (claim_resume.lua).
@pytest.mark.parametrize("step", ["decide", "claim_resume"])
def test_a_decision_sent_again_after_it_ran_stands_and_resumes_the_task_once(
    idle_coordinator: Coordinator, lost: LostReplies, step: str
) -> None:
    coord = idle_coordinator
    _retrying(coord.store)
    root = coord.create_task("asks first", run=False)
    approval = _risky_call(root.id)
    coord.store.approvals.save_approval(approval)
    lost.lose(_sha(coord.store, step))

    # Before, a decision's resend answered "already approved" (StateError) to the person who made it; a
    # claim's (HSETNX) answered 'claimed' to itself and the resume waited for the reconciler, and its count
    # (HINCRBY, sent on its own) counted a resend twice.
    decided = coord.decide(approval.id, "approve")

    assert lost.lost == 1
    assert decided.status == "approved"
    decisions = [f for _, f in coord.store.events.read_events(root.id) if f.get("type") == "approval"]
    assert [f["status"] for f in decisions] == ["approved"], "decided once"
    assert coord.client.llen(coord.settings.queue) == 1, "its resumed run was published, once"
    assert coord.store.records.task_fields(root.id)["resumes"] == "1"


def test_a_publish_claim_sent_again_after_it_ran_publishes_the_batch(
    idle_coordinator: Coordinator, lost: LostReplies
) -> None:
    coord = idle_coordinator
    _retrying(coord.store)
    parent = coord.create_task("two children", todos="[ ] a\n[ ] b")
    lost.lose("HSETNX", ":batch:", "published")

    # Before, the resend found the claim set and answered 'another publishes it': nothing was sent, and the
    # children waited for the reconciler.
    coord.delegate(parent.id, [{"description": "a", "message": "x"}, {"description": "b", "message": "y"}])

    assert lost.lost == 1
    assert coord.client.llen(coord.settings.queue) == 2, "both children were published, once"


@pytest.fixture(params=["an attempt", "the last attempt"])
def attempt(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which attempt of a transaction loses its reply: one with attempts after it, or the last (made the first
    here), after which the store ran no attempt more and said the state kept changing (ConflictError)."""
    if request.param == "the last attempt":
        monkeypatch.setattr(store_base, "MAX_TRANSACTION_ATTEMPTS", 1)
    return str(request.param)


def test_a_delegations_commit_whose_reply_was_lost_publishes_its_batch(
    idle_coordinator: Coordinator, lost: LostReplies, attempt: str
) -> None:
    """A delegation's commit is a WATCH/MULTI transaction, which redis-py does not send again: a connection lost
    while watching raises WatchError (with the client's retries or without), and the store runs the transaction
    again on the state it finds. Here the commit ran and its reply was lost: the parent it made `delegated` was
    then validated again and refused ("not active"), so its caller got an error for a delegation that stood,
    whose batch was never published, and its parent, taken off the due list by the refusal, waited for good.
    On the last attempt the store ran none again and answered ConflictError, with the same outcome."""
    coord = idle_coordinator
    parent = coord.create_task("two children", todos="[ ] a\n[ ] b")
    lost.lose("EXEC", "waiting_batch_id")

    batch = coord.delegate(parent.id, [{"description": "a", "message": "x"}, {"description": "b", "message": "y"}])

    assert lost.lost == 1
    record = coord.get_task(parent.id)
    assert (record.status, record.waiting_batch_id) == (TaskStatus.DELEGATED, batch.id)
    assert record.child_ids == batch.child_ids, "one batch, committed once"
    assert [i.subtask_id for i in coord.get_todos(parent.id)] == batch.child_ids, "each item linked once"
    assert coord.client.llen(coord.settings.queue) == 2, "both children were published"
    keys = coord.store.keys
    assert all(coord.client.zscore(keys.all_tasks(), c) for c in batch.child_ids), "the children are in the history"


def test_a_delegation_whose_every_attempt_conflicts_is_refused_and_writes_nothing(
    idle_coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of knowing a lost reply's commit: a delegation whose parent another client changed during
    each attempt, the last among them, committed nothing, and says so (its batch's id is its own: not there)."""
    coord = idle_coordinator
    parent = coord.create_task("two children", todos="[ ] a\n[ ] b")
    parent_key = coord.store.keys.task(parent.root_id, parent.id)
    monkeypatch.setattr(store_base, "MAX_TRANSACTION_ATTEMPTS", 2)
    read = coord.store.batches._read_watched
    changes: list[int] = []

    def read_then_changed(pipe: Any, task_id: str, token: str = "") -> Any:
        got = read(pipe, task_id, token)
        changes.append(int(coord.client.hincrby(parent_key, "conflicts", 1)))  # another client's write, watched
        return got

    monkeypatch.setattr(coord.store.batches, "_read_watched", read_then_changed)

    with pytest.raises(ConflictError, match="kept changing"):
        coord.delegate(parent.id, [{"description": "a", "message": "x"}, {"description": "b", "message": "y"}])

    assert changes == [1, 2], "both attempts ran, and each met a change"
    record = coord.get_task(parent.id)
    assert (record.status, record.waiting_batch_id, record.child_ids) == (TaskStatus.ACTIVE, None, [])
    assert [(i.content, i.subtask_id) for i in coord.get_todos(parent.id)] == [("a", None), ("b", None)]
    assert coord.client.llen(coord.settings.queue) == 0, "no child was published"


def test_an_agents_delegation_whose_commit_reply_was_lost_is_its_own(
    rt: Runtime, lost: LostReplies, attempt: str
) -> None:
    """The same from an agent's run (its delegation tool): before, the tool answered the model "no subtask was
    created" while the child was committed, and the batch stayed unpublished, its child `queued` for good."""
    coord = rt.coordinator
    root = coord.create_task("an agent's root", run=True)
    run = _started(rt, root.id)
    lost.lose("EXEC", "waiting_batch_id")

    batch, children = run.plan.delegate([SubtaskSpec(description="a", message="do a")], "parallel", "call-1")

    assert lost.lost == 1
    record = coord.get_task(root.id)
    assert record.waiting_batch_id == batch.id and record.child_ids == [c.id for c in children] == batch.child_ids


def test_a_roots_creation_whose_reply_was_lost_publishes_its_run_and_lists_it(
    idle_coordinator: Coordinator, lost: LostReplies, attempt: str
) -> None:
    """A root's creation is a WATCH/MULTI transaction too: its reply lost after it ran, the transaction ran again,
    found the task there and answered "not created". Its caller then published no run (the reconciler did, a
    grace later) and left the root out of the history's indexes for good."""
    coord = idle_coordinator
    lost.lose("EXEC", "todos_version")

    record, created = coord.create_task_once("an agent's root", run=True)

    assert lost.lost == 1
    assert created, "this call wrote it"
    assert coord.client.llen(coord.settings.queue) == 1, "its run was published at once"
    keys = coord.store.keys
    assert coord.client.zscore(keys.all_tasks(), record.id) and coord.client.zscore(keys.roots(), record.id), (
        "it is in the history, among its roots"
    )


def test_a_chain_steps_publish_claim_sent_again_after_it_ran_publishes_the_step(
    idle_coordinator: Coordinator, rt: Runtime, lost: LostReplies
) -> None:
    coord = idle_coordinator
    parent = coord.create_task("a chain", todos="[ ] a\n[ ] b")
    steps = [{"description": "a", "message": agent(reply("a done"))}, {"description": "b", "message": "y"}]
    first, second = coord.delegate(parent.id, steps, mode="sequential").child_ids
    assert coord.client.llen(coord.settings.queue) == 1, "the chain's first step"
    lost.lose("HSETNX", second, "published")

    assert run_child(rt, first).status == "completed"  # its end starts the next step

    assert lost.lost == 1
    assert coord.client.llen(coord.settings.queue) == 2, "the second step was published, once"


def test_a_close_sent_again_after_it_ran_resumes_the_parent(
    idle_coordinator: Coordinator, rt: Runtime, lost: LostReplies, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain's last step closes its batch with close_batch alone (not inside the step's end)."""
    coord = idle_coordinator
    parent = coord.create_task(agent(reply("resumed")), todos="[ ] a", run=False)
    (only,) = coord.delegate(
        parent.id, [{"description": "a", "message": agent(reply("a done"))}], "sequential"
    ).child_ids
    closes = _closes(monkeypatch)
    lost.lose(_sha(rt.coordinator.store, "close_batch"))

    # Before, the resend found the batch done and answered 'closed before': the parent's resume waited for
    # the reconciler.
    assert run_child(rt, only).status == "completed"

    assert lost.lost == 1
    assert [parent_id for parent_id, _, _ in closes] == [parent.id], "the close's caller went on to resume it"
    assert coord.store.records.task_fields(parent.id)["resumes"] == "1"
    assert coord.get_task(parent.id).status == TaskStatus.ACTIVE


def test_a_settle_sent_again_after_it_ran_closes_the_batch_for_its_caller(
    idle_coordinator: Coordinator, lost: LostReplies, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child ended outside its run's end (a stop, a redelivery of an ended task) is settled alone."""
    coord = idle_coordinator
    _retrying(coord.store)
    parent_id, child_id = _child(coord, agent(reply("done")))
    coord.store.client.hset(coord.store.keys.task(parent_id, child_id), "status", "completed")
    closes = _closes(monkeypatch)
    lost.lose(_sha(coord.store, "settle_child"))

    batch_id = coord.get_task(parent_id).waiting_batch_id
    assert batch_id and writeback.write_back(coord.plane, batch_id, ended=coord.get_task(child_id))

    assert lost.lost == 1
    assert [parent_id for parent_id, _, _ in closes] == [parent_id]
    assert coord.store.records.task_fields(parent_id)["resumes"] == "1"


def test_an_approvals_request_sent_again_after_it_ran_sends_its_event_once(
    idle_coordinator: Coordinator, lost: LostReplies
) -> None:
    coord = idle_coordinator
    _retrying(coord.store)
    root = coord.create_task("asks first", webhooks=[{"url": "https://example.com/hook"}])
    approval = _risky_call(root.id)
    lost.lose(_sha(coord.store, "save_approval"))

    coord.store.approvals.save_approval(approval)  # before: a MULTI whose resend wrote the event again

    assert lost.lost == 1
    requested = [d for d in coord.store.outbox.deliveries(root.id) if d.get("type") == "approval.requested"]
    assert len(requested) == 1, coord.store.outbox.deliveries(root.id)
    assert coord.store.approvals.get_approval(approval.id).status == "pending"
    assert approval.id in coord.store.approvals.pending_approval_ids()


def test_a_delayed_start_sent_again_after_it_ran_reserves_one_stagger(
    idle_coordinator: Coordinator, lost: LostReplies
) -> None:
    coord, stagger = idle_coordinator, AdmissionLimits(stagger_ms=60_000)
    _retrying(coord.store)
    parent = coord.create_task("three children", todos="[ ] a\n[ ] b\n[ ] c")
    specs = [{"description": d, "message": "m"} for d in "abc"]
    first, second, third = coord.delegate(parent.id, specs).child_ids

    def start(task_id: str) -> Any:
        return coord.store.runs.begin_run(task_id, secrets.token_hex(8), 60, 30, stagger, NO_FAIR_SHARES)

    assert start(first).verdict == "run"
    lost.lose(_sha(coord.store, "start_run"))

    # Before, the resend reserved the tree's next start a second time: it waited two staggers, and every later
    # start of the tree one more.
    delayed = start(second)

    assert lost.lost == 1
    assert delayed.verdict == "delay" and 0 < delayed.delay_ms <= 60_000
    later = start(third)
    assert later.verdict == "delay" and 60_000 < later.delay_ms <= 120_000, "one stagger after the second"


def test_a_parked_start_sent_again_after_it_ran_gives_one_slot_away(
    fair_prefix: Coordinator, lost: LostReplies
) -> None:
    """b (weight 1) holds 3 slots, a (weight 3) 1 with two parked: b's next arrival parks and gives its slot to
    a's first parked run, once."""
    coord = fair_prefix
    store, shares = coord.store, FairShares(on=True, capacity=8)
    _retrying(store)
    store.convergence.renew_leases([], 30, "w1")
    store.fair.beat("w1", shares.capacity, 30, {"a": (3, 0), "b": (1, 0), "*": (1, 0)})

    def children(tenant: str, n: int) -> list[str]:
        root = coord.create_task(f"{tenant} root")
        coord.client.hset(store.keys.task(root.id, root.id), TaskField.TENANT, tenant)
        return coord.delegate(root.id, [{"description": f"{tenant}{i}", "message": "m"} for i in range(n)]).child_ids

    def start(task_id: str) -> Any:
        return store.runs.begin_run(task_id, secrets.token_hex(8), 60, 30, AdmissionLimits(), shares)

    b_runs = children("b", 4)
    assert [start(t).verdict for t in b_runs[:3]] == ["run"] * 3
    a_runs = children("a", 3)
    store.fair.announce("a", a_runs)  # published: a's demand
    assert start(a_runs[0]).verdict == "run"
    store.client.zadd(store.keys.tenant_parked("a"), {a_runs[1]: 0, a_runs[2]: 1})  # as their starts park them
    lost.lose(_sha(store, "start_run"))

    # Before, the resend parked again and gave a second slot away (a_runs[2]), while the first one given it
    # went with the lost reply and waited, unpublished, for the reconciler.
    parked = start(b_runs[3])

    assert lost.lost == 1
    assert (parked.verdict, parked.parked_for, parked.admitted) == ("park", "share", [a_runs[1]])
    assert store.fair.counts("a").running == 2, "one slot given away"


def test_a_cancel_sent_again_after_it_ran_stops_and_writes_back_its_subtree(
    idle_coordinator: Coordinator, lost: LostReplies, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = idle_coordinator
    _retrying(coord.store)
    parent_id, child_id = _child(coord, agent(reply("never runs")))
    closes = _closes(monkeypatch)
    lost.lose(_sha(coord.store, "stop_tasks"))

    # Before, the resend found the child cancelled and answered 'none stopped now': the cancel returned early,
    # revoked nothing, and its parent's batch was not written back until the reconciler came by.
    cancelled = coord.cancel(child_id, "not needed")

    assert lost.lost == 1
    assert cancelled.status == TaskStatus.CANCELLED
    assert [parent for parent, _, _ in closes] == [parent_id], "the child's batch was closed for its parent"
    statuses = [f for _, f in coord.store.events.read_events(parent_id) if f.get("type") == "task_status"]
    assert [(f["task_id"], f["status"]) for f in statuses] == [(child_id, "cancelled")], "stopped once"


def test_a_retry_sent_again_after_it_ran_answers_as_it_did(idle_coordinator: Coordinator, lost: LostReplies) -> None:
    coord = idle_coordinator
    _retrying(coord.store)
    root = coord.create_task(agent({"fail": "refused once"}), run=True)
    runtime = build_runtime(coord.settings, make_app(coord.settings))
    try:
        assert run_child(runtime, root.id).status == "failed"
    finally:
        runtime.coordinator.close()
    coord.client.delete(coord.settings.queue)
    lost.lose(_sha(coord.store, "retry"))

    # Before, the resend found the task active and was refused: the person who retried it read "only a failed
    # task can be retried", and its run waited for the reconciler.
    retried = coord.retry(root.id)

    assert lost.lost == 1
    assert retried.retried == [root.id]
    assert coord.get_task(root.id).status == TaskStatus.ACTIVE
    assert coord.store.records.task_fields(root.id)["retries"] == "1", "retried once"
    assert coord.client.llen(coord.settings.queue) == 1, "its run was published, once"


def test_a_slots_release_sent_again_after_it_ran_admits_the_waiting_run_for_its_caller(
    idle_coordinator: Coordinator, lost: LostReplies
) -> None:
    """A run that releases its worker (delegated, waiting for a decision) frees its slot with release_slot alone."""
    coord, one_each = idle_coordinator, AdmissionLimits(per_parent=1)
    _retrying(coord.store)
    parent = coord.create_task("two children", todos="[ ] a\n[ ] b")
    first, second = coord.delegate(parent.id, [{"description": d, "message": "m"} for d in "ab"]).child_ids
    runs = coord.store.runs
    assert runs.begin_run(first, secrets.token_hex(8), 60, 30, one_each, NO_FAIR_SHARES).verdict == "run"
    assert runs.begin_run(second, secrets.token_hex(8), 60, 30, one_each, NO_FAIR_SHARES).verdict == "wait"
    lost.lose(_sha(coord.store, "release_slot"))

    # Before, the resend found the waiting run gone from the list and admitted nothing: its run was never
    # published, and waited for the reconciler.
    admitted = runs.release_slot(coord.get_task(first), one_each)

    assert lost.lost == 1
    assert admitted == [second]


def test_a_runs_release_sent_again_after_it_ran_still_frees_its_slot(
    idle_coordinator: Coordinator, lost: LostReplies
) -> None:
    """A run frees its slots only when its lease's release says the run was the task's last (a run taken over
    frees nothing of the newer one's). The release sent again after it ran finds the lease gone, and still says
    so: else a delegated parent kept its slot while it waited on its children, who waited on the slot."""
    coord, one_each = idle_coordinator, AdmissionLimits(per_parent=1)
    _retrying(coord.store)
    parent = coord.create_task("two children", todos="[ ] a\n[ ] b")
    first, second = coord.delegate(parent.id, [{"description": d, "message": "m"} for d in "ab"]).child_ids
    runs, token = coord.store.runs, secrets.token_hex(8)
    assert runs.begin_run(first, token, 60, 30, one_each, NO_FAIR_SHARES).verdict == "run"
    lost.lose(_sha(coord.store, "release_lease"))

    assert runs.release_lease(first, token) is True, "this run's own release, answered again"
    assert lost.lost == 1
    assert not coord.client.exists(coord.store.keys.lease(parent.id, first))
    # Once another run of the task has started, a late release of the first answers that it is not the last.
    assert runs.begin_run(first, secrets.token_hex(8), 60, 30, one_each, NO_FAIR_SHARES).verdict == "run"
    assert runs.release_lease(first, token) is False
    assert runs.begin_run(second, secrets.token_hex(8), 60, 30, one_each, NO_FAIR_SHARES).verdict == "wait"


def _one_running_one_parked(coord: Coordinator, shares: FairShares) -> tuple[str, str]:
    """Two children on a fleet of `shares.capacity` (1) slot, over connections that resend: the first runs, the
    second is parked for the slot."""
    store = coord.store
    _retrying(store)
    store.convergence.renew_leases([], 30, "w1")
    store.fair.beat("w1", shares.capacity, 30, {"*": (1, 0)})
    root = coord.create_task("a root")
    first, second = coord.delegate(root.id, [{"description": d, "message": "m"} for d in "ab"]).child_ids
    assert store.runs.begin_run(first, secrets.token_hex(8), 60, 30, AdmissionLimits(), shares).verdict == "run"
    parked = store.runs.begin_run(second, secrets.token_hex(8), 60, 30, AdmissionLimits(), shares)
    assert (parked.verdict, parked.parked_for) == ("park", "fleet"), "the fleet's one slot is held"
    return first, second


def test_a_fleet_slots_release_sent_again_after_it_ran_gives_the_parked_run_for_its_caller(
    fair_prefix: Coordinator, lost: LostReplies
) -> None:
    coord, shares = fair_prefix, FairShares(on=True, capacity=1)
    store = coord.store
    first, second = _one_running_one_parked(coord, shares)
    lost.lose(_sha(store, "fair_release"))

    # Before, the resend found the slot already given and gave nothing: the parked run held it, unpublished,
    # until the reconciler came by.
    given = store.fair.release(first, shares)

    assert lost.lost == 1
    assert given == [second]


def test_a_stops_withdrawal_sent_again_after_it_ran_gives_the_parked_run_for_its_caller(
    fair_prefix: Coordinator, lost: LostReplies
) -> None:
    """A stop takes its runs out of their tenant's demand and gives the free slots on (fair_withdraw.lua)."""
    coord, shares = fair_prefix, FairShares(on=True, capacity=1)
    store = coord.store
    _, second = _one_running_one_parked(coord, shares)
    store.fair.beat("w1", 2, 30, {"*": (1, 0)})  # the fleet grew: a slot is free for the next hand-over
    stopped = coord.create_task("another root").id
    lost.lose(_sha(store, "fair_withdraw"))

    # Before, the resend found the slot already given and answered nothing: the run given it held it, unpublished,
    # until the reconciler came by.
    given = store.fair.withdraw(coord.get_task(stopped).tenant, [stopped], shares)

    assert lost.lost == 1
    assert given == [second]


def test_the_fair_share_pass_sent_again_after_it_ran_answers_the_runs_it_started(
    fair_prefix: Coordinator, lost: LostReplies
) -> None:
    """The reconciler's pass (fair_heal.lua) gave the fleet's free slot to the parked run and its reply was lost:
    the resend found nothing parked and answered nothing, so the run held its slot unpublished until the
    reconciler's grace ran out. The pass keeps its answer under its call's mark for the resend."""
    coord, shares = fair_prefix, FairShares(on=True, capacity=1)
    store = coord.store
    _, second = _one_running_one_parked(coord, shares)
    store.fair.beat("w1", 2, 30, {"*": (1, 0)})  # the fleet grew: a slot is free for the pass to give
    lost.lose(_sha(store, "fair_heal"))

    healed = store.fair.heal(shares, 30, 100)

    assert lost.lost == 1
    assert healed.started == [second]
    marks = list(coord.client.scan_iter(store.keys.fair_heal_mark("*")))
    assert len(marks) == 1 and 0 < coord.client.ttl(marks[0]) <= RESEND_MARK_S, "kept for the resend, not for good"
    assert store.fair.heal(shares, 30, 100) == FairHealed(), "another pass, a call of its own, gives nothing more"


def test_a_rate_limits_count_sent_again_after_it_ran_lets_its_request_start(
    idle_coordinator: Coordinator, lost: LostReplies
) -> None:
    coord = idle_coordinator
    _retrying(coord.store)
    provider = f"provider-{secrets.token_hex(3)}"
    lost.lose(_sha(coord.store, "rate_limit"))

    # Before, the resend found the window's one place taken, by this very request, and answered "wait": the
    # request waited out the window though it was counted.
    wait_ms = coord.store.runs.wait_for_rate(provider, 1)

    assert lost.lost == 1
    assert wait_ms == 0
    assert coord.client.zcard(coord.store.keys.rate(provider)) == 1, "counted once"
    assert coord.store.runs.wait_for_rate(provider, 1) > 0, "the window's one place is its"


def test_a_transient_errors_count_sent_again_after_it_ran_counts_once(
    idle_coordinator: Coordinator, rt: Runtime, lost: LostReplies
) -> None:
    """A run counts its provider's transient errors on its task (count_transient.lua). Before, the resend added
    them again: the record's `transient_errors`, and the attempt number its wait's message shows, one higher."""
    coord = idle_coordinator
    _retrying(coord.store)
    _, child_id = _child(coord, script(usage_step()))
    run = _started(rt, child_id)
    lost.lose(_sha(coord.store, "count_transient"))

    counted = coord.store.endpoints.count_transient_errors(child_id, 1, run.token)

    assert lost.lost == 1
    assert counted is not None and (counted.total, counted.attempts) == (1, 1), counted
    assert coord.get_task(child_id).transient_errors == 1, "counted once"
    again = coord.store.endpoints.count_transient_errors(child_id, 1, run.token)
    assert again is not None and (again.total, again.attempts) == (2, 2), "a new call counts"


def test_an_audit_entry_sent_again_after_its_reply_was_lost_is_kept_once(
    idle_coordinator: Coordinator, lost: LostReplies
) -> None:
    """An audit entry and its refusal's count are one step (audit_add.lua). Before, they were a MULTI with no WATCH,
    which a Sentinel client sends again whole: the entry was on the log twice, and the refusal counted twice."""
    coord = idle_coordinator
    _retrying(coord.store)
    target = f"resend-{secrets.token_hex(4)}"
    refused = coord.store.audit.refused_counts().get("bad_token", 0)
    lost.lose(_sha(coord.store, "audit_add"), target)

    coord.store.audit.add(Actor("someone", "10.0.0.1", "api"), "refused", target, reason="bad_token")

    assert lost.lost == 1
    entries, _ = coord.store.audit.page(50)
    assert [e.target for e in entries].count(target) == 1, "on the log once"
    assert coord.store.audit.refused_counts()["bad_token"] == refused + 1, "counted once"
    marks = coord.client.keys(coord.store.keys.audit_mark("*"))
    assert marks and not set(marks) & set(coord.store.metrics.snapshot()), "a mark lapses on its own: not state"
    coord.store.audit.add(Actor("someone", "10.0.0.1", "api"), "refused", target, reason="bad_token")
    entries, _ = coord.store.audit.page(50)
    assert [e.target for e in entries].count(target) == 2, "a new entry is its own"


def test_a_dead_letter_sent_again_after_its_reply_was_lost_is_kept_once(
    idle_coordinator: Coordinator, lost: LostReplies
) -> None:
    """A dead letter was a MULTI with no WATCH, which a Sentinel client sends again whole: the message was on the
    list twice. Now the list keeps each message once (dead_letter_add.lua)."""
    coord = idle_coordinator
    _retrying(coord.store)
    coord.purge_dead_letters()
    raw = f'{{"not": "a message {secrets.token_hex(4)}"}}'
    entry = dead_letter("subq-nobody", "the queue entry is not a kombu message", raw)
    lost.lose(_sha(coord.store, "dead_letter_add"))

    # (The resend finds the message on the list and answers so: the caller logs that it was kept once.)
    coord.record_dead_letter(entry, message_digest(raw))

    assert lost.lost == 1
    assert coord.dead_letters(10) == [entry], "on the list once"
    later = dead_letter("subq-nobody", "read again", raw)
    assert not coord.record_dead_letter(later, message_digest(raw)), "the same message, on the list already"
    other = dead_letter("subq-nobody", "the queue entry is not JSON", raw + " ")
    assert coord.record_dead_letter(other, message_digest(other.message))
    assert coord.dead_letters(10) == [other, entry]
    assert coord.purge_dead_letters() == 2
    assert coord.record_dead_letter(later, message_digest(raw)), "a purged message is kept again"
    coord.purge_dead_letters()


def test_an_endpoints_recovery_sent_again_after_its_reply_was_lost_wakes_its_parked_runs(
    idle_coordinator: Coordinator, lost: LostReplies
) -> None:
    """A request to a provider that was down was answered: its views are forgotten and the runs parked on them taken
    off their lists, to wake now (endpoint_recovered.lua). Before, a delete and a MULTI: the resend found the views
    up and the lists gone, answered no task, and the parked runs waited out their timers though it was back."""
    coord = idle_coordinator
    _retrying(coord.store)
    store = coord.store.endpoints
    endpoint = f"127.0.0.1:{secrets.randbelow(50_000) + 10_000}"
    store.failed(endpoint, "", "HTTP 503", base_ms=1000, cap_ms=2000, jitter=0.0, asked_ms=None, keep_ms=60_000)
    parked = coord.create_task("parked while its provider is down")
    store.park(endpoint, "", parked.id, f"provider-wait:{parked.id}", time.time() + 3600, 1234, 60)
    lost.lose(_sha(coord.store, "endpoint_recovered"))

    woken = store.recovered(endpoint, "openai:test-model")

    assert lost.lost == 1
    assert woken == [parked.id], "the resend answers the tasks the first send took off the list"
    assert store.state(endpoint) == {} and store.recovered(endpoint) == [], "once"
