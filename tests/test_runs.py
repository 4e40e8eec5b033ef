"""The run-lifecycle seam (coordinator/runs.py), driven in-process on a real Redis.

A run is driven by the same `run_child` the worker runs, on a queue no worker
consumes, so what the seam did in which order can be checked step by step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from coordinator import Coordinator, TaskStatus, admission
from coordinator.celery_app import make_app
from coordinator.plane import Plane
from coordinator.runs import Ended, Run
from tests.helpers import scripted_children
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child


@pytest.fixture
def limited(idle_coordinator: Coordinator) -> Iterator[Coordinator]:
    """The idle coordinator with one running child per parent."""
    coord = Coordinator(idle_coordinator.settings.model_copy(update={"max_running_per_parent": 1}))
    yield coord
    coord.close()


def test_a_run_frees_its_slot_only_after_its_outcome_is_recorded(
    limited: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A per-parent limit of 1 must never show 2 running: the next child is admitted when
    the slot frees (in the run's end, end_run.lua), so the finished one must already be terminal by then."""
    parent_id, (first, second) = scripted_children(limited, "two children, one at a time")
    seen_at_admission: list[tuple[list[str], str]] = []
    real_started_again = admission.started_again

    def spy(plane: Plane, admitted: Sequence[str]) -> None:
        seen_at_admission.append((list(admitted), plane.store.records.status_of(first)[0]))
        real_started_again(plane, admitted)

    monkeypatch.setattr(admission, "started_again", spy)
    rt = build_runtime(limited.settings, make_app(limited.settings))

    run = rt.lifecycle.start(first)
    assert isinstance(run, Run), run
    assert run_child(rt, second).status == "queued", "the one slot is the first child's"
    assert limited.snapshot(parent_id)[second].state == "queued"
    assert run.end(Ended("completed", summary="a done")).status == "completed"

    assert seen_at_admission == [([second], TaskStatus.COMPLETED.value)]
    assert limited.store.runs.in_flight(parent_id)["running"] == 1, "the second child holds the slot now"
    assert run_child(rt, second).status == "completed"
    assert limited.store.runs.in_flight(parent_id)["running"] == 0
    assert limited.get_task(parent_id).status == TaskStatus.ACTIVE, "the last child's write-back closed the batch"
