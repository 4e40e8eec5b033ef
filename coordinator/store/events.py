"""A tree's event stream and the live status of its tasks."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.client import Pipeline, PubSub

from coordinator.ids import root_of
from coordinator.models import TaskRecord, live_status
from coordinator.store.base import EVENTS_MAXLEN, Part, _str_map, translate_redis_errors
from coordinator.store.keys import Keys
from coordinator.store.protocol import SetLive

__all__ = ["EventStore", "SettleWatch", "queue_live"]

# How long a waiter whose subscription dropped pauses before its next status read (redis-py subscribes again
# on the next read of its connection): long enough not to spin while Redis is away, short next to a slice.
RESUBSCRIBE_PAUSE_S = 0.1


def queue_live(
    pipe: Pipeline, keys: Keys, retention_s: int, records: Sequence[TaskRecord], state: str, **fields: object
) -> None:
    """Queue on `pipe` one live status for tasks of one tree: one write of the live hash and one event a task
    (a delegation's commit, which writes its children's `queued` with them: no child has ended before it)."""
    root = records[0].root_id
    pipe.hset(keys.live(root), mapping={r.id: live_status(r, state, **fields) for r in records})
    pipe.expire(keys.live(root), retention_s)
    for record in records:
        pipe.xadd(
            keys.events(root), {"type": "live", "task_id": record.id, "state": state}, maxlen=EVENTS_MAXLEN,
            approximate=True,
        )  # fmt: skip


class SettleWatch:
    """One waiter's subscription to a task's channel: the scripts that may settle the task (finish_task,
    stop_tasks, finish_batch) publish an empty message on it. A waiter reads no event of the tree: a wide
    delegation adds a few a child, and a waiter that read them all cost the server a blocking read every
    10 ms, 60 to 100 us a child (docs/benchmarks.md)."""

    def __init__(self, pubsub: PubSub) -> None:
        self.pubsub = pubsub

    def wait(self, timeout_s: float) -> None:
        """Until a wake-up, or `timeout_s`. A dropped connection ends the wait after a pause: the caller's next
        read of the status says whether Redis is there, and the next wait subscribes again. A refused
        subscription (an ACL user with no channel access: NOPERM) leaves the caller its reads of the status."""
        until_s = time.monotonic() + timeout_s
        try:
            # A read may answer the subscription's own confirmation (None): wait on for the rest.
            while (left_s := until_s - time.monotonic()) > 0:
                if self.pubsub.get_message(timeout=left_s) is not None:
                    return
        except redis.RedisError:
            time.sleep(min(RESUBSCRIBE_PAUSE_S, max(0.0, until_s - time.monotonic())))


class EventStore(Part):
    """Reading a tree's event stream, listening for a task's settling, publishing and reading live status."""

    @translate_redis_errors
    def last_event_id(self, root_id: str) -> str:
        newest: Any = self.client.xrevrange(self.keys.events(root_id), count=1)
        return str(newest[0][0]) if newest else "0-0"

    @contextmanager
    def settle_watch(self, task_id: str) -> Iterator[SettleWatch]:
        """Listen for `task_id`'s settling (`Keys.settled`) while the block runs. Subscribe before the first read
        of the status: a settle between that read and the wait then wakes it instead of being missed."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            translate_redis_errors(pubsub.subscribe)(self.keys.settled(root_of(task_id), task_id))
            yield SettleWatch(pubsub)
        finally:
            pubsub.close()

    @translate_redis_errors
    def read_events(
        self, root_id: str, after_id: str = "0-0", *, block_ms: int | None = None, count: int = 500
    ) -> list[tuple[str, dict[str, str]]]:
        """Entries of the tree's event stream after `after_id` (blocking up to block_ms if none)."""
        reply: Any = self.client.xread({self.keys.events(root_id): after_id}, count=count, block=block_ms)
        if not reply:
            return []
        return [(str(entry_id), _str_map(fields)) for entry_id, fields in reply[0][1]]

    @translate_redis_errors
    def set_live(self, record: TaskRecord, state: str, **fields: object) -> bool:
        """Publish a task's live status, the tree's live hash and an event on its stream, while the task has not
        ended (checked in the step that writes it: a stop that lands first keeps its own status the last).
        Whether it was written."""
        root = record.root_id
        return self.scripts(
            SetLive(
                task=self.keys.task(root, record.id), live=self.keys.live(root), events=self.keys.events(root),
                task_id=record.id, status=live_status(record, state, **fields), state=state,
                retention_s=self.retention_s, events_maxlen=EVENTS_MAXLEN,
            )
        )  # fmt: skip

    @translate_redis_errors
    def live(self, root_id: str) -> dict[str, dict[str, Any]]:
        """task id -> its live status JSON, for every task of the tree that has one."""
        raw = _str_map(self.client.hgetall(self.keys.live(root_id)))
        return {task_id: json.loads(value) for task_id, value in raw.items()}
