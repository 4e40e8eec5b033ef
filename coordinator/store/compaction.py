"""store.compaction: a task's compaction records, kept beside its journal (`keep_compaction.lua`).

A run whose conversation nears its model's context window sends the model a
compacted view of it (workers/runtime/compaction.py, docs/context.md); the
journal (`conversation:<id>`) stays whole, and each compaction is one record in
`compactions:<id>`, written while the run holds its lease together with its
`context_compacted` UI message and its timeline mark. A run resumed on another
worker reads the records and sends the same view, so no turns are compacted twice.
"""

from __future__ import annotations

import time

from coordinator.ids import root_of
from coordinator.models import TaskRecord
from coordinator.store.base import Part, _strs, translate_redis_errors
from coordinator.store.protocol import KeepCompaction

__all__ = ["CompactionStore"]


class CompactionStore(Part):
    """The compaction records of each task, oldest first, as the runs wrote them (JSON)."""

    @translate_redis_errors
    def keep(self, task: TaskRecord, token: str, number: int, record: str, ui_message: str) -> str:
        """Keep compaction `number` of the task's run: 'kept', 'fenced' (the lease is another run's) or
        'kept_before' (that number is kept already); nothing is written unless 'kept'."""
        root, k = task.root_id, self.keys
        return self.scripts(
            KeepCompaction(
                lease=k.lease(root, task.id), task=k.task(root, task.id), compactions=k.compactions(root, task.id),
                ui_messages=k.ui_messages(root, task.id), token=token, number=number, record=record,
                ui_message=ui_message, now=time.time(), retention_s=self.retention_s,
            )
        )  # fmt: skip

    @translate_redis_errors
    def records(self, task_id: str) -> list[str]:
        """Every compaction record of the task, oldest first (JSON)."""
        return _strs(self.client.lrange(self.keys.compactions(root_of(task_id), task_id), 0, -1))
