"""The delegation pipeline end to end: real Redis, real `celery worker` processes.

Figures: one offline request of input 1000, output 500, cache_write 2000,
cache_read 10000, priced as anthropic claude-sonnet-4-5, is 13500 tokens
(tokens_in counts cache tokens) and 21000 micro-USD:
1000*3 + 500*15 + 2000*3.75 + 10000*0.30 per million = 0.021 USD.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from coordinator import Coordinator, Settings, TaskRecord, TaskStatus, TodoStatus, ids, service
from coordinator.celery_app import make_app
from tests.conftest import FAN_OUT_PROCESSES, dedicated_fleet
from tests.helpers import requests_sent, script, snapshot_of, usage_step
from workers.runtime.context import build_runtime

ONE_STEP_TOKENS = 13_500
ONE_STEP_COST_MICROS = 21_000
WAIT_S = 60


def _spec(n: int, todo_id: str | None = None, step: dict[str, object] | None = None) -> dict[str, object]:
    return {
        "description": f"child {n}",
        "message": script(step or usage_step(f"child {n} done")),
        "todo_id": todo_id,
    }


def test_three_parallel_children_write_back_onto_their_todos(coordinator: Coordinator) -> None:
    parent = coordinator.create_task("Plan and delegate", todos="[ ] T1\n[ ] T2\n[ ] T3\n[ ] T4")
    items = coordinator.get_todos(parent.id)
    batch = coordinator.delegate(parent.id, [_spec(n, items[n].id) for n in range(3)])

    done = coordinator.wait(parent.id, WAIT_S)

    assert done.status == TaskStatus.ACTIVE
    todos = coordinator.get_todos(parent.id)
    for n in range(3):
        assert todos[n].subtask_id == batch.child_ids[n]
        assert todos[n].tokens == ONE_STEP_TOKENS
        assert todos[n].cost_micros == ONE_STEP_COST_MICROS
        assert todos[n].status == TodoStatus.COMPLETED
    assert todos[3].subtask_id is None and todos[3].status == TodoStatus.PENDING
    assert done.total_cost_micros == done.cost_micros + 3 * ONE_STEP_COST_MICROS
    assert done.total_tokens == done.tokens + 3 * ONE_STEP_TOKENS
    results = [m for m in coordinator.messages(parent.id) if m.get("say") == "subtask_result"]
    assert len(results) == 1
    text = results[0]["text"]
    positions = [text.index(f"(task {cid}") for cid in batch.child_ids]
    assert positions == sorted(positions), "combined result is in dispatch order"
    assert coordinator.get_batch(batch.id).status == "done"
    for child in coordinator.get_children(parent.id):
        assert child.status == TaskStatus.COMPLETED
        assert (child.tokens_in, child.tokens_out) == (13_000, 500)
        assert (child.cache_writes, child.cache_reads) == (2000, 10_000)
        assert child.cost_micros == child.total_cost_micros == ONE_STEP_COST_MICROS
        assert "genai-prices" in child.cost_source


def test_a_failed_child_keeps_its_link_and_spend_and_the_parent_hears_why(coordinator: Coordinator) -> None:
    parent = coordinator.create_task("Delegate three", todos="[ ] A\n[ ] B\n[ ] C")
    specs = [
        _spec(0),
        _spec(1, step={"fail": "the provider rejected the request: context too long"}),
        _spec(2),
    ]
    batch = coordinator.delegate(parent.id, specs)
    done = coordinator.wait(parent.id, WAIT_S)

    assert done.status == TaskStatus.ACTIVE
    todos = coordinator.get_todos(parent.id)
    assert [t.subtask_id for t in todos] == batch.child_ids
    assert todos[0].status == todos[2].status == TodoStatus.COMPLETED
    assert todos[1].status == TodoStatus.IN_PROGRESS, "a failed child's item is not completed"
    assert todos[0].cost_micros == todos[2].cost_micros == ONE_STEP_COST_MICROS
    failed = coordinator.get_task(batch.child_ids[1])
    assert failed.status == TaskStatus.FAILED
    assert "context too long" in failed.error
    assert todos[1].cost_micros == failed.total_cost_micros  # whatever it spent (a failed request: nothing)
    text = coordinator.messages(parent.id)[-1]["text"]
    failed_lines = [line for line in text.splitlines() if "[failed]" in line]
    assert len(failed_lines) == 1
    assert "child 1" in failed_lines[0] and "context too long" in failed_lines[0]
    assert "Traceback" not in text
    assert done.total_cost_micros == 2 * ONE_STEP_COST_MICROS


def test_a_failed_child_that_spent_first_keeps_that_spend(coordinator: Coordinator) -> None:
    parent = coordinator.create_task("Delegate one", todos="[ ] only")
    spend = usage_step("thinking")
    step_then_fail = {"tool_calls": [{"name": "no_such_tool", "args": {}}], "usage": spend["usage"]}
    batch = coordinator.delegate(
        parent.id, [_spec(0, step=None) | {"message": script(step_then_fail, {"fail": "boom"})}]
    )
    done = coordinator.wait(parent.id, WAIT_S)
    child = coordinator.get_task(batch.child_ids[0])
    assert child.status == TaskStatus.FAILED
    assert child.cost_micros == ONE_STEP_COST_MICROS
    item = coordinator.get_todos(parent.id)[0]
    assert item.subtask_id == child.id and item.status != TodoStatus.COMPLETED
    assert item.cost_micros == ONE_STEP_COST_MICROS
    assert done.total_cost_micros == ONE_STEP_COST_MICROS


@pytest.fixture(scope="module")
def fan_out_fleet(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """Fifty children finishing at once on four worker processes, on a queue of their own."""
    log_dir = tmp_path_factory.mktemp("fan-out")
    with dedicated_fleet(settings, log_dir, FAN_OUT_PROCESSES, queue="subq-fan-out") as (coord, _fleet):
        yield coord


def test_fifty_children_at_once_nothing_lost_nothing_doubled(fan_out_fleet: Coordinator) -> None:
    coordinator = fan_out_fleet
    width = 50
    parent = coordinator.create_task("Fan out", todos="\n".join(f"[ ] item {n}" for n in range(width)))
    batch = coordinator.delegate(parent.id, [_spec(n) for n in range(width)])
    done = coordinator.wait(parent.id, WAIT_S * 2)

    todos = coordinator.get_todos(parent.id)
    assert [t.subtask_id for t in todos] == batch.child_ids
    assert all(t.tokens == ONE_STEP_TOKENS and t.cost_micros == ONE_STEP_COST_MICROS for t in todos)
    assert all(t.status == TodoStatus.COMPLETED for t in todos)
    assert done.total_cost_micros == width * ONE_STEP_COST_MICROS
    assert done.total_tokens == width * ONE_STEP_TOKENS
    runs = {coordinator.store.records.task_field(c, "run_seq") for c in batch.child_ids}
    assert runs == {"1"}, "each child ran exactly once"

    # A duplicated chord callback (the same function the worker runs) changes nothing.
    before = snapshot_of(coordinator, parent.root_id)
    rt = build_runtime(coordinator.settings, make_app(coordinator.settings))
    assert rt.lifecycle.settle_batch(batch.id) is False
    assert snapshot_of(coordinator, parent.root_id) == before


def test_sequential_chain_stops_at_a_failed_step(coordinator: Coordinator) -> None:
    parent = coordinator.create_task("Step by step", todos="[ ] one\n[ ] two\n[ ] three")
    specs = [_spec(0), _spec(1, step={"fail": "step two broke"}), _spec(2)]
    batch = coordinator.delegate(parent.id, specs, mode="sequential")
    done = coordinator.wait(parent.id, WAIT_S)

    assert done.status == TaskStatus.ACTIVE
    first, second, third = (coordinator.get_task(c) for c in batch.child_ids)
    assert (first.status, second.status, third.status) == (
        TaskStatus.COMPLETED,
        TaskStatus.FAILED,
        TaskStatus.CANCELLED,
    )
    assert "step 2" in third.error and third.requests == 0
    todos = coordinator.get_todos(parent.id)
    assert [t.subtask_id for t in todos] == batch.child_ids
    assert [t.status for t in todos] == [TodoStatus.COMPLETED, TodoStatus.IN_PROGRESS, TodoStatus.IN_PROGRESS]
    assert todos[0].cost_micros == ONE_STEP_COST_MICROS and todos[2].cost_micros == 0
    text = coordinator.messages(parent.id)[-1]["text"]
    assert "[cancelled] child 2" in text and "step two broke" in text


def test_sequential_children_write_back_one_by_one(coordinator: Coordinator) -> None:
    parent = coordinator.create_task("Two steps", todos="[-] first\n[ ] second")
    batch = coordinator.delegate(parent.id, [_spec(0), _spec(1)], mode="sequential")
    done = coordinator.wait(parent.id, WAIT_S)
    todos = coordinator.get_todos(parent.id)
    assert [t.subtask_id for t in todos] == batch.child_ids  # in_progress first, then pending
    assert all(t.cost_micros == ONE_STEP_COST_MICROS and t.status == TodoStatus.COMPLETED for t in todos)
    assert done.total_cost_micros == 2 * ONE_STEP_COST_MICROS
    first, second = (coordinator.get_task(c) for c in batch.child_ids)
    assert first.finished_at is not None and second.finished_at is not None
    assert first.finished_at <= second.created_at + 60 and first.finished_at <= second.finished_at


def test_a_child_without_a_todo_candidate_gets_a_new_item(coordinator: Coordinator) -> None:
    parent = coordinator.create_task("No plan yet")
    batch = coordinator.delegate(parent.id, [_spec(0)])
    coordinator.wait(parent.id, WAIT_S)
    (item,) = coordinator.get_todos(parent.id)
    assert item.content == "child 0" and item.subtask_id == batch.child_ids[0]
    assert item.status == TodoStatus.COMPLETED and item.cost_micros == ONE_STEP_COST_MICROS


def test_a_parent_can_delegate_again_after_resuming(coordinator: Coordinator) -> None:
    parent = coordinator.create_task("Twice", todos="[ ] a\n[ ] b")
    coordinator.delegate(parent.id, [_spec(0)])
    coordinator.wait(parent.id, WAIT_S)
    coordinator.delegate(parent.id, [_spec(1)], mode="sequential")
    done = coordinator.wait(parent.id, WAIT_S)
    assert [t.status for t in coordinator.get_todos(parent.id)] == [TodoStatus.COMPLETED] * 2
    assert done.total_cost_micros == 2 * ONE_STEP_COST_MICROS
    assert len([m for m in coordinator.messages(parent.id) if m["say"] == "subtask_result"]) == 2


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_wait_times_out_with_a_clear_error(idle_coordinator: Coordinator, mode: str) -> None:
    from coordinator import WaitTimeout

    parent = idle_coordinator.create_task("Nobody will run this")
    idle_coordinator.delegate(parent.id, [_spec(0)], mode=mode)
    with pytest.raises(WaitTimeout, match=r"still delegated after 0.2s \(1 of 1 children outstanding\)"):
        idle_coordinator.wait(parent.id, 0.2)


def _wait_in_thread(coord: Coordinator, task_id: str) -> tuple[threading.Thread, list[object]]:
    """`coord.wait(task_id)` on a thread named `waiter`, its record or error put in the list it returns."""
    got: list[object] = []

    def waiter() -> None:
        try:
            got.append(coord.wait(task_id, 600))
        except Exception as exc:  # the test reads it
            got.append(exc)

    thread = threading.Thread(target=waiter, name="waiter", daemon=True)
    thread.start()
    return thread, got


def _listening(coord: Coordinator, task_id: str) -> None:
    """Until a waiter listens on the task's channel: a steady state, read from the server."""
    channel = coord.store.keys.settled(ids.root_of(task_id), task_id)
    until_s = time.monotonic() + WAIT_S
    while dict(coord.client.pubsub_numsub(channel)).get(channel, 0) < 1:
        assert time.monotonic() < until_s, "the waiter never subscribed"
        time.sleep(0.01)


@pytest.mark.parametrize("waits_on", ["the caller's parent", "a child"])
def test_wait_wakes_as_its_task_settles_and_reads_none_of_the_trees_events(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch, waits_on: str
) -> None:
    """A waiter listens on its task's channel, which the step that settles the task announces on: it returns
    without a slice's re-read of the status (here ten minutes long, against the minute the test waits) and
    sends the same few commands whatever the tree's width: it reads none of the events its children add."""
    monkeypatch.setattr(service, "WAIT_SLICE_MS", 600_000)
    parent = coordinator.create_task("Wait on me", todos="\n".join(f"[ ] t{n}" for n in range(20)))
    sent = requests_sent(monkeypatch, "waiter")
    batch = coordinator.delegate(parent.id, [_spec(n) for n in range(20)])
    task_id = parent.id if waits_on == "the caller's parent" else batch.child_ids[-1]
    sent.clear()
    thread, got = _wait_in_thread(coordinator, task_id)
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the wait did not wake when its task settled"
    (record,) = got
    assert isinstance(record, TaskRecord), record
    assert record.status == (TaskStatus.ACTIVE if waits_on == "the caller's parent" else TaskStatus.COMPLETED)
    # Its subscription (its connection's handshake), its status read before the wake-up and after it (one,
    # if the task had settled already), its record: the same at any width, and no read of the tree's events.
    assert sent[0] == "SUBSCRIBE" and not {"XREAD", "XREVRANGE"} & set(sent), sent
    assert sent.count("HMGET") <= 2 and len(sent) <= 10, sent


def test_a_waiter_whose_connection_drops_listens_again_and_wakes(
    idle_coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server drops the waiter's subscription (a failover, a restart): it subscribes again, and the cancel
    that comes after wakes it; until then it reads the status no more often than its pause allows."""
    monkeypatch.setattr(service, "WAIT_SLICE_MS", 600_000)
    parent = idle_coordinator.create_task("Nobody runs this")
    idle_coordinator.delegate(parent.id, [_spec(0)])
    thread, got = _wait_in_thread(idle_coordinator, parent.id)
    _listening(idle_coordinator, parent.id)
    assert idle_coordinator.client.client_kill_filter(_type="pubsub") >= 1
    _listening(idle_coordinator, parent.id)
    idle_coordinator.cancel(parent.id, "no longer needed")
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the wait did not wake when its task was cancelled"
    (record,) = got
    assert isinstance(record, TaskRecord) and record.status == TaskStatus.CANCELLED, record


def test_the_steps_that_settle_a_task_announce_it_on_its_channel(idle_coordinator: Coordinator) -> None:
    """finish_task (a child's end, here a child failed by hand) and stop_tasks (a cancel) publish on the
    settled task's channel, in the order they ran; a live status change publishes nothing. (finish_batch, a
    batch's close, wakes the caller's parent in the test above.)"""
    coord = idle_coordinator
    parent = coord.create_task("Announce")
    first, second = coord.delegate(parent.id, [_spec(0), _spec(1)]).child_ids
    channels = {coord.store.keys.settled(parent.root_id, task): name for task, name in
                ((parent.id, "parent"), (first, "first"), (second, "second"))}  # fmt: skip
    pubsub = coord.client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(*channels)

    def heard(count: int) -> list[str]:
        names: list[str] = []
        until_s = time.monotonic() + WAIT_S
        while len(names) < count and (left_s := until_s - time.monotonic()) > 0:
            if (message := pubsub.get_message(timeout=left_s)) is not None:
                assert message["data"] in (b"", ""), message
                names.append(channels[message["channel"]])
        return names

    try:
        # A message for `second` before `first`'s would say that its live status announced it.
        coord.store.events.set_live(coord.get_task(second), "running")
        coord.store.runs.finish_task(first, "failed", error="by hand")
        assert heard(1) == ["first"]
        coord.cancel(parent.id, "stop")
        assert sorted(heard(2)) == ["parent", "second"]
    finally:
        pubsub.close()


def test_a_waiter_refused_its_channel_by_an_acl_still_returns_on_its_own_reads(
    idle_coordinator: Coordinator, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ACL user with no channel access (`resetchannels`): its SUBSCRIBE is refused (NOPERM), and the wait
    falls back on its once-a-second reads of the status rather than failing or spinning."""
    admin = idle_coordinator.client
    admin.execute_command("ACL", "SETUSER", "nochannels", "on", ">nochannels-pw", "~*", "+@all", "resetchannels")
    settings = idle_coordinator.settings
    restricted_url = "redis://nochannels:nochannels-pw@" + redis_url.split("@", 1)[1]
    restricted = Coordinator(settings.model_copy(update={"redis_url": restricted_url}))
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            restricted.client.publish(restricted.store.keys.settled("r", "t"), "")  # the ACL does refuse it
        parent = restricted.create_task("Nobody runs this")
        restricted.delegate(parent.id, [_spec(0)])
        sent = requests_sent(monkeypatch, "waiter")
        thread, got = _wait_in_thread(restricted, parent.id)
        until_s = time.monotonic() + WAIT_S
        while sent.count("HMGET") < 2:  # it read the status, was refused, and read it again: it is in its loop
            assert thread.is_alive() and time.monotonic() < until_s, (got, sent)
            time.sleep(0.01)
        idle_coordinator.cancel(parent.id, "no longer needed")
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the wait did not return"
        (record,) = got
        assert isinstance(record, TaskRecord) and record.status == TaskStatus.CANCELLED, record
    finally:
        restricted.close()
        admin.execute_command("ACL", "DELUSER", "nochannels")
