"""GET /v1/audit: the audit log, newest first, paged (scope `operate` or `admin`).

Every approval, denial, cancel, retry, dead-letter purge, web sign-in and sign-out,
and refused request (401, 403), with who, what, which target, when and from where
(coordinator/audit.py).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from coordinator.access import Scope
from coordinator.api.auth import Caller, Gate
from coordinator.api.errors import error_responses
from coordinator.api.schemas import AuditPage
from coordinator.audit import ENTRY_ID_PATTERN
from coordinator.service import DEFAULT_PAGE, MAX_PAGE, Coordinator

__all__ = ["audit_routes"]


def audit_routes(coord: Coordinator, *, auth: bool) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["audit"])
    denied = (401, 403) if auth else ()
    gate = Gate(coord)

    @router.get(
        "/audit",
        response_model=AuditPage,
        responses=error_responses(*denied, 422, 503),
        summary="The audit log: decisions, control actions, sign-ins and refused requests, newest first",
    )
    def audit(
        request: Request,
        key: Caller,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="Most entries in the page")] = DEFAULT_PAGE,
        before: Annotated[
            str | None,
            Query(pattern=ENTRY_ID_PATTERN, description="`next_before` of the previous page; none for the newest"),
        ] = None,
    ) -> AuditPage:
        """Kept as long as task history (SUBQ_RESULT_RETENTION_S). Scope `operate` or `admin`."""
        gate.need(request, key, Scope.OPERATE)
        entries, next_before = coord.audit(limit, before)
        return AuditPage(entries=entries, next_before=next_before)

    return router
