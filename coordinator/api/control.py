"""The control endpoints: cancel a subtree, retry failed work, the approvals queue, a tree's live snapshot, dead letters.

Thin calls into the Coordinator (docs/control.md), which validates before it
writes; errors come back in the API's one shape. Each asks the `Gate` first
(coordinator/api/auth.py), and each decision, cancel and purge is on the audit
log as the caller's key (a retry too).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from coordinator.access import Scope
from coordinator.api.auth import Caller, Gate, actor_of
from coordinator.api.errors import error_responses
from coordinator.api.routes import TaskId
from coordinator.api.schemas import ApprovalList, DeadLetterList, DeadLettersPurged, DeliveryList, Snapshot
from coordinator.ids import ROOT_ID_PATTERN
from coordinator.inputs import DELIVERY_ID_RE, CancelInput, DecisionInput, RetryInput
from coordinator.models import Approval, Delivery, Retried, TaskRecord
from coordinator.service import DEFAULT_PAGE, MAX_PAGE, Coordinator
from coordinator.tenants import TenantList

__all__ = ["control_routes"]

DeliveryId = Annotated[
    str,
    Path(
        pattern=f"^{DELIVERY_ID_RE.pattern}$",
        description="A delivery id, `<event id>.<subscription>`, as GET /v1/tasks/{id}/deliveries lists it",
    ),
]
ApprovalId = Annotated[str, Path(description="An approval id, `<root>-a<12 hex>`, as GET /v1/approvals lists it")]


def control_routes(coord: Coordinator, *, auth: bool) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["control"])
    denied: tuple[int, ...] = (401, 403) if auth else ()  # documented only where a key is asked for
    gate = Gate(coord)
    _tree_routes(router, coord, gate, denied)
    _approval_routes(router, coord, gate, denied)
    _operator_routes(router, coord, gate, denied)
    return router


def _tree_routes(router: APIRouter, coord: Coordinator, gate: Gate, denied: tuple[int, ...]) -> None:
    """What is done to one tree: cancel, retry, its live snapshot, its outbound deliveries."""

    @router.post(
        "/tasks/{task_id}/cancel",
        response_model=TaskRecord,
        responses=error_responses(*denied, 404, 409, 413, 422, 503),
        summary="Cancel a task and its whole subtree",
    )
    def cancel(
        request: Request,
        key: Caller,
        task_id: TaskId,
        body: CancelInput,
        owner: str = gate.writes(Scope.OPERATE),  # (a default: annotations are strings here, `gate` is this closure's)
    ) -> TaskRecord:
        """Queued children never start, running ones stop at their next step; finished results are kept.
        409 when the task has already ended. Scope `operate`, or `submit` in a tree the key created."""
        return gate.as_read_by(key, owner, coord.cancel(task_id, body.reason, actor=actor_of(request, key)))

    @router.post(
        "/tasks/{task_id}/retry",
        response_model=Retried,
        responses=error_responses(*denied, 404, 409, 413, 422, 503),
        summary="Run a failed task again from its conversation, or every failed task of its tree",
    )
    def retry(
        request: Request,
        key: Caller,
        task_id: TaskId,
        body: RetryInput | None = None,
        owner: str = gate.writes(Scope.OPERATE),  # (as cancel's)
    ) -> Retried:
        """The task goes on from its kept conversation; finished tool calls are not run again; its spend
        stays and the new spend adds to it. `{"failed": true}`: every failed task of its subtree,
        children before parents. 409 when the task is not failed, failed on its budget, or its parent
        already went on with its result. Scope `operate`, or `submit` in a tree the key created."""
        failed = body.failed if body is not None else False
        return gate.as_read_by(key, owner, coord.retry(task_id, failed=failed, actor=actor_of(request, key)))

    @router.get(
        "/tasks/{task_id}/snapshot",
        response_model=Snapshot,
        responses=error_responses(*denied, 404, 422, 503),
        summary="The live state of every task of a tree (the task must be a root)",
    )
    def snapshot(request: Request, key: Caller, task_id: TaskId) -> Snapshot:
        gate.read_tree(request, key, task_id)
        return Snapshot(root_id=task_id, tasks=coord.snapshot(task_id))

    @router.get(
        "/tasks/{task_id}/deliveries",
        response_model=DeliveryList,
        responses=error_responses(*denied, 404, 422, 503),
        summary="The tree's deliveries of outbound events: each one's target, state, attempts and last answer",
    )
    def deliveries(request: Request, key: Caller, task_id: TaskId) -> DeliveryList:
        """Every delivery of the task's tree (webhooks and Celery callbacks), oldest event first: pending,
        retrying (with its next time and last answer), delivered, gone (410) or given up. No secret, and a
        URL without its query. Scope `read` (a tree the key created) or `read_all`."""
        gate.read_tree(request, key, task_id)
        return DeliveryList(deliveries=coord.deliveries(task_id))

    @router.post(
        "/tasks/{task_id}/deliveries/{delivery_id}/redeliver",
        response_model=Delivery,
        responses=error_responses(*denied, 404, 422, 503),
        summary="Send a delivery again now, whatever its state",
    )
    def redeliver(request: Request, key: Caller, task_id: TaskId, delivery_id: DeliveryId) -> Delivery:
        """Its attempts start again from 0 and its bounded time from now; the receiver sees the same
        `webhook-id`. Scope `operate`; on the audit log. A key that may not read the tree is answered the
        delivery's state without its target nor its last answer (`operate` changes any tree, and reads none)."""
        return gate.redeliver(request, key, task_id, delivery_id)


def _approval_routes(router: APIRouter, coord: Coordinator, gate: Gate, denied: tuple[int, ...]) -> None:
    """The approvals queue: the tool calls waiting for a person, and the decision on one."""

    @router.get(
        "/approvals",
        response_model=ApprovalList,
        responses=error_responses(*denied, 404, 422, 503),
        summary="Tool calls waiting for a decision, oldest first",
    )
    def list_approvals(
        request: Request,
        key: Caller,
        root_id: Annotated[str | None, Query(pattern=ROOT_ID_PATTERN, description="Only this root's tree")] = None,
    ) -> ApprovalList:
        """Every waiting call with `decide` or `read_all`; with `read` alone, those of the trees the key created."""
        return ApprovalList(approvals=gate.approvals(request, key, root_id))

    @router.post(
        "/approvals/{approval_id}",
        response_model=Approval,
        responses=error_responses(*denied, 404, 409, 413, 422, 503),
        summary="Approve or deny a waiting tool call; only that task resumes",
        dependencies=[gate.needs(Scope.DECIDE)],
    )
    def decide(request: Request, key: Caller, approval_id: ApprovalId, body: DecisionInput) -> Approval:
        """A denial's feedback goes back to the task's model; 409 when it was already decided.
        Scope `decide`; the approval then carries `decided_by`, the key's name."""
        gate.need(request, key, Scope.DECIDE)
        return coord.decide(approval_id, body.decision, body.feedback, actor=actor_of(request, key))


def _operator_routes(router: APIRouter, coord: Coordinator, gate: Gate, denied: tuple[int, ...]) -> None:
    """The operator's views of the whole deployment (scope `operate`): dead letters and tenants."""

    @router.get(
        "/dead-letters",
        response_model=DeadLetterList,
        responses=error_responses(*denied, 422, 503),
        summary="Messages no worker could decode or validate, newest first",
    )
    def list_dead_letters(
        request: Request,
        key: Caller,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="Most dead letters in the answer")] = DEFAULT_PAGE,
    ) -> DeadLetterList:
        """Each with the time, the queue, the reason, the task name and id when known, and the raw message."""
        gate.need(request, key, Scope.OPERATE)
        return DeadLetterList(count=coord.count_dead_letters(), dead_letters=coord.dead_letters(limit))

    @router.get(
        "/tenants",
        response_model=TenantList,
        responses=error_responses(*denied, 503),
        summary="Every tenant: what it runs, submits and spends against its quotas",
    )
    def list_tenants(request: Request, key: Caller) -> TenantList:
        """Per tenant: tasks running and waiting, roots running, submits in the last minute, micro-USD spent in
        the rolling day, and its policy (shares, priority cap, quotas; docs/tenants.md). Scope `operate`."""
        gate.need(request, key, Scope.OPERATE)
        return TenantList(tenants=coord.tenants())

    @router.delete(
        "/dead-letters",
        response_model=DeadLettersPurged,
        responses=error_responses(*denied, 422, 503),
        summary="Delete every dead letter",
    )
    def purge_dead_letters(request: Request, key: Caller) -> DeadLettersPurged:
        gate.need(request, key, Scope.OPERATE)
        return DeadLettersPurged(purged=coord.purge_dead_letters(actor=actor_of(request, key)))
