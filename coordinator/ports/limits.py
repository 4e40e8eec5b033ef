"""The limits port: a run's fleet-wide rate limits and tool slots (coordinator/admission.py), and the waits
they make on its task's timeline (written as the wait begins and as it ends)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from coordinator import admission
from coordinator.ports.steps import Steps

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["LimitsPort"]


class LimitsPort:
    """One run's waits on the fleet's limits: its provider's rate, a tool's rate, a tool's concurrency."""

    def __init__(self, run: Steps, plane: Plane) -> None:
        self._run = run
        self._plane = plane

    def rate_wait_ms(self, provider: str) -> int:
        """0 when the next request to `provider` may start now under its fleet-wide rate limit, else the ms to wait."""
        wait_ms = admission.wait_for_rate(self._plane, provider)
        self._note("rate_limit", f"rate:{provider}", waiting=wait_ms > 0)
        return wait_ms

    def tool_rate_wait_ms(self, pattern: str, rpm: int) -> int:
        """0 when a call of the tool glob `pattern` may start now under its fleet-wide `rpm`, else the ms to wait."""
        wait_ms = admission.wait_for_tool_rate(self._plane, pattern, rpm)
        self._note("tool_limit", f"tool:{pattern}", waiting=wait_ms > 0)
        return wait_ms

    def take_tool_slot(self, pattern: str, limit: int, lease_s: float, tool_call_id: str) -> int:
        """A fleet-wide slot of the tool glob `pattern` for this call, held until `free_tool_slot` or the lease:
        when the lease ends (ms), which `free_tool_slot` is given back; 0 when none is free."""
        member = f"{self._run.task.id}:{tool_call_id}"
        lease_ends_ms = admission.take_tool_slot(self._plane, pattern, limit, lease_s, member)
        self._note("tool_limit", f"slot:{member}", waiting=not lease_ends_ms)
        return lease_ends_ms

    def free_tool_slot(self, pattern: str, tool_call_id: str, lease_ends_ms: int) -> None:
        """Free the slot of this call's take that said `lease_ends_ms`: not a later take of the same call's (a new
        run of the task that runs the call again while the thread of this one runs on)."""
        admission.free_tool_slot(self._plane, pattern, f"{self._run.task.id}:{tool_call_id}", lease_ends_ms)

    def _note(self, reason: str, what: str, *, waiting: bool) -> None:
        run = self._run
        if run.waits.note(run.writes, reason, what, waiting=waiting):
            run.flush()  # written as the wait begins and ends: the task says what it waits for while it does
