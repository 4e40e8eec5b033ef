"""Fleet-wide metrics (the model-latency histogram, the fleet's gauges) and the whole-prefix snapshot for tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

from coordinator.store.base import Part, _str_map, _strs, translate_redis_errors
from coordinator.store.fields import LatencyField

__all__ = ["LATENCY_BUCKETS_MS", "FleetGauges", "MetricStore", "cumulative", "latency_bucket"]

# Model request latency buckets (ms), Prometheus-style cumulative: from a cached
# reply to a long reasoning call.
LATENCY_BUCKETS_MS = (100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)


def latency_bucket(latency_ms: float) -> str:
    """The histogram field one request of `latency_ms` is counted in."""
    return next((LatencyField.bucket(b) for b in LATENCY_BUCKETS_MS if latency_ms <= b), LatencyField.OVER)


def cumulative(raw: dict[str, str]) -> dict[str, float]:
    """Prometheus's cumulative buckets and count from the stored per-bucket counts ({} before any request)."""
    if not raw:
        return {}
    histogram: dict[str, float] = {}
    running = 0.0
    for bound in LATENCY_BUCKETS_MS:
        running += float(raw.get(LatencyField.bucket(bound), 0))
        histogram[f"le_{bound}"] = running
    histogram["count"] = running + float(raw.get(LatencyField.OVER, 0))
    histogram["sum_ms"] = float(raw.get(LatencyField.SUM_MS, 0))
    return histogram


class FleetGauges(NamedTuple):
    """What the fleet holds now, read on each scrape of the API's /metrics."""

    queue_depth: int  # Celery messages waiting in the queue
    runs_in_flight: int  # runs published and not yet ended: waiting in the queue or running
    approvals_waiting: int
    dead_letters: int


class MetricStore(Part):
    """The latency histogram, and a content snapshot of every key of the prefix."""

    @translate_redis_errors
    def add_latencies(self, latencies_ms: Sequence[float]) -> None:
        """Count model requests' latencies in the fleet-wide histogram, in one round trip: each bucket's
        increment, and the sum. A worker's heartbeat sends what its runs measured since its last beat
        (coordinator/heartbeat.py), not each run's step."""
        if not latencies_ms:
            return
        key = self.keys.latency_histogram()
        with self.client.pipeline() as pipe:  # MULTI/EXEC: a scrape never reads the buckets without their sum
            for bucket, requests in Counter(map(latency_bucket, latencies_ms)).items():
                pipe.hincrby(key, bucket, requests)
            pipe.hincrbyfloat(key, LatencyField.SUM_MS, sum(latencies_ms))
            pipe.execute()

    @translate_redis_errors
    def latency_histogram(self) -> dict[str, float]:
        """{'le_<ms>': cumulative count, 'count': n, 'sum_ms': total} of model request latency."""
        return cumulative(_str_map(self.client.hgetall(self.keys.latency_histogram())))

    @translate_redis_errors
    def snapshot(self) -> dict[str, object]:
        """Every key of this prefix with its value, compared by content (tests: 'nothing changed').

        Not DUMP: a set's serialised order can change on rehashing without any write.
        Liveness is left out: the workers' heartbeats and the reconciler's leader lease
        change every few seconds whatever else happens, and so does the latency histogram,
        which each worker's heartbeat adds to at its beat. So are the marks a write keeps for its own
        resend (an audit entry's, an endpoint recovery's, a fair-share pass's), which lapse two minutes after it, on no
        tree's clock (a loaded run read an audit entry's mark before a step and not after).
        """
        liveness = {self.keys.workers(), self.keys.leader(), self.keys.latency_histogram()}
        resend_marks = (
            self.keys.audit_mark(""),
            self.keys.fair_heal_mark(""),
            self.keys.endpoint_recovered("", "").split("{", 1)[0],
        )
        read: dict[str, Callable[[str], object]] = {
            "string": self.client.get,
            "hash": self.client.hgetall,
            "list": lambda key: self.client.lrange(key, 0, -1),
            "set": lambda key: sorted(_strs(self.client.smembers(key))),
            "zset": lambda key: self.client.zrange(key, 0, -1, withscores=True),
            "stream": lambda key: self.client.xrange(key),
        }
        return {
            key: (kind, read[kind](key))
            for key in self.client.scan_iter(self.keys.all_pattern(), count=1000)
            if key not in liveness and not key.startswith(resend_marks) and (kind := str(self.client.type(key))) in read
        }

    @translate_redis_errors
    def fleet_gauges(self, queue: str) -> FleetGauges:
        """Four O(1) reads in one round trip. Runs in flight are the due list's size: a run is on
        it from before its message is published until it ends or releases its worker (waiting on
        children or a decision), so ZCARD counts them without a scan of the leases."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.llen(queue)
            pipe.zcard(self.keys.due())
            pipe.zcard(self.keys.approvals())
            pipe.llen(self.keys.dead_letters())
            return FleetGauges(*(int(n) for n in pipe.execute()))

    @translate_redis_errors
    def queue_depth(self, queue: str) -> int:
        """Celery messages waiting in `queue` (Celery's own list, not a subq key; LLEN as Celery reports it)."""
        return int(self.client.llen(queue))
