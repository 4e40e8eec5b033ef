"""kombu's Redis channel, as a subq worker's consumer and task events use it, on a real Redis: one client per pool."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from kombu import Connection

from coordinator import Settings
from workers.poison import DeadLetterChannel, DeadLetters, install_channel

QUEUE = "subq-broker-client"


@pytest.fixture
def connection(settings: Settings) -> Iterator[Connection]:
    conn = Connection(settings.require_redis_url(), transport_options={"visibility_timeout": 60})
    install_channel(conn.transport, DeadLetters(settings))
    try:
        yield conn
    finally:
        conn.close()


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


def test_messages_are_delivered_and_acked_through_the_one_client(connection: Connection, settings: Settings) -> None:
    client = redis.Redis.from_url(settings.require_redis_url())
    client.delete(QUEUE)
    queue = connection.SimpleQueue(QUEUE)
    try:
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
    finally:
        queue.close()
        client.delete(QUEUE)
        client.close()
