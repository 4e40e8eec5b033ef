"""`round_trip` (coordinator/store/base.py), the hot steps' one write and its replies, on a real Redis.

It reads every reply before it raises the first error, so the pooled connection it gives back holds no
unread reply; in a transaction an error among EXEC's replies is raised, as redis-py's pipeline raises it
(a NOSCRIPT there is what sends a step again by its text); and its replies are the server's own (an
HGETALL is a flat list under RESP2, which `hash_reply` makes a dict).
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.connection import HiredisRespSerializer
from redis.retry import Retry

from coordinator.local.embedded_redis import local_redis
from coordinator.redis_clients import FAILOVER_ERRORS, LeanPacker, redis_client
from coordinator.settings import Settings
from coordinator.store.base import (
    AcknowledgedScript,
    ReplicaShortfalls,
    ReplicaWait,
    StoreCore,
    hash_reply,
    round_trip,
)
from coordinator.store.keys import Keys

# How long the killer looks for the step's connection blocked in WAIT (a second's WAIT; a loaded host is slow).
KILL_WITHIN_S = 30.0


def test_an_error_reply_is_raised_after_every_reply_is_read(redis_client: redis.Redis) -> None:
    key = f"roundtrip:{uuid.uuid4().hex}"
    redis_client.set(key, "text")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        round_trip(redis_client, [("LPUSH", key, "x"), ("GET", key), ("INCR", f"{key}:n")])
    # The command after the error ran, and the connection given back is in step with the server.
    assert redis_client.get(f"{key}:n") == "1"
    assert round_trip(redis_client, [("GET", key), ("GET", f"{key}:n")]) == ["text", "1"]


def test_a_transaction_raises_a_noscript_among_its_replies_and_writes_the_rest(redis_client: redis.Redis) -> None:
    key = f"roundtrip:{uuid.uuid4().hex}"
    with pytest.raises(redis.exceptions.NoScriptError):
        round_trip(redis_client, [("EVALSHA", "0" * 40, 0), ("SET", key, "v")], transaction=True)
    assert redis_client.get(key) == "v"  # inside MULTI a NOSCRIPT fails its command alone
    commands = [("HSET", f"{key}:h", "a", 1, "b", "two"), ("HGETALL", f"{key}:h")]
    written, read = round_trip(redis_client, commands, transaction=True)
    assert written == 2
    assert hash_reply(read) == {"a": "1", "b": "two"}  # a map under RESP3, a flat list under RESP2
    assert hash_reply(["a", "1", "b", "two"]) == {"a": "1", "b": "two"}
    assert hash_reply({"a": "1"}) == {"a": "1"}


def test_a_round_trip_left_mid_read_gives_its_connection_back_closed(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"roundtrip:{uuid.uuid4().hex}"
    pool = redis_client.connection_pool
    connection = pool.get_connection()
    pool.release(connection)  # the one the next round trip takes

    def stopped(*args: object, **kwargs: object) -> object:
        raise RuntimeError("stopped before its replies were read")

    monkeypatch.setattr(connection, "read_response", stopped)
    with pytest.raises(RuntimeError):
        round_trip(redis_client, [("SET", key, "a"), ("GET", key)])
    monkeypatch.undo()
    # Its two replies were never read: given back open, the next round trip would read the SET's "OK".
    assert round_trip(redis_client, [("GET", key)]) == ["a"]


# --- a step's WAIT: once the step has run, nothing sends it again (issue 43's review) ---


def _cut_while_waiting(url: str, client: redis.Redis, name: str) -> threading.Thread:
    """A thread that cuts the connection `client` takes next (named `name`) once it blocks in WAIT, the step before it
    run, as a master's death or a switch drops it: the socket shut, so its read ends with nothing (a server's CLIENT
    KILL of a client in WAIT answers the WAIT first)."""
    admin = redis.Redis.from_url(url, decode_responses=True)
    pool = client.connection_pool
    taken: list[Any] = []
    take = pool.get_connection

    def get_connection(*args: Any, **kwargs: Any) -> Any:
        taken.append(take(*args, **kwargs))
        return taken[-1]

    pool.get_connection = get_connection  # type: ignore[method-assign]

    def cut() -> None:
        deadline = time.monotonic() + KILL_WITHIN_S
        while time.monotonic() < deadline:
            if any(c.get("name") == name and c.get("cmd") == "wait" for c in admin.client_list()):
                taken[-1]._sock.shutdown(socket.SHUT_RDWR)
                pool.get_connection = take  # type: ignore[method-assign]
                return
            time.sleep(0.01)

    thread = threading.Thread(target=cut)
    thread.start()
    return thread


def _stepping_client(url: str, name: str, **options: object) -> redis.Redis:
    """A client that retries as a Sentinel one does (FAILOVER_ERRORS), named so the test can find its connection."""
    retry = Retry(NoBackoff(), 3, FAILOVER_ERRORS)
    return redis.Redis.from_url(url, decode_responses=True, retry=retry, client_name=name, **options)  # type: ignore[arg-type]


def test_an_acknowledged_script_whose_wait_is_cut_off_ran_once_and_stands() -> None:
    with local_redis() as url:
        client = _stepping_client(url, "step")
        script = client.register_script("return redis.call('INCR', KEYS[1])")
        client.script_load(script.script)  # known: the first send runs it (a NOSCRIPT would run nothing)
        shortfalls = ReplicaShortfalls()
        # A replica is asked for and none exists: WAIT blocks its whole second, and is cut off meanwhile.
        step = AcknowledgedScript(client, script, "a step", ReplicaWait(replicas=1, timeout_ms=1000), shortfalls)
        killer = _cut_while_waiting(url, client, "step")
        try:
            assert step(["ran"], []) == 1
        finally:
            killer.join()
        # Before, the retry sent the script and its WAIT again: it ran twice and the caller was told 2.
        assert client.get("ran") == "1"
        assert shortfalls.count == 1  # it stands on the master, counted as unacknowledged
        assert client.incr("ran") == 2  # and the pool's connections are in step with the server


def test_a_transaction_whose_wait_is_cut_off_is_applied_once() -> None:
    with local_redis() as url:
        client = _stepping_client(url, "txn")
        core = StoreCore(client, Keys(), 3600, ReplicaWait(replicas=1, timeout_ms=1000))
        client.set("status", "pending")
        checked: list[str] = []

        def body(pipe: Pipeline) -> list[Any]:
            checked.append(pipe.get("status"))  # type: ignore[arg-type]
            assert checked[-1] == "pending"
            pipe.multi()
            pipe.set("status", "running")
            pipe.rpush("log", "started")
            return pipe.execute()

        killer = _cut_while_waiting(url, client, "txn")
        try:
            assert core.transaction(["status"], body) == [True, 1]
        finally:
            killer.join()
        # Before, EXEC was sent again with no WATCH: the body checked once, its RPUSH applied twice.
        assert client.lrange("log", 0, -1) == ["started"]
        assert checked == ["pending"]


def test_a_wait_longer_than_the_connections_timeout_is_read_to_its_end() -> None:
    with local_redis() as url:
        client = _stepping_client(url, "slow", socket_timeout=0.3)
        script = client.register_script("return redis.call('INCR', KEYS[1])")
        client.script_load(script.script)
        shortfalls = ReplicaShortfalls()
        step = AcknowledgedScript(client, script, "a step", ReplicaWait(replicas=1, timeout_ms=1000), shortfalls)
        # Before, the read timed out at 0.3 s and the retry ran the script again, three more times, then raised.
        assert step(["ran"], []) == 1
        assert client.get("ran") == "1"
        assert shortfalls.count == 1  # heard from 0 of 1 replicas: WAIT's own answer, read in full


# Commands as subq's store and redis-py's methods send them: names, keys, text, bytes, numbers, a view.
PACKED_ALIKE: list[tuple[Any, ...]] = [
    ("HSET", "subq:{t}:task:t-1", "status", "running", "tokens_in", 1000, "cost", 0.1 + 0.2),
    ("XADD", "subq:{t}:events", "MAXLEN", "~", 10_000, "*", "type", "live", "state", "completed"),
    ("SET", b"bytes key", b"\x00\xff binary", "NX", "PX", 15_000),
    ("RPUSH", "ui", "text with \u00e9 and \u4e2d", ""),
    ("SET", "view", memoryview(b"from a view")),
    ("CLIENT SETNAME", "subq-worker"),  # a name with a space: redis-py splits it
    ("SET", "array", bytearray(b"a bytearray")),  # hiredis refuses it: redis-py's way
    (b"PING",),
]


@pytest.mark.parametrize("command", PACKED_ALIKE, ids=[str(c[0]) + str(i) for i, c in enumerate(PACKED_ALIKE)])
def test_the_lean_packer_sends_what_redis_py_sends(command: tuple[Any, ...]) -> None:
    assert LeanPacker().pack(*command) == [b"".join(HiredisRespSerializer().pack(*command))]


def test_the_lean_packer_refuses_what_redis_py_refuses() -> None:
    with pytest.raises(redis.DataError, match="must be str, int, float or bytes"):
        LeanPacker().pack("SET", "key", None)


def test_subqs_clients_pack_with_the_lean_packer_and_read_back_what_they_wrote(redis_url: str) -> None:
    client = redis_client(Settings(redis_url=redis_url))
    key = f"packer:{uuid.uuid4().hex}"
    try:
        connection = client.connection_pool.get_connection()
        assert isinstance(connection._command_packer, LeanPacker)
        client.connection_pool.release(connection)
        client.hset(key, mapping={"text": "\u00e9t\u00e9", "count": 3, "share": 0.25})
        with client.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "count", 2)
            pipe.hset(key, "view", memoryview(b"viewed"))  # type: ignore[arg-type]
            pipe.execute()
        assert client.hgetall(key) == {"text": "\u00e9t\u00e9", "count": "5", "share": "0.25", "view": "viewed"}
    finally:
        client.delete(key)
        client.close()
