"""What publishing a delegation costs its publisher, on a real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kombu.exceptions import EncodeError

from coordinator import Coordinator, Settings
from coordinator.celery_app import RUN_TASK
from coordinator.dispatch import PUBLISH_BATCH_MESSAGES, publish_group
from coordinator.local.embedded_redis import local_redis
from tests.event_tap import EventTap
from tests.helpers import eventually, requests_sent, script, usage_step


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

    live = coord.store.events.live(parent.root_id)
    assert {child_id: live[child_id]["state"] for child_id in batch.child_ids} == dict.fromkeys(
        batch.child_ids, "queued"
    )
    queued = [f for _, f in coord.store.events.read_events(parent.root_id) if f.get("state") == "queued"]
    assert [f["task_id"] for f in queued] == batch.child_ids, "one event per child, in order"


@pytest.fixture
def private_coordinator() -> Iterator[Coordinator]:
    """A Coordinator on a Redis of its own, so that INFO commandstats counts its commands alone."""
    with local_redis() as url:
        coord = Coordinator(Settings(redis_url=url, queue="subq-nobody", key_prefix="sent"))
        yield coord
        coord.close()


def publishes(coord: Coordinator) -> int:
    calls: int = coord.client.info("commandstats").get("cmdstat_publish", {}).get("calls", 0)
    return calls


def test_a_batchs_sent_events_are_one_publish(private_coordinator: Coordinator) -> None:
    """Celery published each child's task-sent event on its own: one PUBLISH a child."""
    coord, width = private_coordinator, 20
    parent = coord.create_task("a parent", todos="\n".join(f"[ ] c{n}" for n in range(width)))
    with EventTap(coord.settings.require_redis_url()) as tap:
        before = publishes(coord)
        batch = coord.delegate(
            parent.id, [{"description": f"c{n}", "message": script(usage_step())} for n in range(width)]
        )
        assert publishes(coord) - before == 1, "one PUBLISH for the batch's sent events"
        sent = eventually(
            lambda: len(tap.events("task-sent", batch.child_ids)) == width and tap.events("task-sent", batch.child_ids),
            "the sent events",
        )

    assert [m.routing_key for m in tap.messages] == ["task.multi"]
    assert [event["uuid"] for _, event in sent] == batch.child_ids, "in publish order"
    for (_, event), child_id in zip(sent, batch.child_ids, strict=True):
        # What Celery's own sent event carries, and what Flower's redaction reads (workers/flower_setup.py).
        assert event["name"] == RUN_TASK and event["type"] == "task-sent"
        assert event["args"].startswith(f"task={child_id} parent={parent.id} ")
        assert (event["queue"], event["routing_key"], event["root_id"]) == ("subq-nobody", "subq-nobody", child_id)
        assert {"hostname", "pid", "clock", "timestamp", "utcoffset", "kwargs", "retries", "eta", "expires"} <= set(
            event
        )


@pytest.mark.parametrize("failing", [0, 2])
def test_a_group_whose_publish_fails_publishes_no_message_and_no_event(
    private_coordinator: Coordinator, failing: int
) -> None:
    """A group whose publish fails within its first pipeline publishes nothing: neither its messages nor their events."""
    coord = private_coordinator
    ids = [f"sent-{failing}-{n}" for n in range(4)]
    signatures = [coord.app.signature(RUN_TASK, args=(i,), task_id=i, ignore_result=True) for i in ids]
    signatures[failing].args = (object(),)  # JSON cannot encode it: this message's publish fails
    with EventTap(coord.settings.require_redis_url()) as tap:
        with pytest.raises(EncodeError):
            publish_group(coord.app, signatures)
        time.sleep(0.5)  # no event message is on its way

    assert coord.client.llen("subq-nobody") == 0, "the pipeline was discarded, not sent in part"
    assert tap.messages == [], "and no sent event claims a message that is not there"


def test_a_groups_messages_go_in_one_round_trip(
    private_coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu made a Redis client and a round trip for each message of a group."""
    coord = private_coordinator
    ids = [f"trip-{n}" for n in range(50)]
    signatures = [coord.app.signature(RUN_TASK, args=(i,), task_id=i, ignore_result=True) for i in ids]
    publish_group(coord.app, signatures[:1])  # connects, once per process
    sends = requests_sent(monkeypatch)  # another thread of the process writes on its own clock
    publish_group(coord.app, signatures[1:])
    monkeypatch.undo()

    assert coord.client.llen("subq-nobody") == 50
    pipelines = -(-49 // PUBLISH_BATCH_MESSAGES)
    assert sends == ["LPUSH"] * pipelines + ["PUBLISH"], (
        "the 49 messages in pipelines, then their sent events in one PUBLISH"
    )
