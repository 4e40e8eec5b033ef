"""A worker's clocks kept for the whole fleet run slower as the fleet grows (workers/maintenance.py).

Each of a fleet's N processes bids for the reconciler's lead, and its idle webhook
deliverer polls, N times less often than one process alone would, so an idle fleet
costs Redis and the runs' interpreters the same whatever its size; its heartbeat is
beaten every third of a lapse, as a run's lease is renewed. The count of the fleet is
read with the beat, in the same round trip (a real Redis here).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from types import SimpleNamespace
from typing import Any, cast

from coordinator import Coordinator
from coordinator.reconciler import BEATS_PER_LAPSE, IdlePace, Reconciler, fleet_paced_s
from tests.helpers import eventually


def test_a_fleet_clock_runs_as_many_times_slower_as_there_are_processes_up_to_its_bound() -> None:
    assert fleet_paced_s(0.25, 2.0, 1) == 0.25
    assert fleet_paced_s(0.25, 2.0, 4) == 1.0
    assert fleet_paced_s(0.25, 2.0, 100) == 2.0
    assert fleet_paced_s(3.0, 2.0, 1) == 3.0, "never faster than the fleet's own rate"


def test_a_beat_counts_the_worker_processes_of_the_fleet_and_not_the_runs_heartbeats(
    idle_coordinator: Coordinator,
) -> None:
    coord = idle_coordinator
    first = Reconciler(coord, "pacing-a@host:1")
    first.beat()
    alone = first.fleet_size  # other tests' workers may have beaten within the lapse
    second = Reconciler(coord, "pacing-b@host:2")
    second.beat()
    assert second.fleet_size == alone + 1
    # A run's heartbeat (coordinator/heartbeat.py) beats as `<host>:<pid>`: not another process.
    coord.store.convergence.renew_leases([], coord.settings.heartbeat_lapse_s, "host:2")
    first.beat()
    assert first.fleet_size == alone + 1


class FakeClock:
    """Time that passes only while the loop waits; the loop stops once `until_s` is reached."""

    def __init__(self, until_s: float) -> None:
        self.now_s, self.until_s = 0.0, until_s

    def __call__(self) -> float:
        return self.now_s

    def wait(self, timeout: float | None = None) -> bool:
        self.now_s += timeout or 0.0
        return self.now_s >= self.until_s


class Counted(Reconciler):
    """A reconciler whose beats and ticks are counted, not sent (leading or not, as told)."""

    def __init__(self, *, leads: bool, fleet_size: int, fail: bool = False) -> None:
        settings = SimpleNamespace(heartbeat_lapse_s=15, reconcile_interval_s=1.0)
        plane = SimpleNamespace(settings=settings, store=SimpleNamespace(retention_s=604_800))  # the keeper's retention
        super().__init__(cast(Coordinator, SimpleNamespace(plane=plane)), "counted")
        self.leads, self.fail, self.fleet_size = leads, fail, fleet_size
        self.beats = self.ticks = 0

    def beat(self) -> None:
        self.beats += 1
        if self.fail:
            raise ConnectionError("Redis is down")

    def tick(self) -> Counter[str] | None:
        self.ticks += 1
        return Counter() if self.leads else None


def run_for(reconciler: Counted, seconds: float) -> Counted:
    clock = FakeClock(seconds)
    reconciler.run_forever(cast(threading.Event, clock), clock=clock)
    return reconciler


def test_the_leader_ticks_every_interval_and_beats_every_third_of_a_lapse() -> None:
    leader = run_for(Counted(leads=True, fleet_size=8), 60)
    assert leader.beats == 60 / (15 / BEATS_PER_LAPSE)
    assert leader.ticks == 60 / 1.0


def test_the_others_bid_for_the_lead_at_the_fleets_pace() -> None:
    assert run_for(Counted(leads=False, fleet_size=1), 60).ticks == 60, "a lone process bids every interval"
    assert run_for(Counted(leads=False, fleet_size=2), 60).ticks == 30, "each of two every second interval"
    # Eight: at most half the leader's lease (5 s) apart, so one takes a lapsed lease within about that.
    assert run_for(Counted(leads=False, fleet_size=8), 60).ticks == 24


def test_a_failed_beat_is_tried_again_after_an_interval_not_at_once() -> None:
    assert run_for(Counted(leads=True, fleet_size=1, fail=True), 20).beats == 20


def test_a_beat_that_fails_every_time_never_stops_the_ticks() -> None:
    """The beat ran first in the same `try` as the tick, and a beat that always failed (a tenants table it could
    not write) put the tick off at every turn: no lost run was published again on any worker."""
    failing = run_for(Counted(leads=True, fleet_size=1, fail=True), 20)
    assert failing.ticks == 20 and failing.beats == 20


def test_an_idle_stop_watch_keeps_no_timer() -> None:
    """The watch polls on the runs' loop while one is watched; the tick that finds none leaves no timer."""
    from workers.runtime.agent_loop import AgentLoop, StopWatch

    polls = []
    lifecycle = SimpleNamespace(
        stops_so_far=lambda: polls.append(1) or 0, must_stop=lambda runs: [], must_stop_here=lambda runs: []
    )
    watch, loop = StopWatch(cast(Any, lifecycle), poll_s=0.01), AgentLoop()
    run = cast(Any, SimpleNamespace(task_id="t", token="the-run"))

    async def watch_it() -> None:
        watch.watch(run)

    async def forget_it() -> None:
        watch.forget(run)

    loop.run(watch_it())
    eventually(lambda: len(polls) >= 3, "three polls while a run is watched", every_s=0.01)
    loop.run(forget_it())
    eventually(lambda: watch._ticking_on is None, "the timer gone once nothing is watched", every_s=0.01)
    polled = len(polls)
    loop.run(asyncio.sleep(0.05))
    assert len(polls) == polled, "no poll without a watched run"


def test_an_idle_poll_slows_down_over_a_quiet_spell_and_starts_again_after_work() -> None:
    clock, fleet = FakeClock(3600), {"size": 1}
    pace = IdlePace(0.25, 1.0, 2.0, lambda: fleet["size"], clock=clock)
    waits = []
    for _ in range(5):  # an unbroken idle spell: each wait follows the last at once
        waits.append(pace.wait_s())
        clock.wait(waits[-1])
    assert waits == [0.25, 0.5, 1.0, 1.0, 1.0]
    clock.wait(10)  # the loop found work and was busy: a new spell
    assert pace.wait_s() == 0.25
    fleet["size"] = 8  # a fleet of eight: each process N times slower, at most 2 s
    clock.wait(10)
    assert pace.wait_s() == 2.0
