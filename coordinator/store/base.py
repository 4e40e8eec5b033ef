"""Plumbing shared by the store's parts: errors, casts, scripts, records, transactions.

Redis errors are translated into `StoreError` here, in one place
(`translate_redis_errors`). `StoreCore` holds the client, the keys, the
retention and `Scripts`, every Lua script of `lua/`, loaded once and registered
once per client, and the writes several parts share (the WATCH/MULTI
transaction, a todo list's replacement, the history indexes). Each part of the
package is a `Part`: it is built on the one core, not on another part.

Acknowledged means replicated: with `ReplicaWait` (SUBQ_REDIS_MIN_REPLICAS above
0), every transaction and each script of a step a caller sees (`ACKNOWLEDGED`)
ends with `WAIT <replicas> <timeout_ms>` on its own connection, so a failover
right after it cannot undo it. A script's WAIT rides in the same round trip as
its EVALSHA; a transaction's follows its EXEC. Without it (one Redis), nothing of
this runs: the commands are the ones sent before WAIT existed here.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

import pydantic
import redis
from hiredis import pack_command
from redis.client import Pipeline
from redis.commands.core import Script
from redis.connection import Connection
from redis.typing import EncodableT, FieldT

from coordinator import todos as todo_lists
from coordinator.errors import ConflictError, CorruptError, StoreError
from coordinator.models import TaskRecord, TodoItem
from coordinator.store.fields import INT_FIELDS, OPTIONAL_FIELDS, TaskField
from coordinator.store.keys import Keys
from coordinator.store.library import Library, as_function, library_text, lua_file, run_and_flush
from coordinator.store.protocol import CALLS, Call, OutboxKeys, ScriptArg
from coordinator.timeline import FOLD_MARKS, MAX_MARKS, OUTCOMES

__all__ = [
    "ACKNOWLEDGED",
    "EVENTS_MAXLEN",
    "Command",
    "Part",
    "ReplicaWait",
    "ScriptArg",
    "Scripts",
    "StoreCore",
    "hash_reply",
    "round_trip",
    "translate_redis_errors",
]

log = logging.getLogger(__name__)

# Enough history for a live view to catch up after a short disconnect, small
# enough that a busy tree's stream stays a few MB (XADD MAXLEN ~).
EVENTS_MAXLEN = 10_000
# A transaction whose watched keys keep changing is retried this often before
# the caller is told; each retry re-validates on fresh state.
MAX_TRANSACTION_ATTEMPTS = 50
# How long a mark a write keeps for its own resend lives (an audit entry's, an endpoint recovery's): longer than a
# connection's retries of a lost reply go on (a failover is given about 30 s, coordinator/redis_clients.py), short
# enough that a flood of writes (refused requests, each on the audit log) leaves few behind.
RESEND_MARK_S = 120

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

HashMapping = dict[FieldT, EncodableT]
# One Redis command as `round_trip` sends it: its name, then its arguments.
Command = tuple[ScriptArg, ...]


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


def outbox_keys(keys: Keys, root_id: str) -> OutboxKeys:
    """The tree's outbox, as every step that can cause an event names it (coordinator/outbound.py)."""
    return OutboxKeys(hooks=keys.hooks(root_id), outbox=keys.outbox(root_id), pending=keys.outbox_pending())


def _str_map(reply: Any) -> dict[str, str]:
    return cast(dict[str, str], reply)


def _scored(reply: Any) -> dict[str, float]:
    """A ZRANGE ... WITHSCORES reply as member -> score."""
    return {str(member): float(score) for member, score in cast(list[tuple[str, float]], reply)}


def _timeline_bound(prelude: str) -> str:
    """hashes.lua with coordinator/timeline.py's bound and outcomes put in: declared there once, for both folds."""
    outcomes = "{" + ", ".join(f"{outcome} = true" for outcome in OUTCOMES) + "}"
    return (
        prelude.replace("{MAX_MARKS}", str(MAX_MARKS))
        .replace("{FOLD_MARKS}", str(FOLD_MARKS))
        .replace("{OUTCOMES}", outcomes)
    )


def _prelude() -> str:
    """hashes.lua, the prelude of every script and of the library, with the timeline's bound put in."""
    return _timeline_bound(lua_file("hashes.lua"))


def _load_script(name: str, *uses: str) -> str:
    """A script of lua/, with the scripts it `uses` defined first as local functions.

    Each used script becomes `local function <name>(KEYS, ARGV) <its text> end`, so a
    step that does several things in one round trip calls the very scripts that do
    each of them alone (their KEYS and ARGV are the function's parameters). All of
    them share hashes.lua's cache of hash reads and writes, sent once when the
    script itself returns.
    """
    functions = [as_function(used.removesuffix(".lua"), lua_file(used)) for used in uses]
    return _prelude() + "".join(functions) + as_function("main", lua_file(name)) + run_and_flush("main")


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
_TOOL_PREFIX_CHARS = len(TOOL_FIELD_PREFIX)


def tool_field(tool: str, counter: str) -> str:
    return f"{TOOL_FIELD_PREFIX}{tool}:{counter}"


def _tool_use(raw: dict[str, str]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for name, value in raw.items():
        # A slice, not `startswith`: a record has some 50 fields, read at every run's start.
        if name[:_TOOL_PREFIX_CHARS] == TOOL_FIELD_PREFIX:
            tool, _, counter = name[_TOOL_PREFIX_CHARS:].rpartition(":")
            use = found.setdefault(tool, {"outcomes": {}, "ms": 0})
            if counter == "ms":
                use["ms"] = int(value)
            else:
                use["outcomes"][counter] = int(value)
    return found


_RECORD_FIELDS = frozenset(TaskRecord.model_fields)


def _decode_record(raw: dict[str, str], child_ids: list[str], awaiting_ids: list[str]) -> TaskRecord:
    # Written with no method call a field (`in` and indexing, not `get`): a run's start decodes one.
    data: dict[str, Any] = {name: value for name, value in raw.items() if name in _RECORD_FIELDS}
    for name in OPTIONAL_FIELDS:
        if name not in data or not data[name]:
            data[name] = None
    data["child_ids"], data["awaiting_ids"] = child_ids, awaiting_ids
    try:  # (a JSONDecodeError is a ValueError too)
        for name in INT_FIELDS:
            data[name] = int(data[name] or 0) if name in data else 0
        data["tool_use"] = _tool_use(raw)
        data[TaskField.ANCESTORS] = json.loads(raw.get(TaskField.ANCESTORS) or "[]")
        return TaskRecord.model_validate(data)
    except ValueError as exc:
        raise CorruptError(f"Task record {raw.get(TaskField.ID, '?')} is corrupt: {_one_line(exc)}") from None


def _one_line(exc: ValueError) -> str:
    """What is wrong, in one line for a log's line: a failed validation's fields and messages (pydantic's own text
    spans lines, and quotes the values); any other error's text (`int()`'s and JSON's are one line)."""
    if isinstance(exc, pydantic.ValidationError):
        return "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in exc.errors())
    return str(exc)


# The scripts whose step a caller sees, and would see undone by a failover (`acknowledged=True` in the
# protocol table): a run's end and write-back (end_run, settle_child, apply_children, close_batch,
# finish_task), a decision (decide), a cancel or a budget stop (stop_tasks), a retry (retry). A run's
# per-step writes (usage, conversation, tool results) are not: a run resumed from a replica a step behind
# takes that step again, as after a worker's death.
ACKNOWLEDGED = frozenset(name for name, call in CALLS.items() if call.acknowledged)


@dataclass(frozen=True)
class ReplicaWait:
    """`WAIT replicas timeout_ms` after a step a caller sees: how many replicas must have it, how long to wait."""

    replicas: int
    timeout_ms: int


class ReplicaShortfalls:
    """Steps whose WAIT heard from fewer replicas than asked: each stands (it is on the master), and is logged.

    A step is not failed for it: its writes are on the master already and WAIT cannot take them back,
    so failing it would only make its caller try again a step that was done. The count is the process's
    own (the API's /metrics reports it); docs/deploy.md says what such a step risks.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def note(self, step: str, acked: int, wait: ReplicaWait) -> None:
        if acked >= wait.replicas:
            return
        with self._lock:
            self.count += 1
        log.warning(
            "subq: %s was acknowledged by %d of the %d replica(s) SUBQ_REDIS_MIN_REPLICAS asks for within %d ms; "
            "it stands on the master, and a failover before it reaches a replica would lose it",
            step, acked, wait.replicas, wait.timeout_ms,
        )  # fmt: skip


def queue_script(pipe: Pipeline, script: Script, keys: Sequence[ScriptArg], args: Sequence[ScriptArg], *,
                 by_text: bool) -> None:  # fmt: skip
    """Queue one call of `script`: by its SHA (EVALSHA), or by its text (EVAL), after the server answered NOSCRIPT.

    EVAL runs the script and keeps it, so the next EVALSHA finds it; nothing of a call answered NOSCRIPT
    ran, so the text goes in its place. Not `SCRIPT LOAD`, then EVALSHA again: the load took one connection
    of the pool and the call another, which across a failover can lead to another server, and `end_run`
    once met NOSCRIPT on both of its two tries during a kill-based failover under load (1 run in 4).
    """
    if by_text:
        pipe.eval(_text(script), len(keys), *keys, *args)
    else:
        pipe.evalsha(script.sha, len(keys), *keys, *args)


def _text(script: Script) -> str:
    """A script's Lua source (redis-py types it as any encodable; `_load_script` made it a str)."""
    return cast(str, script.script)


def round_trip(
    client: redis.Redis, commands: Sequence[Command], *, transaction: bool = False, wait: ReplicaWait | None = None
) -> list[Any]:
    """Send `commands` in one write on one connection of `client`'s pool and read every reply (EXEC's
    when in a `transaction`, which wraps them in MULTI/EXEC): a step of a run's hot path. With `wait`,
    the step's WAIT goes last in the same write, and its count is the last reply (`read_wait`).

    What redis-py's `execute_command` and pipeline do for it, without their command stack, response
    callbacks and Python pass over each argument before hiredis packs it (about 400 calls of a child's,
    docs/benchmarks.md; the bytes sent are the same): the same pooled
    connection, its health check before the write (`FollowingConnection` asks the server's ROLE), and
    its retry, which sends the whole round trip again after a connection error, disconnected first (a
    failover under Sentinel: `failover_retry`). Every reply is read before the first error is raised,
    inside the retry as redis-py's pipeline raises it (a script's READONLY or NOREPLICAS in EXEC is tried
    again, on Redis 6.2 as on 7), so a pooled connection never keeps an unread reply. Replies are as the
    server sent them: no response callbacks (`hash_reply` makes a dict of an HGETALL's).
    """
    if transaction:
        commands = [("MULTI",), *commands, ("EXEC",)]
    step = len(commands)
    if wait is not None:
        commands = [*commands, ("WAIT", wait.replicas, wait.timeout_ms)]
    # hiredis's packing, one write; its stub types a command of one element only.
    packed = [b"".join([pack_command(command) for command in commands])]  # type: ignore[arg-type, unused-ignore]
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        replies: list[Any] = connection.retry.call_with_retry(
            lambda: _exchange(connection, packed, step, transaction),
            lambda _error: connection.disconnect(),
        )
        if wait is not None:
            replies.append(read_wait(connection, wait))  # outside the retry: the step has run
        return replies
    except redis.ResponseError:
        if wait is not None:
            connection.disconnect()  # its WAIT's answer is still to come
        raise  # every reply of the step was read (`_exchange`)
    except BaseException:
        connection.disconnect()  # left mid-read: never pooled with a reply unread
        raise
    finally:
        pool.release(connection)


# How long past its own timeout a WAIT's answer may take to arrive (redis-py's default socket timeout): a
# connection's own timeout, shorter than a long WAIT, would end the read of an answer still to come.
WAIT_READ_MARGIN_S = 5.0


def read_wait(connection: Connection, wait: ReplicaWait) -> int:
    """The replicas a step's WAIT (sent after it on `connection`) counted; 0 when its answer cannot be read.

    Read once the step's own replies are: the step has run, so an error here (the connection lost, or
    closed by a switch's `UNBLOCKED`) is a shortfall (`ReplicaShortfalls`), never a reason to send the
    step again, which would apply its writes twice. The connection is closed then, its answer unread.
    """
    try:
        return int(connection.read_response(timeout=wait.timeout_ms / 1000 + WAIT_READ_MARGIN_S))
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
        log.warning("subq: a step's WAIT was not answered (%s); the step stands, counted as unacknowledged", exc)
        connection.disconnect()
        return 0


def _exchange(connection: Connection, packed: list[bytes], count: int, transaction: bool) -> list[Any]:
    """One write of `packed` and its first `count` replies (EXEC's, in a transaction); the first error raised
    last. A WAIT after them is read by the caller (`read_wait`)."""
    connection.send_packed_command(packed)
    replies: list[Any] = []
    error: redis.ResponseError | None = None
    for _ in range(count):
        try:
            replies.append(connection.read_response())
        except redis.ResponseError as exc:  # EXECABORT after a command refused when queued: that one is raised
            error = error or exc
    if error is not None:
        raise error
    if transaction:
        replies = replies[-1]
        if replies is None:
            raise redis.WatchError("EXEC discarded the transaction")  # nothing here WATCHes: not expected
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                # A script's refusal by a master a failover explains (NOREPLICAS; READONLY wrapped by Redis 6.2)
                # comes back nested here: nothing of it was written, and the retry sends the step again
                # where the sentinels say, as it does a refusal that comes alone (FollowingConnection).
                refusal = getattr(connection, "refusal", None)
                refused = refusal(reply) if refusal is not None else None
                raise refused or reply
    return replies


def script_command(
    script: Script, keys: Sequence[ScriptArg], args: Sequence[ScriptArg], *, by_text: bool, function: str | None = None
) -> Command:
    """One call of `script`: as the library's `function` (FCALL) when there is one, else by its SHA (EVALSHA);
    or by its text (EVAL), after the server answered NOSCRIPT or "Function not found" (`queue_script` says why)."""
    if by_text:
        return ("EVAL", _text(script), len(keys), *keys, *args)
    if function is not None:
        return ("FCALL", function, len(keys), *keys, *args)
    return ("EVALSHA", script.sha, len(keys), *keys, *args)


def by_sha_then_text(send: Callable[[bool], T], library: Library | None = None) -> T:
    """`send(False)`, a step by its script's SHA, or as the `library`'s function when given (FCALL); if the server
    answers NOSCRIPT, or refuses the FCALL with nothing of it run (`Library.refused`: "Function not found",
    FCALL not allowed, out of memory), `send(True)`, by its text.

    Nothing of a call so answered ran, so sending it again by its text (which no server can forget)
    does it once: a server that does not know the script is one just restarted or promoted (scripts are
    not replicated; a library is, but a replica promoted before the load reached it lacks it). In a
    transaction only the script's command failed: `Scripts.queue_in` says why a transaction that writes
    beside it sends the script by its text from the start.
    """
    try:
        return send(False)
    except redis.exceptions.NoScriptError:
        return send(True)
    except redis.ResponseError as exc:
        if library is None or not library.refused(exc):
            raise
        return send(True)


def send_step(
    library: Library | None,
    name: str,
    script: Script,
    keys: Sequence[ScriptArg],
    args: Sequence[ScriptArg],
    send: Callable[[Command], T],
) -> T:
    """`send` the step's one command: FCALL of `name`'s function where this process loaded the `library`, else
    EVALSHA of `script`; again by its text when the server holds neither (`by_sha_then_text`). Each way a step is
    sent (alone, with its WAIT, with its reads) is a `send` of its own."""
    function = library.function(name) if library is not None else None
    return by_sha_then_text(
        lambda by_text: send(script_command(script, keys, args, by_text=by_text, function=function)),
        library if function is not None else None,
    )


def hash_reply(reply: Any) -> dict[str, str]:
    """HGETALL's reply as `round_trip` reads it (a flat list under RESP2, a map under RESP3) as a dict."""
    if isinstance(reply, dict):
        return reply
    pairs = iter(reply)
    return dict(zip(pairs, pairs, strict=True))


class TextOnNoScript:
    """A script of no acknowledged step, sent alone: FCALL of its function in the `library` where this process
    loaded it, else EVALSHA; and its text (EVAL) on NOSCRIPT, or on an FCALL refused with nothing of it run
    (`by_sha_then_text`).

    redis-py's `Script` loads it (SCRIPT LOAD) and sends EVALSHA once more, each on a connection of
    its own (`queue_script` says why that is not enough).
    """

    def __init__(self, client: redis.Redis, script: Script, name: str, library: Library | None = None) -> None:
        self.client = client
        self.script = script
        self.name = name
        self.library = library

    def __call__(self, keys: Sequence[ScriptArg], args: Sequence[ScriptArg]) -> Any:
        return send_step(
            self.library, self.name, self.script, keys, args, lambda command: round_trip(self.client, [command])[0]
        )


class AcknowledgedScript:
    """A script of a step a caller sees, sent with its WAIT in one round trip (one write, one connection).

    WAIT counts the replicas that have every write of its own connection, so it goes on the
    connection that ran the script. The script goes as its function in the `library` (FCALL) where the
    server has it, else by EVALSHA; a master that does not know it (a replica just promoted: scripts are
    not replicated) gets it again by its text (`queue_script`, `by_sha_then_text`).
    """

    def __init__(
        self,
        client: redis.Redis,
        script: Script,
        name: str,
        wait: ReplicaWait,
        shortfalls: ReplicaShortfalls,
        library: Library | None = None,
    ) -> None:
        self.client = client
        self.script = script
        self.name = name
        self.wait = wait
        self.shortfalls = shortfalls
        self.library = library

    def __call__(self, keys: Sequence[ScriptArg], args: Sequence[ScriptArg]) -> Any:
        reply, acked = send_step(
            self.library, self.name, self.script, keys, args,
            lambda command: round_trip(self.client, [command], wait=self.wait),
        )  # fmt: skip
        self.shortfalls.note(self.name, int(acked), self.wait)
        return reply


class AcknowledgedTransaction(Pipeline):
    """redis-py's transaction pipeline, whose EXEC is followed by WAIT on the same connection."""

    replica_wait: ReplicaWait
    shortfalls: ReplicaShortfalls

    def _execute_transaction(self, connection: Connection, commands: Any, raise_on_error: bool) -> list[Any]:
        replies: list[Any] = super()._execute_transaction(connection, commands, raise_on_error)
        # EXEC has run: past here nothing raises into the pipeline's retry, which would send the body again
        # with no WATCH (its writes applied twice, unchecked).
        try:
            connection.send_command("WAIT", self.replica_wait.replicas, self.replica_wait.timeout_ms)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("subq: a transaction's WAIT was not sent (%s); the transaction stands", exc)
            acked = 0
        else:
            acked = read_wait(connection, self.replica_wait)
        self.shortfalls.note("a transaction", acked, self.replica_wait)
        return replies


class Scripts:
    """Every script of the protocol table (protocol.py), loaded once and registered on one client.

    A part calls one as `self.scripts(EndRun(...))`: the call's fields are packed as KEYS and
    ARGV, and its reply comes back typed. Each script is registered with the scripts it `uses`
    inlined; with a `ReplicaWait`, each `acknowledged` one is sent as an `AcknowledgedScript`. On a
    server with functions (Redis 7) all of them are also one library (`library`, noted in the deployment's
    `libraries_key`), and each is sent as its function there.
    """

    def __init__(
        self,
        client: redis.Redis,
        libraries_key: str,
        replicas: ReplicaWait | None = None,
        shortfalls: ReplicaShortfalls | None = None,
    ) -> None:
        shortfalls = shortfalls or ReplicaShortfalls()
        self._client = client
        self._send: dict[str, Callable[..., Any]] = {}
        self._scripts: dict[str, Script] = {}
        standalone = {name: call.uses for name, call in CALLS.items() if call.standalone}
        # On a server with functions, each is sent as its function in one library of them all (library.py).
        self.library = Library(client, library_text(_prelude(), standalone), noted_in=libraries_key)
        for name, uses in standalone.items():
            script = client.register_script(_load_script(f"{name}.lua", *(f"{used}.lua" for used in uses)))
            self._scripts[name] = script
            if replicas is not None and CALLS[name].acknowledged:
                self._send[name] = AcknowledgedScript(client, script, name, replicas, shortfalls, self.library)
            else:
                self._send[name] = TextOnNoScript(client, script, name, self.library)

    def __call__(self, call: Call[R]) -> R:
        """Send one call of a script (one FCALL or EVALSHA, with its WAIT when acknowledged) and type its reply."""
        script_keys, script_args = call.pack()
        return call.decode(self._send[call.script](keys=script_keys, args=script_args))

    def queue_in(self, pipe: Pipeline, call: Call[Any]) -> None:
        """Queue one call of a script inside the caller's transaction (after its `multi()`), by its text.

        For a WATCH/MULTI step that must write what only a script computes (a timeline mark folded by
        hashes.lua, store/delegation.py): EXEC runs it in its place, atomically with the rest. Never by
        its SHA: inside MULTI a NOSCRIPT fails that command alone at EXEC while the others commit
        (redis-server 7.0; tests/test_delegation_timeline.py shows it), so a server that forgot the
        script would take the step without it. Its reply is in the transaction's replies, in its place.
        """
        script_keys, script_args = call.pack()
        queue_script(pipe, self._scripts[call.script], script_keys, script_args, by_text=True)

    def then_read(self, call: Call[R], reads: Sequence[Command]) -> tuple[R, list[Any]]:
        """One call of a script (not an acknowledged one), then the commands `reads` in the same transaction: one
        MULTI/EXEC, one round trip (`round_trip`), nothing between, so the reads see the state the script left.
        Their replies come as the server sent them (`hash_reply` makes a dict of an HGETALL's).

        For a step whose caller needs a whole record: read by the script, each field would become a Lua
        string and then a reply again, which cost start_run more than the rest of its work
        (docs/benchmarks.md). A server that does not know the script (restarted, or a replica just
        promoted) answers NOSCRIPT inside the transaction, or refuses its FCALL (`Library.refused`), where
        nothing of the script ran: the transaction is sent again with the script's text (`by_sha_then_text`).
        `reads` only read: a write
        beside the script would commit on that NOSCRIPT without the script's own writes (a step that writes
        several things writes them all in its script, as save_approval.lua does).
        """
        if CALLS[call.script].acknowledged:
            raise TypeError(f"{call.script}.lua is acknowledged: send it alone, with its WAIT")
        script_keys, script_args = call.pack()
        reply, *read = send_step(
            self.library, call.script, self._scripts[call.script], script_keys, script_args,
            lambda command: round_trip(self._client, [command, *reads], transaction=True),
        )  # fmt: skip
        return call.decode(reply), read


class StoreCore:
    """What every part of the store shares: the client, keys and retention of one key prefix,
    the registered scripts (built once, here), and the writes several parts make the same way."""

    def __init__(self, client: redis.Redis, keys: Keys, retention_s: int, replicas: ReplicaWait | None = None) -> None:
        self.client = client
        self.keys = keys
        self.retention_s = retention_s
        self.replicas = replicas
        self.replica_shortfalls = ReplicaShortfalls()
        self.scripts = Scripts(client, keys.libraries(), replicas, self.replica_shortfalls)

    def _pipeline(self) -> Pipeline:
        """A transaction pipeline: redis-py's, or one whose EXEC is followed by its WAIT."""
        if self.replicas is None:
            return self.client.pipeline(transaction=True)
        pipe = AcknowledgedTransaction(self.client.connection_pool, self.client.response_callbacks, True, None)
        pipe.replica_wait, pipe.shortfalls = self.replicas, self.replica_shortfalls
        return pipe

    def transaction(self, watched: Sequence[str], body: Callable[[Pipeline], T]) -> T:
        """Run `body` on a pipeline watching `watched`, again while another client changes them.

        `body` reads (immediate mode), validates, then calls `pipe.multi()` and
        queues its writes; redis-py raises WatchError at `execute()` when a watched
        key changed, and the body then runs again on fresh state.
        """
        for _ in range(MAX_TRANSACTION_ATTEMPTS):
            with self._pipeline() as pipe:
                try:
                    pipe.watch(*watched)
                    return body(pipe)
                except redis.WatchError:
                    continue
        raise ConflictError("The task kept changing while subq tried to update it; try again")

    def claim_once(self, key: str, field: str) -> bool:
        """True for the one caller whose claim set `field` of hash `key` (HSETNX).

        The claim's value is its own token: a claim sent again after its reply was lost (Sentinel's
        retry of a lost connection) finds its token and is still its caller's, not another's. The
        second read is made only when the field was set already, so a claim costs one round trip.
        """
        token = uuid.uuid4().hex
        return bool(self.client.hsetnx(key, field, token)) or self.client.hget(key, field) == token

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
