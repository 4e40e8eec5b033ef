"""The deliverer's batches on a real Redis (coordinator/outbound.py, OutboxStore.settle_and_claim: one
settle_and_claim.lua call a batch): the outcomes of a batch are recorded once each, even when the server
has forgotten the scripts (NOSCRIPT), and a claim takes each due delivery once; an event's fields of a
record, read with the claim, read as the whole record does; a claimed delivery already settled or of an
expired tree leaves the index unread; a host name is resolved and checked by a helper thread, at each
attempt.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from coordinator import Coordinator, Settings
from coordinator.errors import StoreError
from coordinator.models import Usage
from coordinator.outbound import Deliverer, payload
from coordinator.store.outbox import EVENT_FIELDS, Settled
from tests.helpers import eventually, step_until
from tests.test_webhooks_connections import RawReceiver

LEASE_MS = 60_000


@pytest.fixture
def outbox_coord(settings: Settings) -> Coordinator:
    return Coordinator(
        settings.model_copy(update={"queue": "subq-nobody", "key_prefix": "subqbatch", "webhook_allow": ["127.0.0.1"]})
    )


def test_a_batch_is_settled_once_each_even_after_the_scripts_were_forgotten(outbox_coord: Coordinator) -> None:
    coord = outbox_coord
    outbox = coord.store.outbox
    root = coord.create_task("Say hello.", webhooks=[{"url": "http://127.0.0.1:9/hook", "events": ["*"]}])
    for _ in range(3):
        outbox.add_event(root.id, root.id, "task.completed", {})
    claimed = [c for c in outbox.settle_and_claim([], 10, LEASE_MS) if c.root_id == root.id]
    assert len(claimed) == 3
    assert [c for c in outbox.settle_and_claim([], 10, LEASE_MS) if c.root_id == root.id] == []  # held by the lease
    coord.client.script_flush()  # a restarted server or a promoted replica: NOSCRIPT for every call
    outcomes = [
        Settled(root.id, claimed[0].delivery_id, "delivered", last="HTTP 204"),
        Settled(root.id, claimed[1].delivery_id, "retrying", last="HTTP 503", next_at=0.0),
        Settled(root.id, claimed[2].delivery_id, "gone", last="HTTP 410"),
    ]
    outbox.settle_and_claim(outcomes, 0, LEASE_MS)
    states = {d["id"]: (d["state"], d["attempts"], d["last"]) for d in outbox.deliveries(root.id)}
    assert states == {
        claimed[0].delivery_id: ("delivered", 1, "HTTP 204"),
        claimed[1].delivery_id: ("retrying", 1, "HTTP 503"),
        claimed[2].delivery_id: ("gone", 1, "HTTP 410"),
    }
    # The retrying one is due again (next_at 0); the delivered and gone ones are off the pending index.
    assert [c.delivery_id for c in outbox.settle_and_claim([], 10, LEASE_MS) if c.root_id == root.id] == [
        claimed[1].delivery_id
    ]
    for key in coord.client.scan_iter("subqbatch:*"):
        coord.client.delete(key)
    coord.close()


def test_each_claim_keeps_what_the_next_attempt_reads(outbox_coord: Coordinator) -> None:
    """A delivery retried past its tree's retention (the receiver down, a short SUBQ_RESULT_RETENTION_S, an
    operator's redeliver) found the subscriptions and the task's record it reads lapsed, and ended `gone` or
    `given_up` with nothing wrong. Each claim now gives both a retention again."""
    coord = outbox_coord
    outbox, keys = coord.store.outbox, coord.store.keys
    try:
        root = coord.create_task("Say hello.", webhooks=[{"url": "http://127.0.0.1:9/hook", "events": ["*"]}])
        outbox.add_event(root.id, root.id, "task.completed", {})
        hooks, record = keys.hooks(root.id), keys.task(root.id, root.id)
        for key in (hooks, record):
            coord.client.expire(key, 5)  # most of the retention gone while the receiver was down
        (claimed,) = [c for c in outbox.settle_and_claim([], 10, LEASE_MS) if c.root_id == root.id]
        assert claimed.record is not None and claimed.found is not None
        retention_s = coord.settings.result_retention_s
        assert [coord.client.ttl(k) > retention_s - 60 for k in (hooks, record)] == [True, True]
    finally:
        for key in coord.client.scan_iter("subqbatch:*"):
            coord.client.delete(key)
        coord.close()


def test_a_named_host_is_resolved_by_a_helper_and_checked_at_each_attempt(settings: Settings) -> None:
    """The deliverer's loop hands a host name to a helper thread (DNS may block), which checks what it
    resolves to: `localhost` allowed by name is delivered; `localhost` not allowed is refused, retrying."""
    # Where the deliverer will connect: the first address the name resolves to (127.0.0.1 or ::1).
    receiver = RawReceiver(host=str(socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)[0][4][0]))
    coord = Coordinator(
        settings.model_copy(update={"queue": "subq-nobody", "key_prefix": "subqnamed", "webhook_allow": ["localhost"]})
    )
    stop = threading.Event()
    try:
        allowed = coord.create_task(
            "Say hello.", webhooks=[{"url": f"http://localhost:{receiver.port}/in", "events": ["*"]}]
        )
        for _ in range(3):
            coord.store.outbox.add_event(allowed.id, allowed.id, "task.completed", {})
        deliverer = Deliverer(coord, lambda *_: None)
        threading.Thread(target=deliverer.run_forever, args=(stop,), daemon=True).start()
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and any(
            d["state"] != "delivered" for d in coord.store.outbox.deliveries(allowed.id)
        ):
            time.sleep(0.1)
        assert [d["state"] for d in coord.store.outbox.deliveries(allowed.id)] == ["delivered"] * 3
        assert len(receiver.requests) == 3 and all(b"host: localhost:" in head for head in receiver.requests)
        # The same name, no longer allowed (the check runs at each attempt, not only at creation).
        deliverer.settings = deliverer.settings.model_copy(update={"webhook_allow": []})
        coord.store.outbox.add_event(allowed.id, allowed.id, "task.completed", {})
        while time.monotonic() < deadline and not any(
            d["state"] == "retrying" for d in coord.store.outbox.deliveries(allowed.id)
        ):
            time.sleep(0.1)
        refused = [d for d in coord.store.outbox.deliveries(allowed.id) if d["state"] == "retrying"]
        assert len(refused) == 1 and refused[0]["last"].startswith("refused: localhost resolves to"), refused
        assert len(receiver.requests) == 3
    finally:
        stop.set()
        receiver.stop()
        for key in coord.client.scan_iter("subqnamed:*"):
            coord.client.delete(key)
        coord.close()


def test_a_stored_host_the_resolver_cannot_be_asked_is_refused_and_frees_its_slot(settings: Settings) -> None:
    """A subscription stored before its URL's host was checked at creation (an empty label: Python's resolver
    raises UnicodeError, not OSError): each attempt is refused, retrying, with a line that names the host, and
    gives its slot back. Before, the helper's exception was lost with its future and the slot with it: once
    every slot was taken so, the deliverer claimed nothing more, for any tree."""
    coord = Coordinator(
        settings.model_copy(
            update={"queue": "subq-nobody", "key_prefix": "subqbadhost", "webhook_allow": ["127.0.0.1"]}
        )
    )
    deliverer = Deliverer(coord, lambda *_: None)
    deliverer.slots = 1
    try:
        bad = coord.create_task("Say hello.", webhooks=[{"url": "http://127.0.0.1:9/in", "events": ["*"]}])
        hooks = coord.store.keys.hooks(bad.id)
        stored = json.loads(coord.client.hget(hooks, "s:0"))
        coord.client.hset(hooks, "s:0", json.dumps({**stored, "url": "https://hooks..example.com/in"}))
        fine = coord.create_task("Say hello.", webhooks=[{"url": "http://127.0.0.1:9/in", "events": ["*"]}])
        coord.store.outbox.add_event(bad.id, bad.id, "task.completed", {})
        step_until(deliverer, lambda: [d["state"] for d in coord.store.outbox.deliveries(bad.id)] == ["retrying"])
        ((state, last),) = [(d["state"], d["last"]) for d in coord.store.outbox.deliveries(bad.id)]
        assert state == "retrying" and "names no valid host ('hooks..example.com'" in last, last
        assert deliverer._busy == 0, "its slot given back"
        coord.store.outbox.add_event(fine.id, fine.id, "task.completed", {})
        step_until(deliverer, lambda: [d["attempts"] for d in coord.store.outbox.deliveries(fine.id)] == [1])
        assert [d["attempts"] for d in coord.store.outbox.deliveries(fine.id)] == [1], "the next one is attempted"
    finally:
        deliverer._connections.close()
        for key in coord.client.scan_iter("subqbadhost:*"):
            coord.client.delete(key)
        coord.close()


def test_an_events_fields_of_a_record_are_read_with_its_claim_as_the_whole_record_reads_them(
    outbox_coord: Coordinator,
) -> None:
    """The deliverer's step reads, with its claim, a few fields of each task's hash (read_claimed.lua,
    OutboxStore.settle_and_claim), not the whole record: each must read as GET /v1/tasks/{id} returns it, the
    payload's figures included; a task that has expired reads as None."""
    coord = outbox_coord
    hooks = [{"url": "http://127.0.0.1:9/hook", "events": ["*"]}]
    root = coord.create_task("Plan.", metadata={"job": "j-42"}, webhooks=hooks)
    (child,) = coord.delegate(root.id, [{"description": "spender", "message": "Spend."}]).child_ids
    coord.store.runs.record_usage(child, "r:1", Usage(tokens_in=120, tokens_out=30), 4_100, "test")
    coord.client.hset(
        coord.store.keys.task(root.id, child), mapping={"output": '{"total":3,"names":["a"]}', "summary": "<b>x</b>"}
    )
    bare = coord.create_task("Say hello.", webhooks=hooks)
    coord.client.hset(coord.store.keys.task(bare.id, bare.id), mapping={"metadata": "", "output": ""})
    gone = coord.create_task("Expired.", webhooks=hooks)
    coord.client.delete(coord.store.keys.task(gone.id, gone.id))
    for root_id, task_id in ((root.id, root.id), (root.id, child), (bare.id, bare.id), (gone.id, gone.id)):
        coord.store.outbox.add_event(root_id, task_id, "task.completed", {})
    claimed = coord.store.outbox.settle_and_claim([], 100, LEASE_MS)
    found = {str(c.entry["task_id"]): c.record for c in claimed if c.root_id in (root.id, bare.id, gone.id)}
    assert sorted(found) == sorted([root.id, child, bare.id, gone.id]) and found[gone.id] is None
    for task_id in (root.id, child, bare.id):
        whole = coord.get_task(task_id).model_dump(mode="json")
        assert found[task_id] == {name: whole[name] for name in EVENT_FIELDS}, task_id
    record = found[child]
    assert record is not None and record["output"] == {"total": 3, "names": ["a"]} and record["tokens_in"] == 120
    body = payload({"type": "task.completed", "task_id": child, "event_id": "evt_1", "ts": 1.0}, record)
    assert (body["data"]["tokens_in"], body["data"]["tokens_out"], body["data"]["cost_micros"]) == (120, 30, 4_100)
    assert body["data"]["tokens"] == record["total_tokens"] == 150
    bare_record = found[bare.id]
    assert bare_record is not None and (bare_record["metadata"], bare_record["output"]) == ({}, None)
    for key in coord.client.scan_iter("subqbatch:*"):
        coord.client.delete(key)
    coord.close()


def test_a_claimed_delivery_settled_or_of_an_expired_tree_leaves_the_index_unread(outbox_coord: Coordinator) -> None:
    """A claim that finds a delivery already settled (a claim that outlived its lease, taken twice) or whose
    tree's outbox has expired takes it off the pending index and hands it to no attempt."""
    coord = outbox_coord
    outbox, pending = coord.store.outbox, coord.store.keys.outbox_pending()
    hooks = [{"url": "http://127.0.0.1:9/hook", "events": ["*"]}]
    settled, expired, due = (coord.create_task("Say hello.", webhooks=hooks) for _ in range(3))
    for task in (settled, expired, due):
        outbox.add_event(task.id, task.id, "task.completed", {})
    (delivery,) = outbox.deliveries(settled.id)
    assert outbox.settle(settled.id, delivery["id"], "delivered", last="HTTP 204") == "delivered"
    coord.client.zadd(pending, {f"{settled.id} {delivery['id']}": 0})  # as a second claim finds it
    coord.client.delete(coord.store.keys.outbox(expired.id))
    claimed = outbox.settle_and_claim([], 100, LEASE_MS)
    assert [c.root_id for c in claimed] == [due.id]
    assert [m.partition(" ")[0] for m in coord.client.zrange(pending, 0, -1)] == [due.id]
    for key in coord.client.scan_iter("subqbatch:*"):
        coord.client.delete(key)
    coord.close()


def test_a_claimed_delivery_whose_data_does_not_decode_is_given_up_and_the_batch_settled_once(
    settings: Settings,
) -> None:
    """The claim's reads are decoded after settle_and_claim.lua has settled the step's outcomes: one claimed
    delivery whose stored data does not decode (here its task's int field) is given up with the reason, the
    rest of its claim goes on, and the outcomes the script settled are not put back to be settled again
    (review V4, item 3: they were, each attempt counted twice)."""
    coord = Coordinator(
        settings.model_copy(
            update={"queue": "subq-nobody", "key_prefix": "subqrefused", "webhook_allow": ["127.0.0.1"]}
        )
    )
    outbox, hooks = coord.store.outbox, [{"url": "http://127.0.0.1:9/hook", "events": ["*"]}]
    deliverer = Deliverer(coord, lambda *_: None)
    try:
        first = coord.create_task("Say hello.", webhooks=hooks)
        outbox.add_event(first.id, first.id, "task.completed", {})
        (claimed,) = outbox.settle_and_claim([], 10, LEASE_MS)
        broken = coord.create_task("Broken.", webhooks=hooks)
        outbox.add_event(broken.id, broken.id, "task.completed", {})
        coord.client.hset(coord.store.keys.task(broken.id, broken.id), "tokens_in", "1.5")  # not an int
        retry_at = time.time() + 600
        deliverer._ended = [Settled(first.id, claimed.delivery_id, "retrying", last="HTTP 503", next_at=retry_at)]
        assert deliverer.step() == 1, "the step does not raise: the broken delivery is claimed, and given up"
        assert [e["attempts"] for e in outbox.deliveries(first.id)] == [1]
        (given_up,) = deliverer._ended
        assert (given_up.root_id, given_up.state) == (broken.id, "given_up")
        assert given_up.last.startswith("its stored data does not decode: ValueError"), given_up.last
        assert given_up.attempts == 0, "recorded against the attempts its claim read (its entry decoded)"
        deliverer.step()
        assert [e["attempts"] for e in outbox.deliveries(first.id)] == [1], "settled once"
        ((state, attempts, last),) = [(e["state"], e["attempts"], e["last"]) for e in outbox.deliveries(broken.id)]
        assert (state, attempts, last) == ("given_up", 1, given_up.last)
        assert outbox.counts() == {("task.completed", "retrying"): 1, ("task.completed", "given_up"): 1}
        outbox.settle_and_claim([given_up], 10, LEASE_MS)  # the same step sent again, its reply lost
        assert [e["attempts"] for e in outbox.deliveries(broken.id)] == [1], "given up once"
        assert outbox.counts()[("task.completed", "given_up")] == 1
        assert deliverer._ended == [] and outbox.settle_and_claim([], 10, LEASE_MS) == [], "nothing left claimed"
    finally:
        deliverer._connections.close()
        for key in coord.client.scan_iter("subqrefused:*"):
            coord.client.delete(key)
        coord.close()


def test_a_step_sent_again_after_its_reply_was_lost_records_each_outcome_once(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """settle_and_claim.lua ran, and its reply was lost (a failover cut the connection): the deliverer sends its
    outcomes again at its next step, and each is recorded once, as its claim's attempt (settle_delivery.lua
    records an outcome only while the delivery has the attempts its claim read). A delivered outcome is
    recorded over another claim's (a claim that outlived its lease), and a standalone settle as before."""
    coord = Coordinator(
        settings.model_copy(update={"queue": "subq-nobody", "key_prefix": "subqresent", "webhook_allow": ["127.0.0.1"]})
    )
    outbox, hooks = coord.store.outbox, [{"url": "http://127.0.0.1:9/hook", "events": ["*"]}]
    deliverer = Deliverer(coord, lambda *_: None)
    try:
        root = coord.create_task("Say hello.", webhooks=hooks)
        for _ in range(2):
            outbox.add_event(root.id, root.id, "task.completed", {})
        retried, taken = outbox.settle_and_claim([], 10, LEASE_MS)
        assert (retried.entry["attempts"], taken.entry["attempts"]) == (0, 0)
        sent = outbox.scripts
        lost: list[int] = []

        def reply_lost(call: object) -> object:
            reply = sent(call)  # type: ignore[arg-type]
            if not lost:
                lost.append(1)
                raise redis.ConnectionError("Connection closed by server.")
            return reply

        monkeypatch.setattr(outbox, "scripts", reply_lost)
        retry_at = time.time() + 600
        deliverer._ended = [
            Settled(root.id, retried.delivery_id, "retrying", last="HTTP 503", next_at=retry_at, attempts=0),
            Settled(root.id, taken.delivery_id, "retrying", last="HTTP 502", next_at=retry_at, attempts=0),
        ]
        with pytest.raises(StoreError):
            deliverer.step()
        assert len(deliverer._ended) == 2, "sent again at the next step: whether they were recorded is unknown"
        deliverer.step()
        states = {d["id"]: (d["state"], d["attempts"], d["last"]) for d in outbox.deliveries(root.id)}
        assert states == {
            retried.delivery_id: ("retrying", 1, "HTTP 503"),
            taken.delivery_id: ("retrying", 1, "HTTP 502"),
        }
        assert outbox.counts() == {("task.completed", "retrying"): 2}, "each attempt counted once"
        # A claim that outlived its lease: its delivered outcome is recorded over the other claim's retrying.
        outbox.settle_and_claim([Settled(root.id, taken.delivery_id, "delivered", last="HTTP 204", attempts=0)], 0, 1)
        assert [d["state"] for d in outbox.deliveries(root.id) if d["id"] == taken.delivery_id] == ["delivered"]
        # Without a claim's attempts (an operator's call), an outcome is recorded whatever they are.
        assert outbox.settle(root.id, retried.delivery_id, "given_up", last="by hand") == "given_up"
        assert [d["attempts"] for d in outbox.deliveries(root.id) if d["id"] == retried.delivery_id] == [2]
    finally:
        deliverer._connections.close()
        for key in coord.client.scan_iter("subqresent:*"):
            coord.client.delete(key)
        coord.close()


def test_a_host_check_that_raises_is_the_attempts_refusal(
    outbox_coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a named host's check raises is that attempt's refusal, retrying, and its slot is given back."""
    coord = outbox_coord
    deliverer = Deliverer(coord, lambda *_: None)

    def breaks(*_: object) -> str:
        raise RuntimeError("the resolver broke")

    monkeypatch.setattr("coordinator.outbound.resolve_safe", breaks)
    try:
        root = coord.create_task("Say hello.", webhooks=[{"url": "http://localhost:9/in", "events": ["*"]}])
        coord.store.outbox.add_event(root.id, root.id, "task.completed", {})
        step_until(deliverer, lambda: [d["state"] for d in coord.store.outbox.deliveries(root.id)] == ["retrying"])
        ((last,),) = [(d["last"],) for d in coord.store.outbox.deliveries(root.id)]
        assert last == "refused: the host's check failed: RuntimeError: the resolver broke", last
        assert deliverer._busy == 0
    finally:
        deliverer._connections.close()
        for key in coord.client.scan_iter("subqbatch:*"):
            coord.client.delete(key)
        coord.close()


def test_a_root_whose_tree_filled_its_cap_still_tells_its_end(settings: Settings) -> None:
    """The tree's cap counts every delivery the tree wrote, delivered ones too: past it, its children's events
    are dropped (counted), and the root's own end is still written, for its webhook and its `on_complete`, as are
    its approvals and budget warnings."""
    coord = Coordinator(
        settings.model_copy(
            update={
                "queue": "subq-nobody",
                "key_prefix": "subqcap",
                "webhook_tree_cap": 3,
                "webhook_allow": ["127.0.0.1"],
            }
        )
    )
    outbox = coord.store.outbox
    try:
        root = coord.create_task(
            "fan out", webhooks=[{"url": "http://127.0.0.1:9/in", "events": ["*"]}], on_complete="myapp.tree_done"
        )
        children = coord.delegate(root.id, [{"description": f"c{n}", "message": "m"} for n in range(4)]).child_ids
        for child in children:
            outbox.add_event(root.id, child, "task.completed", {})
        assert len(outbox.deliveries(root.id)) == 3 and outbox.dropped(root.id) == 1, "the cap holds for children"
        outbox.add_event(root.id, root.id, "task.completed", {})
        ended = [d["hook"] for d in outbox.deliveries(root.id) if d["type"] == "task.completed"]
        assert sorted(ended) == ["0", "c"], "the root's end, for its webhook and its on_complete"
        # A person must hear of a call that waits, and of a budget nearly spent, however wide the tree: before,
        # both were dropped past the cap, an operator's SUBQ_NOTIFY sink's too.
        assert outbox.add_event(root.id, children[0], "approval.requested", {"approval_id": "a1"}) == 1
        assert outbox.add_event(root.id, children[1], "budget.warning", {"share": 0.8}) == 1
        assert outbox.add_event(root.id, children[0], "task.failed", {}) == 0 and outbox.dropped(root.id) == 2
    finally:
        for key in coord.client.scan_iter("subqcap:*"):
            coord.client.delete(key)
        coord.close()


def test_a_full_fleet_outbox_still_takes_every_roots_end(settings: Settings) -> None:
    """The fleet's cap bounds what every tree's children add: one tree whose receiver is down can fill it. A root's
    own end, an approval's events and a budget warning are written past it, so another tree, another tenant's maybe,
    still tells its caller it ended (its webhook and its `on_complete`) and its approvers that a call waits; before,
    they were dropped with the rest."""
    coord = Coordinator(
        settings.model_copy(
            update={"queue": "subq-nobody", "key_prefix": "subqfleetcap", "webhook_outbox_cap": 2,
                    "webhook_allow": ["127.0.0.1"]}
        )
    )  # fmt: skip
    outbox = coord.store.outbox
    try:
        down = coord.create_task("fan out", webhooks=[{"url": "http://127.0.0.1:9/in", "events": ["*"]}])
        children = coord.delegate(down.id, [{"description": f"c{n}", "message": "m"} for n in range(3)]).child_ids
        for child in children:
            outbox.add_event(down.id, child, "task.completed", {})
        assert outbox.dropped(down.id) == 1 and coord.client.zcard(coord.store.keys.outbox_pending()) == 2
        other = coord.create_task(
            "another tree", webhooks=[{"url": "http://127.0.0.1:9/other", "events": ["*"]}], on_complete="app.done"
        )
        (child,) = coord.delegate(other.id, [{"description": "c", "message": "m"}]).child_ids
        assert outbox.add_event(other.id, child, "task.completed", {}) == 0, "a child's event is held to the cap"
        assert outbox.add_event(other.id, other.id, "task.completed", {}) == 2, "the root's end is not"
        ended = sorted(d["hook"] for d in outbox.deliveries(other.id) if d["type"] == "task.completed")
        assert ended == ["0", "c"] and outbox.dropped(other.id) == 1
        assert outbox.add_event(other.id, child, "approval.requested", {"approval_id": "a1"}) == 1, "nor a call's wait"
        assert outbox.add_event(other.id, child, "approval.decided", {"approval_id": "a1"}) == 1
        assert outbox.add_event(other.id, child, "budget.warning", {"share": 0.8}) == 1
    finally:
        for key in coord.client.scan_iter("subqfleetcap:*"):
            coord.client.delete(key)
        coord.close()


def test_a_trees_subscriptions_are_kept_while_it_has_events(outbox_coord: Coordinator) -> None:
    """Written once with the root, the subscriptions are kept for the retention from the tree's last event,
    one no subscription asks for too: a tree that runs past its retention still tells its root's end."""
    coord = outbox_coord
    root = coord.create_task("Plan.", webhooks=[{"url": "http://127.0.0.1:9/in"}])  # the root's own events
    hooks = coord.store.keys.hooks(root.id)
    coord.client.expire(hooks, 5)  # most of the retention gone
    (child,) = coord.delegate(root.id, [{"description": "c", "message": "m"}]).child_ids
    try:
        assert coord.store.outbox.add_event(root.id, child, "task.completed", {}) == 0, "asked for by none"
        assert coord.client.ttl(hooks) > 60, "kept from the tree's last event"
    finally:
        for key in coord.client.scan_iter("subqbatch:*"):
            coord.client.delete(key)
        coord.close()


def test_an_ends_delivery_sends_the_record_as_it_was_at_the_event_at_every_attempt(
    outbox_coord: Coordinator,
) -> None:
    """An end's delivery keeps the fields of its task's record an event reads as they were at the end (outbox_add,
    from finish_task and stop_tasks): a retry of the tree, which clears a failed task's error, or spend recorded
    after a stop, changes no attempt's body; the same webhook-id always carries the same body."""
    coord = outbox_coord
    hooks = [{"url": "http://127.0.0.1:9/hook", "events": ["child.*"]}]
    root = coord.create_task("Plan.", webhooks=hooks)
    failed, stopped = coord.delegate(root.id, [{"description": d, "message": "Go."} for d in ("f", "s")]).child_ids
    coord.store.runs.record_usage(failed, "r:1", Usage(tokens_in=120, tokens_out=30), 4_100, "test")
    coord.store.runs.finish_task(failed, "failed", error="boom", error_class="RuntimeError")
    coord.cancel(stopped, "not needed")
    at_event = {t: coord.get_task(t).model_dump(mode="json") for t in (failed, stopped)}
    outbox = coord.store.outbox
    try:
        for attempt in range(2):
            claimed = [c for c in outbox.settle_and_claim([], 10, LEASE_MS) if c.root_id == root.id]
            assert sorted(str(c.entry["task_id"]) for c in claimed) == sorted([failed, stopped]), attempt
            for c in claimed:
                whole = at_event[str(c.entry["task_id"])]
                assert c.record == {name: whole[name] for name in EVENT_FIELDS}, attempt
            # The receiver answered 503, and meanwhile the record changed as a retry and late spend change it.
            outbox.settle_and_claim(
                [Settled(root.id, c.delivery_id, "retrying", last="HTTP 503", next_at=0.0) for c in claimed], 0,
                LEASE_MS,
            )  # fmt: skip
            coord.client.hset(coord.store.keys.task(root.id, failed), mapping={"error": "", "error_class": ""})
            coord.client.hset(coord.store.keys.task(root.id, stopped), mapping={"total_cost_micros": "99"})
    finally:
        for key in coord.client.scan_iter("subqbatch:*"):
            coord.client.delete(key)
        coord.close()


def test_the_fields_an_end_keeps_are_the_fields_an_event_reads() -> None:
    lua = (Path(__file__).resolve().parent.parent / "coordinator" / "store" / "lua" / "hashes.lua").read_text()
    block = lua.split("local EVENT_FIELDS = {", 1)[1].split("}", 1)[0]
    assert tuple(name.strip().strip("'") for name in block.split(",")) == EVENT_FIELDS


def _hanging_dns(names: set[str]) -> tuple[Callable[..., Any], threading.Event, list[object]]:
    """A stand-in for socket.getaddrinfo that holds back its answer for `names` until the event is set (no real name
    server can be made to hang here), then says they do not resolve; the names it was asked for, in order."""
    real, release = socket.getaddrinfo, threading.Event()
    asked: list[object] = []

    def hanging(host: object, *args: Any, **kwargs: Any) -> Any:
        if host in names:
            asked.append(host)
            release.wait(120)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    return hanging, release, asked


def _let_go(coord: Coordinator, release: threading.Event, stop: threading.Event, receiver: RawReceiver) -> None:
    """A hanging-resolver test's end: the held lookups answered, the deliverer and the receiver stopped, and the
    coordinator's keys (a prefix of its own) deleted."""
    release.set()
    stop.set()
    receiver.stop()
    for key in coord.client.scan_iter(f"{coord.settings.key_prefix}:*"):
        coord.client.delete(key)
    coord.close()


def test_a_host_whose_name_server_hangs_holds_neither_other_hosts_nor_its_claims(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name server that never answers (no real one can be made to hang here: the system resolver's answer for
    one name is held back, in this process, until the test lets it go). Its attempts share one resolution, each
    ends `retrying` within its timeout (before its claim's lease, so no other worker sends it meanwhile), and
    another tree's delivery to a name that resolves goes out meanwhile. Before, the two helper threads waited
    on it for good, every other named host's attempt waited behind them, and the claims lapsed."""
    receiver = RawReceiver(host=str(socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)[0][4][0]))
    own = settings.model_copy(
        update={
            "queue": "subq-nobody", "key_prefix": "subqhang", "webhook_allow": ["localhost", "stuck.example"],
            "webhook_timeout_s": 1.0, "webhook_retry_base_s": 60.0,  # no retry within the test: its slots read 0
        }
    )  # fmt: skip
    coord = Coordinator(own)
    hanging, release, asked = _hanging_dns({"stuck.example"})
    stop = threading.Event()
    try:
        stuck = coord.create_task("Say hello.", webhooks=[{"url": "http://stuck.example/in", "events": ["*"]}])
        fine = coord.create_task(
            "Say hello.", webhooks=[{"url": f"http://localhost:{receiver.port}/in", "events": ["*"]}]
        )
        monkeypatch.setattr(socket, "getaddrinfo", hanging)
        for _ in range(3):
            coord.store.outbox.add_event(stuck.id, stuck.id, "task.completed", {})
        deliverer = Deliverer(coord, lambda *_: None)
        threading.Thread(target=deliverer.run_forever, args=(stop,), daemon=True).start()
        eventually(lambda: asked, "the stuck name is being resolved", 30)
        coord.store.outbox.add_event(fine.id, fine.id, "task.completed", {})
        eventually(
            lambda: [d["state"] for d in coord.store.outbox.deliveries(fine.id)] == ["delivered"],
            "the other host's delivery went out while the stuck name hung", 30,
        )  # fmt: skip
        eventually(
            lambda: [d["state"] for d in coord.store.outbox.deliveries(stuck.id)] == ["retrying"] * 3,
            "each attempt to the stuck name ended within its timeout", 30,
        )  # fmt: skip
        lasts = {d["last"] for d in coord.store.outbox.deliveries(stuck.id)}
        assert lasts == {"stuck.example did not resolve within 1 s"}, lasts
        assert asked == ["stuck.example"], "the attempts of one host wait on one resolution"
        assert deliverer._busy == 0, "every slot given back"
    finally:
        _let_go(coord, release, stop, receiver)


@pytest.mark.parametrize("hanging_hosts", ["kept", "most"])
def test_a_host_behind_other_hosts_hanging_lookups_is_resolved_or_at_least_not_held_back_as_silent(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, hanging_hosts: str
) -> None:
    """Names whose name server hangs (another tree's, another tenant's maybe) fill the resolver threads kept
    (`kept`: RESOLVERS and two more): a third tree's host is looked up by a thread started for it and delivered
    (before, it waited behind them until its attempt's timeout). Past MAX_RESOLVERS of them (`most`) it waits in
    the queue: its attempt retries, as it must, but its host is not marked as a receiver that did not answer,
    with its next attempts held back: nothing was ever asked of it."""
    from coordinator.outbound import MAX_RESOLVERS, RESOLVERS

    receiver = RawReceiver(host=str(socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)[0][4][0]))
    count = RESOLVERS + 2 if hanging_hosts == "kept" else MAX_RESOLVERS
    stuck_names = [f"stuck{n}.example" for n in range(count)]
    own = settings.model_copy(
        update={
            "queue": "subq-nobody", "key_prefix": "subqqueued", "webhook_allow": ["localhost", *stuck_names],
            "webhook_timeout_s": 1.0, "webhook_retry_base_s": 60.0,
        }
    )  # fmt: skip
    coord = Coordinator(own)
    hanging, release, asked = _hanging_dns(set(stuck_names))
    stop = threading.Event()
    try:
        stuck = [
            coord.create_task("Say hello.", webhooks=[{"url": f"http://{name}/in", "events": ["*"]}])
            for name in stuck_names
        ]
        fine = coord.create_task(
            "Say hello.", webhooks=[{"url": f"http://localhost:{receiver.port}/in", "events": ["*"]}]
        )
        monkeypatch.setattr(socket, "getaddrinfo", hanging)
        for root in stuck:
            coord.store.outbox.add_event(root.id, root.id, "task.completed", {})
        deliverer = Deliverer(coord, lambda *_: None)
        threading.Thread(target=deliverer.run_forever, args=(stop,), daemon=True).start()
        eventually(lambda: len(asked) == count, "a resolver thread holds each hanging name", 30)
        coord.store.outbox.add_event(fine.id, fine.id, "task.completed", {})
        if hanging_hosts == "kept":
            eventually(
                lambda: [d["state"] for d in coord.store.outbox.deliveries(fine.id)] == ["delivered"],
                "the host was looked up by a thread of its own and delivered", 30,
            )  # fmt: skip
            return
        eventually(
            lambda: [d["state"] for d in coord.store.outbox.deliveries(fine.id)] == ["retrying"],
            "the queued host's attempt ended at its timeout", 30,
        )  # fmt: skip
        assert not receiver.requests
        assert ("localhost", receiver.port) not in deliverer._silent, "a host never asked is not held back"
        eventually(
            lambda: all(
                [d["state"] for d in coord.store.outbox.deliveries(root.id)] == ["retrying"] for root in stuck
            ),
            "each hanging name's attempt ended at its timeout", 30,
        )  # fmt: skip
        assert {(name, 80) for name in stuck_names} <= set(deliverer._silent), "a lookup that hung is held back"
    finally:
        _let_go(coord, release, stop, receiver)


def test_a_receiver_that_never_answers_holds_one_attempt_a_span_not_every_slot(settings: Settings) -> None:
    """One tree's receiver hangs; its twelve events are due before another tree's one. Before, each claim of the
    hung host's deliveries held a slot for the whole timeout: the other tree's event, another tenant's maybe, waited
    behind all twelve (three timeouts here, hours at a fleet's backlog). Now, once an attempt to the host got no
    answer within its timeout, its next deliveries end `retrying` at once, without a request, but for one attempt a
    timeout's span; the other tree's goes out. Once that one attempt is answered, the host's deliveries go again."""
    held, fine = RawReceiver(), RawReceiver()
    held.hold()
    own = settings.model_copy(
        update={
            "queue": "subq-nobody", "key_prefix": "subqheld", "webhook_allow": ["127.0.0.1"], "webhook_concurrency": 4,
            "webhook_timeout_s": 1.0, "webhook_retry_base_s": 0.2, "webhook_retry_max_s": 0.5,
        }
    )  # fmt: skip
    coord = Coordinator(own)
    outbox = coord.store.outbox
    deliverer = Deliverer(coord, lambda *_: None)
    try:
        hung = coord.create_task("fan out", webhooks=[{"url": f"http://127.0.0.1:{held.port}/in", "events": ["*"]}])
        children = coord.delegate(hung.id, [{"description": f"c{n}", "message": "m"} for n in range(12)]).child_ids
        for child in children:
            outbox.add_event(hung.id, child, "task.completed", {})
        other = coord.create_task("another", webhooks=[{"url": f"http://127.0.0.1:{fine.port}/in", "events": ["*"]}])
        outbox.add_event(other.id, other.id, "task.completed", {})

        step_until(deliverer, lambda: [d["state"] for d in outbox.deliveries(other.id)] == ["delivered"])
        assert [d["state"] for d in outbox.deliveries(other.id)] == ["delivered"], "the other tree's event went out"
        # The first claim's four reached the hung host; after them, one a span at most (a loaded host's steps
        # may take a span or two). Before, all twelve did before the other tree's turn.
        assert 4 <= len(held.requests) <= 6, len(held.requests)
        lasts = [d["last"] for d in outbox.deliveries(hung.id) if d["attempts"]]
        assert any(last == "ReadTimeout: timed out" for last in lasts), lasts
        not_sent = f"not sent: 127.0.0.1:{held.port} answered no attempt within 1 s lately; one attempt a 1 s goes"
        assert any(last.startswith(not_sent) for last in lasts), lasts

        held.release.set()  # it answers again: a span's one attempt is answered, and the rest go
        step_until(deliverer, lambda: all(d["state"] == "delivered" for d in outbox.deliveries(hung.id)))
        assert {d["state"] for d in outbox.deliveries(hung.id)} == {"delivered"}
        assert deliverer._busy == 0 and not deliverer._silent, "every slot given back, and the host heard"
    finally:
        held.release.set()
        deliverer._connections.close()
        held.stop()
        fine.stop()
        for key in coord.client.scan_iter("subqheld:*"):
            coord.client.delete(key)
        coord.close()
