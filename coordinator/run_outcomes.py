"""How a run ends: its outcome (`Ended`, `Released`), or an exception that ends it without one."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Ended", "HandBack", "LeaseLost", "Released", "RunStopped"]


class RunStopped(Exception):
    """The run's task was stopped (a cancel, a spent budget) while it ran: it writes nothing more."""


class LeaseLost(Exception):
    """The run's lease lapsed or was taken: another run owns the task now; this one writes nothing more."""


class HandBack(Exception):
    """The worker is shutting down: the run stops at this step boundary and is queued again."""


@dataclass(frozen=True)
class Ended:
    """The task's run ended the task: completed, failed or cancelled."""

    status: str
    summary: str = ""
    error: str = ""
    error_class: str = ""
    error_detail: str = ""  # a failed model request's raw error body, kept on the record


@dataclass(frozen=True)
class Released:
    """The run ended before the task did: `delegated`, or `waiting_approval`."""

    state: str
