"""Fair shares between tenants in Redis: the slots each tenant's runs hold fleet-wide, its parked and announced
runs, the queue of tenants that want a slot, the fleet's capacity and the tenants' policies (coordinator/
admission.py says how they are used; docs/architecture.md, "Fair shares between tenants", why).

A run's start and end take their part of it inside start_run.lua and end_run.lua (`FairShares` is what they
are handed); this part holds the rest: a publish's announcement, a release of a slot outside a run's end, the
worker's beat (its concurrency, the policies), and the reads of the tenants view and of the reconciler.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.ids import root_of
from coordinator.replies import FairHealed
from coordinator.store.base import RESEND_MARK_S, Part, translate_redis_errors
from coordinator.store.keys import Keys, cut
from coordinator.store.protocol import (
    FairAnnounce,
    FairArgs,
    FairBeat,
    FairHeal,
    FairKeys,
    FairRelease,
    FairWithdraw,
)
from coordinator.tenants import DEFAULT_PRIORITY, DEFAULT_TENANT, NO_FAIR_SHARES, FairShares

__all__ = [
    "FAIR_FILL",
    "FAIR_QUEUED_S",
    "NO_FAIR_SHARES",
    "FairCounts",
    "FairShares",
    "FairStore",
    "fair_args",
    "fair_keys",
]

# How long a published run counts as its tenant's demand while its message waits in the broker. A tenant
# that holds the head of the queue with runs still in the broker makes a freed slot wait for them, so a
# message that never comes (lost with a Redis restart, a publish that failed after its announcement) may
# hold the others back this long at most; a real one reaches a worker far sooner, as every run of a
# tenant above its share ahead of it is parked in a few ms.
FAIR_QUEUED_S = 30
# How many parked runs one freed slot may start: one, and more only when the fleet grew (its capacity went up)
# or a policy changed; a bound so that a step's cost stays small.
FAIR_FILL = 8


@dataclass(frozen=True)
class FairCounts:
    """One tenant's runs: holding a fleet slot, parked for one, announced in the broker's queue."""

    running: int = 0
    parked: int = 0
    queued: int = 0


def fair_keys(keys: Keys) -> FairKeys:
    """The fleet-wide keys a run's start and end splice in."""
    return FairKeys(
        wanting=keys.fair_wanting(), policies=keys.fair_policies(), holding=keys.fair_holding(),
        capacity=keys.fair_capacity(),
    )  # fmt: skip


@functools.lru_cache(maxsize=64)  # one per deployment and setting: built once, not at every run's start and end
def fair_args(keys: Keys, shares: FairShares) -> FairArgs:
    """How the scripts name a tenant's keys and a task's hash (the keys module's names, cut where the tenant or
    the ids go), and the bounds."""
    head, running_tail = cut(keys.tenant_running)
    parked_tail, queued_tail = cut(keys.tenant_parked)[1], cut(keys.tenant_queued)[1]
    task_head, task_middle, _ = cut(keys.task, 2)
    return FairArgs(
        on=int(shares.on), tenant_head=head, running_tail=running_tail, parked_tail=parked_tail,
        queued_tail=queued_tail, task_head=task_head, task_middle=task_middle, queued_ms=FAIR_QUEUED_S * 1000,
        capacity=shares.capacity, fill=FAIR_FILL, default_tenant=DEFAULT_TENANT, default_priority=DEFAULT_PRIORITY,
    )  # fmt: skip


class FairStore(Part):
    """The fleet-wide state of fair shares outside a run's start and end (which splice in `fair_keys` and
    `fair_args`)."""

    @translate_redis_errors
    def announce(self, tenant: str, task_ids: Sequence[str]) -> None:
        """Runs of `tenant` were published: its demand in the broker's queue until each reaches a worker."""
        if not task_ids:
            return
        k = self.keys
        self.scripts(
            FairAnnounce(
                wanting=k.fair_wanting(), policies=k.fair_policies(), running=k.tenant_running(tenant),
                parked=k.tenant_parked(tenant), queued=k.tenant_queued(tenant), tenant=tenant,
                now_ms=int(time.time() * 1000), queued_ms=FAIR_QUEUED_S * 1000, retention_s=self.retention_s,
                task_ids=list(task_ids),
            )
        )  # fmt: skip

    @translate_redis_errors
    def release(
        self,
        task_id: str,
        shares: FairShares,
        *,
        while_status: str = "",
        while_run: str = "",
        while_asked: bool = False,
    ) -> list[str]:
        """Free the run's fleet slot, if it holds one, and give free slots to parked runs; the ids given one.
        Only while the task is as `while_status`, `while_run` and `while_asked` say: the guards of the tree slot's
        free (`RunStore.release_slot`), checked in the same step."""
        return self.scripts(
            FairRelease(
                fair=fair_keys(self.keys), task_id=task_id, now_ms=int(time.time() * 1000),
                retention_s=self.retention_s, args=fair_args(self.keys, shares), call=secrets.token_hex(8),
                while_status=while_status, while_run=while_run,
                while_asked=self.keys.approval(root_of(task_id), "") if while_asked else None,
            )
        )  # fmt: skip

    @translate_redis_errors
    def withdraw(self, tenant: str, task_ids: Sequence[str], shares: FairShares) -> list[str]:
        """Runs of `tenant` were stopped: out of its parked and announced runs (their messages, revoked, reach no
        worker to take them out), then free slots given to parked runs; the ids given one."""
        if not task_ids:
            return []
        return self.scripts(
            FairWithdraw(
                fair=fair_keys(self.keys), tenant=tenant, now_ms=int(time.time() * 1000),
                retention_s=self.retention_s, shares=fair_args(self.keys, shares), call=secrets.token_hex(8),
                task_ids=list(task_ids),
            )
        )  # fmt: skip

    @translate_redis_errors
    def heal(self, shares: FairShares, look_after_s: float, limit: int) -> FairHealed:
        """The reconciler's pass (fair_heal.lua): free the slots whose run's task is gone, ended or delegated;
        with fair shares on, give free slots to parked runs; off, release up to `limit` parked runs (each put
        on the due list to be looked at in `look_after_s`). The caller publishes `started`."""
        now = time.time()
        return self.scripts(
            FairHeal(
                fair=fair_keys(self.keys), due=self.keys.due(), mark=self.keys.fair_heal_mark(secrets.token_hex(16)),
                now_ms=int(now * 1000), look_at=now + look_after_s, limit=limit, retention_s=self.retention_s,
                args=fair_args(self.keys, shares), lease_middle=cut(self.keys.lease, 2)[1], mark_s=RESEND_MARK_S,
            )
        )  # fmt: skip

    @translate_redis_errors
    def beat(self, worker: str, concurrency: int, live_s: float, policies: Mapping[str, tuple[int, int]]) -> int:
        """This process's concurrency, and the tenants table it reads (name -> (weight, max_running)); the
        fleet's capacity, the concurrency of the processes whose heartbeat is younger than `live_s`."""
        k = self.keys
        return self.scripts(
            FairBeat(
                workers=k.workers(), slots=k.worker_slots(), capacity=k.fair_capacity(), policies=k.fair_policies(),
                worker=worker, concurrency=concurrency, live_since=time.time() - live_s,
                capacity_ttl_s=max(1, int(3 * live_s)),
                table=[(name, f"{weight} {cap}") for name, (weight, cap) in policies.items()],
            )
        )  # fmt: skip

    @translate_redis_errors
    def is_parked(self, task_id: str, tenant: str) -> bool:
        """Whether the run waits among its tenant's parked runs for a fleet slot."""
        return self.client.zscore(self.keys.tenant_parked(tenant), task_id) is not None

    @translate_redis_errors
    def counts(self, tenant: str) -> FairCounts:
        """The tenant's runs holding a slot, parked and announced (the tenants view; tests)."""
        k = self.keys
        with self.client.pipeline(transaction=False) as pipe:
            pipe.scard(k.tenant_running(tenant))
            pipe.zcard(k.tenant_parked(tenant))
            pipe.zcard(k.tenant_queued(tenant))
            running, parked, queued = pipe.execute()
        return FairCounts(int(running), int(parked), int(queued))

    @translate_redis_errors
    def capacity(self) -> int | None:
        """The fleet's capacity as the last beat summed it (None: no beat within its time)."""
        value = self.client.get(self.keys.fair_capacity())
        return int(value) if value is not None else None
