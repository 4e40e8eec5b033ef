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
from coordinator.store.base import EVENTS_MAXLEN, Part, ScriptArg, translate_redis_errors

__all__ = ["RetryStore"]


class RetryStore(Part):
    """Failed tasks back to `active` (or `delegated` on a re-opened batch), once."""

    @translate_redis_errors
    def retry(
        self, root_id: str, tasks: Sequence[RetryTask], batches: Sequence[RetryBatch], due_after_s: float
    ) -> list[int] | RetryRefused:
        """Apply the plan; each task's retry count, in order, or why nothing was written."""
        keys, now = self.keys, time.time()
        index = {batch.batch_id: n for n, batch in enumerate(batches, start=1)}
        script_keys: list[str] = [keys.due(), keys.live(root_id), keys.events(root_id)]
        args: list[ScriptArg] = [now, now + due_after_s, self.retention_s, EVENTS_MAXLEN, len(tasks), len(batches)]
        for task in tasks:
            root = root_of(task.task_id)
            script_keys += [
                keys.task(root, task.task_id),
                keys.ui_messages(root, task.task_id),
                keys.lease(root, task.task_id),
                keys.conversation(root, task.task_id),
            ]
            args += [task.task_id, task.role, index[task.slot] if task.slot else 0, task.keep, task.length]
        for batch in batches:
            script_keys += [
                keys.batch(root_id, batch.batch_id),
                keys.batch_lines(root_id, batch.batch_id),
                keys.task(root_id, batch.parent_id),
                keys.awaiting(root_id, batch.parent_id),
                keys.todos(root_id, batch.parent_id),
            ]
            args += [batch.batch_id, batch.state, batch.parent_id]
        reply = self.scripts.retry(keys=script_keys, args=args)
        if reply[0] == "refused":
            return RetryRefused(str(reply[1]), str(reply[2]), str(reply[3]))
        return [int(n) for n in reply[1]]
