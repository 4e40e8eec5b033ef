"""Many children in flight on one worker process: all complete, each delivered to a run once.

redis-py's default connection pool refuses its 101st connection; a worker
running more subagents than that at once failed runs at random, left their
leases behind and ended some as `cancelled` with no reason (the stop watcher
took a refused connection for a stop). The worker's pool now holds one
connection per thread and makes a thread wait rather than fail. The full
figure (a thousand children of 8 s each on one process) is bench/in_flight.py's.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.local.fleet import WorkerFleet
from tests.agents import agent

CHILDREN = 250  # well beyond redis-py's default pool of 100 connections
RECEIVED = re.compile(r"subq\.run_task\[([0-9a-f-]+)\] received")


def test_more_runs_at_once_than_redis_py_pools_by_default(settings: Settings, tmp_path: Path) -> None:
    assert settings.redis_url
    own = settings.model_copy(
        update={
            "redis_url": settings.redis_url.rsplit("/", 1)[0] + "/4",
            "queue": "subq-in-flight",
            "worker_concurrency": CHILDREN + 10,
        }
    )
    with WorkerFleet(own, 1, tmp_path) as fleet:
        fleet.wait_ready()
        coord = Coordinator(own)
        try:
            # Repairs are counted per Redis database for good, and another file's fault tests share this one
            # (test_typed_results: a killed worker's run-lost): only this test's own count.
            repairs_before = coord.repairs()
            parent = coord.create_task("Many at once")
            step = {"reply": "done", "usage": {"input": 10, "output": 5}, "latency_ms": 1500}
            batch = coord.delegate(
                parent.id, [{"description": f"c{n}", "message": agent(step)} for n in range(CHILDREN)]
            )
            coord.wait(parent.id, 120)
            records = coord.store.records.get_records(batch.child_ids)
            assert Counter(r.status for r in records) == {TaskStatus.COMPLETED: CHILDREN}
            assert {coord.store.records.task_field(c, "run_seq") for c in batch.child_ids} == {"1"}, "each run once"
            deliveries = Counter(RECEIVED.findall(fleet.logs[0].read_text(errors="replace")))
            assert {deliveries[c] for c in batch.child_ids} == {1}, "each delivered once"
            assert coord.repairs() == repairs_before, "no run was published again"
        finally:
            coord.close()
