"""Task records and what hangs off them: fields, children, todos, messages, history."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

import redis
from redis.client import Pipeline

from coordinator import todos as todo_lists
from coordinator.errors import ConflictError, CorruptError, NotFoundError
from coordinator.ids import root_of
from coordinator.models import NewChildren, TaskRecord, TaskStatus, TodoItem
from coordinator.output_schema import compact
from coordinator.store.base import (
    HashMapping,
    Part,
    _decode_record,
    _encode_record,
    _str_map,
    _strs,
    translate_redis_errors,
)
from coordinator.store.fields import JSON_FIELDS, TaskField

__all__ = ["RecordStore", "decode_record", "new_children", "stored_fields"]


# What a record's dump holds that is not a field of its hash: the children and those awaited
# have keys of their own, `times` and `waiting_for` are read from the marks, the marks are written
# as text, tool calls only by the step that keeps each (record_tool.lua), and `tool_use` is read from
# the `tool:` counters that step keeps.
NOT_STORED: set[str] = {"child_ids", "awaiting_ids", "times", "waiting_for", "timeline", "tool_calls", "tool_use"}

# What a new record leaves out of its hash while it holds its default (0, '' or none): what its runs
# count and how it ended, which its steps write. A missing field reads as its default, in Python
# (store.fields: INT_FIELDS 0, OPTIONAL_FIELDS and JSON_FIELDS None, the others the model's default)
# and in Lua (each read has its `or '0'` or `or ''`). A record is written at its creation with half
# its fields then: half the server's work and memory a task (docs/benchmarks.md). Its subtree
# totals stay: their presence says "read the child" to a todo item's live figures (RecordStore.todos).
LEFT_UNSET: frozenset[str] = frozenset({
    TaskField.TOKENS_IN, TaskField.TOKENS_OUT, TaskField.CACHE_READS, TaskField.CACHE_WRITES, TaskField.COST_MICROS,
    TaskField.REQUESTS, TaskField.UNLINKED_TOKENS, TaskField.UNLINKED_COST_MICROS, TaskField.SUMMARY, TaskField.ERROR,
    TaskField.ERROR_CLASS, TaskField.ERROR_DETAIL, TaskField.COST_SOURCE, TaskField.COMPLETED_BY_CHILD_ID,
    TaskField.RETRIES, TaskField.TRANSIENT_ERRORS, TaskField.FINISHED_AT, TaskField.OUTPUT, TaskField.INVALID_OUTPUTS,
    TaskField.WAITING_BATCH_ID,
})  # fmt: skip


def stored_fields(record: TaskRecord) -> dict[str, Any]:
    """A new record's fields as its hash holds them (before `_encode_record`): the JSON fields as compact text,
    and none of LEFT_UNSET at its default."""
    return _as_stored(record.model_dump(exclude=NOT_STORED))


def _as_stored(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` (some or all of a record's) as its hash holds them: see `stored_fields`."""
    for name in JSON_FIELDS:
        if name in fields:
            fields[name] = "" if fields[name] is None else compact(fields[name])
    for name in LEFT_UNSET:
        if name in fields and fields[name] in (0, "", None):
            del fields[name]
    return fields


def new_children(
    new: NewChildren, first_number: int, extra: Mapping[str, object]
) -> tuple[list[TaskRecord], list[HashMapping]]:
    """A delegation's children (their history numbers from `first_number` on) and each one's hash as
    `stored_fields` makes it, with `extra` and its opening marks: what they share made and encoded once, each
    child's own fields (CHILD_OWN_FIELDS, none of them LEFT_UNSET) on top. tests/test_delegation_commit.py holds each
    hash to the one made from the child's record alone."""
    children = new.records(first_number)
    shared = _encode_record({**stored_fields(new.shared), **extra, TaskField.TIMELINE: opening_marks(new.shared)})
    # Each child's own fields encoded from the values its record was made of, not read back from it.
    hashes = [
        {**shared, **_encode_record(_as_stored({**values, "number": child.number}))}
        for child, values in zip(children, new.own, strict=True)
    ]
    return children, hashes


def decode_record(raw: dict[str, str], child_ids: list[str], awaiting_ids: list[str]) -> TaskRecord:
    """A task record from its hash: `_decode_record`, the JSON fields read back as their values first."""
    decoded: dict[str, Any] = dict(raw)
    for name in JSON_FIELDS:
        text = raw.get(name)
        try:
            decoded[name] = json.loads(text) if text else None
        except json.JSONDecodeError:
            raise CorruptError(f"Task record {raw.get(TaskField.ID, '?')} is corrupt: {name} is not JSON") from None
    return _decode_record(cast(dict[str, str], decoded), child_ids, awaiting_ids)


def opening_marks(record: TaskRecord) -> str:
    """A new task's timeline as stored: the record opened it at its creation (TaskRecord's validator)."""
    return record.timeline.text()


class RecordStore(Part):
    """Reads and plain writes of task records, their todo lists, messages and the history indexes."""

    # -- one task ----------------------------------------------------------------------

    @translate_redis_errors
    def task_fields(self, task_id: str) -> dict[str, str]:
        """The raw hash of a task; NotFoundError when there is none."""
        raw = _str_map(self.client.hgetall(self.keys.task(root_of(task_id), task_id)))
        if not raw:
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        return raw

    @translate_redis_errors
    def get_task(self, task_id: str) -> TaskRecord:
        raw = self.task_fields(task_id)
        root = root_of(task_id)
        child_ids = _strs(self.client.lrange(self.keys.children(root, task_id), 0, -1))
        awaiting = set(_strs(self.client.smembers(self.keys.awaiting(root, task_id))))
        return decode_record(raw, child_ids, [c for c in child_ids if c in awaiting])

    def ancestors(self, task_id: str) -> list[str]:
        """The task's ancestors, root first."""
        return list(json.loads(self.task_field(task_id, TaskField.ANCESTORS) or "[]"))

    @translate_redis_errors
    def status_of(self, task_id: str) -> tuple[str, str]:
        """(status, runner) of a task in one small read; NotFoundError when there is none."""
        status, runner = self.client.hmget(
            self.keys.task(root_of(task_id), task_id), [TaskField.STATUS, TaskField.RUNNER]
        )
        if status is None:
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        return str(status), str(runner or "caller")

    @translate_redis_errors
    def owner_of(self, task_id: str) -> str:
        """The API key that created the task's tree ('' for none); NotFoundError when there is no such task."""
        status, owner = self.client.hmget(
            self.keys.task(root_of(task_id), task_id), [TaskField.STATUS, TaskField.OWNER]
        )
        if status is None:
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        return str(owner or "")

    @translate_redis_errors
    def stops_so_far(self) -> int:
        """How many stops (`stop_tasks` calls that stopped a task) have been made: it moves when one is."""
        return int(self.client.get(self.keys.stops()) or 0)

    @translate_redis_errors
    def statuses_of(self, task_ids: Sequence[str]) -> list[str | None]:
        """Each task's status (None for an unknown task), in one round trip however many."""
        with self.client.pipeline(transaction=False) as pipe:
            for task_id in task_ids:
                pipe.hget(self.keys.task(root_of(task_id), task_id), TaskField.STATUS)
            return [None if s is None else str(s) for s in pipe.execute()]

    @translate_redis_errors
    def submission_batch(self, task_id: str) -> str | None:
        """The batch a submission's root waits on (`ends_with_batch`, still `delegated`); None for any other task.
        One small read (writeback.end_submission)."""
        ends, status, batch_id = self.client.hmget(
            self.keys.task(root_of(task_id), task_id),
            [TaskField.ENDS_WITH_BATCH, TaskField.STATUS, TaskField.WAITING_BATCH_ID],
        )
        return str(batch_id) if ends == "1" and status == TaskStatus.DELEGATED and batch_id else None

    @translate_redis_errors
    def task_field(self, task_id: str, name: str) -> str | None:
        return cast(str | None, self.client.hget(self.keys.task(root_of(task_id), task_id), name))

    @translate_redis_errors
    def get_todos(self, task_id: str, *, live: bool = False) -> list[TodoItem]:
        """The stored list; with `live`, linked items carry their child's current subtree figures."""
        self.task_fields(task_id)
        root = root_of(task_id)
        items = todo_lists.from_hash(_str_map(self.client.hgetall(self.keys.todos(root, task_id))))
        linked = [i for i in items if i.subtask_id]
        if not live or not linked:
            return items
        with self.client.pipeline(transaction=False) as pipe:
            for item in linked:
                pipe.hmget(
                    self.keys.task(root, str(item.subtask_id)), [TaskField.TOTAL_TOKENS, TaskField.TOTAL_COST_MICROS]
                )
            figures = dict(zip((i.subtask_id for i in linked), pipe.execute(), strict=True))
        out = []
        for item in items:
            tokens, cost = figures.get(item.subtask_id, (None, None))
            if tokens is not None:  # the child's record is the system of record
                shown = {
                    "tokens": item.prior_tokens + int(tokens),
                    "cost_micros": item.prior_cost_micros + int(cost or 0),
                }
                item = item.model_copy(update=shown)
            out.append(item)
        return out

    # -- several tasks -----------------------------------------------------------------

    @translate_redis_errors
    def get_records(self, task_ids: Sequence[str], *, whole: bool = False) -> list[TaskRecord]:
        """Several task records in one round trip: without their child lists (write-back, summaries), or
        `whole`, with them (a page of a 1,000-child tree read each child alone, three reads each)."""
        with self.client.pipeline(transaction=False) as pipe:
            for task_id in task_ids:
                root = root_of(task_id)
                pipe.hgetall(self.keys.task(root, task_id))
                if whole:
                    pipe.lrange(self.keys.children(root, task_id), 0, -1)
                    pipe.smembers(self.keys.awaiting(root, task_id))
            replies = pipe.execute()
        per_task = 3 if whole else 1
        records = []
        for n, task_id in enumerate(task_ids):
            raw, *lists = replies[per_task * n : per_task * (n + 1)]
            if not raw:
                raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
            child_ids, awaiting = (_strs(lists[0]), set(_strs(lists[1]))) if whole else ([], set())
            records.append(decode_record(_str_map(raw), child_ids, [c for c in child_ids if c in awaiting]))
        return records

    @translate_redis_errors
    def get_children(self, task_id: str) -> list[TaskRecord]:
        """The task's children in creation order, each whole (with its own children), in one round trip."""
        self.task_fields(task_id)
        return self.get_records(
            _strs(self.client.lrange(self.keys.children(root_of(task_id), task_id), 0, -1)), whole=True
        )

    @translate_redis_errors
    def subtree_ids(self, task_id: str) -> list[str]:
        """The task and all its descendants, top first (breadth first)."""
        root = root_of(task_id)
        out, frontier = [task_id], [task_id]
        while frontier:
            with self.client.pipeline(transaction=False) as pipe:
                for tid in frontier:
                    pipe.lrange(self.keys.children(root, tid), 0, -1)
                frontier = [child for reply in pipe.execute() for child in _strs(reply)]
            out.extend(frontier)
        return out

    @translate_redis_errors
    def finishing(self, task_ids: Sequence[str], lapse_s: float) -> list[str]:
        """Those of `task_ids` whose run may still record spend: it holds its lease, or a step refused its
        spend (its task was stopped) and it has not recorded that yet, within a heartbeat lapse by the server's
        clock (a run that died before it did records nothing). One round trip however many."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.time()
            for task_id in task_ids:
                root = root_of(task_id)
                pipe.exists(self.keys.lease(root, task_id))
                pipe.hget(self.keys.task(root, task_id), TaskField.LATE_SPEND_AT)
            (now_s, _), *replies = pipe.execute()
        out = []
        for task_id, leased, late in zip(task_ids, replies[::2], replies[1::2], strict=True):
            if leased or (late and now_s - int(late) < lapse_s):
                out.append(task_id)
        return out

    @translate_redis_errors
    def tree_task_ids(self, root_id: str) -> list[str]:
        return _strs(self.client.zrange(self.keys.tree_tasks(root_id), 0, -1))

    @translate_redis_errors
    def recent_task_ids(self, *, root_id: str | None, offset: int, count: int) -> list[str]:
        """Task ids, newest first (all tasks, or one tree's)."""
        key = self.keys.tree_tasks(root_id) if root_id else self.keys.all_tasks()
        return _strs(self.client.zrevrange(key, offset, offset + count - 1))

    # -- creation and history numbers --------------------------------------------------

    @translate_redis_errors
    def create_root(
        self,
        record: TaskRecord,
        todos: Sequence[TodoItem],
        hooks: Mapping[str, str] | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> bool:
        """Write a new root, or nothing when a task of that id exists (an idempotent retry); True if written
        (by this call: one whose reply was lost after it wrote is True too, known by the record's history number).

        `hooks` is the tree's subscriptions hash (store.outbox.hooks_mapping), written in the same MULTI: no
        event of the tree can be caused before its subscriptions exist."""
        root = record.root_id
        task_key, todos_key = self.keys.task(root, record.id), self.keys.todos(root, record.id)
        fields = _encode_record(
            {
                **stored_fields(record),
                TaskField.ANCESTORS: [],
                TaskField.TIMELINE: opening_marks(record),
                **(extra or {}),
            }
        )

        def landed(reader: Pipeline | redis.Redis) -> bool:
            return reader.hget(task_key, TaskField.NUMBER) == str(record.number)

        def body(pipe: Pipeline) -> bool:
            if pipe.exists(task_key):
                # Written by this very call when its history number is there: its reply was lost after it ran
                # (redis-py raises WatchError for a connection lost while watching, and the body runs again).
                # Its caller then indexes and publishes the root as it would have (said not written, the root
                # stayed out of the history for good, and its run waited on the reconciler).
                return landed(pipe)
            pipe.multi()
            pipe.hset(task_key, mapping={**fields, TaskField.TODOS_VERSION: 0})
            pipe.expire(task_key, self.retention_s)
            self.core.write_todos(pipe, todos_key, todos)
            pipe.zadd(self.keys.tree_tasks(root), {record.id: record.created_at})
            pipe.expire(self.keys.tree_tasks(root), self.retention_s)
            if hooks:
                pipe.hset(self.keys.hooks(root), mapping=cast(HashMapping, dict(hooks)))
                pipe.expire(self.keys.hooks(root), self.retention_s)
            pipe.execute()
            return True

        try:
            written = self.core.transaction([task_key], body)
        except ConflictError:
            # The last attempt's reply may be what was lost (a WatchError, as a conflict's), after its EXEC ran.
            if not landed(self.client):
                raise
            written = True
        if not written:
            return False
        self.core.index([record], root=True)
        return True

    @translate_redis_errors
    def task_exists(self, task_id: str) -> bool:
        return bool(self.client.exists(self.keys.task(root_of(task_id), task_id)))

    @translate_redis_errors
    def claim_idempotency(self, key: str, root_id: str) -> str:
        """The root id the key names: `root_id` if this call is the key's first, else the first one's."""
        name = self.keys.idempotency(hashlib.sha256(key.encode()).hexdigest())
        with self.client.pipeline(transaction=True) as pipe:
            pipe.set(name, root_id, nx=True, ex=self.retention_s)
            pipe.get(name)
            _, owner = pipe.execute()
        return str(owner)

    @translate_redis_errors
    def release_idempotency(self, key: str, root_id: str, counted_in: str) -> bool:
        """Take back this call's claim of `key` for `root_id`, whose submit was refused: unless a duplicate of
        the same submit got the root counted meanwhile (`root_id` in the sorted set `counted_in`, the
        tenant's submits). Whether the claim was taken back."""
        name = self.keys.idempotency(hashlib.sha256(key.encode()).hexdigest())

        def release(pipe: Pipeline) -> bool:
            if pipe.get(name) != root_id or pipe.zscore(counted_in, root_id) is not None:
                return False
            pipe.multi()
            pipe.delete(name)
            pipe.execute()
            return True

        return self.core.transaction([name, counted_in], release)

    @translate_redis_errors
    def next_numbers(self, count: int) -> int:
        """Reserve `count` history numbers; returns the first."""
        return int(self.client.incrby(self.keys.task_number(), count)) - count + 1

    # -- messages and conversation -----------------------------------------------------

    @translate_redis_errors
    def ui_messages(self, task_id: str) -> list[dict[str, Any]]:
        self.task_fields(task_id)
        entries = self.client.lrange(self.keys.ui_messages(root_of(task_id), task_id), 0, -1)
        messages = []
        for index, entry in enumerate(entries):
            try:
                messages.append(json.loads(entry))
            except json.JSONDecodeError:
                raise CorruptError(f"UI message {index} of task {task_id} is corrupt") from None
        return messages

    @translate_redis_errors
    def conversation(self, task_id: str) -> list[str]:
        """The task's model conversation, one JSON entry per message."""
        return _strs(self.client.lrange(self.keys.conversation(root_of(task_id), task_id), 0, -1))
