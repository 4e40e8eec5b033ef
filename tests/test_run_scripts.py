"""What a run's scripts read and write, command by command, on a real Redis (MONITOR).

A child's end touches its own record and its parent's from several of the scripts it
composes (usage, finish, write-back, close); each record is read once and written once
(lua/hashes.lua). The records a delegation writes carry what the run's scripts would
otherwise look up per child: the batch's mode, the ancestors with a budget, the history
number, and the batch lines hash with its retention.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from coordinator import Coordinator, TaskStatus
from coordinator.celery_app import make_app
from coordinator.errors import SubqError
from coordinator.models import AdmissionLimits
from coordinator.store.fields import BatchField, TaskField
from tests.agents import STEP_COST_MICROS, agent, reply
from tests.helpers import delegate_as_its_run
from workers.runtime.context import Runtime, build_runtime
from workers.runtime.runner import run_child


@pytest.fixture
def rt(idle_coordinator: Coordinator) -> Iterator[Runtime]:
    runtime = build_runtime(idle_coordinator.settings, make_app(idle_coordinator.settings))
    yield runtime
    runtime.coordinator.close()


@contextmanager
def monitored(redis_url: str) -> Iterator[list[list[str]]]:
    """Every command the server runs meanwhile (those inside Lua included), as argument lists."""
    commands: list[list[str]] = []
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    stop = threading.Event()
    ready = threading.Event()

    def listen() -> None:
        with client.monitor() as monitor:
            ready.set()
            for entry in monitor.listen():
                if stop.is_set():
                    return
                commands.append(entry["command"].split())

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    assert ready.wait(5)
    time.sleep(0.1)
    try:
        yield commands
    finally:
        time.sleep(0.1)
        stop.set()
        redis.Redis.from_url(redis_url).ping()  # one more command wakes the listener
        thread.join(5)
        client.close()


def on(commands: list[list[str]], key: str) -> list[str]:
    """The names of the commands run on `key`, in order."""
    return [c[0].upper() for c in commands if len(c) > 1 and c[1] == key]


def test_a_childs_end_reads_and_writes_its_record_and_its_parents_once(
    idle_coordinator: Coordinator, rt: Runtime
) -> None:
    coord = idle_coordinator
    parent = coord.create_task("two children", todos="[ ] a\n[ ] b")
    batch = coord.delegate(parent.id, [{"description": d, "message": agent(reply(f"{d} done"))} for d in "ab"])
    first, last = batch.child_ids
    keys = coord.store.keys
    child_key, parent_key = keys.task(parent.root_id, last), keys.task(parent.root_id, parent.id)
    with monitored(coord.settings.redis_url) as commands:
        assert run_child(rt, first).status == "completed"  # not its batch's last: it closes nothing
    assert on(commands, parent_key) == ["HMGET", "HSET"], "usage and write-back: one read, one write"

    with monitored(coord.settings.redis_url) as commands:
        result = run_child(rt, last)  # the last child: its end closes the batch too

    assert result.status == "completed" and result.cost_micros == STEP_COST_MICROS
    # The start reads what it decides on and counts, then the record is read in its transaction (not in Lua).
    assert on(commands, child_key) == ["HMGET", "HSET", "HGETALL", "HMGET", "HSET", "EXPIRE"], "start; end: once"
    # The fields only a batch's closer reads (close_batch's) are read by it alone, not prefetched by every child.
    assert on(commands, parent_key) == ["HMGET", "HMGET", "HSET", "EXPIRE"], "usage, write-back and close: one write"
    assert on(commands, keys.batch(parent.root_id, batch.id)) == ["HMGET", "HSET", "EXPIRE"], "the close, once"
    # ... and those writes are what the separate steps would have written.
    record = coord.get_task(parent.id)
    assert record.status == TaskStatus.ACTIVE and record.completed_by_child_id == last
    assert coord.store.records.task_field(parent.id, TaskField.RESUMES) == "1"
    assert record.total_cost_micros == 2 * STEP_COST_MICROS
    assert [(i.status.value, i.cost_micros) for i in coord.get_todos(parent.id)] == [
        ("completed", STEP_COST_MICROS)
    ] * 2
    assert coord.store.records.task_field(parent.id, TaskField.TODOS_VERSION) == "3", "delegation, then one per child"


def test_a_child_whose_record_does_not_name_its_batch_mode_is_still_written_back(
    idle_coordinator: Coordinator, rt: Runtime
) -> None:
    """A child delegated by an older version has no `batch_mode`: its end reads the batch's."""
    coord = idle_coordinator
    parent = coord.create_task("one child", todos="[ ] a")
    (child_id,) = coord.delegate(parent.id, [{"description": "a", "message": agent(reply("done"))}]).child_ids
    child_key = coord.store.keys.task(parent.root_id, child_id)
    assert coord.client.hget(child_key, TaskField.BATCH_MODE) == "parallel"
    coord.client.hdel(child_key, TaskField.BATCH_MODE)

    assert run_child(rt, child_id).status == "completed"

    assert coord.get_todos(parent.id)[0].status.value == "completed"
    assert coord.get_task(parent.id).status == TaskStatus.ACTIVE, "the batch closed"


def test_a_run_reads_only_the_ancestors_with_a_budget(idle_coordinator: Coordinator, rt: Runtime) -> None:
    coord = idle_coordinator
    root = coord.create_task("a budget on top", todos="[ ] a", budget_usd=1.0)
    (middle,) = coord.delegate(root.id, [{"description": "a", "message": agent(reply("x"))}]).child_ids
    coord.update_todos(middle, "[ ] b")
    (leaf,) = delegate_as_its_run(coord, middle, [{"description": "b", "message": agent(reply("leaf done"))}]).child_ids
    keys = coord.store.keys
    leaf_key = keys.task(root.root_id, leaf)
    assert json.loads(coord.client.hget(leaf_key, TaskField.BUDGET_CHAIN) or "") == [root.id]
    # The top's budget is spent: the leaf's start finds it from its chain, without reading the middle.
    coord.client.hset(keys.task(root.root_id, root.id), TaskField.TOTAL_COST_MICROS, 1_000_000)

    with monitored(coord.settings.redis_url) as commands:
        started = coord.store.runs.begin_run(leaf, "token-1", 60, 30, AdmissionLimits())

    assert started.verdict == "run" and started.exhausted == root.id
    assert on(commands, keys.task(root.root_id, middle)) == [], "an ancestor without a budget is not read"
    coord.store.runs.release_lease(leaf, "token-1")

    # A record written before the chain was kept reads every ancestor, and finds the same.
    coord.client.hdel(leaf_key, TaskField.BUDGET_CHAIN)
    assert coord.store.runs.begin_run(leaf, "token-2", 60, 30, AdmissionLimits()).exhausted == root.id


def test_a_childs_budget_joins_the_chain_of_its_children(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    root = coord.create_task("no budget on top", todos="[ ] a")
    spec = {"description": "a", "message": agent(reply("x")), "budget_usd": 0.5}
    (middle,) = coord.delegate(root.id, [spec]).child_ids
    coord.update_todos(middle, "[ ] b")
    (leaf,) = delegate_as_its_run(coord, middle, [{"description": "b", "message": agent(reply("y"))}]).child_ids

    chain = coord.client.hget(coord.store.keys.task(root.root_id, leaf), TaskField.BUDGET_CHAIN)
    assert json.loads(chain or "") == [middle]
    assert (
        json.loads(coord.client.hget(coord.store.keys.task(root.root_id, middle), TaskField.BUDGET_CHAIN) or "") == []
    )


def test_a_batchs_lines_have_their_retention_from_the_delegation_and_the_close_refreshes_the_plan(
    idle_coordinator: Coordinator, rt: Runtime
) -> None:
    coord = idle_coordinator
    retention_s = coord.settings.result_retention_s
    parent = coord.create_task("two children", todos="[ ] a\n[ ] b")
    batch = coord.delegate(parent.id, [{"description": d, "message": agent(reply(f"{d} done"))} for d in "ab"])
    keys = coord.store.keys
    lines, todos = keys.batch_lines(parent.root_id, batch.id), keys.todos(parent.root_id, parent.id)
    assert coord.client.hget(lines, BatchField.LINES_OWNER) == batch.id
    assert retention_s - 5 <= coord.client.ttl(lines) <= retention_s, "a retention before any child writes a line"

    run_child(rt, batch.child_ids[0])
    coord.client.expire(todos, 100)
    coord.client.expire(lines, 100)
    run_child(rt, batch.child_ids[1])  # the last: it closes the batch

    assert coord.client.ttl(todos) > 100 and coord.client.ttl(lines) > 100, "the close refreshed both"
    result = coord.get_batch(batch.id).result or ""
    assert result.startswith("Subtask results (parallel, 2 of 2 completed):") and "~batch" not in result
    assert len(result.splitlines()) == 3, "one line a child, none for the lines hash's own field"


def test_children_get_their_history_numbers_with_their_records(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    parent = coord.create_task("three children", todos="[ ] a\n[ ] b\n[ ] c")
    batch = coord.delegate(parent.id, [{"description": d, "message": agent(reply("x"))} for d in "abc"])

    numbers = [coord.get_task(child_id).number for child_id in batch.child_ids]
    assert numbers == [parent.number + 1, parent.number + 2, parent.number + 3]


def test_a_refused_delegation_takes_no_history_number(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    parent = coord.create_task("a small budget", todos="[ ] a", budget_usd=0.01)
    counter = coord.client.get(coord.store.keys.task_number())

    with pytest.raises(SubqError, match="budget"):
        coord.delegate(parent.id, [{"description": "a", "message": agent(reply("x")), "budget_usd": 5}])

    assert coord.client.get(coord.store.keys.task_number()) == counter
