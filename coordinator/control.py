"""Control of running trees: cancel a subtree, stop one (cancel or budget), the live snapshot.

A stop is persisted first (`stop_tasks.lua` makes every task of the subtree
that has not ended terminal, once), so a queued child never starts and a
running one sees it at its next step; the Celery tasks of the stopped ones are
revoked as well. Pending approvals of stopped tasks expire, every batch a
stopped task waited on is closed deepest first, and the top's own place in its
parent's batch is written back, so each parent hears what had finished.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coordinator import admission, approvals, faults, writeback
from coordinator.errors import StateError, ValidationError
from coordinator.inputs import MAX_REASON_CHARS, text_field
from coordinator.models import LiveState, TaskRecord, TaskStatus

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["cancel", "snapshot", "stop_subtree"]


def cancel(plane: Plane, task_id: str, reason: str) -> TaskRecord:
    """Cancel a task and its whole subtree; its parent hears why, with what had finished."""
    reason = text_field(reason, "reason", MAX_REASON_CHARS)
    record = plane.store.records.get_task(task_id)
    if record.status.terminal:
        raise StateError(
            f"Task {task_id} has already ended ({record.status.value}); only a task that has not ended "
            "can be cancelled",
            field="task_id",
        )
    stopped = stop_subtree(
        plane,
        record,
        top_status="cancelled",
        top_error=f"cancelled: {reason}",
        top_class="Cancelled",
        error=f"cancelled with {task_id}: {reason}",
    )
    now = plane.store.records.get_task(task_id)
    if task_id not in stopped and now.status != TaskStatus.CANCELLED:
        # Its run ended it between the read above and the stop, which leaves an ended task as it is.
        raise StateError(
            f"Task {task_id} ended ({now.status.value}) before the cancel reached it, and keeps that outcome",
            field="task_id",
        )
    return now


def stop_subtree(
    plane: Plane, top: TaskRecord, *, top_status: str, top_error: str, top_class: str, error: str
) -> list[str]:
    """Stop `top` and every descendant that has not ended; returns the ids stopped now.

    The subtree is read, then stopped: a run that commits a delegation between the two adds children the
    stop does not name. So it is read again, and what is new stopped, until a read finds nothing new.
    That ends: a commit checks under WATCH that its parent is active, so no stopped task adds more."""
    stopped: list[str] = []
    named: set[str] = set()
    while new := [t for t in plane.store.records.subtree_ids(top.id) if t not in named]:
        named.update(new)
        stopped += plane.store.batches.stop_tasks(
            new if top.id in new else [top.id, *new],  # the top first: it takes `top_status` (once)
            top_status=top_status,
            status="cancelled",
            top_error=top_error,
            error=error,
            top_class=top_class,
            error_class="Cancelled",
            watch_s=plane.settings.reconcile_grace_s,  # on the due list till written back, below
        )
    stopped = list(dict.fromkeys(stopped))  # a pass sent again after its reply was lost names its own again
    if not stopped:
        return []
    faults.crash_point(plane.settings, "after-stop")  # each stopped task on the due list: the reconciler writes it back
    plane.app.control.revoke(stopped)  # queued ones never start (the persisted status covers restarts)
    approvals.expire_for(plane, top.root_id, set(stopped))
    records = plane.store.records.get_records(stopped)
    live = admission.release_stopped(plane, records)  # before the unwatch below: a dead run's slot, due no more
    admission.withdraw_stopped(plane, records)  # their tenant's demand for fleet slots, which none will take now
    stopped_top = plane.store.records.get_task(top.id)
    if top.id not in stopped:  # stopped before: the batch it waits on closes with the children stopped now
        records.insert(0, stopped_top)
    for record in reversed(records):  # deepest first
        if record.waiting_batch_id:
            writeback.write_back(plane, record.waiting_batch_id)
    if stopped_top.status.terminal and stopped_top.batch_id:
        writeback.write_back(plane, stopped_top.batch_id, ended=stopped_top)
    # Written back. A live run that holds a slot stays due: it unwatches as it ends, and if it dies first the
    # reconciler frees its slot once its lease lapses (unwatched, the slot stayed held by an ended task).
    plane.store.convergence.unwatch([t for t in stopped if t not in live])
    return stopped


def snapshot(plane: Plane, task_id: str) -> dict[str, LiveState]:
    """The live state of every task of the tree (queued, running, waiting_approval, ended)."""
    record = plane.store.records.get_task(task_id)
    if record.id != record.root_id:
        raise ValidationError(f"{task_id} is not a root task (its root is {record.root_id})", field="task_id")
    live = plane.store.events.live(task_id)
    out: dict[str, LiveState] = {}
    for task in plane.store.records.get_records(plane.store.records.tree_task_ids(task_id)):
        state = live.get(task.id, {})
        ended = task.status.value if task.status.terminal else None
        waiting = "delegated" if task.status == TaskStatus.DELEGATED else "queued"
        out[task.id] = LiveState.model_validate(
            {
                "task_id": task.id,
                "parent_id": task.parent_id,
                "depth": task.depth,
                "state": ended or state.get("state") or waiting,
                "ts": float(state.get("ts") or task.updated_at),
                "tool": state.get("tool"),
                "text": state.get("text"),
                "requests": task.requests,
                "cost_micros": task.total_cost_micros,
                # What it waits for and why (a parked run: its tenant's share), while it has not ended.
                "waiting_for": None if ended else (state.get("waiting_for") or task.waiting_for),
                "reason": None if ended else state.get("reason"),
            }
        )
    return out
