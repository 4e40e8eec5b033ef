"""Budgets: a cap on what a task's whole subtree may spend, in integer micro-USD.

- A budget is given in US dollars (`budget_usd`) and stored as micro-USD
  (`budget_micros`, 0: none) on the task.
- A child's budget may not exceed what remains of the tightest budget above it
  (checked at delegation, naming `subtasks.N.budget_usd`).
- A run checks before each model request, and the usage roll-up reports after
  each one, whether a subtree has reached its budget; the task nearest the root
  that has is stopped with its subtree, and the error reports the figures.
  A request that answered before its run reads the stop is recorded (late, if the stop landed first), so a
  subtree can overshoot by the requests in flight; one still unanswered is cut off by the worker's stop watch,
  and what the provider may bill for it is not known to subq (docs/control.md).
- Spend recorded late (a response its run held when a stop landed, or one Redis refused, which the worker's
  heartbeat records once it is back: record_late_spend.lua) is spend like any other: whoever records it stops
  the subtree whose budget is reached then, unless that subtree's top has ended already (`stop_late`), not at
  the next step of a run in it.
- A tenant's day of spend (`max_cost_usd_per_day`, coordinator/quotas.py) stops a tree the same way:
  a run whose response took its tenant's rolling day to the quota names its root as the holder, and
  the stop names the tenant's quota instead of a budget.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from coordinator import control, quotas
from coordinator.errors import ValidationError
from coordinator.inputs import to_micros
from coordinator.models import TaskRecord, TaskStatus, format_usd

if TYPE_CHECKING:
    from coordinator.plane import Plane

log = logging.getLogger(__name__)

__all__ = ["check_within", "left_over", "stop", "stop_late", "to_micros"]


def left_over(plane: Plane, parent: TaskRecord) -> int | None:
    """What remains of the tightest budget over the parent (its own or an ancestor's), if any."""
    chain = [parent, *plane.store.records.get_records(parent.ancestors)] if parent.ancestors else [parent]
    left = [t.budget_micros - t.total_cost_micros for t in chain if t.budget_micros > 0]
    return max(0, min(left)) if left else None


def check_within(remaining_micros: int | None, child_budgets_micros: Sequence[int]) -> None:
    """Refuse a child budget above what remains over its parent, naming `subtasks.N.budget_usd`."""
    if remaining_micros is None:
        return
    for index, wanted in enumerate(child_budgets_micros):
        if wanted > remaining_micros:
            field = f"subtasks.{index}.budget_usd"
            raise ValidationError(
                f"{field}: {format_usd(wanted)} exceeds what remains of the parent's budget "
                f"({format_usd(remaining_micros)})",
                field=field,
            )


def stop(plane: Plane, holder_id: str, *, day_spent_micros: int | None = None) -> None:
    """The subtree of `holder_id` has spent its budget: stop it, reporting the figures.

    `day_spent_micros`: the tenant's day of spend as the run that stops found it over its quota (read again
    here when not given)."""
    holder = plane.store.records.get_task(holder_id)
    if not 0 < holder.budget_micros <= holder.total_cost_micros:  # no budget of its own spent: its tenant's day
        day_micros = day_spent_micros if day_spent_micros is not None else quotas.over_day_spend(plane, holder)
        if day_micros is not None:
            quotas.stop_over_day(plane, holder, day_micros)
            return
    children = plane.store.records.get_records(holder.child_ids)
    spent = ", ".join(f"{c.description or c.id} {format_usd(c.total_cost_micros)}" for c in children)
    control.stop_subtree(
        plane,
        holder,
        top_status="failed",
        top_error=(
            f"budget of {format_usd(holder.budget_micros)} exhausted: the subtree spent "
            f"{format_usd(holder.total_cost_micros)} (own {format_usd(holder.cost_micros)}"
            + (f"; children: {spent}" if spent else "")
            + ")"
        ),
        top_class="BudgetExhausted",
        error=f"stopped: the budget of {holder_id} is exhausted",
    )


def stop_late(plane: Plane, holder_id: str | None) -> bool:
    """Stop the subtree of `holder_id`, whose budget is reached once late spend was recorded (the run's, or its
    worker's heartbeat's: record_late_spend.lua), as the step that crossed it would have; nothing when there is
    none, or when its top has ended (most late spend is that of runs a budget's own stop cancelled: stopped
    again, the subtree would be read whole for nothing). Best effort: a stop that fails is logged and left to
    the next step of a run in the subtree, which reads its chain's budgets (the record it follows stands).
    Whether this call stopped it (its caller counts the stop, as a step's is counted: `RunHooks.budget_stopped`)."""
    if not holder_id:
        return False
    try:
        if TaskStatus(plane.store.records.status_of(holder_id)[0]).terminal:
            return False
        stop(plane, holder_id)
    except Exception:  # Redis away again, or the broker's revoke: the subtree's next step stops it
        log.warning("subq: could not stop the subtree of %s, whose budget late spend reached", holder_id,
                    exc_info=True)  # fmt: skip
        return False
    return True
