"""The Celery app factory and subq's task names (the contract producers send by name).

Both planes build their app here from the same `Settings`: the coordinator
to publish work by task name, `workers.app` to run it. JSON only; late acks
with prefetch 1, so a worker takes only what its threads can start; the Redis
visibility timeout above the task time limit, so a slow message other than a
run is not delivered twice (a worker holds a run message in memory, and the
reconciler brings a lost run back: workers/run_acks.py); events on so Flower
sees every task.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis
from celery import Celery
from celery.app.amqp import AMQP
from celery.backends.redis import RedisBackend, SentinelBackend
from kombu.connection import Connection, ConnectionPool, PooledConnection
from kombu.pools import ProducerPool
from kombu.transport import redis as kombu_redis

from coordinator import tracing
from coordinator.errors import BrokerError
from coordinator.redis_clients import (
    ROLE_CHECK_INTERVAL_S,
    FollowingConnection,
    FollowingSSLConnection,
    celery_tls,
    celery_url,
    sentinel_transport_options,
)
from coordinator.settings import Settings

__all__ = [
    "ADVANCE",
    "BROKER_POOL_ACQUIRE_TIMEOUT_S",
    "RUN_TASK",
    "SUBMIT",
    "BoundedConnectionPool",
    "BoundedProducerPool",
    "BrokerPoolExhausted",
    "FollowingSentinelBackend",
    "FollowingSentinelChannel",
    "FollowingSentinelTransport",
    "PublishOnlyRedisBackend",
    "PublishOnlySentinelBackend",
    "SubqCelery",
    "describe_args",
    "describe_kwargs",
    "make_app",
    "result_backend_url",
]

# The task names: the coordinator publishes by these names and never imports `workers`.
RUN_TASK = "subq.run_task"
ADVANCE = "subq.advance"
SUBMIT = "subq.submit"
BACKEND_RETRY_POLICY = {"max_retries": 5, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}
# The worker's consumer dead-letters a message it cannot decode or validate instead of dying
# on it (workers/poison.py). Named, not imported: the coordinator plane never loads it.
POISON_SAFE_CONSUMER = "workers.poison:PoisonSafeConsumer"
# Flower shows kwargsrepr; a profile name is short, anything longer is not a name.
PROFILE_REPR_CHARS = 40
# The longest a publish or a control broadcast waits for a connection (or a producer)
# of the app's broker pool (broker_pool_limit, 10) before it fails with a BrokerError
# (503 in the API; a run's publish is retried by the reconciler). A publish holds one
# for milliseconds, so a wait this long means the pool is wedged, not busy.
BROKER_POOL_ACQUIRE_TIMEOUT_S = 5.0
# How a lost broker connection is tried again under Sentinel (kombu's own: 2 s, then 4, 6, ...
# between rounds). Each try asks the sentinels, which answer at once, for the master: rounds at
# most a second apart find the promoted one within a second instead of up to 8 s later.
SENTINEL_RECONNECT_S = {"interval_start": 0.5, "interval_step": 0.5, "interval_max": 1.0}


def describe_args(args: Sequence[Any]) -> str:
    """A submission's positional arguments as Flower may show them: only how many (it refuses any)."""
    return f"<{len(args)} positional argument(s): refused>" if args else ""


def describe_kwargs(kwargs: Mapping[str, Any]) -> str:
    """A submission as Flower may show it: sizes and names, never the prompt or a message."""
    parts = []
    for name, value in kwargs.items():
        if name == "prompt":
            size = f"{len(value)} chars" if isinstance(value, str) else type(value).__name__
            parts.append(f"prompt=<{size}>")
        elif name == "todos":
            lines = value.count("\n") + 1 if isinstance(value, str) else len(value) if isinstance(value, list) else 0
            parts.append(f"todos=<{lines} items>")
        elif name == "subtasks":
            parts.append(f"subtasks=<{len(value) if isinstance(value, list) else '?'}>")
        elif name == "webhooks":
            # Never a URL (it may carry a token) nor a secret: how many, as for subtasks.
            parts.append(f"webhooks=<{len(value) if isinstance(value, list) else '?'}>")
        elif name == "on_complete":
            task = value.get("task") if isinstance(value, dict) else value
            parts.append(f"on_complete={str(task)[:PROFILE_REPR_CHARS]!r}")
        elif name in ("profile", "run", "mode", "idempotency_key", "tenant", "priority"):
            shown = value if isinstance(value, bool) or value is None else str(value)[:PROFILE_REPR_CHARS]
            parts.append(f"{name}={shown!r}")
        else:
            parts.append(f"{str(name)[:PROFILE_REPR_CHARS]}=<unknown field>")
    return " ".join(parts)


class PublishOnlyRedisBackend(RedisBackend):  # type: ignore[misc]
    """The Redis result backend, minus a subscription per published task.

    Celery's Redis backend subscribes the publisher to every task's result
    channel so that `AsyncResult.get()` can return fast. subq never waits on an
    AsyncResult (no task blocks on another's result; `Coordinator.wait` reads
    subq's own state), so those subscriptions were pure cost: one pub/sub
    channel per child, and errors from their cleanup at interpreter exit.
    Chord joins do not use them (they count results in Redis).
    """

    def on_task_call(self, producer: Any, task_id: str) -> None:
        return None

    def add_pending_result(self, result: Any, weak: bool = False, start_drainer: bool = True) -> Any:
        # A group's publish adds every member's result to its barrier (weakly), which
        # subscribed the publisher to each member's channel: one SUBSCRIBE a child, measured
        # in bench/. `AsyncResult.get()` adds its result strongly, and still subscribes.
        if weak:
            return result
        return super().add_pending_result(result, weak=weak, start_drainer=start_drainer)

    def on_result_fulfilled(self, result: Any) -> None:
        # Nothing was subscribed, so there is nothing to unsubscribe (this ran from
        # AsyncResult.__del__, reconnecting to Redis at interpreter exit).
        return None


class FollowingSentinelBackend(SentinelBackend):  # type: ignore[misc]
    """Celery's `SentinelBackend`, whose connections follow a switch as subq's own do (`FollowingConnection`).

    Celery's takes redis-py's sentinel-managed connection, which reconnects to the address it had
    (redis-py issue 3874) and takes a master's NOREPLICAS for a failed command.
    """

    connection_class_ssl = FollowingSSLConnection

    def _get_pool(self, **params: Any) -> Any:
        params.setdefault("connection_class", FollowingConnection)  # TLS sets connection_class_ssl's
        return super()._get_pool(**params)


class PublishOnlySentinelBackend(PublishOnlyRedisBackend, FollowingSentinelBackend):
    """`PublishOnlyRedisBackend` on the master Redis Sentinel names (`FollowingSentinelBackend`)."""


def result_backend_url(settings: Settings, on_redis: type[RedisBackend], on_sentinel: type[SentinelBackend]) -> str:
    """Celery's `result_backend`: a backend class of subq's by path, for one Redis or for the sentinels."""
    backend = on_sentinel if settings.redis_sentinels is not None else on_redis
    return f"{backend.__module__}:{backend.__name__}+{celery_url(settings)}"


class BrokerPoolExhausted(BrokerError):
    """Every connection or producer of the broker pool stayed in use for BROKER_POOL_ACQUIRE_TIMEOUT_S."""


class BoundedConnectionPool(ConnectionPool):
    """kombu's connection pool, whose blocking acquire gives up after `acquire_timeout_s`.

    kombu waits for a free connection forever when no timeout is given, and its
    own producer pool asks that way (`ProducerPool._acquire_connection`, block,
    no timeout), as do Celery's control broadcasts (a revoke) through it. A
    broadcast holds one connection while its producer waits for a second, so
    enough concurrent broadcasts held every connection and waited for each other
    for good: the incident where 40 concurrent GET /healthz (a worker ping each)
    hung every API thread until a restart. Here every blocking acquire ends: a
    connection, or `BrokerPoolExhausted` (a BrokerError, so the API answers 503
    store_error instead of hanging; not kombu's LimitExceeded, which Celery
    would turn into an OperationalError, a 500).
    """

    def __init__(self, connection: Any, limit: int | None, acquire_timeout_s: float) -> None:
        self.acquire_timeout_s = acquire_timeout_s
        super().__init__(connection, limit=limit)  # type: ignore[no-untyped-call]  # kombu has partial hints

    def acquire(self, block: bool = False, timeout: float | None = None) -> Any:
        return _bounded(super().acquire, "connection", self, block, timeout)

    def new(self) -> Any:
        # kombu's makes each a PooledConnection, whatever the pool's connection class: a publish
        # after a planned switch went to the old master through one (READONLY, the batch refused).
        return PooledBrokerConnection(self, **dict(self.connection._info(resolve=False)))  # type: ignore[no-untyped-call]


class BoundedProducerPool(ProducerPool):
    """kombu's producer pool over a `BoundedConnectionPool`, whose own acquire ends the same way."""

    def __init__(self, connections: BoundedConnectionPool, limit: int | None) -> None:
        self.acquire_timeout_s = connections.acquire_timeout_s
        super().__init__(connections, limit=limit)  # type: ignore[no-untyped-call]

    def acquire(self, block: bool = False, timeout: float | None = None) -> Any:
        return _bounded(super().acquire, "producer", self, block, timeout)


def _bounded(acquire: Any, what: str, pool: Any, block: bool, timeout: float | None) -> Any:
    if block and timeout is None:
        timeout = pool.acquire_timeout_s
    try:
        return acquire(block=block, timeout=timeout)
    except pool.LimitExceeded:
        waited = f"after {timeout:g} s" if block else "(not waiting)"
        raise BrokerPoolExhausted(
            f"The broker is busy: all {pool.limit} {what}s of this process's broker pool stayed in use; "
            f"gave up {waited}. Try again."
        ) from None


class FollowingSentinelChannel(kombu_redis.SentinelChannel):
    """kombu's sentinel channel, on subq's `FollowingConnection`: a broker connection follows a switch.

    kombu's takes redis-py's sentinel-managed connection, which reconnects to the address it had
    without asking the sentinels (redis-py issue 3874). After a planned switch a worker's consumer
    stayed on the old master, now a replica, restoring its unacknowledged messages there, and in 3
    of 5 runs no worker took new work within 120 s; a BRPOP that met the old master's NOREPLICAS
    (min-replicas-to-write) ended the worker ("Unrecoverable error"). Here each reconnect asks the
    sentinels and takes only a master, and NOREPLICAS is a lost connection, which the consumer
    survives by reconnecting (tests/test_sentinel_fleet.py, the planned switch).
    """

    connection_class = FollowingConnection
    connection_class_ssl = FollowingSSLConnection  # type: ignore[assignment]  # kombu's is its base

    def _connparams(self, asynchronous: bool = False) -> Any:
        params = super()._connparams(asynchronous=asynchronous)  # type: ignore[no-untyped-call]
        if not asynchronous:  # the consumer's own BRPOP connection raises: kombu re-registers a new socket
            ssl = issubclass(params["connection_class"], FollowingSSLConnection)
            params["connection_class"] = BrokerFollowingSSLConnection if ssl else BrokerFollowingConnection
        return params


class BrokerFollowingConnection(FollowingConnection):
    """`FollowingConnection` for kombu's commands (a publish, an ack): one that finds its server a replica
    now reconnects through the sentinels before sending, rather than failing the command.

    kombu sends a batch of messages once only, never again (its delivery would be uncertain), so a
    publish after a planned switch on a pooled connection to the old master was refused (a BrokerError
    to the caller) though nothing of it had been sent. subq's own clients raise instead, which starts a
    watched transaction again; kombu watches no key.
    """

    def check_health(self) -> None:
        try:
            super().check_health()
        except redis.ConnectionError:
            self.connect()  # asks the sentinels; a master only


class BrokerFollowingSSLConnection(BrokerFollowingConnection, FollowingSSLConnection):
    """`BrokerFollowingConnection` over TLS."""


class FollowingSentinelTransport(kombu_redis.SentinelTransport):
    """kombu's sentinel transport (`sentinel://`) with `FollowingSentinelChannel`s."""

    Channel = FollowingSentinelChannel


class BrokerConnection(Connection):
    """kombu's broker connection, which under Sentinel is tried again at most a second apart when lost,
    on `FollowingSentinelTransport`.

    A worker's consumer reconnects through `ensure_connection` (Celery passes no intervals),
    and so takes new messages again within a second of a promotion. The transport is chosen
    here, each time one is made, rather than by a `transport` argument: kombu resets that to
    the URL's scheme when a lost connection moves on to the next sentinel's address (`switch`).
    """

    def get_transport_cls(self) -> Any:
        transport = super().get_transport_cls()  # type: ignore[no-untyped-call]
        return FollowingSentinelTransport if transport is kombu_redis.SentinelTransport else transport

    def ensure_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self.transport_cls == "sentinel" and len(args) <= 2:  # the intervals not given positionally
            kwargs = {**SENTINEL_RECONNECT_S, **kwargs}
        return super().ensure_connection(*args, **kwargs)  # type: ignore[no-untyped-call]


class PooledBrokerConnection(PooledConnection, BrokerConnection):
    """A connection of the app's broker pool (`BoundedConnectionPool`): kombu's pooled one, a `BrokerConnection`."""


class SubqAMQP(AMQP):  # type: ignore[misc]  # Celery ships no type hints
    """Celery's AMQP helper whose producer pool is a `BoundedProducerPool` over the app's own pool.

    Celery's takes kombu's process-wide producer pool, over kombu's process-wide
    connection pool, whose waits have no end (`BoundedConnectionPool`). Its connections
    are `BrokerConnection`s.
    """

    Connection = BrokerConnection
    BrokerConnection = BrokerConnection  # Celery's compat alias
    _producer_pool: BoundedProducerPool | None

    @property
    def producer_pool(self) -> BoundedProducerPool:
        if self._producer_pool is None:
            self._producer_pool = BoundedProducerPool(self.app.pool, limit=self.app.pool.limit)
        return self._producer_pool

    publisher_pool = producer_pool  # Celery's compat alias


class SubqCelery(Celery):  # type: ignore[misc]  # Celery ships no type hints
    """subq's Celery app: a `subq.submit` it publishes carries a safe summary, never the prompt.

    The producer's `task-sent` event carries `argsrepr`/`kwargsrepr` (Python's
    repr of the arguments when none is given), and Celery's event state lets a
    sent event that arrives after the worker's `task-received` overwrite the
    worker's safe summary. subq's own Flower drops the arguments of every
    `subq.*` sent event (workers/flower_setup.py); for any other monitor of the
    event stream, the summary is computed here, at publish time, as well.
    """

    # The settings the app was made from: the worker's consumer writes dead letters with them.
    subq_settings: Settings | None = None
    amqp_cls = f"{__name__}:SubqAMQP"
    _pool: BoundedConnectionPool | None

    @property
    def pool(self) -> BoundedConnectionPool:
        """The broker connection pool: Celery's, except that no acquire waits for good (`BoundedConnectionPool`)."""
        if self._pool is None:
            self._ensure_after_fork()  # as Celery's: a forked child builds a pool of its own
            self._pool = BoundedConnectionPool(
                self.connection_for_write(), self.conf.broker_pool_limit, BROKER_POOL_ACQUIRE_TIMEOUT_S
            )
        return self._pool

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        if name == SUBMIT and isinstance(kwargs, Mapping) and "kwargsrepr" not in options:
            options["kwargsrepr"] = describe_kwargs(kwargs)
        if name == SUBMIT and isinstance(args, Sequence) and "argsrepr" not in options:
            options["argsrepr"] = describe_args(args)
        return super().send_task(name, args, kwargs, **options)


def make_app(settings: Settings) -> Celery:
    settings.require_redis()
    tracing.setup(settings)  # before any publish: a no-op unless SUBQ_TRACES_EXPORTER is set
    backend = result_backend_url(settings, PublishOnlyRedisBackend, PublishOnlySentinelBackend)
    app = SubqCelery("subq", broker=celery_url(settings), backend=backend, set_as_current=False)
    # Under Redis Sentinel, kombu's and Celery's sentinel transports take the master's name here.
    transport = {"visibility_timeout": settings.visibility_timeout_s, **sentinel_transport_options(settings)}
    broker_transport = {
        **transport,
        # Sweep for lost tasks every restore_interval_s (throttle 1: each sweep scans).
        "unacked_restore_interval": settings.restore_interval_s,
        "unacked_restore_throttle": 1,
    }
    if settings.redis_sentinels is not None:
        # A broker connection idle this long asks ROLE before its next command (FollowingConnection): after a
        # planned switch, a publish on a pooled connection to the old master met READONLY, and kombu sends a
        # batch once only (delivery uncertain), so its delegation was refused. kombu's own checks of the
        # consumer's BRPOP and pub/sub connections run as often: a PING, or a look at a socket.
        broker_transport["health_check_interval"] = ROLE_CHECK_INTERVAL_S
        app.conf.redis_backend_health_check_interval = ROLE_CHECK_INTERVAL_S
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        # A task whose pool process died is put back on its queue (prefork; bounded: the runner counts
        # deliveries). A whole worker lost is the reconciler's to repair: workers/run_acks.py.
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=broker_transport,
        # A result store that is down fails a publish in about three seconds (Celery's own
        # policy retries for 19 s); the caller gets a BrokerError and the reconciler retries.
        result_backend_transport_options={**transport, "retry_policy": BACKEND_RETRY_POLICY},
        task_time_limit=settings.task_time_limit_s,
        task_default_queue=settings.queue,
        task_routes={"subq.*": {"queue": settings.queue}},
        result_expires=settings.result_retention_s,
        result_extended=True,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        worker_pool=settings.worker_pool,
        worker_concurrency=settings.worker_concurrency,
        broker_connection_retry_on_startup=True,
        # A worker waits out a broker outage however long it lasts: Celery's 100 tries end a worker for good, and
        # under Sentinel each sentinel's address is a try of its own (about 30 s with three sentinels), runs in
        # flight dying unhanded back with it.
        broker_connection_max_retries=None,
        worker_hijack_root_logger=False,
    )
    tls = celery_tls(settings)
    if tls is not None:  # TLS to the nodes under Sentinel (one Redis keeps it in its rediss:// URL)
        app.conf.update(broker_use_ssl=tls, redis_backend_use_ssl=tls)
    app.conf.worker_consumer = POISON_SAFE_CONSUMER
    app.subq_settings = settings
    return app
