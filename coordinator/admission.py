"""Admission control: how many children run at once, and how fast runs and requests start.

- `SUBQ_MAX_RUNNING_PER_PARENT` / `SUBQ_MAX_RUNNING_PER_ROOT` cap the children
  of one parent, and the tasks of one tree, holding a run slot at once (0: no cap).
- `SUBQ_START_STAGGER_MS` spaces the starts of a tree's runs.
- `SUBQ_PROVIDER_RPM` caps each provider's requests per minute, fleet-wide.
- A profile's `tool_limits` cap the calls of the tools a glob matches, fleet-wide:
  at once (slots held for the call, with a lease a dead worker's slots lapse by)
  and a minute (the same window as a provider's requests).

Admission is a step of a run's one start and one end, not a path of its own: a
run's start (`start_run.lua`) admits it before it takes the lease, and a run's
end (`end_run.lua`) frees its slot after its outcome is recorded, so a finished
child never counts as running beside the limit's worth of new ones. A run that
must wait holds no worker: it is queued in order on the tree's admission list,
and when a slot frees the first waiting tasks that now fit are started again by
name (`started_again`). A stagger delay is a delayed restart. A root always
runs. This module holds what the start and end hand back to Python: the limits,
the waiting run's live status, the restarts, and the slot a run frees when it
releases its worker without ending (delegated, waiting for a decision, handed
back) or when an ended task's write-back is repaired.

Fair shares between tenants (docs/architecture.md, "Fair shares between tenants") are on when some tenant
policy caps `max_running` or weighs other than 1 (coordinator/tenants.py). Then every run, a root's too,
takes a fleet slot of its tenant at its start (`fair_admit.lua`, inside start_run) after its tree's own
admission, and frees it at its end or release (`fair_release.lua`). A run that may not start is parked in its
tenant's sorted set (priority first, then arrival; live `queued` with `waiting_for` `admission` and the tenant
as the `reason`) and its worker goes back to the broker at once; a freed slot goes to the parked run of the
tenant furthest below its weighted share, `(running + 1) / weight` lowest, as long as the runs holding a slot
stay below the fleet's capacity (the live workers' concurrency, which each worker's beat writes with the
tenants table: `beat`). Runs published in a batch or as a root are announced first (`announce`): a tenant's
runs still in Celery's FIFO queue behind another's flood count as its demand, so the other's are parked as
they come and the queue drains at the speed of a park.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from coordinator import dispatch
from coordinator.errors import NotFoundError
from coordinator.models import AdmissionLimits, TaskRecord, TaskStatus
from coordinator.replies import FairHealed
from coordinator.tenants import DEFAULT_POLICY_NAME, NO_FAIR_SHARES, FairShares

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = [
    "PARKED_FOR",
    "announce",
    "beat",
    "fair",
    "free_tool_slot",
    "heal",
    "limits",
    "must_wait",
    "parked",
    "release",
    "started_again",
    "take_tool_slot",
    "wait_for_rate",
    "wait_for_tool_rate",
]


def limits(plane: Plane) -> AdmissionLimits:
    s = plane.settings
    return AdmissionLimits(s.max_running_per_parent, s.max_running_per_root, s.start_stagger_ms)


# Why a run was parked for a fleet slot of its tenant (fair_admit.lua's word), as its live status says it.
PARKED_FOR = {
    "max_running": "holds its max_running",
    "share": "is at its weighted share while other tenants wait",
    "fleet": "waits for a free slot of the fleet",
    "order": "gave its slot to its own parked run of a higher priority or an earlier arrival",
}


def fair(plane: Plane) -> FairShares:
    """Whether fair shares are on now (the tenants table, read again when its file changed), and this process's
    concurrency: the fleet's capacity until a worker's beat has counted it."""
    if not plane.tenants.fair_shares:
        return NO_FAIR_SHARES
    return FairShares(on=True, capacity=plane.settings.worker_concurrency)


def must_wait(
    plane: Plane, task: TaskRecord, delay_ms: int, parked_for: str = "", admitted: Sequence[str] = ()
) -> None:
    """The start found no slot ('wait': it is on its tree's admission list; 'park': among its tenant's parked
    runs, `parked_for` why, and `admitted` the parked runs given the slot instead) or a stagger (`delay_ms`:
    restart it then)."""
    # Said before the restart is published: its run may write `running` first, which a later `queued` would cover.
    if parked_for:
        reason = f"tenant {task.tenant} {PARKED_FOR.get(parked_for, parked_for)}"
        plane.store.events.set_live(task, "queued", waiting_for="admission", reason=reason)
    else:
        plane.store.events.set_live(task, "queued")
    if delay_ms:
        dispatch.publish_restart(plane.app, task, countdown_s=delay_ms / 1000)
    if admitted:
        started_again(plane, admitted)


def started_again(plane: Plane, admitted: Sequence[str]) -> None:
    """Publish the runs of waiting tasks a freed slot admitted (each still on the due list, should this fail)."""
    for task_id in admitted:
        dispatch.publish_restart(plane.app, plane.store.records.get_task(task_id))


def release(
    plane: Plane, task: TaskRecord, *, token: str = "", while_asked: bool = False, while_ended: bool = False
) -> None:
    """Free the task's run slot (its tree's, and its tenant's fleet slot) and start the waiting tasks that now fit.

    With `token`, a run's release after it freed its lease: only while that run is still the task's last start,
    checked in the step that frees each slot (a run of the task that started since reuses them).

    With `while_asked`, each slot only while one of the calls the task waits on is still pending, checked in the
    step that frees it: the reconciler's, for a run that died after it parked calls for a person and before its
    release freed them. Until the last decision no run of the task starts (`start_run` answers `asked`); its
    resumed run then takes slots again as any resumed run does, and reuses those a decision made before the free
    left held.

    With `while_ended`, each slot only while the task still has the status `task` was read with (an ended one),
    or waits on its children, checked in the step that frees it: a repair's, which read the task ended. A retry
    since made it active, and the slot its new run took is that run's; or made it wait on its retried children
    (`delegated`), and no run of it holds a slot while it waits, so the one its dead run held is freed (else its
    children could wait for it for good)."""
    own = limits(plane)
    status = f"{task.status.value} {TaskStatus.DELEGATED.value}" if while_ended else ""
    admitted: list[str] = []
    if own.applies_to(task):
        admitted += plane.store.runs.release_slot(
            task, own, while_status=status, while_run=token, while_asked=while_asked
        )
    shares = fair(plane)
    if shares.on:
        admitted += plane.store.fair.release(
            task.id, shares, while_status=status, while_run=token, while_asked=while_asked
        )
    started_again(plane, admitted)


def release_delegated(plane: Plane, task: TaskRecord) -> None:
    """Free the tree slot of a delegated task whose run died before its release freed it (its fleet slot is
    `heal`'s): only while the task is still delegated, checked in the step that frees it, so a resumed run of
    it, which took a slot again, keeps it. Without this its children could wait for good on the slot it held."""
    own = limits(plane)
    if own.applies_to(task):
        started_again(plane, plane.store.runs.release_slot(task, own, while_status=TaskStatus.DELEGATED.value))


def release_stopped(plane: Plane, stopped: Sequence[TaskRecord]) -> set[str]:
    """Free the tree slots that tasks of one stop hold with no run left to free them: a run that died, its lease
    lapsed, before the reconciler published it again (the stop takes it off the due list, where the
    reconciler's look would have freed it). Returns the ids whose live run still holds its slot: it frees it as
    it ends, and the stop leaves them on the due list, so that a run that dies first has its slot freed by the
    reconciler once its lease lapses. Fleet slots are `heal`'s."""
    own = limits(plane)
    held = [task for task in stopped if own.applies_to(task)]
    if not held:
        return set()
    running = plane.store.runs.running_ids(held[0].root_id)  # a subtree is within one tree
    held = [task for task in held if task.id in running]
    triaged = plane.store.convergence.triage([task.id for task in held]) if held else []
    live: set[str] = set()
    for task, seen in zip(held, triaged, strict=True):
        if seen.leased:
            live.add(task.id)
        else:  # only while it is as the stop left it: a retry since gave its new run the slot
            started_again(plane, plane.store.runs.release_slot(task, own, while_status=task.status.value))
    return live


def withdraw_stopped(plane: Plane, stopped: Sequence[TaskRecord]) -> None:
    """Take the tasks of one stop out of their tenant's demand for fleet slots (fair_withdraw.lua), and start the
    parked runs the slots they no longer want go to. Else a tenant whose freshly published batch was cancelled
    went on looking the neediest until its announced runs aged out (`FAIR_QUEUED_S`), and every freed slot of
    the fleet went to nobody meanwhile."""
    shares = fair(plane)
    if not shares.on:
        return
    by_tenant: dict[str, list[str]] = {}
    for task in stopped:
        by_tenant.setdefault(task.tenant, []).append(task.id)
    for tenant, task_ids in by_tenant.items():
        started_again(plane, plane.store.fair.withdraw(tenant, task_ids, shares))


def announce(plane: Plane, tenant: str, task_ids: Sequence[str]) -> None:
    """Runs of `tenant` are about to be published: its demand while their messages wait in the broker's queue."""
    if task_ids and plane.tenants.fair_shares:
        plane.store.fair.announce(tenant, task_ids)


def parked(plane: Plane, task_id: str) -> bool:
    """Whether the task's run waits among its tenant's parked runs (the reconciler leaves it to a freed slot)."""
    if not plane.tenants.fair_shares:
        return False
    return plane.store.fair.is_parked(task_id, plane.store.records.get_task(task_id).tenant)


def heal(plane: Plane, limit: int) -> FairHealed:
    """The reconciler's pass over fair shares (fair_heal.lua), whether they are on or not: free the fleet slots
    of runs whose task is gone, ended or delegated (no slot leaks); on, give free slots to parked runs (a
    `max_running` raised, a weight changed, the fleet grown); off, release up to `limit` parked runs (none is
    stranded when the tenants table turns fair shares off). Publishes the runs it started or released."""
    shares = fair(plane)
    if not shares.on:
        shares = FairShares(on=False, capacity=plane.settings.worker_concurrency)
    healed = plane.store.fair.heal(shares, plane.settings.reconcile_grace_s, limit)
    for task_id in healed.started:
        try:
            dispatch.publish_restart(plane.app, plane.store.records.get_task(task_id))
        except NotFoundError:
            pass  # its tree is gone: nothing to run (its slot, if it took one, is freed by the next pass)
    return healed


def beat(plane: Plane, worker: str) -> None:
    """A worker process's beat: its concurrency (the fleet's capacity is their sum) and the tenants table it
    reads, which the admission steps read for any tenant they meet."""
    tenants = plane.tenants
    if not tenants.fair_shares:
        return
    table = {name: (policy.weight, policy.max_running) for name, policy in tenants.listed.items()}
    table[DEFAULT_POLICY_NAME] = (tenants.default.weight, tenants.default.max_running)
    plane.store.fair.beat(worker, plane.settings.worker_concurrency, plane.settings.heartbeat_lapse_s, table)


def take_tool_slot(plane: Plane, pattern: str, limit: int, lease_s: float, member: str) -> int:
    """Take a fleet-wide slot of the tool glob `pattern` for the call `member`: when its lease ends (ms), which
    `free_tool_slot` is given back; 0: all `limit` are held."""
    return plane.store.runs.take_tool_slot(pattern, limit, lease_s, member)


def free_tool_slot(plane: Plane, pattern: str, member: str, lease_ends_ms: int) -> None:
    """Free the slot the take that said `lease_ends_ms` took, unless the same call has taken it again since."""
    plane.store.runs.free_tool_slot(pattern, member, lease_ends_ms)


def wait_for_tool_rate(plane: Plane, pattern: str, rpm: int) -> int:
    """0 when a call of the tool glob `pattern` may start now (and is counted), else the ms to wait first."""
    return plane.store.runs.wait_for_rate(f"tool:{pattern}", rpm)


def wait_for_rate(plane: Plane, provider: str) -> int:
    """0 when a request to `provider` may start now (and is counted), else the ms to wait first."""
    rpm = plane.settings.provider_rpm.get(provider, 0)
    return plane.store.runs.wait_for_rate(provider, rpm) if rpm else 0
