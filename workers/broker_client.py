"""One redis-py client per connection pool for kombu's Redis channel, where kombu builds one per call.

kombu's Redis channel builds a new redis-py client for each ack, each message's
prefetch bookkeeping and each event publish: about 0.1 ms of CPU each, several
per task, in the worker's consumer thread. A client is thread-safe (each command
takes a connection from the pool, a pipeline is an object of its own), so one
per pool does: a reconnect makes a new pool, and with it a new client.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OneClientPerPool"]


class OneClientPerPool:
    """Mixed in before kombu's Redis `Channel`: its synchronous client, built once per pool."""

    pool: Any

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the consumer's own BRPOP and pub/sub client: kombu builds it once already
            return super()._create_client(asynchronous=True)  # type: ignore[misc]
        pool = self.pool
        client = self.__dict__.get("_subq_client")
        if client is None or client.connection_pool is not pool:
            client = super()._create_client()  # type: ignore[misc]
            self.__dict__["_subq_client"] = client
        return client
