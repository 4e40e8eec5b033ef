"""What a run holds between its steps, and how it ends: the state its ports share with it.

A run (coordinator/runs.py) writes shared state only in steps: one script call that writes
what it did since its last (`RunWrites`) and reads back the checks (`Stepped`). Each worker
concern is a port (this package) handed the run as `Steps`: the narrow part of the run a port
may touch (its task and token, the writes its next step sends, the step state, the live
figures, the waits it has open, and `flush` / `stepped`), never the run's life (`end`, `hand_back`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from coordinator.errors import FencedError
from coordinator.models import Mark, RunWrites, TaskRecord, live_status
from coordinator.replies import Ending, Stepped
from coordinator.timeline import WAIT_PREFIX

__all__ = [
    "LIVE_EVERY_S",
    "LIVE_TEXT_CHARS",
    "Ended",
    "HandBack",
    "LeaseLost",
    "LiveFigures",
    "Released",
    "RunStopped",
    "StepState",
    "Steps",
    "Waits",
    "fenced_writes",
    "lose_lease",
]

# Live status carries an excerpt of the latest model text, not the whole of it.
LIVE_TEXT_CHARS = 200
# A run writes its live status (and the worker its Flower progress event) at most this often
# as responses arrive, and before each next model request, and at its end: a run that
# answers at once writes one, at its end.
LIVE_EVERY_S = 0.25

# -- how a run ends ------------------------------------------------------------------------


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
    # A typed task's validated data, compact JSON ('' for none): its record's `output`, written with the end.
    output_json: str = ""
    # Its model's answers that broke the output schema (each sent back with the errors), kept on the record.
    invalid_outputs: int = 0


@dataclass(frozen=True)
class Released:
    """The run ended before the task did: `delegated`, `waiting_approval`, or `waiting_provider`
    (its provider is down: the run is published again at `wake_at_s`, or sooner when it is back)."""

    state: str
    wake_at_s: float = 0.0


# -- what a run holds between steps ------------------------------------------------------------


@dataclass
class StepState:
    """What a run's last step already did: one small state, changed by each step's typed reply
    (coordinator/replies.py's `Stepped`, `Ending`) and by what the run does between steps, and read by the
    check before its next model request (`Run.check_stop`) and by the journal's `keep_calls`.
    """

    # The checks the last step made that the next request may take as its own (the status and the
    # topmost budget reached): the start's, or the step that kept the last tool call's result. A
    # response makes them stale (its usage must be written and the budgets checked first).
    checks: Stepped | None = None
    # A response recorded since the last step (its calls are kept by a step before they run).
    response_unwritten: bool = False
    # A tool of subq's own wrote state since the last full check: its answer has no journal, so the
    # check before the next request writes a step (the tool step's checks do not serve).
    own_state_written: bool = False
    # The start said the task's prompt as its first UI message.
    announced: bool = False
    # The lease was lost: a step's reply said so, or the heartbeat did. Nothing is written after.
    fenced: bool = False

    @classmethod
    def started(cls, status: str, exhausted: str | None) -> StepState:
        """A run started in one step (start_run.lua), which read the status and the budgets a moment ago."""
        return cls(checks=Stepped(leased=True, status=status, exhausted=exhausted), announced=True)

    def stepped(self, reply: Stepped, *, keep: bool) -> None:
        """A step was written (or refused: the lease is another run's); `keep`: its checks serve the next request."""
        self.response_unwritten = False
        if not reply.leased:
            self.fenced = True
        elif keep:
            self.checks = reply

    def responded(self) -> None:
        self.checks, self.response_unwritten = None, True

    def wrote_own_state(self) -> None:
        self.own_state_written = True

    def take_checks(self) -> Stepped | None:
        """The checks the next request may take as its own, once; None: it must write a step and check."""
        if self.checks is None or self.own_state_written:
            return None
        checks, self.checks = self.checks, None
        return checks

    def checked(self) -> None:
        """A full check was written: what subq's own tools answered is saved with it."""
        self.own_state_written = False

    def ended(self, ending: Ending) -> None:
        if ending.kind == "fenced":
            self.fenced = True


@dataclass
class LiveFigures:
    """A run's live status between steps: its figures so far, and the latest response's tool and text until
    a step writes them (at most every LIVE_EVERY_S, and always at the end)."""

    requests: int
    cost_micros: int
    written_at_s: float = field(default_factory=time.monotonic)
    pending: dict[str, Any] | None = None  # the latest response's tool and text, until written

    def responded(self, cost_micros: int, tool: str | None, text: str) -> bool:
        """A response's figures; True when its live status is due now."""
        self.requests += 1
        self.cost_micros += cost_micros
        self.pending = {"tool": tool, "text": text[:LIVE_TEXT_CHARS] or None}
        return time.monotonic() - self.written_at_s >= LIVE_EVERY_S

    def write(self, task: TaskRecord, writes: RunWrites) -> None:
        """Put the pending live status (the latest response's) into the writes of the next step, if any."""
        if self.pending is None:
            return
        self.written_at_s = time.monotonic()
        writes.live = live_status(task, "running", **self.pending, requests=self.requests, cost_micros=self.cost_micros)
        self.pending = None

    def write_state(self, task: TaskRecord, writes: RunWrites, state: str, waiting_for: str) -> None:
        """A live status of a run that waits inside itself (`waiting_provider`), written with its next step."""
        writes.live = live_status(
            task, state, waiting_for=waiting_for, requests=self.requests, cost_micros=self.cost_micros
        )


@dataclass
class Waits:
    """The waits inside a run now open (a rate limit, a tool's limit, a provider), by what waits, since when
    (ms): each opened or closed on its task's timeline by a mark its next step writes."""

    open: dict[str, int] = field(default_factory=dict)

    def note(self, writes: RunWrites, reason: str, what: str, *, waiting: bool) -> bool:
        """Note a wait: the first refusal opens it, the answer that lets it go on closes it. Waits that overlap
        (parallel tool calls) are one wait, from the first to open to the last to close. True when this call
        opened or closed the wait: the caller writes the step then, so `waiting_for` is true while the wait
        lasts, and only then (two round trips a wait, none for a call that did not wait)."""
        now_ms = int(time.time() * 1000)
        if waiting and what not in self.open:
            opened = not self.open
            if opened:
                writes.marks.append(Mark(t_ms=now_ms, state=f"{WAIT_PREFIX}{reason}"))
            self.open[what] = now_ms
            return opened
        if not waiting and self.open.pop(what, None) is not None and not self.open:
            writes.marks.append(Mark(t_ms=now_ms, state="running"))
            return True
        return False


class Steps(Protocol):
    """The part of a run a port may touch: what its next step writes, and writing it."""

    # Set when a cost it recorded took its tenant's day to the quota (coordinator/quotas.py): it stops next.
    tenant_over_day: bool

    @property
    def task(self) -> TaskRecord: ...

    @property
    def token(self) -> str: ...

    @property
    def writes(self) -> RunWrites: ...

    @property
    def step(self) -> StepState: ...

    @property
    def live(self) -> LiveFigures: ...

    @property
    def waits(self) -> Waits: ...

    def flush(self, *, or_stop: bool = False) -> Stepped:
        """Write what the run did since its last step (`or_stop`: raise `RunStopped` if its task was stopped)."""
        ...

    def stepped(self, reply: Stepped, *, keep: bool) -> Stepped:
        """A step a port sent itself was answered: what it wrote is gone from `writes`."""
        ...

    def say(self, kind: str, text: str) -> None: ...


def lose_lease(run: Steps) -> NoReturn:
    """A write of the run's own was refused because the run stalled past its lease's lapse: it must not write
    again, and ends as lost (`LeaseLost`): the newer run of its task owns the task now."""
    run.step.fenced = True
    raise LeaseLost(run.task.id)


@contextmanager
def fenced_writes(run: Steps) -> Iterator[None]:
    """A write of the run's own that is not a step, refused as `FencedError` (a delegation, a todo update, an
    approval's park), ends the run as lost (`lose_lease`)."""
    try:
        yield
    except FencedError:
        lose_lease(run)
