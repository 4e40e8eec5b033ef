"""A worker dies after a run's end gave its tenant's freed slot to a parked run, before it published that
run's restart (coordinator/runs.py's `after-end` crash point): the reconciler publishes the run again.

The slot is given inside end_run.lua (fair_release.lua), and the run stays on the due list from its first
publish, so the repair is the reconciler's `run-lost` path (docs/architecture.md, "Fair shares between
tenants"). Built as tests/test_faults.py: a crashing worker, and a healthy rescuer on a queue of its own.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.local.fleet import WorkerFleet
from coordinator.tenants import TenantPolicy
from tests.agents import USAGE, agent
from tests.conftest import dedicated_fleet
from tests.helpers import eventually, repairs_reach

SETTINGS = {
    "queue": "subq-fairfault",
    "key_prefix": "subqfairfault",
    "heartbeat_lapse_s": 3,
    "reconcile_interval_s": 0.5,
    "reconcile_grace_s": 3,
    "task_time_limit_s": 60,
    "visibility_timeout_s": 300,  # far beyond the test: the reconciler, not the broker, converges it
    "tenants": {"a": TenantPolicy(max_running=1)},
}
CONVERGE_S = 60


@pytest.fixture
def fair_settings(settings: Settings) -> Settings:
    assert settings.redis_url
    return settings.model_copy(update={**SETTINGS, "redis_url": settings.redis_url.rsplit("/", 1)[0] + "/3"})


@pytest.fixture
def rescuer(fair_settings: Settings, tmp_path: Path) -> Iterator[Coordinator]:
    with dedicated_fleet(fair_settings, tmp_path / "rescuer", 1, queue="subq-fairrescue", worker_concurrency=4) as (
        coord,
        _,
    ):
        yield coord


def test_a_slot_given_to_a_parked_run_survives_the_death_of_the_worker_that_gave_it(
    fair_settings: Settings, rescuer: Coordinator, tmp_path: Path
) -> None:
    crash = fair_settings.model_copy(update={"fault_crash_at": "after-end", "worker_concurrency": 2})
    coord = Coordinator(fair_settings)
    before = coord.store.convergence.repairs()
    with WorkerFleet(crash, 1, tmp_path / "crash", name="crash") as fleet:
        fleet.wait_ready()
        root = coord.create_task("Two of a tenant that runs one at a time", tenant="a")
        slow = agent({"reply": "done", "usage": USAGE, "latency_ms": 1500})
        children = coord.delegate(root.id, [{"description": f"c{n}", "message": slow} for n in range(2)]).child_ids
        # One runs, the other is parked for the tenant's one slot (whichever came first); the first's end gives
        # the slot to the parked one, and the worker dies before it publishes that run.
        fleet.procs[0].wait(timeout=CONVERGE_S)
        assert fleet.procs[0].returncode == -signal.SIGKILL, fleet.logs[0].read_text(errors="replace")[-2000:]
        records = coord.store.records.get_records(list(children))
        (ended,) = [r for r in records if r.status == TaskStatus.COMPLETED]
        (given,) = [r for r in records if r.status != TaskStatus.COMPLETED]
        assert any(state == "wait:admission" for _, state in given.timeline.m), "it was parked"
        assert coord.store.fair.counts("a").running == 1 and coord.store.fair.counts("a").parked == 0
        assert coord.wait(root.id, CONVERGE_S).status == TaskStatus.ACTIVE, "the batch closed"
    assert coord.get_task(given.id).status == TaskStatus.COMPLETED and ended.id != given.id
    repairs_reach(
        lambda: coord.store.convergence.repairs().get("run-lost", 0) - before.get("run-lost", 0),
        1, "the reconciler publishing the second again",
    )  # fmt: skip
    eventually(lambda: coord.store.fair.counts("a").running == 0, "the tenant's slot to be free", 10)
    coord.close()


def test_runs_parked_when_fair_shares_are_turned_off_run_on_a_real_worker(settings: Settings, tmp_path: Path) -> None:
    """The tenants table turned fair shares off while runs were parked (their messages long gone from the
    broker): the fleet's reconciler releases them (`parked-released`) and its worker runs them to the batch's
    close; nothing is left in the tenant's parked set."""
    assert settings.redis_url
    off = settings.model_copy(
        update={
            **{k: v for k, v in SETTINGS.items() if k != "tenants"},
            "queue": "subq-fairoff",
            "key_prefix": "subqfairoff",
            "redis_url": settings.redis_url.rsplit("/", 1)[0] + "/3",
        }
    )
    coord = Coordinator(off)
    assert not coord.plane.tenants.fair_shares
    root = coord.create_task("Parked while fair shares were on", tenant="a")
    fast = agent({"reply": "done", "usage": USAGE})
    children = list(coord.delegate(root.id, [{"description": f"p{n}", "message": fast} for n in range(3)]).child_ids)
    coord.client.delete(off.queue)  # their messages reached a worker of the old table, which parked them
    keys = coord.store.keys
    coord.client.zadd(keys.tenant_parked("a"), {c: n for n, c in enumerate(children)})
    coord.client.zadd(keys.fair_wanting(), {"a": 1})
    before = coord.store.convergence.repairs()
    with WorkerFleet(off, 1, tmp_path / "off", name="off") as fleet:
        fleet.wait_ready()
        assert coord.wait(root.id, CONVERGE_S).status == TaskStatus.ACTIVE, "the batch closed"
    assert all(r.status == TaskStatus.COMPLETED for r in coord.store.records.get_records(children))
    assert coord.store.fair.counts("a").parked == 0
    released = repairs_reach(
        lambda: coord.store.convergence.repairs().get("parked-released", 0) - before.get("parked-released", 0),
        3, "three released by the reconciler's pass", 10,
    )  # fmt: skip
    assert released == 3, f"{released} released by the reconciler's pass"
    coord.close()
