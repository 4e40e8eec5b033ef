"""The model-latency histogram's bucketing and a process's tally of it: pure logic, so fast unit tests on fakeredis.

(Behaviour that needs Redis itself, such as Lua, transactions and TTLs, is tested
on a real server elsewhere.)
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

import fakeredis
import pytest

from coordinator.errors import StoreError
from coordinator.heartbeat import Heartbeat, LatencyTally
from coordinator.store import LATENCY_BUCKETS_MS, Keys, Store

if TYPE_CHECKING:
    from coordinator.plane import Plane


@pytest.fixture
def store() -> Store:
    return Store(fakeredis.FakeRedis(decode_responses=True), Keys("unit"), retention_s=60, budget_warn_at=0.8)


def test_buckets_are_cumulative_with_count_and_sum(store: Store) -> None:
    store.metrics.add_latencies([50, 100, 101, 2600, 200_000])
    histogram = store.metrics.latency_histogram()
    assert histogram["count"] == 5
    assert histogram["sum_ms"] == pytest.approx(50 + 100 + 101 + 2600 + 200_000)
    assert histogram["le_100"] == 2, "a request of exactly 100 ms is within the 100 ms bucket"
    assert histogram["le_250"] == 3
    assert histogram["le_5000"] == 4
    assert "le_inf" not in histogram and histogram.get(f"le_{LATENCY_BUCKETS_MS[-1]}") == 4, "over the top: count only"
    counts = [histogram.get(f"le_{b}", 0) for b in LATENCY_BUCKETS_MS]
    assert counts == sorted(counts), "cumulative buckets never decrease"


def test_an_empty_histogram_reads_as_nothing(store: Store) -> None:
    assert store.metrics.latency_histogram() == {}


def test_a_tally_gives_what_it_holds_once_and_takes_back_what_redis_refused(store: Store) -> None:
    tally = LatencyTally()
    for latency_ms in (80, 90, 700):
        tally.observe(latency_ms)
    taken = tally.take()
    assert taken == [80, 90, 700] and tally.take() == [], "taken once"
    tally.put_back(taken)
    tally.observe(300)
    store.metrics.add_latencies(tally.take())
    store.metrics.add_latencies([])
    histogram = store.metrics.latency_histogram()
    assert (histogram["le_100"], histogram["le_500"], histogram["le_1000"], histogram["count"]) == (2, 3, 4, 4)
    assert histogram["sum_ms"] == pytest.approx(1170)


def test_a_heartbeat_keeps_the_latencies_redis_did_not_take_for_its_next_beat(store: Store) -> None:
    class Refusing:
        def add_latencies(self, latencies_ms: list[float]) -> None:
            raise StoreError("Redis is down")

    beat = Heartbeat(cast("Plane", SimpleNamespace(store=SimpleNamespace(metrics=Refusing()))), "w1")
    beat.latencies.observe(700)
    beat.add_latencies()
    assert beat.latencies.take() == [700], "kept for the next beat"
    beat.latencies.observe(700)
    beat.plane = cast("Plane", SimpleNamespace(store=store))
    beat.add_latencies()
    assert store.metrics.latency_histogram()["le_1000"] == 1 and beat.latencies.take() == []
