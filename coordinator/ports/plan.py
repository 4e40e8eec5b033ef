"""The plan port: the orchestration tools' writes (a run's todo list, its delegation), each after the run's
step, and never after its task was stopped (a stop already shown as final)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from coordinator import delegation
from coordinator.models import Batch, DelegationMode, SubtaskSpec, TaskRecord, TodoItem
from coordinator.ports.steps import Steps, fenced_writes

if TYPE_CHECKING:
    from coordinator.plane import Plane
    from coordinator.service import Coordinator

__all__ = ["PlanPort", "Spans"]


class Spans(Protocol):
    """Where a delegation's trace span comes from (the run's hooks, coordinator/runs.py's `RunHooks`)."""

    def span(self, name: str, **attributes: str | int | bool) -> AbstractContextManager[object]: ...


class PlanPort:
    """One run's plan: its todo list (the service's operations), and the delegation it commits."""

    def __init__(self, run: Steps, coord: Coordinator, hooks: Spans) -> None:
        self._run = run
        self._coord = coord  # its todo operations are the service's
        self._plane: Plane = coord.plane
        self._hooks = hooks
        # The delegation this run committed, published by the run's end once its conversation is saved.
        self.delegation: tuple[Batch, list[TaskRecord]] | None = None

    def todos(self) -> list[TodoItem]:
        """The task's plan as stored (the offline planner and the compaction read it)."""
        return self._coord.get_todos(self._run.task.id)

    def update_todos(self, update: str | Sequence[object]) -> list[TodoItem]:
        """Replace the task's plan. Raises `LeaseLost` (nothing written) when another run owns the task now."""
        run = self._run
        run.flush(or_stop=True)  # the conversation that asked for it is saved first
        with fenced_writes(run):
            updated = self._coord.update_todos(run.task.id, update, token=run.token)
        run.step.wrote_own_state()  # its answer has no journal: the step before the next request saves it
        return updated

    def delegate(
        self, subtasks: Sequence[SubtaskSpec], mode: DelegationMode | str, tool_call_id: str
    ) -> tuple[Batch, list[TaskRecord]]:
        """Commit a delegation; it is published by the run's `end` once the conversation is saved.

        Raises `LeaseLost` (nothing committed) when another run owns the task now."""
        run = self._run
        run.flush(or_stop=True)  # a resumed run must find the call that made the delegation in its history
        task_id = run.task.id
        with (
            self._hooks.span("subq.delegate", task_id=task_id, children=len(subtasks), mode=str(mode)),
            fenced_writes(run),
        ):
            self.delegation = delegation.commit(self._plane, task_id, subtasks, mode, tool_call_id, run.token)
        return self.delegation
