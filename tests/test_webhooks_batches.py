"""The deliverer's batches on a real Redis (coordinator/outbound.py, OutboxStore.settle_and_claim): the
outcomes of a batch are recorded once each, even when the server has forgotten the scripts (NOSCRIPT:
only the calls that did not run are sent again), and a claim takes each due delivery once.
"""

from __future__ import annotations

import pytest

from coordinator import Coordinator, Settings
from coordinator.store.outbox import Settled

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
