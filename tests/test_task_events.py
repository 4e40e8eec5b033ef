"""A run's `task-progress` events ride the worker's buffered task events, and still arrive at once.

Real worker processes (the session's fleet) on the test Redis; the events are read
as Redis carries them (tests/event_tap.py), one entry per PUBLISH.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import pytest
from celery import Celery

from coordinator import Coordinator, Settings
from tests.agents import USAGE, agent, call, subtask
from tests.event_tap import EventMessage, EventTap
from tests.helpers import HostLag, eventually
from workers import task_events

# The model's second response takes this long: the worker is idle while it waits, so a
# progress event left in the buffer until something else is published would arrive late.
THINKING_MS = 2500
# How soon an event sent by a run must reach a subscriber (Flower) even while the worker idles.
PROMPT_S = 1.0
PROGRESS_FIELDS = {"task_id", "request", "cost_micros", "tool", "latency_ms"}


@pytest.fixture
def tap(settings: Settings, coordinator: Coordinator) -> Iterator[EventTap]:
    with EventTap(settings.require_redis_url()) as tap:
        yield tap


def test_a_runs_progress_is_buffered_with_the_task_events_and_sent_at_once(
    coordinator: Coordinator, tap: EventTap
) -> None:
    with HostLag() as lag:  # the worker's pacer and this tap wake late alike on a loaded host
        root = coordinator.create_task(
            agent(
                call("update_todo_list", todos="[-] count"),
                {"reply": "counted", "usage": USAGE, "latency_ms": THINKING_MS},
            ),
            todos="[ ] count",
            run=True,
        )
        assert coordinator.wait(root.id, 60).status == "completed"
    succeeded = eventually(lambda: tap.events("task-succeeded", [root.id]), "the run's task-succeeded event")
    started = tap.events("task-started", [root.id])
    # At least the first response's, sent before the slow one, and the last, within a pace of the run's end.
    progress = eventually(
        lambda: (events := tap.events("task-progress", [root.id])) and len(events) >= 2 and events,
        "the run's progress events, the first response's and the last's",
    )
    assert len(started) == 1
    for message, event in progress:
        assert message.routing_key == "task.multi", "a progress event was published on its own"
        assert set(event) >= PROGRESS_FIELDS and event["task_id"] == root.id
        assert event["hostname"] == started[0][1]["hostname"], "named after the worker that runs the task"
        late_s = message.received_at - event["timestamp"]
        assert late_s < lag.bound_s(PROMPT_S), (
            f"a progress event reached the subscriber {late_s:.2f} s after it was sent, the host late by "
            f"{lag.worst_s:.2f} s"
        )
    # The first progress event came while the model still thought, not with the run's end.
    assert progress[0][0].received_at < succeeded[0][0].received_at - THINKING_MS / 2000


# Children whose ends are this far apart: unpaced, each end would be a publish of its own.
STAGGER_MS = 25
STAGGERED_CHILDREN = 12
# Celery's dispatcher publishes its buffer at once when it holds this many events.
BUFFER_LIMIT = 24


def test_task_events_sent_close_together_share_a_publish(coordinator: Coordinator, tap: EventTap) -> None:
    children = [
        subtask(f"child {n}", {"reply": f"done {n}", "usage": USAGE, "latency_ms": n * STAGGER_MS})
        for n in range(STAGGERED_CHILDREN)
    ]
    with HostLag() as lag:  # the worker's pacer and this tap wake late alike on a loaded host
        root = coordinator.create_task(
            agent(call("run_subagents", tasks=children), call("attempt_completion", result="all done")), run=True
        )
        assert coordinator.wait(root.id, 60).status == "completed"
    ids = [child.id for child in coordinator.get_children(root.id)]
    succeeded = eventually(
        lambda: (events := tap.events("task-succeeded", ids)) and len(events) == len(ids) and events,
        "every child's task-succeeded event",
    )
    # Celery flushes at once when its buffer fills (24 events): those publishes are not the pacer's.
    by_worker: dict[str, list[EventMessage]] = {}
    for message, event in succeeded:
        if len(message.events) < BUFFER_LIMIT and message not in by_worker.get(event["hostname"], []):
            by_worker.setdefault(event["hostname"], []).append(message)
    for worker, paced in by_worker.items():
        span_s = paced[-1].received_at - paced[0].received_at
        # Each worker's pacer publishes at most once every EVENT_FLUSH_EVERY_S (one more for the tap's delays).
        most = int(span_s / task_events.EVENT_FLUSH_EVERY_S) + 2
        assert len(paced) <= most, f"{worker}: children's ends over {span_s:.2f} s took {len(paced)} paced publishes"
    for message, event in succeeded:
        late_s = message.received_at - event["timestamp"]
        assert late_s < lag.bound_s(PROMPT_S), (
            f"a task-succeeded event reached the subscriber {late_s:.2f} s after it was sent, the host late by "
            f"{lag.worst_s:.2f} s"
        )


class FakeConsumer:
    def __init__(self, dispatcher: Any) -> None:
        self.event_dispatcher = dispatcher
        self.hub = None


def test_the_consumers_dispatcher_is_used_only_where_it_buffers_task_events(settings: Settings) -> None:
    """Elsewhere (no worker here, a forked child, events off, no hub) a progress event is published alone."""
    app = Celery(broker=settings.redis_url, set_as_current=False)
    buffering = app.events.Dispatcher(app.connection_for_write(), buffer_group=["task"])
    consumer = FakeConsumer(buffering)
    step = task_events.ConsumerEvents(consumer)
    try:
        assert task_events.buffered_dispatcher() is None, "no worker's consumer in this process"
        step.start(consumer)
        assert task_events.buffered_dispatcher() is buffering
        consumer.event_dispatcher = app.events.Dispatcher(app.connection_for_write())  # a worker without a hub
        assert task_events.buffered_dispatcher() is None
        consumer.event_dispatcher = buffering
        buffering.disable()  # events off, or the connection being restored
        assert task_events.buffered_dispatcher() is None
        buffering.enable()
        with patch("os.getpid", return_value=os.getpid() + 1):  # a pool process forked from the worker
            assert task_events.buffered_dispatcher() is None
        assert task_events.buffered_dispatcher() is buffering
        step.shutdown(consumer)
        assert task_events.buffered_dispatcher() is None
    finally:
        step.shutdown(consumer)
        buffering.close()
