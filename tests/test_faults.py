"""The fault suite: a worker dies at each named crash point, and the fleet converges without it.

Two fleets share one Redis database: the *crashing* worker (one process, one
thread, `SUBQ_FAULT_CRASH_AT` set) consumes the queue the work is published to
and kills itself at the named point (coordinator/faults.py), as a SIGKILL
there would; the *rescuer* (another queue) is a healthy worker whose reconciler
must find what the dead one left and move it on. After each fault the
invariants hold: every tree settled, each child applied once, exact totals,
nothing left in flight, nothing left on the due list.

The clock is scaled down (a 3 s heartbeat lapse, a 0.5 s reconciler tick, a 3 s
grace) so that each fault converges in seconds; the defaults scale the same way
(docs/architecture.md, "Convergence").
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.celery_app import RUN_TASK
from coordinator.local.fleet import WorkerFleet
from tests.agents import STEP_COST_MICROS, agent, call, calls, reply, subtask
from tests.conftest import dedicated_fleet
from tests.helpers import eventually, repairs_reach

LAPSE_S = 3
FAULT_SETTINGS = {
    "queue": "subq-fault",
    "heartbeat_lapse_s": LAPSE_S,
    "reconcile_interval_s": 0.5,
    "reconcile_grace_s": 3,
    "task_time_limit_s": 60,
    "visibility_timeout_s": 300,  # far beyond each test: the reconciler, not the broker, converges them
}
# Kill, lapse, a tick, a run, and the parent's resume, with room for a loaded CI machine.
CONVERGE_S = 45


@pytest.fixture(scope="module")
def fault_settings(settings: Settings) -> Settings:
    assert settings.redis_url
    return settings.model_copy(update={**FAULT_SETTINGS, "redis_url": settings.redis_url.rsplit("/", 1)[0] + "/2"})


@pytest.fixture(scope="module")
def rescuer(fault_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """A healthy worker on a queue of its own; its reconciler must repair what the crashing one left."""
    with dedicated_fleet(
        fault_settings, tmp_path_factory.mktemp("rescuer"), 1, queue="subq-rescue", worker_concurrency=4
    ) as (coord, _fleet):
        yield coord


@pytest.fixture
def coord(fault_settings: Settings, rescuer: Coordinator) -> Iterator[Coordinator]:
    """Publishes to the crashing worker's queue."""
    coord = Coordinator(fault_settings)
    yield coord
    coord.close()


def crashing_worker(settings: Settings, log_dir: Path, point: str = "") -> WorkerFleet:
    own = settings.model_copy(update={"fault_crash_at": point, "worker_concurrency": 1})
    fleet = WorkerFleet(own, 1, log_dir, name="crash")
    fleet.wait_ready()
    return fleet


def died(fleet: WorkerFleet, timeout_s: float = 30) -> None:
    fleet.procs[0].wait(timeout=timeout_s)
    assert fleet.procs[0].returncode == -signal.SIGKILL, fleet.logs[0].read_text(errors="replace")[-2000:]


def assert_converged(coord: Coordinator, root_id: str) -> None:
    """Every task settled, each child applied once to its item, exact totals, nothing in flight."""
    records = [coord.get_task(t) for t in coord.store.records.tree_task_ids(root_id)]
    for record in records:
        assert record.status.terminal or (record.runner == "caller" and record.status == TaskStatus.ACTIVE), record
        for batch_id in [record.waiting_batch_id] if record.waiting_batch_id else []:
            assert coord.get_batch(batch_id).status == "done"
    own = sum(r.cost_micros for r in records)
    assert coord.get_task(root_id).total_cost_micros == own, "the root's total is the sum of every own cost"
    for parent in records:
        for item in coord.get_todos(parent.id):
            if item.subtask_id:
                child = coord.get_task(item.subtask_id)
                assert item.cost_micros == child.total_cost_micros, (item, child)
    # A run's last steps (its lease, its slot, the due list) follow the status `wait` returns on.
    empty = {"running": 0, "admission": 0, "awaiting": 0, "leases": 0, "watched": 0}
    eventually(
        lambda: coord.store.runs.in_flight(root_id) == empty,
        f"nothing in flight (now {coord.store.runs.in_flight(root_id)})",
        10,
    )


def unacked_tasks(coord: Coordinator) -> list[str]:
    """The task names of the messages kombu's unacked hash holds (the broker's redelivery backstop)."""
    return [json.loads(raw)[0]["headers"].get("task") for raw in coord.client.hvals("unacked")]


def repairs_since(coord: Coordinator, before: dict[str, int]) -> dict[str, int]:
    now = coord.store.convergence.repairs()
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def test_a_chain_step_killed_between_its_end_and_the_next_steps_publish(coord: Coordinator, tmp_path: Path) -> None:
    """A step's end is recorded (end_run.lua), the next step not yet published: the reconciler writes it back."""
    before = coord.store.convergence.repairs()
    fleet = crashing_worker(coord.settings, tmp_path, "after-end")
    try:
        parent = coord.create_task("Two steps", todos="[ ] a\n[ ] b")
        items = coord.get_todos(parent.id)
        batch = coord.delegate(
            parent.id,
            [subtask("a", reply("a done"), todo_id=items[0].id), subtask("b", reply("b done"), todo_id=items[1].id)],
            mode="sequential",
        )
        died(fleet)
    finally:
        fleet.stop()
    assert coord.get_task(batch.child_ids[0]).status == TaskStatus.COMPLETED, "the first step had ended"
    coord.wait(parent.id, CONVERGE_S)
    assert coord.get_batch(batch.id).status == "done"
    assert [coord.get_task(c).summary for c in batch.child_ids] == ["a done", "b done"]
    assert [t.cost_micros for t in coord.get_todos(parent.id)] == [STEP_COST_MICROS, STEP_COST_MICROS]
    assert_converged(coord, parent.id)
    ended = repairs_reach(lambda: repairs_since(coord, before).get("ended-not-written-back", 0), 1, "the repair")
    assert ended == 1


@pytest.mark.parametrize("point", ["after-end", "after-close"])
def test_a_parent_whose_resume_was_never_published(coord: Coordinator, tmp_path: Path, point: str) -> None:
    """The last child's end closed the batch (end_run.lua); the worker dies before it sends the parent's resume."""
    before = coord.store.convergence.repairs()
    fleet = crashing_worker(coord.settings, tmp_path, point)
    try:
        root = coord.create_task(
            agent(
                call("run_subagents", tasks=[subtask("A", reply("A done"))]), call("attempt_completion", result="ok")
            ),
            run=True,
        )
        died(fleet)
    finally:
        fleet.stop()
    done = coord.wait(root.id, CONVERGE_S)
    assert done.status == TaskStatus.COMPLETED and done.summary == "ok"
    assert [c.cost_micros for c in coord.get_children(root.id)] == [STEP_COST_MICROS]
    assert_converged(coord, root.id)
    repairs_reach(lambda: repairs_since(coord, before).get("run-lost", 0), 1, "the parent's resume published again")


def test_a_submission_whose_closer_died_before_it_ended_the_root(coord: Coordinator, tmp_path: Path) -> None:
    """A submission's root ends as its batch closes; the worker whose child's end closed it dies between the close
    and the root's end. The root was put on the due list by the close: the reconciler ends it."""
    before = coord.store.convergence.repairs()
    fleet = crashing_worker(coord.settings, tmp_path, "after-close")
    try:
        done = coord.submit("Plan", subtasks=[subtask("A", reply("A done"))])
        assert done.error is None and done.batch is not None
        died(fleet)
    finally:
        fleet.stop()
    ended = coord.wait(done.task.id, CONVERGE_S)
    assert ended.status == TaskStatus.COMPLETED and ended.summary.startswith("Subtask results (parallel, 1 of 1")
    assert_converged(coord, done.task.id)
    repairs_reach(
        lambda: repairs_since(coord, before).get("submission-ended", 0), 1, "the root ended by the reconciler"
    )


def test_a_budget_stop_killed_before_it_writes_the_stopped_child_back(coord: Coordinator, tmp_path: Path) -> None:
    """A child with a budget delegates; its grandchild's end crosses the budget, and the worker that stops the
    child's subtree dies once the stop is persisted, before it writes the child back into its parent's batch.
    The child, delegated, was off the due list: the stop puts it back on in the same step, so the reconciler
    writes it back and the parent's batch closes (before, the parent waited on it for good)."""
    fleet = crashing_worker(coord.settings, tmp_path, "after-stop")
    try:
        root = coord.create_task("Fan out", todos="[ ] c")
        budgeted = {
            "description": "c",
            "todo_id": coord.get_todos(root.id)[0].id,
            # Its own step within the budget; its child's end crosses it, while it waits on its batch.
            "budget_usd": str(Decimal(STEP_COST_MICROS * 3 // 2) / 1_000_000),
            "message": agent(
                call("run_subagents", tasks=[subtask("g", reply("g done"))]), call("attempt_completion", result="c")
            ),
        }
        batch = coord.delegate(root.id, [budgeted])
        died(fleet)
    finally:
        fleet.stop()
    (child_id,) = batch.child_ids
    assert coord.get_task(child_id).status == TaskStatus.FAILED, "the budget stopped the child"
    eventually(lambda: coord.get_batch(batch.id).status == "done" or None, "the parent's batch to close", CONVERGE_S)
    # And the child's own batch, once its stopped grandchild's run (the dead worker's) lapsed and was written back.
    own_batch = coord.get_task(child_id).waiting_batch_id
    assert own_batch
    eventually(lambda: coord.get_batch(own_batch).status == "done" or None, "the child's batch to close", CONVERGE_S)
    (item,) = coord.get_todos(root.id)
    assert item.cost_micros == 2 * STEP_COST_MICROS, "the child's subtree written back onto its item"
    assert_converged(coord, root.id)


@pytest.mark.parametrize("point", ["after-commit", "after-claim-publish"])
def test_an_agent_killed_between_its_delegation_and_its_publish(coord: Coordinator, tmp_path: Path, point: str) -> None:
    fleet = crashing_worker(coord.settings, tmp_path, point)
    try:
        root = coord.create_task(
            agent(
                call("run_subagents", tasks=[subtask("A", reply("A done")), subtask("B", reply("B done"))]),
                call("attempt_completion", result="both done"),
            ),
            run=True,
        )
        died(fleet)
    finally:
        fleet.stop()
    done = coord.wait(root.id, CONVERGE_S)
    assert done.status == TaskStatus.COMPLETED and done.summary == "both done"
    assert [c.summary for c in coord.get_children(root.id)] == ["A done", "B done"]
    assert_converged(coord, root.id)


def test_a_worker_killed_after_parking_a_call_frees_the_slot_its_sibling_waits_for(
    fault_settings: Settings, tmp_path: Path
) -> None:
    """A run parks a call for a person and its worker dies before the release freed the tree's one run slot: once
    the lease has lapsed the reconciler frees it, the call still pending, and the sibling that waited for it runs;
    the decision then resumes the first. Before, the sibling waited for the person's decision.

    Keys and a queue of its own, so the module's rescuer, which has no run limit, takes no part."""
    settings = fault_settings.model_copy(
        update={"key_prefix": f"subqpark{os.getpid()}", "queue": "subq-park", "max_running_per_root": 1}
    )
    coord = Coordinator(settings)
    fleet = crashing_worker(settings, tmp_path / "crash", "after-park")  # one thread: the children in their order
    try:
        parent = coord.create_task("Two children", todos="[ ] check\n[ ] notes")
        asks = subtask("check", call("run_command", command="true"), reply("checked"))
        asker, sibling = coord.delegate(parent.id, [asks, subtask("notes", reply("noted"))]).child_ids
        died(fleet)
    finally:
        fleet.stop()
    (approval,) = coord.list_approvals(parent.id)
    assert coord.store.runs.running_ids(parent.id) == {asker}, "the dead run holds the tree's one slot"
    with dedicated_fleet(settings, tmp_path / "after", 1, worker_concurrency=2) as (_, _after):
        eventually(lambda: coord.get_task(sibling).status == TaskStatus.COMPLETED, "the sibling to run", CONVERGE_S)
        assert coord.list_approvals(parent.id) == [approval], "while the call still waits for its person"
        assert coord.decide(approval.id, "approve").status == "approved"
        coord.wait(parent.id, CONVERGE_S)
    assert coord.get_task(asker).summary == "checked"
    assert_converged(coord, parent.id)
    coord.close()


def test_a_decision_on_a_call_saved_before_its_worker_died_mid_park_counts(coord: Coordinator, tmp_path: Path) -> None:
    """A run parks two calls for a person; its worker dies once the first is saved (and its `approval.requested`
    sent), before the second. A person approves the first at once: the run resumed elsewhere runs that call,
    and asks a person about the second, which nobody was asked about and which never ran (the policy decides a
    call cut off by its worker's death anew). Before, the first was on no task's list: the approval was taken and
    ignored. And the second was answered as interrupted, though it had never run; had `run_command` been declared
    idempotent, it ran with the resume's leave and no person's approval."""
    fleet = crashing_worker(coord.settings, tmp_path, "mid-park")
    try:
        parent = coord.create_task("One child", todos="[ ] check")
        asks = subtask(
            "check", calls(("run_command", {"command": "true"}), ("run_command", {"command": "echo two"})),
            reply("checked"),
        )  # fmt: skip
        (child_id,) = coord.delegate(parent.id, [asks]).child_ids
        died(fleet)
    finally:
        fleet.stop()
    (first,) = coord.list_approvals(parent.id)
    assert first.args == {"command": "true"}
    assert coord.decide(first.id, "approve").status == "approved"
    second = eventually(
        lambda: [a for a in coord.list_approvals(parent.id) if a.args == {"command": "echo two"}],
        "the second call, never asked about, is asked about now", CONVERGE_S,
    )  # fmt: skip
    said = [(m.get("say"), m.get("text")) for m in coord.messages(child_id)]
    assert ("command", "true") in said and ("command", "echo two") not in said, "nothing ran it unapproved"
    assert coord.decide(second[0].id, "approve").status == "approved"
    coord.wait(parent.id, CONVERGE_S)
    child = coord.get_task(child_id)
    assert child.summary == "checked"
    assert child.tool_use["run_command"].outcomes == {"ok": 2}, child.tool_use
    said = [(m.get("say"), m.get("text")) for m in coord.messages(child_id)]
    assert ("command", "echo two") in said and not any(kind == "tool_interrupted" for kind, _ in said)
    assert coord.list_approvals(parent.id) == []
    assert_converged(coord, parent.id)


def test_a_worker_killed_mid_run_resumes_elsewhere_after_the_lapse(
    fault_settings: Settings, rescuer: Coordinator, tmp_path: Path
) -> None:
    # A grace far longer than the wait allowed: a running task must be looked at every tick
    # from its start, not first when the grace of its publish has passed.
    coord = Coordinator(fault_settings.model_copy(update={"reconcile_grace_s": 10 * CONVERGE_S}))
    fleet = crashing_worker(coord.settings, tmp_path)
    try:
        parent = coord.create_task("One slow child", todos="[ ] slow")
        slow = {"reply": "slow done", "usage": {"input": 10, "output": 5}, "latency_ms": 4000}
        batch = coord.delegate(parent.id, [{"description": "slow", "message": agent(slow)}])
        child_id = batch.child_ids[0]
        deadline = time.monotonic() + 30
        while coord.store.runs.in_flight(parent.id)["leases"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        # The worker holds the run's message in its memory, not in kombu's unacked hash (workers/run_acks.py):
        # killed, it leaves no copy for the broker's visibility backstop to deliver again hours later.
        assert RUN_TASK not in unacked_tasks(coord), "a run message was written to kombu's unacked hash"
        os.kill(fleet.procs[0].pid, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        fleet.stop()
    assert RUN_TASK not in unacked_tasks(coord)
    coord.wait(parent.id, CONVERGE_S)
    took_s = time.monotonic() - killed
    child = coord.get_task(child_id)
    assert child.status == TaskStatus.COMPLETED and child.summary == "slow done"
    assert coord.store.records.task_field(child_id, "run_seq") == "2", "it ran again, once"
    # Killed before its first step was saved (no conversation yet): the second run does not say the prompt again.
    said = [m.get("say") for m in coord.messages(child_id)]
    assert said.count("task") == 1 and said[-1] == "completion_result", said
    # The lapse, a tick and a grace at most before it runs again, then its 4 s request.
    assert took_s < LAPSE_S + 0.5 + 3 + 4 + 10, f"resumed and finished {took_s:.1f} s after the kill"
    assert_converged(coord, parent.id)
    coord.close()


def test_a_run_longer_than_the_lapse_is_never_run_twice_while_its_worker_lives(
    coord: Coordinator, tmp_path: Path
) -> None:
    """The stand-in for a two-hour run: four heartbeat lapses long, on a live worker."""
    fleet = crashing_worker(coord.settings, tmp_path)
    try:
        parent = coord.create_task("One long child", todos="[ ] long")
        long = {"reply": "long done", "usage": {"input": 10, "output": 5}, "latency_ms": 4 * LAPSE_S * 1000}
        batch = coord.delegate(parent.id, [{"description": "long", "message": agent(long)}])
        coord.wait(parent.id, CONVERGE_S)
    finally:
        fleet.stop()
    child_id = batch.child_ids[0]
    assert coord.get_task(child_id).summary == "long done"
    assert coord.store.records.task_field(child_id, "run_seq") == "1", "never run a second time"
    assert coord.store.records.task_field(child_id, "repairs") is None, "never published again"
    assert_converged(coord, parent.id)
