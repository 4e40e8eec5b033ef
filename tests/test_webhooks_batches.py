"""The deliverer's batches on a real Redis (coordinator/outbound.py, OutboxStore.settle_and_claim: one
settle_and_claim.lua call a batch): the outcomes of a batch are recorded once each, even when the server
has forgotten the scripts (NOSCRIPT), and a claim takes each due delivery once; an event's fields of a
record read as the whole record does; a host name is resolved and checked by a helper thread, at each
attempt.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from coordinator import Coordinator, Settings
from coordinator.models import Usage
from coordinator.outbound import Deliverer, payload
from coordinator.store.outbox import EVENT_FIELDS, Settled
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
    claimed = [c for c in outbox.settle_and_claim([], 10, LEASE_MS) if c[0] == root.id]
    assert len(claimed) == 3
    assert [c for c in outbox.settle_and_claim([], 10, LEASE_MS) if c[0] == root.id] == []  # held by the lease
    coord.client.script_flush()  # a restarted server or a promoted replica: NOSCRIPT for every call
    outcomes = [
        Settled(root.id, claimed[0][1], "delivered", last="HTTP 204"),
        Settled(root.id, claimed[1][1], "retrying", last="HTTP 503", next_at=0.0),
        Settled(root.id, claimed[2][1], "gone", last="HTTP 410"),
    ]
    outbox.settle_and_claim(outcomes, 0, LEASE_MS)
    states = {d["id"]: (d["state"], d["attempts"], d["last"]) for d in outbox.deliveries(root.id)}
    assert states == {
        claimed[0][1]: ("delivered", 1, "HTTP 204"),
        claimed[1][1]: ("retrying", 1, "HTTP 503"),
        claimed[2][1]: ("gone", 1, "HTTP 410"),
    }
    # The retrying one is due again (next_at 0); the delivered and gone ones are off the pending index.
    assert [c[1] for c in outbox.settle_and_claim([], 10, LEASE_MS) if c[0] == root.id] == [claimed[1][1]]
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


def test_an_events_fields_of_a_record_read_as_the_whole_record_reads_them(outbox_coord: Coordinator) -> None:
    """The deliverer reads a few fields of each task's hash (OutboxStore.event_records), not the whole
    record: each must read as GET /v1/tasks/{id} returns it, the payload's figures included."""
    coord = outbox_coord
    root = coord.create_task("Plan.", metadata={"job": "j-42"})
    (child,) = coord.delegate(root.id, [{"description": "spender", "message": "Spend."}]).child_ids
    coord.store.runs.record_usage(child, "r:1", Usage(tokens_in=120, tokens_out=30), 4_100, "test")
    coord.client.hset(
        coord.store.keys.task(root.id, child), mapping={"output": '{"total":3,"names":["a"]}', "summary": "<b>x</b>"}
    )
    bare = coord.create_task("Say hello.")
    coord.client.hset(coord.store.keys.task(bare.id, bare.id), mapping={"metadata": "", "output": ""})
    gone = coord.create_task("Expired.")
    coord.client.delete(coord.store.keys.task(gone.id, gone.id))
    found = coord.store.outbox.event_records([root.id, child, bare.id, gone.id])
    assert sorted(found) == sorted([root.id, child, bare.id]), "a task that expired is left out"
    for task_id in (root.id, child, bare.id):
        whole = coord.get_task(task_id).model_dump(mode="json")
        assert found[task_id] == {name: whole[name] for name in EVENT_FIELDS}, task_id
    assert found[child]["output"] == {"total": 3, "names": ["a"]} and found[child]["tokens_in"] == 120
    body = payload({"type": "task.completed", "task_id": child, "event_id": "evt_1", "ts": 1.0}, found[child])
    assert (body["data"]["tokens_in"], body["data"]["tokens_out"], body["data"]["cost_micros"]) == (120, 30, 4_100)
    assert body["data"]["tokens"] == found[child]["total_tokens"] == 150
    assert found[bare.id]["metadata"] == {} and found[bare.id]["output"] is None
    for key in coord.client.scan_iter("subqbatch:*"):
        coord.client.delete(key)
    coord.close()
