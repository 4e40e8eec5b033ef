"""The critical path follows what held the tree (coordinator/timeline.py): pure logic over timelines.

Each tree here is written as the marks its tasks' state changes leave (the form the
Lua scripts write), so every case names the exact intervals the path must walk.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.timeline import Timeline, critical_path, critical_steps, held_longest


@dataclass(frozen=True)
class Task:
    """A task as the critical path reads it (coordinator.timeline.Timed)."""

    id: str
    parent_id: str | None
    timeline: Timeline


def task(task_id: str, parent_id: str | None, *marks: tuple[int, str]) -> Task:
    return Task(task_id, parent_id, Timeline(m=list(marks)))


def _own_approval_then_a_quick_child() -> list[Task]:
    """The root waits 30 s for a person, then delegates one quick child: the child is the step that ended
    last, but the root's approval wait is what held the tree."""
    root = task(
        "r", None,
        (0, "queued"), (10, "running"), (1_000, "wait:approval"), (31_000, "queued"), (31_050, "running"),
        (31_500, "wait:children"), (33_000, "queued"), (33_010, "running"), (33_200, "completed"),
    )  # fmt: skip
    child = task("r-b", "r", (31_500, "queued"), (31_600, "running"), (33_000, "completed"))
    return [root, child]


def test_a_parents_own_approval_wait_is_what_held_the_tree() -> None:
    records = _own_approval_then_a_quick_child()
    held = held_longest(records)
    assert held is not None
    assert (held.task_id, held.interval.reason, held.interval.ms) == ("r", "approval", 30_000)
    assert critical_path(records) == ["r", "r-b"], "the child that closed the batch is on the path too"
    steps = [(s.task_id, s.interval.state, s.interval.reason) for s in critical_steps(records)]
    # The wait for children is covered by the child's own intervals, in time order.
    assert steps == [
        ("r", "queued", None), ("r", "running", None), ("r", "waiting", "approval"), ("r", "queued", None),
        ("r", "running", None), ("r-b", "queued", None), ("r-b", "running", None), ("r", "queued", None),
        ("r", "running", None),
    ]  # fmt: skip


def test_each_sequential_step_is_on_the_path_not_only_the_last() -> None:
    root = task(
        "r", None,
        (0, "running"), (1_000, "wait:children"), (5_000, "running"), (6_000, "wait:children"),
        (7_000, "running"), (7_100, "completed"),
    )  # fmt: skip
    first = task("r-a", "r", (1_000, "queued"), (1_100, "running"), (2_000, "wait:rate_limit"), (4_000, "running"),
                 (5_000, "completed"))  # fmt: skip
    second = task("r-b", "r", (6_000, "queued"), (6_100, "running"), (7_000, "completed"))
    records = [root, first, second]
    assert critical_path(records) == ["r", "r-a", "r-b"]
    held = held_longest(records)
    assert held is not None and (held.task_id, held.interval.reason, held.interval.ms) == ("r-a", "rate_limit", 2_000)


def test_in_a_fan_out_the_child_that_closed_the_batch_is_walked_and_its_wait_named() -> None:
    root = task("r", None, (0, "running"), (1_000, "wait:children"), (9_000, "running"), (9_100, "completed"))
    quick = task("r-a", "r", (1_000, "queued"), (1_010, "running"), (3_000, "completed"))
    guarded = task("r-c", "r", (1_000, "queued"), (1_010, "running"), (2_000, "wait:approval"),
                   (8_500, "queued"), (8_600, "running"), (9_000, "completed"))  # fmt: skip
    nested = task("r-a-x", "r-a", (1_100, "queued"), (1_200, "running"), (2_900, "completed"))
    records = [root, quick, guarded, nested]
    assert critical_path(records) == ["r", "r-c"], "the quick child and its own child held nothing"
    held = held_longest(records)
    assert held is not None and (held.task_id, held.interval.reason, held.interval.ms) == ("r-c", "approval", 6_500)


def test_a_batch_closed_a_little_after_its_last_child_ended_is_still_walked() -> None:
    # Two writers' clocks: the child's end may read a little after its parent's mark (`root`), or the
    # reconciler closed the batch a while after the child ended (`late`).
    root = task("r", None, (0, "running"), (100, "wait:children"), (5_400, "running"), (5_500, "completed"))
    child = task("r-a", "r", (100, "queued"), (200, "running"), (1_000, "wait:tool_limit"), (4_000, "running"),
                 (5_500, "completed"))  # fmt: skip
    late = task("r", None, (0, "running"), (100, "wait:children"), (6_200, "running"), (6_300, "completed"))
    assert critical_path([root, child]) == ["r", "r-a"]
    assert critical_path([late, child]) == ["r", "r-a"], "within the slack of a second"
    held = held_longest([late, child])
    assert held is not None and (held.task_id, held.interval.reason) == ("r-a", "tool_limit")


def test_a_tree_that_only_ran_was_held_by_nothing_but_its_work() -> None:
    records = [task("r", None, (0, "running"), (2_000, "completed"))]
    assert held_longest(records) is None
    assert critical_path(records) == ["r"]
    assert critical_path([]) == [] and critical_steps([]) == []
