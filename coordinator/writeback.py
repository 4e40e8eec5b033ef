"""Settling delegations: applying ended children to their parent and closing the batch.

`settle(coord, batch_id)` does the write-back of a batch from the state in Redis:
- parallel: every child that has ended is applied (`apply_children.lua`, once per
  child, all in one call); when all have ended the batch is closed;
- sequential: children are applied in order; the first that has not ended is
  started if it never was (the chain grows a step at a time); a step that did
  not complete stops the chain, and the rest are recorded `cancelled`.
Closing (`finish_batch.lua`) happens once; the call that closes it resumes an
agent parent under a numbered Celery task id.

Callers: the chord callback (`subq.gather`) and the chain step (`subq.advance`);
every child as it ends (`settle_child`, which applies just that child, so each
todo item is written as soon as its child ends); and a cancel or budget stop.
Every step is idempotent, so a redelivered or duplicated call changes nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from coordinator import dispatch
from coordinator.models import Batch, BatchRef, SubtaskResult, TaskRecord, TaskStatus, Usage, format_usd

if TYPE_CHECKING:
    from coordinator.service import Coordinator

__all__ = ["close_batch", "combined_result", "result_of", "settle", "settle_child"]


def settle(coord: Coordinator, batch_id: str) -> bool:
    """Write back what has ended in the batch; True when this call closed it."""
    store = coord.store
    batch = store.get_batch(batch_id)
    if batch.status == "done":
        return False
    children = store.get_records(batch.child_ids)
    ended = [c.id for c in children if c.status.terminal]
    if batch.mode == "parallel":
        store.apply_children(batch, ended)
        return len(ended) == len(children) and close_batch(coord, batch)
    for index, child in enumerate(children):
        if not child.status.terminal:
            store.apply_children(batch, [c.id for c in children[:index]])
            if store.claim(child.id, "published"):
                dispatch.publish_step(coord.app, batch, child, index)
            return False
        if child.status != TaskStatus.COMPLETED:
            reason = f"not run: step {index + 1} of the chain ended {child.status.value}"
            rest = [c.id for c in children[index + 1 :]]
            store.stop_tasks(
                rest, top_status="cancelled", status="cancelled", top_error=reason, error=reason,
                top_class="ChainStopped", error_class="ChainStopped",
            )  # fmt: skip
            break
    store.apply_children(batch, batch.child_ids)
    return close_batch(coord, batch)


def settle_child(coord: Coordinator, child: TaskRecord) -> None:
    """A child has ended: write it back now, and close its batch if it was the last.

    O(1) for a parallel batch (the awaiting set says whether it was the last), so
    a wide fan-out does not re-read every sibling as each one ends.
    """
    if not child.batch_id:
        return
    mode, status, parent_id = coord.store.batch_head(child.batch_id)
    if mode == "sequential":
        settle(coord, child.batch_id)
        return
    coord.store.apply_children(BatchRef(id=child.batch_id, parent_id=parent_id, root_id=child.root_id), [child.id])
    if status != "done" and coord.store.awaiting_count(parent_id) == 0:
        settle(coord, child.batch_id)


def close_batch(coord: Coordinator, batch: Batch) -> bool:
    children = coord.store.get_records(batch.child_ids)
    combined = combined_result(batch, children)
    parent = coord.store.get_task(batch.parent_id)
    if parent.status.terminal:  # stopped meanwhile: its caller reads why, then what had finished
        combined = f"Stopped: {parent.error_class}: {parent.error}\n{combined}"
    ui_message = {"ts": time.time(), "type": "say", "say": "subtask_result", "text": combined}
    resumes = coord.store.finish_batch(batch, combined, ui_message)
    if not resumes:
        return False
    if parent.runner == "agent" and parent.status == TaskStatus.DELEGATED:
        dispatch.publish_run(coord.app, parent, resumes)
    return True


def combined_result(batch: Batch, children: list[TaskRecord]) -> str:
    """One block for the parent, children in dispatch order, one line each."""
    done = sum(1 for c in children if c.status == TaskStatus.COMPLETED)
    lines = [f"Subtask results ({batch.mode}, {done} of {len(children)} completed):"]
    for number, child in enumerate(children, 1):
        figures = f"{child.total_tokens} tokens, {format_usd(child.total_cost_micros)}"
        head = f"{number}. [{child.status.value}] {child.description} (task {child.id}"
        head += f", todo {child.todo_id})" if child.todo_id else ")"
        if child.status == TaskStatus.COMPLETED:
            lines.append(f"{head}: {' '.join(child.summary.split())} ({figures})")
        else:
            lines.append(f"{head}: {child.error_class or 'Error'}: {child.error or 'no detail'} ({figures})")
    return "\n".join(lines)


def result_of(record: TaskRecord, pending: str = "delegated") -> SubtaskResult:
    """The result message of a task, from its record (the system of record)."""
    status = record.status.value if record.status.terminal else pending
    return SubtaskResult(
        child_id=record.id,
        status=status,  # type: ignore[arg-type]
        summary=record.summary,
        usage=Usage(
            tokens_in=record.tokens_in,
            tokens_out=record.tokens_out,
            cache_reads=record.cache_reads,
            cache_writes=record.cache_writes,
        ),
        cost_micros=record.cost_micros,
        error=record.error or None,
        error_class=record.error_class or None,
    )
