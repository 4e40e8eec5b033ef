"""Tenants' quotas in Redis: `store.quotas`, the submits, running roots and rolling-day spend of each tenant.

A root is checked and counted in one script (tenant_submit.lua) as it is created; each
cost is counted as the run takes its response (tenant_spend.lua, into the tenant's hourly
buckets, once per request key). Roots that ended are taken out of the running set lazily, before
each check and each read: a root's end happens inside its tree's scripts, in another
slot, and an ended root never runs again, so taking it out late only delays a place
being freed until the next submit or read looks. A retry runs one again, counted again first: the
removal (prune_roots.lua) takes a root out only while it is still as the prune read it.
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple

from coordinator.replies import QuotaVerdict
from coordinator.store.base import Part, _scored, _str_map, translate_redis_errors
from coordinator.store.fields import TaskField
from coordinator.store.protocol import PruneRoots, TenantSpend, TenantSubmit
from coordinator.timeline import OUTCOMES

__all__ = ["HOUR_MS", "QuotaStore", "TenantUsage"]

HOUR_MS = 3_600_000
# The rolling day: 24 hourly buckets, the current one included.
DAY_HOURS = 24
# A spend hash outlives its newest bucket by the day plus an hour, then goes with nothing left to count.
SPEND_TTL_S = (DAY_HOURS + 1) * 3600
_ENDED = frozenset(OUTCOMES)  # the statuses that end a task, declared once
# How long a counted root may have no record before it is taken for one whose submit died: a root is counted
# before its record is written, and a prune that took a root without a record for ended let a second submit
# take the place the first had counted (two roots running against max_running_roots 1).
UNWRITTEN_ROOT_GRACE_MS = 60_000


def _retry_counted(counted_ms: float, finished_at: object, grace_from_ms: float) -> bool:
    """Whether an ended root was counted after it ended, within the grace: a retry counted it and its step has
    not run yet (coordinator/retry.py). It holds its place until then; one whose retry died lets it go."""
    try:
        finished_ms = float(str(finished_at)) * 1000
    except ValueError:
        return False
    return counted_ms > finished_ms and counted_ms >= grace_from_ms


class TenantUsage(NamedTuple):
    """What a tenant uses now, as its quotas count it."""

    submits_last_minute: int
    roots_running: int
    spent_micros_day: int


def spent_in_day(buckets: dict[str, str], now_ms: int) -> int:
    """Micro-USD in the hourly buckets of the rolling day ending now."""
    hour = now_ms // HOUR_MS
    total = 0
    for name, micros in buckets.items():
        if name.isdigit() and int(name) > hour - DAY_HOURS:
            total += int(micros or 0)
    return total


def _state_of(live_json: str) -> str:
    try:
        found = json.loads(live_json)
    except ValueError:
        return ""
    return str(found.get("state", "")) if isinstance(found, dict) else ""


class QuotaStore(Part):
    """Per-tenant quota state: `store.quotas`, `QuotaStore(core)`."""

    @translate_redis_errors
    def count_root(
        self,
        tenant: str,
        root_id: str,
        *,
        submits_per_minute: int,
        max_running_roots: int,
        max_cost_micros_per_day: int,
        now_ms: int | None = None,
        retried: bool = False,
    ) -> QuotaVerdict:
        """Check the tenant's quotas for a new root and count it, atomically; a refusal writes nothing. A
        `retried` root (one that ended, run again) is counted among the running roots again, under
        `max_running_roots` alone."""
        if max_running_roots > 0:
            self.prune_roots(tenant)
        keys = self.keys
        verdict = self.scripts(
            TenantSubmit(
                submits=keys.tenant_submits(tenant),
                roots=keys.tenant_roots(tenant),
                spend=keys.tenant_spend(tenant),
                root_id=root_id,
                now_ms=now_ms if now_ms is not None else int(time.time() * 1000),
                submits_per_minute=submits_per_minute,
                max_running_roots=max_running_roots,
                max_cost_micros_per_day=max_cost_micros_per_day,
                retention_s=self.retention_s,
                retried="1" if retried else None,
            )
        )
        if verdict.accepted and not retried:
            # The tenants view lists every tenant that created a root (another slot: written apart).
            pipe = self.client.pipeline(transaction=False)
            pipe.zadd(keys.tenants(), {tenant: time.time()})
            pipe.zremrangebyscore(keys.tenants(), "-inf", time.time() - self.retention_s)
            pipe.execute()
        return verdict

    @translate_redis_errors
    def uncount_root(self, tenant: str, root_id: str) -> None:
        """Take a root back out of the tenant's running roots (a retry counted it, then was refused)."""
        self.client.zrem(self.keys.tenant_roots(tenant), root_id)

    @translate_redis_errors
    def count_spend(self, tenant: str, request: str, cost_micros: int, now_ms: int | None = None) -> int:
        """Count one cost (`<task id>:<request key>`, once however often it is sent) into the tenant's rolling
        day; the day's micro-USD, this cost included."""
        return self.scripts(
            TenantSpend(
                spend=self.keys.tenant_spend(tenant),
                counted=self.keys.tenant_spent(tenant),
                request=request,
                cost_micros=cost_micros,
                now_ms=now_ms if now_ms is not None else int(time.time() * 1000),
            )
        )

    @translate_redis_errors
    def prune_roots(self, tenant: str) -> int:
        """Take the tenant's roots that ended (or expired, or whose submit died before it wrote them) out of its
        running set; how many still run."""
        counted, prune = self.read_prune(tenant)
        return counted - (self.apply_prune(prune) if prune else 0)

    @translate_redis_errors
    def read_prune(self, tenant: str) -> tuple[int, PruneRoots | None]:
        """The read half of `prune_roots`: how many roots are counted, and the script that takes out those read
        as ended (None: nothing to write, the common case). The script takes a root out only while its score and
        status are still as read here: a retry may count it again and run it in between (prune_roots.lua)."""
        key = self.keys.tenant_roots(tenant)
        counted = _scored(self.client.zrange(key, 0, -1, withscores=True))  # root id -> ms it was counted at
        if not counted:
            return 0, None
        pipe = self.client.pipeline(transaction=False)
        for root in counted:
            pipe.hmget(self.keys.task(root, root), TaskField.STATUS, TaskField.FINISHED_AT)
        found = pipe.execute()
        now_ms = time.time() * 1000
        unwritten_before_ms = now_ms - UNWRITTEN_ROOT_GRACE_MS
        ended = [
            (root, counted_ms, status or "")
            for (root, counted_ms), (status, finished_at) in zip(counted.items(), found, strict=True)
            if (status in _ENDED and not _retry_counted(counted_ms, finished_at, unwritten_before_ms))
            or (status is None and counted_ms < unwritten_before_ms)
        ]
        # A root still running, counted more than half a retention ago, is counted as of now: a submit drops the
        # roots counted longer ago than a retention (tenant_submit.lua), which would drop one that runs longer than
        # that; the rest are left as they are, so a count writes nothing more as a rule. (Not an ended root kept
        # for its retry's step: counted anew, it would be kept at every count. XX: one that ended meanwhile and
        # was taken out stays out.)
        stale_before_ms = now_ms - self.retention_s * 500
        long_running = [
            root
            for (root, counted_ms), (status, _) in zip(counted.items(), found, strict=True)
            if status and status not in _ENDED and counted_ms < stale_before_ms
        ]
        if not ended and not long_running:
            return len(counted), None
        return len(counted), PruneRoots(
            roots=key,
            tasks=[self.keys.task(root, root) for root, _, _ in ended],
            retention_s=self.retention_s,
            now_ms=now_ms,
            ended=ended,
            long_running=long_running,
        )

    @translate_redis_errors
    def apply_prune(self, prune: PruneRoots) -> int:
        """The write half of `prune_roots`: how many roots it took out."""
        return self.scripts(prune)

    @translate_redis_errors
    def usage(self, tenant: str, now_ms: int | None = None) -> TenantUsage:
        """The tenant's submits in the last minute, roots running and micro-USD spent in the rolling day."""
        now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
        running = self.prune_roots(tenant)
        pipe = self.client.pipeline(transaction=False)
        pipe.zcount(self.keys.tenant_submits(tenant), f"({now_ms - 60_000}", "+inf")
        pipe.hgetall(self.keys.tenant_spend(tenant))
        submits, buckets = pipe.execute()
        return TenantUsage(int(submits), running, spent_in_day(buckets, now_ms))

    @translate_redis_errors
    def day_spend(self, tenant: str, now_ms: int | None = None) -> int:
        """The micro-USD the tenant spent in the rolling day (one read: a run's stop check asks for this alone)."""
        now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
        return spent_in_day(_str_map(self.client.hgetall(self.keys.tenant_spend(tenant))), now_ms)

    @translate_redis_errors
    def live_counts(self, root_ids: list[str]) -> tuple[int, int]:
        """(running, queued) tasks of these trees, from their live hashes."""
        if not root_ids:
            return 0, 0
        pipe = self.client.pipeline(transaction=False)
        for root in root_ids:
            pipe.hvals(self.keys.live(root))
        running = queued = 0
        for values in pipe.execute():
            for text in values:
                state = _state_of(str(text))
                running += state == "running"
                queued += state == "queued"
        return running, queued

    @translate_redis_errors
    def running_roots(self, tenant: str) -> list[str]:
        """The tenant's roots not yet ended (the ended ones taken out first)."""
        self.prune_roots(tenant)
        return [str(root) for root in self.client.zrange(self.keys.tenant_roots(tenant), 0, -1)]

    @translate_redis_errors
    def known(self) -> list[str]:
        """Every tenant that created a root within the retention, by name."""
        return sorted(str(name) for name in self.client.zrange(self.keys.tenants(), 0, -1))
