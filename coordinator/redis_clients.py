"""Every Redis client subq makes, made here: one Redis (SUBQ_REDIS_URL), or the master Redis Sentinel names.

subq's own clients (the store of every process, a worker's pool, the API's health
reads, the CLI, `subq up`'s check) come from `redis_client`; Celery's broker and
result backend take the same choice as a URL and transport options
(`celery_url`, `sentinel_transport_options`), for kombu's and
Celery's own sentinel transports (`sentinel://h1:p1;sentinel://h2:p2` with
`master_name`).

With one Redis a client is `redis.Redis.from_url`, exactly as before this module
existed. Under Sentinel it is `Sentinel(...).master_for(...)`: every new
connection asks the sentinels where the master is, so a connection lost in a
failover reconnects to the replica they promoted. A command that fails with a
connection error meanwhile is sent again with backoff (`failover_retry`) for
about as long as a failover takes, so a run in flight carries on with its step on
the new master rather than failing its task. Every step subq sends is
idempotent (guarded in its Lua script or re-validated by its transaction), so
one sent twice, once to the old master and once to the new, changes nothing.
"""

from __future__ import annotations

import socket
from typing import Any, cast
from urllib.parse import quote

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from coordinator.settings import Settings

__all__ = [
    "FAILOVER_RETRIES",
    "SENTINEL_ASK_TIMEOUT_S",
    "SENTINEL_CONNECT_TIMEOUT_S",
    "BlockingSentinelConnectionPool",
    "celery_url",
    "describe",
    "failover_retry",
    "redis_client",
    "sentinel_transport_options",
]

# A failover takes the sentinels' down-after-milliseconds (5 s in deploy/) plus an election and the
# promotion (a second or two): a command is sent again for about 30 s (0.05 s doubling to 1 s, then
# each second), so a run in flight outlasts a failover, and a Redis that stays gone still fails it.
FAILOVER_RETRIES = 34
FAILOVER_BACKOFF_CAP_S = 1.0
FAILOVER_BACKOFF_BASE_S = 0.05
# ReadOnlyError: a command that reached the old master after it came back as a replica. redis-py's
# sentinel connection already turns the replies it reads itself into a ConnectionError; this covers
# any other path, and each retry reconnects, to the master the sentinels name by then.
FAILOVER_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError)


def failover_retry() -> Retry:
    """How a command that lost its connection is sent again under Sentinel (one per client: it is theirs)."""
    backoff = ExponentialBackoff(cap=FAILOVER_BACKOFF_CAP_S, base=FAILOVER_BACKOFF_BASE_S)
    return Retry(backoff, FAILOVER_RETRIES, FAILOVER_ERRORS)


# A new connection to a master whose machine died waits this long before the next try.
SENTINEL_CONNECT_TIMEOUT_S = 5.0
# A sentinel on the same network answers in a millisecond; one silent this long is passed over.
SENTINEL_ASK_TIMEOUT_S = 1.0
# A master whose machine died does not close its sockets. No read timeout finds it, since `wait` and
# the live views block on XREAD for as long as they were asked to; TCP keepalive probes do: silent
# for 5 s, then 3 probes 2 s apart, and the connection fails over about 11 s after the machine died.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3


class BlockingSentinelConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """The sentinel-managed pool, which makes a thread wait for a free connection (a worker's pool)."""


def redis_client(
    settings: Settings,
    *,
    decode_responses: bool = True,
    max_connections: int | None = None,
    pool_timeout_s: float | None = None,
    **options: Any,
) -> redis.Redis:
    """A client of subq's Redis: the one URL's, or the master's the sentinels name.

    `pool_timeout_s` gives a blocking pool of `max_connections` (a thread waits that long
    for a free connection, as a worker's pool threads do); `options` are redis-py's
    connection options (timeouts, `retry`), which win over this module's defaults.
    """
    settings.require_redis()
    pool_options: dict[str, Any] = {}
    if max_connections is not None:
        pool_options["max_connections"] = max_connections
    if settings.redis_sentinels is None:
        url = settings.require_redis_url()
        if pool_timeout_s is None:
            return redis.Redis.from_url(url, decode_responses=decode_responses, **pool_options, **options)
        pool = redis.BlockingConnectionPool.from_url(
            url, decode_responses=decode_responses, timeout=pool_timeout_s, **pool_options, **options
        )
        return redis.Redis(connection_pool=pool)
    if pool_timeout_s is not None:
        pool_options.update(connection_pool_class=BlockingSentinelConnectionPool, timeout=pool_timeout_s)
    data = {
        "socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
        "socket_keepalive_options": _keepalive_options(),
        "retry": failover_retry(),
        **options,
    }
    if settings.redis_password is not None:
        data["password"] = settings.redis_password.get_secret_value()
    sentinels = settings.sentinel_addresses()
    sentinel = Sentinel(sentinels, sentinel_kwargs=_sentinel_kwargs(settings, data))  # type: ignore[no-untyped-call]
    master = settings.redis_sentinel_master
    assert master is not None  # Settings requires it with the sentinels
    client = sentinel.master_for(master, decode_responses=decode_responses, **pool_options, **data)  # type: ignore[no-untyped-call]
    return cast(redis.Redis, client)


def _keepalive_options() -> dict[int, int]:
    """TCP keepalive timings where the platform has them (Linux does; others keep their defaults)."""
    wanted = {"TCP_KEEPIDLE": KEEPALIVE_IDLE_S, "TCP_KEEPINTVL": KEEPALIVE_INTERVAL_S, "TCP_KEEPCNT": KEEPALIVE_PROBES}
    return {getattr(socket, name): value for name, value in wanted.items() if hasattr(socket, name)}


def _sentinel_kwargs(settings: Settings, data: dict[str, Any]) -> dict[str, Any]:
    """How a client talks to the sentinels themselves: their password, short timeouts, no retry of its own.

    A sentinel that does not answer at once is skipped for the next one (redis-py then asks the
    one that answered first); redis-py's default would try a dead one four times, seconds each.
    """
    own = {name: value for name, value in data.items() if name.startswith("socket_")}
    own["socket_connect_timeout"] = min(
        own.get("socket_connect_timeout", SENTINEL_ASK_TIMEOUT_S), SENTINEL_ASK_TIMEOUT_S
    )
    own["socket_timeout"] = min(own.get("socket_timeout") or SENTINEL_ASK_TIMEOUT_S, SENTINEL_ASK_TIMEOUT_S)
    own["retry"] = Retry(NoBackoff(), 0)
    if settings.redis_sentinel_password is not None:
        own["password"] = settings.redis_sentinel_password.get_secret_value()
    return own


def celery_url(settings: Settings) -> str:
    """Celery's broker and result backend URL: the one Redis's, or
    `sentinel://[:password@]host:port;sentinel://host:port;...`.

    kombu's and Celery's sentinel transports read the data password from the first
    address (and only the sentinels' addresses from the rest).
    """
    settings.require_redis()
    if settings.redis_sentinels is None:
        return settings.require_redis_url()
    auth = ""
    if settings.redis_password is not None:
        auth = f":{quote(settings.redis_password.get_secret_value(), safe='')}@"
    parts = []
    for n, (host, port) in enumerate(settings.sentinel_addresses()):
        parts.append(f"sentinel://{auth if n == 0 else ''}{_bracketed(host)}:{port}")
    return ";".join(parts)


def sentinel_transport_options(settings: Settings) -> dict[str, Any]:
    """What kombu's and Celery's sentinel transports need beside the URL; nothing with one Redis."""
    if settings.redis_sentinels is None:
        return {}
    options: dict[str, Any] = {"master_name": settings.redis_sentinel_master}
    if settings.redis_sentinel_password is not None:
        options["sentinel_kwargs"] = {"password": settings.redis_sentinel_password.get_secret_value()}
    return options


def describe(settings: Settings) -> str:
    """Where subq's Redis is, without a password: for banners and log lines."""
    if settings.redis_sentinels is None:
        url = settings.redis_url or ""
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url
    addresses = ",".join(f"{_bracketed(host)}:{port}" for host, port in settings.sentinel_addresses())
    return f"master {settings.redis_sentinel_master!r} of the sentinels {addresses}"


def _bracketed(host: str) -> str:
    """An IPv6 address in brackets, as a URL and host:port write it."""
    return f"[{host}]" if ":" in host else host
