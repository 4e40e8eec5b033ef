"""The compaction port: a run's compaction records, kept beside its journal (docs/context.md)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from coordinator import faults
from coordinator.ports.steps import Steps, lose_lease

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["CompactionPort"]


class CompactionPort:
    """One run's compactions of what its model reads: read back on a resume, kept as each is made."""

    def __init__(self, run: Steps, plane: Plane) -> None:
        self._run = run
        self._plane = plane

    def records(self) -> list[str]:
        """The task's compaction records (JSON), oldest first: a resumed run sends the view they make."""
        return self._plane.store.compaction.records(self._run.task.id)

    def keep(self, number: int, record: str, text: str) -> bool:
        """Keep compaction `number` beside the journal, with its `context_compacted` UI line and its timeline
        mark, in one step that writes only while the run holds its lease. What the run did since its last
        step is written first: the journal the record covers, and the summariser's usage (a summary is never
        paid for without being counted). False when that number was kept already (nothing written).

        Raises `LeaseLost` (nothing written) when another run owns the task now.
        """
        run = self._run
        run.flush()
        ui = json.dumps({"ts": time.time(), "type": "say", "say": "context_compacted", "text": text})
        kept = self._plane.store.compaction.keep(run.task, run.token, number, record, ui)
        if kept == "fenced":
            lose_lease(run)
        faults.crash_point(self._plane.settings, "after-compaction")
        return kept == "kept"
