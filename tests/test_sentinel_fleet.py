"""A Redis failover under a working fleet: real workers, real sentinels, the master SIGKILLed mid-way.

Three trees run across the switch: an agent that fans out to a hundred children
waiting on their model, a sequential chain, and a tree cancelled just before the
kill. The replicas stall for half a second before the master dies, so the
promoted one lacks the master's last writes, as asynchronous replication can
leave it. The sentinels promote a replica (DOWN_AFTER_MS of silence, then an
election); the workers' clients, broker and result backend follow it (every
node has min-replicas-to-write 1, as docs/deploy.md asks, so the promoted master
takes writes once a replica follows it); the
reconciler moves on whatever the switch left or lost. Every tree converges with exact
totals, no child's request counted twice, and the agent resumed once; the
consumers, reconnected through kombu's sentinel transport, still dead-letter an
unreadable entry. The time from the promotion until a task published after it
has run is printed: the "serving again" figure of docs/deploy.md.

Then docs/deploy.md's planned switch, made mid fan-out under two workers: the
workers' broker connections follow it (no restart), the tree completes with
each child run once, and a delegation made right after it runs within the same
bound.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.errors import WaitTimeout
from coordinator.local.fleet import WorkerFleet
from tests.agents import agent, call, reply
from tests.helpers import eventually
from tests.sentinel_kit import SentinelSet, assert_each_request_once, fleet_on, replica_lag_bytes, sentinel_set
from tests.test_faults import assert_converged

CHILDREN = 100
CHAIN_STEPS = 4
# Each child waits this long on its model: the fan-out is still running when the master dies.
CHILD_LATENCY_MS = 700
# The bound: workers serve again within this of the promotion.
SERVING_AGAIN_S = 15
# The master's last writes the promoted replica never got (the replicas stalled that long before the kill).
LOST_S = 0.5
# A planned switch's children: a fifth have ended when it starts, the rest run across it.
SWITCH_CHILDREN = 40
WAIT_S = 120


@pytest.fixture
def fleet_on_sentinel(settings: Settings, tmp_path: Path) -> Iterator[tuple[SentinelSet, Coordinator, WorkerFleet]]:
    # min-replicas-to-write 1, as docs/deploy.md asks of every node: until the surviving replica follows the
    # promoted master, that master refuses writes (the workers send them again), so none stands on it alone. Without
    # it a second failover, which a loaded host can bring about (the promoted master slow to answer the sentinels),
    # promoted a replica that had not followed: CI read the fan-out's root `completed`, then `delegated` again.
    with sentinel_set(tmp_path / "sentinels", min_replicas_to_write=1) as kit:
        # visibility_timeout_s: the reconciler, not the broker's backstop, must converge it.
        names = {"key_prefix": "subqfailover", "queue": "subq-failover", "visibility_timeout_s": 300}
        with fleet_on(kit, settings, 2, tmp_path / "workers", **names) as (_own, coord, fleet):
            yield kit, coord, fleet


def _slow(text: str, latency_ms: int) -> str:
    return agent({**reply(text), "latency_ms": latency_ms})


def test_a_failover_mid_fan_out_chain_and_cancel_converges(
    fleet_on_sentinel: tuple[SentinelSet, Coordinator, WorkerFleet],
) -> None:
    kit, coord, fleet = fleet_on_sentinel
    children = [{"description": f"c{n}", "message": _slow(f"c{n} done", CHILD_LATENCY_MS)} for n in range(CHILDREN)]
    fan_out = coord.create_task(
        agent(call("run_subagents", tasks=children), reply("all hundred done"), text="Fan out a hundred."), run=True
    )
    chain = coord.create_task("A chain")
    coord.delegate(
        chain.id,
        [{"description": f"s{n}", "message": _slow(f"s{n} done", 800)} for n in range(CHAIN_STEPS)],
        mode="sequential",
    )
    doomed = coord.create_task("To cancel")
    coord.delegate(doomed.id, [{"description": f"d{n}", "message": _slow("never", 30_000)} for n in range(5)])

    def ended_children() -> int:
        return sum(c.status.terminal for c in coord.get_children(fan_out.id))

    eventually(lambda: ended_children() >= CHILDREN // 5 or None, "a fifth of the children to end", WAIT_S)
    coord.cancel(doomed.id, "cancelled just before the failover")  # acknowledged: a replica has it
    lag_bytes = replica_lag_bytes(kit)  # what a replica lacks of the master's writes before the stall
    # The replicas stall for LOST_S while the workers write, then the master dies: the promoted one lacks
    # those writes (runs started, ended, written back, messages taken), and the trees converge all the same.
    old, lost_bytes = kit.kill_master_losing(LOST_S)
    assert min(lost_bytes) > 0, f"no write was lost: the replicas lacked {lost_bytes} bytes at the kill"
    killed_at = time.monotonic()
    kit.wait_promoted(old)
    promoted_at = time.monotonic()

    # Serving again: a task published after the promotion runs.
    probe = coord.create_task("A probe")
    coord.delegate(probe.id, [{"description": "p", "message": agent(reply("p done"))}])
    coord.wait(probe.id, WAIT_S)
    serving_again_s = time.monotonic() - promoted_at
    print(
        f"\nfailover: promoted {promoted_at - killed_at:.1f} s after the kill; serving again {serving_again_s:.1f} s "
        f"after; the replicas were {lag_bytes} bytes behind before a {LOST_S} s stall, {lost_bytes} at the kill"
    )
    assert serving_again_s < SERVING_AGAIN_S

    try:
        done = coord.wait(fan_out.id, WAIT_S)
    except WaitTimeout:
        pytest.fail(_why_outstanding(coord, fleet, fan_out.id))
    assert done.status == TaskStatus.COMPLETED and done.summary == "all hundred done"
    coord.wait(chain.id, WAIT_S)
    print(f"the masters the sentinels named after the kill, in order: {kit.switches()}")  # shown on a failure
    for root in (fan_out.id, chain.id, doomed.id, probe.id):
        assert_converged(coord, root)

    kids = coord.get_children(fan_out.id)
    assert len(kids) == CHILDREN and all(k.status == TaskStatus.COMPLETED for k in kids)
    parent = coord.get_task(fan_out.id)
    assert_each_request_once(parent, kids)
    assert parent.requests == 2, "the agent resumed once: its delegation and its answer"
    assert [m.get("say") for m in coord.messages(fan_out.id)].count("subtask_result") == 1, "the batch closed once"

    steps = coord.get_children(chain.id)
    assert [s.summary for s in steps] == [f"s{n} done" for n in range(CHAIN_STEPS)]
    assert {(s.status, s.requests) for s in steps} == {(TaskStatus.COMPLETED, 1)}

    assert coord.get_task(doomed.id).status == TaskStatus.CANCELLED
    assert all(c.status == TaskStatus.CANCELLED for c in coord.get_children(doomed.id))
    # The consumer's dead-letter boundary holds on kombu's sentinel transport too (workers/poison.py).
    coord.client.lpush(coord.settings.queue, "not a message")
    eventually(lambda: coord.count_dead_letters() == 1 or None, "the unreadable entry dead-lettered", 20)
    # A run whose Redis commands outlasted their retries is retried by Celery (workers/tasks.py): it converges
    # all the same, but it is not what a failover should cause, so it is shown.
    retried = [
        line for log in fleet.logs for line in log.read_text(errors="replace").splitlines() if "Retry in" in line
    ]
    print(f"tasks Celery retried across the failover: {len(retried)}", *retried[:5], sep="\n")


def _why_outstanding(coord: Coordinator, fleet: WorkerFleet, parent_id: str) -> str:
    """What the reconciler and the workers knew of each child still outstanding (seen twice in CI, never here:
    the failure must say why itself)."""
    convergence, watched = coord.store.convergence, coord.store.convergence.watched()
    lines = [f"{parent_id} never converged; repairs {convergence.repairs()}"]
    for task_id in coord.get_task(parent_id).awaiting_ids:
        task = coord.get_task(task_id)
        triaged = convergence.triage([task_id])[0]
        lines.append(
            f"{task_id}: {task.status.value} waiting_for={task.waiting_for} leased={triaged.leased} "
            f"due_in_s={round(watched[task_id] - time.time()) if task_id in watched else None} "
            f"held={convergence.reserved(task_id)} "
            f"queued={task_id in convergence.queued_task_ids(coord.settings.queue)} timeline={task.timeline}"
        )
        lines += [
            f"  {line}"
            for log in fleet.logs
            for line in log.read_text(errors="replace").splitlines()
            if task_id in line
        ][-8:]
    return "\n".join(lines)


def test_the_workers_follow_a_planned_switch(settings: Settings, tmp_path: Path) -> None:
    """docs/deploy.md's planned switch mid fan-out: the workers' consumers follow it, without a restart.

    kombu's broker connections reconnected to the old master, now a replica (redis-py issue 3874): a
    consumer stayed there restoring its unacknowledged messages, or met its NOREPLICAS and ended, and
    in 3 of 5 runs no worker took new work within 120 s (coordinator/celery_app.py,
    `FollowingSentinelChannel`). Every node and sentinel has a password, every node min-replicas-to-write 1.
    """
    with sentinel_set(tmp_path / "sentinels", password=secrets.token_urlsafe(16), min_replicas_to_write=1) as kit:
        names = {"key_prefix": "subqswitch", "queue": "subq-switch", "visibility_timeout_s": 300}
        with fleet_on(kit, settings, 2, tmp_path / "workers", **names) as (_own, coord, fleet):
            children = [
                {"description": f"c{n}", "message": _slow(f"c{n} done", CHILD_LATENCY_MS)}
                for n in range(SWITCH_CHILDREN)
            ]
            fan_out = coord.create_task(
                agent(call("run_subagents", tasks=children), reply("all done"), text="Fan out."), run=True
            )
            eventually(
                lambda: sum(c.status.terminal for c in coord.get_children(fan_out.id)) >= SWITCH_CHILDREN // 5 or None,
                "a fifth of the children to end",
                WAIT_S,
            )
            old, new = kit.planned_switch()
            switched_at = time.monotonic()

            # Serving again: a task published after the switch runs.
            probe = coord.create_task("A probe")
            coord.delegate(probe.id, [{"description": "p", "message": agent(reply("p done"))}])
            coord.wait(probe.id, WAIT_S)
            serving_again_s = time.monotonic() - switched_at
            print(f"\nplanned switch {old} -> {new}: serving again {serving_again_s:.1f} s after")
            assert serving_again_s < SERVING_AGAIN_S

            done = coord.wait(fan_out.id, WAIT_S)
            assert done.status == TaskStatus.COMPLETED and done.summary == "all done"
            for root in (fan_out.id, probe.id):
                assert_converged(coord, root)
            kids = coord.get_children(fan_out.id)
            assert len(kids) == SWITCH_CHILDREN and all(k.status == TaskStatus.COMPLETED for k in kids)
            assert_each_request_once(coord.get_task(fan_out.id), kids)
            assert coord.get_task(fan_out.id).requests == 2, "the agent resumed once"
            assert [m.get("say") for m in coord.messages(fan_out.id)].count("subtask_result") == 1

            # No worker ended across it: before, a BRPOP that met the old master's NOREPLICAS ended its worker.
            assert all(proc.poll() is None for proc in fleet.procs), "a worker ended across the switch"
            logs = "\n".join(log.read_text(errors="replace") for log in fleet.logs)
            assert "Unrecoverable error" not in logs
