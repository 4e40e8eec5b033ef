"""Admission control: how many children run at once, and how fast runs and requests start.

- `SUBQ_MAX_RUNNING_PER_PARENT` / `SUBQ_MAX_RUNNING_PER_ROOT` cap the children
  of one parent, and the tasks of one tree, holding a run slot at once (0: no cap).
- `SUBQ_START_STAGGER_MS` spaces the starts of a tree's runs.
- `SUBQ_PROVIDER_RPM` caps each provider's requests per minute, fleet-wide.
- A profile's `tool_limits` cap the calls of the tools a glob matches, fleet-wide:
  at once (slots held for the call, with a lease a dead worker's slots lapse by)
  and a minute (the same window as a provider's requests).

Admission is a step of a run's one start and one end, not a path of its own: a
run's start (`start_run.lua`) admits it before it takes the lease, and a run's
end (`end_run.lua`) frees its slot after its outcome is recorded, so a finished
child never counts as running beside the limit's worth of new ones. A run that
must wait holds no worker: it is queued in order on the tree's admission list,
and when a slot frees the first waiting tasks that now fit are started again by
name (`started_again`). A stagger delay is a delayed restart. A root always
runs. This module holds what the start and end hand back to Python: the limits,
the waiting run's live status, the restarts, and the slot a run frees when it
releases its worker without ending (delegated, waiting for a decision, handed
back) or when an ended task's write-back is repaired.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from coordinator import dispatch
from coordinator.models import AdmissionLimits, TaskRecord

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = [
    "free_tool_slot",
    "limits",
    "must_wait",
    "release",
    "started_again",
    "take_tool_slot",
    "wait_for_rate",
    "wait_for_tool_rate",
]


def limits(plane: Plane) -> AdmissionLimits:
    s = plane.settings
    return AdmissionLimits(s.max_running_per_parent, s.max_running_per_root, s.start_stagger_ms)


def must_wait(plane: Plane, task: TaskRecord, delay_ms: int) -> None:
    """The start found no slot ('wait': it is on the admission list) or a stagger (`delay_ms`: restart it then)."""
    if delay_ms:
        dispatch.publish_restart(plane.app, task, countdown_s=delay_ms / 1000)
    plane.store.events.set_live(task, "queued")


def started_again(plane: Plane, admitted: Sequence[str]) -> None:
    """Publish the runs of waiting tasks a freed slot admitted (each still on the due list, should this fail)."""
    for task_id in admitted:
        dispatch.publish_restart(plane.app, plane.store.records.get_task(task_id))


def release(plane: Plane, task: TaskRecord) -> None:
    """Free the task's run slot and start the waiting tasks that now fit."""
    own = limits(plane)
    if own.applies_to(task):
        started_again(plane, plane.store.runs.release_slot(task, own))


def take_tool_slot(plane: Plane, pattern: str, limit: int, lease_s: float, member: str) -> bool:
    """Take a fleet-wide slot of the tool glob `pattern` for the call `member`; False: all `limit` are held."""
    return plane.store.runs.take_tool_slot(pattern, limit, lease_s, member)


def free_tool_slot(plane: Plane, pattern: str, member: str) -> None:
    plane.store.runs.free_tool_slot(pattern, member)


def wait_for_tool_rate(plane: Plane, pattern: str, rpm: int) -> int:
    """0 when a call of the tool glob `pattern` may start now (and is counted), else the ms to wait first."""
    return plane.store.runs.wait_for_rate(f"tool:{pattern}", rpm)


def wait_for_rate(plane: Plane, provider: str) -> int:
    """0 when a request to `provider` may start now (and is counted), else the ms to wait first."""
    rpm = plane.settings.provider_rpm.get(provider, 0)
    return plane.store.runs.wait_for_rate(provider, rpm) if rpm else 0
