"""Retry of failed work: a failed task runs again from its kept conversation and tool journal.

Only a `failed` task is retried, by an agent (a caller's task has no run to go on with), and
not one that failed on its budget (it would hit the same budget). Its spend stays counted and
the new spend adds to it; its finished tool calls are answered from the journal, not run again.

    retry(plane, task_id)                 the task alone
    retry(plane, task_id, failed=True)    every failed task of its subtree, children before parents

Where a task stands decides what a retry does (docs/control.md, "Retry"):
- a root, or a child whose batch is still open (its parent still waits on it): back to
  `active`, its run published as `<task>-t<n>`; a child's slot in its batch is opened again
  (`retry.lua`: its line removed, awaited again, its figures taken back out of the parent's
  unlinked spend if they went there), so its next end writes it back once, and the batch
  closes when its last child ends;
- a child whose batch closed (its parent went on with its result): refused alone. In a tree's
  retry, where the parent failed too and its conversation has not gone past the response that
  made the delegation call (no model response after that call's answer), the batch is
  re-opened: the parent goes back to `delegated` on it, its conversation cut back to that
  response (the spend of what is dropped stays counted), the failed children are retried, and
  when the last of them ends the batch closes again and the parent resumes with the new
  combined result. Where the parent went further, the child is left, and the parent is retried
  alone from its conversation (it read the old result);
- a step of a sequential delegation: a failed step stopped its chain and cancelled the steps
  after it; a stopped chain is not re-opened (refused, and left in a tree's retry).

The plan is made here from the records; `retry.lua` checks every part of it again and writes
all of it or nothing, before any run is published. A retried task is on the due list before
its run is published, so a process that dies between the two leaves it to the reconciler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coordinator import delegation, dispatch, faults, quotas
from coordinator.errors import ConflictError, StateError
from coordinator.models import (
    Batch,
    Retried,
    RetryBatch,
    RetryRefused,
    RetrySkip,
    RetryTask,
    TaskRecord,
    TaskStatus,
    format_usd,
)

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["retry"]

# The error class a budget stop gives the task whose budget was spent (coordinator/budgets.py).
BUDGET_CLASS = "BudgetExhausted"


@dataclass
class _Plan:
    tasks: list[RetryTask] = field(default_factory=list)
    batches: dict[str, RetryBatch] = field(default_factory=dict)
    skipped: list[RetrySkip] = field(default_factory=list)


def retry(plane: Plane, task_id: str, *, failed: bool = False) -> Retried:
    """Retry the failed task `task_id`, or with `failed` every failed task of its subtree; what was done."""
    top = plane.store.records.get_task(task_id)
    plan = _plan_tree(plane, top) if failed else _plan_one(plane, top)
    if not plan.tasks:
        reasons = "; ".join(skip.reason for skip in plan.skipped)
        raise StateError(f"no failed task of the tree of {top.id} can be retried: {reasons}", field="task_id")
    # A root that ended runs again: its tenant's max_running_roots counts it first (the tenant's keys are not the
    # tree's, so not in the retry's step), and a count of the running roots meanwhile keeps it (counted after its
    # end: QuotaStore.prune_roots). A refused retry takes it back out, unless another retry runs it now; a process
    # that dies between the two leaves an ended root counted, which a count a minute later takes out.
    root = top if top.id == top.root_id else plane.store.records.get_task(top.root_id)
    recounted = root.status.terminal and any(task.task_id == root.id for task in plan.tasks)
    if recounted:
        quotas.check_retried_root(plane, root)
    done = plane.store.retries.retry(
        top.root_id,
        plan.tasks,
        list(plan.batches.values()),
        plane.settings.reconcile_grace_s,
        pace_s=delegation.PUBLISH_PACE_S,  # published one by one below, as a wide batch's children are
    )
    if isinstance(done, RetryRefused):
        if recounted and TaskStatus(plane.store.records.status_of(root.id)[0]).terminal:
            plane.store.quotas.uncount_root(root.tenant, root.id)
        raise _refused(plane, done)
    # Committed: every task to run is on the due list, so a process that dies before it has
    # published them all leaves the rest to the reconciler (`run-lost`).
    faults.crash_point(plane.settings, "after-retry")
    runs = [(task, n) for task, n in zip(plan.tasks, done, strict=True) if task.role == "run"]
    records = plane.store.records.get_records([task.task_id for task, _ in runs])
    for record, (_, retry_no) in zip(records, runs, strict=True):
        dispatch.publish_retry(plane.app, record, retry_no)
    return Retried(
        task=plane.store.records.get_task(top.id),
        retried=[task.task_id for task, _ in runs],
        reopened=[task.task_id for task in plan.tasks if task.role == "wait"],
        skipped=plan.skipped,
    )


def _plan_one(plane: Plane, task: TaskRecord) -> _Plan:
    """The task alone: a root, or a child whose batch still waits on it; anything else is refused."""
    if task.status != TaskStatus.FAILED:
        raise StateError(f"task {task.id} is {task.status.value}: only a failed task can be retried", field="task_id")
    refusal = _own_refusal(task)
    if refusal:
        raise StateError(refusal, field="task_id")
    plan = _Plan()
    if task.batch_id:
        batch = plane.store.batches.get_batch(task.batch_id)
        if batch.mode == "sequential":
            raise StateError(_chain_refusal(plane, task, batch), field="task_id")
        if batch.status == "done":
            raise StateError(_moved_on(plane, task, batch), field="task_id")
        if stopped := _stopped_parent(plane, task, batch):
            raise StateError(stopped, field="task_id")
        plan.batches[batch.id] = RetryBatch(batch.id, "open", batch.parent_id)
    plan.tasks.append(RetryTask(task.id, "run", slot=task.batch_id))
    return plan


def _plan_tree(plane: Plane, top: TaskRecord) -> _Plan:
    """Every failed task of the subtree of `top` that can run again; the others skipped, with why."""
    records = plane.store.records.get_records(plane.store.records.subtree_ids(top.id))
    failed = [record for record in records if record.status == TaskStatus.FAILED]  # parents first
    if not failed:
        raise StateError(
            f"no task of the tree of {top.id} has failed ({top.id} is {top.status.value}): nothing to retry",
            field="task_id",
        )
    tree = _TreePlan(plane, top, {record.id: record for record in records})
    for task in failed:  # parents first: whether a closed batch re-opens depends on its parent being retried
        refusal = tree.refusal(task)
        if refusal:
            tree.plan.skipped.append(RetrySkip(task_id=task.id, reason=refusal))
        else:
            tree.fit[task.id] = task.batch_id
    for task in reversed(failed):  # children before parents
        if task.id in tree.fit:
            tree.add(task)
    return tree.plan


@dataclass
class _TreePlan:
    """A subtree's retry plan as it is made, with what deciding each failed task has learnt so far."""

    plane: Plane
    top: TaskRecord
    by_id: dict[str, TaskRecord]  # the subtree's records
    plan: _Plan = field(default_factory=_Plan)
    batches: dict[str, Batch] = field(default_factory=dict)  # each batch read, read once
    fit: dict[str, str | None] = field(default_factory=dict)  # task id -> the batch its slot is in (None: none)
    reopen: dict[str, tuple[Batch, int, int]] = field(default_factory=dict)  # parent id -> batch, keep, length

    def refusal(self, task: TaskRecord) -> str:
        """Why the failed task cannot run again in this plan ('' if it can); a closed batch that can be
        re-opened for it is noted in `reopen`."""
        refusal = _own_refusal(task)
        if refusal or not task.batch_id:
            return refusal
        batch = self._batch(task.batch_id)
        if batch.mode == "sequential":
            return _chain_refusal(self.plane, task, batch)
        if batch.status != "done":
            return _stopped_parent(self.plane, task, batch)
        parent = self.by_id.get(batch.parent_id) if task.id != self.top.id else None
        point = _reopen_point(self.plane, parent, batch, self.fit, self.reopen)
        if point is None:  # the named task's parent is outside its subtree: the hint names the root
            return _moved_on(self.plane, task, batch, in_tree=task.id != self.top.id)
        self.reopen[batch.parent_id] = (batch, *point)
        return ""

    def add(self, task: TaskRecord) -> None:
        """The retried task into the plan, with the batch its slot is in: it runs again, or (a parent whose
        closed batch is re-opened) waits on that batch."""
        slot = self.fit[task.id]
        if slot and slot not in self.plan.batches:
            batch = self.batches[slot]
            self.plan.batches[slot] = RetryBatch(slot, "closed" if batch.status == "done" else "open", batch.parent_id)
        if task.id in self.reopen:
            batch, keep, length = self.reopen[task.id]
            self.plan.batches[batch.id] = RetryBatch(batch.id, "closed", task.id)
            self.plan.tasks.append(RetryTask(task.id, "wait", slot=slot, keep=keep, length=length))
        else:
            self.plan.tasks.append(RetryTask(task.id, "run", slot=slot))

    def _batch(self, batch_id: str) -> Batch:
        batch = self.batches.get(batch_id) or self.plane.store.batches.get_batch(batch_id)
        self.batches[batch.id] = batch
        return batch


def _reopen_point(
    plane: Plane,
    parent: TaskRecord | None,
    batch: Batch,
    fit: dict[str, str | None],
    reopen: dict[str, tuple[Batch, int, int]],
) -> tuple[int, int] | None:
    """(messages to keep, messages now) of the parent's conversation when its closed `batch` can be re-opened:
    the parent is retried in this same plan, and no model response followed its delegation call's answer."""
    if parent is None or parent.id not in fit or not batch.tool_call_id:
        return None
    if parent.id in reopen:  # a sibling re-opened it already; a parent waits on one batch at a time
        batch_then, keep, length = reopen[parent.id]
        return (keep, length) if batch_then.id == batch.id else None
    conversation = plane.store.records.conversation(parent.id)
    at = _delegation_response(conversation, batch.tool_call_id)
    return None if at is None else (at + 1, len(conversation))


def _delegation_response(conversation: list[str], tool_call_id: str) -> int | None:
    """The index of the model response that made the call `tool_call_id`, or None: absent, or a model
    response follows it (the parent went further after reading that call's answer)."""
    at = None
    for index, entry in enumerate(conversation):
        try:
            message = json.loads(entry)
        except json.JSONDecodeError:
            return None
        if not isinstance(message, dict) or message.get("kind") != "response":
            continue
        if at is not None:
            return None
        parts = message.get("parts") or []
        if any(isinstance(p, dict) and p.get("tool_call_id") == tool_call_id for p in parts):
            at = index
    return at


def _own_refusal(task: TaskRecord) -> str:
    """Why the failed task cannot run again whatever its place in the tree ('' if it can)."""
    if task.runner != "agent":
        return f"task {task.id} is run by its caller, not by an agent on the fleet: there is no run to go on with"
    if task.error_class == BUDGET_CLASS:
        return _budget_refusal(task)
    return ""


def _budget_refusal(task: TaskRecord) -> str:
    """Why a task that failed on its budget is not retried, in its figures alone: its error names its children's
    descriptions, which a key that may retry the tree but not read it (`operate`) must not be told."""
    return (
        f"task {task.id} failed on its budget (budget of {format_usd(task.budget_micros)} exhausted: the subtree "
        f"spent {format_usd(task.total_cost_micros)}): retrying it would hit the same budget"
    )


def _moved_on(plane: Plane, task: TaskRecord, batch: Batch, *, in_tree: bool = False) -> str:
    parent = plane.store.records.get_task(batch.parent_id)
    if in_tree or parent.status != TaskStatus.FAILED:
        return (
            f"task {task.id} cannot be retried: its parent {parent.id} already went on with its result "
            f"(the parent is {parent.status.value})"
        )
    return (
        f"task {task.id} cannot be retried alone: its parent {parent.id} already went on with its result; "
        f"retry the tree: subq retry {task.root_id} --failed"
    )


def _stopped_parent(plane: Plane, task: TaskRecord, batch: Batch) -> str:
    """Why a child of a batch still open cannot run again ('' if it can): a stop ended its parent, and the
    batch has yet to be closed (a cancel between stopping the tree's tasks and writing the batch back, or one
    that died there). Retried, it ran and spent under a stopped tree whose figures were final."""
    parent = plane.store.records.get_task(batch.parent_id)
    if parent.status == TaskStatus.DELEGATED:
        return ""
    return f"task {task.id} cannot be retried: its parent {parent.id} is {parent.status.value}"


def _chain_refusal(plane: Plane, task: TaskRecord, batch: Batch) -> str:
    step = batch.child_ids.index(task.id) + 1 if task.id in batch.child_ids else 0
    return (
        f"task {task.id} is step {step} of a sequential delegation of {batch.parent_id}, which stopped at it "
        "and cancelled the steps after it: a stopped chain is not re-opened; retry its parent, which read "
        "what the chain did, or delegate the steps again"
    )


def _refused(plane: Plane, refused: RetryRefused) -> StateError | ConflictError:
    """The script's refusal (the state changed since the plan was made) in the planner's words."""
    target = refused.target
    if refused.why == "status":
        return StateError(f"task {target} is {refused.detail}: only a failed task can be retried", field="task_id")
    if refused.why == "leased":
        return ConflictError(f"a run of task {target} is still ending; try again in a moment", field="task_id")
    if refused.why == "budget":
        return StateError(_budget_refusal(plane.store.records.get_task(target)), field="task_id")
    if refused.why == "caller":
        return StateError(_own_refusal(plane.store.records.get_task(target)), field="task_id")
    if refused.why == "parent":
        return StateError(f"task {target} is {refused.detail}: its children cannot be retried", field="task_id")
    return ConflictError(f"the tree of {target} changed while subq retried it; try again", field="task_id")
