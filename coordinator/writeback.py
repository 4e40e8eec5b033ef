"""Settling delegations: applying ended children to their parent and closing the batch.

`write_back(plane, batch_id, ended=None)`, the one entry point, does the
write-back of a batch from the state in Redis:
- parallel: every child that has ended is applied (`apply_children.lua`, once per
  child, all in one call); when all have ended the batch is closed;
- sequential: children are applied in order; the first that has not ended is
  started if it never was (the chain grows a step at a time); a step that did
  not complete stops the chain, and the rest are recorded `cancelled`.
Closing (`close_batch.lua`) happens once, in constant time per child: each
child's line of the combined result is stored as it is applied, and the close
joins the lines in dispatch order. The call that closes it resumes an agent
parent under a numbered Celery task id.

The combined result a parent reads (the answer to its delegation call) is one
header line, then each child's line in dispatch order, numbered:

    Subtask results (parallel, 2 of 3 completed):
    1. [completed] <description> (task <id>, todo <todo id>): <summary> (<tokens> tokens, $<cost>)
    2. [completed] ... (...) Output (JSON): {"total":3}
    3. [failed] <description> (task <id>): <error class>: <error> (<tokens> tokens, $<cost>)

A completed child with an output schema has its validated data appended to its
line as compact JSON (`Output (JSON): ...`, one line), up to OUTPUT_IN_LINE_BYTES
(an output's own bound, so every valid one fits). The whole is at most
COMBINED_RESULT_BYTES: past it, each later line keeps its head and names the
child whose record has the rest (`[cut: ...]`). The lines are made by hashes.lua's
`line_of` and written by `apply_children.lua` (and again by `record_late_spend.lua`
with the spend a run made before a stop), the header and the cut by
`close_batch.lua` (`Stopped: ...` first when the parent was stopped meanwhile).

Callers, all in the coordinator: a run's end for a step of a chain (`end_run.lua`
writes a parallel child back itself), a redelivery of an ended task and the
reconciler, `subq.advance` (a chain step); and a cancel or budget stop
(coordinator/control.py).
Every step is idempotent, so a redelivered or duplicated call changes nothing.
A step that sends a message (the next chain step, a parent's resume) watches
its task first (the due list), so a process that dies before the send leaves
it to the reconciler (coordinator/reconciler.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from coordinator import admission, approvals, dispatch, faults, tracing
from coordinator.errors import NotFoundError
from coordinator.models import Batch, BatchRef, SubtaskResult, TaskRecord, TaskStatus
from coordinator.replies import END_SUBMISSION, RESUME_RUN

if TYPE_CHECKING:
    from coordinator.plane import Plane

log = logging.getLogger(__name__)

__all__ = [
    "COMBINED_RESULT_BYTES",
    "OUTPUT_IN_LINE_BYTES",
    "close_batch",
    "end_submission",
    "result_of",
    "resumed",
    "settle_ended",
    "write_back",
]

# The most of a child's output (compact JSON) its line of the combined result carries: a parent of
# fifty typed children reads fifty objects, each within a few thousand tokens (hashes.lua's OUTPUT_IN_LINE
# is this number).
OUTPUT_IN_LINE_BYTES = 16384
# The most the whole combined result carries (close_batch.lua's COMBINED_RESULT_BYTES, the same number): past
# it, each later child's line keeps its first 300 bytes (status, description, task id) and names its record.
COMBINED_RESULT_BYTES = 262144


@tracing.traced("subq.write_back")
def write_back(plane: Plane, batch_id: str, ended: TaskRecord | None = None) -> bool:
    """Write back what has ended in the batch; True when this call closed it.

    The one write-back entry point. With `ended` (a child that has just ended) a
    parallel batch applies just that child and closes if it was the last: O(1),
    the awaiting set says whether it was, so a wide fan-out does not re-read every
    sibling as each one ends. Without it (a chain step, a stop),
    every child that has ended is applied from the records in Redis. A child is
    applied, and its batch closed, by `settle_child.lua`, the script a run's end
    calls inside `end_run.lua`: one implementation for every caller.
    """
    store = plane.store
    if ended is not None:
        try:
            settled = store.batches.settle_child(batch_id, ended, plane.settings.reconcile_grace_s)
        except NotFoundError:
            # Its batch's record lapsed (a batch open longer than SUBQ_RESULT_RETENTION_S): nothing is left to
            # write it back to. Raised, it failed a stop of the child, and every reconciler tick that met it.
            log.warning("subq: %s ended after its batch %s lapsed; nothing is written back", ended.id, batch_id)
            return False
        if settled.mode == "parallel":
            return bool(settled.resumes) and resumed(plane, ended.parent_id or "", settled.resumes, settled.resume)
    batch = store.batches.get_batch(batch_id)
    if batch.status == "done":
        return False
    children = store.records.get_records(batch.child_ids)
    if batch.mode == "parallel":
        ended_ids = [c.id for c in children if c.status.terminal]
        store.batches.apply_children(batch, ended_ids)
        return len(ended_ids) == len(children) and close_batch(plane, batch)
    for index, child in enumerate(children):
        if not child.status.terminal:
            store.batches.apply_children(batch, [c.id for c in children[:index]])
            _publish_step(plane, child)
            return False
        if child.status != TaskStatus.COMPLETED:
            reason = f"not run: step {index + 1} of the chain ended {child.status.value}"
            # Each later step with its whole subtree: a step may have been given children
            # (a caller delegating from it) before the chain reached it.
            rest = [t for c in children[index + 1 :] for t in store.records.subtree_ids(c.id)]
            store.batches.stop_tasks(
                rest,
                top_status="cancelled",
                status="cancelled",
                top_error=reason,
                error=reason,
                top_class="ChainStopped",
                error_class="ChainStopped",
            )
            break
    store.batches.apply_children(batch, batch.child_ids)
    return close_batch(plane, batch)


def _publish_step(plane: Plane, step: TaskRecord) -> None:
    """Publish the chain's current step, once. One published already was watched by its publisher first: watched
    again here, a step parked on its provider (off the due list, its timer set) was taken for lost and published
    while its provider was still down."""
    store = plane.store
    if store.runs.step_published(step.id):
        return
    store.convergence.watch([step.id], plane.settings.reconcile_grace_s)  # first: a lost step is published again
    if store.runs.claim_step_publish(step.id):
        dispatch.publish_step(plane.app, step)


def close_batch(plane: Plane, batch: Batch | BatchRef) -> bool:
    """Close the batch (once) and publish its agent parent's resume; True when this call closed it."""
    closed = plane.store.batches.close_batch(batch, plane.settings.reconcile_grace_s)
    return bool(closed.resumes) and resumed(plane, batch.parent_id, closed.resumes, closed.resume)


def resumed(plane: Plane, parent_id: str, resumes: int, resume: int) -> bool:
    """A batch was closed (the parent's `resumes`-th time): publish its agent parent's resumed run (RESUME_RUN),
    or end a submission's root (END_SUBMISSION); the close put the parent on the due list first. True."""
    faults.crash_point(plane.settings, "after-close")
    if resume == RESUME_RUN:
        (parent,) = plane.store.records.get_records([parent_id])
        dispatch.publish_run(plane.app, parent, resumes)
    elif resume == END_SUBMISSION:
        end_submission(plane, parent_id)
    return True


def end_submission(plane: Plane, task_id: str) -> bool:
    """End a submission's root whose batch has closed (True; False for any other task, which it leaves).

    A submission (`subq.submit` with subtasks) hands its root to nobody: no run resumes it, no caller goes on
    from it, so it ends as its batch closes, `completed` when every child completed and `failed`
    (`SubtasksFailed`) when one did not, its summary the combined result. Its `task.*` event and `on_complete`
    go out from that end: before, the root stood `active` for good and its producer was never called back.
    It stays `delegated` from the close to this end (finish_batch.lua), so no waiter takes it for settled
    meanwhile. The close put it on the due list first, so a closer that dies before this leaves it to the
    reconciler; ending twice changes nothing (`finish_task.lua` keeps the first outcome)."""
    store = plane.store
    batch_id = store.records.submission_batch(task_id)
    if batch_id is None:
        return False
    try:
        batch = store.batches.get_batch(batch_id)
    except NotFoundError:
        return False  # its batch lapsed (open longer than a retention): nothing to end it with
    if batch.status != "done":
        return False
    statuses = store.records.statuses_of(batch.child_ids)  # one round trip, statuses alone (a lapsed one: None)
    missed = sum(status != TaskStatus.COMPLETED for status in statuses)
    if missed:
        error = f"{missed} of {len(statuses)} subtasks did not complete (the summary has each one's line)"
        store.runs.finish_task(task_id, "failed", batch.result, error=error, error_class="SubtasksFailed")
    else:
        store.runs.finish_task(task_id, "completed", batch.result)
    store.convergence.unwatch([task_id])
    return True


def settle_ended(plane: Plane, record: TaskRecord) -> None:
    """A task that has ended and is still due, whatever its run did after its end: the one repair.

    Its run died between `end_run.lua` and what the end sends, or its message came again (redelivered,
    duplicated, stopped before it started), or a stop died before it wrote it back: free a run slot it may hold,
    expire the calls its last run asked a person about that are still pending, write it back to its batch
    (once: idempotent), and take it off the due list. The reconciler and a worker given its message both call this.
    """
    if record.status == TaskStatus.DELEGATED:
        admission.release_delegated(plane, record)  # read after a retry made it wait on its retried children
        return
    if not record.status.terminal:
        return  # read again after the look that found it ended: a retry since made it active, its new run's to end
    admission.release(plane, record, while_ended=True)  # not a retried run's, should a retry come first
    approvals.expire_waited_on(plane, record.id)  # a stop that died before it expired them
    if record.batch_id:
        write_back(plane, record.batch_id, ended=record)
    plane.store.convergence.unwatch_ended(record)


def result_of(record: TaskRecord, pending: str = "delegated") -> SubtaskResult:
    """The result message of a task, from its record (the system of record)."""
    status = record.status.value if record.status.terminal else pending
    return SubtaskResult(
        child_id=record.id,
        status=status,  # type: ignore[arg-type]
        summary=record.summary,
        usage=record.usage,
        cost_micros=record.cost_micros,
        error=record.error or None,
        error_class=record.error_class or None,
        output=record.output if record.status == TaskStatus.COMPLETED else None,
    )
