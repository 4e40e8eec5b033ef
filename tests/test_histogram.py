"""The model-latency histogram's bucketing: pure logic, so a fast unit test on fakeredis.

(Behaviour that needs Redis itself, such as Lua, transactions and TTLs, is tested
on a real server elsewhere.)
"""

from __future__ import annotations

import fakeredis
import pytest

from coordinator.store import LATENCY_BUCKETS_MS, Keys, Store


@pytest.fixture
def store() -> Store:
    return Store(fakeredis.FakeRedis(decode_responses=True), Keys("unit"), retention_s=60, budget_warn_at=0.8)


def test_buckets_are_cumulative_with_count_and_sum(store: Store) -> None:
    for latency_ms in (50, 100, 101, 2600, 200_000):
        store.metrics.observe_latency(latency_ms)
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
