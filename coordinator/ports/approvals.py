"""The approvals port: a run's tool calls that wait for a person's decision (coordinator/approvals.py), and
the decisions a resumed run answers its open calls with."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator import approvals
from coordinator.approvals import Decision, ToolCall
from coordinator.models import Batch, Mark
from coordinator.ports.steps import RunStopped, Steps, fenced_writes
from coordinator.timeline import WAIT_PREFIX

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["Answers", "ApprovalPort"]


@dataclass(frozen=True)
class Answers:
    """What a resumed run answers its open calls with: the batch it was resumed from, and decided approvals."""

    batch: Batch | None
    decisions: dict[str, Decision]


class ApprovalPort:
    """One run's approvals: calls parked for a decision, and the decisions read back."""

    def __init__(self, run: Steps, plane: Plane) -> None:
        self._run = run
        self._plane = plane
        # The approvals this run parked, first first: its release claims the park's resume by the first.
        self.parked: list[str] = []

    def park(self, calls: Sequence[ToolCall]) -> list[str]:
        """Queue tool calls for a decision; returns the approval ids."""
        run = self._run
        # Its task waits on a person from now (written with this step): a decision may come before the run ends.
        run.writes.marks.append(Mark(t_ms=int(time.time() * 1000), state=f"{WAIT_PREFIX}approval"))
        run.flush(or_stop=True)
        with fenced_writes(run):
            made = approvals.park(self._plane, run.task, calls, run.token)
        if made is None:  # stopped after that step: as `flush` says of a stop it reads
            raise RunStopped(run.task.id)
        self.parked = [a.id for a in made]
        return self.parked

    def answers(self) -> Answers:
        """The batch the run was resumed from (its children's combined result), and the decided approvals."""
        store, task_id = self._plane.store, self._run.task.id
        batch_id = store.runs.resume_batch_id(task_id)
        batch = store.batches.get_batch(batch_id) if batch_id else None
        return Answers(batch, approvals.decisions(self._plane, task_id))
