"""Named crash points, for the fault suite: a process stops dead at one step, as a SIGKILL would.

`crash_point(settings, name)` kills the calling process when `SUBQ_FAULT_CRASH_AT`
names that point, and does nothing otherwise (one string comparison). The tests
start a worker with the setting, let it die there, and check that the fleet
converges without it. Never set it in a deployment.

Points: `after-end` (a run's end is recorded by `end_run.lua`: the task is terminal,
its lease and run slot freed, a parallel child written back and its batch closed if
it was the last; what the end sends, the next chain step, the parent's resume, the
runs a freed slot admitted, not yet sent),
`after-commit` (a delegation is committed, not yet published),
`after-close` (a batch is closed, its parent's resume not yet published),
`after-claim-publish` (a batch is claimed for publishing, not yet published),
`after-retry` (a retry is committed: its tasks active again and on the due list, their runs
not yet published),
`after-compaction` (a run's compaction record is kept with its journal, the request it was
made for not yet sent),
`mid-park` (a run that parks two or more calls for a person's decision has saved the first, and its
task's list of them; the others not yet saved),
`after-park` (a run's calls are saved for a person's decision, its lease and run slots not yet
freed),
`after-stop` (a cancel or a budget's stop is persisted, `stop_tasks.lua`: the subtree's tasks
terminal; none revoked, written back into its parent's batch or taken off the due list yet),
`after-dead-letter` (a message no worker can run is on the dead-letter list, not yet acknowledged by
the worker: `Coordinator.record_dead_letter`).
"""

from __future__ import annotations

import logging
import os
import signal

from coordinator.settings import Settings

__all__ = ["POINTS", "crash_point"]

log = logging.getLogger(__name__)

POINTS = (
    "after-end", "after-commit", "after-close", "after-claim-publish", "after-retry", "after-compaction", "mid-park",
    "after-park", "after-stop", "after-dead-letter",
)  # fmt: skip


def crash_point(settings: Settings, name: str) -> None:
    if settings.fault_crash_at == name:
        log.critical("subq: SUBQ_FAULT_CRASH_AT=%s: this process dies here", name)
        os.kill(os.getpid(), signal.SIGKILL)
