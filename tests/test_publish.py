"""What publishing a delegation costs its publisher, on a real Redis."""

from __future__ import annotations

from coordinator import Coordinator
from tests.helpers import script, usage_step


def test_publishing_a_batch_subscribes_to_no_childs_result(idle_coordinator: Coordinator) -> None:
    """A group's publish used to subscribe the publisher to every member's result channel."""
    coord = idle_coordinator
    parent = coord.create_task("a parent", todos="\n".join(f"[ ] c{n}" for n in range(20)))
    batch = coord.delegate(parent.id, [{"description": f"c{n}", "message": script(usage_step())} for n in range(20)])

    channels = [f"celery-task-meta-{child_id}" for child_id in batch.child_ids]
    subscribers = dict(coord.client.pubsub_numsub(*channels))
    assert len(batch.child_ids) == 20 and coord.client.llen("subq-nobody") == 20
    assert set(subscribers.values()) == {0}, "no child's result channel has a subscriber"


def test_a_batchs_children_show_queued_at_once(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    parent = coord.create_task("a parent", todos="[ ] a\n[ ] b\n[ ] c")
    batch = coord.delegate(parent.id, [{"description": d, "message": script(usage_step())} for d in "abc"])

    live = coord.store.live(parent.root_id)
    assert {child_id: live[child_id]["state"] for child_id in batch.child_ids} == dict.fromkeys(
        batch.child_ids, "queued"
    )
    queued = [f for _, f in coord.store.read_events(parent.root_id) if f.get("state") == "queued"]
    assert [f["task_id"] for f in queued] == batch.child_ids, "one event per child, in order"
