"""GET /livez, /readyz, /healthz and /metrics: open endpoints for probes, load balancers and Prometheus.

None needs the bearer token (they carry no task data), so anyone who reaches the
API can call them as often as they like. Each answers from state that costs at
most one Redis read per second or two, whatever the number of callers, and
none of them takes a thread of the shared pool that the /v1 routes run on:

- `/livez`: the process is up; no Redis, no thread, always 200.
- `/readyz`: Redis answers (200, or 503 `down`); the workers whose heartbeat is
  within SUBQ_HEARTBEAT_LAPSE_S are reported but do not make the API unready:
  it takes work with no worker up, and the work waits in the queue.
- `/healthz`: the same answer as /readyz, kept for the clients that call it.
- `/metrics`: collected from Redis by a collector on a fresh registry (no
  process-global state: every API replica reports the same fleet-wide figures:
  what the fleet holds now, queue depth, runs in flight, approvals waiting, dead
  letters, and what Redis already counts, repairs and the latency histogram).
  The counters of runs, model requests, tokens and cost are each worker's own
  (workers/observe.py, docs/api.md).

Why: /healthz used to ping Redis with a fresh client and broadcast a ping to the
workers through Celery's shared broker pool on every call, on the shared thread
pool. 40 concurrent calls deadlocked that pool (each call held a broker
connection while it waited for another, for its producer) and took every
thread of the 40 with it: every /v1 route and /ui page timed out until a
restart. Now a `SingleFlight` cache reads the health (one ZRANGEBYSCORE over the
heartbeats, on a client of its own with short socket timeouts) and the metrics
in a thread of its own, at most one read in flight, and a request waits for it
a bounded time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from redis.backoff import NoBackoff
from redis.retry import Retry

from coordinator.api.errors import error_responses
from coordinator.api.schemas import Health, Liveness, RedisHealth, WorkersHealth
from coordinator.errors import StoreError
from coordinator.models import TaskStatus
from coordinator.redis_clients import redis_client
from coordinator.service import Coordinator
from coordinator.tenants import TenantState

__all__ = [
    "HEALTH_CACHE_TTL_S",
    "HEALTH_REDIS_TIMEOUT_S",
    "HEALTH_WAIT_S",
    "METRICS_CACHE_TTL_S",
    "METRICS_RECENT_TASKS",
    "METRICS_WAIT_S",
    "RefreshPending",
    "SingleFlight",
    "SubqCollector",
    "health_reader",
    "ops_routes",
]

T = TypeVar("T")

# A probe every few seconds still sees a reading at most this old, and a flood of
# health calls costs one Redis read per period, not one per call.
HEALTH_CACHE_TTL_S = 1.0
# Connect and read timeout of the health check's own Redis client: a Redis that takes
# longer than this for one ZRANGEBYSCORE is not fit to serve requests.
HEALTH_REDIS_TIMEOUT_S = 1.0
# How long a health call waits for the reading in flight before answering `down`:
# above one connect plus one read (HEALTH_REDIS_TIMEOUT_S each), within a probe's 5 s.
HEALTH_WAIT_S = 2.5
# Prometheus scrapes every 15 s or so; a flood of scrapes costs one collection per period.
METRICS_CACHE_TTL_S = 2.0
# How long a scrape waits for the collection in flight before a 503: within
# Prometheus' default scrape timeout of 10 s.
METRICS_WAIT_S = 5.0
# Task counts and spend are read over this many most recent tasks of the history
# index, so a scrape stays cheap however long the retention is.
METRICS_RECENT_TASKS = 1000
# The label of every tenant the tenants table does not name: their number is the callers', not the operator's,
# so each gets no series of its own (a metric's labels must stay few).
OTHER_TENANTS = "other"


class RefreshPending(StoreError):
    """The reading in flight took longer than a request waits for it (503 store_error)."""


class SingleFlight(Generic[T]):
    """A value read by `read` at most once per `ttl_s`, in a thread of its own, shared by every caller.

    Concurrent callers of `get` share the one read in flight (single-flight) and
    wait for it at most `wait_s` (then `RefreshPending`); a read that raises is
    not cached, and its exception goes to the callers that waited for it. The
    read never runs on the event loop nor on anyio's thread pool (that pool runs
    the /v1 routes: a slow read must not take their threads).
    """

    def __init__(self, read: Callable[[], T], *, ttl_s: float, wait_s: float, name: str) -> None:
        self._read = read
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.name = name
        self.reads = 0  # reads started, for tests and for whoever wants to know the cost
        self._lock = threading.Lock()
        self._value: T | None = None
        self._read_at = 0.0  # time.monotonic() when _value was read
        self._pending: concurrent.futures.Future[T] | None = None

    def cached(self) -> T | None:
        """The value, if read within the last `ttl_s`."""
        with self._lock:
            if self._value is not None and time.monotonic() - self._read_at < self.ttl_s:
                return self._value
            return None

    async def get(self) -> T:
        value = self.cached()
        if value is not None:
            return value
        waiter = asyncio.wrap_future(self._start())
        done, _ = await asyncio.wait({waiter}, timeout=self.wait_s)
        if not done:
            # Nobody reads this result now; retrieving it keeps asyncio from logging
            # "exception was never retrieved" when the read fails later.
            waiter.add_done_callback(_discard)
            raise RefreshPending(f"{self.name}: Redis did not answer within {self.wait_s:g} s")
        return waiter.result()

    def _start(self) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._pending is None:
                future: concurrent.futures.Future[T] = concurrent.futures.Future()
                # Running from the start: an awaiting request that is cancelled cannot cancel it.
                future.set_running_or_notify_cancel()
                self._pending = future
                self.reads += 1
                threading.Thread(target=self._run, args=(future,), name=f"subq-{self.name}", daemon=True).start()
            return self._pending

    def _run(self, future: concurrent.futures.Future[T]) -> None:
        try:
            value = self._read()
        except BaseException as exc:  # handed to the callers waiting; nothing is cached
            with self._lock:
                self._pending = None
            future.set_exception(exc)
            return
        with self._lock:
            self._value, self._read_at, self._pending = value, time.monotonic(), None
        future.set_result(value)


def _discard(waiter: asyncio.Future[Any]) -> None:
    if not waiter.cancelled():
        waiter.exception()


def _node_of(member: str) -> str | None:
    """The Celery node of a heartbeat entry, or None for an entry that is not a node's.

    A worker's reconciler beats as `<node>:<pid>` every third of SUBQ_HEARTBEAT_LAPSE_S
    (workers/maintenance.py), and a node's name is `<name>@<host>`; the runs'
    own heartbeats (`<host>:<pid>`, coordinator/runs.py) have no `@`. A node
    restarted under the same name counts once.
    """
    node, _, _pid = member.rpartition(":")
    return node if "@" in node else None


def health_reader(coord: Coordinator) -> Callable[[], Health]:
    """The health reading: one ZRANGEBYSCORE of the heartbeats, on a client of the health check's own.

    Its own client: short socket timeouts so a Redis that hangs fails the reading
    instead of hanging it, no retries (the next reading is the retry), and one
    connection, since `SingleFlight` runs one reading at a time.
    """
    # A Coordinator over that client: the read goes through the service, as every face's does.
    readers: list[Coordinator] = []

    def read() -> Health:
        try:
            if not readers:
                client = redis_client(
                    coord.settings,
                    socket_timeout=HEALTH_REDIS_TIMEOUT_S,
                    socket_connect_timeout=HEALTH_REDIS_TIMEOUT_S,
                    retry=Retry(NoBackoff(), 0),
                    max_connections=1,
                )
                readers.append(Coordinator(coord.settings, client=client, app=coord.app))
            started = time.perf_counter()
            members = readers[0].workers_since(time.time() - coord.settings.heartbeat_lapse_s)
            latency_ms = round((time.perf_counter() - started) * 1000, 3)
        except Exception as exc:  # redis's errors, a bad URL: the check must answer
            return _down(f"Redis is unreachable: {exc}")
        nodes = {node for member in members if (node := _node_of(str(member))) is not None}
        workers = WorkersHealth(count=len(nodes))
        return Health(
            status="ok" if nodes else "degraded", redis=RedisHealth(ok=True, latency_ms=latency_ms), workers=workers
        )

    return read


def _down(error: str) -> Health:
    workers = WorkersHealth(count=0, error="not checked: Redis is unreachable")
    return Health(status="down", redis=RedisHealth(ok=False, error=error), workers=workers)


class SubqCollector(Collector):
    """subq's figures, read from Redis at scrape time."""

    def __init__(self, coord: Coordinator, recent_tasks: int = METRICS_RECENT_TASKS) -> None:
        self.coord = coord
        self.recent_tasks = recent_tasks

    def collect(self) -> Iterable[Metric]:
        return list(self._metrics())

    def _metrics(self) -> Iterator[Metric]:
        records = self.coord.recent_records(self.recent_tasks)
        window = f"the {self.recent_tasks} most recent tasks of the history index (older tasks are not counted)"
        tasks = GaugeMetricFamily("subq_tasks", f"Tasks by status, over {window}", labels=["status"])
        for status in TaskStatus:
            tasks.add_metric([status.value], sum(1 for r in records if r.status == status))
        yield tasks
        yield GaugeMetricFamily(
            "subq_root_spend_micro_usd",
            f"Total spend in micro-USD of the root tasks (each root's total covers its whole tree), over {window}",
            value=sum(r.total_cost_micros for r in records if r.parent_id is None),
        )
        queue = self.coord.settings.queue
        fleet = self.coord.fleet_gauges()
        depth = GaugeMetricFamily("subq_queue_depth", "Celery messages waiting in the Redis queue", labels=["queue"])
        depth.add_metric([queue], fleet.queue_depth)
        yield depth
        in_flight = GaugeMetricFamily(
            "subq_runs_in_flight",
            "Runs published and not yet ended (waiting in the queue or running); tasks waiting on children "
            "or a decision are not counted",
            labels=["queue"],
        )
        in_flight.add_metric([queue], fleet.runs_in_flight)
        yield in_flight
        yield GaugeMetricFamily(
            "subq_approvals_waiting", "Tool calls waiting for a human decision", value=fleet.approvals_waiting
        )
        repairs = CounterMetricFamily(
            "subq_repairs", "Tree states the reconciler moved on, by reason (docs/architecture.md)", labels=["reason"]
        )
        for reason, count in sorted(self.coord.repairs().items()):
            repairs.add_metric([reason], count)
        yield repairs
        yield GaugeMetricFamily(
            "subq_dead_letters", "Messages no worker could decode or validate, kept", value=fleet.dead_letters
        )
        refused = CounterMetricFamily(
            "subq_refused_requests",
            "Requests the API and the web view refused (401, 403), by reason, fleet-wide (docs/security.md)",
            labels=["reason"],
        )
        for reason, count in sorted(self.coord.refused_counts().items()):
            refused.add_metric([reason], count)
        yield refused
        deliveries = CounterMetricFamily(
            "subq_webhook_deliveries",
            "Attempts to deliver outbound events (webhooks, Celery callbacks), by event type and outcome: "
            "delivered, retrying, gone (410), given_up; fleet-wide (docs/webhooks.md)",
            labels=["event", "outcome"],
        )
        for (event, outcome), count in sorted(self.coord.delivery_counts().items()):
            deliveries.add_metric([event, outcome], count)
        yield deliveries
        yield GaugeMetricFamily(
            "subq_webhook_oldest_pending_seconds",
            "How long the most overdue pending delivery has waited past its time (0: none is late)",
            value=self.coord.oldest_delivery_wait_s(),
        )
        yield CounterMetricFamily(
            "subq_replica_shortfalls",
            "Steps this API process acknowledged whose WAIT heard from fewer replicas than SUBQ_REDIS_MIN_REPLICAS "
            "within SUBQ_REDIS_REPLICA_WAIT_MS (each stands on the master; docs/deploy.md, 'Redis failover')",
            value=self.coord.replica_shortfalls(),
        )
        yield self._latency()
        yield from self._tenants()

    def _tenants(self) -> Iterator[Metric]:
        """Per tenant, with bounded labels: a tenant the tenants table names has its own; every other tenant (a
        key's name, a `subq.submit` argument: as many as callers make) is added up under `other`."""
        figures: dict[str, tuple[str, Callable[[TenantState], int]]] = {
            "subq_tenant_running": ("Tasks of the tenant running on a worker", lambda s: s.running),
            "subq_tenant_waiting": ("Tasks of the tenant queued (for a worker or for admission)", lambda s: s.waiting),
            "subq_tenant_roots_running": ("Roots of the tenant not yet ended", lambda s: s.roots_running),
            "subq_tenant_submits_last_minute": (
                "Roots the tenant created in the last 60 s",
                lambda s: s.submits_last_minute,
            ),
            "subq_tenant_spend_day_micro_usd": (
                "Micro-USD the tenant's trees spent in the rolling day (24 hourly buckets)",
                lambda s: s.spent_micros_day,
            ),
        }
        states = self.coord.tenants()
        for name, (text, of) in figures.items():
            family = GaugeMetricFamily(
                name, f"{text}; tenants not in SUBQ_TENANTS are summed as `other`", labels=["tenant"]
            )
            by_label: dict[str, int] = {}
            for state in states:
                label = state.tenant if state.listed else OTHER_TENANTS
                by_label[label] = by_label.get(label, 0) + of(state)
            for label, value in sorted(by_label.items()):
                family.add_metric([label], value)
            yield family
        quota = GaugeMetricFamily(
            "subq_tenant_spend_quota_micro_usd",
            "A listed tenant's max_cost_usd_per_day in micro-USD (0: no quota)",
            labels=["tenant"],
        )
        for state in states:
            if state.listed:
                quota.add_metric([state.tenant], state.policy.max_cost_micros_per_day)
        yield quota

    def _latency(self) -> HistogramMetricFamily:
        raw = self.coord.latency_histogram()
        bounds_ms = sorted(int(k.removeprefix("le_")) for k in raw if k.startswith("le_") and k[3:].isdigit())
        buckets = [(_seconds(ms), raw.get(f"le_{ms}", 0.0)) for ms in bounds_ms]
        buckets.append(("+Inf", raw.get("count", 0.0)))
        return HistogramMetricFamily(
            "subq_model_request_latency_seconds",
            "Latency of model requests made by subagents, fleet-wide",
            buckets=buckets,
            sum_value=raw.get("sum_ms", 0.0) / 1000,
        )


def _seconds(ms: int) -> str:
    return f"{ms / 1000:g}"


def ops_routes(coord: Coordinator) -> APIRouter:
    router = APIRouter(tags=["operations"])
    health = SingleFlight(health_reader(coord), ttl_s=HEALTH_CACHE_TTL_S, wait_s=HEALTH_WAIT_S, name="health")
    metrics_text = SingleFlight(
        lambda: _collect_metrics(coord), ttl_s=METRICS_CACHE_TTL_S, wait_s=METRICS_WAIT_S, name="metrics"
    )

    async def ready() -> JSONResponse:
        try:
            body = await health.get()
        except RefreshPending as exc:
            body = _down(str(exc))
        return JSONResponse(body.model_dump(mode="json"), status_code=503 if body.status == "down" else 200)

    @router.get("/livez", response_model=Liveness, summary="The process is up (open, no token)")
    async def livez() -> Liveness:
        """Always 200 while the process serves requests: Kubernetes' livenessProbe (nothing else is checked)."""
        return Liveness()

    ready_responses: dict[int | str, dict[str, Any]] = {
        503: {"model": Health, "description": "Redis is unreachable (status down)"}
    }

    @router.get("/readyz", response_model=Health, responses=ready_responses, summary="Redis reachable (open, no token)")
    async def readyz() -> JSONResponse:
        """200 when Redis answers (`degraded` when no worker beat lately: work waits in the queue); 503 when not.

        Read at most once a second, whatever the number of callers.
        """
        return await ready()

    @router.get(
        "/healthz",
        response_model=Health,
        responses=ready_responses,
        summary="Redis reachable and workers seen (open, no token; the same answer as /readyz)",
    )
    async def healthz() -> JSONResponse:
        """200 when Redis answers (`degraded` when no worker beat lately); 503 when it does not."""
        return await ready()

    @router.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **error_responses(503),
        },
        summary="Prometheus metrics (open, no token)",
    )
    async def metrics() -> Response:
        return Response(await metrics_text.get(), media_type=CONTENT_TYPE_LATEST)

    return router


def _collect_metrics(coord: Coordinator) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SubqCollector(coord))
    return generate_latest(registry)
