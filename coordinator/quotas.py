"""Tenants' quotas: a new root checked and counted against its tenant's, and a tree stopped past the day's spend.

Per tenant (coordinator/tenants.py, `TenantPolicy`): `submits_per_minute` (roots created in any
60 s), `max_running_roots` (roots not yet ended) and `max_cost_micros_per_day` (micro-USD its
trees spent in the rolling day: 24 hourly buckets, each cost counted once by its request key as
the run takes the response, tenant_spend.lua). A root over a quota is refused with `QuotaExceeded` (HTTP 429 and Retry-After;
the same text from the API, both clients, the CLI and `subq.submit`) and nothing is written.
A tree already running when its tenant's day spend reaches the quota stops as a budget stop does
(coordinator/budgets.py), its error naming the tenant's quota.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from coordinator import control
from coordinator.errors import QuotaExceeded
from coordinator.models import TaskRecord, format_usd
from coordinator.tenants import TenantPolicy, TenantState

if TYPE_CHECKING:
    from coordinator.plane import Plane
    from coordinator.replies import QuotaVerdict

__all__ = [
    "ROOTS_RETRY_AFTER_S",
    "check_retried_root",
    "check_root",
    "count_spend",
    "day_spend_error",
    "over_day_spend",
    "states",
    "stop_over_day",
]

# A root over `max_running_roots` waits for one of the tenant's roots to end, which no clock says:
# Retry-After then suggests a short wait, as a root takes seconds to minutes.
ROOTS_RETRY_AFTER_S = 10
DAY_QUOTA = "max_cost_usd_per_day"


def check_root(plane: Plane, tenant: str, root_id: str, policy: TenantPolicy) -> None:
    """Count a new root against its tenant's quotas, or raise QuotaExceeded (nothing counted)."""
    if not (policy.submits_per_minute or policy.max_running_roots or policy.max_cost_micros_per_day):
        plane.store.quotas.count_root(
            tenant, root_id, submits_per_minute=0, max_running_roots=0, max_cost_micros_per_day=0
        )  # counted all the same: `subq tenants` shows what each tenant submits and runs
        return
    verdict = plane.store.quotas.count_root(
        tenant,
        root_id,
        submits_per_minute=policy.submits_per_minute,
        max_running_roots=policy.max_running_roots,
        max_cost_micros_per_day=policy.max_cost_micros_per_day,
    )
    if not verdict.accepted:
        raise refusal(tenant, verdict)


def check_retried_root(plane: Plane, root: TaskRecord) -> None:
    """Count a root that ended, run again by a retry, among its tenant's running roots, or raise QuotaExceeded
    (nothing counted): at `max_running_roots`, or over `max_cost_usd_per_day`, a retry waits as a new root does."""
    policy = plane.tenants.policy(root.tenant)
    verdict = plane.store.quotas.count_root(
        root.tenant, root.id, submits_per_minute=0, max_running_roots=policy.max_running_roots,
        max_cost_micros_per_day=policy.max_cost_micros_per_day, retried=True,
    )  # fmt: skip
    if not verdict.accepted:
        raise refusal(root.tenant, verdict)


def refusal(tenant: str, verdict: QuotaVerdict) -> QuotaExceeded:
    """The one error text of a refused root, whatever face it came from."""
    wait_s = max(1, -(-verdict.retry_after_ms // 1000)) if verdict.retry_after_ms else ROOTS_RETRY_AFTER_S
    at = datetime.fromtimestamp(time.time() + wait_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if verdict.quota == "submits_per_minute":
        what = f"created {verdict.used} roots in the last minute; its submits_per_minute is {verdict.limit}"
        resets = f"it resets in {wait_s} s ({at})"
    elif verdict.quota == "max_running_roots":
        what = f"has {verdict.used} roots running; its max_running_roots is {verdict.limit}"
        resets = f"it resets when one of them ends (retry in about {wait_s} s)"
    else:
        what = f"spent {format_usd(verdict.used)} in the last 24 h; its {DAY_QUOTA} is {format_usd(verdict.limit)}"
        resets = f"it resets in {wait_s} s ({at}), as the oldest spend leaves the rolling day"
    return QuotaExceeded(
        f"Quota exceeded: tenant {tenant!r} {what}; {resets}",
        field=verdict.quota,
        tenant=tenant,
        quota=verdict.quota,
        retry_after_s=wait_s,
    )


def count_spend(plane: Plane, record: TaskRecord, request_key: str, cost_micros: int) -> bool:
    """Count one response's (or a tool call's) cost into its tenant's day; True when the day's quota is reached
    (the run then stops its tree before its next request, as a budget stops it)."""
    limit = plane.tenants.policy(record.tenant).max_cost_micros_per_day
    if cost_micros <= 0 or limit <= 0:
        # Counted only against a quota: the count is a round trip of its own at every priced response, which a
        # tenant with no day quota (every tenant of a deployment without tenants) does not pay
        # (tests/test_run_steps.py: a child's worker makes two requests, its start and its end).
        return False
    total = plane.store.quotas.count_spend(record.tenant, f"{record.id}:{request_key}", cost_micros)
    return 0 < limit <= total


def over_day_spend(plane: Plane, record: TaskRecord) -> int | None:
    """The tenant's spend in the rolling day when it has reached its quota (micro-USD), else None."""
    limit = plane.tenants.policy(record.tenant).max_cost_micros_per_day
    if limit <= 0:
        return None
    spent = plane.store.quotas.day_spend(record.tenant)  # not `usage`, which prunes the tenant's running roots too
    return spent if spent >= limit else None


def day_spend_error(tenant: str, spent_micros: int, limit_micros: int) -> str:
    return (
        f"tenant {tenant!r} quota {DAY_QUOTA} of {format_usd(limit_micros)} reached: its trees spent "
        f"{format_usd(spent_micros)} in the last 24 h"
    )


def stop_over_day(plane: Plane, record: TaskRecord, spent_micros: int) -> None:
    """The tenant's day spend reached its quota: stop the task's whole tree, as a budget stop does."""
    limit = plane.tenants.policy(record.tenant).max_cost_micros_per_day
    root = plane.store.records.get_task(record.root_id)
    message = day_spend_error(record.tenant, spent_micros, limit)
    control.stop_subtree(
        plane,
        root,
        top_status="failed",
        top_error=message,
        top_class="TenantQuotaExceeded",
        error=f"stopped: {message}",
    )


def states(plane: Plane) -> list[TenantState]:
    """Every tenant the table names or that created a root within the retention, by name, with what it uses."""
    table = plane.tenants
    listed = set(table.names())
    out = []
    for name in sorted(listed | set(plane.store.quotas.known())):
        roots = plane.store.quotas.running_roots(name)
        running, waiting = plane.store.quotas.live_counts(roots)
        used = plane.store.quotas.usage(name)
        out.append(
            TenantState(
                tenant=name,
                listed=name in listed,
                running=running,
                waiting=waiting,
                roots_running=len(roots),
                submits_last_minute=used.submits_last_minute,
                spent_micros_day=used.spent_micros_day,
                policy=table.policy(name),
            )
        )
    return out
