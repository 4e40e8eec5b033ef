"""A tree's event stream and the live status of its tasks."""

from __future__ import annotations

import json
from typing import Any

from coordinator.models import TaskRecord, live_status
from coordinator.store.base import EVENTS_MAXLEN, StoreBase, _str_map, translate_redis_errors

__all__ = ["EventStore"]


class EventStore(StoreBase):
    """Reading (and blocking on) a tree's event stream; publishing and reading live status."""

    @translate_redis_errors
    def last_event_id(self, root_id: str) -> str:
        newest: Any = self.client.xrevrange(self.keys.events(root_id), count=1)
        return str(newest[0][0]) if newest else "0-0"

    @translate_redis_errors
    def wait_for_event(self, root_id: str, after_id: str, block_ms: int) -> str:
        """Block until the tree's stream has an entry after `after_id`; returns the newest id seen."""
        reply: Any = self.client.xread({self.keys.events(root_id): after_id}, block=block_ms)
        if not reply:
            return after_id
        return str(reply[0][1][-1][0])

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
    def set_live(self, record: TaskRecord, state: str, **fields: object) -> None:
        """Publish a task's live status: the tree's live hash and an event on its stream."""
        root = record.root_id
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.live(root), record.id, live_status(record, state, **fields))
            pipe.expire(self.keys.live(root), self.retention_s)
            pipe.xadd(
                self.keys.events(root),
                {"type": "live", "task_id": record.id, "state": state},
                maxlen=EVENTS_MAXLEN,
                approximate=True,
            )
            pipe.execute()

    @translate_redis_errors
    def live(self, root_id: str) -> dict[str, dict[str, Any]]:
        """task id -> its live status JSON, for every task of the tree that has one."""
        raw = _str_map(self.client.hgetall(self.keys.live(root_id)))
        return {task_id: json.loads(value) for task_id, value in raw.items()}
