"""Delegation: check subtasks, commit a batch atomically, publish it; and a submission's two halves.

Every check runs before anything is written: a bad subtask refuses the whole
delegation with an error naming its field (`subtasks.1.todo_id`), and nothing is
read or written. The commit is one WATCH/MULTI transaction in the store (the
parent's record, its todo list, the child records, the batch); only after it
does `publish` send the work, once (a once-only claim on the batch), so a
retried publish names the same Celery tasks.

Field names are the API's: the parent is `task_id`, the specs are `subtasks`,
so the HTTP API, the CLI and `subq.submit` report the same paths.

A submission (`Coordinator.submit`, create-and-delegate) is checked here first
(`check_submission`), before the service creates its root, and then delegated
here (`submit_to`): the service creates the root between the two, so this room
never calls back into the service.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import pydantic

from coordinator import admission, budgets, control, dispatch, faults, ids, todo_links, writeback
from coordinator import todos as todo_lists
from coordinator.errors import BrokerError, ConflictError, NotFoundError, StateError, SubqError, ValidationError
from coordinator.inputs import error_message, error_path, one_line, profile_asked
from coordinator.models import Batch, DelegationMode, NewChildren, SubtaskSpec, TaskRecord, TaskStatus, TodoItem

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = [
    "MODES",
    "PUBLISH_PACE_S",
    "Submission",
    "check_mode",
    "check_submission",
    "check_subtasks",
    "commit",
    "delegate",
    "publish",
    "submit_to",
]

log = logging.getLogger(__name__)

MODES: tuple[DelegationMode, ...] = ("parallel", "sequential")

# The slowest pace at which a batch's run messages are taken to reach the broker, s a message: the reconciler
# looks at a wide batch's n-th child this much later per child before it (a 5,000-wide publish took 18 s on a
# loaded 2-core host, 3.6 ms a message; bench/overhead.py --widths 5000 --grace-s 2).
PUBLISH_PACE_S = 0.01


@dataclass(frozen=True)
class Submission:
    """What a submission did: the root it created, and its batch, or the error that failed the root."""

    task: TaskRecord
    batch: Batch | None = None
    error: SubqError | None = None


def check_mode(mode: object) -> DelegationMode:
    if mode == "parallel":
        return "parallel"
    if mode == "sequential":
        return "sequential"
    raise ValidationError(f"mode must be 'parallel' or 'sequential', not {mode!r}", field="mode")


def check_subtasks(plane: Plane, subtasks: Sequence[SubtaskSpec | dict[str, Any]]) -> list[SubtaskSpec]:
    """Every subtask parsed and its profile known; the first problem names its field."""
    if isinstance(subtasks, (str, bytes)) or not isinstance(subtasks, Sequence):
        raise ValidationError("subtasks must be a list of subtask specs", field="subtasks")
    if not subtasks:
        raise ValidationError("subtasks is empty: a delegation needs at least one subtask", field="subtasks")
    limit = plane.settings.max_fanout
    if len(subtasks) > limit:
        raise ValidationError(f"{len(subtasks)} subtasks exceed SUBQ_MAX_FANOUT={limit}", field="subtasks")
    checked: list[SubtaskSpec] = []
    for index, spec in enumerate(subtasks):
        try:
            parsed = spec if isinstance(spec, SubtaskSpec) else SubtaskSpec.model_validate(spec)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            path = error_path(err, ("subtasks", index))
            raise ValidationError(f"{path}: {error_message(err)}", field=path) from None
        if parsed.profile is not None:
            profile_asked(parsed.profile, f"subtasks.{index}.profile", "the parent's profile")
            try:
                plane.settings.profile(parsed.profile)
            except ValidationError as exc:
                raise type(exc)(exc.message, field=f"subtasks.{index}.profile") from None
        checked.append(parsed)
    return checked


def commit(
    plane: Plane,
    task_id: str,
    subtasks: Sequence[SubtaskSpec | dict[str, Any]],
    mode: DelegationMode | str = "parallel",
    tool_call_id: str = "",
    token: str = "",
) -> tuple[Batch, list[TaskRecord]]:
    """Validate and commit a delegation in one atomic step, without publishing it.

    An agent parent commits from its delegation tool, persists its conversation,
    and only then publishes, so no child can finish before the parent's state is saved.
    Its run passes its lease's `token`: `FencedError`, nothing committed, once another run
    of the task holds the lease (a run that stalled past its lapse delegates nothing).
    """
    checked_mode = check_mode(mode)
    checked = check_subtasks(plane, subtasks)
    root_id = ids.root_of(task_id)
    child_ids = [ids.new_child_id(root_id) for _ in checked]
    batch_id = ids.new_batch_id(root_id)

    def plan(parent: TaskRecord, items: list[TodoItem]) -> tuple[Batch, NewChildren, list[TodoItem]]:
        _check_parent(plane, parent, token)
        remaining = budgets.left_over(plane, parent)
        child_budgets = [budgets.to_micros(s.budget_usd, f"subtasks.{n}.budget_usd") for n, s in enumerate(checked)]
        budgets.check_within(remaining, child_budgets)
        specs = [(cid, spec.todo_id, spec.description) for cid, spec in zip(child_ids, checked, strict=True)]
        new_items, links = todo_links.link_children(items, specs, awaiting=parent.awaiting_ids)
        now = time.time()
        own: list[dict[str, Any]] = [
            {
                "id": cid,
                "prompt": spec.message,
                "description": spec.description,
                "profile": spec.profile or parent.profile,
                "todo_id": todo_id,
                "budget_micros": budget_micros,
                "output_schema": spec.output_schema,
            }
            for cid, spec, todo_id, budget_micros in zip(child_ids, checked, links, child_budgets, strict=True)
        ]
        # What every child shares, validated once (its own fields are the first child's, replaced in each);
        # each child's own values above come from specs checked already.
        shared = TaskRecord(
            **own[0],
            parent_id=parent.id,
            root_id=parent.root_id,
            depth=parent.depth + 1,
            status=TaskStatus.ACTIVE,
            batch_id=batch_id,
            runner="agent",
            owner=parent.owner,
            metadata=parent.metadata,  # the tree's tags, on every task of it (a history filter reads them)
            tenant=parent.tenant,  # whom the tree runs for, and its priority: admission reads both
            priority=parent.priority,
            created_at=now,
            updated_at=now,
        )
        batch = Batch(
            id=batch_id,
            parent_id=parent.id,
            root_id=parent.root_id,
            mode=checked_mode,
            child_ids=child_ids,
            tool_call_id=tool_call_id,
            created_at=now,
        )
        return batch, NewChildren(shared, own), new_items

    # Watched before the commit: its publish may never come. A refused delegation changes nothing, the due list
    # included (a refusal left a task due, or pushed its look later, at each call).
    watched = plane.store.convergence.watch_one(task_id, plane.settings.reconcile_grace_s)
    try:
        batch, children = plane.store.batches.commit_delegation(task_id, batch_id, plan, token=token)
    except (ValidationError, NotFoundError, StateError, ConflictError):  # a refusal: nothing was committed
        plane.store.convergence.rewatch(watched)  # unless another step watched it since (rewatch.lua)
        raise
    faults.crash_point(plane.settings, "after-commit")
    return batch, children


def _check_parent(plane: Plane, parent: TaskRecord, token: str) -> None:
    if parent.runner == "agent" and not token:
        # An agent's task delegates from its own run, which then waits on the batch by its tool call's id. One
        # made from outside (the API, the CLI, a client) left it `delegated` with no call to resume: its queued
        # run did nothing, and its children's results never reached its model.
        raise StateError(
            f"Task {parent.id} is run by its agent: only its own run delegates from it "
            "(delegate from a task created without run)",
            field="task_id",
        )
    if parent.status != TaskStatus.ACTIVE:
        raise StateError(
            f"Task {parent.id} is {parent.status.value}, not active: it cannot delegate now", field="task_id"
        )
    if parent.depth >= plane.settings.max_depth:
        raise StateError(
            f"Task {parent.id} is at depth {parent.depth}; SUBQ_MAX_DEPTH={plane.settings.max_depth} "
            "allows no deeper subtasks",
            field="task_id",
        )


def publish(plane: Plane, batch: Batch, children: list[TaskRecord]) -> None:
    """Publish a committed batch's work, once (a second call finds it published).

    The children to start are watched first (the due list), then the batch is
    claimed, then published: a process that dies after the claim leaves them to the
    reconciler. A publish the broker refuses gives the claim back and raises
    `BrokerError`, so the next call (or the reconciler) tries again.
    """
    store = plane.store
    if store.batches.batch_published(batch.id):
        # Only while it waits: its children may all have ended, and its resume be published, already.
        store.convergence.unwatch([batch.parent_id], while_status=TaskStatus.DELEGATED.value)
        return
    starting = children if batch.mode == "parallel" else children[:1]  # later steps start as each ends
    # Each child a publish's pace later than the one before it: the last of a wide batch's messages reaches the
    # queue seconds after the first, and looked at before it did, it read as lost and was published again.
    store.convergence.watch([c.id for c in starting], plane.settings.reconcile_grace_s, spread_s=PUBLISH_PACE_S)
    if store.batches.claim_batch_publish(batch.id):
        faults.crash_point(plane.settings, "after-claim-publish")
        if batch.mode == "sequential":
            store.runs.claim_step_publish(children[0].id)
        try:
            admission.announce(plane, children[0].tenant, [c.id for c in starting])  # its tenant's demand (fair shares)
            dispatch.publish_batch(plane.app, batch, children)
        except Exception as exc:  # kombu's errors, whatever the transport
            store.batches.unclaim_batch_publish(batch.id)
            raise BrokerError(
                f"The broker did not take batch {batch.id}; it is published again once the broker is back: "
                f"{one_line(str(exc))}"
            ) from exc
    # Only while it waits: children that answer at once may have closed the batch already, and
    # the close watched the parent again for its resume (tests/test_kill_resumed_parent.py).
    store.convergence.unwatch([batch.parent_id], while_status=TaskStatus.DELEGATED.value)


def publish_waiting(plane: Plane, record: TaskRecord) -> None:
    """Publish the batch a delegated task waits on (its run committed it and may have died before publishing).

    Not that of a task stopped since its run committed it: its children are stopped with it. `stop_subtree`
    stops children committed while it ran; this stops (and writes back) those a stop that read the subtree only
    once (a coordinator of an earlier version, in a rolling upgrade) left `active`, unpublished and unwatched."""
    if record.waiting_batch_id and record.status.terminal:
        control.stop_subtree(
            plane, record, top_status=record.status.value, top_error=record.error or "",
            top_class=record.error_class or "", error=f"stopped with {record.id}, before its delegation was published",
        )  # fmt: skip
    elif record.waiting_batch_id:
        batch = plane.store.batches.get_batch(record.waiting_batch_id)
        publish(plane, batch, plane.store.records.get_records(batch.child_ids))


def stop_unwaited(plane: Plane, record: TaskRecord) -> None:
    """Stop the children of a delegation the ended task committed and never waited on (its run ended rather than
    wait: its time limit, a failure beside the delegation), and close its batch. Left, they stayed `active`, never
    published nor watched, and a retry of the task delegated again into a batch that never closed."""
    if record.status.terminal and record.waiting_batch_id and _open(plane, record.waiting_batch_id):
        publish_waiting(plane, record)


def settle_ended(plane: Plane, record: TaskRecord) -> None:
    """`writeback.settle_ended`, after `stop_unwaited`: the ended task's run may have died before it stopped them
    itself (`Run.end`)."""
    stop_unwaited(plane, record)
    writeback.settle_ended(plane, record)


def _open(plane: Plane, batch_id: str) -> bool:
    """Whether the batch is still running (not closed, nor lapsed with its retention)."""
    try:
        return plane.store.batches.get_batch(batch_id).status != "done"
    except NotFoundError:
        return False


def delegate(
    plane: Plane,
    task_id: str,
    subtasks: Sequence[SubtaskSpec | dict[str, Any]],
    mode: DelegationMode | str = "parallel",
) -> Batch:
    batch, children = commit(plane, task_id, subtasks, mode)
    publish(plane, batch, children)
    return batch


def check_submission(
    plane: Plane,
    subtasks: Sequence[SubtaskSpec | dict[str, Any]],
    mode: DelegationMode | str,
    todos: str | Sequence[object] | None,
    budget_usd: Decimal | float | str | None,
) -> tuple[DelegationMode, list[SubtaskSpec]]:
    """Every check `delegate` makes on a fresh root, before the root exists; the checked mode and subtasks.

    The checks run on the parsed plan and throwaway child ids (linking is pure), so
    a bad subtask or todo id is refused before anything is written.
    """
    checked_mode = check_mode(mode)
    checked = check_subtasks(plane, subtasks)
    if plane.settings.max_depth < 1:
        raise StateError(f"SUBQ_MAX_DEPTH={plane.settings.max_depth} allows no subtasks of a root", field="subtasks")
    items = todo_lists.parse_update(todos) if todos is not None else []
    todo_links.link_children(items, [(f"check-{n}", s.todo_id, s.description) for n, s in enumerate(checked)])
    root_budget = budgets.to_micros(budget_usd, "budget_usd")
    child_budgets = [budgets.to_micros(s.budget_usd, f"subtasks.{n}.budget_usd") for n, s in enumerate(checked)]
    budgets.check_within(root_budget or None, child_budgets)
    return checked_mode, checked


def submit_to(
    plane: Plane, parent: TaskRecord, created: bool, subtasks: list[SubtaskSpec], mode: DelegationMode
) -> Submission:
    """Delegate a submission's checked `subtasks` to its new root `parent` (`created`: this call made it).

    Only Redis or the broker can fail now; the root is then ended visibly
    (`failed`, with the reason) rather than left waiting, and the error is returned
    beside it, so the caller can name the root it created. A root an earlier
    submission with the same key made returns what that one made: its root and
    batch (or delegates now, if the first died before it could).
    """
    if not created and (done := _submitted(plane, parent)) is not None:
        return done
    try:
        batch = delegate(plane, parent.id, subtasks, mode)
    except StateError:
        if not created and (done := _submitted(plane, plane.store.records.get_task(parent.id))) is not None:
            return done  # a concurrent duplicate delegated first
        raise
    except SubqError as exc:
        log.error("subq: delegation of the new root %s failed after it was created: %s", parent.id, exc)
        _fail_submission(plane, parent.id, exc)
        return Submission(task=_as_it_ended(plane, parent), error=exc)
    return Submission(task=parent, batch=batch)


def _fail_submission(plane: Plane, root_id: str, exc: SubqError) -> None:
    """End a submission's root `failed`. A delegation committed before the failure (the broker refused its
    publish) is stopped with it: its children, on the due list, would otherwise be published by the reconciler
    and run, and spend, under a root its caller was told had failed."""
    root = plane.store.records.get_task(root_id)
    if not root.child_ids:
        plane.store.runs.finish_task(root_id, "failed", error=str(exc), error_class=type(exc).__name__)
        return
    try:
        control.stop_subtree(
            plane, root, top_status="failed", top_error=str(exc), top_class=type(exc).__name__,
            error=f"not run: the submission of {root_id} failed",
        )  # fmt: skip
    except Exception:  # the broker's revoke (kombu's errors), or Redis
        if not plane.store.records.get_task(root_id).status.terminal:
            raise  # the stop was not persisted: the caller hears it
        # Persisted (its tasks on the due list): the reconciler writes back what the stop did not.
        log.exception("subq: the stop of the failed submission %s did not finish", root_id)


def _as_it_ended(plane: Plane, root: TaskRecord) -> TaskRecord:
    """A failed submission's root as `_fail_submission` left it (`failed`, with the reason); as it was created
    when Redis cannot say (the error beside it tells the caller why)."""
    try:
        return plane.store.records.get_task(root.id)
    except SubqError:
        return root


def _submitted(plane: Plane, parent: TaskRecord) -> Submission | None:
    """What an earlier submission with the same key made of `parent`; None if it made no batch yet."""
    if parent.status.terminal:
        return Submission(task=parent, error=StateError(parent.error or "the submission failed", field="subtasks"))
    batch_id = parent.waiting_batch_id or (
        plane.store.records.get_task(parent.child_ids[0]).batch_id if parent.child_ids else None
    )
    return Submission(task=parent, batch=plane.store.batches.get_batch(batch_id)) if batch_id else None
