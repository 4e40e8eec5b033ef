"""Tool approvals: a risky tool call waits for a human decision, holding no worker.

1. A run whose model called a tool that the profile's policy says needs approval
   ends (`park`): each such call becomes an `Approval` record, pending, with a
   deadline (`SUBQ_APPROVAL_TIMEOUT_S`), listed in the fleet-wide queue, and the
   task remembers which approvals it waits on.
2. A person approves or denies it (`decide`, from the API, the CLI or Python),
   once: a second decision is refused. When the last approval the task waits on
   is decided, the task is resumed (once per park, a once-only claim) and
   its run answers the call with the decision (`decisions`).
3. An approval nobody decides expires at its deadline, which counts as a denial
   (`expire`, served by the reconciler from a timer, `expire-approval:<id>`, not by
   a broker countdown); a stopped task's pending approvals expire with it (`expire_for`).
The decision that leaves the task no pending approval watches it in the same step
(decide.lua, the due list), so a process that dies between the decision and the
resume leaves the resume to the reconciler. A decision made while the parking run
still holds the lease publishes nothing (its delivery would find the lease held);
that run's release resumes the task. Only that task resumes; its siblings go on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordinator import dispatch, ids
from coordinator.errors import FencedError, NotFoundError, StateError, ValidationError
from coordinator.faults import crash_point
from coordinator.models import Approval, TaskRecord

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = [
    "EXPIRY_TIMER",
    "Decision",
    "ToolCall",
    "decide",
    "decisions",
    "expire",
    "expire_for",
    "expire_waited_on",
    "expiry_timer",
    "list_pending",
    "park",
    "undecided",
]

EXPIRY_TIMER = "expire-approval"


@dataclass(frozen=True)
class ToolCall:
    """A tool call that needs a decision, as the agent loop asked for it."""

    tool: str
    args: dict[str, Any]
    tool_call_id: str


@dataclass(frozen=True)
class Decision:
    """A decided approval, as the resumed run answers its call."""

    approved: bool
    feedback: str


def park(plane: Plane, task: TaskRecord, calls: Sequence[ToolCall], token: str = "") -> list[Approval] | None:
    """Queue each call for a decision; the task resumes once all are decided.

    None when the task was stopped before its calls were saved (a cancel between the run's last step and
    this): a call saved after the stop's mark would wait on a person, and notify one, for a run that is over,
    so none is saved from there on, and the stop expires those saved before its mark.

    Raises `FencedError` when the run of lease `token` lost the lease meanwhile (it stalled past its lapse; a
    newer run of the task may have started and parked calls of its own): nothing more is saved, and the task's
    list of the calls its last run asked for is left as it is. Lost before the list was written, the list is
    the newer run's. Lost after a call was saved, the list is this park's and no newer run has started (a start
    waits while a listed call is pending: `start_run` answers `asked`): the saved calls stay pending, as after
    a worker's death there, and their decisions resume the task. ('' for a park no run makes: not checked.)
    Stopped part-way, the calls this park saved expire, ending no wait (`_withdraw`)."""
    parent_items = plane.store.records.get_todos(task.parent_id) if task.parent_id else []
    todo = next((t for t in parent_items if t.id == task.todo_id), None)
    now = time.time()
    timeout_s = plane.settings.approval_timeout_s
    asked = [
        Approval(
            id=ids.new_approval_id(task.root_id),
            task_id=task.id,
            root_id=task.root_id,
            tool=call.tool,
            args=call.args,
            tool_call_id=call.tool_call_id,
            todo_id=task.todo_id,
            todo_content=todo.content if todo else None,
            created_at=now,
            deadline=now + timeout_s,
        )
        for call in calls
    ]
    # The task's list first, then each approval: a process that dies in between leaves every saved approval
    # listed (one not saved yet reads as not pending), so the task waits on the calls a person was told of and
    # a decision on one ends its wait; its next run asks only for the calls no approval was saved for. Saved
    # first, a death before the list left them on no task's list: the next run asked for them again, and a
    # decision on the first copy resumed nothing.
    if not plane.store.runs.set_waiting_approvals(task.id, [a.id for a in asked], token):
        raise FencedError.of(task.id)
    made: list[Approval] = []
    for approval in asked:
        # The timer first: a timer whose approval was never saved finds nothing to expire.
        plane.store.convergence.add_timer(expiry_timer(approval.id), approval.deadline)
        saved = plane.store.approvals.save_approval(approval, token)
        if saved in ("ended", "fenced"):
            plane.store.convergence.remove_timers([expiry_timer(approval.id)])  # its approval was never saved
            if saved == "fenced":
                raise FencedError.of(task.id)
            _withdraw(plane, made)
            return None
        made.append(approval)
        if len(made) < len(asked):
            crash_point(plane.settings, "mid-park")
    return made


def _withdraw(plane: Plane, made: Sequence[Approval]) -> None:
    """A park a stop overtook part-way: the calls it saved before expire, so no person decides a call no run will
    make (the stop expired them already, or will: deciding again changes nothing). A withdrawal ends no wait of
    the task (it has ended), so it resumes nothing."""
    feedback = "its run stopped before it asked for all its calls"
    for approval in made:
        plane.store.approvals.decide(approval.id, "expired", feedback, grace_s=0, withdraw=True)
    plane.store.convergence.remove_timers([expiry_timer(a.id) for a in made])


def expiry_timer(approval_id: str) -> str:
    return f"{EXPIRY_TIMER}:{approval_id}"


def _waited_on(plane: Plane, task_id: str) -> list[Approval]:
    """The approvals the task's last run asked for that are still kept. One expires with its retention, counted
    from its save, while the task's list of them stays: a task that parks later (on its provider) or resumes
    late reads it as the scripts do (`approval_pending`), as no longer waited on."""
    kept = []
    for approval_id in plane.store.runs.waiting_approval_ids(task_id):
        try:
            kept.append(plane.store.approvals.get_approval(approval_id))
        except NotFoundError:
            continue
    return kept


def undecided(plane: Plane, task_id: str) -> list[str]:
    """The approvals the task's last run asked for that are still pending."""
    return [a.id for a in _waited_on(plane, task_id) if a.status == "pending"]


def decisions(plane: Plane, task_id: str) -> dict[str, Decision]:
    """tool call id -> decision, for the approvals the task waited on that have been decided."""
    out = {}
    for approval in _waited_on(plane, task_id):
        if approval.status != "pending":
            feedback = approval.feedback or f"The call was {approval.status}."
            out[approval.tool_call_id] = Decision(approved=approval.status == "approved", feedback=feedback)
    return out


def list_pending(plane: Plane, root_id: str | None = None) -> list[Approval]:
    """Tool calls waiting for a decision, oldest first (of one tree, or all)."""
    if root_id is not None:
        try:
            record = plane.store.records.get_task(root_id)
        except NotFoundError as exc:
            raise NotFoundError(exc.message, field="root_id") from None
        if record.root_id != root_id:  # a child's id would match no approval and answer "nothing waits"
            raise ValidationError(
                f"root_id: {root_id} is not a root task (its root is {record.root_id})", field="root_id"
            )
    out = []
    for approval_id in plane.store.approvals.pending_approval_ids():
        if root_id is None or approval_id.startswith(root_id):
            try:
                out.append(plane.store.approvals.get_approval(approval_id))
            except NotFoundError:  # expired with its tree: off the fleet's index too, which has no expiry
                plane.store.approvals.forget_lapsed(approval_id)
    return out


def decide(
    plane: Plane, approval_id: str, decision: str, feedback: str | None = None, decided_by: str = ""
) -> Approval:
    """Approve or deny a pending tool call, naming who decided; only that task resumes, its siblings go on."""
    if decision not in ("approve", "deny"):
        raise ValidationError(f"decision must be 'approve' or 'deny', not {decision!r}", field="decision")
    if feedback is not None and not isinstance(feedback, str):
        raise ValidationError("feedback must be a string", field="feedback")
    approval = plane.store.approvals.get_approval(approval_id)
    status = "approved" if decision == "approve" else "denied"
    return _decide(plane, approval, status, feedback or "", decided_by)


def expire(plane: Plane, approval_id: str) -> bool:
    """Deny an approval whose deadline has passed; False when it was decided or is not due."""
    approval = plane.store.approvals.get_approval(approval_id)
    if approval.status != "pending" or time.time() < approval.deadline:
        return False
    try:
        _decide(plane, approval, "expired", f"no decision within {plane.settings.approval_timeout_s}s")
    except StateError:
        return False
    return True


def expire_waited_on(plane: Plane, task_id: str) -> None:
    """The calls an ended task's last run asked a person about that are still pending expire: no run of it will
    make them (a stop expires them itself, `expire_for`; one that died before it did leaves them to this)."""
    for approval_id in undecided(plane, task_id):
        _expire_stopped(plane, approval_id)


def expire_for(plane: Plane, root_id: str, stopped: set[str]) -> None:
    """The pending approvals of stopped tasks expire: nobody may approve a call of a stopped run."""
    for approval_id in plane.store.approvals.pending_approval_ids():
        if not approval_id.startswith(root_id):
            continue
        try:
            approval = plane.store.approvals.get_approval(approval_id)
        except NotFoundError:  # lapsed before its decision (a retention shorter than the approval timeout)
            plane.store.approvals.forget_lapsed(approval_id)
            continue
        if approval.task_id in stopped:
            _expire_stopped(plane, approval_id)


def _expire_stopped(plane: Plane, approval_id: str) -> None:
    plane.store.approvals.decide(
        approval_id, "expired", "the task was stopped", grace_s=plane.settings.reconcile_grace_s
    )


def _decide(plane: Plane, approval: Approval, status: str, feedback: str, decided_by: str = "") -> Approval:
    # decide.lua says whether this decision ended the task's wait (of two made at once, exactly one does), and
    # watches the task in the same step, so a crash before the publish still resumes it (the reconciler).
    grace_s = plane.settings.reconcile_grace_s
    decided = plane.store.approvals.decide(approval.id, status, feedback, decided_by, grace_s=grace_s)
    if decided.outcome == "late":  # an approval at or after the deadline: the call timed out, a denial, made now
        expire(plane, approval.id)
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(approval.deadline))
        raise StateError(
            f"Approval {approval.id} expired at {at}, before this approval: the call was denied as timed out",
            field="approval_id",
        )
    if decided.outcome == "stopped":  # its task ended before its calls expired (a stop's expiry comes after)
        plane.store.convergence.remove_timers([expiry_timer(approval.id)])
        raise StateError(f"Approval {approval.id}'s task had ended: the call expired", field="approval_id")
    if decided.outcome not in ("ok", "resume"):
        raise StateError(f"Approval {approval.id} was already {decided.outcome}", field="approval_id")
    plane.store.convergence.remove_timers([expiry_timer(approval.id)])
    if decided.outcome == "resume":
        resume(plane, approval.task_id, decided.reason_id)
    return plane.store.approvals.get_approval(approval.id)


def resume(plane: Plane, task_id: str, reason_id: str = "") -> None:
    """Publish the resume of a task whose approvals are all decided, once per park: the decision that ended the
    wait and the parked run's release (for a decision made while that run held the lease) claim one field,
    named after the park's first approval, so whichever comes second publishes nothing.

    A decision names the park it ended (`reason_id`, read in its own step): read here, the list could be a later
    park's by now (the release resumed the task meanwhile and its next run parked again), and the stale
    decision's claim would take that park's field, its own decision then publishing nothing. The release reads
    the list it parked on, its lease still held."""
    if not reason_id:
        waiting = plane.store.runs.waiting_approval_ids(task_id)
        reason_id = waiting[0] if waiting else ""
    if reason_id and (resumes := plane.store.runs.claim_resume(task_id, reason_id)):
        dispatch.publish_run(plane.app, plane.store.records.get_task(task_id), resumes)
