"""Fair shares between tenants, step by step on a real Redis: the start's park and the end's hand-over
(fair_admit.lua, fair_release.lua, fair_take.lua), priority within a tenant, and the fleet's capacity.

The fleet-wide behaviour on real workers is in tests/test_fair_share_fleet.py.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from coordinator import Coordinator, TaskStatus, approvals
from coordinator.approvals import ToolCall
from coordinator.models import AdmissionLimits
from coordinator.replies import FairHealed
from coordinator.store import Store
from coordinator.store.fair import FairCounts, FairShares
from coordinator.store.fields import TaskField
from coordinator.store.runs import Started
from coordinator.tenants import TenantPolicy

SHARES = FairShares(on=True, capacity=8)


@pytest.fixture
def fair(idle_coordinator: Coordinator) -> Iterator[Coordinator]:
    """A coordinator of its own key prefix, whose fleet (one worker of `SHARES.capacity`) reads two tenants:
    `a` (weight 3, max_running 2) and `b` (weight 1), and the default for the rest."""
    coord = Coordinator(idle_coordinator.settings.model_copy(update={"key_prefix": f"subqfair{secrets.token_hex(3)}"}))
    beat(coord.store, {"a": (3, 2), "b": (1, 0), "*": (1, 0)})
    yield coord
    for key in coord.client.scan_iter(coord.store.keys.all_pattern()):
        coord.client.delete(key)
    coord.close()


def beat(store: Store, table: dict[str, tuple[int, int]], concurrency: int = SHARES.capacity) -> int:
    store.convergence.renew_leases([], 30, "w1")
    return store.fair.beat("w1", concurrency, 30, table)


def children(coord: Coordinator, tenant: str, n: int, priority: int = 3) -> list[str]:
    """`n` children of a fresh caller's root of `tenant` (set on the root as its creation would, and copied
    to each child by the delegation)."""
    root = coord.create_task(f"{tenant} root")
    coord.client.hset(
        coord.store.keys.task(root.id, root.id), mapping={TaskField.TENANT: tenant, TaskField.PRIORITY: priority}
    )
    ids = coord.delegate(root.id, [{"description": f"{tenant}{i}", "message": "m"} for i in range(n)]).child_ids
    assert all(coord.get_task(i).tenant == tenant for i in ids)
    return ids


def start(store: Store, task_id: str, shares: FairShares = SHARES) -> Started:
    return store.runs.begin_run(task_id, secrets.token_hex(4), 60, 30, AdmissionLimits(), shares)


def test_a_tenant_at_its_max_running_parks_and_its_freed_slot_starts_the_next(fair: Coordinator) -> None:
    store = fair.store
    a1, a2, a3, a4 = children(fair, "a", 4)
    assert [start(store, t).verdict for t in (a1, a2)] == ["run", "run"]
    parked = start(store, a3)
    assert (parked.verdict, parked.parked_for, parked.admitted) == ("park", "max_running", [])
    assert start(store, a4).verdict == "park"
    task = fair.get_task(a3)
    assert task.waiting_for == "admission", "its timeline says it waits for a slot"
    assert store.fair.counts("a").running == 2 and store.fair.counts("a").parked == 2
    assert store.fair.release(a1, SHARES) == [a3], "the freed slot goes to the first parked run"
    assert store.fair.release(a1, SHARES) == [], "a second release of one run frees nothing"
    assert start(store, a3).verdict == "run", "given the slot: its restart runs"
    assert fair.get_task(a3).waiting_for is None


def test_a_release_while_a_status_frees_nothing_once_the_task_has_another(fair: Coordinator) -> None:
    """A repair read the task ended and frees its fleet slot only while it still is (fair_release.lua checks the
    status in the step that frees it): a retry since made it active, and its new run's slot stays, nor is the slot
    given to a parked run."""
    store = fair.store
    a1, a2, a3 = children(fair, "a", 3)
    assert [start(store, t).verdict for t in (a1, a2, a3)] == ["run", "run", "park"]
    status = fair.get_task(a1).status.value
    assert store.fair.release(a1, SHARES, while_status="failed") == [], "it is not failed: nothing freed or given"
    assert store.fair.counts("a") == FairCounts(running=2, parked=1, queued=0), store.fair.counts("a")
    assert store.fair.release(a1, SHARES, while_status=status) == [a3], "as read: freed, and given on"


def test_a_parked_run_admitted_by_its_messages_second_delivery_leaves_the_parked_runs(fair: Coordinator) -> None:
    """A parked run's message delivered again (the reconciler's false `run-lost`) finds room and runs: it leaves
    its tenant's parked runs there. Left in them, a later release handed it a second slot while it waited on a
    person or on its children, and the tenant ran one fewer than its share until the slot was healed."""
    store = fair.store
    beat(store, {"*": (1, 0)}, concurrency=1)
    running, parked = children(fair, "b", 2)
    assert start(store, running).verdict == "run"
    assert (start(store, parked).verdict, store.fair.counts("b").parked) == ("park", 1)
    beat(store, {"*": (1, 0)}, concurrency=2)  # the fleet grew
    assert start(store, parked).verdict == "run", "its second delivery finds room"
    assert store.fair.counts("b") == FairCounts(running=2, parked=0, queued=0), store.fair.counts("b")
    assert store.fair.release(running, SHARES) == [], "the slot freed goes to no run that holds one already"


def test_priority_first_then_arrival_within_a_tenant(fair: Coordinator) -> None:
    store = fair.store
    first, second = children(fair, "a", 2)
    low = children(fair, "a", 2, priority=3)
    high = children(fair, "a", 1, priority=5)
    assert [start(store, t).verdict for t in (first, second, *low, *high)] == ["run", "run", "park", "park", "park"]
    assert store.fair.release(first, SHARES) == high, "priority 5, parked last, starts first"
    assert store.fair.release(second, SHARES) == low[:1], "then the earliest of priority 3"


def test_runs_parked_in_one_millisecond_start_in_the_order_they_parked(
    fair: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parks of one priority stamped with the same millisecond (or an earlier one, by another worker's
    clock) keep the order they parked in, where equal scores would sort by task id."""
    store = fair.store
    running = children(fair, "a", 2)
    assert [start(store, t).verdict for t in running] == ["run", "run"]
    waiting = children(fair, "a", 6)
    frozen = time.time()
    for step, task_id in enumerate(waiting):
        # The first three share one millisecond; the last three come stamped a second earlier.
        monkeypatch.setattr(time, "time", lambda at=frozen - (step >= 3): at)
        assert start(store, task_id).verdict == "park"
    monkeypatch.undo()
    started = [store.fair.release(running[i % 2], SHARES) for i in range(2)]
    assert started == [waiting[:1], waiting[1:2]], "the first two parked start first, in that order"
    assert store.client.zrange(store.keys.tenant_parked("a"), 0, -1) == waiting[2:]


def test_a_lone_tenant_uses_the_whole_fleet_and_the_fleet_caps_it(fair: Coordinator) -> None:
    store = fair.store
    ids = children(fair, "solo", SHARES.capacity + 1)
    assert [start(store, t).verdict for t in ids[:-1]] == ["run"] * SHARES.capacity
    last = start(store, ids[-1])
    assert (last.verdict, last.parked_for) == ("park", "fleet"), "every slot of the fleet is promised"
    assert store.fair.release(ids[0], SHARES) == [ids[-1]]


def test_a_tenant_over_its_share_gives_the_slot_to_the_neediest(fair: Coordinator) -> None:
    """b (weight 1) holds 3 slots; a (weight 3) holds none, its runs parked: b's next arrival parks, and the
    slot goes to a's parked run in the same step."""
    store = fair.store
    beat(store, {"a": (3, 0), "b": (1, 0), "*": (1, 0)})
    b_runs = children(fair, "b", 5)
    assert [start(store, t).verdict for t in b_runs[:3]] == ["run"] * 3
    a_runs = children(fair, "a", 2)
    store.fair.announce("a", a_runs)  # published: a's demand while its messages wait in the broker
    assert store.fair.counts("a").queued == 2
    b4 = start(store, b_runs[3])
    assert (b4.verdict, b4.parked_for, b4.admitted) == ("park", "share", []), "a's runs are still in the broker"
    assert start(store, a_runs[0]).verdict == "run", "a is furthest below its share: it runs as it comes"
    assert store.fair.counts("a").queued == 1
    # a holds 1 (score 2/3) and wants more; b would hold 4 (score 4): b's arrival parks, a's parked run is
    # given the slot instead (none parked yet: it waits in the broker, so nothing is given).
    a_parked = children(fair, "a", 1)
    store.client.zadd(store.keys.tenant_parked("a"), {a_parked[0]: 0})  # as a's start parks it
    b5 = start(store, b_runs[4])
    assert (b5.verdict, b5.parked_for, b5.admitted) == ("park", "share", a_parked)
    assert store.fair.counts("a").running == 2 and store.fair.counts("b").running == 3


def test_announced_runs_count_until_they_come_or_age_out(fair: Coordinator) -> None:
    store = fair.store
    ids = children(fair, "b", 2)
    store.fair.announce("b", ids)
    assert store.client.zscore(store.keys.fair_wanting(), "b") == 1.0, "(0 running + 1) / weight 1"
    store.client.zadd(store.keys.tenant_queued("b"), {ids[1]: 0})  # announced long ago: its message is lost
    start(store, ids[0])
    assert store.fair.counts("b").queued == 0 and store.client.zscore(store.keys.fair_wanting(), "b") is None


def test_the_capacity_is_the_live_workers_concurrency(fair: Coordinator) -> None:
    store = fair.store
    assert beat(store, {"*": (1, 0)}, concurrency=8) == 8
    store.convergence.renew_leases([], 30, "host:123")  # a run's heartbeat names a beating process again
    assert beat(store, {"*": (1, 0)}, concurrency=8) == 8
    store.convergence.renew_leases([], 30, "w2")
    store.fair.beat("w2", 4, 30, {"*": (1, 0)})
    assert store.fair.capacity() == 12
    store.client.zadd(store.keys.workers(), {"w2": 1.0})  # its heartbeat is old: gone
    assert beat(store, {"*": (1, 0)}, concurrency=8) == 8
    assert sorted(store.client.hkeys(store.keys.worker_slots())) == ["w1"]


def test_a_tenants_table_of_thousands_is_written_whole_by_the_beat(fair: Coordinator) -> None:
    """A table of one tenant a customer: its 8,000 values and more were unpacked into one HSET, past what Lua
    unpacks ("too many results to unpack"), and every beat failed."""
    store = fair.store
    table = {f"t{i}": (1 + i % 3, i % 5) for i in range(4100)} | {"*": (1, 0)}
    assert beat(store, table) == SHARES.capacity
    written = store.client.hgetall(store.keys.fair_policies())
    assert written.pop("~changed") == "1", "a new table: the next take scores the wanting tenants again"
    assert len(written) == len(table)
    assert beat(store, table) == SHARES.capacity
    assert store.client.hget(store.keys.fair_policies(), "~changed") == "1", "kept until a take has taken it up"
    assert written["t4099"] == f"{1 + 4099 % 3} {4099 % 5}" and written["*"] == "1 0"


def test_with_fair_shares_off_nothing_of_them_is_written(fair: Coordinator) -> None:
    store = fair.store
    (one,) = children(fair, "a", 1)
    before = set(store.client.scan_iter(f"{store.keys.prefix}:fair:*"))
    assert start(store, one, FairShares()).verdict == "run"
    assert store.fair.counts("a").running == 0
    assert set(store.client.scan_iter(f"{store.keys.prefix}:fair:*")) == before


def test_a_parked_run_says_what_it_waits_for_and_why_on_every_face(fair: Coordinator) -> None:
    """The live snapshot (the API's tree, the web view, `subq run --follow`) carries the parked run's
    `waiting_for` and `reason`, not only its state."""
    from coordinator import admission
    from coordinator.cli.views import _live_note

    store = fair.store
    a1, a2, a3 = children(fair, "a", 3)
    assert [start(store, t).verdict for t in (a1, a2)] == ["run", "run"]
    parked = start(store, a3)
    assert parked.verdict == "park" and parked.record is not None
    admission.must_wait(fair.plane, parked.record, 0, parked.parked_for, parked.admitted)
    live = fair.snapshot(fair.get_task(a3).root_id)[a3]
    assert (live.state, live.waiting_for, live.reason) == ("queued", "admission", "tenant a holds its max_running")
    assert "waiting for admission: tenant a holds its max_running" in _live_note(live)
    assert live.model_dump()["reason"] == "tenant a holds its max_running", "the API's body carries it"
    running = fair.snapshot(fair.get_task(a1).root_id)[a1]
    assert running.waiting_for is None and running.reason is None


def test_the_pass_frees_a_slot_whose_task_is_gone_or_ended_and_gives_it_on(fair: Coordinator) -> None:
    """A run whose tree was deleted (or expired), or that ended while fair shares were off, keeps no slot:
    the reconciler's pass (fair_heal.lua) frees it and gives it to the parked run."""
    store = fair.store
    a1, a2, a3, a4 = children(fair, "a", 4)
    assert [start(store, t).verdict for t in (a1, a2, a3, a4)] == ["run", "run", "park", "park"]
    assert store.fair.heal(SHARES, 30, 100) == FairHealed(), "every slot's task is live: nothing to do"
    root = fair.get_task(a1).root_id
    fair.client.delete(store.keys.task(root, a1), store.keys.lease(root, a1))  # its tree deleted under it
    healed = store.fair.heal(SHARES, 30, 100)
    # Parked in one ms, a3 and a4 are ordered by id: either is the first given a slot.
    assert healed.freed == [a1] and len(healed.started) == 1 and healed.started[0] in (a3, a4)
    (rest,) = {a3, a4} - set(healed.started)
    fair.client.hset(store.keys.task(root, a2), TaskField.STATUS, "completed")  # ended while fair shares were off
    fair.client.delete(store.keys.lease(root, a2))  # (its end frees its lease)
    healed = store.fair.heal(SHARES, 30, 100)
    assert (healed.freed, healed.started) == ([a2], [rest])
    assert store.fair.counts("a") == FairCounts(running=2, parked=0, queued=0)
    assert sorted(store.client.hkeys(store.keys.fair_holding())) == sorted([a3, a4])


def test_the_pass_leaves_the_slot_of_a_stopped_run_that_still_runs_until_its_lease_is_gone(fair: Coordinator) -> None:
    """A stopped run goes on until its next step reads the stop (a request in flight, a tool call running), and
    frees its slot as it ends. The pass freed it at once before, and gave it to a parked run: both ran, over the
    tenant's max_running and the fleet's capacity. Now it waits for the run's lease: its end, or its lapse."""
    store = fair.store
    a1, a2, a3, a4 = children(fair, "a", 4)
    assert [start(store, t).verdict for t in (a1, a2, a3, a4)] == ["run", "run", "park", "park"]
    root = fair.get_task(a1).root_id
    fair.cancel(root, "not needed")  # the stop a caller with fair shares off makes: it withdraws nothing
    assert {fair.get_task(t).status for t in (a1, a2)} == {TaskStatus.CANCELLED}
    assert store.fair.heal(SHARES, 30, 100) == FairHealed(), "both runs still hold their leases: still running"
    assert sorted(store.client.hkeys(store.keys.fair_holding())) == sorted([a1, a2])
    fair.client.delete(store.keys.lease(root, a1))  # its run died, and its lease lapsed
    healed = store.fair.heal(SHARES, 30, 100)
    assert healed.freed == [a1], "no run holds it now: nothing else would free it"
    assert store.fair.counts("a").running == 1, "the parked runs were stopped too: none took the slot"


def test_the_pass_keeps_a_tenants_running_set_while_its_slots_are_held(fair: Coordinator) -> None:
    """A tenant's running set (what max_running counts) had its expiry renewed only by an admission: long runs that
    held their slots through a retention with no admission between lost it, and the tenant read none running, over
    its max_running from then on. The pass puts each held slot back in it and keeps it a retention more."""
    store = fair.store
    a1, a2, a3 = children(fair, "a", 3)
    assert [start(store, t).verdict for t in (a1, a2)] == ["run", "run"]
    running = store.keys.tenant_running("a")
    fair.client.delete(running)  # its retention ran out while both ran
    assert store.fair.heal(SHARES, 30, 100) == FairHealed(), "both tasks live: nothing freed, nothing given"
    assert sorted(fair.client.smembers(running)) == sorted([a1, a2])
    assert 0 < fair.client.ttl(running) <= store.retention_s
    assert start(store, a3).verdict == "park", "max_running 2 still counts both"


def test_the_slot_of_a_run_dead_after_it_parked_a_call_is_freed_only_while_the_call_waits(fair: Coordinator) -> None:
    """The reconciler frees the fleet slot of a run that parked a call for a person and died before its release
    (`while_asked`), checked in the step that frees it: while the call is pending the slot goes to the parked
    run; once decided, the slot is left to the resumed run, which reuses it."""
    store = fair.store
    a1, a2, a3, a4 = children(fair, "a", 4)
    assert [start(store, t).verdict for t in (a1, a2, a3, a4)] == ["run", "run", "park", "park"]
    (asked,) = approvals.park(fair.plane, fair.get_task(a1), [ToolCall("run_command", {"command": "ls"}, "c1")]) or []
    (decided,) = approvals.park(fair.plane, fair.get_task(a2), [ToolCall("run_command", {"command": "ls"}, "c2")]) or []
    assert fair.decide(decided.id, "approve").status == "approved"
    assert store.fair.release(a2, SHARES, while_asked=True) == [], "decided: the slot is its resumed run's"
    assert store.fair.counts("a") == FairCounts(running=2, parked=2, queued=0)
    given = store.fair.release(a1, SHARES, while_asked=True)
    assert len(given) == 1 and given[0] in (a3, a4), "pending: freed, and given to a parked run"
    assert sorted(store.client.hkeys(store.keys.fair_holding())) == sorted([a2, *given])


def test_a_runs_release_frees_no_fleet_slot_of_a_newer_start_of_its_task(fair: Coordinator) -> None:
    """A run's release frees its fleet slot after its lease, naming its token (`while_run`): a start of the task
    between the two (a decision's resume) reuses the slot, so the release leaves it; the last start's frees it."""
    store = fair.store
    a1, a2, a3 = children(fair, "a", 3)
    first = secrets.token_hex(4)
    assert store.runs.begin_run(a1, first, 60, 30, AdmissionLimits(), SHARES).verdict == "run"
    assert [start(store, t).verdict for t in (a2, a3)] == ["run", "park"]
    assert store.runs.release_lease(a1, first)
    newer = secrets.token_hex(4)
    assert store.runs.begin_run(a1, newer, 60, 30, AdmissionLimits(), SHARES).verdict == "run", "reuses its slot"
    assert store.fair.release(a1, SHARES, while_run=first) == [], "the newer start holds it"
    assert sorted(store.client.hkeys(store.keys.fair_holding())) == sorted([a1, a2])
    assert store.fair.release(a1, SHARES, while_run=newer) == [a3], "its own release gives it on"


def test_a_stop_takes_its_runs_out_of_their_tenants_demand_and_gives_the_slots_on(fair: Coordinator) -> None:
    """A cancelled batch's runs, announced in the broker's queue, want no slot any more. Their messages are
    revoked and never reach a worker to take them out, so until they aged out (30 s) the stopped tenant looked
    the neediest, every slot the fleet freed went to nobody, and the other tenant's parked run waited."""
    store = fair.store
    shares = FairShares(on=True, capacity=3)
    beat(store, {"a": (2, 0), "b": (1, 0), "*": (1, 0)}, concurrency=3)
    a1, a2, a3 = children(fair, "a", 3)
    assert [start(store, t, shares).verdict for t in (a1, a2)] == ["run", "run"]
    b_ids = children(fair, "b", 5)
    store.fair.announce("b", b_ids)  # as the delegation's publish does, fair shares on
    parked = start(store, a3, shares)
    assert (parked.verdict, parked.parked_for) == ("park", "share"), "b, holding none, is below its share"
    queued = fair.client.llen(fair.settings.queue)
    cancel_with_fair_shares_on(fair, b_ids[0])
    assert store.fair.counts("b") == FairCounts(running=0, parked=0, queued=0), "b wants nothing now"
    assert store.client.zscore(store.keys.fair_wanting(), "b") is None
    assert store.fair.counts("a") == FairCounts(running=3, parked=0, queued=0), "the free slot went to a3"
    assert store.client.hget(store.keys.fair_holding(), a3) == "a"
    assert fair.client.llen(fair.settings.queue) == queued + 1, "a3's restart was published"
    assert a3 in fair.client.lindex(fair.settings.queue, 0), "the newest message is a3's"


def test_a_stop_takes_its_parked_runs_out_of_their_tenants_demand(fair: Coordinator) -> None:
    store = fair.store
    shares = FairShares(on=True, capacity=1)
    beat(store, {"a": (2, 0), "b": (1, 0), "*": (1, 0)}, concurrency=1)
    b1, b2 = children(fair, "b", 2)
    assert [start(store, t, shares).verdict for t in (b1, b2)] == ["run", "park"]
    cancel_with_fair_shares_on(fair, b1)
    # b1's run still holds its slot until it reads the stop and ends (its end frees it).
    assert store.fair.counts("b") == FairCounts(running=1, parked=0, queued=0), "b2 is parked no more"


def cancel_with_fair_shares_on(fair: Coordinator, task_id: str) -> None:
    """Cancel the task's tree as a caller whose tenants table has fair shares on (as the fleet's does)."""
    caller = Coordinator(fair.settings.model_copy(update={"tenants": {"a": TenantPolicy(weight=2)}}))
    try:
        assert caller.plane.tenants.fair_shares
        caller.cancel(fair.get_task(task_id).root_id, "changed my mind")
    finally:
        caller.close()


def test_a_parked_run_stopped_or_gone_since_it_parked_is_dropped_and_the_slot_goes_on(fair: Coordinator) -> None:
    """A stop by a caller whose table has fair shares off (or a park that crossed the stop) leaves stopped runs
    parked, and a tree deleted under its parked runs leaves them there too: the hand-over drops each rather
    than give it the slot (a cancelled run's restart would only end and free it again), and writes no mark on a
    task that is gone (a hash with a timeline alone, which the reconciler could not read)."""
    store = fair.store
    shares = FairShares(on=True, capacity=2)
    beat(store, {"a": (1, 0), "b": (3, 0), "*": (1, 0)}, concurrency=2)
    b1, b2, b3, b4 = children(fair, "b", 4)
    assert [start(store, t, shares).verdict for t in (b1, b2, b3, b4)] == ["run", "run", "park", "park"]
    assert not fair.plane.tenants.fair_shares, "this caller's table has fair shares off: its stop withdraws none"
    fair.cancel(fair.get_task(b1).root_id, "stop")
    gone = store.keys.task(fair.get_task(b4).root_id, b4)
    fair.client.delete(gone)  # b4's tree is gone too, as an expired one is
    (a1,) = children(fair, "a", 1)
    assert start(store, a1, shares).parked_for == "fleet"
    # b (weight 3, one slot held once b1's is freed) is the neediest: its parked runs are met first.
    assert store.fair.release(b1, shares) == [a1], "the slot goes past the stopped and the gone to a1"
    assert store.fair.counts("b") == FairCounts(running=1, parked=0, queued=0)
    assert not fair.client.exists(gone), "no mark was written on the task that is gone"


def test_room_made_without_a_release_goes_to_the_tenants_parked_runs_before_a_newcomer(fair: Coordinator) -> None:
    """A raised `max_running` makes room before the leader's pass: a run of the tenant that reaches a worker then
    parks behind the tenant's parked runs of a higher priority, or of its own parked earlier, and the first of
    them is given the slot in its step. Before, the newcomer took it, ahead of a priority-5 run parked for it."""
    store = fair.store
    running = children(fair, "a", 2)
    high = children(fair, "a", 1, priority=5)
    same = children(fair, "a", 1)
    late, later = children(fair, "a", 2)
    assert [start(store, t).verdict for t in (*running, *high, *same)] == ["run", "run", "park", "park"]
    beat(store, {"a": (3, 4), "b": (1, 0), "*": (1, 0)})  # two more fit now; no run ended
    first = start(store, late)
    assert (first.verdict, first.parked_for, first.admitted) == ("park", "order", high), "the priority-5 run first"
    second = start(store, later)
    assert (second.verdict, second.admitted) == ("park", same), "then the one of its priority parked before it"
    assert store.fair.counts("a") == FairCounts(running=4, parked=2, queued=0), store.fair.counts("a")
    assert [start(store, t).verdict for t in (*high, *same)] == ["run", "run"], "given the slots: their restarts run"
    from coordinator import admission

    assert first.record is not None
    admission.must_wait(fair.plane, first.record, 0, first.parked_for, first.admitted)
    live = fair.snapshot(fair.get_task(late).root_id)[late]
    assert live.reason == "tenant a gave its slot to its own parked run of a higher priority or an earlier arrival"


@pytest.mark.parametrize("ahead_ms", [0, 60_000], ids=["same millisecond", "a clock ahead"])
def test_a_newcomer_comes_after_its_priority_s_parked_run_whatever_its_stamp(fair: Coordinator, ahead_ms: int) -> None:
    """A run parked in the newcomer's own millisecond (CI's quick host), or stamped by a worker whose clock runs a
    minute ahead, parked before the newcomer came: it is given the room. Before, a stamp not strictly below the
    newcomer's `now` let the newcomer take it."""
    store = fair.store
    running = children(fair, "a", 2)
    (parked,) = children(fair, "a", 1)
    (newcomer,) = children(fair, "a", 1)
    assert [start(store, t).verdict for t in (*running, parked)] == ["run", "run", "park"]
    key = store.keys.tenant_parked("a")
    stamp = store.client.time()
    now_ms = stamp[0] * 1000 + stamp[1] // 1000
    store.client.zadd(key, {parked: -3 * 10**13 + now_ms + ahead_ms + 5_000}, xx=True)  # past the start's `now`
    beat(store, {"a": (3, 3), "b": (1, 0), "*": (1, 0)})
    came = start(store, newcomer)
    assert (came.verdict, came.admitted) == ("park", [parked]), came
    assert store.fair.counts("a") == FairCounts(running=3, parked=1, queued=0), store.fair.counts("a")


@pytest.mark.parametrize(("parked_priority", "stopped"), [(1, False), (5, True)], ids=["lower", "stopped"])
def test_a_newcomer_takes_the_room_when_no_live_parked_run_comes_before_it(
    fair: Coordinator, parked_priority: int, stopped: bool
) -> None:
    """The tenant's parked run is of a lower priority (`lower`), or it comes first but its tree was stopped by a
    caller whose table has fair shares off (`stopped`: dropped on the way, not given the slot)."""
    store = fair.store
    running = children(fair, "a", 2)
    parked = children(fair, "a", 1, priority=parked_priority)
    (newcomer,) = children(fair, "a", 1, priority=3)
    assert [start(store, t).verdict for t in (*running, *parked)] == ["run", "run", "park"]
    if stopped:
        fair.cancel(fair.get_task(parked[0]).root_id, "stop")
    beat(store, {"a": (3, 3), "b": (1, 0), "*": (1, 0)})
    assert start(store, newcomer).verdict == "run", "nothing live parked comes before it"
    left = 0 if stopped else 1
    assert store.fair.counts("a") == FairCounts(running=3, parked=left, queued=0), store.fair.counts("a")


def test_a_parked_run_whose_tenant_has_parked_runs_ahead_of_it_gives_them_the_room(fair: Coordinator) -> None:
    """A parked run's message delivered again when room was made keeps its place: the run ahead of it starts."""
    store = fair.store
    running = children(fair, "a", 2)
    ahead, behind = children(fair, "a", 2)
    assert [start(store, t).verdict for t in (*running, ahead, behind)] == ["run", "run", "park", "park"]
    beat(store, {"a": (3, 3), "b": (1, 0), "*": (1, 0)})
    again = start(store, behind)
    assert (again.verdict, again.admitted) == ("park", [ahead])
    assert store.client.zrange(store.keys.tenant_parked("a"), 0, -1) == [behind], "it kept its place"


def test_a_raised_max_running_admits_what_now_fits(fair: Coordinator) -> None:
    store = fair.store
    ids = children(fair, "a", 5)
    assert [start(store, t).verdict for t in ids] == ["run", "run", "park", "park", "park"]
    beat(store, {"a": (3, 4), "b": (1, 0), "*": (1, 0)})  # the tenants table now lets a run 4
    started = store.fair.heal(SHARES, 30, 100).started
    assert len(started) == 2 and set(started) < set(ids[2:]), "two more fit"
    assert store.fair.counts("a") == FairCounts(running=4, parked=1, queued=0)


@pytest.mark.parametrize("others", [0, 150], ids=["two tenants", "past the rescoring bound"])
def test_a_tenant_whose_max_running_was_raised_is_not_left_behind_a_tenant_with_room(
    fair: Coordinator, others: int
) -> None:
    """Scored +inf while at its max_running, a tenant kept that score after its cap was raised: every slot freed
    went to the other tenant, however far over its share, for as long as the capped tenant's run ran. With more
    tenants waiting than a take scores again, the capped ones (last in the queue) are scored first."""
    store = fair.store
    now_ms = int(time.time() * 1000)
    for n in range(others):  # tenants far over their share (10 running), each with a run in the broker's queue
        store.client.sadd(store.keys.tenant_running(f"other{n}"), *[f"running{n}-{k}" for k in range(10)])
        store.client.zadd(store.keys.tenant_queued(f"other{n}"), {f"run{n}": now_ms})
        store.client.zadd(store.keys.fair_wanting(), {f"other{n}": 11})
    four = FairShares(on=True, capacity=4)
    beat(store, {"a": (1, 0), "b": (1, 1), "*": (1, 0)}, 4)
    b, a = children(fair, "b", 3), children(fair, "a", 8)
    assert start(store, b[0], four).verdict == "run"
    assert [start(store, t, four).verdict for t in a[:3]] == ["run"] * 3
    assert [start(store, t, four).verdict for t in b[1:]] == ["park"] * 2, "b holds its max_running of 1"
    assert [start(store, t, four).verdict for t in a[3:]] == ["park"] * 5, "the fleet is full"
    beat(store, {"a": (1, 0), "b": (1, 0), "*": (1, 0)}, 4)  # b's cap lifted: b runs 1 against a's 3
    assert store.fair.release(a[0], four) in ([b[1]], [b[2]]), "the slot freed goes to b, furthest below its share"
    assert store.fair.counts("b") == FairCounts(running=2, parked=1, queued=0)
    beat(store, {"a": (1, 0), "b": (1, 0), "*": (1, 0)}, 4)
    assert store.client.hget(store.keys.fair_policies(), "~changed") is None, "the same table changes nothing"


def test_with_fair_shares_off_the_pass_releases_every_parked_run(fair: Coordinator) -> None:
    """The tenants table turned fair shares off while runs were parked: the reconciler's tick publishes each
    again (its restart in the queue), from the due list so a crash before the publish is covered."""
    from coordinator.reconciler import Reconciler

    store = fair.store
    ids = children(fair, "a", 4)
    assert [start(store, t).verdict for t in ids] == ["run", "run", "park", "park"]
    store.fair.announce("a", ["announced-not-arrived"])
    queue = fair.settings.queue
    before = fair.client.llen(queue)
    assert not fair.plane.tenants.fair_shares, "this coordinator's tenants table has fair shares off"
    repairs = Reconciler(fair, "n@host:1").tick()
    assert repairs is not None and repairs["parked-released"] == 2
    assert fair.client.llen(queue) == before + 2, "each parked run's restart was published"
    assert store.fair.counts("a") == FairCounts(running=2, parked=0, queued=0)
    assert store.client.zscore(store.keys.fair_wanting(), "a") is None
    due = store.convergence.watched()
    assert all(due[i] > time.time() for i in ids[2:]), "on the due list: a restart lost is published again"
    assert Reconciler(fair, "n@host:1").tick() == Counter(), "a second pass finds nothing"
    assert fair.get_task(ids[2]).waiting_for is None, "its timeline left the wait"


def test_with_fair_shares_off_the_pass_takes_out_a_parked_run_whose_tree_is_gone(fair: Coordinator) -> None:
    """A parked run whose tree was deleted (or expired) after fair shares were turned off: the pass marked its
    timeline on a task hash that was gone, which made it again with that one field and no expiry, and the tick
    then failed reading it (CorruptError), publishing none of the others. Now it is only taken out."""
    from coordinator.reconciler import Reconciler

    store = fair.store
    ids = children(fair, "a", 4)
    assert [start(store, t).verdict for t in ids] == ["run", "run", "park", "park"]
    gone, other = ids[2], ids[3]
    root = fair.get_task(gone).root_id
    fair.client.delete(store.keys.task(root, gone))
    before = fair.client.llen(fair.settings.queue)
    repairs = Reconciler(fair, "n@host:1").tick()
    assert repairs is not None and repairs["parked-released"] == 1, repairs
    assert not fair.client.exists(store.keys.task(root, gone)), "no hash made again for the gone task"
    assert fair.client.llen(fair.settings.queue) == before + 1, "the other parked run's restart was published"
    assert store.fair.counts("a").parked == 0 and other in store.convergence.watched()
