"""Settling delegations: applying finished children to their parent and closing the batch.

One function, `settle`, does the write-back of a batch from the state in Redis:
- parallel: every child that has ended is applied (`apply_children.lua`, once
  per child, all in one call); when all have ended the batch is closed;
- sequential: children are applied in order; the first that has not ended is
  started if it never was (the chain grows a step at a time); a step that did
  not complete stops the chain, and the rest are recorded `cancelled`.
Closing (`finish_batch.lua`) happens once; the call that closes it resumes an
agent parent under a numbered Celery task id.

The chord callback (`subq.gather`) and the chain step (`subq.advance`) call it;
so does the last run of a child that had delegated, since that child's chord
header ended long before the child did. Every step is idempotent, so a
redelivered or duplicated call changes nothing.
"""

from __future__ import annotations

import time

from coordinator import dispatch
from coordinator.models import Batch, SubtaskResult, TaskRecord, TaskStatus, Usage, format_usd
from workers.runtime.context import Runtime

__all__ = ["combined_result", "result_of", "settle"]


def settle(rt: Runtime, batch_id: str) -> bool:
    """Write back what has ended in the batch; True when this call closed it."""
    store = rt.store
    batch = store.get_batch(batch_id)
    if batch.status == "done":
        return False
    children = store.get_records(batch.child_ids)
    ended = [c.id for c in children if c.status.terminal]
    if batch.mode == "parallel":
        store.apply_children(batch, ended)
        return len(ended) == len(children) and close_batch(rt, batch)
    for index, child in enumerate(children):
        if not child.status.terminal:
            store.apply_children(batch, [c.id for c in children[:index]])
            if store.claim(child.id, "published"):
                dispatch.publish_step(rt.app, batch, child, index)
            return False
        if child.status != TaskStatus.COMPLETED:
            reason = f"not run: step {index + 1} of the chain ended {child.status.value}"
            for rest in children[index + 1 :]:
                store.finish_task(rest.id, "cancelled", error=reason, error_class="ChainStopped")
            break
    store.apply_children(batch, batch.child_ids)
    return close_batch(rt, batch)


def close_batch(rt: Runtime, batch: Batch) -> bool:
    children = rt.store.get_records(batch.child_ids)
    combined = combined_result(batch, children)
    ui_message = {"ts": time.time(), "type": "say", "say": "subtask_result", "text": combined}
    resumes = rt.store.finish_batch(batch, combined, ui_message)
    if not resumes:
        return False
    parent = rt.store.get_task(batch.parent_id)
    if parent.runner == "agent" and parent.status == TaskStatus.ACTIVE:
        dispatch.publish_run(rt.app, parent, resumes)
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


def result_of(record: TaskRecord) -> SubtaskResult:
    """The result message of a task, from its record (the system of record)."""
    status = record.status.value if record.status.terminal else "delegated"
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
