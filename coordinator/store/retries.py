"""store.retries: failed tasks made to run again, in one step (`retry.lua`).

The plan (which task runs again, which waits on a re-opened batch, which slot of
which batch is opened again) is made by `coordinator/retry.py` from the records;
the script checks every part of it again and writes all of it or nothing, so a
second retry of the same tasks is refused (they are no longer failed).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from coordinator.ids import root_of
from coordinator.models import RetryBatch, RetryRefused, RetryTask
from coordinator.store.base import EVENTS_MAXLEN, Part, translate_redis_errors
from coordinator.store.protocol import Retry, RetryBatchArgs, RetryBatchKeys, RetryTaskArgs, RetryTaskKeys

__all__ = ["RetryStore"]


class RetryStore(Part):
    """Failed tasks back to `active` (or `delegated` on a re-opened batch), once."""

    @translate_redis_errors
    def retry(
        self,
        root_id: str,
        tasks: Sequence[RetryTask],
        batches: Sequence[RetryBatch],
        due_after_s: float,
        *,
        pace_s: float = 0.0,
    ) -> list[int] | RetryRefused:
        """Apply the plan; each task's retry count, in order, or why nothing was written.

        The first task to run is looked at `due_after_s` from now, and each after it `pace_s` later than the
        one before (their runs are published one by one, in this order)."""
        k, now = self.keys, time.time()
        index = {batch.batch_id: n for n, batch in enumerate(batches, start=1)}
        return self.scripts(
            Retry(
                due=k.due(), live=k.live(root_id), events=k.events(root_id),
                task_keys=[
                    RetryTaskKeys(
                        task=k.task(root, t.task_id), ui_messages=k.ui_messages(root, t.task_id),
                        lease=k.lease(root, t.task_id), conversation=k.conversation(root, t.task_id),
                    )
                    for t in tasks
                    for root in (root_of(t.task_id),)
                ],
                batch_keys=[
                    RetryBatchKeys(
                        batch=k.batch(root_id, b.batch_id), lines=k.batch_lines(root_id, b.batch_id),
                        parent=k.task(root_id, b.parent_id), awaiting=k.awaiting(root_id, b.parent_id),
                        todos=k.todos(root_id, b.parent_id),
                    )
                    for b in batches
                ],
                now=now, look_at=now + due_after_s, pace_s=pace_s, retention_s=self.retention_s, events_maxlen=EVENTS_MAXLEN,
                tasks=[
                    RetryTaskArgs(
                        task_id=t.task_id, role=t.role, batch_index=index[t.slot] if t.slot else 0, keep=t.keep,
                        length=t.length,
                    )
                    for t in tasks
                ],
                batches=[RetryBatchArgs(batch_id=b.batch_id, state=b.state, parent_id=b.parent_id) for b in batches],
            )
        )  # fmt: skip
