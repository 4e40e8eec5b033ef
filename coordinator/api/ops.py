"""GET /healthz and GET /metrics: open endpoints for load balancers and Prometheus.

Neither needs the bearer token (they carry no task data). The health check
pings Redis and the workers; the metrics are collected from Redis on each
scrape by a collector on a fresh registry, so no process-global state exists
and every API replica reports the same fleet-wide figures: what the fleet holds
now (queue depth, runs in flight, approvals waiting, dead letters) and what
Redis already counts (repairs, the latency histogram). The counters of runs,
model requests, tokens and cost are each worker's own (coordinator/metrics.py,
docs/api.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import anyio.to_thread
import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from coordinator.api.errors import error_responses
from coordinator.api.schemas import Health, RedisHealth, WorkersHealth
from coordinator.models import TaskStatus
from coordinator.service import Coordinator

__all__ = ["METRICS_RECENT_TASKS", "SubqCollector", "ops_routes"]

# A health check must answer within a load balancer's timeout (often 5 s) even when
# Redis hangs: a short socket timeout on a client of its own.
REDIS_PING_TIMEOUT_S = 2.0
# Workers answer a broadcast ping within milliseconds; one second covers a busy host.
WORKER_PING_TIMEOUT_S = 1.0
# Task counts and spend are read over this many most recent tasks of the history
# index, so a scrape stays cheap however long the retention is.
METRICS_RECENT_TASKS = 1000


def _ping_redis(url: str) -> RedisHealth:
    client = redis.Redis.from_url(url, socket_timeout=REDIS_PING_TIMEOUT_S, socket_connect_timeout=REDIS_PING_TIMEOUT_S)
    try:
        started = time.perf_counter()
        client.ping()
        return RedisHealth(ok=True, latency_ms=round((time.perf_counter() - started) * 1000, 3))
    except redis.RedisError as exc:
        return RedisHealth(ok=False, error=f"Redis is unreachable: {exc}")
    finally:
        client.close()


def _ping_workers(coord: Coordinator) -> WorkersHealth:
    try:
        replies = coord.app.control.ping(timeout=WORKER_PING_TIMEOUT_S) or []
    except Exception as exc:  # a kombu/Celery error of any kind: report it, the check must answer
        return WorkersHealth(count=0, names=[], error=f"{type(exc).__name__}: {exc}")
    names = sorted(name for reply in replies for name in reply)
    return WorkersHealth(count=len(names), names=names)


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
        yield self._latency()

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

    @router.get(
        "/healthz",
        response_model=Health,
        responses={503: {"model": Health, "description": "Redis is unreachable (status down)"}},
        summary="Redis reachable and workers seen (open, no token)",
    )
    async def healthz() -> JSONResponse:
        """200 when Redis answers (`degraded` when no worker replied to a ping); 503 when it does not."""
        url = coord.settings.require_redis_url()
        redis_health = await anyio.to_thread.run_sync(_ping_redis, url)
        if not redis_health.ok:
            workers = WorkersHealth(count=0, names=[], error="not checked: Redis is unreachable")
            body = Health(status="down", redis=redis_health, workers=workers)
            return JSONResponse(body.model_dump(mode="json"), status_code=503)
        workers = await anyio.to_thread.run_sync(_ping_workers, coord)
        body = Health(status="ok" if workers.count else "degraded", redis=redis_health, workers=workers)
        return JSONResponse(body.model_dump(mode="json"))

    @router.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **error_responses(503),
        },
        summary="Prometheus metrics (open, no token)",
    )
    def metrics() -> Response:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SubqCollector(coord))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
