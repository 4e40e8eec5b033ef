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
from collections.abc import Sequence
from typing import TYPE_CHECKING

from coordinator import admission, approvals, delegation, writeback
from coordinator.approvals import ToolCall
from coordinator.errors import NotFoundError
from coordinator.heartbeat import Heartbeat
from coordinator.models import (
    SubtaskResult,
    TaskRecord,
    TaskStatus,
)
from coordinator.run import LIVE_EVERY_S, MAX_SUMMARY_CHARS, Ended, HandBack, LeaseLost, Released, Run, RunStopped

if TYPE_CHECKING:
    from coordinator.service import Coordinator
__all__ = [
    "LIVE_EVERY_S",
    "MAX_SUMMARY_CHARS",
    "Ended",
    "HandBack",
    "LeaseLost",
    "Released",
    "Run",
    "RunInProgress",
    "RunLifecycle",
    "RunStopped",
    "ToolCall",
]

log = logging.getLogger(__name__)


class RunInProgress(Exception):
    """Another delivery of this task is running it now; this one is retried later."""


class RunLifecycle:
    """One per worker process: starts runs, renews their leases, settles batches, hands runs back."""

    def __init__(self, coord: Coordinator, worker_id: str | None = None) -> None:
        self.coord = coord
        self.heartbeat = Heartbeat(coord, worker_id or f"{socket.gethostname()}:{os.getpid()}")

    def start(self, task_id: str) -> Run | SubtaskResult:
        """A `Run` holding the task's lease, or the result to return when there is nothing to run."""
        coord = self.coord
        if admission.limits_set(coord):
            return self._start_admitted(task_id)
        token = secrets.token_hex(8)
        try:
            started = coord.store.begin_run(
                task_id, token, coord.settings.heartbeat_lapse_s, coord.settings.reconcile_interval_s
            )
        except NotFoundError as exc:
            return _unknown(task_id, exc)
        assert started.record is not None
        if started.verdict == "other":
            return self._nothing_to_run(started.record)
        if started.verdict == "leased":
            # A live run holds it and will end it; a dead one's lease lapses and the
            # reconciler publishes the task again, so this delivery has nothing to do.
            return writeback.result_of(started.record, pending="running")
        run = Run(self, started.record, token, conversation=started.conversation, exhausted=started.exhausted)
        run.deliveries, run.run_seq = started.deliveries, started.run_seq
        self.heartbeat.hold(run)
        return run

    def _start_admitted(self, task_id: str) -> Run | SubtaskResult:
        """The start when admission limits are set: admit first (a run may wait for a slot), then lease."""
        coord = self.coord
        try:
            task = coord.store.get_task(task_id)
        except NotFoundError as exc:
            return _unknown(task_id, exc)
        if task.runner != "agent" or task.status.terminal or task.status == TaskStatus.DELEGATED:
            return self._nothing_to_run(task)
        if not admission.admit(coord, task):
            return writeback.result_of(task, pending="queued")
        token = secrets.token_hex(8)
        if not coord.store.acquire_lease(task_id, token, coord.settings.heartbeat_lapse_s):
            return writeback.result_of(task, pending="running")  # as in `start`
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

    def _nothing_to_run(self, task: TaskRecord) -> SubtaskResult:
        """A delivery of a task that is not an agent's to run now: refused, ended, or delegated."""
        coord = self.coord
        if task.runner != "agent":
            error = f"task {task.id} is owned by its caller (runner {task.runner!r}), not run by an agent"
            log.error("subq.run_task refused: %s", error)
            return SubtaskResult(child_id=task.id, status="failed", error=error, error_class="StateError")
        if task.status.terminal:
            # Redelivered, duplicated, stopped before it started, or its run died after
            # ending it: free a slot it may hold, write it back (once: idempotent), forget it.
            admission.release(coord, task)
            if task.batch_id:
                writeback.write_back(coord, task.batch_id, ended=task)
            coord.store.unwatch([task.id])
            return writeback.result_of(task)
        delegation.publish_waiting(coord, task)  # delegated: a batch a dead run left unpublished
        return writeback.result_of(task)

    def must_stop(self, runs: Sequence[Run]) -> list[Run]:
        """The runs among `runs` that must stop now, even mid-request; one Redis read for all of them.

        A task that is gone (its tree expired or was deleted) stops its run too.
        """
        statuses = self.coord.store.statuses_of([run.task_id for run in runs])
        return [run for run, status in zip(runs, statuses, strict=True) if run.must_stop_now(status or "cancelled")]

    def stops_so_far(self) -> int:
        """A count that moves whenever a task is stopped (cancel, budget, chain): one small read."""
        return self.coord.store.stops_so_far()

    def must_stop_here(self, runs: Sequence[Run]) -> list[Run]:
        """The runs among `runs` that must stop for a reason of this process alone (fenced, out of grace)."""
        return [run for run in runs if run.must_stop_now(TaskStatus.ACTIVE)]

    def settle_batch(self, batch_id: str) -> bool:
        """A chain step (or an older release's chord callback): write back what has ended; True when it closed."""
        return writeback.write_back(self.coord, batch_id)

    def expire_approval(self, approval_id: str) -> bool:
        return approvals.expire(self.coord, approval_id)

    def drain(self, grace_s: float) -> None:
        """The worker is shutting down: every run hands itself back within `grace_s`."""
        self.heartbeat.drain(grace_s)


def _unknown(task_id: str, exc: NotFoundError) -> SubtaskResult:
    log.error("subq.run_task for an unknown task %r: %s", task_id, exc)
    return SubtaskResult(child_id=task_id, status="failed", error=str(exc), error_class="NotFoundError")
