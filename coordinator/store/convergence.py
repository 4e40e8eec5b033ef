"""What convergence reads and writes: the due list, timers, leases, heartbeats, the leader, repairs.

- `due` (a zset, task id -> when to look): every task that expects a message to
  move it on (a published run, a resume, a committed delegation) is written here
  *before* the message is sent, and removed once its run has ended or released
  its worker; a run puts its task there as it takes the lease, and no one else
  removes a task while a run holds its lease. An entry still there when its
  time comes means a message was lost or a process died between two steps; the
  reconciler looks at it then.
- `timers` (a zset, `<kind>:<id>` -> due time): delayed actions, served by the
  reconciler instead of broker countdown messages.
- run leases are renewed by their worker's heartbeat (`renew_leases`); a lease
  that lapses means its worker is gone.
- the trees' keys, walked a SCAN call at a time (`tree_keys`), and those of the trees
  in flight given their retention again (`keep_trees`, coordinator/keeper.py); where
  the walk stands (`keeper_walk`), for whichever process leads next.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import NamedTuple, cast

from coordinator.ids import root_of, task_of_run_id
from coordinator.models import TaskRecord
from coordinator.store.base import Part, _scored, _str_map, _strs, translate_redis_errors
from coordinator.store.fields import TaskField
from coordinator.store.protocol import (
    KeepTrees,
    Lead,
    RemoveServedTimers,
    RenewLeases,
    Rewatch,
    Unwatch,
    UnwatchKeys,
    UnwatchParked,
)

__all__ = ["QUEUE_SCAN_LIMIT", "ConvergenceStore", "Triage"]

# How many ready messages one look at the broker's queue reads; a deeper backlog counts
# every task as still queued (nothing is published again on a guess) until it drains below.
QUEUE_SCAN_LIMIT = 20_000
# A worker's heartbeat entry is dropped after a day without one (the list is for people).
WORKER_FORGET_S = 24 * 3600


class Triage(NamedTuple):
    """What the reconciler reads of a due task first; status is '' when the task is gone."""

    status: str
    runner: str
    updated_at: float
    leased: bool
    asked: bool = False  # its last run asked for decisions (they may all be decided by now)


class Watched(NamedTuple):
    """A task's watch by `watch_one`: the time it wrote, and when the task was due before (None: not listed)."""

    task_id: str
    at: float
    due_before: float | None


class ConvergenceStore(Part):
    """The due list and timers, run leases and heartbeats, the reconciler's leader lease, repairs."""

    # -- the due list ------------------------------------------------------------------

    @translate_redis_errors
    def watch(
        self, task_ids: Sequence[str], after_s: float, *, only_if_watched: bool = False, spread_s: float = 0.0
    ) -> None:
        """Look at these tasks in `after_s` unless their runs end or release their worker first.

        `only_if_watched` moves the time of tasks still watched and adds none (the
        reconciler's "look again later" must not bring back a task whose run just ended).
        `spread_s`: each task `spread_s` later than the one before it (tasks whose messages are
        sent one after another, in this order, over a while).
        """
        if task_ids:
            at = time.time() + after_s
            due = {task_id: at + n * spread_s for n, task_id in enumerate(task_ids)}
            self.client.zadd(self.keys.due(), due, xx=only_if_watched)

    @translate_redis_errors
    def watch_one(self, task_id: str, after_s: float) -> Watched:
        """`watch([task_id], after_s)`, answering what `rewatch` puts back when the step the watch was for is
        refused: when the task was due before (None: it was not on the list), and the time this watch wrote."""
        at = time.time() + after_s
        # One transaction: another watch of the task between the read and the write (two delegations of one caller
        # task at once) would leave this one answering a place it did not find, and `rewatch` put back the wrong one.
        pipe = self.client.pipeline(transaction=True)
        pipe.zscore(self.keys.due(), task_id)
        pipe.zadd(self.keys.due(), {task_id: at})
        due_before: float | None = pipe.execute()[0]
        return Watched(task_id, at, due_before)

    @translate_redis_errors
    def rewatch(self, watched: Watched) -> bool:
        """The task's place on the due list as `watch_one` found it, unless a step has watched it since
        (rewatch.lua); whether it was put back."""
        before = "" if watched.due_before is None else repr(watched.due_before)
        return self.scripts(
            Rewatch(due=self.keys.due(), task_id=watched.task_id, watched_at=watched.at, due_before=before)
        )

    @translate_redis_errors
    def unwatch(self, task_ids: Sequence[str], *, while_status: str = "") -> None:
        """Take these tasks off the due list, except one a live run holds the lease of (unwatch.lua).

        With `while_status`, only those still in that status: a caller that saw a parent
        `delegated` must not take it off once it has been resumed meanwhile. A run's own
        end takes its task off in the same step as it frees the lease.
        """
        if task_ids:
            tasks = [
                UnwatchKeys(lease=self.keys.lease(root_of(t), t), task=self.keys.task(root_of(t), t)) for t in task_ids
            ]
            self.scripts(Unwatch(due=self.keys.due(), tasks=tasks, while_status=while_status, task_ids=task_ids))

    @translate_redis_errors
    def unwatch_parked(self, task_id: str) -> bool:
        """Take a task parked on approvals off the due list while one of them is still pending, in one
        step (unwatch_parked.lua); True while one is. A task whose approvals were all decided stays on
        it: a decision made before its run freed the lease published a resume that did nothing."""
        root = root_of(task_id)
        return self.scripts(
            UnwatchParked(
                due=self.keys.due(), lease=self.keys.lease(root, task_id), task=self.keys.task(root, task_id),
                task_id=task_id, approval_prefix=self.keys.approval(root, ""),
            )
        )  # fmt: skip

    def unwatch_ended(self, record: TaskRecord) -> None:
        """Take a task read as ended off the due list, only while the server this reaches still says so.

        Under a Sentinel split (two masters for a moment) the read may have come from the old master
        and this step go to the new one, where the task has not ended: taken off there, no one would
        publish it again (docs/architecture.md, "Convergence")."""
        self.unwatch([record.id], while_status=record.status.value)

    @translate_redis_errors
    def due_tasks(self, limit: int) -> list[str]:
        """Tasks whose time to be looked at has come, oldest first."""
        return _strs(self.client.zrangebyscore(self.keys.due(), "-inf", time.time(), start=0, num=limit))

    @translate_redis_errors
    def watched(self) -> dict[str, float]:
        """Every watched task and when it is due (tests, `subq` views)."""
        return _scored(self.client.zrange(self.keys.due(), 0, -1, withscores=True))

    @translate_redis_errors
    def triage(self, task_ids: Sequence[str]) -> list[Triage]:
        """(status, runner, updated_at, leased, asked) of each task, in one round trip."""
        fields = [TaskField.STATUS, TaskField.RUNNER, TaskField.UPDATED_AT, TaskField.WAITING_APPROVAL_IDS]
        with self.client.pipeline(transaction=False) as pipe:
            for task_id in task_ids:
                root = root_of(task_id)
                pipe.hmget(self.keys.task(root, task_id), fields)
                pipe.exists(self.keys.lease(root, task_id))
            replies = pipe.execute()
        return [
            Triage(str(status or ""), str(runner or ""), float(updated_at or 0), bool(leased), bool(asked))
            for (status, runner, updated_at, asked), leased in zip(replies[0::2], replies[1::2], strict=True)
        ]

    @translate_redis_errors
    def in_admission(self, task_id: str) -> bool:
        """Whether the task waits in its tree's admission list for a run slot."""
        return self.client.lpos(self.keys.admission(root_of(task_id)), task_id) is not None

    @translate_redis_errors
    def queued_task_ids(self, queue: str) -> set[str] | None:
        """Tasks with a run message waiting in the broker's ready list of `queue` (kombu's Redis layout); None when
        the list holds more than QUEUE_SCAN_LIMIT messages: every task counts as queued then. (Read from its head,
        the newest, a deep backlog left out its oldest messages, those of the tasks due longest: each was taken
        for lost and published again, up to the tick's limit, every tick.)"""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.llen(queue)
            pipe.lrange(queue, 0, QUEUE_SCAN_LIMIT - 1)
            depth, messages = pipe.execute()
        if int(depth) > QUEUE_SCAN_LIMIT:
            return None
        found: set[str] = set()
        for raw in _strs(messages):
            try:
                celery_id = json.loads(raw)["headers"]["id"]
            except (ValueError, KeyError, TypeError):
                continue  # not a Celery task message: nothing of subq's
            task_id = task_of_run_id(celery_id) if isinstance(celery_id, str) else None
            if task_id:
                found.add(task_id)
        return found

    @translate_redis_errors
    def next_repair(self, task_id: str) -> int:
        return int(self.client.hincrby(self.keys.task(root_of(task_id), task_id), TaskField.REPAIRS, 1))

    @translate_redis_errors
    def count_repair(self, reason: str) -> None:
        self.client.hincrby(self.keys.repairs(), reason, 1)

    @translate_redis_errors
    def repairs(self) -> dict[str, int]:
        return {k: int(v) for k, v in _str_map(self.client.hgetall(self.keys.repairs())).items()}

    # -- timers ------------------------------------------------------------------------

    @translate_redis_errors
    def add_timer(self, name: str, due_at: float, *, later: bool = False) -> None:
        """Set the timer `name` for `due_at`; with `later`, only if that is later than it is set for (or it is unset)."""
        self.client.zadd(self.keys.timers(), {name: due_at}, gt=later)

    @translate_redis_errors
    def due_timers(self, limit: int) -> list[str]:
        return list(self.due_timer_times(limit))

    @translate_redis_errors
    def due_timer_times(self, limit: int) -> dict[str, float]:
        """The due timers, each with the time it was set for (what `remove_served_timers` compares)."""
        due = cast(
            "list[tuple[str | bytes, float]]",
            self.client.zrangebyscore(self.keys.timers(), "-inf", time.time(), start=0, num=limit, withscores=True),
        )
        return {name.decode() if isinstance(name, bytes) else str(name): float(at) for name, at in due}

    @translate_redis_errors
    def remove_served_timers(self, served: Mapping[str, float]) -> None:
        """Remove the timers served, each only while it is still set for the time it was read at.

        A timer set again meanwhile is a new one: a parked run woken by this tick, run at once and
        parked again under the same name before the tick ended, has its new timer kept (removed by
        name, it was lost, and its task waited for nothing).
        """
        if not served:
            return
        # In Lua (remove_served_timers.lua), not a WATCH on this key: every park, approval and wake writes
        # it, so a busy fleet could run out the transaction's tries; the tick then failed whole, and the next
        # served every timer again (each provider wake published again).
        self.scripts(RemoveServedTimers(timers=self.keys.timers(), served=list(served.items())))

    @translate_redis_errors
    def remove_timers(self, names: Iterable[str]) -> None:
        names = list(names)
        if names:
            self.client.zrem(self.keys.timers(), *names)

    # -- the trees in flight, kept (coordinator/keeper.py) ------------------------------

    @translate_redis_errors
    def key_count(self) -> int:
        """How many keys the database holds (DBSIZE: every prefix's), to size a pass over them."""
        return int(self.client.dbsize())

    @translate_redis_errors
    def tree_keys(self, cursor: int, count: int) -> tuple[int, dict[str, list[str]]]:
        """One SCAN step over the trees' keys from `cursor`, about `count` keys looked at: the next cursor (0: the
        pass is over) and the keys it found that live their tree's retention, by root (no run's lease)."""
        cursor, found = self.client.scan(cursor, match=self.keys.trees_pattern(), count=count)
        by_root: dict[str, list[str]] = {}
        for key in _strs(found):
            if (root_id := self.keys.root_of_kept(key)) is not None:
                by_root.setdefault(root_id, []).append(key)
        return int(cursor), by_root

    @translate_redis_errors
    def keep_trees(self, by_root: Mapping[str, Sequence[str]], floor_s: float) -> int:
        """Give each key of these trees (by root) with less than `floor_s` of its retention left the whole retention
        again, those of a tree in flight only (keep_trees.lua: an agent's root not ended, a caller's delegated), in one
        call: how many were."""
        if not by_root:
            return 0
        trees_keys = [key for root_id, keys in by_root.items() for key in (self.keys.task(root_id, root_id), *keys)]
        return self.scripts(
            KeepTrees(
                trees_keys=trees_keys, retention_ms=self.core.retention_s * 1000, floor_ms=int(floor_s * 1000),
                counts=[len(keys) for keys in by_root.values()],
            )
        )  # fmt: skip

    @translate_redis_errors
    def keeper_walk(self) -> tuple[int, float]:
        """Where the keeper's walk stands, as the last leader left it: SCAN's cursor (0 between passes) and when the
        next pass is due (epoch s; 0: at once, none has begun)."""
        cursor, next_pass_at = self.client.hmget(self.keys.keeper(), ["cursor", "next_pass_at"])
        return int(cursor or 0), float(next_pass_at or 0)

    @translate_redis_errors
    def note_keeper_walk(self, cursor: int, next_pass_at: float) -> None:
        self.client.hset(self.keys.keeper(), mapping={"cursor": cursor, "next_pass_at": next_pass_at})

    # -- leases, heartbeats and the leader ---------------------------------------------

    @translate_redis_errors
    def beat(self, worker: str, live_s: float, reserved: Collection[str] = ()) -> list[str]:
        """Beat this worker's heartbeat and read who beat within `live_s`: one round trip.

        `reserved`: the tasks whose run message this process holds (taken off the broker's queue,
        its run maybe not started yet), kept `live_s` in `<p>:reserved`: the reconciler does not take
        such a run for lost however long its start waits for a thread, and a dead process's entries lapse.
        """
        with self.client.pipeline(transaction=False) as pipe:
            now = time.time()
            pipe.zadd(self.keys.workers(), {worker: now})
            pipe.zremrangebyscore(self.keys.workers(), "-inf", now - WORKER_FORGET_S)
            pipe.zrangebyscore(self.keys.workers(), now - live_s, "+inf")
            pipe.zremrangebyscore(self.keys.reserved(), "-inf", now)
            if reserved:
                pipe.zadd(self.keys.reserved(), dict.fromkeys(reserved, now + live_s), gt=True)
            return _strs(pipe.execute()[2])

    @translate_redis_errors
    def reserved(self, task_id: str) -> bool:
        """Whether a live worker process holds the task's run message (`beat`'s `reserved`)."""
        lapses_at = self.client.zscore(self.keys.reserved(), task_id)
        return lapses_at is not None and float(lapses_at) > time.time()

    @translate_redis_errors
    def renew_leases(self, leases: Sequence[tuple[str, str]], ttl_s: float, worker: str) -> list[tuple[str, str]]:
        """Renew the (task id, token) leases this worker holds and beat its heartbeat; returns the lost ones."""
        with self.client.pipeline(transaction=False) as pipe:
            now = time.time()
            pipe.zadd(self.keys.workers(), {worker: now})
            pipe.zremrangebyscore(self.keys.workers(), "-inf", now - WORKER_FORGET_S)
            pipe.execute()
        if not leases:
            return []
        lost = self.scripts(
            RenewLeases(
                leases=[self.keys.lease(root_of(task_id), task_id) for task_id, _ in leases],
                lease_ms=int(ttl_s * 1000),
                tokens=[token for _, token in leases],
            )
        )
        return [leases[i - 1] for i in lost]

    @translate_redis_errors
    def workers(self) -> dict[str, float]:
        """Worker processes and the time of their last heartbeat."""
        return _scored(self.client.zrange(self.keys.workers(), 0, -1, withscores=True))

    @translate_redis_errors
    def workers_since(self, since_s: float) -> list[str]:
        """Worker processes whose last heartbeat is at `since_s` or later: one ZRANGEBYSCORE."""
        return [str(member) for member in self.client.zrangebyscore(self.keys.workers(), since_s, "+inf")]

    @translate_redis_errors
    def lead(self, candidate: str, ttl_s: float) -> bool:
        """Take or keep the reconciler's leader lease; True while `candidate` leads."""
        return self.scripts(Lead(lease=self.keys.leader(), candidate=candidate, lease_ms=int(ttl_s * 1000)))

    @translate_redis_errors
    def leader(self) -> str | None:
        value = self.client.get(self.keys.leader())
        return str(value) if value else None
