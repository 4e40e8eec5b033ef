"""The Redis store on a real Redis: atomic roll-up, idempotent write-back, no lost update.

These tests drive the store directly (the same functions the workers call)
from many threads at once, so a read-modify-write that is not atomic loses
updates here.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

import pytest

from coordinator import Coordinator, CorruptError, NotFoundError, Settings, StoreError, TodoStatus, Usage
from coordinator.models import AdmissionLimits, TaskRecord
from coordinator.replies import UsageRecorded
from coordinator.store import Store
from coordinator.store.runs import Started
from tests.helpers import delegate_as_its_run, script, snapshot_of, usage_step

THREADS = 8


def _run_threads(count: int, work: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def guarded(n: int) -> None:
        try:
            work(n)
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def _tree(coord: Coordinator) -> tuple[TaskRecord, TaskRecord, TaskRecord]:
    """root -> child -> grandchild, with nothing run (the queue has no worker)."""
    root = coord.create_task("root", todos="[ ] a")
    (child_id,) = coord.delegate(root.id, [{"description": "child", "message": "work"}]).child_ids
    (grandchild_id,) = delegate_as_its_run(
        coord, child_id, [{"description": "grandchild", "message": "work"}]
    ).child_ids
    return coord.get_task(root.id), coord.get_task(child_id), coord.get_task(grandchild_id)


def test_usage_rolls_up_every_ancestor_exactly_under_concurrency(idle_coordinator: Coordinator) -> None:
    root, child, grandchild = _tree(idle_coordinator)
    store = idle_coordinator.store
    per_thread = 50
    usage = Usage(tokens_in=130, tokens_out=5, cache_reads=100, cache_writes=20)

    def record(n: int) -> None:
        for i in range(per_thread):
            task = grandchild if i % 2 else child
            assert store.runs.record_usage(task.id, f"t{n}:{i}", usage, 210, "test") == UsageRecorded(1, None)

    _run_threads(THREADS, record)
    # Every request key again: nothing is counted twice.
    for n in range(THREADS):
        for i in range(per_thread):
            task = grandchild if i % 2 else child
            assert store.runs.record_usage(task.id, f"t{n}:{i}", usage, 210, "test") == UsageRecorded(0, None)

    half = THREADS * per_thread // 2
    g, c, r = (idle_coordinator.get_task(t.id) for t in (grandchild, child, root))
    assert (g.requests, g.cost_micros, g.total_cost_micros) == (half, half * 210, half * 210)
    assert (g.tokens_in, g.tokens_out, g.cache_reads, g.cache_writes) == (half * 130, half * 5, half * 100, half * 20)
    assert (c.cost_micros, c.total_cost_micros) == (half * 210, 2 * half * 210)
    assert (r.cost_micros, r.total_cost_micros, r.total_tokens) == (0, 2 * half * 210, 2 * half * 135)


def test_write_back_and_todo_rewrites_at_once_lose_nothing(idle_coordinator: Coordinator) -> None:
    width = 24
    coord, store = idle_coordinator, idle_coordinator.store
    parent = coord.create_task("p", todos="\n".join(f"[ ] item {n}" for n in range(width)))
    batch = coord.delegate(parent.id, [{"description": f"c{n}", "message": "m"} for n in range(width)])
    for n, child_id in enumerate(batch.child_ids):
        store.runs.record_usage(child_id, "1:1", Usage(tokens_in=n + 1, tokens_out=1), 1000 + n, "test")
        store.runs.finish_task(child_id, "completed", summary=f"done {n}")

    def work(n: int) -> None:
        if n % 2:
            for child_id in batch.child_ids[n::THREADS]:
                store.batches.apply_children(batch, [child_id])
        else:
            for round_ in range(10):  # the parent's agent rewrites its plan meanwhile
                mark = "[-]" if round_ % 2 else "[ ]"
                coord.update_todos(parent.id, "\n".join(f"{mark} item {k}" for k in range(width)))

    _run_threads(THREADS, work)
    store.batches.apply_children(batch, batch.child_ids)  # children no odd thread covered
    todos = coord.get_todos(parent.id)
    assert [t.subtask_id for t in todos] == batch.child_ids
    assert [t.cost_micros for t in todos] == [1000 + n for n in range(width)]
    assert [t.tokens for t in todos] == [n + 2 for n in range(width)]
    assert coord.get_task(parent.id).awaiting_ids == []


def test_write_back_is_idempotent_and_terminal_status_is_first_wins(idle_coordinator: Coordinator) -> None:
    coord, store = idle_coordinator, idle_coordinator.store
    parent = coord.create_task("p", todos="[ ] a")
    batch = coord.delegate(parent.id, [{"description": "c", "message": "m"}])
    (child_id,) = batch.child_ids
    assert store.batches.apply_children(batch, [child_id]) == 0, "a child that has not ended is not written back"
    store.runs.record_usage(child_id, "1:1", Usage(tokens_in=10, tokens_out=2), 77, "test")
    assert store.runs.finish_task(child_id, "failed", error="first", error_class="X") == "failed"
    assert store.runs.finish_task(child_id, "completed", summary="second") == "failed"

    assert store.batches.apply_children(batch, [child_id]) == 1
    after_first = snapshot_of(coord, parent.root_id)
    assert store.batches.apply_children(batch, [child_id]) == 0
    assert snapshot_of(coord, parent.root_id) == after_first
    (item,) = coord.get_todos(parent.id)
    assert (item.subtask_id, item.tokens, item.cost_micros) == (child_id, 12, 77)
    assert item.status == TodoStatus.IN_PROGRESS


def test_corrupt_entries_read_as_clear_errors(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    task = coord.create_task("p", todos="[ ] a")
    keys = coord.store.keys
    coord.client.hset(keys.todos(task.root_id, task.id), "order", "{not json")
    with pytest.raises(CorruptError, match="The stored todo list has no readable order"):
        coord.get_todos(task.id)
    coord.client.hset(keys.todos(task.root_id, task.id), "order", '["missing-id"]')
    with pytest.raises(CorruptError, match="lacks item missing-id"):
        coord.get_todos(task.id)
    coord.client.rpush(keys.ui_messages(task.root_id, task.id), "{broken")
    with pytest.raises(CorruptError, match=f"UI message 0 of task {task.id} is corrupt"):
        coord.messages(task.id)
    coord.client.hset(keys.task(task.root_id, task.id), "status", "weird")
    try:
        # In one line, naming the field and what is wrong (a log's line: the reconciler warns with it each grace).
        with pytest.raises(CorruptError) as raised:
            coord.get_task(task.id)
        assert str(raised.value) == (
            f"Task record {task.id} is corrupt: status: Input should be 'active', 'delegated', 'completed', 'failed' "
            "or 'cancelled'"
        )
        for field, value in (("status", "active"), ("depth", "deep")):  # a number that is none reads so too
            coord.client.hset(keys.task(task.root_id, task.id), field, value)
        with pytest.raises(CorruptError, match=f"Task record {task.id} is corrupt: invalid literal for int"):
            coord.get_task(task.id)
    finally:  # a corrupt record left behind would (rightly) break other tests' history listings
        coord.client.delete(*[key for key in coord.store.metrics.snapshot() if f"{{{task.root_id}}}" in key])
        coord.client.zrem(keys.all_tasks(), task.id)
        coord.client.zrem(keys.roots(), task.id)


def test_unknown_ids_and_unreachable_redis(idle_coordinator: Coordinator, settings: Settings) -> None:
    with pytest.raises(NotFoundError, match="Unknown task: 0123456789abcdef"):
        idle_coordinator.get_task("0123456789abcdef")
    with pytest.raises(NotFoundError, match="Unknown batch"):
        idle_coordinator.get_batch("0123456789abcdef-b0123456789ab")
    nowhere = Coordinator(settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"}))
    with pytest.raises(StoreError, match="Redis is unreachable"):
        nowhere.get_task("0123456789abcdef")


def test_keys_live_under_one_hash_tag_per_tree(idle_coordinator: Coordinator) -> None:
    root, _, _ = _tree(idle_coordinator)
    tree_keys = [k for k in idle_coordinator.store.metrics.snapshot() if root.root_id in k]
    prefix = idle_coordinator.settings.key_prefix
    assert tree_keys and all(k.startswith(f"{prefix}:{{{root.root_id}}}:") for k in tree_keys)
    ttls = [idle_coordinator.client.ttl(k) for k in tree_keys]
    assert all(0 < ttl <= idle_coordinator.settings.result_retention_s for ttl in ttls), "every tree key expires"


def test_a_delegation_commits_its_childrens_queued_live_status_with_them(
    idle_coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process dies right after the commit (a SUBQ_FAULT_CRASH_AT point, raised here instead of SIGKILL):
    # what the commit wrote is all there is, and every child it wrote has its live status and its event.
    coord = idle_coordinator

    def die(_settings: Settings, name: str) -> None:
        if name == "after-commit":
            raise SystemExit("died after the commit")

    monkeypatch.setattr("coordinator.delegation.faults.crash_point", die)
    root = coord.create_task("root", todos="[ ] a\n[ ] b\n[ ] c")
    with pytest.raises(SystemExit):
        coord.delegate(root.id, [{"description": d, "message": "work"} for d in "abc"])
    children = coord.get_children(root.id)
    assert len(children) == 3
    live = coord.store.events.live(root.id)
    assert {c.id: live[c.id]["state"] for c in children} == dict.fromkeys((c.id for c in children), "queued")
    events = [fields for _, fields in coord.store.events.read_events(root.id)]
    queued = [e["task_id"] for e in events if e["type"] == "live" and e["state"] == "queued"]
    assert queued == [c.id for c in children], "one `queued` event a child, in dispatch order"
    delegated = next(n for n, e in enumerate(events) if e["type"] == "delegated")
    assert all(n > delegated for n, e in enumerate(events) if e["type"] == "live"), "after the delegation's event"


def test_a_new_record_leaves_what_its_runs_write_out_and_reads_it_as_its_default(
    idle_coordinator: Coordinator,
) -> None:
    coord = idle_coordinator
    _, _, child = _tree(coord)  # the grandchild: it delegated nothing
    raw = coord.store.records.task_fields(child.id)
    left_out = {"tokens_in", "cost_micros", "requests", "summary", "error", "error_class", "finished_at", "output",
                "retries", "waiting_batch_id", "tool_use", "waiting_for"}  # fmt: skip
    assert not left_out & set(raw), sorted(left_out & set(raw))
    assert {"id", "status", "prompt", "total_tokens", "total_cost_micros", "tenant", "priority"} <= set(raw)
    assert child.tokens_in == child.cost_micros == child.requests == child.retries == 0
    assert child.summary == child.error == "" and child.finished_at is None and child.output is None
    # What a run writes reads back as written: one request's usage, then its end.
    usage = Usage(tokens_in=130, tokens_out=5)
    assert coord.store.runs.record_usage(child.id, "r1:1", usage, 210, "test") == UsageRecorded(1, None)
    coord.store.runs.finish_task(child.id, "completed", summary="done")
    ended = coord.get_task(child.id)
    assert (ended.status.value, ended.summary, ended.requests) == ("completed", "done", 1)
    assert (ended.tokens_in, ended.cost_micros, ended.total_cost_micros) == (130, 210, 210)
    assert ended.finished_at is not None


def test_a_script_with_bad_json_fails_the_child_with_a_clear_error(coordinator: Coordinator) -> None:
    parent = coordinator.create_task("p", todos="[ ] a")
    bad = 'Do it.\n\n```subq-script\n{"steps": [\n```\n'
    batch = coordinator.delegate(parent.id, [{"description": "bad script", "message": bad}, {
        "description": "good", "message": script(usage_step())}])  # fmt: skip
    coordinator.wait(parent.id, 60)
    broken = coordinator.get_task(batch.child_ids[0])
    assert broken.status.value == "failed" and broken.error_class == "ScriptError"
    assert "subq-script block is not valid JSON" in broken.error
    assert coordinator.get_task(batch.child_ids[1]).status.value == "completed"


def start(store: Store, task_id: str, limits: AdmissionLimits) -> Started:
    """A run's start (start_run.lua), as a worker makes it, under admission `limits`."""
    return store.runs.begin_run(task_id, secrets.token_hex(4), 60, 30, limits)


def test_admission_limits_a_tree_and_starts_the_waiting_in_order(idle_coordinator: Coordinator) -> None:
    coord, store = idle_coordinator, idle_coordinator.store
    root = coord.create_task("root")
    a, b = coord.delegate(root.id, [{"description": d, "message": "m"} for d in "ab"]).child_ids
    a1, a2, b1 = (
        *delegate_as_its_run(coord, a, [{"description": d, "message": "m"} for d in ("a1", "a2")]).child_ids,
        *delegate_as_its_run(coord, b, [{"description": "b1", "message": "m"}]).child_ids,
    )
    limits = AdmissionLimits(per_tree=2)
    verdicts = [start(store, t, limits).verdict for t in (a1, a2, b1)]
    assert verdicts == ["run", "run", "wait"], "two tasks of the tree run at once"
    assert start(store, a1, limits).verdict == "leased", "admitted already (idempotent): only its lease is taken"
    assert store.runs.release_slot(coord.get_task(a1), limits) == [b1], "the first waiting one starts"
    assert store.runs.in_flight(root.id)["running"] == 2 and store.runs.in_flight(root.id)["admission"] == 0


def test_admission_limits_children_of_one_parent(idle_coordinator: Coordinator) -> None:
    coord, store = idle_coordinator, idle_coordinator.store
    root = coord.create_task("root")
    children = coord.delegate(root.id, [{"description": f"c{n}", "message": "m"} for n in range(3)]).child_ids
    records = [coord.get_task(c) for c in children]
    limits = AdmissionLimits(per_parent=1)
    assert [start(store, c, limits).verdict for c in children] == ["run", "wait", "wait"]
    assert store.runs.release_slot(records[0], limits) == [children[1]]
    assert store.runs.release_slot(records[1], limits) == [children[2]]


class HandClock:
    """The store's clock (coordinator/store/runs.py reads `time.time()` for a start's `now`), moved by hand: a
    stagger's window is then exact, whatever the host's load between two calls. It starts on a whole second and
    moves by binary fractions (1/8 s), so each `int(now * 1000)` is exact."""

    def __init__(self) -> None:
        self.now_s = float(int(time.time()))

    def time(self) -> float:
        return self.now_s

    def time_ns(self) -> int:
        return int(self.now_s * 1e9)

    def advance(self, span_s: float) -> None:
        self.now_s += span_s


@pytest.fixture
def hand_clock(monkeypatch: pytest.MonkeyPatch) -> HandClock:
    clock = HandClock()
    monkeypatch.setattr("coordinator.store.runs.time", clock)
    return clock


def test_a_stagger_spaces_the_starts_of_a_tree(idle_coordinator: Coordinator, hand_clock: HandClock) -> None:
    coord, store = idle_coordinator, idle_coordinator.store
    root = coord.create_task("root")
    first, second, third = (
        coord.get_task(c)
        for c in coord.delegate(root.id, [{"description": f"c{n}", "message": "m"} for n in range(3)]).child_ids
    )
    limits = AdmissionLimits(stagger_ms=500)
    assert start(store, first.id, limits).verdict == "run"
    hand_clock.advance(0.125)
    # The second start is reserved 500 ms after the first, the third 500 ms after that.
    delays = [start(store, t, limits) for t in (second.id, third.id)]
    assert [(d.verdict, d.delay_ms) for d in delays] == [("delay", 375), ("delay", 875)]
    assert store.records.task_field(third.id, "deliveries") is None, (
        "a delayed start took no lease and counted no delivery"
    )
    assert not coord.client.exists(store.keys.lease(root.root_id, third.id))


def _three_children(coord: Coordinator) -> tuple[TaskRecord, list[str]]:
    root = coord.create_task("root")
    return root, coord.delegate(root.id, [{"description": f"c{n}", "message": "m"} for n in range(3)]).child_ids


def test_a_delayed_start_runs_at_the_start_it_reserved(idle_coordinator: Coordinator, hand_clock: HandClock) -> None:
    """A delayed start comes back as a new run (a new token) at the start it reserved, and runs. Before, its own
    reservation read as the tree's last start, so it was delayed again at every return and never ran."""
    coord, store, limits = idle_coordinator, idle_coordinator.store, AdmissionLimits(stagger_ms=300)
    root, (first, second, third) = _three_children(coord)
    last_start = store.keys.last_start(root.root_id)
    assert start(store, first, limits).verdict == "run"
    hand_clock.advance(0.125)
    delayed = start(store, second, limits)
    assert (delayed.verdict, delayed.delay_ms) == ("delay", 175)
    reserved = coord.client.get(last_start)

    hand_clock.advance(0.125)
    early = start(store, second, limits)  # its restart, before its time: the rest of its wait
    assert (early.verdict, early.delay_ms) == ("delay", 50)
    assert coord.client.get(last_start) == reserved, "no second reservation"
    hand_clock.advance(0.125)
    assert start(store, second, limits).verdict == "run", "its own reservation does not delay it again"
    started_ms = float(coord.client.get(last_start) or 0)
    assert float(reserved or 0) <= started_ms < float(reserved or 0) + 300, "the last start is when it ran"

    later = start(store, third, limits)  # the next start is one stagger after the second's
    assert later.verdict == "delay" and float(coord.client.get(last_start) or 0) == started_ms + 300


def test_delayed_starts_that_come_back_late_are_spaced_again(
    idle_coordinator: Coordinator, hand_clock: HandClock
) -> None:
    """Two delayed starts back a whole stagger past their reservations (their worker died and the reconciler
    published them again, or the pool was busy) do not both run at once: the first runs, the second is spaced
    one stagger after it, as a start that reserved nothing."""
    coord, store, limits = idle_coordinator, idle_coordinator.store, AdmissionLimits(stagger_ms=300)
    root, (first, second, third) = _three_children(coord)
    assert start(store, first, limits).verdict == "run"
    assert [start(store, t, limits).verdict for t in (second, third)] == ["delay", "delay"]  # at +300, +600
    hand_clock.advance(1.0)  # past both reservations by more than a stagger
    assert start(store, second, limits).verdict == "run"
    again = start(store, third, limits)
    assert (again.verdict, again.delay_ms) == ("delay", 300), again
