"""A tree's event stream and the live status of its tasks."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from redis.client import Pipeline

from coordinator.models import TaskRecord, live_status
from coordinator.store.base import EVENTS_MAXLEN, Part, _str_map, translate_redis_errors
from coordinator.store.keys import Keys

__all__ = ["EventStore", "queue_live"]

# Events read at once while waiting, and the kinds of a task's own events that cannot settle it.
WAIT_READ_COUNT = 1000
QUIET_EVENTS = frozenset({"child_applied", "live"})
# A waiter reads the stream at most this often: the events of a wide batch arrive a few per
# child, and a read for each cost a Redis command and a wake-up each; the event that settles
# the task is seen at most this much later.
WAIT_READ_EVERY_S = 0.01


def queue_live(
    pipe: Pipeline, keys: Keys, retention_s: int, records: Sequence[TaskRecord], state: str, **fields: object
) -> None:
    """Queue on `pipe` one live status for tasks of one tree: one write of the live hash and one event a task
    (`EventStore.set_live_many`, and a delegation's commit, which writes its children's `queued` with them)."""
    root = records[0].root_id
    pipe.hset(keys.live(root), mapping={r.id: live_status(r, state, **fields) for r in records})
    pipe.expire(keys.live(root), retention_s)
    for record in records:
        pipe.xadd(
            keys.events(root), {"type": "live", "task_id": record.id, "state": state}, maxlen=EVENTS_MAXLEN,
            approximate=True,
        )  # fmt: skip


class EventStore(Part):
    """Reading (and blocking on) a tree's event stream; publishing and reading live status."""

    @translate_redis_errors
    def last_event_id(self, root_id: str) -> str:
        newest: Any = self.client.xrevrange(self.keys.events(root_id), count=1)
        return str(newest[0][0]) if newest else "0-0"

    def wait_for_event_of(self, task_id: str, root_id: str, after_id: str, until_s: float) -> str:
        """Read the tree's stream until an event that may settle `task_id`, or until `until_s`
        (monotonic); returns the last id read.

        The rest of the tree's events (its descendants' runs, each child written back) need
        no read of the task's status: a wide delegation makes a few events per child, and
        waking on each cost a waiter as much CPU as a worker. `Coordinator.wait` reads the
        status after each call anyway, so an event of a kind not named here delays it by
        one slice at most.
        """
        read_at_s = 0.0
        while (block_ms := int((until_s - time.monotonic()) * 1000)) > 0:
            if (idle_s := read_at_s + WAIT_READ_EVERY_S - time.monotonic()) > 0:
                time.sleep(idle_s)
            read_at_s = time.monotonic()
            events = self.read_events(root_id, after_id, block_ms=block_ms, count=WAIT_READ_COUNT)
            if not events:
                break
            after_id = events[-1][0]
            if any(f.get("task_id") == task_id and f.get("type") not in QUIET_EVENTS for _, f in events):
                break
        return after_id

    @translate_redis_errors
    def read_events(
        self, root_id: str, after_id: str = "0-0", *, block_ms: int | None = None, count: int = 500
    ) -> list[tuple[str, dict[str, str]]]:
        """Entries of the tree's event stream after `after_id` (blocking up to block_ms if none)."""
        reply: Any = self.client.xread({self.keys.events(root_id): after_id}, count=count, block=block_ms)
        if not reply:
            return []
        return [(str(entry_id), _str_map(fields)) for entry_id, fields in reply[0][1]]

    def set_live(self, record: TaskRecord, state: str, **fields: object) -> None:
        """Publish a task's live status: the tree's live hash and an event on its stream."""
        self.set_live_many([record], state, **fields)

    @translate_redis_errors
    def set_live_many(self, records: Sequence[TaskRecord], state: str, **fields: object) -> None:
        """Publish one live status for tasks of one tree (a batch's children) in one round trip:
        one write of the live hash and one event per task."""
        if not records:
            return
        with self.client.pipeline(transaction=False) as pipe:
            queue_live(pipe, self.keys, self.retention_s, records, state, **fields)
            pipe.execute()

    @translate_redis_errors
    def live(self, root_id: str) -> dict[str, dict[str, Any]]:
        """task id -> its live status JSON, for every task of the tree that has one."""
        raw = _str_map(self.client.hgetall(self.keys.live(root_id)))
        return {task_id: json.loads(value) for task_id, value in raw.items()}
