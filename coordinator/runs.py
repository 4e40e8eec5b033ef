"""The run-lifecycle seam: everything a worker needs from the coordinator for one run of a task.

The worker's runner drives the agent loop and nothing else; each step that
touches shared state is one call here, in this order:

    run = lifecycle.start(task_id)       admit, lease, count the delivery, live 'running'
    run.history() / run.answers()        the persisted conversation, and the answers to its open calls
    run.check_stop() / run.rate_wait_ms() before each model request: a stop or spent budget, the rate limit
    run.record_response(...)             after each: usage and cost (once per request key), live status
    run.save(...) / run.say(...)         new conversation messages, UI messages
    run.update_todos / run.delegate      the orchestration tools
    run.park(calls)                      tool calls that wait for a human decision
    run.end(outcome)                     finish, release the lease, free the slot, write back, resume

A run holds its task's lease for as long as its worker's heartbeat renews it
(`SUBQ_HEARTBEAT_LAPSE_S`, renewed every third of that by one thread per
process): a dead worker's leases lapse within seconds and the reconciler
(coordinator/reconciler.py) publishes those runs again. A run that finds its
lease gone stops at its next step and writes nothing more (`LeaseLost`: a
fence, so there are never two live runs of one task). A worker that is shutting
down (`drain`) hands each run back at its next step boundary (`HandBack`): the
conversation is saved after every response, so the next run goes on from there.

`end` records the outcome before it frees the run slot, so a finished child
never shows `running` beside the next one admitted. A task that ended writes
itself back at once (`writeback.write_back`, the one write-back entry point); a
delegated task publishes its committed batch only after its state is saved.
`start` returns a plain result instead of a `Run` when there is nothing to run:
the task ended (a redelivery), is delegated (publishing a batch a dead run left
unpublished), or must wait for a run slot.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordinator import admission, approvals, budgets, delegation, dispatch, faults, writeback
from coordinator.approvals import ToolCall
from coordinator.errors import NotFoundError, StoreError
from coordinator.heartbeat import Heartbeat
from coordinator.models import (
    Batch,
    DelegationMode,
    SubtaskResult,
    SubtaskSpec,
    TaskRecord,
    TaskStatus,
    TodoItem,
    Usage,
)
from coordinator.settings import Profile

if TYPE_CHECKING:
    from coordinator.service import Coordinator

__all__ = [
    "MAX_SUMMARY_CHARS",
    "Ended",
    "HandBack",
    "LeaseLost",
    "Released",
    "Run",
    "RunInProgress",
    "RunLifecycle",
    "ToolCall",
]

log = logging.getLogger(__name__)

# A summary is what the parent reads back; the full text stays in the conversation.
MAX_SUMMARY_CHARS = 4000
# Live status carries an excerpt of the latest model text, not the whole of it.
LIVE_TEXT_CHARS = 200


class RunInProgress(Exception):
    """Another delivery of this task is running it now; this one is retried later."""


class LeaseLost(Exception):
    """The run's lease lapsed or was taken: another run owns the task now; this one writes nothing more."""


class HandBack(Exception):
    """The worker is shutting down: the run stops at this step boundary and is queued again."""


@dataclass(frozen=True)
class Ended:
    """The task's run ended the task: completed, failed or cancelled."""

    status: str
    summary: str = ""
    error: str = ""
    error_class: str = ""


@dataclass(frozen=True)
class Released:
    """The run ended before the task did: `delegated`, or `waiting_approval`."""

    state: str


class RunLifecycle:
    """One per worker process: starts runs, renews their leases, settles batches, hands runs back."""

    def __init__(self, coord: Coordinator, worker_id: str | None = None) -> None:
        self.coord = coord
        self.heartbeat = Heartbeat(coord, worker_id or f"{socket.gethostname()}:{os.getpid()}")

    def start(self, task_id: str) -> Run | SubtaskResult:
        """A `Run` holding the task's lease, or the result to return when there is nothing to run."""
        coord = self.coord
        try:
            task = coord.store.get_task(task_id)
        except NotFoundError as exc:
            log.error("subq.run_task for an unknown task %r: %s", task_id, exc)
            return SubtaskResult(child_id=task_id, status="failed", error=str(exc), error_class="NotFoundError")
        if task.runner != "agent":
            error = f"task {task_id} is owned by its caller (runner {task.runner!r}), not run by an agent"
            log.error("subq.run_task refused: %s", error)
            return SubtaskResult(child_id=task_id, status="failed", error=error, error_class="StateError")
        if task.status.terminal:
            # Redelivered, duplicated, stopped before it started, or its run died after
            # ending it: free a slot it may hold, write it back (once: idempotent), forget it.
            admission.release(coord, task)
            if task.batch_id:
                writeback.write_back(coord, task.batch_id, ended=task)
            coord.store.unwatch([task_id])
            return writeback.result_of(task)
        if task.status == TaskStatus.DELEGATED:
            delegation.publish_waiting(coord, task)
            return writeback.result_of(task)
        if not admission.admit(coord, task):
            return writeback.result_of(task, pending="queued")
        token = secrets.token_hex(8)
        if not coord.store.acquire_lease(task_id, token, coord.settings.heartbeat_lapse_s):
            # A live run holds it and will end it; a dead one's lease lapses and the
            # reconciler publishes the task again, so this delivery has nothing to do.
            return writeback.result_of(task, pending="running")
        run = Run(self, task, token)
        try:
            # From now on the reconciler looks every tick: a lapsed lease is a dead worker.
            coord.store.watch([task_id], coord.settings.reconcile_interval_s, only_if_watched=True)
            coord.store.set_live(task, "running")
            run.deliveries, run.run_seq = coord.store.start_run(task_id)
        except BaseException:
            run.abandon()  # the lease must not outlive a start that failed
            raise
        self.heartbeat.hold(run)
        return run

    def settle_batch(self, batch_id: str) -> bool:
        """The chord callback or a chain step: write back what has ended; True when it closed the batch."""
        return writeback.write_back(self.coord, batch_id)

    def expire_approval(self, approval_id: str) -> bool:
        return approvals.expire(self.coord, approval_id)

    def drain(self, grace_s: float) -> None:
        """The worker is shutting down: every run hands itself back within `grace_s`."""
        self.heartbeat.drain(grace_s)


class Run:
    """One run of one task, holding its lease; ended once by `end` (or `abandon` on a store failure)."""

    def __init__(self, lifecycle: RunLifecycle, task: TaskRecord, token: str) -> None:
        self._heartbeat = lifecycle.heartbeat
        self._coord = lifecycle.coord
        self.token = token
        self.task = task
        self.deliveries = 0
        # Runs of this task ever: request keys `<run_seq>:<request no>` stay unique across resumes.
        self.run_seq = 0
        self.delegation: tuple[Batch, list[TaskRecord]] | None = None
        # Set by the heartbeat when the lease was lost: the run must not write again.
        self.fenced = False

    @property
    def task_id(self) -> str:
        return self.task.id

    @property
    def lost_too_often(self) -> Ended | None:
        """A run delivered more than SUBQ_MAX_DELIVERIES times (its worker kept dying) fails instead."""
        limit = self._coord.settings.max_deliveries
        if self.deliveries <= limit:
            return None
        error = f"lost with its worker {self.deliveries - 1} times (SUBQ_MAX_DELIVERIES={limit})"
        return Ended("failed", error=error, error_class="WorkerLost")

    def profile(self) -> Profile:
        return self._coord.settings.profile(self.task.profile)

    # -- the conversation ---------------------------------------------------------------

    def history(self) -> list[str]:
        """The persisted conversation, one JSON message an entry."""
        return self._coord.store.conversation(self.task.id)

    def answers(self) -> tuple[Batch | None, dict[str, approvals.Decision]]:
        """What the run answers its open calls with: the batch it was resumed from, and decided approvals."""
        batch_id = self._coord.store.resume_batch_id(self.task.id)
        batch = self._coord.store.get_batch(batch_id) if batch_id else None
        return batch, approvals.decisions(self._coord, self.task.id)

    def save(self, entries: Sequence[str]) -> None:
        if self.fenced or not self._coord.store.append_conversation(self.task.id, entries, lease_token=self.token):
            self.fenced = True
            raise LeaseLost(self.task.id)

    def say(self, kind: str, text: str) -> None:
        """A UI message of this task, as AI coding tools show a task's progress."""
        self._coord.store.append_ui_message(self.task.id, {"ts": time.time(), "type": "say", "say": kind, "text": text})

    # -- each model request -------------------------------------------------------------

    def is_stopped(self) -> bool:
        """Whether the run must stop now, even in the middle of a model request."""
        return self.fenced or self._heartbeat.out_of_grace() or self.is_stopped_by_status()

    def is_stopped_by_status(self) -> bool:
        """Whether its task was stopped (cancelled, or a budget over it is spent)."""
        status, _ = self._coord.store.status_of(self.task.id)
        return TaskStatus(status).terminal

    def check_stop(self) -> tuple[bool, str | None]:
        """(stopped, budget holder): whether the run must stop before its next request, and why.

        Raises `LeaseLost` or `HandBack` when the run must end without an outcome of its own.
        """
        if self.fenced:
            raise LeaseLost(self.task.id)
        if self._heartbeat.draining:
            raise HandBack(self.task.id)
        if self.is_stopped():
            return True, None
        holder = budgets.exhausted(self._coord, self.task)
        return holder is not None, holder

    def rate_wait_ms(self, provider: str) -> int:
        return admission.wait_for_rate(self._coord, provider)

    def record_response(
        self,
        request_no: int,
        usage: Usage,
        cost_micros: int,
        cost_source: str,
        *,
        latency_ms: float,
        tool: str | None,
        text: str,
    ) -> tuple[int, str | None]:
        """Record one response's usage once (see Store.record_usage) and publish the live status."""
        store = self._coord.store
        store.observe_latency(latency_ms)
        recorded, exhausted = store.record_usage(
            self.task.id, f"{self.run_seq}:{request_no}", usage, cost_micros, cost_source, ancestors=self.task.ancestors
        )
        if recorded >= 0:
            (current,) = store.get_records([self.task.id])
            live: dict[str, Any] = {"tool": tool, "text": text[:LIVE_TEXT_CHARS] or None}
            store.set_live(
                self.task, "running", **live, requests=current.requests, cost_micros=current.total_cost_micros
            )
        return recorded, exhausted

    def transient_error(self, what: str, attempt: int) -> None:
        self._coord.store.count_transient_error(self.task.id)
        self.say("retry", f"{what}: retrying (attempt {attempt})")

    # -- the orchestration tools --------------------------------------------------------

    def update_todos(self, update: str | Sequence[object]) -> list[TodoItem]:
        return self._coord.update_todos(self.task.id, update)

    def delegate(
        self, subtasks: Sequence[SubtaskSpec], mode: DelegationMode | str, tool_call_id: str
    ) -> tuple[Batch, list[TaskRecord]]:
        """Commit a delegation; it is published by `end` once the conversation is saved."""
        self.delegation = delegation.commit(self._coord, self.task.id, subtasks, mode, tool_call_id)
        return self.delegation

    def park(self, calls: Sequence[ToolCall]) -> list[str]:
        """Queue tool calls for a decision; returns the approval ids."""
        return [a.id for a in approvals.park(self._coord, self.task, calls)]

    # -- the end ------------------------------------------------------------------------

    def stopped(self, budget_holder: str | None) -> Ended:
        """The outcome of a run that was stopped (a cancel, or a budget: its holder's subtree is stopped now)."""
        if self.fenced:
            raise LeaseLost(self.task.id)
        if self._heartbeat.draining and not self.is_stopped_by_status():
            raise HandBack(self.task.id)
        if budget_holder:
            budgets.stop(self._coord, budget_holder)
        task = self._coord.store.get_task(self.task.id)
        return Ended(task.status.value if task.status.terminal else "cancelled", error=task.error)

    def end(self, outcome: Ended | Released) -> SubtaskResult:
        """Record the outcome, release the lease and the slot (in that order), write back or publish."""
        coord, task_id = self._coord, self.task.id
        if self.fenced:
            raise LeaseLost(task_id)
        if isinstance(outcome, Released):
            self._release()
            if outcome.state == "delegated":
                delegation.publish_waiting(coord, coord.store.get_task(task_id))
            else:  # waiting for a decision: each decision (or its timer) watches it again
                coord.store.unwatch([task_id])
            coord.store.set_live(self.task, outcome.state)
            return writeback.result_of(coord.store.get_task(task_id), pending=outcome.state)
        summary = outcome.summary[:MAX_SUMMARY_CHARS]
        coord.store.finish_task(task_id, outcome.status, summary, outcome.error, outcome.error_class)
        faults.crash_point(coord.settings, "after-finish")
        self._release()
        (final,) = coord.store.get_records([task_id])  # one read; the result needs no child lists
        if final.status == TaskStatus.COMPLETED:
            self.say("completion_result", final.summary)
        else:
            self.say("error", f"{final.error_class}: {final.error}")
        if final.batch_id:
            writeback.write_back(coord, final.batch_id, ended=final)  # its todo item is written as it ends
        coord.store.unwatch([task_id])
        return writeback.result_of(final)

    def lost(self) -> SubtaskResult:
        """The run lost its lease: another run owns the task; this one leaves everything to it."""
        log.warning("subq: the run of %s lost its lease and stopped without writing", self.task.id)
        self._heartbeat.forget(self)  # its run slot is the task's, which the new run holds now
        return writeback.result_of(self._coord.store.get_task(self.task.id), pending="running")

    def hand_back(self) -> SubtaskResult:
        """Queue the task again for another worker (its conversation is saved) and free this one."""
        coord = self._coord
        coord.store.watch([self.task.id], coord.settings.reconcile_grace_s)  # a lost message is published again
        coord.store.reset_deliveries(self.task.id)  # handed back is not lost: SUBQ_MAX_DELIVERIES counts losses
        self._release()
        task = coord.store.get_task(self.task.id)
        if not task.status.terminal:
            dispatch.publish_again(coord.app, task, coord.store.next_repair(task.id))
            coord.store.set_live(task, "queued")
            log.warning("subq: handed %s back to the queue", task.id)
        return writeback.result_of(task, pending="queued")

    def abandon(self) -> None:
        """The run failed outside the agent (Redis): free the lease and slot if Redis lets us; retried."""
        try:
            self._release()
        except StoreError as exc:  # the lease lapses with its TTL; the original error is what matters
            log.warning("subq: could not release the run of %s: %s", self.task.id, exc)

    def _release(self) -> None:
        self._heartbeat.forget(self)
        self._coord.store.release_lease(self.task.id, self.token)
        admission.release(self._coord, self.task)
