"""Convergence step by step, in process, against a real Redis: each repair the reconciler makes.

The fault suite (tests/test_faults.py) kills real workers; these tests build
each stuck state directly and run one reconciler tick, so each rule of
coordinator/reconciler.py is checked on its own, and quickly.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator import (
    OFFLINE_PROFILE,
    BrokerError,
    Coordinator,
    NotFoundError,
    StateError,
    TaskStatus,
    admission,
    approvals,
    delegation,
    endpoints,
    reconciler,
    writeback,
)
from coordinator.approvals import ToolCall, expiry_timer, undecided
from coordinator.celery_app import make_app
from coordinator.errors import FencedError
from coordinator.local.embedded_redis import local_redis
from coordinator.models import Approval, Batch, SubtaskSpec, TaskRecord, live_status
from coordinator.plane import Plane
from coordinator.ports.steps import Released, RunStopped
from coordinator.reconciler import Reconciler
from coordinator.replies import Decided, Stepped
from coordinator.runs import Ended, LeaseLost, Run, RunLifecycle
from coordinator.settings import Profile, RunCommand, Settings
from coordinator.store.approvals import ApprovalStore
from coordinator.store.convergence import QUEUE_SCAN_LIMIT
from tests.agents import agent, call, reply, subtask
from tests.helpers import delegate_as_its_run, state
from workers.runtime import metering
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child

QUEUE = "subq-nobody"


@pytest.fixture
def coord(idle_coordinator: Coordinator) -> Iterator[Coordinator]:
    """The idle coordinator with no grace, so each watched task is due at once."""
    coord = Coordinator(idle_coordinator.settings.model_copy(update={"reconcile_grace_s": 1}))
    keys = coord.store.keys
    coord.client.delete(keys.due(), keys.timers(), keys.leader(), keys.reserved())  # what earlier tests left
    yield coord
    coord.close()


def tick(coord: Coordinator, after_s: float = 0) -> dict[str, int]:
    """One reconciler round once every watched task is due and has settled (SETTLE_S)."""
    time.sleep(after_s)
    for task_id in coord.store.convergence.watched():
        coord.store.convergence.watch([task_id], -10, only_if_watched=True)
        coord.store.client.hset(coord.store.keys.task(task_id[:16], task_id), "updated_at", time.time() - 60)
    repairs = Reconciler(coord, "test").tick()
    assert repairs is not None, "a lone reconciler leads"
    return dict(repairs)


@contextmanager
def settings_of(coord: Coordinator, **update: Any) -> Iterator[Coordinator]:
    """A coordinator of `coord`'s settings with `update`, closed after."""
    other = Coordinator(coord.settings.model_copy(update=update))
    try:
        yield other
    finally:
        other.close()


def queued_ids(coord: Coordinator) -> list[str]:
    return sorted(coord.store.convergence.queued_task_ids(QUEUE))


def park(plane: Plane, task: TaskRecord, calls: list[ToolCall]) -> list[Approval]:
    """The calls parked for a decision, by a task that has not ended."""
    made = approvals.park(plane, task, calls)
    assert made is not None, f"{task.id} had ended"
    return made


def test_a_task_queued_in_the_broker_is_left_alone(coord: Coordinator) -> None:
    root = coord.create_task(agent(reply("x")), run=True)
    assert tick(coord) == {}
    assert queued_ids(coord) == [root.id] and coord.client.llen(QUEUE) == 1, "not published twice"
    assert root.id in coord.store.convergence.watched()


def test_a_task_queued_behind_a_backlog_deeper_than_one_look_is_not_taken_for_lost(coord: Coordinator) -> None:
    """kombu pushes to the list's head and takes from its tail: a look at its first QUEUE_SCAN_LIMIT messages read
    the newest, and the oldest, those due longest, were taken for lost and published again. Past the limit every
    task counts as queued."""
    root = coord.create_task(agent(reply("x")), run=True)  # its message is the oldest
    filler = json.dumps({"headers": {"id": "not-subqs"}, "body": ""})
    with coord.client.pipeline(transaction=False) as pipe:
        for _ in range(QUEUE_SCAN_LIMIT // 1000):
            pipe.lpush(QUEUE, *[filler] * 1000)
        pipe.execute()
    assert coord.client.llen(QUEUE) == QUEUE_SCAN_LIMIT + 1
    assert tick(coord) == {}, "not published again"
    assert coord.client.lindex(QUEUE, -1) is not None and coord.client.llen(QUEUE) == QUEUE_SCAN_LIMIT + 1
    coord.client.ltrim(QUEUE, QUEUE_SCAN_LIMIT, -1)  # the backlog drains but for the oldest: read whole again
    assert queued_ids(coord) == [root.id] and tick(coord) == {}


def test_a_task_the_reconciler_cannot_look_at_is_put_off_and_holds_up_none_due_after_it(
    coord: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """A due task whose look raises (here an ended record that no longer reads) is logged and looked at again a
    grace later; the tick goes on to the tasks due after it. Before, the tick raised on it, every tick, and the
    lost run behind it was never published again."""
    poison = coord.create_task(agent(reply("x")), run=True)
    lost = coord.create_task(agent(reply("y")), run=True)
    coord.client.delete(QUEUE)  # both messages lost
    keys = coord.store.keys
    coord.client.hset(keys.task(poison.root_id, poison.id), mapping={"status": "completed", "depth": "deep"})
    for order, task in enumerate((poison, lost)):
        coord.store.convergence.watch([task.id], -20 + order, only_if_watched=True)
        coord.client.hset(keys.task(task.root_id, task.id), "updated_at", time.time() - 60)
    before_s = time.time()
    try:
        with caplog.at_level(logging.WARNING, logger="coordinator.reconciler"):
            assert Reconciler(coord, "test").tick() == {"run-lost": 1}
        # The record's fault in one line a grace, which names it: no trace for an operator to dig through.
        said = [r for r in caplog.records if poison.id in r.getMessage()]
        assert [
            (r.getMessage().startswith(f"subq reconciler: Task record {poison.id} is corrupt"), r.exc_info)
            for r in said
        ] == [(True, None)], [r.getMessage() for r in said]
        assert queued_ids(coord) == [lost.id], "the task due after it was looked at and published again"
        put_off = coord.client.zscore(keys.due(), poison.id)
        assert put_off is not None and put_off > before_s, "looked at again later, not first at every tick"
    finally:  # a record that does not read would break other tests' listings
        coord.client.hset(keys.task(poison.root_id, poison.id), "depth", "0")


def test_a_broker_that_refuses_a_publish_ends_the_tick_and_puts_off_no_task(coord: Coordinator) -> None:
    """A broker away fails every publish alike: the tick ends at the first, as with the store away, rather than
    trying each due task in turn (each waiting out its publish's retries); the lost run stays watched."""
    lost = coord.create_task(agent(reply("y")), run=True)
    coord.client.delete(QUEUE)  # its message lost
    coord.store.convergence.watch([lost.id], -10, only_if_watched=True)
    coord.client.hset(coord.store.keys.task(lost.root_id, lost.id), "updated_at", time.time() - 60)
    nowhere = coord.settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    broker_away = Coordinator(coord.settings, app=make_app(nowhere))  # its store is there, its broker is not
    try:
        with pytest.raises(Exception) as raised:
            Reconciler(broker_away, "test").tick()
        assert "127.0.0.1:1" in str(raised.value) or "Connection refused" in str(raised.value), raised.value
    finally:
        broker_away.close()
    assert lost.id in coord.store.convergence.watched(), "watched again first: the next tick tries it again"


def test_a_delegated_task_whose_batch_lapsed_leaves_the_due_list(coord: Coordinator) -> None:
    """A parent still waiting on a batch whose record lapsed (open longer than a retention) has nothing left to
    publish: the reconciler takes it off the due list, where before it failed on the missing batch."""
    parent = coord.create_task("fan out")
    batch = coord.delegate(parent.id, [subtask("child", agent(reply("x")))])
    coord.client.delete(coord.store.keys.batch(parent.root_id, batch.id))
    coord.store.convergence.watch([parent.id], 0)
    assert tick(coord) == {}
    assert parent.id not in coord.store.convergence.watched()


def test_a_wave_of_queued_tasks_costs_a_tick_a_few_round_trips(coord: Coordinator) -> None:
    """Each queued task is looked at again later, all in one write: not a round trip or two each."""
    with local_redis() as url, settings_of(coord, redis_url=url) as alone:  # its command counts are its own
        _tick_a_wave(alone)


def _tick_a_wave(coord: Coordinator) -> None:
    parent = coord.create_task("fan out")
    batch = coord.delegate(parent.id, [subtask(f"child {n}", agent(reply("x"))) for n in range(40)])
    for task_id in coord.store.convergence.watched():
        coord.store.convergence.watch([task_id], -10, only_if_watched=True)
        coord.store.client.hset(coord.store.keys.task(task_id[:16], task_id), "updated_at", time.time() - 60)
    reconciler = Reconciler(coord, "test")
    # Its pass over the trees' keys (coordinator/keeper.py) done first: what the tick costs is its due tasks'.
    reconciler.keeper.step()
    while reconciler.keeper.in_pass:
        reconciler.keeper.step()
    before = coord.client.info("commandstats")
    assert reconciler.tick() == {}
    after = coord.client.info("commandstats")

    def calls(command: str) -> int:
        return int(after.get(f"cmdstat_{command}", {}).get("calls", 0)) - int(
            before.get(f"cmdstat_{command}", {}).get("calls", 0)
        )

    assert calls("zadd") == 1, "one write moves every queued child's time"
    assert calls("hget") == 0, "no decision is looked up for a task that never asked for one"
    due = coord.store.convergence.watched()
    assert all(due[child] > time.time() for child in batch.child_ids), "each is looked at again later"
    assert queued_ids(coord) == sorted(batch.child_ids), "none was published twice"


def test_a_run_taken_from_the_queue_while_the_tick_looked_is_not_taken_for_lost(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the tick's triage and its read of the queue, a worker takes the message and starts the run."""
    root = coord.create_task(agent(reply("x")), run=True)
    store = coord.store.convergence
    read_queue = store.queued_task_ids

    def a_worker_takes_it_first(queue: str) -> set[str]:
        coord.client.delete(queue)  # the worker took the message off the ready list ...
        coord.client.set(coord.store.keys.lease(root.id, root.id), "its-run", ex=30)  # ... and its run started
        return read_queue(queue)

    monkeypatch.setattr(store, "queued_task_ids", a_worker_takes_it_first)
    assert tick(coord) == {}, "not published again"
    assert coord.client.llen(QUEUE) == 0 and root.id in store.watched()


# The pace the two tests below give a wide publish, five times the product's (delegation.PUBLISH_PACE_S): each
# ticks just after its first child is due and checks that the last hundred, whose messages it took off the queue,
# are not due yet. With the product's pace they were due 4 s after the first, and a loaded host that took longer
# than that to publish the 500 messages before the tick saw the first of them due (`run-lost`: 20, beside two busy
# loops). At this pace they are due 20 s after the first.
TEST_PACE_S = 0.05


def test_a_wide_batchs_children_are_looked_at_no_sooner_than_its_publish_reaches_each(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's children are watched before its messages are sent, one after another; a wide batch's last
    reached the queue seconds after the first. Watched all for the same time, they were looked at before
    their messages were there and published again (`run-lost`: 280 of a 5,000-wide fan-out beside one busy
    loop, bench/overhead.py --widths 5000 --grace-s 2). Each child is now due a publish's pace later than the
    one before it."""
    monkeypatch.setattr(reconciler, "SETTLE_S", 0.0)  # the look that this test is about, not the settling
    monkeypatch.setattr(delegation, "PUBLISH_PACE_S", TEST_PACE_S)
    with settings_of(coord, max_fanout=500) as wide:
        _publish_half_and_tick(wide)


def _publish_half_and_tick(coord: Coordinator) -> None:
    parent = coord.create_task("fan out")
    batch = coord.delegate(parent.id, [subtask(f"child {n}", agent(reply("x"))) for n in range(500)])
    due = coord.store.convergence.watched()
    times = [due[child] for child in batch.child_ids]
    assert times == sorted(times) and times[-1] - times[0] == pytest.approx(499 * TEST_PACE_S, abs=0.001)
    # The last hundred messages have not reached the queue yet (kombu pushes each new one at the list's head).
    coord.client.ltrim(QUEUE, 100, -1)
    assert queued_ids(coord) == sorted(batch.child_ids[:400])
    time.sleep(max(0.0, times[0] - time.time()) + 0.2)  # the first children are due; the last (4 s on) are not
    repairs = Reconciler(coord, "test").tick()
    assert repairs == {}, "none of the children on their way was taken for lost"
    assert coord.client.llen(QUEUE) == 400, "none published again"


def test_a_wide_retrys_runs_are_looked_at_no_sooner_than_its_publish_reaches_each(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree's retry commits every task it re-runs, then publishes their runs one by one, as a batch does its
    children: all due at the same time, the last of a wide retry's were looked at before their messages were
    sent. Each is now due a publish's pace later than the one before it, in the order they are published."""
    monkeypatch.setattr(reconciler, "SETTLE_S", 0.0)
    monkeypatch.setattr(delegation, "PUBLISH_PACE_S", TEST_PACE_S)
    with settings_of(coord, max_fanout=500) as wide:
        parent = wide.create_task(agent(reply("x")), run=True)
        batch = delegate_as_its_run(wide, parent.id, [subtask(f"child {n}", agent(reply("x"))) for n in range(500)])
        wide.client.delete(QUEUE)
        for child in batch.child_ids:
            wide.store.runs.finish_task(child, "failed", error="by hand", error_class="ModelHTTPError")
        wide.store.convergence.unwatch(batch.child_ids)

        retried = wide.retry(parent.id, failed=True)

        assert sorted(retried.retried) == sorted(batch.child_ids)
        due = wide.store.convergence.watched()
        times = [due[child] for child in retried.retried]  # the order they were published in
        assert times == sorted(times) and times[-1] - times[0] == pytest.approx(499 * TEST_PACE_S, abs=0.01)
        wide.client.ltrim(QUEUE, 100, -1)  # the last hundred messages have not reached the queue yet
        time.sleep(max(0.0, times[0] - time.time()) + 0.2)
        assert Reconciler(wide, "test").tick() == {}, "none of the runs on their way was taken for lost"
        assert wide.client.llen(QUEUE) == 400, "none published again"


def test_a_run_that_ended_while_the_tick_looked_is_not_taken_for_lost(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the tick's triage and its read of the queue, a worker takes the message and runs it to its end:
    its lease is gone again by the tick's second look, and the task was published again (`run-lost`), then put
    back on the due list after its end had taken it off. A busy fleet whose children waited past the grace
    counted a few such repairs in every wide fan-out (bench/overhead.py's 5,000-wide runs)."""
    root = coord.create_task(agent(reply("x")), run=True)
    store = coord.store.convergence
    read_queue = store.queued_task_ids
    runtime = build_runtime(coord.settings, make_app(coord.settings))

    def a_worker_runs_it_first(queue: str) -> set[str]:
        coord.client.delete(queue)  # the worker took the message off the ready list ...
        assert run_child(runtime, root.id).status == "completed"  # ... and its run has started and ended
        return read_queue(queue)

    monkeypatch.setattr(store, "queued_task_ids", a_worker_runs_it_first)
    assert tick(coord) == {}, "not published again"
    assert coord.client.llen(QUEUE) == 0
    assert root.id not in store.watched(), "its end took it off the due list, and the tick did not put it back"
    assert coord.store.records.task_field(root.id, "repairs") in (None, "", "0")


def test_a_delivery_that_read_its_task_ended_elsewhere_leaves_it_due_where_it_is_not(coord: Coordinator) -> None:
    """Under a Sentinel split (a promoted replica, and the old master still taking writes for a few seconds), a
    worker's pool can hold connections to both: its delivery read the task ended on the old master, and its
    next step went to the new one, where the task still runs. Taking the task off the due list there left it
    for no one to publish again (a 100-wide fan-out waited forever on one child, tests/test_sentinel_fleet.py,
    on a loaded host). Now each step that takes an ended task off does so only while the server it reaches
    says so too."""
    root = coord.create_task(agent(reply("x")), run=True)
    runtime = build_runtime(coord.settings, make_app(coord.settings))
    assert root.id in coord.store.convergence.watched()
    read_elsewhere = coord.get_task(root.id).model_copy(update={"status": TaskStatus.COMPLETED})

    result = runtime.lifecycle._nothing_to_run(read_elsewhere)

    assert result.status == "completed", "the delivery answers what it read"
    assert root.id in coord.store.convergence.watched(), "still due where it has not ended"
    assert coord.get_task(root.id).status == TaskStatus.ACTIVE
    coord.client.delete(QUEUE)  # its message is gone with the old master's writes
    coord.client.zadd(coord.store.keys.due(), {root.id: time.time() - 1})
    assert tick(coord) == {"run-lost": 1}, "the reconciler publishes it again"
    assert queued_ids(coord) == [root.id]

    # Where it has ended, the same delivery takes it off, as before.
    assert run_child(runtime, root.id).status == "completed"
    coord.store.convergence.watch([root.id], 0)
    runtime.lifecycle._nothing_to_run(coord.get_task(root.id))
    assert root.id not in coord.store.convergence.watched()


def test_a_run_whose_message_was_lost_is_published_again(coord: Coordinator) -> None:
    root = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)  # the broker lost it (a Redis restart)
    assert tick(coord) == {"run-lost": 1}
    assert queued_ids(coord) == [root.id]
    assert coord.store.records.task_field(root.id, "repairs") == "1"
    assert tick(coord) == {}, "its new message is in the queue: nothing more"


def test_a_run_whose_message_a_live_worker_holds_is_not_taken_for_lost(coord: Coordinator) -> None:
    """Taken off the queue by a worker whose threads are all busy: its start waits, however long, while that
    worker beats (it lists the run messages it holds); once its entry lapses (the worker died), it is lost."""
    root = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)  # a worker took the message ...
    Reconciler(coord, "worker@host:1", lambda: [root.id]).beat()  # ... and holds it, its run not started
    assert tick(coord) == {}, "not published again"
    assert coord.client.llen(QUEUE) == 0 and root.id in coord.store.convergence.watched()
    coord.client.zadd(coord.store.keys.reserved(), {root.id: time.time() - 1})  # its worker stopped beating
    assert tick(coord) == {"run-lost": 1}
    assert queued_ids(coord) == [root.id]


def test_a_beat_drops_the_lapsed_entries_of_held_runs(coord: Coordinator) -> None:
    keys = coord.store.keys
    coord.client.zadd(keys.reserved(), {"gone-worker-task": time.time() - 1})
    Reconciler(coord, "worker@host:2", lambda: ["held-task"]).beat()
    held = coord.client.zrange(keys.reserved(), 0, -1, withscores=True)
    assert [name for name, _ in held] == ["held-task"]
    assert time.time() < held[0][1] <= time.time() + coord.settings.heartbeat_lapse_s


def test_a_worker_lists_the_run_messages_it_holds(coord: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a worker's beat lists: its Celery state's requests that are runs, by task (not other tasks)."""
    from celery.worker import state as worker_state

    assert coord.settings.redis_url
    monkeypatch.setenv("SUBQ_REDIS_URL", coord.settings.redis_url)  # the worker's modules read their settings
    from workers.maintenance import held_runs

    root = coord.create_task("held")
    requests = {f"{root.id}-r1": object(), "a-celery-task-of-someone-else": object()}
    worker_state.requests.update(requests)
    try:
        assert held_runs() == [root.id]
    finally:
        for request_id in requests:
            worker_state.requests.pop(request_id, None)


def test_an_ended_child_never_written_back_is_applied_once(coord: Coordinator) -> None:
    parent = coord.create_task("p", todos="[ ] a")
    (item,) = coord.get_todos(parent.id)
    batch = coord.delegate(parent.id, [subtask("a", reply("a"), todo_id=item.id)])
    child_id = batch.child_ids[0]
    coord.store.runs.finish_task(child_id, "completed", "a done")  # and its process died here
    assert tick(coord) == {"ended-not-written-back": 1}
    assert coord.get_batch(batch.id).status == "done"
    assert coord.get_todos(parent.id)[0].subtask_id == child_id
    assert tick(coord) == {} and child_id not in coord.store.convergence.watched()


def test_a_redelivered_run_of_an_ended_child_writes_it_back(coord: Coordinator) -> None:
    parent = coord.create_task("p", todos="[ ] a")
    batch = coord.delegate(parent.id, [subtask("a", reply("a"))])
    coord.store.runs.finish_task(batch.child_ids[0], "completed", "a done")
    result = run_child(build_runtime(coord.settings, make_app(coord.settings)), batch.child_ids[0])
    assert result.status == "completed"
    assert coord.get_batch(batch.id).status == "done", "the redelivery wrote the child back and closed the batch"


def test_a_delegation_committed_but_never_published(coord: Coordinator) -> None:
    parent = coord.create_task("p")
    batch, _children = delegation.commit(coord.plane, parent.id, [subtask("a", reply("a")), subtask("b", reply("b"))])
    assert coord.client.llen(QUEUE) == 0
    assert tick(coord) == {"delegation-unpublished": 1}
    assert set(queued_ids(coord)) == set(batch.child_ids)
    assert tick(coord) == {}, "published once"


def test_a_publish_the_broker_refuses_is_given_back(coord: Coordinator) -> None:
    dead_broker = make_app(coord.settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"}))
    refused = Coordinator(coord.settings, app=dead_broker)
    parent = refused.create_task("p")
    with pytest.raises(BrokerError, match=r"The broker did not take batch .*; it is published again"):
        refused.delegate(parent.id, [subtask("a", reply("a"))])
    record = coord.get_task(parent.id)
    assert record.status == TaskStatus.DELEGATED and not coord.store.batches.batch_published(record.waiting_batch_id)
    assert tick(coord) == {"delegation-unpublished": 1}, "the reconciler publishes it once the broker is back"
    assert len(queued_ids(coord)) == 1


def test_a_submission_the_broker_refuses_ends_failed_and_runs_none_of_its_children(coord: Coordinator) -> None:
    """`submit` commits its delegation and the broker refuses the publish: the root ends `failed` as the caller
    is told, and its children with it, so the reconciler publishes none of them once the broker is back (before,
    they stayed `active` on the due list, and ran and spent under a root reported failed)."""
    dead_broker = make_app(coord.settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"}))
    refused = Coordinator(coord.settings, app=dead_broker)
    submission = refused.submit("p", subtasks=[subtask("a", reply("a")), subtask("b", reply("b"))])
    assert isinstance(submission.error, BrokerError)
    root = coord.get_task(submission.task.id)
    assert root.status == TaskStatus.FAILED and "did not take batch" in root.error
    assert submission.task == root, "the caller is handed the root as it ended, not as it was created"
    children = coord.get_children(root.id)
    assert len(children) == 2 and {c.status for c in children} == {TaskStatus.CANCELLED}, children
    tick(coord)
    assert queued_ids(coord) == [], "none of its children published"
    assert not coord.store.convergence.watched(), "written back, off the due list"


def test_run_task_refuses_a_caller_owned_task_and_changes_nothing(coord: Coordinator) -> None:
    root = coord.create_task("owned by its caller", todos="[ ] a")
    before = state(coord, root.id)
    result = run_child(build_runtime(coord.settings, make_app(coord.settings)), root.id)
    assert (result.status, result.error_class) == ("failed", "StateError")
    assert result.error == f"task {root.id} is owned by its caller (runner 'caller'), not run by an agent"
    assert state(coord, root.id) == before


def test_an_approval_deadline_is_a_timer_not_a_broker_countdown(coord: Coordinator) -> None:
    root = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    (approval,) = park(coord.plane, coord.get_task(root.id), [ToolCall("run_command", {"command": "ls"}, "call-1")])
    assert coord.client.llen(QUEUE) == 0, "no countdown message"
    timers = dict(coord.client.zrange(coord.store.keys.timers(), 0, -1, withscores=True))
    assert timers[expiry_timer(approval.id)] == pytest.approx(approval.deadline)
    coord.client.zadd(coord.store.keys.timers(), {expiry_timer(approval.id): time.time() - 1})
    coord.client.hset(coord.store.keys.approval(root.id, approval.id), "deadline", time.time() - 1)
    tick(coord)
    assert coord.store.approvals.get_approval(approval.id).status == "expired"
    assert expiry_timer(approval.id) not in dict(coord.client.zrange(coord.store.keys.timers(), 0, -1, withscores=True))
    assert queued_ids(coord) == [root.id], "the task resumes once, with the denial"


def test_a_timer_set_again_while_the_tick_served_it_is_kept(coord: Coordinator) -> None:
    """The tick serves a due timer; meanwhile the run it woke parks again under the same name."""
    convergence = coord.store.convergence
    convergence.add_timer("provider-wait:again", time.time() - 5)
    convergence.add_timer("provider-wait:served", time.time() - 5)
    due = convergence.due_timer_times(100)
    assert set(due) == {"provider-wait:again", "provider-wait:served"}
    wake_at = time.time() + 8
    convergence.add_timer("provider-wait:again", wake_at)  # parked again, before the tick removes what it served
    convergence.remove_served_timers(due)
    left = dict(coord.client.zrange(coord.store.keys.timers(), 0, -1, withscores=True))
    assert left == {"provider-wait:again": pytest.approx(wake_at)}, "the new timer stays, the served one goes"


def test_the_served_timers_are_removed_in_one_script_call_that_takes_no_watch(coord: Coordinator) -> None:
    """A compare-and-remove in Lua: a WATCH on the timers, which every park, approval and wake writes, could
    run out its tries on a busy fleet, and the whole tick failed (review V4, item 4)."""
    with local_redis() as url:  # a server of its own: its command counts are this test's alone
        alone = Coordinator(coord.settings.model_copy(update={"redis_url": url}))
        try:
            convergence = alone.store.convergence
            for n in range(3):
                convergence.add_timer(f"provider-wait:t{n}", time.time() - 5)
            due = convergence.due_timer_times(100)
            convergence.add_timer("provider-wait:t0", time.time() + 8)  # set again meanwhile: kept
            before = alone.client.info("commandstats")
            convergence.remove_served_timers(due)
            after = alone.client.info("commandstats")
            left = list(alone.client.zrange(alone.store.keys.timers(), 0, -1))
        finally:
            alone.close()
    calls = {name: after[name]["calls"] - before.get(name, {"calls": 0})["calls"] for name in after}
    assert left == ["provider-wait:t0"]
    assert not {"cmdstat_watch", "cmdstat_multi", "cmdstat_exec"} & {name for name, n in calls.items() if n}, calls
    assert calls.get("cmdstat_zmscore", 0) == 0 and calls.get("cmdstat_evalsha", 0) == 1, calls


def test_a_timer_that_raises_leaves_the_others_served_and_the_tick_whole(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One timer whose serving raises stays set for the next tick; the others are served once and removed,
    and the tick's other passes run (a raise there failed the tick, and the next served every timer again)."""
    convergence, woken = coord.store.convergence, []

    def wake(plane: object, task_id: str) -> None:
        if task_id == "bad":
            raise RuntimeError("a bug of ours")
        woken.append(task_id)

    monkeypatch.setattr(endpoints, "wake", wake)
    for subject in ("first", "bad", "last"):
        convergence.add_timer(endpoints.timer(subject), time.time() - 5)
    root = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)  # its run message lost: the due pass publishes it again
    assert tick(coord) == {"run-lost": 1}, "the tick went on past the bad timer"
    assert sorted(woken) == ["first", "last"] and queued_ids(coord) == [root.id]
    assert list(coord.client.zrange(coord.store.keys.timers(), 0, -1)) == [endpoints.timer("bad")]
    tick(coord)
    assert sorted(woken) == ["first", "last"], "the served ones are not served again"


def test_a_parked_run_woken_while_its_lease_lingers_is_woken_again_after_the_grace(coord: Coordinator) -> None:
    """Its timer fired before the run that parked it let its lease go (the real park: the timer is set,
    then the run releases its lease and unwatches its task): the timer is set again and runs it later."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    run = lifecycle.start(task.id)
    assert isinstance(run, Run)
    timers, name = coord.store.keys.timers(), endpoints.timer(task.id)
    # The run parks: its timer first, due at once (its endpoint was back meanwhile) ...
    endpoints.park(lifecycle.plane, run.task, "api.example:443", "", time.time() - 1, int(time.time() * 1000))
    Reconciler(coord, "test").tick()
    assert queued_ids(coord) == [], "its run holds the lease: not published now"
    # ... and the run lets its lease go as a park does.
    run.end(Released("waiting_provider", wake_at_s=time.time() + 30))
    assert task.id not in coord.store.convergence.watched(), "a parked run is not watched"
    assert coord.client.zscore(timers, name) is not None, "its timer is set again, not dropped"
    coord.client.zadd(timers, {name: time.time() - 1})  # the grace has passed
    Reconciler(coord, "test").tick()
    assert queued_ids(coord) == [task.id], "published again"


def test_a_provider_timer_served_twice_never_restarts_a_run_answered_since(coord: Coordinator) -> None:
    """A provider timer served again (a tick that failed before removing it) while the woken run holds the
    lease is set again only while that run still waits for its provider; once it was answered and parked
    on an approval, the timer publishes nothing (a restart would ask for the same call a second time)."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    timers, name = coord.store.keys.timers(), endpoints.timer(task.id)
    # Parked on its provider by an earlier run, then woken: this run holds the lease, its wait not over yet.
    endpoints.park(lifecycle.plane, coord.get_task(task.id), "api.example:443", "", time.time() - 1, 1)
    run = lifecycle.start(task.id)
    assert isinstance(run, Run)
    Reconciler(coord, "test").tick()  # the timer, served a second time
    assert coord.client.zscore(timers, name) is not None, "still waiting for its provider: set again"
    assert queued_ids(coord) == []
    # Its provider answers (the wait is over), it asks a person, and releases as waiting_approval.
    assert coord.store.endpoints.clear_wait(task.id, run.token)
    (approval,) = park(coord.plane, run.task, [ToolCall("run_command", {"command": "ls"}, "call-1")])
    run.end(Released("waiting_approval"))
    coord.client.zadd(timers, {name: time.time() - 1})  # the re-armed timer comes due
    Reconciler(coord, "test").tick()
    assert queued_ids(coord) == [], "no restart beside the undecided approval"
    assert coord.client.zscore(timers, name) is None, "the stale timer is gone"
    assert undecided(coord.plane, task.id) == [approval.id], "its approval still waits for its person"


def test_a_chain_step_parked_on_its_provider_is_not_taken_for_lost_when_a_later_step_is_stopped(
    coord: Coordinator,
) -> None:
    """A chain's write-back watched its current step again whenever it ran (a later step stopped, a redelivered
    end): a step parked on its provider, off the due list with its timer set, was then taken for lost and
    published while its provider was still down. A step already published is left to its publisher's watch."""
    root = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    steps = [SubtaskSpec(description=f"s{n}", message=agent(reply(f"s{n}"))) for n in range(3)]
    batch = delegate_as_its_run(coord, root.id, steps, mode="sequential")
    first, second, third = batch.child_ids
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    for step in (first, second):
        run = lifecycle.start(step)
        assert isinstance(run, Run), step
        if step == first:
            run.end(Ended("completed", summary="one"))
    assert isinstance(run, Run)
    endpoints.park(lifecycle.plane, run.task, "api.example:443", "", time.time() + 600, int(time.time() * 1000))
    run.end(Released("waiting_provider", wake_at_s=time.time() + 600))
    assert second not in coord.store.convergence.watched(), "parked: off the due list, its timer set"
    coord.client.delete(QUEUE)
    coord.cancel(third, "not needed")  # a later step stopped: the chain's write-back runs
    assert tick(coord) == {}, "no step published while its provider is down"
    assert queued_ids(coord) == []


def test_a_provider_timer_served_as_its_run_lets_go_leaves_the_task_watched(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run parking for its provider freed its lease, then took the task off the due list in a step of its own.
    Its timer served between the two (a short backoff, or its endpoint back) watched and published a new run, and
    the unwatch then took that watch off: with the new run's message lost (its worker killed), nobody published
    the task again. The task now leaves the due list in the step that frees the lease."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    run = lifecycle.start(task.id)
    assert isinstance(run, Run)
    endpoints.park(lifecycle.plane, run.task, "api.example:443", "", time.time() - 1, int(time.time() * 1000))
    runs = lifecycle.plane.store.runs
    release = runs.release_lease

    def then_the_timer(task_id: str, token: str, **how: bool) -> bool:
        released = release(task_id, token, **how)
        Reconciler(coord, "test").tick()  # the leader serves the timer the moment the lease is free
        return released

    monkeypatch.setattr(runs, "release_lease", then_the_timer)
    run.end(Released("waiting_provider", wake_at_s=time.time()))
    assert queued_ids(coord) == [task.id], "the timer published it"
    assert task.id in coord.store.convergence.watched(), "and its watch stands"
    coord.client.delete(QUEUE)  # the woken run's message lost with the worker that took it
    tick(coord)
    assert queued_ids(coord) == [task.id], "the reconciler publishes it again"


def test_a_duplicate_message_never_frees_the_slot_of_a_run_that_still_holds_its_lease(coord: Coordinator) -> None:
    """A child's run has committed its delegation (its status `delegated`) and not yet released: a duplicate of its
    message freed its slot, and its waiting sibling was admitted beside the live run, past the per-parent limit of
    one. A duplicate now leaves a leased task to its run."""
    with settings_of(coord, max_running_per_parent=1) as limited:
        root = limited.create_task(agent(reply("x")), run=True)
        batch = delegate_as_its_run(limited, root.id, [subtask(agent(reply("a"))), subtask(agent(reply("b")))])
        first, sibling = batch.child_ids
        limited.client.delete(QUEUE)
        lifecycle = build_runtime(limited.settings, make_app(limited.settings)).lifecycle
        run = lifecycle.start(first)
        assert isinstance(run, Run)
        assert lifecycle.start(sibling).status == "queued", "it waits for the one slot"
        delegation.commit(limited.plane, first, [subtask(agent(reply("g")))], "parallel", token=run.token)
        assert limited.get_task(first).status == TaskStatus.DELEGATED
        running = limited.store.keys.running(root.id)
        duplicate = lifecycle.start(first)  # its message again, in that moment
        assert duplicate.status == "delegated"
        assert sorted(limited.client.smembers(running)) == [first], "the live run keeps its slot"
        assert sibling not in queued_ids(limited), "and the sibling still waits"


def _stale_and_newer(coord: Coordinator, **create: Any) -> tuple[TaskRecord, RunLifecycle, Run, Run]:
    """A task whose run stalled past its lease's lapse (its lease gone) and whose newer run started: the task,
    the lifecycle that started both, the stale run and the newer one."""
    task = coord.create_task(agent(reply("x")), run=True, **create)
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    stale = lifecycle.start(task.id)
    assert isinstance(stale, Run)
    coord.client.delete(coord.store.keys.lease(task.id, task.id))  # it stalled past its lapse
    newer = lifecycle.start(task.id)  # the task published again, and run
    assert isinstance(newer, Run)
    return task, lifecycle, stale, newer


def test_a_stale_runs_answer_leaves_a_newer_parks_wait_and_its_timer_wakes_the_task(coord: Coordinator) -> None:
    """A run that stalled past its lapse gets its answer after the newer run of its task parked for its provider:
    its answer clears nothing (the lease is not its own), so the newer park's timer still wakes the task."""
    task, lifecycle, stale, newer = _stale_and_newer(coord)
    endpoints.park(lifecycle.plane, newer.task, "api.example:443", "", time.time() - 1, 1)
    newer.end(Released("waiting_provider", wake_at_s=time.time() + 30))
    assert not coord.store.endpoints.clear_wait(task.id, stale.token), "the stale run's answer clears nothing"
    assert coord.store.endpoints.wait_since_ms(task.id) == 1, "the newer park's wait stands"
    coord.client.zadd(coord.store.keys.timers(), {endpoints.timer(task.id): time.time() - 1})
    Reconciler(coord, "test").tick()
    assert queued_ids(coord) == [task.id], "its timer woke it"


def test_a_provider_timer_never_restarts_a_task_that_waits_for_a_person(coord: Coordinator) -> None:
    """Even with its provider wait still on record (a model whose answers do not clear it), a task whose
    approval is undecided is left to the decision or its expiry."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    run = lifecycle.start(task.id)
    assert isinstance(run, Run)
    park(coord.plane, run.task, [ToolCall("run_command", {"command": "ls"}, "call-1")])
    run.end(Released("waiting_approval"))
    endpoints.park(lifecycle.plane, coord.get_task(task.id), "api.example:443", "", time.time() - 1, 1)
    Reconciler(coord, "test").tick()
    assert queued_ids(coord) == [], "not published"
    assert coord.client.zscore(coord.store.keys.timers(), endpoints.timer(task.id)) is None


def test_a_provider_timer_wakes_a_task_whose_old_approval_has_expired(coord: Coordinator) -> None:
    """An approval expires with its retention, counted from its save, and its task keeps the list of the
    approvals its last run asked for: a task that later parks on its provider is still woken by its timer
    (before, the wake read the expired approval, raised, and the timer stayed, every tick, for good)."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    run = lifecycle.start(task.id)
    assert isinstance(run, Run)
    (approval,) = park(coord.plane, run.task, [ToolCall("run_command", {"command": "ls"}, "call-1")])
    coord.decide(approval.id, "approve")
    run.end(Released("waiting_approval"))
    coord.client.delete(QUEUE)
    coord.client.delete(coord.store.keys.approval(task.root_id, approval.id))  # its retention ran out
    assert coord.store.runs.waiting_approval_ids(task.id) == [approval.id], "the task's list stays"
    endpoints.park(lifecycle.plane, coord.get_task(task.id), "api.example:443", "", time.time() - 1, 1)
    Reconciler(coord, "test").tick()
    assert queued_ids(coord) == [task.id], "its timer woke it"
    assert coord.client.zscore(coord.store.keys.timers(), endpoints.timer(task.id)) is None, "served"
    assert approvals.decisions(coord.plane, task.id) == {}, "a resumed run finds no decision to answer with"


@pytest.mark.parametrize("found_by", ["its expiry timer", "a listing", "a cancel"])
def test_an_approval_that_lapsed_undecided_leaves_the_fleets_pending_index(coord: Coordinator, found_by: str) -> None:
    """A retention no longer than the approval timeout lets an undecided approval's record lapse before its
    deadline: its id on the fleet-wide pending index (which has no expiry) would stay for good, counted by the
    waiting gauge and read by every listing and cancel. Whoever finds the record gone takes the id off."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    run = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(task.id)
    assert isinstance(run, Run)
    (approval,) = park(coord.plane, run.task, [ToolCall("run_command", {"command": "ls"}, "call-1")])
    run.end(Released("waiting_approval"))
    pending = coord.store.keys.approvals()
    assert coord.client.zscore(pending, approval.id) is not None
    coord.client.delete(coord.store.keys.approval(task.root_id, approval.id))  # its retention ran out first
    if found_by == "its expiry timer":
        coord.client.zadd(coord.store.keys.timers(), {expiry_timer(approval.id): time.time() - 1})
        Reconciler(coord, "test").tick()
        assert coord.client.zscore(coord.store.keys.timers(), expiry_timer(approval.id)) is None, "served"
    elif found_by == "a listing":
        assert coord.list_approvals(task.root_id) == []
    else:
        assert coord.cancel(task.id, "not needed").status == TaskStatus.CANCELLED
    assert coord.client.zscore(pending, approval.id) is None


def test_a_decision_made_before_the_parked_run_freed_its_lease_still_resumes_the_task(coord: Coordinator) -> None:
    """A person decides between the run's park (its approval saved) and its release: a resume then would be
    delivered while the lease is still held and do nothing, so the decision publishes none and leaves the task
    on the due list; the run's release publishes it, once, and a process that dies before that release leaves
    it to the reconciler."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    rt = build_runtime(coord.settings, make_app(coord.settings))
    run = rt.lifecycle.start(task.id)
    assert isinstance(run, Run)
    (approval,) = park(coord.plane, run.task, [ToolCall("run_command", {"command": "ls"}, "call-1")])
    assert coord.decide(approval.id, "approve").status == "approved"
    assert queued_ids(coord) == [], "no resume while the parked run holds the lease"
    assert run_child(rt, task.id).status == "running", "a delivery now would find the lease held"
    assert task.id in coord.store.convergence.watched(), "due: were the run to die now, the reconciler resumes it"
    run.end(Released("waiting_approval"))
    assert queued_ids(coord) == [task.id] and coord.client.llen(QUEUE) == 1, "the release published the resume"
    approvals.resume(coord.plane, task.id)  # a second claim of the same park (a decision after the release)
    assert tick(coord) == {} and coord.client.llen(QUEUE) == 1, "published once"


def test_a_parked_run_dead_before_its_release_is_resumed_by_the_reconciler(coord: Coordinator) -> None:
    """Decided while the parking run held its lease, and that run died before its release: the decision's
    watch has the reconciler publish the task once the lease has lapsed."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    run = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(task.id)
    assert isinstance(run, Run)
    (approval,) = park(coord.plane, run.task, [ToolCall("run_command", {"command": "ls"}, "call-1")])
    coord.decide(approval.id, "approve")
    assert tick(coord) == {} and queued_ids(coord) == [], "the lease is held: left to its run"
    coord.client.delete(coord.store.keys.lease(task.id, task.id))  # the run died: its lease lapsed
    assert tick(coord) == {"run-lost": 1}
    assert queued_ids(coord) == [task.id], "published by the reconciler"


def _parked_on(coord: Coordinator, calls: int) -> tuple[str, list[str]]:
    """A task whose run parked `calls` tool calls for approval and freed its worker; its id and the approvals'."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    run = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(task.id)
    assert isinstance(run, Run)
    asked = park(coord.plane, run.task, [ToolCall("run_command", {"n": n}, f"call-{n}") for n in range(calls)])
    run.end(Released("waiting_approval"))
    assert queued_ids(coord) == [] and task.id not in coord.store.convergence.watched()
    return task.id, [a.id for a in asked]


def test_two_decisions_made_at_once_publish_one_resume(coord: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two people decide a task's two calls at once: each decision's step runs before the other's caller
    looks, and each sees the other's call decided. Only the step that decided last says to resume."""
    task_id, (first, second) = _parked_on(coord, 2)
    store = coord.store.approvals
    decide = store.decide

    def the_other_decided_meanwhile(approval_id: str, *args: object, **kwargs: object) -> Decided:
        outcome = decide(approval_id, *args, **kwargs)  # type: ignore[arg-type]
        if approval_id == first:
            monkeypatch.setattr(store, "decide", decide)
            assert coord.decide(second, "approve").status == "approved"
        return outcome

    monkeypatch.setattr(store, "decide", the_other_decided_meanwhile)
    assert coord.decide(first, "deny").status == "denied"
    assert coord.client.llen(QUEUE) == 1, "one resume, not one a decision"
    assert queued_ids(coord) == [task_id]


def test_a_slow_decision_claims_the_park_it_ended_not_the_next(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decision's step ends park 1's wait; before its process claims the resume, another path (the parked
    run's release) resumed the task and its next run parked call B. The slow decision claims park 1's field
    (named in its own step), not B's: before, it took B's, and B's own decision then published nothing, the
    task waiting a reconcile grace for its resume."""
    task_id, (first,) = _parked_on(coord, 1)
    store = coord.store.approvals
    decide = store.decide
    runtime = build_runtime(coord.settings, make_app(coord.settings))
    parked_again: list[Approval] = []

    def the_task_parked_again_meanwhile(approval_id: str, *args: object, **kwargs: object) -> Decided:
        decided = decide(approval_id, *args, **kwargs)  # type: ignore[arg-type]
        monkeypatch.setattr(store, "decide", decide)
        approvals.resume(coord.plane, task_id, first)  # the release's claim of park 1
        assert queued_ids(coord) == [task_id]
        coord.client.delete(QUEUE)
        run = runtime.lifecycle.start(task_id)
        assert isinstance(run, Run)
        parked_again.extend(park(coord.plane, run.task, [ToolCall("run_command", {"n": "b"}, "call-b")]))
        run.end(Released("waiting_approval"))
        return decided

    monkeypatch.setattr(store, "decide", the_task_parked_again_meanwhile)
    assert coord.decide(first, "approve").status == "approved"
    assert queued_ids(coord) == [], "park 1's resume was published once, by the release"
    (second,) = parked_again
    assert coord.decide(second.id, "approve").status == "approved"
    assert queued_ids(coord) == [task_id], "B's decision published its resume"


def test_a_decision_on_a_task_stopped_before_its_calls_expired_is_refused(coord: Coordinator) -> None:
    """A cancel's own step ends the task; its expiry of the tree's calls comes after (a broadcast between). A
    person's approval in that gap was recorded `approved`, with its event and audit entry, for a call no run
    would make: the call expires now, and the decision is a 409 naming the stop."""
    task_id, (approval,) = _parked_on(coord, 1)
    coord.client.hset(coord.store.keys.task(task_id[:16], task_id), "status", "cancelled")  # the stop's own step
    with pytest.raises(StateError, match="task had ended: the call expired"):
        coord.decide(approval, "approve")
    record = coord.store.approvals.get_approval(approval)
    assert (record.status, record.feedback, record.decided_by) == ("expired", "its task had ended", None), record
    assert queued_ids(coord) == [] and task_id not in coord.store.convergence.watched()
    assert not [e for e in coord.audit()[0] if e.target == approval], "no decision on record"


@pytest.mark.parametrize("by", ["a person", "the policy"])
def test_a_denial_is_counted_once_however_often_its_run_is_resumed(coord: Coordinator, tmp_path: Path, by: str) -> None:
    """A resumed run answers a denied call, counts it and says so; its worker dies in the model request that
    carries the answer (before that request was saved), and the next run answers the call again, the same way.
    Before, each such resume counted the denial once more (`tool:run_command:denied` 2) and said it again."""
    policy: dict[str, Any] = {"deny": ["run_command:touch"]} if by == "the policy" else {}
    profiles = {OFFLINE_PROFILE: Profile(run_command=RunCommand(cwd=tmp_path), **policy)}
    asker = Coordinator(coord.settings.model_copy(update={"profiles": profiles}))
    try:
        runtime = build_runtime(asker.settings, make_app(asker.settings))
        task = asker.create_task(agent(call("run_command", command="touch made"), reply("done")), run=True)
        asker.client.delete(QUEUE)

        class Died(BaseException):
            """The worker's death in the model request that carries the denial."""

        async def dies(*_: object, **__: object) -> None:
            raise Died

        if by == "a person":
            assert run_child(runtime, task.id).status == "waiting_approval"
            (asked,) = asker.list_approvals(task.root_id)
            asker.decide(asked.id, "deny", "no")
            asker.client.delete(QUEUE)
        with pytest.MonkeyPatch.context() as patch:
            calls_made = {"n": 0}
            request = metering.MeteredModel.request

            async def second_dies(self: Any, *args: Any, **kwargs: Any) -> Any:
                calls_made["n"] += 1
                if by == "the policy" and calls_made["n"] == 1:
                    return await request(self, *args, **kwargs)  # the response that makes the call
                return await dies()

            patch.setattr(metering.MeteredModel, "request", second_dies)
            with pytest.raises(Died):
                run_child(runtime, task.id)
        key = asker.store.keys.task(task.root_id, task.id)
        assert asker.client.hget(key, "tool:run_command:denied") == "1"
        told = [m["text"] for m in asker.messages(task.id) if m.get("say") == "tool_denied"]
        asker.client.delete(asker.store.keys.lease(task.root_id, task.id))  # its lease lapses
        assert run_child(runtime, task.id).status == "completed"
        assert asker.client.hget(key, "tool:run_command:denied") == "1", "counted once"
        said = [m["text"] for m in asker.messages(task.id) if m.get("say") == "tool_denied"]
        assert said == told and len(said) == 1, said
        answered = "\n".join(asker.store.records.conversation(task.id))
        assert "interrupted" not in answered, "answered as denied again, not as interrupted"
        assert not (tmp_path / "made").exists()
    finally:
        asker.close()


def test_a_decision_whose_publish_never_came_still_resumes(coord: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision's watch is made in its own step: a release's or the reconciler's look just before it (a
    pending approval: off the due list) cannot take it away, and a process that dies before it publishes the
    resume leaves the task to the reconciler."""
    task_id, (approval,) = _parked_on(coord, 1)
    decide = coord.store.approvals.decide

    def looked_at_just_before(*args: object, **kwargs: object) -> Decided:
        assert coord.store.convergence.unwatch_parked(task_id), "still pending: taken off"
        return decide(*args, **kwargs)  # type: ignore[arg-type]

    def dies(*args: object, **kwargs: object) -> None:
        raise BrokerError("the process died before it published the resume")

    monkeypatch.setattr(coord.store.approvals, "decide", looked_at_just_before)
    monkeypatch.setattr("coordinator.dispatch.publish_run", dies)
    with pytest.raises(BrokerError):
        coord.decide(approval, "approve")
    assert queued_ids(coord) == [] and task_id in coord.store.convergence.watched()
    assert [(e.action, e.target) for e in coord.audit()[0] if e.target == approval] == [("approve", approval)], (
        "the decision stands, and is on record"
    )
    assert tick(coord) == {"run-lost": 1}
    assert queued_ids(coord) == [task_id], "published by the reconciler"


def test_a_late_approval_whose_expiry_the_broker_refused_puts_no_decision_on_record(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An approval after the deadline expires the call, and the expiry's resume is published; the broker refuses
    it. The person decided nothing: no `deny` of theirs on the audit log (the expiry is nobody's decision)."""
    task_id, (approval,) = _parked_on(coord, 1)
    coord.client.hset(coord.store.keys.approval(task_id[:16], approval), "deadline", time.time() - 1)

    def refused(*args: object, **kwargs: object) -> None:
        raise BrokerError("the broker refused the publish")

    monkeypatch.setattr("coordinator.dispatch.publish_run", refused)
    with pytest.raises(BrokerError):
        coord.decide(approval, "approve")
    assert coord.store.approvals.get_approval(approval).status == "expired"
    assert [e for e in coord.audit()[0] if e.target == approval] == []
    assert task_id in coord.store.convergence.watched(), "the reconciler publishes the resume"


def test_a_parked_run_with_a_pending_approval_leaves_the_due_list(coord: Coordinator) -> None:
    """The other side: while a call still waits for its person, the released task is not due, and the
    reconciler leaves it to the decision (or its expiry timer)."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    run = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(task.id)
    assert isinstance(run, Run)
    park(coord.plane, run.task, [ToolCall("run_command", {"command": "ls"}, "call-1")])
    run.end(Released("waiting_approval"))
    assert task.id not in coord.store.convergence.watched()
    coord.store.convergence.watch([task.id], -10)  # a stale look: the reconciler takes it off again
    assert tick(coord) == {} and queued_ids(coord) == []
    assert task.id not in coord.store.convergence.watched()


def test_one_leader_at_a_time(coord: Coordinator) -> None:
    first, second = Reconciler(coord, "first"), Reconciler(coord, "second")
    coord.client.delete(coord.store.keys.leader())
    assert first.tick() is not None
    assert second.tick() is None, "the second waits while the first's lease lives"
    coord.client.delete(coord.store.keys.leader())  # the first died: its lease lapsed
    assert second.tick() is not None


def test_a_run_whose_lease_was_taken_stops_and_writes_nothing(coord: Coordinator) -> None:
    """The fence: a worker cut off past the lapse finds another run owning its task."""
    task = coord.create_task(agent(reply("x")), run=True)
    rt = build_runtime(coord.settings, make_app(coord.settings))
    run = rt.lifecycle.start(task.id)
    assert isinstance(run, Run)
    lease = coord.store.keys.lease(task.id, task.id)
    coord.client.set(lease, "another-run", ex=60)  # it lapsed, and another run took it
    rt.lifecycle.heartbeat.renew()
    assert run.fenced
    with pytest.raises(LeaseLost):
        run.check_stop()
    before = coord.store.records.conversation(task.id)
    with pytest.raises(LeaseLost):
        run.save(['{"kind": "request", "parts": []}'])
    with pytest.raises(LeaseLost):
        run.end(Ended("completed", summary="written by a fenced run"))
    assert coord.store.records.conversation(task.id) == before
    assert coord.get_task(task.id).status == TaskStatus.ACTIVE, "the fenced run ended nothing"
    assert coord.client.get(lease) == "another-run", "nor touched the new run's lease"
    rt.lifecycle.heartbeat.forget(run)


def test_a_renewal_racing_a_runs_end_step_neither_fences_it_nor_warns(
    coord: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """The end script deletes the lease; a renewal whose list was read before must not call it lost."""
    task = coord.create_task(agent(reply("x")), run=True)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    run = lifecycle.start(task.id)
    assert isinstance(run, Run)
    heartbeat = lifecycle.heartbeat
    lease = coord.store.keys.lease(task.id, task.id)
    with heartbeat.ending(run):
        coord.client.delete(lease)  # as end_run.lua does, before the run forgets its lease
        heartbeat.renew()
    heartbeat.renew()  # ended, not yet forgotten
    assert not run.fenced
    assert "lapsed" not in caplog.text
    heartbeat.forget(run)

    # An end step that raised (Redis failed under it) leaves the run's lease watched as before.
    again = coord.create_task(agent(reply("x")), run=True)
    second = lifecycle.start(again.id)
    assert isinstance(second, Run)
    with pytest.raises(RuntimeError), heartbeat.ending(second):
        raise RuntimeError("the end step failed")
    coord.client.delete(coord.store.keys.lease(again.id, again.id))
    heartbeat.renew()
    assert second.fenced and "lapsed" in caplog.text
    heartbeat.forget(second)

    # A fenced end step leaves its mark (its `forget` finds another run in its place): a new run of the
    # same task is not covered by it, and its lost lease still fences it.
    third = coord.create_task(agent(reply("x")), run=True)
    fenced_run = lifecycle.start(third.id)
    assert isinstance(fenced_run, Run)
    with heartbeat.ending(fenced_run):
        pass  # end_run.lua answered 'fenced': the run raises LeaseLost, and nothing forgets it
    newer = SimpleNamespace(task_id=third.id, token="a-newer-run", fenced=False)
    heartbeat.hold(newer)
    heartbeat.renew()  # the lease is not the newer run's
    assert newer.fenced
    heartbeat.forget(newer)

    # The other order: the newer run is held first (the old one stalled past its lapse and the task was
    # published again), then the old run's end step is fenced. Each run is renewed and fenced on its own.
    fourth = coord.create_task(agent(reply("x")), run=True)
    stalled = lifecycle.start(fourth.id)
    assert isinstance(stalled, Run)
    coord.client.delete(coord.store.keys.lease(fourth.id, fourth.id))  # its lease lapsed
    newest = SimpleNamespace(task_id=fourth.id, token="the-newest-run", fenced=False)
    heartbeat.hold(newest)
    heartbeat.renew()  # neither run holds the lease now
    assert stalled.fenced and newest.fenced, "both runs of the task are fenced, not only the last held"
    newest.fenced = False
    with heartbeat.ending(stalled):
        pass  # the old run's end: end_run.lua answers 'fenced'
    heartbeat.forget(stalled)
    heartbeat.renew()
    assert newest.fenced, "the old run's end-step mark does not cover the newer run"
    heartbeat.forget(newest)


def test_a_save_after_the_lease_lapsed_is_refused_even_before_the_heartbeat_notices(coord: Coordinator) -> None:
    task = coord.create_task(agent(reply("x")), run=True)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    run = lifecycle.start(task.id)
    assert isinstance(run, Run)
    coord.client.delete(coord.store.keys.lease(task.id, task.id))
    run.save(['{"kind": "request", "parts": []}'])  # kept for the run's next step, which writes it
    with pytest.raises(LeaseLost):
        run.flush()
    assert coord.store.records.conversation(task.id) == [] and run.fenced
    with pytest.raises(LeaseLost):
        run.save(['{"kind": "request", "parts": []}'])
    lifecycle.heartbeat.forget(run)


def test_a_cancel_stops_the_children_a_delegation_committed_while_it_read_the_subtree(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run commits a delegation between the cancel's read of the subtree and its stop: the children it adds
    are stopped too, and its run's release publishes nothing for the cancelled task."""
    root = coord.create_task("fan out")
    (worker_id,) = coord.delegate(root.id, [subtask("works", agent(reply("x")))]).child_ids
    coord.client.delete(QUEUE)
    run = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(worker_id)
    assert isinstance(run, Run)
    records = coord.store.records
    read = records.subtree_ids
    added: list[str] = []

    def a_delegation_lands_just_after(task_id: str) -> list[str]:
        ids = read(task_id)
        if not added:
            _, children = delegation.commit(
                coord.plane, worker_id, [subtask("late", agent(reply("y")))], token=run.token
            )
            added.extend(c.id for c in children)
        return ids

    monkeypatch.setattr(records, "subtree_ids", a_delegation_lands_just_after)
    coord.cancel(root.id, "enough")
    assert added and set(added) <= set(records.tree_task_ids(root.id))
    statuses = {t.id: t.status for t in records.get_records(records.tree_task_ids(root.id))}
    assert statuses == dict.fromkeys(statuses, TaskStatus.CANCELLED), statuses
    run.end(Released("delegated"))
    assert queued_ids(coord) == [], "no child of a cancelled task is published"


def test_a_stop_of_thousands_of_tasks_puts_every_one_on_the_due_list(coord: Coordinator) -> None:
    """A stop names a tree of 4,500 tasks (a wide fan-out's, or a tenant's day quota stopping a whole root): every
    one is stopped and on the due list, in one step (Lua unpacks no more than about 8,000 values at once)."""
    root = coord.create_task("a wide tree")
    ids = [root.id, *(f"{root.id}-{n:012x}" for n in range(4_499))]
    with coord.client.pipeline(transaction=False) as pipe:
        for task_id in ids[1:]:
            pipe.hset(coord.store.keys.task(root.id, task_id), mapping={"id": task_id, "status": "active"})
        pipe.execute()
    stopped = coord.store.batches.stop_tasks(
        ids, top_status="cancelled", status="cancelled", top_error="cancelled: enough", error="enough",
        top_class="Cancelled", error_class="Cancelled", watch_s=30,
    )  # fmt: skip
    assert sorted(stopped) == sorted(ids)
    assert set(coord.store.convergence.watched()) == set(ids)
    coord.store.convergence.unwatch(ids)


def test_a_cancel_that_dies_before_its_write_back_leaves_the_parent_to_the_reconciler(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel of a delegated child dies just after its stop is persisted (the broker's revoke fails, or its
    process is killed), before it writes the child back into its parent's batch: the child stays on the due
    list, and the reconciler writes it back, so the batch closes and the parent hears it (before, a delegated
    or parked child was off the list, and its parent stayed `delegated` for good; a second cancel is refused,
    the child having ended)."""
    root = coord.create_task("fan out")
    (child_id,) = coord.delegate(root.id, [subtask("works", agent(reply("x")))]).child_ids
    delegate_as_its_run(coord, child_id, [subtask("deeper", agent(reply("y")))])  # the child now waits on its own batch
    coord.client.delete(QUEUE)
    assert child_id not in coord.store.convergence.watched(), "a delegated task is off the due list"

    def the_broker_is_away(*_: object, **__: object) -> None:
        raise ConnectionError("the broker is away")

    monkeypatch.setattr(coord.app.control, "revoke", the_broker_is_away)
    with pytest.raises(ConnectionError):
        coord.cancel(child_id, "enough")
    assert coord.get_task(child_id).status == TaskStatus.CANCELLED, "the stop persisted"
    assert coord.get_task(root.id).status == TaskStatus.DELEGATED
    assert child_id in coord.store.convergence.watched(), "left to the reconciler"

    assert tick(coord).get("ended-not-written-back", 0) >= 1
    batch = coord.store.batches.get_batch(coord.get_task(child_id).batch_id)
    assert batch.status == "done", "the parent's batch closed"
    assert coord.get_task(root.id).status != TaskStatus.DELEGATED, "the parent heard its child's end"
    assert child_id not in coord.store.convergence.watched(), "written back, and off the list"


def test_a_cancel_that_dies_before_it_expires_a_parked_tasks_calls_leaves_them_to_the_reconciler(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel of a task parked on a call for a person dies just after its stop is persisted, before it expires
    the call: the reconciler's look at the stopped task expires it, so no person is left asked about a call no
    run will make (before, until the approval's deadline)."""
    task_id, (approval,) = _parked_on(coord, 1)

    def the_broker_is_away(*_: object, **__: object) -> None:
        raise ConnectionError("the broker is away")

    monkeypatch.setattr(coord.app.control, "revoke", the_broker_is_away)
    with pytest.raises(ConnectionError):
        coord.cancel(task_id, "enough")
    assert coord.store.approvals.get_approval(approval).status == "pending", "the stop died before it expired it"
    tick(coord)
    assert coord.store.approvals.get_approval(approval).status == "expired"
    assert approval not in coord.store.approvals.pending_approval_ids()
    assert queued_ids(coord) == [], "nothing resumed"


def _after_the_first_save(monkeypatch: pytest.MonkeyPatch, then: Callable[[], None]) -> list[str]:
    """Every approval's save (the run's own store's too: its runtime's coordinator) noted in the list returned,
    with `then` run just before each save after the first."""
    save = ApprovalStore.save_approval
    saved: list[str] = []

    def noted(store: ApprovalStore, approval: Approval, token: str = "") -> str:
        if saved:
            then()
        done = save(store, approval, token)
        saved.append(approval.id)
        return done

    monkeypatch.setattr(ApprovalStore, "save_approval", noted)
    return saved


def test_a_call_a_cancel_overtook_never_waits_on_a_person(coord: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel lands between the parking run's last step (which read its task active) and the save of its
    calls: the first call, saved before the stop's mark, is expired by the stop; the second, after it, is not
    saved, and no `approval.requested` goes out for it. The run stops as it does at a step."""
    task = coord.create_task(agent(reply("x")), run=True, webhooks=[{"url": "https://example.com/hook"}])
    coord.client.delete(QUEUE)
    run = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(task.id)
    assert isinstance(run, Run)
    saved = _after_the_first_save(monkeypatch, lambda: coord.cancel(task.id, "enough"))
    with pytest.raises(RunStopped):
        run.approvals.park([ToolCall("run_command", {"n": n}, f"call-{n}") for n in range(2)])
    first, second = saved
    assert approvals.list_pending(coord.plane, task.root_id) == []
    assert coord.store.approvals.get_approval(first).status == "expired", "expired by the stop"
    with pytest.raises(NotFoundError):
        coord.store.approvals.get_approval(second)
    assert run.end(run.stopped(None)).status == "cancelled", "the run ends as a stop it read at a step does"
    assert coord.get_task(task.id).status == TaskStatus.CANCELLED and queued_ids(coord) == []
    requested = [d for d in coord.store.outbox.deliveries(task.id) if d.get("type") == "approval.requested"]
    assert [d["fields"]["approval_id"] for d in requested] == [first], "no notice of the call that was not saved"
    timers = coord.client.zrange(coord.store.keys.timers(), 0, -1)
    assert expiry_timer(second) not in timers, "no deadline for a call never saved"


def test_a_parked_run_whose_task_was_cancelled_before_its_release_ends_stopped(coord: Coordinator) -> None:
    """The cancel lands after the run saved its calls and before its release: the stop expired them, so the
    release, finding none pending, would have resumed the task and shown it waiting again. It ends stopped."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    run = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(task.id)
    assert isinstance(run, Run)
    (approval,) = run.approvals.park([ToolCall("run_command", {"command": "ls"}, "call-1")])
    coord.cancel(task.id, "enough")
    assert coord.store.approvals.get_approval(approval).status == "expired"

    assert run.end(Released("waiting_approval")).status == "cancelled"
    assert queued_ids(coord) == [] and coord.client.llen(QUEUE) == 0, "no resume of a cancelled task"
    assert coord.store.events.live(task.root_id)[task.id]["state"] == "cancelled"
    assert coord.client.exists(coord.store.keys.lease(task.id, task.id)) == 0, "its lease freed"


def test_a_cancel_that_lands_as_a_parked_run_releases_leaves_no_waiting_status_after_it(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel lands after the run's release freed its lease and before it said the task waits for a person:
    the task's live status stays `cancelled` and the stream shows no wait after the stop's event (before, a
    `waiting_approval` status and event came after it, and a follower saw a cancelled task waiting)."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    run = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(task.id)
    assert isinstance(run, Run)
    run.approvals.park([ToolCall("run_command", {"command": "ls"}, "call-1")])
    convergence = run._plane.store.convergence
    unwatch_parked = convergence.unwatch_parked

    def then_cancelled(task_id: str) -> bool:
        parked = unwatch_parked(task_id)
        coord.cancel(task.id, "enough")
        return parked

    monkeypatch.setattr(convergence, "unwatch_parked", then_cancelled)
    run.end(Released("waiting_approval"))
    assert coord.get_task(task.id).status == TaskStatus.CANCELLED
    assert coord.store.events.live(task.root_id)[task.id]["state"] == "cancelled"
    events = [fields for _, fields in coord.store.events.read_events(task.root_id)]
    stop = next(n for n, e in enumerate(events) if e["type"] == "task_status" and e["status"] == "cancelled")
    assert [e for e in events[stop:] if e["type"] == "live"] == [], "no live status after the stop's"


def test_a_live_status_a_run_sends_after_a_stop_landed_leaves_the_stops_the_last(coord: Coordinator) -> None:
    """A cancel lands between a run's steps, with a live status (`running`, its figures) waiting for the next: that
    step writes the run's usage and reads the stop, and the task's live status stays `cancelled` (before, the
    step wrote `running` over it, and the run's end, finding the task ended, never wrote it again)."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    run = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(task.id)
    assert isinstance(run, Run)
    run.writes.live = live_status(run.task, "running", requests=1)
    coord.cancel(task.id, "enough")

    assert TaskStatus(run.flush().status) == TaskStatus.CANCELLED, "the step reads the stop"
    assert coord.store.events.live(task.root_id)[task.id]["state"] == "cancelled"
    events = [fields for _, fields in coord.store.events.read_events(task.root_id)]
    stop = next(n for n, e in enumerate(events) if e["type"] == "task_status" and e["status"] == "cancelled")
    assert [e for e in events[stop:] if e["type"] == "live"] == [], "no live status after the stop's"


def test_a_parked_runs_wait_never_covers_the_newer_run_a_decision_started(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run parks a call, decided at once; it stalls past its lapse just before its release, and the task's newer
    run starts. The stale run's release frees nothing and it ends lost: no `waiting_approval` over the newer run's
    `running`, and no second resume published (before, it said the wait after its release, over the newer run,
    and published a resume of a task that runs)."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    stale = lifecycle.start(task.id)
    assert isinstance(stale, Run)
    (approval,) = stale.approvals.park([ToolCall("run_command", {"command": "ls"}, "call-1")])
    coord.decide(approval, "approve")
    newer: list[Run] = []

    def stalls_past_its_lapse(_settings: Settings, name: str) -> None:
        if name == "after-park":
            coord.client.delete(coord.store.keys.lease(task.id, task.id))
            started = lifecycle.start(task.id)
            assert isinstance(started, Run), "the decided task's newer run starts"
            newer.append(started)

    monkeypatch.setattr("coordinator.runs.faults.crash_point", stalls_past_its_lapse)
    stale.end(Released("waiting_approval"))
    assert newer, "the stale run got past its step to its release"
    assert coord.store.events.live(task.root_id)[task.id]["state"] == "running", "the newer run's status stands"
    assert queued_ids(coord) == [] and coord.client.llen(QUEUE) == 0, "no resume of a task that runs"
    assert coord.client.get(coord.store.keys.lease(task.id, task.id)) == newer[0].token, "its lease the newer run's"


def test_a_run_that_lost_its_lease_may_not_start_an_approved_call(coord: Coordinator) -> None:
    """An approved call is run once: a run that stalled past its lapse just before it started the call, while
    the task's newer run read the journal without its note and may run the call itself, is told here that its
    lease is lost, and writes no note (before, the note was written blind and both runs ran the call)."""
    task, _, stale, newer = _stale_and_newer(coord)
    assert newer.journal.kept(["call-1"]).started == set(), "the newer run read no note"

    with pytest.raises(LeaseLost):
        stale.journal.mark_started("call-1")
    assert stale.fenced and newer.journal.kept(["call-1"]).started == set(), "nothing written"
    newer.journal.mark_started("call-1")
    assert stale.journal.kept(["call-1"]).started == {"call-1"}, "the newer run's note"


def _stale_after_its_next_step(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch, task: TaskRecord, then: Callable[[Run], object] | None = None
) -> Run:
    """The task's run, which stalls past its lease's lapse just after its next step: the task's newer run starts
    then (and does `then`), before the stale run goes on."""
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    stale = lifecycle.start(task.id)
    assert isinstance(stale, Run)
    flush = stale.flush

    def then_a_newer_run_starts(*, or_stop: bool = False) -> Stepped:
        stepped = flush(or_stop=or_stop)
        coord.client.delete(coord.store.keys.lease(task.id, task.id))  # it stalled past its lapse
        newer = lifecycle.start(task.id)
        assert isinstance(newer, Run), "the task's newer run"
        if then is not None:
            then(newer)
        return stepped

    monkeypatch.setattr(stale, "flush", then_a_newer_run_starts)
    return stale


def _one_child_committed(coord: Coordinator) -> tuple[TaskRecord, RunLifecycle, Run, Batch, TaskRecord]:
    """A task's run in this process (its message taken off the queue), which has committed a delegation of one
    child: the task, the lifecycle that started the run, the run, the batch and the child."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    run = lifecycle.start(task.id)
    assert isinstance(run, Run)
    batch, (child,) = run.plan.delegate([SubtaskSpec(description="a", message="work")], "parallel", "call-1")
    return task, lifecycle, run, batch, child


def test_a_run_that_ends_after_committing_a_delegation_stops_its_children_and_a_retry_resumes(
    coord: Coordinator,
) -> None:
    """A run commits a delegation, then ends `failed` rather than release (its time limit ran out in a tool called
    beside `run_subagents`): the children it committed are stopped with it and its batch closes. Before, they
    stayed `active`, never published nor watched, and a retry's next delegation waited on a batch that never
    closed, the task `delegated` for good."""
    task, lifecycle, run, batch, committed = _one_child_committed(coord)
    run.end(Ended("failed", error="the task's time limit ran out"))
    child = coord.get_task(committed.id)
    assert child.status.terminal, f"the committed child is stopped with its parent, not {child.status}"
    assert coord.store.batches.get_batch(batch.id).status == "done", "its batch closed"
    assert task.id not in coord.store.convergence.watched(), "nothing left for the reconciler to repair"
    coord.retry(task.id)
    again = lifecycle.start(task.id)
    assert isinstance(again, Run)
    second, (only,) = again.plan.delegate([SubtaskSpec(description="b", message="work")], "parallel", "call-2")
    again.end(Released("delegated"))
    ran = lifecycle.start(only.id)
    assert isinstance(ran, Run)
    ran.end(Ended("completed", summary="done"))
    assert coord.store.batches.get_batch(second.id).status == "done", "the retry's batch closes on its one child's end"
    assert coord.get_task(task.id).status == TaskStatus.ACTIVE, "and the parent is resumed"


def test_a_run_that_dies_after_ending_with_a_committed_delegation_leaves_its_children_to_the_reconciler(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same end, its process dead right after `end_run.lua` (before it stopped the children): the ended task
    stays on the due list while its delegation is open, and the reconciler's look stops the children."""

    class Died(BaseException):
        pass

    def dies(*_args: object) -> None:
        raise Died

    task, lifecycle, run, batch, child = _one_child_committed(coord)
    from coordinator import delegation

    monkeypatch.setattr(delegation, "publish_waiting", dies)  # the process dies as it begins to stop them
    with pytest.raises(Died):
        run.end(Ended("failed", error="the task's time limit ran out"))
    assert coord.get_task(child.id).status == TaskStatus.ACTIVE, "the process died before it stopped them"
    assert task.id in coord.store.convergence.watched(), "the ended task stays due while its delegation is open"
    monkeypatch.undo()
    tick(coord)
    assert coord.get_task(child.id).status.terminal and coord.store.batches.get_batch(batch.id).status == "done"
    assert task.id not in coord.store.convergence.watched(), "and leaves the due list then"


def test_a_delegation_beside_a_call_for_a_person_runs_its_children_while_the_call_waits(coord: Coordinator) -> None:
    """One response commits a delegation and asks a person about another call: the run parks for the decision,
    and its children run meanwhile. Before, they waited unpublished until the decision (or its expiry, an hour
    by default). The parent runs once both have come: its children's end and the decision."""
    task, lifecycle, run, batch, child = _one_child_committed(coord)
    (approval,) = park(coord.plane, run.task, [ToolCall("run_command", {"command": "ls"}, "call-2")])
    run.end(Released("waiting_approval"))
    assert coord.store.batches.batch_published(batch.id) and queued_ids(coord) == [child.id], "its child runs now"
    coord.client.delete(QUEUE)
    ran = lifecycle.start(child.id)
    assert isinstance(ran, Run)
    ran.end(Ended("completed", summary="done"))
    assert coord.store.batches.get_batch(batch.id).status == "done"
    assert not isinstance(lifecycle.start(task.id), Run), "no run of the parent before the person decides"
    assert undecided(coord.plane, task.id) == [approval.id]
    coord.decide(approval.id, "approve")
    assert isinstance(lifecycle.start(task.id), Run), "the decision resumes it, its children's results in"


def test_a_run_that_lost_its_lease_delegates_nothing_and_leaves_the_plan_alone(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stalls past its lapse between its step and its delegation's commit (or its plan's update), and the
    task's newer run starts: the stale run commits nothing and ends lost, leaving the task `active` and its plan
    the newer run's (before, it committed children the newer run never asked for, and made the task
    `delegated` under the newer run's feet)."""
    task = coord.create_task(agent(reply("x")), run=True, todos="[ ] a\n[ ] b")
    stale = _stale_after_its_next_step(coord, monkeypatch, task)
    with pytest.raises(LeaseLost):
        stale.plan.delegate([SubtaskSpec(description="a", message="work")], "parallel", "call-1")
    assert stale.fenced
    after = coord.get_task(task.id)
    assert (after.status, after.child_ids) == (TaskStatus.ACTIVE, []), "nothing committed"
    with pytest.raises(LeaseLost):
        stale.plan.update_todos("[x] a\n[ ] b\n[ ] c")
    assert [t.content for t in coord.get_todos(task.id)] == ["a", "b"], "the plan as it was"
    assert [t.status for t in coord.get_todos(task.id)] == ["pending", "pending"]


def test_a_run_that_lost_its_lease_parks_nothing_on_its_provider(coord: Coordinator) -> None:
    """A run, its provider's wait open, stalls past its lapse just before it parks, and the task's newer run starts: the
    stale park writes nothing (no timer, no wait's time, no delivery count reset on the newer run's task) and
    the run ends lost (before, the newer run's next failed request counted its wait from the stale run's time,
    and could give up at once)."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    stale = lifecycle.start(task.id)
    assert isinstance(stale, Run)
    stale.provider.waiting("api.example:443", waiting=True)  # its wait opened, written with a step
    coord.client.delete(coord.store.keys.lease(task.id, task.id))  # it stalled past its lapse
    newer = lifecycle.start(task.id)
    assert isinstance(newer, Run)
    deliveries = coord.client.hget(coord.store.keys.task(task.id, task.id), "deliveries")
    timers = coord.client.zrange(coord.store.keys.timers(), 0, -1)

    with pytest.raises(LeaseLost):
        stale.provider.park("api.example:443", "", time.time() + 30, int(time.time() * 1000) - 600_000)
    assert stale.fenced
    assert coord.store.endpoints.wait_since_ms(task.id) is None, "no wait on the newer run's task"
    assert coord.client.hget(coord.store.keys.task(task.id, task.id), "deliveries") == deliveries
    assert coord.client.zrange(coord.store.keys.timers(), 0, -1) == timers, "no timer"
    assert task.id not in coord.client.zrange(coord.store.keys.endpoint_parked("api.example:443", ""), 0, -1)


def _a_roots_run(coord: Coordinator, lifecycle: RunLifecycle) -> tuple[TaskRecord, Run]:
    """A fresh root of one offline agent, its message taken off the queue, and its run started by `lifecycle`."""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    run = lifecycle.start(task.id)
    assert isinstance(run, Run)
    return task, run


def test_a_run_handed_back_counts_its_deliveries_anew_but_not_a_newer_runs(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run handed back (its worker shutting down) was not lost: its task's delivery count starts again. Its
    lease lapsed after its last step and the task's newer run started, just before the release: that run's count
    stays (reset_deliveries in the lease's release, `release_lease.lua`; before, a plain write after the step set
    the newer run's count to 0, so a run lost for good was delivered SUBQ_MAX_DELIVERIES times more)."""
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    task_key = coord.store.keys.task
    handed, run = _a_roots_run(coord, lifecycle)
    assert coord.client.hget(task_key(handed.id, handed.id), "deliveries") == "1"
    assert run.hand_back().status == "queued"
    assert coord.client.hget(task_key(handed.id, handed.id), "deliveries") == "0", "handed back: counted anew"

    task, stale = _a_roots_run(coord, lifecycle)
    convergence = lifecycle.plane.store.convergence  # the worker's store, which the run writes through
    watch = convergence.watch
    newer: list[object] = []

    def lapsed_and_taken_over(*args: Any, **kwargs: Any) -> None:
        coord.client.delete(coord.store.keys.lease(task.id, task.id))  # it stalled past its lapse
        newer.append(lifecycle.start(task.id))
        watch(*args, **kwargs)

    monkeypatch.setattr(convergence, "watch", lapsed_and_taken_over)
    assert stale.hand_back().status == "running", "lost: the task is the newer run's"
    assert isinstance(newer[0], Run)
    assert coord.client.hget(task_key(task.id, task.id), "deliveries") == "2", "the newer run's count stays"


def test_a_failed_runs_error_body_is_written_with_its_end_not_over_a_retry(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed run's raw error body is kept on its record by the step that fails the task (end_run.lua), not by a
    write after it: a person's retry just after that step clears the failure, and the retried task carries no
    body of the run before (before, the late write put it on the retried, active task)."""
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    failed, run = _a_roots_run(coord, lifecycle)
    runs = lifecycle.plane.store.runs  # the worker's store, which the run writes through
    end_run = runs.end_run
    retried: list[str] = []

    def then_retried(*args: Any, **kwargs: Any) -> Any:
        ending = end_run(*args, **kwargs)
        assert coord.get_task(failed.id).error_detail == '{"error": "overloaded"}', "written with the failure"
        retried.extend(coord.retry(failed.id).retried)
        return ending

    monkeypatch.setattr(runs, "end_run", then_retried)
    ended = run.end(Ended("failed", error="no way", error_class="X", error_detail='{"error": "overloaded"}'))
    assert (ended.status, retried) == ("failed", [failed.id])
    record = coord.get_task(failed.id)
    assert (record.status, record.error_detail) == (TaskStatus.ACTIVE, ""), "the retried task has no old body"


def test_an_end_that_finds_its_task_failed_meanwhile_keeps_no_error_body(coord: Coordinator) -> None:
    """Another process failed the task while its run went on (lost past SUBQ_MAX_DELIVERIES): the run's own failed
    end, the same status, writes no body of its own onto a failure that is not its (before, a write after the end
    checked only that the statuses matched)."""
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    lost, run = _a_roots_run(coord, lifecycle)
    coord.store.runs.finish_task(lost.id, "failed", error="lost", error_class="WorkerLost")  # failed meanwhile
    run.end(Ended("failed", error="no way", error_class="X", error_detail="late"))
    assert coord.get_task(lost.id).error_detail == "", "not this run's failure: no body"


def test_a_stale_runs_failed_requests_are_not_counted_on_the_newer_runs_request(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stalls past its lapse just after the step before its failed requests are counted, and the task's newer
    run starts and has a request of its own fail: the stale run's failures are not counted on the task (before,
    they were added to the newer run's failed attempts, which could then give up early), no `wait_out` line is
    said, and the stale run ends lost."""
    task = coord.create_task(agent(reply("x")), run=True)
    stale = _stale_after_its_next_step(
        coord, monkeypatch, task, then=lambda newer: newer.provider.transient_errors(["api.example:443 answered 503"])
    )
    record = coord.store.keys.task(task.id, task.id)
    with pytest.raises(LeaseLost):
        stale.provider.transient_errors(["api.example:443 answered 503", "api.example:443 answered 429"])
    assert stale.fenced
    assert coord.client.hmget(record, "transient_errors", "provider_attempts") == ["1", "1"], "the newer run's one"
    said = [json.loads(line) for line in coord.client.lrange(coord.store.keys.ui_messages(task.id, task.id), 0, -1)]
    assert not [m for m in said if m.get("say") == "wait_out"], "no stale wait_out line"


def test_a_park_its_run_lost_the_lease_in_the_middle_of_leaves_the_saved_call_to_its_person(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run parks two calls and stalls past its lapse after saving the first (listed, and notified). The task's
    next start waits while that call is pending (`asked`), so no newer run asks anything beside it; the second
    is not saved, the stale run ends lost, and the first stays for its person, as after a worker's death there.
    The decision resumes the task: its run answers the first call with it. (Before, the list was written after
    the saves: the first expired unlisted, and the newer run answered both calls as interrupted.)"""
    task = coord.create_task(agent(reply("x")), run=True)
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    stale = lifecycle.start(task.id)
    assert isinstance(stale, Run)
    started: list[object] = []

    def stalls_past_its_lapse() -> None:
        coord.client.delete(coord.store.keys.lease(task.id, task.id))
        started.append(lifecycle.start(task.id))

    saved = _after_the_first_save(monkeypatch, stalls_past_its_lapse)
    with pytest.raises(LeaseLost):
        stale.approvals.park([ToolCall("run_command", {"n": n}, f"c{n}") for n in range(2)])
    assert stale.fenced
    assert not isinstance(started[0], Run), "no newer run beside the call that waits"
    first, second = saved
    assert coord.store.approvals.get_approval(first).status == "pending"
    with pytest.raises(NotFoundError):
        coord.store.approvals.get_approval(second)
    assert [a.id for a in approvals.list_pending(coord.plane, task.root_id)] == [first]
    assert coord.store.runs.waiting_approval_ids(task.id) == [first, second]
    assert undecided(coord.plane, task.id) == [first]
    assert expiry_timer(first) in coord.client.zrange(coord.store.keys.timers(), 0, -1)
    assert coord.decide(first, "approve").status == "approved"
    assert queued_ids(coord) == [task.id], "the decision resumes it"
    resumed = lifecycle.start(task.id)
    assert isinstance(resumed, Run)
    assert {c: d.approved for c, d in resumed.approvals.answers().decisions.items()} == {"c0": True}


def test_a_run_that_lost_its_lease_parks_nothing_beside_the_newer_runs_call(coord: Coordinator) -> None:
    """A run stalled past its lapse after its last step, and a newer run of its task parked a call of its own;
    the stale run's calls, parked late, are not saved (no approval, no notice, no deadline) and the task's
    list of the calls it waits on stays the newer run's (before, the stale run overwrote it: a decision of the
    newer call then read the list of calls nobody would run)."""
    task, _, stale, newer = _stale_and_newer(coord, webhooks=[{"url": "https://example.com/hook"}])
    (asked,) = newer.approvals.park([ToolCall("run_command", {"command": "ls"}, "call-new")])
    timers_before = coord.client.zrange(coord.store.keys.timers(), 0, -1)

    with pytest.raises(FencedError):
        approvals.park(stale._plane, stale.task, [ToolCall("run_command", {"command": "rm"}, "call-old")], stale.token)
    assert coord.store.runs.waiting_approval_ids(task.id) == [asked], "the newer run's list stands"
    assert undecided(coord.plane, task.id) == [asked]
    requested = [d for d in coord.store.outbox.deliveries(task.id) if d.get("type") == "approval.requested"]
    assert [d["fields"]["approval_id"] for d in requested] == [asked], "one notice: the newer run's call"
    assert coord.client.zrange(coord.store.keys.timers(), 0, -1) == timers_before, "no deadline left for it"
    assert not coord.store.runs.set_waiting_approvals(task.id, ["nobody"], stale.token), "the list write is fenced"
    assert coord.store.runs.waiting_approval_ids(task.id) == [asked]


@pytest.fixture
def limited(coord: Coordinator) -> Iterator[Coordinator]:
    """The convergence coordinator with one run slot a tree and one a parent."""
    limited = Coordinator(coord.settings.model_copy(update={"max_running_per_root": 1, "max_running_per_parent": 1}))
    yield limited
    limited.close()


def test_a_run_abandoned_after_its_task_was_taken_over_frees_nothing_of_the_new_runs(limited: Coordinator) -> None:
    """A run whose lease lapsed (a partition, a stall) while the task's next run took it over, and that then
    fails on Redis and abandons itself, frees no slot: the slots are the newer run's (it reused them). It freed
    them, and a sibling started beside the newer run, one past the limit, for as long as that run ran."""
    coord = limited
    lifecycle, older, second = _one_slot_held_one_waiting(coord)
    root, first = older.task.root_id, older.task.id
    coord.client.delete(coord.store.keys.lease(root, first))  # its lease lapsed
    newer = lifecycle.start(first)
    assert isinstance(newer, Run), "the task's next run, in the slot its task holds"
    older.abandon()
    assert coord.store.runs.running_ids(root) == {first}, "the slot is still the newer run's"
    assert coord.client.llen(QUEUE) == 0, "the sibling was not admitted beside it"
    newer.abandon()
    assert coord.store.runs.running_ids(root) == {second}, "the newer run's release gives the slot on"


def test_a_delegating_run_dead_before_its_release_frees_its_slot_for_its_children(limited: Coordinator) -> None:
    """A child's run commits a delegation and dies before its release freed its tree slot: the reconciler, which
    publishes the batch, frees the slot too (while the task is still delegated), or its children wait for it
    for good; a redelivery of its message does the same."""
    coord = limited
    root = coord.create_task("fan out")
    (worker_id,) = coord.delegate(root.id, [subtask("works", agent(reply("x")))]).child_ids
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    run = lifecycle.start(worker_id)
    assert isinstance(run, Run), "it holds the tree's one slot"
    _, (late,) = delegation.commit(coord.plane, worker_id, [subtask("late", agent(reply("y")))], token=run.token)
    coord.client.delete(coord.store.keys.lease(root.id, worker_id))  # the run died: its lease lapsed
    assert tick(coord) == {"delegation-unpublished": 1}
    assert worker_id not in coord.store.runs.running_ids(root.id), "its slot freed"
    assert isinstance(lifecycle.start(late.id), Run), "its child runs"
    assert run_child(build_runtime(coord.settings, make_app(coord.settings)), worker_id).status == "delegated"
    assert coord.store.runs.running_ids(root.id) == {late.id}, "a redelivery frees nothing of its child's"


def _asking_beside_a_waiting_sibling(coord: Coordinator) -> tuple[str, str, Approval]:
    """Two children of a tree with one run slot: the first's run parked a call for a person and died before its
    release (its lease lapsed), holding the slot; the second waits for it. Their ids and the call's approval."""
    _, run, sibling = _one_slot_held_one_waiting(coord)
    (approval,) = park(coord.plane, run.task, [ToolCall("run_command", {"command": "ls"}, "call-1")])
    coord.client.delete(coord.store.keys.lease(run.task.root_id, run.task.id))  # the run died: its lease lapsed
    return run.task.id, sibling, approval


def _one_slot_held_one_waiting(coord: Coordinator) -> tuple[RunLifecycle, Run, str]:
    """Two children of a tree with one run slot: the first's run holds it, the second waits for it. The lifecycle
    that started them, the first's run and the second's id."""
    root = coord.create_task("fan out")
    first, second = coord.delegate(
        root.id, [subtask("a", agent(reply("x"))), subtask("b", agent(reply("y")))]
    ).child_ids
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    run = lifecycle.start(first)
    assert isinstance(run, Run), "it holds the tree's one slot"
    assert not isinstance(lifecycle.start(second), Run), "its sibling waits for the slot"
    return lifecycle, run, second


def test_a_run_dead_after_it_parked_a_call_frees_its_slot_while_the_call_waits(limited: Coordinator) -> None:
    """A child's run parks a call for a person and dies before its release freed its tree slot: the reconciler,
    which takes the task off the due list while the call waits, frees the slot too, and its sibling starts.
    Before, the sibling waited for the person's decision (or the approval's deadline)."""
    coord = limited
    asker, sibling, approval = _asking_beside_a_waiting_sibling(coord)
    assert tick(coord) == {}
    assert asker not in coord.store.convergence.watched(), "left to the decision"
    assert coord.store.runs.running_ids(approval.root_id) == {sibling}, "its slot went to the sibling"
    assert queued_ids(coord) == [sibling], "whose run was published"
    assert coord.decide(approval.id, "approve").status == "approved"
    assert queued_ids(coord) == sorted([asker, sibling]), "the decision resumes it"
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    assert not isinstance(lifecycle.start(asker), Run), "its resumed run waits for a slot, the limit kept"


def test_a_parked_runs_release_frees_no_slot_of_the_run_a_decision_started_meanwhile(
    limited: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run parks a call and releases: between its lease's free and its slot's, the person decides, and the
    resumed run starts elsewhere, reusing the slot its task holds. The parked run's free, checked in its own
    step against the task's last start, leaves that slot. Before, it freed it under the resumed run, and the
    sibling waiting for it started beside, one past the tree's limit."""
    coord = limited
    lifecycle, parked, sibling = _one_slot_held_one_waiting(coord)
    asker = parked.task.id
    (approval,) = park(coord.plane, parked.task, [ToolCall("run_command", {"command": "ls"}, "call-1")])
    runs = parked._plane.store.runs
    release_lease = runs.release_lease
    resumed: list[Run] = []

    def decided_and_resumed_just_after(task_id: str, token: str, **kwargs: Any) -> bool:
        freed = release_lease(task_id, token, **kwargs)
        assert coord.decide(approval.id, "approve").status == "approved"
        newer = lifecycle.start(asker)  # the resume, delivered to another worker
        assert isinstance(newer, Run), "the resumed run, in the slot its task holds"
        resumed.append(newer)
        return freed

    monkeypatch.setattr(runs, "release_lease", decided_and_resumed_just_after)
    parked.end(Released("waiting_approval"))
    assert resumed, "the decision came between the two frees"
    assert coord.store.runs.running_ids(parked.task.root_id) == {asker}, "the slot is still the resumed run's"
    assert sibling not in queued_ids(coord), "the sibling was not admitted beside it"
    assert resumed[0].end(Ended("completed", summary="x")).status == "completed"
    assert coord.store.runs.running_ids(parked.task.root_id) == {sibling}, "the resumed run's end gives it on"


def test_a_parked_tasks_slot_is_not_freed_once_a_decision_resumed_it(
    limited: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconciler read the task parked, its call pending; before it freed the slot, the decision came and
    the resumed run took the lease, reusing the slot its task holds: the free, checked in its own step, leaves
    that slot (else the sibling would run beside it, one past the tree's limit)."""
    coord = limited
    asker, sibling, approval = _asking_beside_a_waiting_sibling(coord)
    release_slot = coord.store.runs.release_slot
    resumed: list[object] = []

    def decided_just_before(*args: Any, **kwargs: Any) -> list[str]:
        assert coord.decide(approval.id, "approve").status == "approved"
        resumed.append(build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(asker))
        return release_slot(*args, **kwargs)

    monkeypatch.setattr(coord.store.runs, "release_slot", decided_just_before)
    tick(coord)
    assert isinstance(resumed[0], Run), "the resumed run reused the slot"
    assert coord.store.runs.running_ids(approval.root_id) == {asker}, "still the resumed run's"
    assert sibling not in queued_ids(coord), "the sibling still waits"


def test_a_delegated_tasks_slot_is_not_freed_once_a_resumed_run_took_it(limited: Coordinator) -> None:
    """The reconciler read the task delegated; its batch closed and a resumed run of it took a slot before the
    free: the free, checked in its own step, leaves that slot (else a third run would fit the tree's one)."""
    coord = limited
    root = coord.create_task("fan out")
    (worker_id,) = coord.delegate(root.id, [subtask("works", agent(reply("x")))]).child_ids
    coord.client.delete(QUEUE)
    assert isinstance(build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(worker_id), Run)
    read_delegated = coord.get_task(worker_id).model_copy(update={"status": TaskStatus.DELEGATED})
    admission.release_delegated(coord.plane, read_delegated)  # it is active, running: not freed
    assert coord.store.runs.running_ids(root.id) == {worker_id}


def test_a_repair_of_an_ended_task_frees_no_slot_once_a_retry_ran_it_again(coord: Coordinator) -> None:
    """A repair (the reconciler's, or a redelivered message's) read a child failed and still due; before it freed
    the child's slot, a retry made the child active and its new run took a slot: the free, checked in its own
    step against the status it read, leaves that slot (else a further child would be admitted beside the retried
    one, one past the tree's limit); a repair that reads the task again and finds it active does nothing."""
    two = Coordinator(coord.settings.model_copy(update={"max_running_per_root": 2, "max_running_per_parent": 2}))
    try:
        root = two.create_task("fan out")
        first, second, third = two.delegate(root.id, [subtask(n, agent(reply("x"))) for n in "abc"]).child_ids
        two.client.delete(QUEUE)
        lifecycle = build_runtime(two.settings, make_app(two.settings)).lifecycle
        runs = [lifecycle.start(first), lifecycle.start(second)]
        assert all(isinstance(run, Run) for run in runs) and not isinstance(lifecycle.start(third), Run)
        assert runs[0].end(Ended("failed", error="no way", error_class="X")).status == "failed"
        assert isinstance(lifecycle.start(third), Run), "the failed child's slot went to the third"
        assert runs[1].end(Ended("completed", summary="x")).status == "completed"
        read_failed = two.get_task(first)  # the repair's read
        assert two.retry(first).retried == [first]
        assert isinstance(lifecycle.start(first), Run), "the retried run takes the free slot"
        assert two.store.runs.running_ids(root.id) == {first, third}
        writeback.settle_ended(two.plane, read_failed)
        assert two.store.runs.running_ids(root.id) == {first, third}, "the retried run keeps its slot"
        writeback.settle_ended(two.plane, two.get_task(first))  # the reconciler's read after its look
        assert two.store.runs.running_ids(root.id) == {first, third}
        assert first in two.store.convergence.watched(), "still due, as the retry left it"
    finally:
        two.close()


def test_a_repair_frees_the_slot_of_a_task_a_retry_made_wait_on_its_children(limited: Coordinator) -> None:
    """A child's run died holding the tree's one slot and the task was failed (lost past its deliveries); before
    the repair freed the slot, a retry of its tree made it wait on its retried children (retry.lua's `wait`:
    `delegated`, on no due list). No run of it holds a slot while it waits, so the repair frees the dead run's,
    whether it read the task failed or reads it again delegated: left held, its children would wait for it for
    good."""
    coord = limited
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    for read_again in (False, True):
        root = coord.create_task("fan out")
        (worker_id,) = coord.delegate(root.id, [subtask("works", agent(reply("x")))]).child_ids
        coord.client.delete(QUEUE)
        assert isinstance(lifecycle.start(worker_id), Run), "it holds the tree's one slot"
        coord.store.runs.finish_task(worker_id, "failed", error="lost", error_class="WorkerLost")  # its run died
        read_failed = coord.get_task(worker_id)
        coord.client.hset(coord.store.keys.task(root.id, worker_id), "status", "delegated")  # the tree's retry
        writeback.settle_ended(coord.plane, coord.get_task(worker_id) if read_again else read_failed)
        assert coord.store.runs.running_ids(root.id) == set(), f"freed (read again: {read_again})"


def test_a_cancel_of_a_run_that_died_frees_its_slot_for_its_siblings(limited: Coordinator) -> None:
    """A child's run died (its lease lapsed) and is cancelled before the reconciler published it again: the stop
    takes it off the due list, where the reconciler would have freed its slot, so the stop frees it and
    admits the sibling that waited for it."""
    coord = limited
    root = coord.create_task("fan out")
    first, second = coord.delegate(root.id, [subtask(n, agent(reply("x"))) for n in ("a", "b")]).child_ids
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    assert isinstance(lifecycle.start(first), Run)
    assert not isinstance(lifecycle.start(second), Run), "it waits for the parent's one slot"
    coord.client.delete(coord.store.keys.lease(root.id, first))  # the run died
    coord.cancel(first, "stuck")
    assert coord.store.runs.running_ids(root.id) == {second}, "the dead run's slot went to its sibling"
    assert second in queued_ids(coord), "and its run was published"


def test_a_freed_slot_goes_past_a_waiting_task_that_was_stopped(limited: Coordinator) -> None:
    """Two children wait for the tree's one slot, and the first of them is cancelled while it waits: the freed
    slot goes to the second, and the stopped one leaves the list. Before, the slot went to the stopped task and
    its run was published to find it ended (a worker that died before that publish left the slot held by a task
    that had ended, and the tree's later children waiting for it for good)."""
    coord = limited
    root = coord.create_task("fan out")
    first, stopped, second = coord.delegate(root.id, [subtask(n, agent(reply("x"))) for n in ("a", "b", "c")]).child_ids
    coord.client.delete(QUEUE)
    lifecycle = build_runtime(coord.settings, make_app(coord.settings)).lifecycle
    assert isinstance(lifecycle.start(first), Run)
    assert not isinstance(lifecycle.start(stopped), Run) and not isinstance(lifecycle.start(second), Run)
    coord.cancel(stopped, "not needed")
    coord.client.delete(coord.store.keys.lease(root.id, first))  # the first's run died
    coord.cancel(first, "stuck")  # its slot is freed by the stop
    assert coord.store.runs.running_ids(root.id) == {second}, "the slot went to the task still waiting"
    assert queued_ids(coord) == [second]
    assert coord.client.lrange(coord.store.keys.admission(root.id), 0, -1) == [], "the stopped one left the list"


def test_a_stopped_runs_slot_is_freed_when_the_run_dies_as_the_stop_goes_on(
    limited: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child's run is live when a cancel stops it, so the stop leaves its tree slot for the run to free as it
    ends; the run dies just then, its lease lapsing before the stop's last step. The stop leaves a task whose run
    held its slot on the due list, so the reconciler frees the slot and the sibling waiting for it starts.
    Before, the stop's last step found no lease and took it off the list: the slot stayed held by a task that
    had ended, and its sibling waited for good."""
    coord = limited
    _, run, second = _one_slot_held_one_waiting(coord)
    first, root = run.task.id, run.task.root_id
    release_stopped = admission.release_stopped

    def then_the_run_dies(plane: Plane, stopped: list[TaskRecord]) -> set[str]:
        live = release_stopped(plane, stopped)
        coord.client.delete(coord.store.keys.lease(root, first))  # its lease lapses
        return live

    monkeypatch.setattr(admission, "release_stopped", then_the_run_dies)
    coord.cancel(first, "stuck")
    assert coord.store.runs.running_ids(root) == {first}, "its live run held the slot"
    assert first in coord.store.convergence.watched()
    assert tick(coord) == {"ended-not-written-back": 1}
    assert coord.store.runs.running_ids(root) == {second}, "the slot went to the sibling"
    assert queued_ids(coord) == [second]
    assert first not in coord.store.convergence.watched()


def test_a_waiting_task_started_with_room_leaves_the_admission_list(limited: Coordinator) -> None:
    """A child waits for the tree's one slot; its message comes again (its worker died before the ack) when there
    is room by a way that took nothing off the list (here: the running sets emptied by hand), and its run starts:
    it leaves the list as it takes the slot, so a freed slot later does not admit it a second time."""
    coord = limited
    lifecycle, _, waiting = _one_slot_held_one_waiting(coord)
    root = waiting[:16]
    assert coord.client.lrange(coord.store.keys.admission(root), 0, -1) == [waiting]
    coord.client.delete(coord.store.keys.running(root), coord.store.keys.running_children(root, root))
    assert isinstance(lifecycle.start(waiting), Run), "room: it runs"
    assert coord.client.lrange(coord.store.keys.admission(root), 0, -1) == [], "and left the list"


def test_a_parked_tasks_message_delivered_again_starts_no_run(coord: Coordinator) -> None:
    """Its worker died between the release and the message's ack, so the message comes again while the call
    still waits for its person: no run starts (it would cut the call off and ask for it again, and a decision
    on the first would resume nothing), and the decision's resume is what runs it."""
    task_id, (approval,) = _parked_on(coord, 1)
    task_key = coord.store.keys.task(task_id[:16], task_id)
    before = coord.client.hgetall(task_key)
    rt = build_runtime(coord.settings, make_app(coord.settings))
    assert run_child(rt, task_id).status == "waiting_approval"
    assert coord.client.hgetall(task_key) == before, "nothing counted, marked or started"
    assert [a.id for a in approvals.list_pending(coord.plane, task_id[:16])] == [approval]
    coord.decide(approval, "approve")
    assert queued_ids(coord) == [task_id], "the decision resumes it"


def test_children_a_single_pass_stop_missed_are_stopped_by_their_parents_release(coord: Coordinator) -> None:
    """A stop that read the subtree once (a coordinator of an earlier version, in a rolling upgrade) missed
    the children a delegation committed meanwhile: the delegating run's release stops them rather than leave
    them `active` with nothing to publish them, and closes their batch."""
    root = coord.create_task("fan out")
    (worker_id,) = coord.delegate(root.id, [subtask("works", agent(reply("x")))]).child_ids
    coord.client.delete(QUEUE)
    run = build_runtime(coord.settings, make_app(coord.settings)).lifecycle.start(worker_id)
    assert isinstance(run, Run)
    read_before = coord.store.records.subtree_ids(root.id)
    batch, children = delegation.commit(coord.plane, worker_id, [subtask("late", agent(reply("y")))], token=run.token)
    coord.store.batches.stop_tasks(
        read_before, top_status="cancelled", status="cancelled", top_error="cancelled: old", error="old",
        top_class="Cancelled", error_class="Cancelled",
    )  # fmt: skip
    assert coord.get_task(children[0].id).status == TaskStatus.ACTIVE, "missed by the single pass"
    run.end(Released("delegated"))
    assert coord.get_task(children[0].id).status == TaskStatus.CANCELLED
    assert queued_ids(coord) == [], "nothing published"
    assert coord.store.batches.get_batch(batch.id).status == "done", "its batch closed"
