"""The reconciler: finds tree states that no message will move on any more, and moves them on.

It runs inside the worker fleet (a thread of each worker process, `run_forever`; one
leader at a time through a Redis lease, `lead.lua`), every `SUBQ_RECONCILE_INTERVAL_S`.
The others bid for the lead at the fleet's pace, and every process beats its heartbeat
every third of `SUBQ_HEARTBEAT_LAPSE_S`, counting the fleet as it does.
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
   | ended                                         | free its slot, write it back, unwatch it  | `ended-not-written-back` |
   |                                               | (`writeback.settle_ended`)                |                          |
   | delegated, a submission's root whose batch    | end it (`writeback.end_submission`)       | `submission-ended`       |
   | closed (its closer died first)                |                                           |                          |
   | delegated, its batch not published            | publish it (`delegation.publish`)         | `delegation-unpublished` |
   | active, an agent's, leased by a live run      | nothing; look again next tick             |                          |
   | active, a call still pending for a decision   | free its slots while the call is pending  |                          |
   |                                               | (its run died before its release), unwatch|                          |
   |                                               | it: the decision or the timer moves it on |                          |
   | active, waiting for a run slot, or with a run | nothing (the freed slot moves it on)      |                          |
   | message in the broker's queue, or held by a   |                                           |                          |
   | live worker (`<p>:reserved`)                  |                                           |                          |
   | active, an agent's, nothing of the above      | publish its run again (`-x<n>`)           | `run-lost`               |

   `run-lost` covers a run whose worker died (its lease lapsed with the
   worker's heartbeat), a resume never published after its batch closed, and a
   message lost in the broker (a Redis restart).
3. passes over fair shares between tenants (`admission.heal`, fair_heal.lua): a fleet
   slot whose run's task is gone, ended or delegated is freed (`fair-slot-leaked`); with
   fair shares on, free slots go to parked runs (a `max_running` raised); with them off,
   every parked run is published again (`parked-released`), none left stranded;
4. keeps the keys of the trees in flight: a slice of the keyspace a tick, each key of a tree
   whose agent root has not ended, or whose caller root is delegated, given its retention again
   before it lapses (coordinator/keeper.py).
Every step is idempotent, so a repair done twice, or beside the normal path,
changes nothing. Each repair is counted (`Store.convergence.repairs`) and logged with its reason. A task whose
look fails (a record that does not read, a fault) is logged and looked at again a grace later: it holds up
none of the tasks due after it. A store or broker that is away ends the tick (every task would fail alike).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import redis
from kombu.exceptions import OperationalError

from coordinator import admission, approvals, delegation, dispatch, endpoints, writeback
from coordinator.errors import CorruptError, NotFoundError, StoreError
from coordinator.keeper import TreeKeeper
from coordinator.models import TaskStatus

if TYPE_CHECKING:
    from coordinator.service import Coordinator

__all__ = ["BEATS_PER_LAPSE", "TICK_LIMIT", "IdlePace", "Reconciler", "fleet_paced_s"]

log = logging.getLogger(__name__)

# How many due tasks and timers one tick takes; the rest wait for the next tick.
TICK_LIMIT = 500
# A task that changed this recently is left to the normal path, which is on its next step.
SETTLE_S = 3.0
# The leader's lease lasts at least this long: a tick that a loaded host slows does not lose it.
MIN_LEASE_S = 5.0
# A process beats this many times within a lapse (as a run's lease is renewed, coordinator/heartbeat.py):
# one beat missed under load does not make it look gone.
BEATS_PER_LAPSE = 3


def fleet_paced_s(every_s: float, most_s: float, fleet_size: int) -> float:
    """How long one process waits between two turns of a clock it keeps for the whole fleet.

    The fleet should turn it every `every_s`: each of its `fleet_size` processes waits that many times
    as long, at most `most_s`, and never less than `every_s`. An idle fleet of eight cost Redis and its
    runs' interpreters eight times what one did, for nothing (bench/overhead.py --processes).
    """
    return max(every_s, min(every_s * fleet_size, most_s))


class IdlePace:
    """The waits of a loop that polls while idle (the webhook deliverer): longer the longer it stays idle.

    `wait_s()` is called after each poll that found nothing. The first wait is `every_s`; each next one
    of an unbroken idle spell doubles, up to `quiet_s`; then each is paced by the fleet's size
    (`fleet_paced_s`, at most `most_s`). A call that comes later than the last wait could explain means
    the loop found work between the two: the spell is over and the waits start again at `every_s`. An
    idle worker of one process looked 4 times a second and spent 2.5 ms of CPU a second on it.
    """

    def __init__(
        self,
        every_s: float,
        quiet_s: float,
        most_s: float,
        fleet_size: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_s, self.quiet_s, self.most_s, self.fleet_size, self.clock = (
            every_s, quiet_s, most_s, fleet_size, clock
        )  # fmt: skip
        self._base_s = every_s
        self._due_s: float | None = None  # when the next call is expected, were the loop still idle

    def wait_s(self) -> float:
        now = self.clock()
        if self._due_s is None or now > self._due_s + self.every_s:
            self._base_s = self.every_s  # work was found since: a new spell
        else:
            self._base_s = min(self._base_s * 2, self.quiet_s)
        wait_s = fleet_paced_s(self._base_s, max(self.most_s, self._base_s), self.fleet_size())
        self._due_s = now + wait_s
        return wait_s


class Reconciler:
    """One per worker process; `tick()` does a round when this process leads, else nothing."""

    def __init__(self, coord: Coordinator, name: str, reserved: Callable[[], Collection[str]] = tuple) -> None:
        self.plane = coord.plane  # the worker builds it with its Coordinator; it works with the plane alone
        self.name = name
        # The tasks whose run message this process holds, started or not (the worker reads Celery's state).
        self.reserved = reserved
        self._queued: set[str] | None = None
        self._queue_read = False
        self._later: defaultdict[float, list[str]] = defaultdict(list)  # delay -> tasks to look at again then
        # The worker processes whose reconcilers beat within a lapse, this one included, as of its last beat:
        # the clocks each keeps for the whole fleet run that many times slower (workers/maintenance.py).
        self.fleet_size = 1
        # The trees still in flight keep their keys: a slice of the keyspace a tick (coordinator/keeper.py).
        self.keeper = TreeKeeper(self.plane, self.plane.settings.reconcile_interval_s)

    @property
    def lease_s(self) -> float:
        """How long the leader's lease lasts past its last tick (a few ticks: a slow tick does not lose it)."""
        return max(3 * self.plane.settings.reconcile_interval_s, MIN_LEASE_S)

    def beat(self) -> None:
        """This worker's heartbeat, whether or not it runs anything or leads; it counts the fleet too."""
        live = self.plane.store.convergence.beat(self.name, self.plane.settings.heartbeat_lapse_s, self.reserved())
        # A node's reconciler beats as `<node>:<pid>` (`<name>@<host>`); a run's heartbeat has no `@`.
        self.fleet_size = max(1, sum(1 for member in live if "@" in member.rpartition(":")[0]))
        admission.beat(self.plane, self.name)  # its concurrency and the tenants table (fair shares)

    def run_forever(self, stop: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        """Beat, and tick while leading or bid for the lead, until `stop` is set (never, in a worker).

        The beat every third of a lapse; the leader's tick every `SUBQ_RECONCILE_INTERVAL_S`; the others'
        bids for the lead at the fleet's pace (`fleet_paced_s`), at most half the lease apart, so one of
        them takes a lapsed lease within about an interval.
        """
        interval_s = self.plane.settings.reconcile_interval_s
        beat_every_s = self.plane.settings.heartbeat_lapse_s / BEATS_PER_LAPSE
        # The first beat at once, not after a tick's wait: a worker that answers pings counts as
        # present on /readyz from its start (a fresh fleet read `degraded` for its first tick).
        next_beat = next_tick = clock()
        while True:
            started = clock()
            # The beat and the tick each fail alone (Redis down, a bad record: logged, tried again after an
            # interval): a beat that failed every time (a tenants table too large for it) stopped every tick.
            if started >= next_beat:
                try:
                    self.beat()
                    next_beat = started + beat_every_s
                except Exception:
                    log.exception("subq reconciler: a beat failed")
                    next_beat = started + interval_s
            if started >= next_tick:
                try:
                    leads = self.tick() is not None
                    wait_s = interval_s if leads else fleet_paced_s(interval_s, self.lease_s / 2, self.fleet_size)
                    next_tick = started + wait_s
                except Exception:
                    log.exception("subq reconciler: a tick failed")
                    next_tick = started + interval_s
            if clock() - started > interval_s:
                log.warning("subq reconciler: a tick took %.1f s", clock() - started)
            if stop.wait(max(0.0, min(next_beat, next_tick) - clock())):
                return

    def tick(self) -> Counter[str] | None:
        """One round; the repairs made by reason, or None when another process leads."""
        if not self.plane.store.convergence.lead(self.name, self.lease_s):
            self.keeper.interrupt()
            return None
        repairs: Counter[str] = Counter()
        self._timers()
        self._fair_shares(repairs)
        self._queued, self._queue_read = None, False  # the broker's queue is read at most once a tick, if needed
        self._later = defaultdict(list)
        due = self.plane.store.convergence.due_tasks(TICK_LIMIT)
        for task_id, triaged in zip(due, self.plane.store.convergence.triage(due), strict=True):
            try:
                reason = self._look_at(task_id, triaged)
            except CorruptError as exc:
                self._put_off(task_id, exc)
                continue
            except (StoreError, OperationalError, redis.RedisError):
                # Redis or the broker away or refusing (a publish's error comes as kombu's, or redis-py's own):
                # every task would fail alike, so the tick ends and is tried again.
                raise
            except Exception as exc:
                self._put_off(task_id, exc)
                continue
            if reason:
                repairs[reason] += 1
                self.plane.store.convergence.count_repair(reason)
                log.warning("subq reconciler: %s: %s", reason, task_id)
        # The tasks to look at again later, in one write a delay: a wave of a thousand queued children
        # costs a tick a few round trips, not two each (each round trip also takes the interpreter's
        # lock from the runs of the process, bench/overhead.py measured it).
        for after_s, task_ids in self._later.items():
            self.plane.store.convergence.watch(task_ids, after_s, only_if_watched=True)
        self.keeper.step()
        return repairs

    def _put_off(self, task_id: str, exc: Exception) -> None:
        """A task whose look failed: looked at again a grace later, so it holds up none of the tasks due after it.
        Raised out of the tick, it failed every tick until its record lapsed, and no task due after it was looked at
        meanwhile. A corrupt entry is one line a grace, its error naming what is wrong (until an operator mends
        it); a fault of this code is logged with its trace."""
        grace_s = self.plane.settings.reconcile_grace_s
        if isinstance(exc, CorruptError):
            log.warning("subq reconciler: %s; %s is looked at again in %.0f s", exc, task_id, grace_s)
        else:
            log.exception("subq reconciler: looking at %s failed; it is looked at again in %.0f s", task_id, grace_s)
        self._later[grace_s].append(task_id)

    def _fair_shares(self, repairs: Counter[str]) -> None:
        """Fair shares' pass (admission.heal): a slot whose run's task is gone, ended or delegated is freed
        (`fair-slot-leaked`); with fair shares off, parked runs are published again (`parked-released`)."""
        healed = admission.heal(self.plane, TICK_LIMIT)
        released = [] if self.plane.tenants.fair_shares else healed.started
        for reason, task_ids in (("fair-slot-leaked", healed.freed), ("parked-released", released)):
            for task_id in task_ids:
                repairs[reason] += 1
                self.plane.store.convergence.count_repair(reason)
                log.warning("subq reconciler: %s: %s", reason, task_id)

    def _timers(self) -> None:
        """Serve the due timers. One that raises stays set, served again at the next tick, and the others
        are served and removed all the same: a raise that ended the tick left every timer to be served again
        (each provider wake published its run again)."""
        due = self.plane.store.convergence.due_timer_times(TICK_LIMIT)
        served: dict[str, float] = {}
        for name, at in due.items():
            try:
                self._serve(name)
            except Exception:  # Redis away, or a bug of ours: this timer only, tried again next tick
                log.exception("subq reconciler: timer %r failed; it is served again at the next tick", name)
            else:
                served[name] = at
        # Only those still set for the time they were read at: one its run set again meanwhile is new.
        self.plane.store.convergence.remove_served_timers(served)

    def _serve(self, name: str) -> None:
        kind, _, subject = name.partition(":")
        if kind == approvals.EXPIRY_TIMER:
            try:
                approvals.expire(self.plane, subject)
            except NotFoundError:  # its tree has expired: off the fleet's pending index too, which has no expiry
                self.plane.store.approvals.forget_lapsed(subject)
        elif kind == endpoints.PROVIDER_TIMER:
            endpoints.wake(self.plane, subject)  # a run parked while its provider was down
        else:
            log.error("subq reconciler: unknown timer %r dropped", name)

    def _ended(self, task_id: str) -> str:
        """An ended task still due: its end was never written back to its parent's batch."""
        delegation.settle_ended(self.plane, self.plane.store.records.get_task(task_id))
        return "ended-not-written-back"

    def _delegated(self, task_id: str) -> str | None:
        """A delegated task still due: its batch is published, unless that never happened; a submission's root
        whose batch closed is ended (its closer died before it ended it: `writeback.end_submission`)."""
        store = self.plane.store
        if writeback.end_submission(self.plane, task_id):
            return "submission-ended"
        record = store.records.get_task(task_id)
        admission.release_delegated(self.plane, record)  # its run died before its release freed the slot
        try:
            batch = store.batches.get_batch(record.waiting_batch_id) if record.waiting_batch_id else None
        except NotFoundError:
            batch = None  # its batch lapsed (open longer than a retention): nothing is left to publish
        if batch is not None and not store.batches.batch_published(batch.id):
            delegation.publish(self.plane, batch, store.records.get_records(batch.child_ids))
            return "delegation-unpublished"
        store.convergence.unwatch([task_id], while_status=TaskStatus.DELEGATED.value)  # not once resumed meanwhile
        return None

    def _waits_to_start(self, task_id: str) -> bool:
        """Its run message is in the broker's queue or held by a live worker, or it waits for a run slot."""
        store = self.plane.store
        if not self._queue_read:
            self._queued = store.convergence.queued_task_ids(self.plane.settings.queue)
            self._queue_read = True
        return (
            self._queued is None  # a backlog deeper than one look reads: every task counts as queued
            or task_id in self._queued
            or store.convergence.reserved(task_id)
            or store.convergence.in_admission(task_id)
            or admission.parked(self.plane, task_id)
        )

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
            return self._ended(task_id)
        if state == TaskStatus.DELEGATED:
            return self._delegated(task_id)
        if runner != "agent":
            store.convergence.unwatch([task_id])
            return None
        if asked:
            # The run that parked it on a call for a person died before its release (no lease): its slots are freed
            # while the call is still pending, or the tree's other runs (and its tenant's) would wait for them
            # until a person decides. Before it leaves the due list: a process that dies in between looks again.
            admission.release(plane, store.records.get_task(task_id), while_asked=True)
            if store.convergence.unwatch_parked(task_id):
                return None  # a call still waits: the last decision, or its timer, watches it again
        if self._waits_to_start(task_id):
            self._later[settings.reconcile_grace_s].append(task_id)
            return None
        now = store.convergence.triage([task_id])[0]
        if now.leased or (now.status, now.updated_at) != (status, updated_at):
            # Its message left the queue after the triage and before the queue was read: a worker
            # took it and its run has started, or even ended, since (an end frees the lease and takes
            # the task off the due list, which "later" does not undo). Not lost: an extra read, on this
            # branch only.
            self._later[settings.reconcile_interval_s].append(task_id)
            return None
        store.convergence.watch([task_id], settings.reconcile_grace_s)  # first: a lost publish is tried again
        record = store.records.get_task(task_id)
        dispatch.publish_again(plane.app, record, store.convergence.next_repair(task_id))
        return "run-lost"
