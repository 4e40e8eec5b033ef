"""Plumbing shared by the store's parts: errors, casts, scripts, records, transactions.

Redis errors are translated into `StoreError` here, in one place
(`translate_redis_errors`). `StoreCore` holds the client, the keys, the
retention and `Scripts`, every Lua script of `lua/`, loaded once and registered
once per client, and the writes several parts share (the WATCH/MULTI
transaction, a todo list's replacement, the history indexes). Each part of the
package is a `Part`: it is built on the one core, not on another part.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, ParamSpec, TypeVar, cast

import redis
from redis.client import Pipeline
from redis.typing import EncodableT, FieldT

from coordinator import todos as todo_lists
from coordinator.errors import ConflictError, CorruptError, StoreError
from coordinator.models import TaskRecord, TodoItem
from coordinator.store.fields import INT_FIELDS, OPTIONAL_FIELDS, TaskField
from coordinator.store.keys import Keys

__all__ = ["EVENTS_MAXLEN", "Part", "Scripts", "StoreCore", "translate_redis_errors"]

# Enough history for a live view to catch up after a short disconnect, small
# enough that a busy tree's stream stays a few MB (XADD MAXLEN ~).
EVENTS_MAXLEN = 10_000
# A transaction whose watched keys keep changing is retried this often before
# the caller is told; each retry re-validates on fresh state.
MAX_TRANSACTION_ATTEMPTS = 50

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

HashMapping = dict[FieldT, EncodableT]
ScriptArg = str | int | float


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


def _load_script(name: str, *uses: str) -> str:
    """A script of lua/, with the scripts it `uses` defined first as local functions.

    Each used script becomes `local function <name>(KEYS, ARGV) <its text> end`, so a
    step that does several things in one round trip calls the very scripts that do
    each of them alone (their KEYS and ARGV are the function's parameters). All of
    them share hashes.lua's cache of hash reads and writes, sent once when the
    script itself returns.
    """
    lua = resources.files("coordinator.store").joinpath("lua")

    def function(used: str, body_of: str) -> str:
        return f"local function {used}(KEYS, ARGV)\n{lua.joinpath(body_of).read_text(encoding='utf-8')}end\n"

    prelude = lua.joinpath("hashes.lua").read_text(encoding="utf-8")
    functions = [function(used.removesuffix(".lua"), used) for used in uses]
    main = "local reply = main(KEYS, ARGV)\nhash_flush()\nreturn reply\n"
    return prelude + "".join(functions) + function("main", name) + main


def _encode_record(fields: dict[str, Any]) -> HashMapping:
    """A task record as hash fields: None becomes '' and lists become JSON."""
    out: HashMapping = {}
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


# A task hash's tool-call counters: `tool:<name>:<outcome>` (calls) and `tool:<name>:ms` (time).
TOOL_FIELD_PREFIX = "tool:"


def tool_field(tool: str, counter: str) -> str:
    return f"{TOOL_FIELD_PREFIX}{tool}:{counter}"


def _tool_use(raw: dict[str, str]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for name, value in raw.items():
        if name.startswith(TOOL_FIELD_PREFIX):
            tool, _, counter = name[len(TOOL_FIELD_PREFIX) :].rpartition(":")
            use = found.setdefault(tool, {"outcomes": {}, "ms": 0})
            if counter == "ms":
                use["ms"] = int(value)
            else:
                use["outcomes"][counter] = int(value)
    return found


def _decode_record(raw: dict[str, str], child_ids: list[str], awaiting_ids: list[str]) -> TaskRecord:
    data: dict[str, Any] = {name: raw.get(name) for name in TaskRecord.model_fields if name in raw}
    for name in OPTIONAL_FIELDS:
        if not data.get(name):
            data[name] = None
    for name in INT_FIELDS:
        data[name] = int(data.get(name) or 0)
    data["child_ids"], data["awaiting_ids"] = child_ids, awaiting_ids
    data["tool_use"] = _tool_use(raw)
    data[TaskField.ANCESTORS] = json.loads(raw.get(TaskField.ANCESTORS) or "[]")
    try:
        return TaskRecord.model_validate(data)
    except ValueError as exc:
        raise CorruptError(f"Task record {raw.get(TaskField.ID, '?')} is corrupt: {exc}") from None


class Scripts:
    """Every Lua script of `lua/`, loaded once and registered on one client.

    A part calls one as `self.scripts.end_run(keys=..., args=...)`; the attribute is
    the script's file name, and a script that `uses` others has them inlined.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.record_usage = client.register_script(_load_script("record_usage.lua"))
        self.finish_task = client.register_script(_load_script("finish_task.lua"))
        self.apply_children = client.register_script(_load_script("apply_children.lua"))
        self.close_batch = client.register_script(_load_script("close_batch.lua", "finish_batch.lua"))
        self.settle_child = client.register_script(
            _load_script("settle_child.lua", "apply_children.lua", "finish_batch.lua", "close_batch.lua")
        )
        self.start_run = client.register_script(_load_script("start_run.lua", "admit.lua"))
        self.flush_run = client.register_script(_load_script("flush_run.lua", "record_usage.lua"))
        self.record_tool = client.register_script(_load_script("record_tool.lua", "record_usage.lua", "flush_run.lua"))
        self.end_run = client.register_script(
            _load_script(
                "end_run.lua", "record_usage.lua", "flush_run.lua", "finish_task.lua", "release_lease.lua",
                "apply_children.lua", "finish_batch.lua", "close_batch.lua", "settle_child.lua", "release_slot.lua",
            )
        )  # fmt: skip
        self.stop_tasks = client.register_script(_load_script("stop_tasks.lua"))
        self.release_slot = client.register_script(_load_script("release_slot.lua"))
        self.rate_limit = client.register_script(_load_script("rate_limit.lua"))
        self.tool_slot = client.register_script(_load_script("tool_slot.lua"))
        self.decide = client.register_script(_load_script("decide.lua"))
        self.release_lease = client.register_script(_load_script("release_lease.lua"))
        self.renew_leases = client.register_script(_load_script("renew_leases.lua"))
        self.lead = client.register_script(_load_script("lead.lua"))
        self.append_if_leased = client.register_script(_load_script("append_if_leased.lua"))
        self.unwatch = client.register_script(_load_script("unwatch.lua"))


class StoreCore:
    """What every part of the store shares: the client, keys and retention of one key prefix,
    the registered scripts (built once, here), and the writes several parts make the same way."""

    def __init__(self, client: redis.Redis, keys: Keys, retention_s: int) -> None:
        self.client = client
        self.keys = keys
        self.retention_s = retention_s
        self.scripts = Scripts(client)

    def transaction(self, watched: Sequence[str], body: Callable[[Pipeline], T]) -> T:
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

    def write_todos(self, pipe: Pipeline, key: str, items: Sequence[TodoItem]) -> None:
        """Queue the replacement of a todo list (in the caller's transaction)."""
        pipe.delete(key)
        pipe.hset(key, mapping=cast(HashMapping, todo_lists.to_hash(items)))
        pipe.expire(key, self.retention_s)

    def index(self, records: Sequence[TaskRecord], *, root: bool = False) -> None:
        """The history indexes, outside any tree's slot, so written apart from the tree's commit."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(self.keys.all_tasks(), {r.id: r.created_at for r in records})
            if root:
                pipe.zadd(self.keys.roots(), {r.id: r.created_at for r in records})
            cutoff = time.time() - self.retention_s
            pipe.zremrangebyscore(self.keys.all_tasks(), "-inf", cutoff)
            pipe.zremrangebyscore(self.keys.roots(), "-inf", cutoff)
            pipe.execute()


class Part:
    """One part of the store (`store.records`, `store.runs`, ...): the core's client, keys,
    retention and scripts at hand. A part that reads through another is handed it explicitly."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self.client = core.client
        self.keys = core.keys
        self.retention_s = core.retention_s
        self.scripts = core.scripts
