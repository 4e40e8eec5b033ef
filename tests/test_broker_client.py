"""kombu's Redis channel, as a subq worker's consumer and task events use it, on a real Redis: one client per pool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from coordinator import Settings
from coordinator.celery_app import RUN_TASK
from workers.poison import DeadLetterChannel, DeadLetters, install_channel
from workers.run_acks import RunQoS

QUEUE = "subq-broker-client"


@pytest.fixture
def connection(settings: Settings) -> Iterator[Connection]:
    conn = Connection(settings.require_redis_url(), transport_options={"visibility_timeout": 60})
    install_channel(conn.transport, DeadLetters(settings))
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def client(settings: Settings) -> Iterator[redis.Redis]:
    """The test's own client, with the test's queue emptied before and after.

    kombu's unacked hash is the database's, which other tests' workers use too: a test reads only its own tags.
    """
    client = redis.Redis.from_url(settings.require_redis_url())
    client.delete(QUEUE)
    try:
        yield client
    finally:
        client.delete(QUEUE)
        client.close()


@pytest.fixture
def queue(connection: Connection, client: redis.Redis) -> Iterator[Any]:
    """kombu's SimpleQueue on the test's queue, through subq's channel."""
    queue = connection.SimpleQueue(QUEUE)
    try:
        yield queue
    finally:
        queue.close()


def test_the_channel_reuses_one_client_and_makes_a_new_one_with_a_new_pool(connection: Connection) -> None:
    channel = connection.default_channel
    assert isinstance(channel, DeadLetterChannel)
    with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
        assert first is second, "kombu built a client per call again"
        assert first.ping()
    old_pool = first.connection_pool

    channel._disconnect_pools()  # what a reconnect does: the old pool is gone

    with channel.conn_or_acquire() as after:
        assert after is not first and after.connection_pool is not old_pool
        assert after.connection_pool is channel.pool
        assert after.ping()


def test_messages_are_delivered_and_acked_through_the_one_client(queue: Any, client: redis.Redis) -> None:
    for n in range(3):
        queue.put({"n": n})
    received = []
    for _ in range(3):
        message = queue.get(timeout=5)
        # kombu's QoS indexed it as unacked (through the channel's client) until the ack.
        assert client.hexists("unacked", message.delivery_tag)
        received.append(message.payload["n"])
        message.ack()
        assert not client.hexists("unacked", message.delivery_tag)
    assert received == [0, 1, 2]
    assert client.llen(QUEUE) == 0


def test_a_run_message_is_held_in_memory_and_forgotten_by_its_ack(
    connection: Connection, queue: Any, client: redis.Redis
) -> None:
    # A run's redelivery is subq's own (the due list and the reconciler): nothing of it is written to kombu's
    # unacked hash or its index, while prefetch still counts it; any other message is indexed as before.
    queue.put({"n": 1}, headers={"task": RUN_TASK, "id": "run-1"})
    queue.put({"n": 2}, headers={"task": "subq.submit", "id": "other-1"})
    run, other = queue.get(timeout=5), queue.get(timeout=5)
    qos = connection.default_channel.qos
    assert isinstance(qos, RunQoS)
    assert run.headers["task"] == RUN_TASK and run.delivery_tag in qos._delivered
    assert not client.hexists("unacked", run.delivery_tag)
    assert client.zscore("unacked_index", run.delivery_tag) is None
    assert client.hexists("unacked", other.delivery_tag), "a message other than a run lost kombu's backstop"
    run.ack()
    other.ack()
    qos._flush()
    assert run.delivery_tag not in qos._delivered and other.delivery_tag not in qos._delivered
    for tag in (run.delivery_tag, other.delivery_tag):
        assert not client.hexists("unacked", tag) and client.zscore("unacked_index", tag) is None
    assert client.llen(QUEUE) == 0, "an ack put a run message back"


def test_a_run_message_put_back_goes_where_kombu_puts_one_back(queue: Any, client: redis.Redis) -> None:
    # kombu's reject with requeue puts a message back behind the ones waiting (LPUSH: the consumer pops the
    # other end), marked redelivered: a run message held in memory goes back the same way, from memory.
    queue.put({"n": 1}, headers={"task": RUN_TASK, "id": "run-1"})
    queue.put({"n": 2}, headers={"task": RUN_TASK, "id": "run-2"})
    first = queue.get(timeout=5)
    assert first.headers["id"] == "run-1"
    first.reject(requeue=True)
    assert client.llen(QUEUE) == 2, "a requeued run message was not put back"
    second = queue.get(timeout=5)
    again = queue.get(timeout=5)
    assert second.headers["id"] == "run-2" and again.headers["id"] == "run-1"
    assert again.payload == {"n": 1} and again.delivery_info.get("redelivered") is True
    again.ack()
    second.reject(requeue=False)  # (a dead-lettered run: dropped, not put back)
    assert client.llen(QUEUE) == 0
    assert not any(client.hexists("unacked", m.delivery_tag) for m in (first, second, again))


def test_run_messages_still_held_when_the_channel_closes_go_back_on_their_queue(
    connection: Connection, client: redis.Redis
) -> None:
    # A warm shutdown's restore: kombu restores every message still held when its channel closes, a run message
    # from the worker's memory, any other from the unacked hash; none is lost and none is restored twice.
    queue = connection.SimpleQueue(QUEUE)
    queue.put({"n": 1}, headers={"task": RUN_TASK, "id": "run-1"})
    queue.put({"n": 2}, headers={"task": "subq.submit", "id": "other-1"})
    queue.put({"n": 3}, headers={"task": RUN_TASK, "id": "run-2"})
    held = [queue.get(timeout=5) for _ in range(3)]
    held[2].ack()  # acked before the close: not restored
    assert client.llen(QUEUE) == 0
    queue.close()
    connection.close()
    entries = [json.loads(raw) for raw in client.lrange(QUEUE, 0, -1)]
    assert sorted(entry["headers"]["id"] for entry in entries) == ["other-1", "run-1"]
    assert not any(client.hexists("unacked", m.delivery_tag) for m in held)


def test_a_run_message_redis_refused_to_put_back_is_put_back_at_close(
    connection: Connection, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A requeue that Redis refuses (here, the push itself fails as a lost connection would) leaves the message
    # held: the restore at the channel's close pushes it from memory, where it would otherwise be lost.
    queue = connection.SimpleQueue(QUEUE)
    queue.put({"n": 1}, headers={"task": RUN_TASK, "id": "run-1"})
    message = queue.get(timeout=5)

    def refused(*args: Any, **kwargs: Any) -> None:
        raise redis.ConnectionError("Redis went away")

    monkeypatch.setattr(connection.default_channel, "_do_restore_message", refused)
    with pytest.raises(redis.ConnectionError):
        message.reject(requeue=True)
    monkeypatch.undo()
    assert client.llen(QUEUE) == 0
    queue.close()
    connection.close()
    assert [json.loads(raw)["headers"]["id"] for raw in client.lrange(QUEUE, 0, -1)] == ["run-1"]
