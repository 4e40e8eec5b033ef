"""Closing delegations: the chord callback and the chain's per-step write-back.

`gather` applies every child of a parallel batch and closes it; `advance`
applies one step of a sequential batch, stops the chain on a failed step
(the remaining children are recorded `cancelled` with the reason) and closes
it after the last. Each write-back is one idempotent Lua step and closing is
another, so a redelivered or duplicated callback changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import pydantic

from coordinator.models import Batch, SubtaskResult, TaskRecord, format_usd
from workers.runtime.context import Runtime

__all__ = ["advance", "combined_result", "gather"]

log = logging.getLogger(__name__)


def gather(rt: Runtime, batch_id: str, raw_results: Iterable[object]) -> bool:
    """Apply every child of a parallel batch, then close it; True if this call closed it."""
    batch = rt.store.get_batch(batch_id)
    results = _parse_results(raw_results)
    for child_id in batch.child_ids:
        result = results.get(child_id) or SubtaskResult(
            child_id=child_id, status="failed", error="no result reached the callback", error_class="MissingResult"
        )
        rt.store.apply_child(batch, result)
    return close_batch(rt, batch)


def advance(rt: Runtime, batch_id: str, raw_result: object) -> bool:
    """Apply one finished step of a sequential batch; True when the chain must stop here."""
    batch = rt.store.get_batch(batch_id)
    result = next(iter(_parse_results([raw_result]).values()), None)
    if result is None or result.child_id not in batch.child_ids:
        log.error("subq.advance for batch %s got a result of no child of it: %r", batch_id, raw_result)
        return False
    rt.store.apply_child(batch, result)
    index = batch.child_ids.index(result.child_id)
    rest = batch.child_ids[index + 1 :]
    if result.status != "completed" and rest:
        reason = f"not run: step {index + 1} of the chain ended {result.status}"
        for child_id in rest:
            rt.store.finish_task(child_id, "cancelled", error=reason, error_class="ChainStopped")
            cancelled = SubtaskResult(child_id=child_id, status="cancelled", error=reason, error_class="ChainStopped")
            rt.store.apply_child(batch, cancelled)
        close_batch(rt, batch)
        return True
    if not rest:
        close_batch(rt, batch)
    return False


def close_batch(rt: Runtime, batch: Batch) -> bool:
    children = [rt.store.get_task(child_id) for child_id in batch.child_ids]
    combined = combined_result(batch, children)
    ui_message = {"ts": time.time(), "type": "say", "say": "subtask_result", "text": combined}
    return rt.store.finish_batch(batch, combined, ui_message)


def combined_result(batch: Batch, children: list[TaskRecord]) -> str:
    """One block for the parent, children in dispatch order, one line each."""
    done = sum(1 for c in children if c.status.value == "completed")
    lines = [f"Subtask results ({batch.mode}, {done} of {len(children)} completed):"]
    for number, child in enumerate(children, 1):
        figures = f"{child.total_tokens} tokens, {format_usd(child.total_cost_micros)}"
        head = f"{number}. [{child.status.value}] {child.description} (task {child.id}"
        head += f", todo {child.todo_id})" if child.todo_id else ")"
        if child.status.value == "completed":
            lines.append(f"{head}: {' '.join(child.summary.split())} ({figures})")
        else:
            lines.append(f"{head}: {child.error_class or 'Error'}: {child.error or 'no detail'} ({figures})")
    return "\n".join(lines)


def _parse_results(raw_results: Iterable[object]) -> dict[str, SubtaskResult]:
    results: dict[str, SubtaskResult] = {}
    for raw in raw_results:
        try:
            result = SubtaskResult.model_validate(raw)
        except pydantic.ValidationError as exc:
            log.error("ignoring a malformed subtask result %r: %s", raw, exc.errors()[0]["msg"])
            continue
        results[result.child_id] = result
    return results
