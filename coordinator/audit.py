"""The audit log: every human decision, control action, sign-in and refused request, on record.

One entry says who (`actor`: the API key's name, `local` for a step taken
straight on Redis, '' for a caller no key names), what (`action`), on which
`target` (an approval id, a task id, `dead-letters`, or the refused request as
`METHOD /path`), when (`ts`), from where (`address`, the client address as the
rate limits count it) and through which face (`via`). A refused request carries
its `reason`, which the metric `subq_refused_requests_total` counts by.

The log is a Redis stream (`<p>:audit`, coordinator/store/audit.py), newest
first when read, paged by entry id, kept as long as task history
(SUBQ_RESULT_RETENTION_S) and at most AUDIT_MAX_ENTRIES entries.

Recording an action is one call, `record(log, actor, action, target)`, for any
face that adds one (a retry, say): the entry and its counter are written in one
transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

from coordinator.errors import ValidationError
from coordinator.text import shown_value, stream_id

__all__ = [
    "AUDIT_MAX_ENTRIES",
    "ENTRY_ID_PATTERN",
    "LOCAL",
    "REFUSALS_LOGGED_PER_MIN",
    "Action",
    "Actor",
    "AuditEntry",
    "AuditSink",
    "RefusalReason",
    "Via",
    "check_before",
    "record",
]

# A page cursor is an entry id of the log's stream, `<ms>-<n>`.
ENTRY_ID_PATTERN = r"^\d{1,20}-\d{1,20}$"
# The newest entries kept whatever their age: a flood of refused requests (each counted
# in the metric regardless) cannot grow Redis without bound within the retention.
AUDIT_MAX_ENTRIES = 100_000
# The refusals of one key (or, for a caller no key names, one address) put on the log each minute; past it they
# are counted alone (subq_refused_requests_total), after one entry that says so. A key's flood of refused
# requests would otherwise push the other tenants' decisions and cancels past AUDIT_MAX_ENTRIES.
REFUSALS_LOGGED_PER_MIN = 60

Action = Literal[
    "approve", "deny", "cancel", "retry", "redeliver", "purge_dead_letters", "sign_in", "sign_out", "refused"
]
Via = Literal["api", "web", "local"]
# Why a request was refused (401 or 403): the metric's label and the entry's `reason`.
RefusalReason = Literal[
    "missing_token",  # 401: no bearer token
    "invalid_token",  # 401: a token no key has
    "missing_scope",  # 403: the key lacks the scope the route needs
    "not_signed_in",  # 401: a web view fragment, stream or action without a valid session
    "wrong_sign_in",  # 401: a sign-in with a token no key has
    "not_found",  # a read of a tree the key may not read (the API, the web view), or an MCP call about one or no tree
]


@dataclass(frozen=True)
class Actor:
    """Who takes a step: a key's name, the client's address, and the face they came through."""

    name: str
    address: str = ""
    via: Via = "local"


# A step taken straight on Redis (the CLI with SUBQ_REDIS_URL, Python): whoever can reach
# Redis is trusted with everything, and still on record.
LOCAL = Actor("local")


class AuditEntry(BaseModel):
    """One entry of the audit log (GET /v1/audit)."""

    model_config = ConfigDict(frozen=True)

    id: str  # the stream entry id: `<ms>-<n>`, the page cursor
    ts: float  # epoch seconds
    actor: str
    action: Action
    target: str
    address: str = ""
    via: Via = "local"
    reason: str = ""  # a refused request's RefusalReason; '' otherwise
    detail: str = ""  # the scope missing, a cancel's reason, a denial's feedback (cut)


class AuditSink(Protocol):
    """Where entries go: the store's audit part (`store.audit`)."""

    def add(self, actor: Actor, action: Action, target: str, *, reason: str = "", detail: str = "") -> None: ...


# A detail is for reading at a glance, not a copy of the input; a target is an id or a request's
# path, which a caller chooses: both are cut, so no request writes more than a line to the log.
MAX_DETAIL_CHARS = 500
MAX_TARGET_CHARS = 300


def record(sink: AuditSink, actor: Actor, action: Action, target: str, *, reason: str = "", detail: str = "") -> None:
    """Put one step on record (the entry and, for a refusal, its reason's counter, in one step)."""
    if len(detail) > MAX_DETAIL_CHARS:
        detail = detail[:MAX_DETAIL_CHARS] + "…"
    if len(target) > MAX_TARGET_CHARS:
        target = target[:MAX_TARGET_CHARS] + "…"
    sink.add(actor, action, target, reason=reason, detail=detail)


def check_before(before: str | None) -> None:
    """A page's `before` is an entry id (`<ms>-<n>`), or a ValidationError naming it: checked by the store and,
    before a request is made of it, by the client (a lone surrogate is no UTF-8: a traceback in httpx)."""
    if before is not None and not stream_id(before):
        raise ValidationError(f"before must be an entry id as <ms>-<n>, not {shown_value(before)}", field="before")
