"""A tenant's ended roots leave its running roots only while they are still as the prune read them, on a real Redis.

A prune reads the running roots and their records, then takes out the ended ones (prune_roots.lua). A retry in
between counts its ended root again and runs it (coordinator/retry.py): a removal decided on the earlier read
took that count away, and the root ran uncounted, letting the tenant run one over its max_running_roots. The
tests run the prune's read, then what happens meanwhile, then its removal: no sleeps, no threads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.errors import QuotaExceeded

PREFIX = "subqprune"


def _clean(coord: Coordinator) -> None:
    for key in coord.client.scan_iter(f"{PREFIX}:*"):
        coord.client.delete(key)


@pytest.fixture
def coord(settings: Settings) -> Iterator[Coordinator]:
    """A Coordinator of its own prefix whose queue no worker reads: acme may run one root at once."""
    own = settings.model_copy(
        update={"key_prefix": PREFIX, "queue": "subq-prune-idle", "tenants": {"acme": {"max_running_roots": 1}}}
    )
    coordinator = Coordinator(own)
    _clean(coordinator)
    yield coordinator
    _clean(coordinator)
    coordinator.close()


def _failed_root(coord: Coordinator) -> str:
    root = coord.create_task("fails", tenant="acme", run=True)
    coord.store.runs.finish_task(root.id, "failed", error="boom", error_class="RuntimeError")
    return root.id


def test_a_retry_between_a_prunes_read_and_its_removal_keeps_its_root_counted(coord: Coordinator) -> None:
    quotas, key = coord.store.quotas, coord.store.keys.tenant_roots("acme")
    root = _failed_root(coord)
    counted, prune = quotas.read_prune("acme")  # e.g. a /metrics scrape: reads the root as ended
    assert counted == 1 and prune is not None and [ended[0] for ended in prune.ended] == [root]
    assert coord.retry(root).task.status != TaskStatus.FAILED  # counted again, and run again
    assert quotas.apply_prune(prune) == 0, "the root the prune read as ended runs again"
    assert coord.client.zrange(key, 0, -1) == [root]
    with pytest.raises(QuotaExceeded) as caught:
        coord.create_task("second", tenant="acme")
    assert caught.value.quota == "max_running_roots"


def test_a_root_run_again_or_written_since_the_read_stays_and_one_unchanged_goes(coord: Coordinator) -> None:
    """Each condition alone keeps a root: its record no longer ended (its score as read: a count that found it
    still counted), or a record written for one read without (a submit slow to write it)."""
    quotas, key = coord.store.quotas, coord.store.keys.tenant_roots("acme")
    rerun, left = _failed_root(coord), _failed_root(coord)
    unwritten = "f" * 16
    # The second's submit took the first out (ended): counted again here, as before its end; and one counted a
    # minute ago whose record is not written.
    coord.client.zadd(key, {rerun: time.time() * 1000 - 1_000, unwritten: time.time() * 1000 - 61_000})
    counted, prune = quotas.read_prune("acme")
    assert counted == 3 and prune is not None and len(prune.ended) == 3
    coord.client.hset(coord.store.keys.task(rerun, rerun), "status", "active")
    coord.client.hset(coord.store.keys.task(unwritten, unwritten), mapping={"id": unwritten, "status": "active"})
    assert quotas.apply_prune(prune) == 1, f"{left} alone, unchanged since the read, goes"
    assert sorted(coord.client.zrange(key, 0, -1)) == sorted([rerun, unwritten])


def test_a_long_running_root_counted_again_since_the_read_keeps_its_later_count(coord: Coordinator) -> None:
    """A root read as running and counted more than half a retention ago is counted anew at the prune's time;
    a count written since the read (a retry's, later) stays, not the prune's earlier time (ZADD GT)."""
    quotas, key = coord.store.quotas, coord.store.keys.tenant_roots("acme")
    root = coord.create_task("runs long", tenant="acme", run=True).id
    long_ago_ms = time.time() * 1000 - coord.settings.result_retention_s * 1000
    coord.client.zadd(key, {root: long_ago_ms})
    counted, prune = quotas.read_prune("acme")
    assert counted == 1 and prune is not None and list(prune.long_running) == [root]
    later_ms = prune.now_ms + 60_000
    coord.client.zadd(key, {root: later_ms})  # counted again since the read
    assert quotas.apply_prune(prune) == 0
    assert coord.client.zscore(key, root) == later_ms
