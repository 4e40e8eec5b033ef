"""Fair shares between tenants on real workers (issue 42's acceptance): a fleet of 2 worker processes x 8
threads, each child a model call of a set time (the offline model's `latency_ms`).

One fleet for the module, four tenants: `a` and `b` hold at most 4 runs each, `c` and `d` weigh 3 and 1.
Each test cancels what it left running, so the next one starts on an idle fleet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from coordinator import Coordinator, Settings
from coordinator.models import TaskRecord, TaskStatus
from coordinator.tenants import TenantPolicy
from tests.agents import USAGE, agent
from tests.conftest import dedicated_fleet
from tests.helpers import eventually

PROCESSES, THREADS = 2, 8
CAP = 4
WAIT_S = 120
# The weights' window: until this many runs started in it (about ten seconds on a quiet host), and at most
# the minute (a host loaded many times over its cores runs a slot's turn in seconds, not 300 ms):
# enough starts that the light tenant's share, about 80 starts, is not moved past the 10 % by where its
# runs' turns fall at the window's edges (a window of 160 once read 141:40, slots held 12:4 throughout).
WINDOW_STARTS = 320
WINDOW_MAX_S = 60
# The fewest starts a window may end with (a tenant running low ends it early).
WINDOW_MIN_STARTS = 200
# Each tenant's flood: c queues 5 roots of this many children, d 2 (c's 600 outlast the window even after a
# slow start on a loaded host; the runs left are stopped, not run).
FLOOD_CHILDREN = 120


def _slow(latency_ms: int) -> str:
    return agent({"reply": "done", "usage": USAGE, "latency_ms": latency_ms})


@pytest.fixture(scope="module")
def fleet(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    tenants = {
        "a": TenantPolicy(max_running=CAP),
        "b": TenantPolicy(max_running=CAP),
        "c": TenantPolicy(weight=3),
        "d": TenantPolicy(weight=1),
    }
    with dedicated_fleet(
        settings, tmp_path_factory.mktemp("fair"), PROCESSES, queue="subq-fair", key_prefix="subqfairfleet",
        worker_concurrency=THREADS, tenants=tenants,
    ) as (coord, _):  # fmt: skip
        coord.client.delete("subq-fair")
        # The workers' beat has counted the fleet (its capacity) and written the tenants' policies.
        eventually(lambda: coord.store.fair.capacity() == PROCESSES * THREADS, "the fleet's capacity", 60, every_s=0.2)
        yield coord


def _fan_out(coord: Coordinator, tenant: str, children: int, latency_ms: int, priority: int = 3) -> list[str]:
    """A caller's root of `tenant` delegating `children` runs of `latency_ms` each; the child ids."""
    root = coord.create_task(f"{tenant} p{priority}", tenant=tenant, priority=priority)
    specs = [{"description": f"{tenant}{n}", "message": _slow(latency_ms)} for n in range(children)]
    return list(coord.delegate(root.id, specs).child_ids)


def _first_run_ms(record: TaskRecord) -> int | None:
    return next((t for t, state in record.timeline.m if state == "running"), None)


def _arrival_ms(record: TaskRecord) -> int:
    """When its first run's message reached a worker: its park, or its run's start."""
    return next(t for t, state in record.timeline.m if state in ("wait:admission", "running"))


def _started(coord: Coordinator, ids: list[str]) -> dict[str, int]:
    """Each task of `ids` that has started a run: when its first run started (ms, its timeline's clock)."""
    out = {}
    for record in coord.store.records.get_records(ids):
        first = _first_run_ms(record)
        if first is not None:
            out[record.id] = first
    return out


def _running(coord: Coordinator, roots: set[str]) -> int:
    """How many tasks of these trees are running now, by their live status."""
    return sum(1 for root in roots for live in coord.store.events.live(root).values() if live.get("state") == "running")


def _stop(coord: Coordinator, ids: list[str]) -> None:
    """Cancel the trees of `ids` and wait until no run of theirs holds or waits for a slot."""
    for root in {coord.get_task(i).root_id for i in ids}:
        coord.cancel(root, "test over")
    tenants = {coord.get_task(i).tenant for i in ids}

    def drained() -> bool:
        return all(coord.store.fair.counts(t).running == 0 and coord.store.fair.counts(t).parked == 0 for t in tenants)

    eventually(drained, "the cancelled runs to leave their slots", WAIT_S, every_s=0.2)


class Sampler:
    """Counts the running tasks of some trees every 100 ms, in a thread, until stopped."""

    def __init__(self, coord: Coordinator, roots: set[str]) -> None:
        self.coord, self.roots, self.counts = coord, roots, list[int]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self.counts.append(_running(self.coord, self.roots))

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def test_a_tenant_at_its_max_running_leaves_the_fleet_to_another(fleet: Coordinator) -> None:
    a_children = [c for _ in range(5) for c in _fan_out(fleet, "a", 40, latency_ms=1000)]
    a_roots = {fleet.get_task(c).root_id for c in a_children}
    with Sampler(fleet, a_roots) as sampled:
        time.sleep(1)
        b_submitted_ms = int(time.time() * 1000)
        b_children = _fan_out(fleet, "b", 2, latency_ms=1000)
        b_root = fleet.get_task(b_children[0]).root_id
        assert fleet.wait(b_root, WAIT_S).status == TaskStatus.ACTIVE, "B's batch closed"
        waiting = [r for r in fleet.store.records.get_records(a_children) if r.waiting_for == "admission"]
        b_started = _started(fleet, b_children)
        a_started = _started(fleet, a_children)
    _stop(fleet, a_children)
    # B's children started before A had started 12 more (each run's first `running` mark, one clock).
    b_last = max(b_started.values())
    a_meanwhile = sum(1 for t in a_started.values() if b_submitted_ms <= t <= b_last)
    print(f"caps: A started {a_meanwhile} while B's waited; {len(waiting)} of A's waiting; A ran {max(sampled.counts)}")
    assert a_meanwhile < 12, f"A started {a_meanwhile} runs while B's two waited"
    # B's root completed (its batch closed) while more than 100 of A's children still waited, parked for a slot.
    assert len(waiting) > 100, f"only {len(waiting)} of A's children waited for admission"
    assert max(sampled.counts) <= CAP, f"A ran {max(sampled.counts)} at once"
    assert len(sampled.counts) > 10 and max(sampled.counts) == CAP


def test_weights_split_the_fleet_between_two_saturating_tenants(fleet: Coordinator) -> None:
    """c (weight 3) and d (weight 1) each queue more than the fleet runs in the window; once both run (d has
    reached its share), the runs started over a window of WINDOW_STARTS starts (at most the issue's 60 s)
    split 3:1 within 10 % (the runs seen running, sampled every 100 ms, are printed beside it)."""
    c_children: list[str] = []
    d_children: list[str] = []
    for n in range(5):  # interleaved: each tenant's flood behind the other's (tests above: one flood first)
        c_children += _fan_out(fleet, "c", FLOOD_CHILDREN, latency_ms=300)
        if n < 2:
            d_children += _fan_out(fleet, "d", FLOOD_CHILDREN, latency_ms=300)
    share = PROCESSES * THREADS // 4

    def steady() -> bool:
        """d has reached its share, and every run published has reached a worker (none announced is left in
        the broker's queue): from now on only admission orders the starts. Before, a slot given to a parked
        run waits for its restart behind the flood still to be parked (Celery's one FIFO queue), so the starts
        follow the queue's order, not the handovers. On a host at load 33 that transient filled a 60 s window
        (55 starts, split 2.4:1); at load 8 to 16 the slots held read 12:4 at every 100 ms sample and the
        steady state split 30:10 in each 40 starts (docs/architecture.md, "Why announce")."""
        counts = [fleet.store.fair.counts(t) for t in ("c", "d")]
        return len(_started(fleet, d_children)) >= share and all(c.queued == 0 for c in counts)

    eventually(steady, "d to reach its share with the flood parked", WAIT_S, every_s=0.2)
    c_roots = {fleet.get_task(c).root_id for c in c_children}
    d_roots = {fleet.get_task(d).root_id for d in d_children}
    with Sampler(fleet, c_roots) as c_held, Sampler(fleet, d_roots) as d_held:
        window_start = int(time.time() * 1000)
        deadline = time.monotonic() + WINDOW_MAX_S
        while time.monotonic() < deadline:  # until WINDOW_STARTS runs started in the window, at most a minute
            time.sleep(0.5)
            started_now = [*_started(fleet, c_children).values(), *_started(fleet, d_children).values()]
            if sum(1 for t in started_now if t >= window_start) >= WINDOW_STARTS:
                break
            # A tenant about to run out of waiting runs no longer saturates: the window ends there (a slow flood
            # left c's 320 runs 142 once, and d took the slots c no longer wanted).
            if min(fleet.store.fair.counts(t).parked for t in ("c", "d")) < THREADS:
                break
        window_end = int(time.time() * 1000)
    c_started, d_started = _started(fleet, c_children), _started(fleet, d_children)
    left = len(c_children) - len(c_started), len(d_children) - len(d_started)
    _stop(fleet, c_children + d_children)
    # A tenant whose flood ran out between two of the loop's looks (a loaded host starts many runs between
    # them) saturated until its last run started: the window ends there (that start left out).
    for started, not_started in ((c_started, left[0]), (d_started, left[1])):
        if not not_started:
            window_end = min(window_end, max(started.values()))
    c_n = sum(1 for t in c_started.values() if window_start <= t < window_end)
    d_n = sum(1 for t in d_started.values() if window_start <= t < window_end)
    held = sum(c_held.counts) / max(1, sum(d_held.counts))
    print(f"weights 3:1: c started {c_n}, d {d_n} in the window; slots held {held:.2f}:1; not started {left}")
    assert c_n + d_n >= WINDOW_MIN_STARTS, f"only {c_n + d_n} runs started in the window"
    assert d_n > 0 and 2.7 <= c_n / d_n <= 3.3, f"c started {c_n} and d {d_n} in the window"


def test_a_later_root_of_higher_priority_starts_before_the_waiting_ones(fleet: Coordinator) -> None:
    low = [c for _ in range(3) for c in _fan_out(fleet, "a", 20, latency_ms=1000)]
    time.sleep(1)
    submitted_ms = int(time.time() * 1000)
    high = _fan_out(fleet, "a", CAP, latency_ms=200, priority=5)
    eventually(lambda: len(_started(fleet, high)) == CAP, "the priority-5 children to start", WAIT_S, every_s=0.1)
    high_started = max(_started(fleet, high).values())
    low_started = _started(fleet, low)
    # Where a priority-5 child's wait went: in the broker's queue (from its creation to its arrival, the
    # `wait:admission` mark of its park) and parked for a slot (docs/architecture.md, priority and the broker).
    in_broker_ms = [_arrival_ms(r) - r.timeline.m[0][0] for r in fleet.store.records.get_records(high)]
    print(f"priority 5: in the broker {max(in_broker_ms)} ms at most, started {high_started - submitted_ms} ms in")
    _stop(fleet, low + high)
    waiting_then = [c for c in low if low_started.get(c, high_started + 1) > submitted_ms]
    before_high = [c for c in waiting_then if low_started.get(c, high_started + 1) < high_started]
    assert len(waiting_then) > 20, "many priority-3 children still waited when the priority-5 root came"
    # Only the slots freed before the priority-5 children were parked went to priority 3.
    assert len(before_high) <= CAP, f"{len(before_high)} waiting priority-3 children started first"
