"""The Redis store: every read and write of subq state, and the Lua scripts.

Each read-modify-write of shared state is atomic: the delegation commit and
todo updates are WATCH/MULTI transactions (validation runs on the watched
state, so a concurrent change retries it); usage roll-up, the write-back of a
child, and status transitions are Lua scripts from `coordinator/lua/`, loaded
once and registered once per client. Redis errors are translated here into
`StoreError`, in one place.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, ParamSpec, TypeVar, cast

import redis
from redis.client import Pipeline
from redis.typing import EncodableT, FieldT

from coordinator import todos as todo_lists
from coordinator.errors import ConflictError, CorruptError, NotFoundError, StoreError
from coordinator.ids import root_of
from coordinator.keys import Keys
from coordinator.models import Approval, Batch, BatchRef, TaskRecord, TodoItem, Usage

__all__ = ["EVENTS_MAXLEN", "Store", "translate_redis_errors"]

# Enough history for a live view to catch up after a short disconnect, small
# enough that a busy tree's stream stays a few MB (XADD MAXLEN ~).
EVENTS_MAXLEN = 10_000
# A transaction whose watched keys keep changing is retried this often before
# the caller is told; each retry re-validates on fresh state.
MAX_TRANSACTION_ATTEMPTS = 50
# How far down the admission list one freed slot looks for a task that now fits.
ADMISSION_SCAN = 50
# Model request latency buckets (ms), Prometheus-style cumulative: from a cached
# reply to a long reasoning call.
LATENCY_BUCKETS_MS = (100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

_INT_FIELDS = (
    "depth", "tokens_in", "tokens_out", "cache_reads", "cache_writes", "cost_micros",
    "requests", "total_tokens", "total_cost_micros", "number", "budget_micros",
)  # fmt: skip
_OPTIONAL_FIELDS = ("parent_id", "todo_id", "batch_id", "waiting_batch_id", "finished_at", "completed_by_child_id")


def translate_redis_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn redis-py exceptions into StoreError with a message a user can act on."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreError(f"Redis is unreachable: {exc}") from exc
        except redis.ResponseError as exc:
            raise StoreError(f"Redis refused a subq command: {exc}") from exc

    return wrapper


# The client is built with decode_responses=True, so Redis replies are str; redis-py
# types them as bytes | str, and these casts say so once, at the boundary.
def _strs(reply: Any) -> list[str]:
    return cast(list[str], reply)


def _str_map(reply: Any) -> dict[str, str]:
    return cast(dict[str, str], reply)


def _load_script(name: str) -> str:
    return resources.files("coordinator").joinpath("lua", name).read_text(encoding="utf-8")


HashFields = dict[FieldT, EncodableT]
ScriptArg = str | int | float


def _encode_record(fields: dict[str, Any]) -> HashFields:
    """A task record as hash fields: None becomes '' and lists become JSON."""
    out: HashFields = {}
    for name, value in fields.items():
        if value is None:
            out[name] = ""
        elif isinstance(value, (list, dict)):
            out[name] = json.dumps(value)
        elif isinstance(value, bool):
            out[name] = int(value)
        else:
            out[name] = value
    return out


class Store:
    """subq state in Redis, for one key prefix."""

    def __init__(self, client: redis.Redis, keys: Keys, retention_s: int) -> None:
        self.client = client
        self.keys = keys
        self.retention_s = retention_s
        self._record_usage = client.register_script(_load_script("record_usage.lua"))
        self._finish_task = client.register_script(_load_script("finish_task.lua"))
        self._apply_children = client.register_script(_load_script("apply_children.lua"))
        self._finish_batch = client.register_script(_load_script("finish_batch.lua"))
        self._stop_tasks = client.register_script(_load_script("stop_tasks.lua"))
        self._admit = client.register_script(_load_script("admit.lua"))
        self._release_slot = client.register_script(_load_script("release_slot.lua"))
        self._rate_limit = client.register_script(_load_script("rate_limit.lua"))
        self._decide = client.register_script(_load_script("decide.lua"))
        self._release_lease = client.register_script(_load_script("release_lease.lua"))

    # -- reads -------------------------------------------------------------------------

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
        return _decode_record(raw, child_ids, [c for c in child_ids if c in awaiting])

    def ancestors(self, task_id: str) -> list[str]:
        """The task's ancestors, root first."""
        return list(json.loads(self.task_field(task_id, "ancestors") or "[]"))

    @translate_redis_errors
    def status_of(self, task_id: str) -> tuple[str, str]:
        """(status, runner) of a task in one small read; NotFoundError when there is none."""
        status, runner = self.client.hmget(self.keys.task(root_of(task_id), task_id), ["status", "runner"])
        if status is None:
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        return str(status), str(runner or "caller")

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
                pipe.hmget(self.keys.task(root, str(item.subtask_id)), ["total_tokens", "total_cost_micros"])
            figures = dict(zip((i.subtask_id for i in linked), pipe.execute(), strict=True))
        out = []
        for item in items:
            tokens, cost = figures.get(item.subtask_id, (None, None))
            if tokens is not None:  # the child's record is the system of record
                item = item.model_copy(update={"tokens": int(tokens), "cost_micros": int(cost or 0)})
            out.append(item)
        return out

    @translate_redis_errors
    def get_records(self, task_ids: Sequence[str]) -> list[TaskRecord]:
        """Several task records in one round trip, without their child lists (write-back, summaries)."""
        with self.client.pipeline(transaction=False) as pipe:
            for task_id in task_ids:
                pipe.hgetall(self.keys.task(root_of(task_id), task_id))
            replies = pipe.execute()
        records = []
        for task_id, raw in zip(task_ids, replies, strict=True):
            if not raw:
                raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
            records.append(_decode_record(_str_map(raw), [], []))
        return records

    @translate_redis_errors
    def get_children(self, task_id: str) -> list[TaskRecord]:
        root = root_of(task_id)
        self.task_fields(task_id)
        return [self.get_task(c) for c in _strs(self.client.lrange(self.keys.children(root, task_id), 0, -1))]

    @translate_redis_errors
    def batch_head(self, batch_id: str) -> tuple[str, str, str]:
        """(mode, status, parent_id) of a batch, without its list of children (the hot path)."""
        mode, status, parent_id = self.client.hmget(
            self.keys.batch(root_of(batch_id), batch_id), ["mode", "status", "parent_id"]
        )
        if mode is None:
            raise NotFoundError(f"Unknown batch: {batch_id}", field="batch_id")
        return str(mode), str(status), str(parent_id)

    @translate_redis_errors
    def get_batch(self, batch_id: str) -> Batch:
        raw = _str_map(self.client.hgetall(self.keys.batch(root_of(batch_id), batch_id)))
        if not raw:
            raise NotFoundError(f"Unknown batch: {batch_id}", field="batch_id")
        return Batch.model_validate(
            {**raw, "child_ids": json.loads(raw["child_ids"]), "finished_at": raw.get("finished_at") or None}
        )

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
    def last_event_id(self, root_id: str) -> str:
        newest: Any = self.client.xrevrange(self.keys.events(root_id), count=1)
        return str(newest[0][0]) if newest else "0-0"

    @translate_redis_errors
    def wait_for_event(self, root_id: str, after_id: str, block_ms: int) -> str:
        """Block until the tree's stream has an entry after `after_id`; returns the newest id seen."""
        reply: Any = self.client.xread({self.keys.events(root_id): after_id}, block=block_ms)
        if not reply:
            return after_id
        return str(reply[0][1][-1][0])

    @translate_redis_errors
    def read_events(
        self, root_id: str, after_id: str = "0-0", *, block_ms: int | None = None, count: int = 500
    ) -> list[tuple[str, dict[str, str]]]:
        """Entries of the tree's event stream after `after_id` (blocking up to block_ms if none)."""
        reply: Any = self.client.xread({self.keys.events(root_id): after_id}, count=count, block=block_ms)
        if not reply:
            return []
        return [(str(entry_id), _str_map(fields)) for entry_id, fields in reply[0][1]]

    @translate_redis_errors
    def observe_latency(self, latency_ms: float) -> None:
        """Count one model request's latency in the fleet-wide histogram (Prometheus buckets)."""
        key = self.keys.latency_histogram()
        with self.client.pipeline(transaction=False) as pipe:
            for bound in LATENCY_BUCKETS_MS:
                if latency_ms <= bound:
                    pipe.hincrby(key, f"le_{bound}", 1)
            pipe.hincrby(key, "count", 1)
            pipe.hincrbyfloat(key, "sum_ms", latency_ms)
            pipe.execute()

    @translate_redis_errors
    def latency_histogram(self) -> dict[str, float]:
        """{'le_<ms>': cumulative count, 'count': n, 'sum_ms': total} of model request latency."""
        return {k: float(v) for k, v in _str_map(self.client.hgetall(self.keys.latency_histogram())).items()}

    @translate_redis_errors
    def snapshot(self) -> dict[str, object]:
        """Every key of this prefix with its value, compared by content (tests: 'nothing changed').

        Not DUMP: a set's serialised order can change on rehashing without any write.
        """
        read: dict[str, Callable[[str], object]] = {
            "string": self.client.get,
            "hash": self.client.hgetall,
            "list": lambda key: self.client.lrange(key, 0, -1),
            "set": lambda key: sorted(_strs(self.client.smembers(key))),
            "zset": lambda key: self.client.zrange(key, 0, -1, withscores=True),
            "stream": lambda key: self.client.xrange(key),
        }
        return {
            key: (kind, read[kind](key))
            for key in self.client.scan_iter(self.keys.all_pattern(), count=1000)
            if (kind := str(self.client.type(key))) in read
        }

    # -- writes ------------------------------------------------------------------------

    @translate_redis_errors
    def next_numbers(self, count: int) -> int:
        """Reserve `count` history numbers; returns the first."""
        return int(self.client.incrby(self.keys.task_number(), count)) - count + 1

    @translate_redis_errors
    def set_numbers(self, numbers: dict[str, int]) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            for task_id, number in numbers.items():
                pipe.hset(self.keys.task(root_of(task_id), task_id), "number", number)
            pipe.execute()

    @translate_redis_errors
    def create_root(self, record: TaskRecord, todos: Sequence[TodoItem]) -> None:
        root = record.root_id
        task_key, todos_key = self.keys.task(root, record.id), self.keys.todos(root, record.id)
        fields = _encode_record({**record.model_dump(exclude={"child_ids", "awaiting_ids"}), "ancestors": []})
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(task_key, mapping={**fields, "todos_version": 0})
            pipe.expire(task_key, self.retention_s)
            self._write_todos(pipe, todos_key, todos)
            pipe.zadd(self.keys.tree_tasks(root), {record.id: record.created_at})
            pipe.expire(self.keys.tree_tasks(root), self.retention_s)
            pipe.execute()
        self._index([record], root=True)

    def _index(self, records: Sequence[TaskRecord], *, root: bool = False) -> None:
        """The history indexes, outside any tree's slot, so written apart from the tree's commit."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(self.keys.all_tasks(), {r.id: r.created_at for r in records})
            if root:
                pipe.zadd(self.keys.roots(), {r.id: r.created_at for r in records})
            cutoff = time.time() - self.retention_s
            pipe.zremrangebyscore(self.keys.all_tasks(), "-inf", cutoff)
            pipe.zremrangebyscore(self.keys.roots(), "-inf", cutoff)
            pipe.execute()

    @translate_redis_errors
    def update_todos(
        self, task_id: str, change: Callable[[TaskRecord, list[TodoItem]], list[TodoItem]]
    ) -> list[TodoItem]:
        """Replace a task's todo list with `change(record, old)`, atomically.

        `change` may raise to refuse; then nothing is written.
        """
        root = root_of(task_id)
        task_key, todos_key = self.keys.task(root, task_id), self.keys.todos(root, task_id)

        def body(pipe: Pipeline) -> list[TodoItem]:
            record, old = self._read_watched(pipe, task_id)
            new = change(record, old)
            pipe.multi()
            self._write_todos(pipe, todos_key, new)
            pipe.hincrby(task_key, "todos_version", 1)
            pipe.hset(task_key, "updated_at", time.time())
            pipe.execute()
            return new

        return self._transaction([task_key, todos_key], body)

    @translate_redis_errors
    def commit_delegation(
        self,
        parent_id: str,
        plan: Callable[[TaskRecord, list[TodoItem]], tuple[Batch, list[TaskRecord], list[TodoItem]]],
    ) -> tuple[Batch, list[TaskRecord]]:
        """Commit a delegation in one transaction, or write nothing.

        `plan(parent, todos)` validates against the watched state and returns the
        batch, the child records and the parent's new todo list; it raises to refuse.
        """
        root = root_of(parent_id)
        k = self.keys
        parent_key, todos_key = k.task(root, parent_id), k.todos(root, parent_id)

        def body(pipe: Pipeline) -> tuple[Batch, list[TaskRecord]]:
            parent, old_todos = self._read_watched(pipe, parent_id)
            batch, children, new_todos = plan(parent, old_todos)
            ancestors = [*json.loads(cast(str | None, pipe.hget(parent_key, "ancestors")) or "[]"), parent_id]
            now = time.time()
            pipe.multi()
            for child in children:
                child_key = k.task(root, child.id)
                fields = child.model_dump(exclude={"child_ids", "awaiting_ids"})
                pipe.hset(child_key, mapping=_encode_record({**fields, "ancestors": ancestors}))
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
            pipe.hset(parent_key, mapping={"status": "delegated", "waiting_batch_id": batch.id, "updated_at": now})
            pipe.hincrby(parent_key, "todos_version", 1)
            self._write_todos(pipe, todos_key, new_todos)
            pipe.xadd(
                k.events(root),
                {"type": "delegated", "task_id": parent_id, "batch_id": batch.id, "children": len(ids)},
                maxlen=EVENTS_MAXLEN,
                approximate=True,
            )
            pipe.expire(k.events(root), self.retention_s)
            pipe.execute()
            return batch, children

        batch, children = self._transaction([parent_key, todos_key], body)
        self._index(children)
        return batch, children

    @translate_redis_errors
    def start_run(self, task_id: str) -> tuple[int, int]:
        """Count a run starting: (deliveries of this run so far, runs of the task ever).

        Deliveries reset when the task is resumed, so SUBQ_MAX_DELIVERIES bounds the
        redeliveries of one run; the run sequence keeps request keys unique forever.
        """
        key = self.keys.task(root_of(task_id), task_id)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "deliveries", 1)
            pipe.hincrby(key, "run_seq", 1)
            deliveries, run_seq = pipe.execute()
        return int(deliveries), int(run_seq)

    @translate_redis_errors
    def task_field(self, task_id: str, name: str) -> str | None:
        return cast(str | None, self.client.hget(self.keys.task(root_of(task_id), task_id), name))

    @translate_redis_errors
    def acquire_lease(self, task_id: str, token: str, ttl_s: int) -> bool:
        """Take the task's run lease: no two deliveries run one task at once."""
        return bool(self.client.set(self.keys.lease(root_of(task_id), task_id), token, nx=True, ex=ttl_s))

    @translate_redis_errors
    def release_lease(self, task_id: str, token: str) -> None:
        self._release_lease(keys=[self.keys.lease(root_of(task_id), task_id)], args=[token])

    @translate_redis_errors
    def claim(self, task_id: str, flag: str) -> bool:
        """Set a once-only flag on a task (e.g. `published`); True for the first caller."""
        return bool(self.client.hsetnx(self.keys.task(root_of(task_id), task_id), flag, 1))

    @translate_redis_errors
    def claim_resume(self, task_id: str, reason_id: str) -> bool:
        """Once-only guard for resuming a task for one reason (a batch or an approval)."""
        key = self.keys.task(root_of(task_id), task_id)
        return bool(self.client.hsetnx(key, f"resumed:{reason_id}", 1))

    @translate_redis_errors
    def next_resume(self, task_id: str) -> int:
        return int(self.client.hincrby(self.keys.task(root_of(task_id), task_id), "resumes", 1))

    @translate_redis_errors
    def set_fields(self, task_id: str, fields: dict[str, str | int | float]) -> None:
        self.client.hset(self.keys.task(root_of(task_id), task_id), mapping=cast(HashFields, fields))

    @translate_redis_errors
    def count(self, task_id: str, field: str, by: int = 1) -> int:
        return int(self.client.hincrby(self.keys.task(root_of(task_id), task_id), field, by))

    @translate_redis_errors
    def claim_batch(self, batch_id: str, flag: str) -> bool:
        return bool(self.client.hsetnx(self.keys.batch(root_of(batch_id), batch_id), flag, 1))

    @translate_redis_errors
    def record_usage(
        self,
        task_id: str,
        request_key: str,
        usage: Usage,
        cost_micros: int,
        cost_source: str,
        ancestors: Sequence[str] | None = None,
    ) -> tuple[int, str | None]:
        """Record one request's usage on the task and roll it up the ancestors, once per key.

        Returns (recorded, exhausted): recorded is 1, 0 (a repeat of this key) or -1 (the
        task had ended: nothing is recorded after a stop); exhausted is the id of the
        task nearest the root whose budget the subtree has now reached, or None.
        `ancestors` (root first) may be passed by a caller that has the record, to save a read.
        """
        root = root_of(task_id)
        if ancestors is None:
            ancestors = self.ancestors(task_id)
        keys = [self.keys.task(root, task_id), self.keys.usage_applied(root, task_id)]
        keys += [self.keys.task(root, a) for a in reversed(ancestors)]
        args: list[ScriptArg] = [
            request_key, usage.tokens_in, usage.tokens_out, usage.cache_reads, usage.cache_writes,
            cost_micros, cost_source, time.time(), self.retention_s,
        ]  # fmt: skip
        recorded, exhausted = self._record_usage(keys=keys, args=args)
        return int(recorded), (str(exhausted) or None)

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
    ) -> list[str]:
        """Stop the tasks that have not ended (the first is the subtree's top); returns those stopped."""
        if not task_ids:
            return []
        root = root_of(task_ids[0])
        keys = [self.keys.events(root), self.keys.live(root), *(self.keys.task(root, t) for t in task_ids)]
        args: list[ScriptArg] = [
            top_status, status, top_error, error, top_class, error_class, time.time(), self.retention_s, EVENTS_MAXLEN,
        ]  # fmt: skip
        return _strs(self._stop_tasks(keys=keys, args=args))

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
    def set_live(self, record: TaskRecord, state: str, **fields: object) -> None:
        """Publish a task's live status: the tree's live hash and an event on its stream."""
        root = record.root_id
        live = {
            "task_id": record.id, "parent_id": record.parent_id, "depth": record.depth, "state": state,
            "ts": time.time(), **fields,
        }  # fmt: skip
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.live(root), record.id, json.dumps(live))
            pipe.expire(self.keys.live(root), self.retention_s)
            pipe.xadd(
                self.keys.events(root),
                {"type": "live", "task_id": record.id, "state": state},
                maxlen=EVENTS_MAXLEN,
                approximate=True,
            )
            pipe.execute()

    @translate_redis_errors
    def live(self, root_id: str) -> dict[str, dict[str, Any]]:
        """task id -> its live status JSON, for every task of the tree that has one."""
        raw = _str_map(self.client.hgetall(self.keys.live(root_id)))
        return {task_id: json.loads(value) for task_id, value in raw.items()}

    @translate_redis_errors
    def awaiting_count(self, task_id: str) -> int:
        return int(self.client.scard(self.keys.awaiting(root_of(task_id), task_id)))

    @translate_redis_errors
    def budget_exhausted(self, task_id: str, ancestors: Sequence[str]) -> str | None:
        """The task or ancestor nearest the root whose budget its subtree has reached, if any."""
        root = root_of(task_id)
        chain = [task_id, *reversed(ancestors)]
        with self.client.pipeline(transaction=False) as pipe:
            for tid in chain:
                pipe.hmget(self.keys.task(root, tid), ["budget_micros", "total_cost_micros"])
            replies = pipe.execute()
        found = None
        for tid, (budget, total) in zip(chain, replies, strict=True):
            if int(budget or 0) > 0 and int(total or 0) >= int(budget):
                found = tid
        return found

    @translate_redis_errors
    def admit(self, record: TaskRecord, per_parent: int, per_tree: int, stagger_ms: int) -> tuple[str, int]:
        """('run', 0), ('wait', 0) (queued for a slot) or ('delay', ms) for this task's run."""
        root, k = record.root_id, self.keys
        keys = [
            k.running(root), k.running_children(root, record.parent_id or record.id), k.admission(root),
            k.last_start(root),
        ]  # fmt: skip
        args: list[ScriptArg] = [record.id, per_parent, per_tree, stagger_ms, int(time.time() * 1000), self.retention_s]
        verdict, delay_ms = self._admit(keys=keys, args=args)
        return str(verdict), int(delay_ms)

    @translate_redis_errors
    def release_slot(self, record: TaskRecord, per_parent: int, per_tree: int) -> list[str]:
        """Free the task's run slot and admit waiting tasks that now fit; returns the admitted ids."""
        root, k = record.root_id, self.keys
        waiting = _strs(self.client.lrange(k.admission(root), 0, ADMISSION_SCAN - 1))
        parents = [w.parent_id or w.id for w in self.get_records(waiting)] if waiting else []
        keys = [
            k.running(root), k.admission(root), k.running_children(root, record.parent_id or record.id),
            *(k.running_children(root, p) for p in parents),
        ]  # fmt: skip
        args: list[ScriptArg] = [record.id, per_parent, per_tree, self.retention_s, *waiting]
        return _strs(self._release_slot(keys=keys, args=args))

    @translate_redis_errors
    def in_flight(self, root_id: str) -> dict[str, int]:
        """Sizes of the tree's in-flight structures (empty once every run has ended)."""
        k = self.keys
        with self.client.pipeline(transaction=False) as pipe:
            pipe.scard(k.running(root_id))
            pipe.llen(k.admission(root_id))
            for task_id in self.tree_task_ids(root_id):
                pipe.scard(k.awaiting(root_id, task_id))
                pipe.exists(k.lease(root_id, task_id))
            running, admission, *rest = pipe.execute()
        return {"running": int(running), "admission": int(admission), "awaiting": sum(rest[0::2]),
                "leases": sum(rest[1::2])}  # fmt: skip

    @translate_redis_errors
    def wait_for_rate(self, provider: str, rpm: int) -> int:
        """0 when a request to `provider` may start now (and is counted), else the ms to wait."""
        member = f"{time.time_ns()}-{os.getpid()}-{threading.get_ident()}"
        return int(self._rate_limit(keys=[self.keys.rate(provider)], args=[rpm, int(time.time() * 1000), member]))

    @translate_redis_errors
    def save_approval(self, approval: Approval) -> None:
        key = self.keys.approval(approval.root_id, approval.id)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=_encode_record(approval.model_dump()))
            pipe.expire(key, self.retention_s)
            pipe.zadd(self.keys.approvals(), {approval.id: approval.created_at})
            pipe.execute()

    @translate_redis_errors
    def get_approval(self, approval_id: str) -> Approval:
        raw = _str_map(self.client.hgetall(self.keys.approval(root_of(approval_id), approval_id)))
        if not raw:
            raise NotFoundError(f"Unknown approval: {approval_id}", field="approval_id")
        data: dict[str, Any] = {**raw, "args": json.loads(raw["args"])}
        for name in ("todo_id", "todo_content", "feedback", "decided_at"):
            data[name] = data.get(name) or None
        return Approval.model_validate(data)

    @translate_redis_errors
    def pending_approval_ids(self) -> list[str]:
        return _strs(self.client.zrange(self.keys.approvals(), 0, -1))

    @translate_redis_errors
    def decide(self, approval_id: str, status: str, feedback: str) -> str:
        """Decide a pending approval once; 'ok', or its status when it was not pending."""
        root = root_of(approval_id)
        keys = [self.keys.approval(root, approval_id), self.keys.approvals(), self.keys.events(root)]
        args: list[ScriptArg] = [approval_id, status, feedback, time.time(), EVENTS_MAXLEN]
        return str(self._decide(keys=keys, args=args))

    @translate_redis_errors
    def finish_task(self, task_id: str, status: str, summary: str = "", error: str = "", error_class: str = "") -> str:
        """Make a task terminal once; returns its status after the call."""
        root = root_of(task_id)
        keys = [self.keys.task(root, task_id), self.keys.events(root), self.keys.live(root)]
        args: list[ScriptArg] = [status, summary, error, error_class, time.time(), self.retention_s, EVENTS_MAXLEN]
        result = self._finish_task(keys=keys, args=args)
        if result is None:
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        return str(result)

    @translate_redis_errors
    def apply_children(self, batch: Batch | BatchRef, child_ids: Sequence[str]) -> int:
        """Write ended children's figures onto the parent's todo items, each once per batch.

        One script call for all of them: the parent's todo list is decoded once.
        Children that have not ended are skipped. Returns how many were applied now.
        """
        if not child_ids:
            return 0
        root, k = batch.root_id, self.keys
        keys = [
            k.task(root, batch.parent_id), k.todos(root, batch.parent_id), k.batch_applied(root, batch.id),
            k.awaiting(root, batch.parent_id), k.events(root), *(k.task(root, c) for c in child_ids),
        ]  # fmt: skip
        args: list[ScriptArg] = [time.time(), self.retention_s, EVENTS_MAXLEN, *child_ids]
        return int(self._apply_children(keys=keys, args=args))

    @translate_redis_errors
    def finish_batch(self, batch: Batch, combined: str, ui_message: dict[str, Any]) -> int:
        """Close a batch once and set its parent active.

        Returns the parent's resume count when this call closed it (>= 1), else 0.
        """
        root, k = batch.root_id, self.keys
        keys = [
            k.batch(root, batch.id), k.task(root, batch.parent_id), k.ui_messages(root, batch.parent_id),
            k.awaiting(root, batch.parent_id), k.events(root),
        ]  # fmt: skip
        args: list[ScriptArg] = [
            combined, json.dumps(ui_message), time.time(), self.retention_s, EVENTS_MAXLEN, batch.child_ids[-1],
        ]  # fmt: skip
        return int(self._finish_batch(keys=keys, args=args))

    @translate_redis_errors
    def append_ui_message(self, task_id: str, message: dict[str, Any]) -> None:
        key = self.keys.ui_messages(root_of(task_id), task_id)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.rpush(key, json.dumps(message))
            pipe.expire(key, self.retention_s)
            pipe.execute()

    @translate_redis_errors
    def append_conversation(self, task_id: str, entries: Sequence[str]) -> None:
        """Append model messages (one JSON entry each) to the task's conversation, atomically."""
        if not entries:
            return
        key = self.keys.conversation(root_of(task_id), task_id)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.rpush(key, *entries)
            pipe.expire(key, self.retention_s)
            pipe.execute()

    @translate_redis_errors
    def conversation(self, task_id: str) -> list[str]:
        """The task's model conversation, one JSON entry per message."""
        return _strs(self.client.lrange(self.keys.conversation(root_of(task_id), task_id), 0, -1))

    @translate_redis_errors
    def tree_task_ids(self, root_id: str) -> list[str]:
        return _strs(self.client.zrange(self.keys.tree_tasks(root_id), 0, -1))

    @translate_redis_errors
    def recent_task_ids(self, *, root_id: str | None, offset: int, count: int) -> list[str]:
        """Task ids, newest first (all tasks, or one tree's)."""
        key = self.keys.tree_tasks(root_id) if root_id else self.keys.all_tasks()
        return _strs(self.client.zrevrange(key, offset, offset + count - 1))

    # -- helpers -----------------------------------------------------------------------

    def _transaction(self, watched: Sequence[str], body: Callable[[Pipeline], T]) -> T:
        """Run `body` on a pipeline watching `watched`, again while another client changes them.

        `body` reads (immediate mode), validates, then calls `pipe.multi()` and
        queues its writes; redis-py raises WatchError at `execute()` when a watched
        key changed, and the body then runs again on fresh state.
        """
        for _ in range(MAX_TRANSACTION_ATTEMPTS):
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(*watched)  # type: ignore[no-untyped-call]
                    return body(pipe)
                except redis.WatchError:
                    continue
        raise ConflictError("The task kept changing while subq tried to update it; try again")

    def _read_watched(self, pipe: Pipeline, task_id: str) -> tuple[TaskRecord, list[TodoItem]]:
        root = root_of(task_id)
        # A watching pipeline runs commands immediately, so these are replies.
        raw = _str_map(pipe.hgetall(self.keys.task(root, task_id)))
        if not raw:
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        child_ids = _strs(pipe.lrange(self.keys.children(root, task_id), 0, -1))
        awaiting = set(_strs(pipe.smembers(self.keys.awaiting(root, task_id))))
        todos_raw = _str_map(pipe.hgetall(self.keys.todos(root, task_id)))
        record = _decode_record(raw, child_ids, [c for c in child_ids if c in awaiting])
        return record, todo_lists.from_hash(todos_raw)

    def _write_todos(self, pipe: Pipeline, key: str, items: Sequence[TodoItem]) -> None:
        """Queue the replacement of a todo list (in the caller's transaction)."""
        pipe.delete(key)
        pipe.hset(key, mapping=cast(HashFields, todo_lists.to_hash(items)))
        pipe.expire(key, self.retention_s)


def _decode_record(raw: dict[str, str], child_ids: list[str], awaiting_ids: list[str]) -> TaskRecord:
    data: dict[str, Any] = {name: raw.get(name) for name in TaskRecord.model_fields if name in raw}
    for name in _OPTIONAL_FIELDS:
        if not data.get(name):
            data[name] = None
    for name in _INT_FIELDS:
        data[name] = int(data.get(name) or 0)
    data["child_ids"], data["awaiting_ids"] = child_ids, awaiting_ids
    data["ancestors"] = json.loads(raw.get("ancestors") or "[]")
    try:
        return TaskRecord.model_validate(data)
    except ValueError as exc:
        raise CorruptError(f"Task record {raw.get('id', '?')} is corrupt: {exc}") from None
