"""`round_trip` (coordinator/store/base.py), the hot steps' one write and its replies, on a real Redis.

It reads every reply before it raises the first error, so the pooled connection it gives back holds no
unread reply; in a transaction an error among EXEC's replies is raised, as redis-py's pipeline raises it
(a NOSCRIPT there is what sends a step again by its text); and its replies are the server's own (an
HGETALL is a flat list under RESP2, which `hash_reply` makes a dict).
"""

from __future__ import annotations

import uuid

import pytest
import redis

from coordinator.store.base import hash_reply, round_trip


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
