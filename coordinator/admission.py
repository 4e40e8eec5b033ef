"""Admission control: how many children run at once, and how fast runs and requests start.

- `SUBQ_MAX_RUNNING_PER_PARENT` / `SUBQ_MAX_RUNNING_PER_ROOT` cap the children
  of one parent, and the tasks of one tree, holding a run slot at once (0: no cap).
- `SUBQ_START_STAGGER_MS` spaces the starts of a tree's runs.
- `SUBQ_PROVIDER_RPM` caps each provider's requests per minute, fleet-wide.

A run that must wait holds no worker: it is queued in order on the tree's
admission list (`admit.lua`), and when a slot frees (`release_slot.lua`) the
first waiting tasks that now fit are started again by name. A stagger delay is
a delayed restart. A root always runs. The slot is freed only after the task's
outcome is recorded, so a finished child never counts as running beside the
limit's worth of new ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coordinator import dispatch
from coordinator.models import TaskRecord

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["admit", "limits_set", "release", "wait_for_rate"]


def limits_set(plane: Plane) -> bool:
    """Whether any admission limit is set: then a run is admitted, and its slot freed, step by step."""
    s = plane.settings
    return bool(s.max_running_per_parent or s.max_running_per_root or s.start_stagger_ms)


def _limited(plane: Plane, task: TaskRecord) -> bool:
    return task.parent_id is not None and limits_set(plane)


def admit(plane: Plane, task: TaskRecord) -> bool:
    """True: the task may run now. False: it waits (queued for a slot, or restarted after a stagger)."""
    if not _limited(plane, task):
        return True
    s = plane.settings
    verdict, delay_ms = plane.store.admit(task, s.max_running_per_parent, s.max_running_per_root, s.start_stagger_ms)
    if verdict == "run":
        return True
    if verdict == "delay":
        dispatch.publish_restart(plane.app, task, countdown_s=delay_ms / 1000)
    plane.store.set_live(task, "queued")
    return False


def release(plane: Plane, task: TaskRecord) -> None:
    """Free the task's run slot and start the waiting tasks that now fit."""
    if not _limited(plane, task):
        return
    s = plane.settings
    for admitted in plane.store.release_slot(task, s.max_running_per_parent, s.max_running_per_root):
        dispatch.publish_restart(plane.app, plane.store.get_task(admitted))


def wait_for_rate(plane: Plane, provider: str) -> int:
    """0 when a request to `provider` may start now (and is counted), else the ms to wait first."""
    rpm = plane.settings.provider_rpm.get(provider, 0)
    return plane.store.wait_for_rate(provider, rpm) if rpm else 0
