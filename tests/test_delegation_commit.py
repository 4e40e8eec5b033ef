"""A delegation's commit builds its children from what they share (models.NewChildren), made and encoded once,
and each child's own values on top (store.records.new_children): on a real Redis, every child's stored hash is the
one its record alone would give, and reads back as that record.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from coordinator import Coordinator, Profile, Settings, delegation
from coordinator.errors import SubqError
from coordinator.models import CHILD_OWN_FIELDS, NewChildren, TaskRecord, TaskStatus
from coordinator.store.base import _encode_record
from coordinator.store.fields import TaskField
from coordinator.store.records import LEFT_UNSET, opening_marks, stored_fields

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@pytest.fixture
def coord(settings: Settings) -> Iterator[Coordinator]:
    """A coordinator no worker serves, with a second profile, so children may differ in theirs."""
    profiles = {**settings.profiles, "second": Profile()}
    coord = Coordinator(
        settings.model_copy(update={"queue": "subq-nobody", "key_prefix": "subqcommit", "profiles": profiles})
    )
    yield coord
    coord.client.delete("subq-nobody")
    coord.close()


def _varied_specs(todo_id: str) -> list[dict[str, Any]]:
    """Children that differ in every own field a spec gives: message, description, profile, item, budget, schema."""
    return [
        {"description": "first", "message": "do the first thing", "todo_id": todo_id},
        {"description": "second", "message": "do the second", "profile": "second", "budget_usd": "0.25"},
        {"description": "third", "message": "answer in JSON", "output_schema": SCHEMA, "budget_usd": "0.5"},
        {"description": "fourth, a row of its own", "message": "the plan has no row left for me"},
    ]


# A parallel delegation from a root of the default tenant; a sequential one from a root with a tenant, a priority
# and an owner of its own, which every child shares (only that case can tell a child's from the default's).
TREES = [
    pytest.param("parallel", {}, id="parallel"),
    pytest.param("sequential", {"tenant": "team-b", "priority": 5, "owner": "key-1"}, id="sequential-tenant"),
]


@pytest.mark.parametrize(("mode", "tree"), TREES)
def test_each_child_is_stored_as_its_record_alone_would_be(coord: Coordinator, mode: str, tree: dict[str, Any]) -> None:
    parent = coord.create_task(
        "a budgeted parent", todos="[ ] a\n[ ] b\n[ ] c", budget_usd="2", metadata={"job": "7"}, **tree
    )
    items = coord.get_todos(parent.id)
    specs = _varied_specs(items[2].id)
    batch, children = delegation.commit(coord.plane, parent.id, specs, mode=mode)

    assert [c.id for c in children] == batch.child_ids
    assert [(c.prompt, c.description) for c in children] == [(s["message"], s["description"]) for s in specs]
    assert len({c.number for c in children}) == len(children), "each child has a history number of its own"
    appended = coord.get_todos(parent.id)[-1]
    assert appended.content == specs[3]["description"], "the fourth child found no row left: one was appended"
    assert [c.todo_id for c in children] == [items[2].id, items[0].id, items[1].id, appended.id]
    assert [c.profile for c in children] == [parent.profile, "second", parent.profile, parent.profile]
    assert [c.budget_micros for c in children] == [0, 250_000, 500_000, 0]
    assert [c.output_schema for c in children] == [None, None, SCHEMA, None]
    for child in children:
        assert (child.tenant, child.priority, child.owner) == (parent.tenant, parent.priority, parent.owner)
        stored = coord.client.hgetall(coord.store.keys.task(child.root_id, child.id))
        # The record leaves its ancestors to the commit (they are the parent's, and the parent).
        alone = _encode_record({**stored_fields(child), TaskField.TIMELINE: opening_marks(child)})
        del alone[TaskField.ANCESTORS]
        assert {name: stored[name] for name in alone} == {name: str(value) for name, value in alone.items()}
        # Beyond the record: the commit's own fields, the same for every child of the batch.
        extra = {name: stored[name] for name in stored.keys() - alone.keys()}
        assert extra == {
            TaskField.ANCESTORS: f'["{parent.id}"]',
            TaskField.BATCH_MODE: mode,
            TaskField.BUDGET_CHAIN: f'["{parent.id}"]',
        }
        read = coord.get_task(child.id)
        assert read.model_dump(exclude={"ancestors"}) == child.model_dump(exclude={"ancestors"})
        assert read.metadata == {"job": "7"} and read.status == TaskStatus.ACTIVE


def test_the_own_fields_are_fields_a_new_record_writes() -> None:
    # A field a new record leaves out at its default (LEFT_UNSET) could not be one a child sets on top of what
    # its siblings share: left out, the shared value would stand in its place.
    assert set(CHILD_OWN_FIELDS) <= set(TaskRecord.model_fields)
    assert not set(CHILD_OWN_FIELDS) & LEFT_UNSET


def test_a_child_gives_every_own_value_and_no_other() -> None:
    shared = TaskRecord(
        id="r-1", root_id="r", status=TaskStatus.ACTIVE, prompt="p", profile="offline", created_at=1.0, updated_at=1.0
    )
    given = {"prompt": "q", "description": "", "profile": "offline", "todo_id": None, "budget_micros": 0}
    given |= {"output_schema": None}
    with pytest.raises(ValueError, match="a child's own values are .* not .*depth"):
        NewChildren(shared, [{"id": "r-2", **given, "depth": 3}])
    # One left out would take the first child's value unseen.
    with pytest.raises(ValueError, match="a child's own values are .* not"):
        NewChildren(shared, [{"id": "r-2", **{k: v for k, v in given.items() if k != "prompt"}}])
    children = NewChildren(shared, [{"id": "r-2", **given}, {"id": "r-3", **given, "prompt": "z"}]).records(10)
    assert [(c.id, c.prompt, c.number) for c in children] == [("r-2", "q", 10), ("r-3", "z", 11)]


def test_a_refused_delegation_leaves_the_due_list_as_it_was(coord: Coordinator) -> None:
    """A delegation watches its parent before its commit (the commit's publish may never come). A refused one changed
    the due list all the same: it put a task on it that was not (the reconciler then counted a repair for a root it
    found cancelled), or pushed one's look later at each call. Now the watch is undone with the refusal."""
    due = coord.store.keys.due()
    budgeted = coord.create_task("budgeted", todos="[ ] a", budget_usd="1")
    cancelled = coord.create_task("cancelled", todos="[ ] a")
    coord.cancel(cancelled.id, "done with it")
    watched = coord.create_task("watched", todos="[ ] a")
    coord.client.zadd(due, {watched.id: 1_000.0})  # due long ago: the reconciler's look is due now
    refusals = [
        (budgeted.id, {"budget_usd": "5"}, "budget"),
        (cancelled.id, {}, "cancelled"),
        (watched.id, {"todo_id": "no-such-item"}, "Unknown todo_id"),
    ]
    try:
        for parent_id, spec, says in refusals:
            before = coord.client.zrange(due, 0, -1, withscores=True)
            with pytest.raises(SubqError, match=says):
                delegation.commit(coord.plane, parent_id, [{"description": "a", "message": "do a", **spec}])
            assert coord.client.zrange(due, 0, -1, withscores=True) == before, says
        assert coord.client.zscore(due, watched.id) == 1_000.0 and coord.client.zscore(due, budgeted.id) is None
        batch, _ = delegation.commit(coord.plane, watched.id, [{"description": "a", "message": "do a"}])
        assert batch.child_ids and (coord.client.zscore(due, watched.id) or 0) > 1_000.0, "a commit is watched"
    finally:
        coord.client.zrem(due, budgeted.id, cancelled.id, watched.id)


def test_a_refused_steps_watch_is_undone_only_while_it_is_the_last(coord: Coordinator) -> None:
    """Two delegations from one caller's task at once: B watches it (it was not listed), A watches it again and
    commits, B is refused. B's undo took the task off the list, A's too: A's batch committed and unpublished had
    nothing left to look at it if A's process died. An undo now puts back only its own watch."""
    due, convergence = coord.store.keys.due(), coord.store.convergence
    task = coord.create_task("a caller's task", todos="[ ] a")
    try:
        b = convergence.watch_one(task.id, 30)
        a = convergence.watch_one(task.id, 60)
        assert (b.due_before, a.due_before) == (None, b.at)
        assert convergence.rewatch(b) is False, "A watched it since: B's undo leaves A's watch"
        assert coord.client.zscore(due, task.id) == a.at
        assert convergence.rewatch(a) is True and coord.client.zscore(due, task.id) == b.at, "the last undo is one"
        assert convergence.rewatch(convergence.watch_one(task.id, 5)) is True
        assert coord.client.zscore(due, task.id) == b.at
    finally:
        coord.client.zrem(due, task.id)
