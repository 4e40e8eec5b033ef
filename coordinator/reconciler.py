"""The reconciler: finds tree states that no message will move on any more, and moves them on.

It runs inside the worker fleet (a thread of each worker process; one leader at
a time through a Redis lease, `lead.lua`), every `SUBQ_RECONCILE_INTERVAL_S`.
Each tick it
1. serves due timers (an approval's deadline: `approvals.expire`; a run parked while its
   provider was down: `endpoints.wake`);
2. looks at every task of the due list whose time has come. The normal path
   writes a task there *before* it sends the message that should move it on
   (a run, a resume, a delegation's children) and removes it once its run has
   ended or released its worker, so an entry still there is a task that some
   message or process failed. For each one it takes the step the normal path
   would have taken:

   | the task is                                   | the step                                  | reason counted           |
   |-----------------------------------------------|-------------------------------------------|--------------------------|
   | ended                                         | write it back (`writeback.write_back`)    | `ended-not-written-back` |
   | delegated, its batch not published            | publish it (`delegation.publish`)         | `delegation-unpublished` |
   | active, an agent's, leased by a live run      | nothing; look again next tick             |                          |
   | active, waiting for a decision or a run slot, | nothing (the decision, the timer or the   |                          |
   | or with a run message in the broker's queue   | freed slot moves it on)                   |                          |
   | active, an agent's, nothing of the above      | publish its run again (`-x<n>`)           | `run-lost`               |

   `run-lost` covers a run whose worker died (its lease lapsed with the
   worker's heartbeat), a resume never published after its batch closed, and a
   message lost in the broker (a Redis restart).
Every step is idempotent, so a repair done twice, or beside the normal path,
changes nothing. Each repair is counted (`Store.convergence.repairs`) and logged with its reason.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from coordinator import admission, approvals, delegation, dispatch, endpoints, writeback
from coordinator.errors import NotFoundError
from coordinator.models import TaskStatus

if TYPE_CHECKING:
    from coordinator.service import Coordinator

__all__ = ["TICK_LIMIT", "Reconciler"]

log = logging.getLogger(__name__)

# How many due tasks and timers one tick takes; the rest wait for the next tick.
TICK_LIMIT = 500
# A task that changed this recently is left to the normal path, which is on its next step.
SETTLE_S = 3.0


class Reconciler:
    """One per worker process; `tick()` does a round when this process leads, else nothing."""

    def __init__(self, coord: Coordinator, name: str) -> None:
        self.plane = coord.plane  # the worker builds it with its Coordinator; it works with the plane alone
        self.name = name
        self._queued: set[str] | None = None
        self._later: defaultdict[float, list[str]] = defaultdict(list)  # delay -> tasks to look at again then

    def beat(self) -> None:
        """This worker's heartbeat, whether or not it runs anything or leads."""
        self.plane.store.convergence.renew_leases([], self.plane.settings.heartbeat_lapse_s, self.name)
        admission.beat(self.plane, self.name)  # its concurrency and the tenants table (fair shares)

    def tick(self) -> Counter[str] | None:
        """One round; the repairs made by reason, or None when another process leads."""
        settings = self.plane.settings
        if not self.plane.store.convergence.lead(self.name, max(3 * settings.reconcile_interval_s, 5.0)):
            return None
        repairs: Counter[str] = Counter()
        self._timers()
        self._queued = None  # the broker's queue is read at most once a tick, and only if needed
        self._later = defaultdict(list)
        due = self.plane.store.convergence.due_tasks(TICK_LIMIT)
        for task_id, triaged in zip(due, self.plane.store.convergence.triage(due), strict=True):
            reason = self._look_at(task_id, triaged)
            if reason:
                repairs[reason] += 1
                self.plane.store.convergence.count_repair(reason)
                log.warning("subq reconciler: %s: %s", reason, task_id)
        # The tasks to look at again later, in one write a delay: a wave of a thousand queued children
        # costs a tick a few round trips, not two each (each round trip also takes the interpreter's
        # lock from the runs of the process, bench/overhead.py measured it).
        for after_s, task_ids in self._later.items():
            self.plane.store.convergence.watch(task_ids, after_s, only_if_watched=True)
        return repairs

    def _timers(self) -> None:
        done = []
        for name in self.plane.store.convergence.due_timers(TICK_LIMIT):
            kind, _, subject = name.partition(":")
            if kind == approvals.EXPIRY_TIMER:
                try:
                    approvals.expire(self.plane, subject)
                except NotFoundError:
                    pass  # its tree has expired
            elif kind == endpoints.PROVIDER_TIMER:
                endpoints.wake(self.plane, subject)  # a run parked while its provider was down
            else:
                log.error("subq reconciler: unknown timer %r dropped", name)
            done.append(name)
        self.plane.store.convergence.remove_timers(done)

    def _look_at(self, task_id: str, triaged: tuple[str, str, float, bool, bool]) -> str | None:
        """One due task, as `convergence.triage` read it: (status, runner, updated_at, leased, asked)."""
        plane, store = self.plane, self.plane.store
        settings = plane.settings
        status, runner, updated_at, leased, asked = triaged
        if not status:  # gone with its tree's retention
            store.convergence.unwatch([task_id])
            return None
        if leased or time.time() - updated_at < SETTLE_S:
            # A live run holds it (a delegating parent publishes its own batch), or it just
            # changed and the normal path is still on its next step.
            self._later[settings.reconcile_interval_s].append(task_id)
            return None
        state = TaskStatus(status)
        if state.terminal:
            record = store.records.get_task(task_id)
            admission.release(plane, record)
            if record.batch_id:
                writeback.write_back(plane, record.batch_id, ended=record)
            store.convergence.unwatch([task_id])
            return "ended-not-written-back"
        if state == TaskStatus.DELEGATED:
            record = store.records.get_task(task_id)
            batch = store.batches.get_batch(record.waiting_batch_id) if record.waiting_batch_id else None
            if batch is not None and not store.batches.batch_published(batch.id):
                delegation.publish(plane, batch, store.records.get_records(batch.child_ids))
                return "delegation-unpublished"
            store.convergence.unwatch([task_id], while_status=TaskStatus.DELEGATED.value)  # not once resumed meanwhile
            return None
        if runner != "agent":
            store.convergence.unwatch([task_id])
            return None
        if asked and approvals.undecided(plane, task_id):
            store.convergence.unwatch([task_id])  # each decision, or its timer, watches it again
            return None
        if self._queued is None:
            self._queued = store.convergence.queued_task_ids(settings.queue)
        if task_id in self._queued or store.convergence.in_admission(task_id) or admission.parked(plane, task_id):
            self._later[settings.reconcile_grace_s].append(task_id)
            return None
        if store.convergence.triage([task_id])[0].leased:
            # Its message left the queue after the triage and before the queue was read: a worker
            # took it and its run has started since. Not lost (an extra read, on this branch only).
            self._later[settings.reconcile_interval_s].append(task_id)
            return None
        store.convergence.watch([task_id], settings.reconcile_grace_s)  # first: a lost publish is tried again
        record = store.records.get_task(task_id)
        dispatch.publish_again(plane.app, record, store.convergence.next_repair(task_id))
        return "run-lost"
