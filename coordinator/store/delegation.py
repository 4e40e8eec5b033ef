"""Delegation: the todo list, committing a batch, writing children back, closing and stopping.

The delegation commit and todo updates are WATCH/MULTI transactions (validation
runs on the watched state, so a concurrent change retries it; a caller's parent is
marked `wait:children` by mark_timeline.lua queued inside the commit's MULTI, so the
timeline's fold stays in Lua alone); the write-back
of children, closing a batch and stopping a subtree are Lua scripts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import cast

import redis
from redis.client import Pipeline

from coordinator import todos as todo_lists
from coordinator.errors import ConflictError, FencedError, NotFoundError
from coordinator.ids import root_of
from coordinator.models import Batch, BatchRef, NewChildren, TaskRecord, TaskStatus, TodoItem
from coordinator.replies import BatchClosed, ChildSettled
from coordinator.store.base import (
    EVENTS_MAXLEN,
    Part,
    StoreCore,
    _encode_record,
    _str_map,
    _strs,
    outbox_keys,
    translate_redis_errors,
)
from coordinator.store.events import queue_live
from coordinator.store.fields import BatchField, TaskField
from coordinator.store.protocol import ApplyChildren, CloseBatch, MarkTimeline, SettleChild, StopTasks
from coordinator.store.records import RecordStore, decode_record, new_children
from coordinator.todo_links import Merged

__all__ = ["DelegationStore"]


class DelegationStore(Part):
    """Todo updates, delegation commits, batches and their write-back, subtree stops."""

    def __init__(self, core: StoreCore, records: RecordStore) -> None:
        super().__init__(core)
        self.records = records  # (a commit whose reply was lost reads its children back)

    # -- transactions ------------------------------------------------------------------

    @translate_redis_errors
    def update_todos(
        self, task_id: str, change: Callable[[TaskRecord, list[TodoItem]], Merged], *, token: str = ""
    ) -> list[TodoItem]:
        """Replace a task's todo list with `change(record, old).items`, atomically.

        The figures of the old rows that found no new row (`orphans`) move to the
        task's unlinked spend in the same transaction, so no child's cost leaves the
        plan. `change` may raise to refuse; then nothing is written. A run's own update
        passes its lease's `token`: `FencedError`, nothing written, once another run holds it.
        """
        root = root_of(task_id)
        task_key, todos_key = self.keys.task(root, task_id), self.keys.todos(root, task_id)

        def body(pipe: Pipeline) -> list[TodoItem]:
            record, old = self._read_watched(pipe, task_id, token)
            merged = change(record, old)
            pipe.multi()
            self.core.write_todos(pipe, todos_key, merged.items)
            if merged.orphans:
                pipe.hincrby(task_key, TaskField.UNLINKED_TOKENS, sum(o.tokens for o in merged.orphans))
                pipe.hincrby(task_key, TaskField.UNLINKED_COST_MICROS, sum(o.cost_micros for o in merged.orphans))
            pipe.hincrby(task_key, TaskField.TODOS_VERSION, 1)
            pipe.hset(task_key, TaskField.UPDATED_AT, time.time())
            pipe.execute()
            return merged.items

        return self.core.transaction([task_key, todos_key], body)

    @translate_redis_errors
    def commit_delegation(
        self,
        parent_id: str,
        batch_id: str,
        plan: Callable[[TaskRecord, list[TodoItem]], tuple[Batch, NewChildren, list[TodoItem]]],
        *,
        token: str = "",
    ) -> tuple[Batch, list[TaskRecord]]:
        """Commit a delegation in one transaction, or write nothing.

        `plan(parent, todos)` validates against the watched state and returns the
        batch (of id `batch_id`, new to this call), the children to make and the parent's new todo list; it
        raises to refuse. A run's delegation passes its lease's `token`: `FencedError`, nothing written,
        once another run holds it.

        A commit whose reply was lost after it ran (a connection that dropped during EXEC) is this call's, and
        answers as it would have: redis-py raises WatchError for a connection lost while watching, so the
        transaction runs again, on the state it wrote. Its batch is there then, and is read back; validated
        again, the parent (now `delegated`) would refuse it, and the committed batch would never be published.
        """
        root = root_of(parent_id)
        k = self.keys
        parent_key, todos_key, batch_key = k.task(root, parent_id), k.todos(root, parent_id), k.batch(root, batch_id)

        runs = 0

        def landed(reader: Pipeline | redis.Redis) -> bool:
            return bool(reader.exists(batch_key))  # the batch's id is new to this call: its commit made it

        def body(pipe: Pipeline) -> tuple[Batch, list[TaskRecord]] | None:
            nonlocal runs
            runs += 1
            # Run again (a conflict, or a lost reply): this call's commit may be in, to read back below. (Not
            # asked on the first run, which no batch of this new id can precede: a round trip every commit saved.)
            if runs > 1 and landed(pipe):
                return None
            parent, old_todos = self._read_watched(pipe, parent_id, token)
            batch, new, new_todos = plan(parent, old_todos)
            ancestors_raw, chain_raw = cast(
                list[str | None], pipe.hmget(parent_key, [TaskField.ANCESTORS, TaskField.BUDGET_CHAIN])
            )
            ancestors = [*json.loads(ancestors_raw or "[]"), parent_id]
            extra: dict[str, object] = {TaskField.ANCESTORS: ancestors, TaskField.BATCH_MODE: batch.mode}
            if chain_raw is not None or parent.depth == 0:  # else the parent's own chain is unknown
                budgeted = [*json.loads(chain_raw or "[]"), *([parent_id] if parent.budget_micros > 0 else [])]
                extra[TaskField.BUDGET_CHAIN] = budgeted
            # History numbers, taken once the plan is valid (in watch mode this runs now), so
            # each child's is written with it; a commit retried on a conflict leaves a gap.
            first = int(pipe.incrby(k.task_number(), len(new.own))) - len(new.own) + 1
            children, hashes = new_children(new, first, extra)
            now = time.time()
            pipe.multi()
            for child, mapping in zip(children, hashes, strict=True):
                child_key = k.task(root, child.id)
                pipe.hset(child_key, mapping=mapping)
                pipe.expire(child_key, self.retention_s)
            ids = [c.id for c in children]
            pipe.zadd(k.tree_tasks(root), {c.id: c.created_at for c in children})
            pipe.expire(k.tree_tasks(root), self.retention_s)
            pipe.rpush(k.children(root, parent_id), *ids)
            pipe.expire(k.children(root, parent_id), self.retention_s)
            pipe.sadd(k.awaiting(root, parent_id), *ids)
            pipe.expire(k.awaiting(root, parent_id), self.retention_s)
            batch_fields = _encode_record(batch.model_dump())
            pipe.hset(k.batch(root, batch.id), mapping=batch_fields)
            pipe.expire(k.batch(root, batch.id), self.retention_s)
            pipe.hset(k.batch_lines(root, batch.id), BatchField.LINES_OWNER, batch.id)
            pipe.expire(k.batch_lines(root, batch.id), self.retention_s)
            waiting: dict[str, object] = {
                TaskField.STATUS: TaskStatus.DELEGATED, TaskField.WAITING_BATCH_ID: batch.id, TaskField.UPDATED_AT: now,
            }  # fmt: skip
            pipe.hset(parent_key, mapping=_encode_record(waiting))
            if parent.runner == "caller":
                # A caller's task waits on its children from now; an agent's from its run's end (runs.py).
                # The mark is hashes.lua's fold, run by EXEC in this transaction: it is written in Lua alone.
                self.scripts.queue_in(pipe, MarkTimeline(task=parent_key, now=now, state="wait:children"))
            pipe.hincrby(parent_key, TaskField.TODOS_VERSION, 1)
            self.core.write_todos(pipe, todos_key, new_todos)
            pipe.xadd(
                k.events(root),
                {"type": "delegated", "task_id": parent_id, "batch_id": batch.id, "children": len(ids)},
                maxlen=EVENTS_MAXLEN,
                approximate=True,
            )
            # The children's live status, `queued`, with them: no state in which they exist without it.
            queue_live(pipe, k, self.retention_s, children, "queued")
            pipe.expire(k.events(root), self.retention_s)
            pipe.execute()
            return batch, children

        try:
            committed = self.core.transaction([parent_key, todos_key], body)
        except ConflictError:
            # The last attempt's reply may be what was lost (a WatchError, as a conflict's), after its EXEC ran.
            if not landed(self.client):
                raise
            committed = None
        if committed is None:
            batch = self.get_batch(batch_id)
            children = self.records.get_records(batch.child_ids)
        else:
            batch, children = committed
        self.core.index(children)
        return batch, children

    def _read_watched(self, pipe: Pipeline, task_id: str, token: str = "") -> tuple[TaskRecord, list[TodoItem]]:
        root = root_of(task_id)
        # A watching pipeline runs commands immediately, so these are replies.
        if token and pipe.get(self.keys.lease(root, task_id)) != token:
            # The run's lease is gone to a newer run of the task (or lapsed: the newer run may start any moment).
            # A newer run that starts after this read writes the watched task hash (start_run.lua), so the
            # transaction's EXEC fails, and this read, made again, refuses it.
            raise FencedError.of(task_id)
        raw = _str_map(pipe.hgetall(self.keys.task(root, task_id)))
        if not raw:
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        child_ids = _strs(pipe.lrange(self.keys.children(root, task_id), 0, -1))
        awaiting = set(_strs(pipe.smembers(self.keys.awaiting(root, task_id))))
        todos_raw = _str_map(pipe.hgetall(self.keys.todos(root, task_id)))
        record = decode_record(raw, child_ids, [c for c in child_ids if c in awaiting])
        return record, todo_lists.from_hash(todos_raw)

    # -- batches -----------------------------------------------------------------------

    @translate_redis_errors
    def get_batch(self, batch_id: str) -> Batch:
        raw = _str_map(self.client.hgetall(self.keys.batch(root_of(batch_id), batch_id)))
        if not raw:
            raise NotFoundError(f"Unknown batch: {batch_id}", field="batch_id")
        return Batch.model_validate(
            {
                **raw,
                BatchField.CHILD_IDS: json.loads(raw[BatchField.CHILD_IDS]),
                BatchField.FINISHED_AT: raw.get(BatchField.FINISHED_AT) or None,
            }
        )

    @translate_redis_errors
    def claim_batch_publish(self, batch_id: str) -> bool:
        """Once-only: True for the first caller that publishes this batch's work."""
        return self.core.claim_once(self.keys.batch(root_of(batch_id), batch_id), BatchField.PUBLISHED)

    @translate_redis_errors
    def unclaim_batch_publish(self, batch_id: str) -> None:
        """Its publish failed: the next publish of the batch may try again."""
        self.client.hdel(self.keys.batch(root_of(batch_id), batch_id), BatchField.PUBLISHED)

    @translate_redis_errors
    def batch_published(self, batch_id: str) -> bool:
        return bool(self.client.hexists(self.keys.batch(root_of(batch_id), batch_id), BatchField.PUBLISHED))

    @translate_redis_errors
    def apply_children(self, batch: Batch | BatchRef, child_ids: Sequence[str]) -> int:
        """Write ended children's figures onto the parent's todo items, each once per batch.

        One script call for all of them: the parent's todo list is decoded once.
        Children that have not ended are skipped. Returns how many were applied now.
        """
        if not child_ids:
            return 0
        root, k, parent = batch.root_id, self.keys, batch.parent_id
        return self.scripts(
            ApplyChildren(
                parent=k.task(root, parent), todos=k.todos(root, parent), awaiting=k.awaiting(root, parent),
                events=k.events(root), lines=k.batch_lines(root, batch.id),
                children=[k.task(root, c) for c in child_ids], now=time.time(), retention_s=self.retention_s,
                events_maxlen=EVENTS_MAXLEN, child_ids=child_ids,
            )
        )  # fmt: skip

    @translate_redis_errors
    def settle_child(self, batch_id: str, child: TaskRecord, resume_grace_s: float) -> ChildSettled:
        """Apply an ended child of a parallel batch and close the batch if it was the last (settle_child.lua).

        Returns the batch's mode, the parent's resume count when this call closed it (else 0),
        and whether the caller must publish the parent's resumed run. A sequential batch is
        left alone: its caller writes the chain back.
        """
        root, k, parent = child.root_id, self.keys, child.parent_id or child.id
        settled = self.scripts(
            SettleChild(
                parent=k.task(root, parent), todos=k.todos(root, parent), awaiting=k.awaiting(root, parent),
                events=k.events(root), lines=k.batch_lines(root, batch_id), child=k.task(root, child.id),
                batch=k.batch(root, batch_id), parent_ui=k.ui_messages(root, parent), due=k.due(), now=time.time(),
                retention_s=self.retention_s, events_maxlen=EVENTS_MAXLEN, child_id=child.id,
                resume_grace_s=resume_grace_s, mode="",
            )
        )  # fmt: skip
        if not settled.mode:
            raise NotFoundError(f"Unknown batch: {batch_id}", field="batch_id")
        return settled

    @translate_redis_errors
    def close_batch(self, batch: Batch | BatchRef, resume_grace_s: float) -> BatchClosed:
        """Close a batch once from its stored lines and set its parent active (close_batch.lua).

        Returns the parent's resume count when this call closed it (else 0), and whether the
        caller must publish the parent's resumed run, which is watched already.
        """
        root, k, parent = batch.root_id, self.keys, batch.parent_id
        return self.scripts(
            CloseBatch(
                batch=k.batch(root, batch.id), parent=k.task(root, parent), parent_ui=k.ui_messages(root, parent),
                awaiting=k.awaiting(root, parent), events=k.events(root), lines=k.batch_lines(root, batch.id),
                due=k.due(), todos=k.todos(root, parent), now=time.time(), retention_s=self.retention_s,
                events_maxlen=EVENTS_MAXLEN, resume_grace_s=resume_grace_s,
            )
        )  # fmt: skip

    # -- stopping a subtree ------------------------------------------------------------

    @translate_redis_errors
    def stop_tasks(
        self,
        task_ids: Sequence[str],
        *,
        top_status: str,
        status: str,
        top_error: str,
        error: str,
        top_class: str,
        error_class: str,
        watch_s: float | None = None,
    ) -> list[str]:
        """Stop the tasks that have not ended (the first is the subtree's top); returns those stopped. With
        `watch_s`, each one stopped now is on the due list in `watch_s` (unless it was on it already), in the
        same step: its caller writes it back and then takes it off, and dies between the two without loss."""
        if not task_ids:
            return []
        root = root_of(task_ids[0])
        now = time.time()
        stopped = self.scripts(
            StopTasks(
                events=self.keys.events(root), live=self.keys.live(root), outbox=outbox_keys(self.keys, root),
                due=self.keys.due(), tasks=[self.keys.task(root, t) for t in task_ids],
                top_status=top_status, status=status, top_error=top_error, error=error, top_class=top_class,
                error_class=error_class, now=now, retention_s=self.retention_s, events_maxlen=EVENTS_MAXLEN,
                due_at=0 if watch_s is None else now + watch_s,
            )
        )  # fmt: skip
        if stopped:
            # After the stop is persisted, so a watch that sees the count move reads the new
            # statuses. Outside the script: the counter is not of this tree's cluster slot. A
            # process that dies between the two leaves the runs to the watches' full look.
            self.client.incr(self.keys.stops())
        return stopped
