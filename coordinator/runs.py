"""The run-lifecycle seam: everything a worker needs from the coordinator for one run of a task.

The worker's runner drives the agent loop and nothing else; each step that
touches shared state is one call here, in this order:

    run = lifecycle.start(task_id)       admit, lease, count the delivery, live 'running'
    run.history() / run.answers()        the persisted conversation, and the answers to its open calls
    run.check_stop() / run.rate_wait_ms() before each model request: a stop or spent budget, the rate limit
    run.record_response(...)             after each: usage and cost (once per request key), live status
    run.save(...) / run.say(...)         new conversation messages, UI messages
    run.keep_compaction(...)             a compaction of what the model reads, kept beside the journal
    run.keep_calls() / record_tool_call  a response kept before a call that must not run twice; each result as it returns
    run.update_todos / run.delegate      the orchestration tools
    run.park(calls)                      tool calls that wait for a human decision
    run.end(outcome)                     finish, release the lease, free the slot, write back, resume

A run holds its task's lease for as long as its worker's heartbeat renews it
(`SUBQ_HEARTBEAT_LAPSE_S`, renewed every third of that by one thread per
process): a dead worker's leases lapse within seconds and the reconciler
(coordinator/reconciler.py) publishes those runs again. A run that finds its
lease gone stops at its next step and writes nothing more (`LeaseLost`: a
fence, so there are never two live runs of one task). A worker that is shutting
down (`drain`) hands each run back at its next step boundary (`HandBack`): the
conversation is saved after every response, so the next run goes on from there.

`end` records the outcome before it frees the run slot, so a finished child
never shows `running` beside the next one admitted. A task that ended writes
itself back at once (`writeback.write_back`, the one write-back entry point); a
delegated task publishes its committed batch only after its state is saved.
`start` returns a plain result instead of a `Run` when there is nothing to run:
the task ended (a redelivery), is delegated (publishing a batch a dead run left
unpublished), or must wait for a run slot.

This module holds a run's whole life, so a reader follows it in one file: how a
run ends (`Ended`, `Released`, or an exception that ends it without one), the
`Run` a worker holds, and the `RunLifecycle` that starts one. What a run does
between steps (conversation messages, UI messages, each response's usage,
latency and live status) is kept in `Run.writes` and written by its next step
in the same round trip: the check before each model request after the first
(`flush_run.lua`), a tool that writes state, or the end (`end_run.lua`, which
also makes the task terminal, releases the lease, writes the child back onto
its parent and closes the batch when it was the last). So a child that answers
in one response costs its worker two Redis round trips: its start and its end
(docs/benchmarks.md).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from coordinator import admission, approvals, budgets, delegation, dispatch, endpoints, faults, quotas, writeback
from coordinator.approvals import ToolCall
from coordinator.endpoints import HOST, MODEL, Gate
from coordinator.errors import NotFoundError, StoreError
from coordinator.heartbeat import Heartbeat
from coordinator.models import (
    Batch,
    DelegationMode,
    Ending,
    Outcome,
    RunWrites,
    Stepped,
    SubtaskResult,
    SubtaskSpec,
    TaskRecord,
    TaskStatus,
    TodoItem,
    ToolCallDone,
    Usage,
    live_status,
)
from coordinator.settings import Profile
from coordinator.timeline import WAIT_PREFIX

if TYPE_CHECKING:
    from coordinator.service import Coordinator

__all__ = [
    "HOST",
    "LIVE_EVERY_S",
    "MAX_SUMMARY_CHARS",
    "MODEL",
    "Ended",
    "Gate",
    "HandBack",
    "LeaseLost",
    "Released",
    "Run",
    "RunHooks",
    "RunInProgress",
    "RunLifecycle",
    "RunStopped",
    "ToolCall",
]

log = logging.getLogger(__name__)

# A tool's result, whatever it is (a string, a number, a pydantic model), as JSON for the journal.
ANY_RESULT: TypeAdapter[Any] = TypeAdapter(Any)

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


# -- one run -------------------------------------------------------------------------------

# A summary is what the parent reads back; the full text stays in the conversation.
MAX_SUMMARY_CHARS = 4000
# Live status carries an excerpt of the latest model text, not the whole of it.
LIVE_TEXT_CHARS = 200
# A run writes its live status (and the worker its Flower progress event) at most this often
# as responses arrive, and before each next model request, and at its end: a run that
# answers at once writes one, at its end.
LIVE_EVERY_S = 0.25


@dataclass
class StepState:
    """What a run's last step already did: one small state, changed by each step's typed reply
    (store/protocol.py's `Stepped`, `Ending`) and by what the run does between steps, and read by the
    check before its next model request (`Run.check_stop`) and by `keep_calls`.
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
        return cls(checks=Stepped(True, status, exhausted), announced=True)

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


class Run:
    """One run of one task, holding its lease; ended once by `end` (or `abandon` on a store failure)."""

    def __init__(
        self,
        lifecycle: RunLifecycle,
        task: TaskRecord,
        token: str,
        *,
        conversation: list[str] | None = None,
        exhausted: str | None = None,
    ) -> None:
        self._heartbeat = lifecycle.heartbeat
        self._hooks = lifecycle.hooks
        self._limits = lifecycle.limits
        self._coord = lifecycle.coord  # its todo operations are the service's
        self._plane = lifecycle.plane
        self.token = token
        self.task = task
        # What the run did since its last step: written by the next one (a check before a
        # model request, a tool that writes state, the end), in the same round trip.
        self.writes = RunWrites()
        # Read by the start already, so the first history() makes no call.
        self._conversation = conversation
        # What the last step already did: the start's reply first (its checks serve the first request).
        self.step = StepState.started(task.status.value, exhausted) if conversation is not None else StepState()
        # Live status is written at most every LIVE_EVERY_S (and always at the end).
        self._live_at_s = time.monotonic()
        self._live: dict[str, Any] | None = None  # the latest response's tool and text, until written
        self._requests = task.requests
        self._total_cost_micros = task.total_cost_micros
        self.deliveries = 0
        # Runs of this task ever: request keys `<run_seq>:<request no>` stay unique across resumes.
        self.run_seq = 0
        # Its tenant's day of spend reached its quota with one of its responses: it stops its tree next.
        self.tenant_over_day = False
        self.delegation: tuple[Batch, list[TaskRecord]] | None = None
        # The waits inside the run now open (a rate limit, a tool's limit), by what waits, since when (ms).
        self._waits: dict[str, int] = {}
        # When the task began waiting for its provider across runs (ms; 0: not waiting), read on first need.
        self._provider_wait_since_ms: int | None = None
        # The failed attempts of the request in flight, as counted on the task by this run (0: none).
        self._provider_attempts = 0

    @property
    def task_id(self) -> str:
        return self.task.id

    @property
    def fenced(self) -> bool:
        """The lease was lost (a step's reply said so, or the heartbeat did): the run must not write again."""
        return self.step.fenced

    @fenced.setter
    def fenced(self, value: bool) -> None:
        self.step.fenced = value

    @property
    def lost_too_often(self) -> Ended | None:
        """A run delivered more than SUBQ_MAX_DELIVERIES times (its worker kept dying) fails instead."""
        limit = self._plane.settings.max_deliveries
        if self.deliveries <= limit:
            return None
        error = f"lost with its worker {self.deliveries - 1} times (SUBQ_MAX_DELIVERIES={limit})"
        return Ended("failed", error=error, error_class="WorkerLost")

    def profile(self) -> Profile:
        return self._plane.settings.profile(self.task.profile)

    # -- the conversation ---------------------------------------------------------------

    def history(self) -> list[str]:
        """The persisted conversation, one JSON message an entry."""
        if self._conversation is not None:
            conversation, self._conversation = self._conversation, None
            return conversation
        return self._plane.store.records.conversation(self.task.id)

    def answers(self) -> tuple[Batch | None, dict[str, approvals.Decision]]:
        """What the run answers its open calls with: the batch it was resumed from, and decided approvals."""
        batch_id = self._plane.store.runs.resume_batch_id(self.task.id)
        batch = self._plane.store.batches.get_batch(batch_id) if batch_id else None
        return batch, approvals.decisions(self._plane, self.task.id)

    def save(self, entries: Sequence[str]) -> None:
        """New conversation messages, written (while the run holds its lease) at its next step."""
        if self.fenced:
            raise LeaseLost(self.task.id)
        self.writes.conversation.extend(entries)

    def announce_task(self) -> None:
        """A first run's opening UI message, the task's prompt (the start wrote it already, if it ran)."""
        if not self.step.announced:
            self.say("task", self.task.prompt)

    def say(self, kind: str, text: str) -> None:
        """A UI message of this task, as AI coding tools show a task's progress (written at the next step)."""
        self.writes.ui_messages.append(json.dumps({"ts": time.time(), "type": "say", "say": kind, "text": text}))

    def flush(self) -> tuple[str, str | None]:
        """Write what the run did since its last step; (the task's status, the topmost budget reached).

        Raises `LeaseLost` (nothing written) when another run owns the task now.
        """
        reply = self._stepped(self._plane.store.runs.flush_run(self.task, self.token, self.writes), keep=False)
        return reply.status, reply.exhausted

    def _stepped(self, reply: Stepped, *, keep: bool) -> Stepped:
        """A step was sent: what it wrote is gone from `writes`, and its reply is the run's state."""
        self.writes.clear()
        self.step.stepped(reply, keep=keep)
        if not reply.leased:
            raise LeaseLost(self.task.id)
        return reply

    def keep_calls(self) -> None:
        """Write the step that keeps the latest response before its tool calls run, unless a step did since
        (its live figures too, shown while the calls run): a run resumed after this worker dies finds the
        calls, and replays each that returned."""
        if not self.step.response_unwritten:
            return
        if self._live is not None:
            self._write_live()
        self.flush()

    # -- each model request -------------------------------------------------------------

    def must_stop_now(self, status: str) -> bool:
        """Whether the run must stop even in the middle of a model request, its task's status being `status`."""
        return self.fenced or self._heartbeat.out_of_grace() or TaskStatus(status).terminal

    def is_stopped_by_status(self) -> bool:
        """Whether its task was stopped (cancelled, or a budget over it is spent)."""
        status, _ = self._plane.store.records.status_of(self.task.id)
        return TaskStatus(status).terminal

    def check_stop(self) -> tuple[bool, str | None]:
        """(stopped, budget holder): whether the run must stop before its next request, and why.

        Raises `LeaseLost` or `HandBack` when the run must end without an outcome of its own.
        """
        if self.fenced:
            raise LeaseLost(self.task.id)
        if self._heartbeat.draining:
            raise HandBack(self.task.id)
        if self._heartbeat.out_of_grace():
            return True, None
        if self.tenant_over_day:  # budgets.stop names the tenant's quota when no budget of the tree is spent
            return True, self.task.root_id
        checks = self.step.take_checks()
        if checks is None:
            if self._live is not None:
                self._write_live()  # the figures so far stay on show while the model thinks
            checks = self._stepped(self._plane.store.runs.flush_run(self.task, self.token, self.writes), keep=False)
            self.step.checked()  # the answers of subq's own tools are saved now
        if TaskStatus(checks.status).terminal:
            return True, None
        return checks.exhausted is not None, checks.exhausted

    def rate_wait_ms(self, provider: str) -> int:
        wait_ms = admission.wait_for_rate(self._plane, provider)
        if self._note_wait("rate_limit", f"rate:{provider}", waiting=wait_ms > 0):
            self.flush()  # written as the wait begins and ends: the task says what it waits for while it does
        return wait_ms

    def tool_rate_wait_ms(self, pattern: str, rpm: int) -> int:
        """0 when a call of the tool glob `pattern` may start now under its fleet-wide `rpm`, else the ms to wait."""
        wait_ms = admission.wait_for_tool_rate(self._plane, pattern, rpm)
        if self._note_wait("tool_limit", f"tool:{pattern}", waiting=wait_ms > 0):
            self.flush()  # written as the wait begins and ends: the task says what it waits for while it does
        return wait_ms

    def take_tool_slot(self, pattern: str, limit: int, lease_s: float, tool_call_id: str) -> bool:
        """A fleet-wide slot of the tool glob `pattern` for this call, held until `free_tool_slot` or the lease."""
        member = f"{self.task.id}:{tool_call_id}"
        taken = admission.take_tool_slot(self._plane, pattern, limit, lease_s, member)
        if self._note_wait("tool_limit", f"slot:{member}", waiting=not taken):
            self.flush()  # written as the wait begins and ends: the task says what it waits for while it does
        return taken

    def _note_wait(self, reason: str, what: str, *, waiting: bool) -> bool:
        """Note a wait inside the run on its task's timeline: the first refusal opens it, the answer that lets
        it go on closes it (both marks go with the next step). Waits that overlap (parallel tool calls) are
        one wait, from the first to open to the last to close. True when this call opened or closed the wait:
        the caller writes the step then, so `waiting_for` is true while the wait lasts, and only then (two
        round trips a wait, none for a call that did not wait)."""
        now_ms = int(time.time() * 1000)
        if waiting and what not in self._waits:
            opened = not self._waits
            if opened:
                self.writes.marks.append((now_ms, f"{WAIT_PREFIX}{reason}"))
            self._waits[what] = now_ms
            return opened
        if not waiting and self._waits.pop(what, None) is not None and not self._waits:
            self.writes.marks.append((now_ms, "running"))
            return True
        return False

    def free_tool_slot(self, pattern: str, tool_call_id: str) -> None:
        admission.free_tool_slot(self._plane, pattern, f"{self.task.id}:{tool_call_id}")

    def record_response(
        self,
        request_no: int,
        usage: Usage,
        cost_micros: int,
        cost_source: str,
        *,
        latency_ms: float,
        tool: str | None,
        text: str,
    ) -> None:
        """One response's usage and cost (recorded once per request key at the next step), and live status."""
        key = f"{self.run_seq}:{request_no}"
        self.writes.usage.append((key, usage, cost_micros, cost_source))
        if quotas.count_spend(self._plane, self.task, key, cost_micros):
            self.tenant_over_day = True  # its tenant's max_cost_usd_per_day: stop the tree before the next request
        self.step.responded()
        self.writes.latencies_ms.append(latency_ms)
        self._requests += 1
        self._total_cost_micros += cost_micros
        self._live = {"tool": tool, "text": text[:LIVE_TEXT_CHARS] or None}
        if time.monotonic() - self._live_at_s >= LIVE_EVERY_S:
            self._write_live()

    def _write_live(self) -> None:
        """Put the pending live status (the latest response's) into the writes of the next step."""
        self._live_at_s = time.monotonic()
        self.writes.live = live_status(
            self.task, "running", **(self._live or {}), requests=self._requests, cost_micros=self._total_cost_micros
        )
        self._live = None

    # -- the tool-call journal ----------------------------------------------------------

    def record_tool_call(self, tool_call_id: str, tool: str, outcome: str, result: object = None, ms: int = 0) -> None:
        """A tool call returned (`result`, kept for a resume), or was answered without running (denied,
        interrupted: nothing kept): keep it now, not at the next step, so a run resumed after this worker
        died replays it instead of calling the tool again; count it on the task; and write the run's step
        with it, whose checks serve the next model request (one round trip).

        Raises `LeaseLost` (nothing written) when another run owns the task now.
        """
        kept = None if outcome in ("denied", "interrupted") else ANY_RESULT.dump_json(result, fallback=str).decode()
        done = ToolCallDone(tool_call_id, tool, outcome, kept, ms)
        self._stepped(self._plane.store.runs.record_tool_call(self.task, self.token, self.writes, done), keep=True)

    def record_tool_cost(self, tool_call_id: str, tool: str, cost_micros: int) -> None:
        """A call's price: the task's own spend (recorded once per call, at the next step, as a response's is)."""
        self.writes.usage.append((f"tool:{tool_call_id}", Usage(), cost_micros, f"tool:{tool}"))
        self._total_cost_micros += cost_micros

    def tool_results(self, tool_call_ids: Sequence[str]) -> tuple[dict[str, Any], set[str]]:
        """The kept results of these calls, for those that returned before the run's last worker died; and
        which human-approved calls had started (`mark_tool_started`)."""
        found, started = self._plane.store.runs.tool_results(self.task.id, tool_call_ids)
        return {call_id: json.loads(value) for call_id, value in found.items()}, started

    def mark_tool_started(self, tool_call_id: str) -> None:
        """A human-approved call starts: a resume after this worker dies must not take the approval as leave
        to run it again (one round trip, only for calls a human approved)."""
        self._plane.store.runs.mark_tool_started(self.task.id, tool_call_id)

    # -- compaction: what the model reads of the conversation (docs/context.md) --------------

    def compactions(self) -> list[str]:
        """The task's compaction records (JSON), oldest first: a resumed run sends the view they make."""
        return self._plane.store.compaction.records(self.task.id)

    def keep_compaction(self, number: int, record: str, text: str) -> bool:
        """Keep compaction `number` beside the journal, with its `context_compacted` UI line and its timeline
        mark, in one step that writes only while the run holds its lease. What the run did since its last
        step is written first: the journal the record covers, and the summariser's usage (a summary is never
        paid for without being counted). False when that number was kept already (nothing written).

        Raises `LeaseLost` (nothing written) when another run owns the task now.
        """
        self.flush()
        ui = json.dumps({"ts": time.time(), "type": "say", "say": "context_compacted", "text": text})
        kept = self._plane.store.compaction.keep(self.task, self.token, number, record, ui)
        if kept == "fenced":
            self.fenced = True
            raise LeaseLost(self.task.id)
        faults.crash_point(self._plane.settings, "after-compaction")
        return kept == "kept"

    def transient_errors(self, lines: Sequence[str]) -> None:
        """Requests sent and failed transiently, to be sent again: each counted on the task (`transient_errors`)
        and told in a `retry` UI line with the request's attempt number, both kept on the task across parks."""
        if not lines:
            return
        self.flush()
        _, attempts = self._plane.store.endpoints.count_transient_errors(self.task.id, len(lines))
        self._provider_attempts = attempts
        for number, what in enumerate(lines, start=attempts - len(lines) + 1):
            self.say("retry", f"{what}: retrying (attempt {number})")

    # -- the provider's endpoint, as the fleet sees it (coordinator/endpoints.py) -------------

    def endpoint_gate(self, endpoint: str, model: str) -> Gate:
        """Whether the next request to `model` may go to `endpoint` now (its host's view and the model's, one
        round trip); this run may become a view's probe."""
        return endpoints.gate(self._plane, endpoint, model, self.token)

    def endpoint_failed(self, endpoint: str, model: str, error: str, asked_s: float | None) -> Gate:
        """A request to `endpoint` failed transiently: the view it marks (`model`'s, or with "" the host's) is
        down for the fleet; how long to wait."""
        return endpoints.failed(self._plane, endpoint, model, error, asked_s)

    def endpoint_answered(self, endpoint: str, model: str, *, was_down: bool) -> None:
        """`endpoint` answered a request to `model` (with "": answered, of a model whose view stays down): the
        fleet forgets those views' failures (only if they had some: the healthy path costs nothing), and wakes
        the runs parked on them."""
        if was_down:
            endpoints.recovered(self._plane, endpoint, model)

    def provider_wait_over(self) -> None:
        """A response arrived: a task whose run had given its worker back to wait forgets when its wait began,
        and its request's failed attempts (once a run: a run woken from a park may not have read them)."""
        if self._provider_wait_since_ms != 0 or self._provider_attempts:
            self._plane.store.endpoints.clear_wait(self.task.id)
        self._provider_wait_since_ms = 0
        self._provider_attempts = 0

    def provider_wait_since_ms(self) -> int | None:
        """When this task began waiting for its provider, if an earlier run of it gave its worker back to wait."""
        if self._provider_wait_since_ms is None:
            self._provider_wait_since_ms = self._plane.store.endpoints.wait_since_ms(self.task.id) or 0
        return self._provider_wait_since_ms or None

    def provider_waiting(self, endpoint: str, *, waiting: bool) -> None:
        """Open (or close) a `wait:provider` on the task's timeline, and say so in its live status."""
        opened = f"endpoint:{endpoint}" not in self._waits
        self._note_wait("provider", f"endpoint:{endpoint}", waiting=waiting)
        if waiting and opened:  # shown now, not after the wait: the step is written at once
            self.writes.live = live_status(
                self.task, "waiting_provider", waiting_for="provider", requests=self._requests,
                cost_micros=self._total_cost_micros,
            )  # fmt: skip
            self.flush()

    def wait_for_provider(self, endpoint: str, model: str, wake_at_s: float, since_ms: int) -> Released:
        """The run gives its worker back until `wake_at_s` (or until the view of `endpoint` it waits for,
        `model`'s or with "" its host's, is back): its timer is set first, then `end` saves it and frees its
        lease and slot."""
        self.provider_waiting(endpoint, waiting=True)
        endpoints.park(self._plane, self.task, endpoint, model, wake_at_s, since_ms)
        return Released("waiting_provider", wake_at_s=wake_at_s)

    # -- the orchestration tools --------------------------------------------------------

    def todos(self) -> list[TodoItem]:
        """The task's plan as stored (the offline planner reads it before each request)."""
        return self._coord.get_todos(self.task.id)

    def update_todos(self, update: str | Sequence[object]) -> list[TodoItem]:
        self._flush_unless_stopped()  # the conversation that asked for it is saved first
        updated = self._coord.update_todos(self.task.id, update)
        self.step.wrote_own_state()  # its answer has no journal: the step before the next request saves it
        return updated

    def delegate(
        self, subtasks: Sequence[SubtaskSpec], mode: DelegationMode | str, tool_call_id: str
    ) -> tuple[Batch, list[TaskRecord]]:
        """Commit a delegation; it is published by `end` once the conversation is saved."""
        self._flush_unless_stopped()  # a resumed run must find the call that made the delegation in its history
        with self._hooks.span("subq.delegate", task_id=self.task.id, children=len(subtasks), mode=str(mode)):
            self.delegation = delegation.commit(self._plane, self.task.id, subtasks, mode, tool_call_id)
        return self.delegation

    def _flush_unless_stopped(self) -> None:
        """Before a tool writes state: write the run's step, and stop if its task was stopped meanwhile.

        A cancel lands between steps; a tool of a stopped run must not write the plan, a
        delegation or an approval after it (the stop has already been shown as final).
        """
        status, _ = self.flush()
        if TaskStatus(status).terminal:
            raise RunStopped(self.task.id)

    def park(self, calls: Sequence[ToolCall]) -> list[str]:
        """Queue tool calls for a decision; returns the approval ids."""
        # Its task waits on a person from now (written with this step): a decision may come before the run ends.
        self.writes.marks.append((int(time.time() * 1000), f"{WAIT_PREFIX}approval"))
        self._flush_unless_stopped()
        return [a.id for a in approvals.park(self._plane, self.task, calls)]

    # -- the end ------------------------------------------------------------------------

    def stopped(self, budget_holder: str | None) -> Ended:
        """The outcome of a run that was stopped (a cancel, or a budget: its holder's subtree is stopped now)."""
        if self.fenced:
            raise LeaseLost(self.task.id)
        if self._heartbeat.draining and not self.is_stopped_by_status():
            raise HandBack(self.task.id)
        self.flush()  # what it spent before it stopped is recorded
        if budget_holder:
            budgets.stop(self._plane, budget_holder)
            self._hooks.budget_stopped(self)
        task = self._plane.store.records.get_task(self.task.id)
        return Ended(task.status.value if task.status.terminal else "cancelled", error=task.error)

    def end(self, outcome: Ended | Released) -> SubtaskResult:
        """Record the outcome, release the lease and the slot (in that order), write back or publish."""
        plane, task_id = self._plane, self.task.id
        if self.fenced:
            raise LeaseLost(task_id)
        if isinstance(outcome, Released):
            if outcome.state == "delegated":  # it waits on its children from now; its batch is published next
                self.writes.marks.append((int(time.time() * 1000), f"{WAIT_PREFIX}children"))
            self.flush()
            self._release()
            if outcome.state == "delegated":
                delegation.publish_waiting(plane, plane.store.records.get_task(task_id))
            else:  # waiting for a decision or its provider: each decision (or its timer) watches it again
                plane.store.convergence.unwatch([task_id])
            if outcome.state == "waiting_provider":
                plane.store.events.set_live(self.task, outcome.state, waiting_for="provider", until=outcome.wake_at_s)
                # To Celery it is queued again, with a delay (the timer publishes it).
                return writeback.result_of(plane.store.records.get_task(task_id), pending="queued")
            plane.store.events.set_live(self.task, outcome.state)
            return writeback.result_of(plane.store.records.get_task(task_id), pending=outcome.state)
        if self._live is not None:
            self._write_live()  # always the last live status, with the final figures
        # end_run.lua writes a child back onto its parent (and closes the batch when it is the last).
        with self._hooks.span("subq.write_back" if self.task.batch_id else "subq.end_run", task_id=task_id):
            ending = plane.store.runs.end_run(
                self.task, self.token, self.writes, _outcome_fields(outcome), plane.settings.reconcile_grace_s,
                self._limits, stop_on_budget=outcome.status == "completed", fair=admission.fair(plane),
            )  # fmt: skip
        self.writes.clear()
        self.step.ended(ending)
        if ending.kind == "fenced":
            raise LeaseLost(task_id)
        if ending.kind == "exhausted":
            # Its last response reached a budget: the holder's subtree is stopped, this run with it.
            return self.end(self.stopped(ending.holder))
        self._heartbeat.forget(self)
        if outcome.error_detail and ending.status == outcome.status:
            plane.store.runs.set_error_detail(task_id, outcome.error_detail[:MAX_SUMMARY_CHARS])
        # The end is recorded; what it sends is not sent yet. Each message to send has its task on
        # the due list (a closed batch's parent, a chain step's child, an admitted run), so a
        # process that dies here leaves them to the reconciler.
        faults.crash_point(plane.settings, "after-end")
        admission.started_again(plane, ending.admitted)
        if ending.batch_mode == "sequential":
            (final,) = plane.store.records.get_records([task_id])
            writeback.write_back(plane, final.batch_id or "", ended=final)
            plane.store.convergence.unwatch([task_id])  # end_run.lua left it on the due list until the chain moved on
        elif ending.closed and self.task.parent_id:
            writeback.resumed(plane, self.task.parent_id, ending.resumes, ending.resume)
        taken = ending.status == "completed" and outcome.status == "completed" and outcome.output_json
        return SubtaskResult(
            child_id=task_id,
            status=ending.status,  # type: ignore[arg-type]
            summary=ending.summary,
            usage=ending.usage,
            cost_micros=ending.cost_micros,
            error=ending.error or None,
            error_class=ending.error_class or None,
            output=json.loads(outcome.output_json) if taken else None,
        )

    def lost(self) -> SubtaskResult:
        """The run lost its lease: another run owns the task; this one leaves everything to it."""
        log.warning("subq: the run of %s lost its lease and stopped without writing", self.task.id)
        self._heartbeat.forget(self)  # its run slot is the task's, which the new run holds now
        return writeback.result_of(self._plane.store.records.get_task(self.task.id), pending="running")

    def hand_back(self) -> SubtaskResult:
        """Queue the task again for another worker (its conversation is saved) and free this one."""
        plane = self._plane
        plane.store.convergence.watch(
            [self.task.id], plane.settings.reconcile_grace_s
        )  # a lost message is published again
        plane.store.runs.reset_deliveries(self.task.id)  # handed back is not lost: SUBQ_MAX_DELIVERIES counts losses
        # Its timeline: this run ends here and the task waits in the queue for the next (a step while the lease holds).
        self.writes.marks.append((int(time.time() * 1000), "queued"))
        self.flush()
        self._release()
        task = plane.store.records.get_task(self.task.id)
        if not task.status.terminal:
            dispatch.publish_again(plane.app, task, plane.store.convergence.next_repair(task.id))
            plane.store.events.set_live(task, "queued")
            log.warning("subq: handed %s back to the queue", task.id)
        return writeback.result_of(task, pending="queued")

    def abandon(self) -> None:
        """The run failed outside the agent (Redis): free the lease and slot if Redis lets us; retried."""
        try:
            self._release()
        except StoreError as exc:  # the lease lapses with its TTL; the original error is what matters
            log.warning("subq: could not release the run of %s: %s", self.task.id, exc)

    def _release(self) -> None:
        self._heartbeat.forget(self)
        self._plane.store.runs.release_lease(self.task.id, self.token)
        admission.release(self._plane, self.task)


def _outcome_fields(outcome: Ended) -> Outcome:
    output = outcome.output_json if outcome.status == "completed" else ""  # only a completed task has data
    return Outcome(
        outcome.status, outcome.summary[:MAX_SUMMARY_CHARS], outcome.error, outcome.error_class, output,
        outcome.invalid_outputs,
    )  # fmt: skip


# -- what a process attaches to a run's life ------------------------------------------------


class RunHooks:
    """What a process attaches to a run's life: the lifecycle calls these at its steps and holds
    no metrics, trace or log code of its own. The worker attaches its Prometheus counters, its
    log fields and its trace spans (workers/observe.py); these defaults do nothing."""

    def started(self, run: Run) -> None:
        """A run holds its task's lease now."""

    def span(self, name: str, **attributes: str | int | bool) -> AbstractContextManager[object]:
        """Around a step that writes shared state: `subq.delegate`, `subq.end_run`, `subq.write_back`."""
        return nullcontext()

    def budget_stopped(self, run: Run) -> None:
        """The run's last response reached a budget: its holder's subtree was stopped."""


# -- starting runs ---------------------------------------------------------------------------


class RunInProgress(Exception):
    """Another delivery of this task is running it now; this one is retried later."""


class RunLifecycle:
    """One per worker process: starts runs, renews their leases, settles batches, hands runs back."""

    def __init__(self, coord: Coordinator, worker_id: str | None = None, hooks: RunHooks | None = None) -> None:
        self.coord = coord
        self.plane = coord.plane  # what the rooms a run goes through are handed
        self.hooks = hooks or RunHooks()
        self.limits = admission.limits(self.plane)  # the settings' admission limits, read once
        self.heartbeat = Heartbeat(self.plane, worker_id or f"{socket.gethostname()}:{os.getpid()}")

    def start(self, task_id: str) -> Run | SubtaskResult:
        """A `Run` holding the task's lease, or the result to return when there is nothing to run."""
        plane = self.plane
        token = secrets.token_hex(8)
        try:
            lapse_s, look_again_s = plane.settings.heartbeat_lapse_s, plane.settings.reconcile_interval_s
            started = plane.store.runs.begin_run(
                task_id, token, lapse_s, look_again_s, self.limits, admission.fair(plane)
            )
        except NotFoundError as exc:
            return _unknown(task_id, exc)
        assert started.record is not None
        if started.verdict == "other":
            return self._nothing_to_run(started.record)
        if started.verdict in ("wait", "delay", "park"):
            admission.must_wait(plane, started.record, started.delay_ms, started.parked_for, started.admitted)
            return writeback.result_of(started.record, pending="queued")
        if started.verdict == "leased":
            # A live run holds it and will end it; a dead one's lease lapses and the
            # reconciler publishes the task again, so this delivery has nothing to do.
            return writeback.result_of(started.record, pending="running")
        run = Run(self, started.record, token, conversation=started.conversation, exhausted=started.exhausted)
        run.deliveries, run.run_seq = started.deliveries, started.run_seq
        self.heartbeat.hold(run)
        self.hooks.started(run)
        return run

    def _nothing_to_run(self, task: TaskRecord) -> SubtaskResult:
        """A delivery of a task that is not an agent's to run now: refused, ended, or delegated."""
        plane = self.plane
        if task.runner != "agent":
            error = f"task {task.id} is owned by its caller (runner {task.runner!r}), not run by an agent"
            log.error("subq.run_task refused: %s", error)
            return SubtaskResult(child_id=task.id, status="failed", error=error, error_class="StateError")
        if task.status.terminal:
            # Redelivered, duplicated, stopped before it started, or its run died after
            # ending it: free a slot it may hold, write it back (once: idempotent), forget it.
            admission.release(plane, task)
            if task.batch_id:
                writeback.write_back(plane, task.batch_id, ended=task)
            plane.store.convergence.unwatch([task.id])
            return writeback.result_of(task)
        delegation.publish_waiting(plane, task)  # delegated: a batch a dead run left unpublished
        return writeback.result_of(task)

    def must_stop(self, runs: Sequence[Run]) -> list[Run]:
        """The runs among `runs` that must stop now, even mid-request; one Redis read for all of them.

        A task that is gone (its tree expired or was deleted) stops its run too.
        """
        statuses = self.plane.store.records.statuses_of([run.task_id for run in runs])
        return [run for run, status in zip(runs, statuses, strict=True) if run.must_stop_now(status or "cancelled")]

    def stops_so_far(self) -> int:
        """A count that moves whenever a task is stopped (cancel, budget, chain): one small read."""
        return self.plane.store.records.stops_so_far()

    def must_stop_here(self, runs: Sequence[Run]) -> list[Run]:
        """The runs among `runs` that must stop for a reason of this process alone (fenced, out of grace)."""
        return [run for run in runs if run.must_stop_now(TaskStatus.ACTIVE)]

    def settle_batch(self, batch_id: str) -> bool:
        """A chain step: write back what has ended; True when it closed."""
        return writeback.write_back(self.plane, batch_id)

    def drain(self, grace_s: float) -> None:
        """The worker is shutting down: every run hands itself back within `grace_s`."""
        self.heartbeat.drain(grace_s)


def _unknown(task_id: str, exc: NotFoundError) -> SubtaskResult:
    log.error("subq.run_task for an unknown task %r: %s", task_id, exc)
    return SubtaskResult(child_id=task_id, status="failed", error=str(exc), error_class="NotFoundError")
