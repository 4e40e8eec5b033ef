"""The tool journal: each tool call kept the moment it returns, so a resumed run replays it instead of
calling again (docs/architecture.md, "Tools"), and its price counted as the task's own spend."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from coordinator import quotas
from coordinator.models import Spend, ToolCallDone, Usage
from coordinator.ports.steps import Steps, lose_lease

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["KeptCalls", "ToolJournal"]

# A tool's result, whatever it is (a string, a number, a pydantic model), as JSON for the journal.
ANY_RESULT: TypeAdapter[Any] = TypeAdapter(Any)


@dataclass(frozen=True)
class KeptCalls:
    """What the journal holds of a response's calls: the kept results (by call id) of those that returned, and
    which human-approved calls had started."""

    results: dict[str, Any]
    started: set[str]
    # Calls answered without running (denied, interrupted), counted then: a resume answers them again uncounted.
    answered: set[str]


class ToolJournal:
    """One run's tool calls: kept as each returns, read back by a resumed run."""

    def __init__(self, run: Steps, plane: Plane) -> None:
        self._run = run
        self._plane = plane

    def keep_calls(self) -> None:
        """Write the step that keeps the latest response before its tool calls run, unless a step did since
        (its live figures too, shown while the calls run): a run resumed after this worker dies finds the
        calls, and replays each that returned."""
        run = self._run
        if not run.step.response_unwritten:
            return
        run.live.write(run.task, run.writes)
        run.flush()

    def record(self, tool_call_id: str, tool: str, outcome: str, result: object = None, ms: int = 0) -> None:
        """A tool call returned (`result`, kept for a resume), or was answered without running (denied,
        interrupted: kept empty, so a resume answers it again uncounted): keep it now, not at the next step, so a run resumed after this worker
        died replays it instead of calling the tool again; count it on the task; and write the run's step
        with it, whose checks serve the next model request (one round trip).

        Raises `LeaseLost` (nothing written) when another run owns the task now.
        """
        kept = None if outcome in ("denied", "interrupted") else ANY_RESULT.dump_json(result, fallback=str).decode()
        done = ToolCallDone(tool_call_id, tool, outcome, kept, ms)
        run = self._run
        run.stepped(self._plane.store.runs.record_tool_call(run.task, run.token, run.writes, done), keep=True)

    def cost(self, tool_call_id: str, tool: str, cost_micros: int) -> None:
        """A call's price: the task's own spend (recorded once per call, at the next step, as a response's is)."""
        # The call id is the model's text: quoted, as the request keys are a space-separated list on the task (an
        # id "x 1:2" had put the key of the run's own request 1:2 there, and that request's cost was never
        # counted, on any budget). Ids of letters, digits and `_.-~` stay as they are.
        request_key = "tool:" + urllib.parse.quote(tool_call_id, safe="")
        spend = Spend(request_key=request_key, usage=Usage(), cost_micros=cost_micros, cost_source=f"tool:{tool}")
        self._run.writes.usage.append(spend)
        self._run.live.cost_micros += cost_micros
        if quotas.count_spend(self._plane, self._run.task, spend.request_key, cost_micros):
            self._run.tenant_over_day = True  # its tenant's max_cost_usd_per_day: stop before the next request

    def kept(self, tool_call_ids: Sequence[str]) -> KeptCalls:
        """The kept results of these calls, for those that returned before the run's last worker died; and
        which human-approved calls had started (`mark_started`)."""
        found, started, answered = self._plane.store.runs.tool_results(self._run.task.id, tool_call_ids)
        return KeptCalls({call_id: json.loads(value) for call_id, value in found.items()}, started, answered)

    def mark_started(self, tool_call_id: str) -> None:
        """A human-approved call starts: a resume after this worker dies must not take the approval as leave
        to run it again (one round trip, only for calls a human approved).

        Raises `LeaseLost` (nothing written) when another run owns the task now: that run read the journal
        without this note and may run the call itself, so this one must not."""
        run = self._run
        if not self._plane.store.runs.mark_tool_started(run.task.id, tool_call_id, run.token):
            lose_lease(run)
