"""The run-lifecycle seam: everything a worker needs from the coordinator for one run of a task.

The worker's runner drives the agent loop and nothing else; each step that
touches shared state is one call here, or on one of the run's ports
(coordinator/ports/: each worker concern a small object with its own narrow
reach into the store), in this order:

    run = lifecycle.start(task_id)        admit, lease, count the delivery, live 'running'
    run.history() / run.approvals.answers()  the persisted conversation, and the answers to its open calls
    run.check_stop() / run.limits.rate_wait_ms()  before each model request: a stop or spent budget, the rate limit
    run.provider.gate() / .failed() / .park()     its model's endpoints, as the fleet sees them
    run.record_response(...)              after each: usage and cost (once per request key), live status
    run.save(...) / run.say(...)          new conversation messages, UI messages
    run.compaction.keep(...)              a compaction of what the model reads, kept beside the journal
    run.journal.keep_calls() / .record()  a response kept before a call that must not run twice; each result as it returns
    run.plan.update_todos / .delegate     the orchestration tools
    run.approvals.park(calls)             tool calls that wait for a human decision
    run.end(outcome)                      finish, release the lease, free the slot, write back, resume

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

This module holds a run's whole life, so a reader follows it in one file: the
`Run` a worker holds, its steps and its end, and the `RunLifecycle` that starts
one. How a run ends (`Ended`, `Released`, or an exception that ends it without
one) and what it holds between steps are coordinator/ports/steps.py's, shared
with its ports. What a run does
between steps (conversation messages, UI messages, each response's usage and
live status) is kept in `Run.writes` and written by its next step in the same
round trip (each response's latency goes to the process's heartbeat, which adds
it to the fleet's histogram at its next beat: coordinator/heartbeat.py): the check before each model request after the first
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
from typing import TYPE_CHECKING

from coordinator import admission, approvals, budgets, delegation, dispatch, faults, quotas, writeback
from coordinator.approvals import ToolCall
from coordinator.errors import NotFoundError, StoreError
from coordinator.heartbeat import Heartbeat
from coordinator.models import (
    Mark,
    Outcome,
    RunWrites,
    Spend,
    SubtaskResult,
    TaskRecord,
    TaskStatus,
    Usage,
    live_status,
)
from coordinator.ports import (
    ApprovalPort,
    CompactionPort,
    Ended,
    HandBack,
    LeaseLost,
    LimitsPort,
    PlanPort,
    ProviderPort,
    Released,
    RunStopped,
    StepState,
    ToolJournal,
)
from coordinator.ports.steps import LIVE_EVERY_S, LiveFigures, Waits
from coordinator.replies import HOST, MODEL, Ending, EndpointState, Stepped
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
    "EndpointState",
    "HandBack",
    "LeaseLost",
    "Released",
    "Run",
    "RunHooks",
    "RunLifecycle",
    "RunStopped",
    "StepState",
    "StopCheck",
    "ToolCall",
]

log = logging.getLogger(__name__)

# -- one run -------------------------------------------------------------------------------

# A summary is what the parent reads back; the full text stays in the conversation.
MAX_SUMMARY_CHARS = 4000


class Run:
    """One run of one task, holding its lease; ended once by `end` (or `abandon` on a store failure).

    The run keeps its life (start, each step's checks, the end) and hands each worker concern to a
    port (coordinator/ports/): `provider`, `limits`, `journal`, `compaction`, `plan`, `approvals`.
    """

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
        self._admission = lifecycle.limits
        plane = self._plane = lifecycle.plane
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
        self.live = LiveFigures(requests=task.requests, cost_micros=task.total_cost_micros)
        # The waits inside the run now open (a rate limit, a tool's limit, its provider).
        self.waits = Waits()
        self.deliveries = 0
        # Runs of this task ever: request keys `<run_seq>:<request no>` stay unique across resumes.
        self.run_seq = 0
        # Its tenant's day of spend reached its quota with one of its responses: it stops its tree next, if the
        # day is still over it then (`day_spent_micros`: the figure its stop names). A tenant with a day quota may
        # be over it already when the run starts (a retry, or a caller's delegation, of a tree the day stopped):
        # its first check reads the day before the first request, which would otherwise go ahead.
        self.tenant_over_day = plane.tenants.policy(task.tenant).max_cost_micros_per_day > 0
        self.day_spent_micros: int | None = None
        # The worker's concerns, each a port with its own narrow reach into the store.
        self.provider = ProviderPort(self, plane)
        self.limits = LimitsPort(self, plane)
        self.journal = ToolJournal(self, plane)
        self.compaction = CompactionPort(self, plane)
        self.plan = PlanPort(self, lifecycle.coord, self._hooks)
        self.approvals = ApprovalPort(self, plane)

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

    # -- steps ----------------------------------------------------------------------------

    def flush(self, *, or_stop: bool = False) -> Stepped:
        """Write what the run did since its last step; its reply (the task's status, the topmost budget reached).

        Raises `LeaseLost` (nothing written) when another run owns the task now; with `or_stop`, `RunStopped`
        when its task was stopped meanwhile: a cancel lands between steps, and a tool of a stopped run must not
        write the plan, a delegation or an approval after it (the stop has already been shown as final).
        """
        reply = self.stepped(self._plane.store.runs.flush_run(self.task, self.token, self.writes), keep=False)
        if or_stop and TaskStatus(reply.status).terminal:
            raise RunStopped(self.task.id)
        return reply

    def stepped(self, reply: Stepped, *, keep: bool) -> Stepped:
        """A step was sent: what it wrote is gone from `writes`, and its reply is the run's state."""
        spends = self.writes.usage
        self.writes.clear()
        self.step.stepped(reply, keep=keep)
        if not reply.leased:
            self._owe_billed(spends)
            raise LeaseLost(self.task.id)
        if spends and reply.refused_spend:
            self._spent_before_the_stop(spends)
        return reply

    def _spent_before_the_stop(self, spends: list[Spend]) -> None:
        """A step that found its task stopped wrote none of its spend (a stop's figures are final at once), but
        the provider billed each response the run had: recorded after the stop, once, on the task, its
        ancestors and the plan items already written back (record_late_spend.lua).

        Raises StoreError when Redis refuses it (its delivery is retried, as for any step), after handing the
        spend to the process's heartbeat, which records it once Redis is back (as `abandon` does with the spend
        of a step Redis failed): the retried delivery finds the task stopped and runs nothing, so the spend lives
        nowhere else. A budget the record leaves reached stops its subtree (`budgets.stop_late`, which never
        raises)."""
        try:
            recorded = self._plane.store.runs.record_late_spend(self.task, spends)
        except StoreError:
            self._heartbeat.owe(self.task, spends, refused=True)
            raise
        if budgets.stop_late(self._plane, recorded.exhausted):  # now, not at a sibling's next step
            self._hooks.budget_stopped(self.task)

    # -- each model request -------------------------------------------------------------

    def must_stop_now(self, status: str) -> bool:
        """Whether the run must stop even in the middle of a model request, its task's status being `status`."""
        return self.fenced or self._heartbeat.out_of_grace() or TaskStatus(status).terminal

    def check_stop(self) -> StopCheck:
        """Whether the run must stop before its next request, and why (a budget's holder).

        Raises `LeaseLost` or `HandBack` when the run must end without an outcome of its own.
        """
        if self.fenced:
            raise LeaseLost(self.task.id)
        if self._heartbeat.draining:
            raise HandBack(self.task.id)
        if self._heartbeat.out_of_grace():
            return StopCheck(stopped=True)
        if self.tenant_over_day:  # budgets.stop names the tenant's quota when no budget of the tree is spent
            # Read again: the tool calls since the response may have taken minutes, in which the day's oldest hour
            # left it or its quota was raised; a stop then fell through to a budget nobody had spent.
            self.day_spent_micros = quotas.over_day_spend(self._plane, self.task)
            if self.day_spent_micros is not None:
                return StopCheck(stopped=True, budget_holder=self.task.root_id)
            self.tenant_over_day = False
        checks = self.step.take_checks()
        if checks is None:
            self.live.write(self.task, self.writes)  # the figures so far stay on show while the model thinks
            checks = self.flush()
            self.step.checked()  # the answers of subq's own tools are saved now
        if TaskStatus(checks.status).terminal:
            return StopCheck(stopped=True)
        return StopCheck(stopped=checks.exhausted is not None, budget_holder=checks.exhausted)

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
        self.writes.usage.append(Spend(request_key=key, usage=usage, cost_micros=cost_micros, cost_source=cost_source))
        if quotas.count_spend(self._plane, self.task, key, cost_micros):
            self.tenant_over_day = True  # its tenant's max_cost_usd_per_day: stop the tree before the next request
        self.step.responded()
        self._heartbeat.latencies.observe(latency_ms)  # the fleet's histogram, added at the process's next beat
        if self.live.responded(cost_micros, tool, text):
            self.live.write(self.task, self.writes)

    # -- the end ------------------------------------------------------------------------

    def stopped(self, budget_holder: str | None) -> Ended:
        """The outcome of a run that was stopped (a cancel, or a budget: its holder's subtree is stopped now)."""
        if self.fenced:
            raise LeaseLost(self.task.id)
        if self._heartbeat.draining and not self._stopped_by_status():
            raise HandBack(self.task.id)
        self.flush()  # what it spent before it stopped is recorded
        if budget_holder:
            budgets.stop(self._plane, budget_holder, day_spent_micros=self.day_spent_micros)
            self._hooks.budget_stopped(self.task)
        task = self._plane.store.records.get_task(self.task.id)
        return Ended(task.status.value if task.status.terminal else "cancelled", error=task.error)

    def _stopped_by_status(self) -> bool:
        """Whether its task was stopped (cancelled, or a budget over it is spent)."""
        status, _ = self._plane.store.records.status_of(self.task.id)
        return TaskStatus(status).terminal

    def end(self, outcome: Ended | Released) -> SubtaskResult:
        """Record the outcome, release the lease and the slot (in that order), write back or publish."""
        if self.fenced:
            raise LeaseLost(self.task.id)
        if isinstance(outcome, Released):
            return self._release_for(outcome)
        self.live.write(self.task, self.writes)  # always the last live status, with the final figures
        plane, task_id = self._plane, self.task.id
        # end_run.lua writes a child back onto its parent (and closes the batch when it is the last).
        span = self._hooks.span("subq.write_back" if self.task.batch_id else "subq.end_run", task_id=task_id)
        with span, self._heartbeat.ending(self):
            ending = plane.store.runs.end_run(
                self.task, self.token, self.writes, _outcome_fields(outcome), plane.settings.reconcile_grace_s,
                self._admission, stop_on_budget=outcome.status == "completed", fair=admission.fair(plane),
            )  # fmt: skip
        spends = self.writes.usage
        self.writes.clear()
        self.step.ended(ending)
        if ending.kind == "fenced":  # its lease lapsed: the end wrote nothing, the spend it held is owed
            self._owe_billed(spends)
            raise LeaseLost(task_id)
        late = bool(spends and ending.refused_spend)
        if late:
            self._spent_before_the_stop(spends)  # a stop landed since its last step: its end wrote no spend
        if ending.kind == "exhausted":
            # Its last response reached a budget: the holder's subtree is stopped, this run with it.
            return self.end(self.stopped(ending.holder))
        self._heartbeat.forget(self)
        if self.plan.delegation is not None:
            # It committed a delegation and ended rather than wait on it: its children are stopped
            # (`delegation.stop_unwaited`) before what the end sends (`_after_end`), which takes a chain step off
            # the due list; end_run.lua keeps the task due until this is done.
            ended = plane.store.records.get_task(task_id)
            delegation.stop_unwaited(plane, ended)
            plane.store.convergence.unwatch_ended(ended)
        self._after_end(ending)
        result = _result_of(task_id, ending, outcome)
        if late:  # the end's figures were read before the spend was recorded: the record's have it (its status
            # stays the end's: a retry may have run the task again since)
            record = plane.store.records.get_task(task_id)
            result = result.model_copy(update={"usage": record.usage, "cost_micros": record.cost_micros})
        return result

    def _release_for(self, outcome: Released) -> SubtaskResult:
        """The run ends before its task: save it, free the lease and the slot, then publish or wait."""
        plane, task_id = self._plane, self.task.id
        if outcome.state == "delegated":  # it waits on its children from now; its batch is published next
            self.writes.marks.append(Mark(t_ms=int(time.time() * 1000), state=f"{WAIT_PREFIX}children"))
        # Its live status says the wait in the step before the release, which writes it only while the run holds
        # the lease and the task has not ended: said after the release, it could land over a stop or over the
        # `running` of a newer run of the task (a decision, or its provider back, starts one at once).
        waiting = {"waiting_for": "provider", "until": outcome.wake_at_s} if outcome.state == "waiting_provider" else {}
        self.writes.live = live_status(self.task, outcome.state, **waiting)
        if TaskStatus(self.flush().status).terminal and outcome.state != "delegated":
            # Stopped since its last step (a cancel just after its calls were saved, say): it ends as a stop it
            # reads at a step does, rather than wait (a resume published for it, its live status over the
            # stop's). A delegation's release stops the children it committed (`publish_waiting`).
            return self.end(self.stopped(None))
        if outcome.state == "waiting_approval":
            faults.crash_point(plane.settings, "after-park")  # its calls saved, its lease and slots still held
        # A park on approvals is no loss: its delivery count starts again, as a provider's wait and a delegation
        # reset it in their own steps (the fourth resume of a task that asked thrice failed it as WorkerLost).
        provider = outcome.state == "waiting_provider"  # its timer publishes it: off the due list with the lease
        if not self._release(reset_deliveries=outcome.state == "waiting_approval", unwatch=provider):
            return self.lost()  # a newer run of the task started since its step: the task is that run's
        if outcome.state == "delegated" or self.plan.delegation is not None:
            # A delegation committed in the response that parked calls for a person is published too: its
            # children waited for the person's decision (the resume it publishes found the batch unpublished),
            # an hour by default, while the approval of one call was to let the others go on.
            delegation.publish_waiting(plane, plane.store.records.get_task(task_id))
        # Off the due list while a call waits for its person (the decision that ends the wait watches it again).
        # Every call decided while this run held the lease: the last decision published nothing (its delivery
        # would have found the lease held), so the release resumes the task, once per park with a decision made
        # since the lease was freed (`approvals.resume`), claimed by the park's first call, which this run made.
        elif outcome.state == "waiting_approval" and not plane.store.convergence.unwatch_parked(task_id):
            approvals.resume(plane, task_id, next(iter(self.approvals.parked), ""))
        if provider:
            # To Celery it is queued again, with a delay (the timer publishes it).
            return writeback.result_of(plane.store.records.get_task(task_id), pending="queued")
        return writeback.result_of(plane.store.records.get_task(task_id), pending=outcome.state)

    def _after_end(self, ending: Ending) -> None:
        """What the recorded end sends: the admitted runs, a chain's next step, a closed batch's parent."""
        plane, task_id = self._plane, self.task.id
        # The end is recorded; what it sends is not sent yet. Each message to send has its task on
        # the due list (a closed batch's parent, a chain step's child, an admitted run), so a
        # process that dies here leaves them to the reconciler.
        faults.crash_point(plane.settings, "after-end")
        admission.started_again(plane, ending.admitted)
        if ending.batch_mode == "sequential":
            (final,) = plane.store.records.get_records([task_id])
            writeback.write_back(plane, final.batch_id or "", ended=final)
            plane.store.convergence.unwatch_ended(final)  # end_run.lua left it on until the chain moved on
        elif ending.closed and self.task.parent_id:
            writeback.resumed(plane, self.task.parent_id, ending.resumes, ending.resume)

    def _owe_billed(self, spends: list[Spend]) -> None:
        """Responses the provider billed that a run which lost its lease holds (its step wrote nothing): its
        heartbeat records them (record_late_spend.lua, once per request key, this run's own keys), beside what the
        newer run spends making those requests again. Dropped before: the task's figures missed a billed
        response each time a lease lapsed under a run mid-request (a Redis outage longer than the lapse, a stall)."""
        if spends:
            self._heartbeat.owe(self.task, spends, refused=False)

    def _owe_held(self) -> None:
        """The spend the run holds for its next step, owed to its heartbeat (`_owe_billed`) and held no more."""
        self._owe_billed(self.writes.usage)
        self.writes.usage = []

    def lost(self) -> SubtaskResult:
        """The run lost its lease: another run owns the task; this one leaves everything else to it (its held
        spend is recorded: `_owe_held`)."""
        self._owe_held()
        log.warning("subq: the run of %s lost its lease and stopped without writing", self.task.id)
        self._heartbeat.forget(self)  # its run slot is the task's, which the new run holds now
        return writeback.result_of(self._plane.store.records.get_task(self.task.id), pending="running")

    def hand_back(self) -> SubtaskResult:
        """Queue the task again for another worker (its conversation is saved) and free this one."""
        plane = self._plane
        # Its timeline and live status: this run ends here and the task waits in the queue for the next, in a step
        # while the lease holds (a run that lost its lease writes neither, nor anything below: the task is the
        # newer run's, its delivery count too).
        self.writes.marks.append(Mark(t_ms=int(time.time() * 1000), state="queued"))
        self.writes.live = live_status(self.task, "queued")
        try:
            self.flush()
        except LeaseLost:
            return self.lost()
        plane.store.convergence.watch([self.task.id], plane.settings.reconcile_grace_s)  # a lost message: published
        # Handed back is not lost (SUBQ_MAX_DELIVERIES counts losses): its count starts again in the lease's own
        # release, where a run that started since (this one's lease lapsed) keeps its own.
        if not self._release(reset_deliveries=True):
            return self.lost()
        task = plane.store.records.get_task(self.task.id)
        if not task.status.terminal:
            dispatch.publish_again(plane.app, task, plane.store.convergence.next_repair(task.id))
            log.warning("subq: handed %s back to the queue", task.id)
        return writeback.result_of(task, pending="queued")

    def abandon(self) -> None:
        """The run failed outside the agent (Redis): free the lease and slot if Redis lets us; retried.

        The spend it held for its next step (responses the provider billed) goes to the process's heartbeat,
        which records it once Redis is back: the retried delivery makes those requests again, or finds its task
        stopped and runs nothing, and either way knows nothing of this run's. A step whose reply was lost after it
        ran had recorded it: recorded again by its request key, it is written once."""
        self._owe_held()
        try:
            self._release()
        except StoreError as exc:  # the lease lapses with its TTL; the original error is what matters
            log.warning("subq: could not release the run of %s: %s", self.task.id, exc)

    def _release(self, *, reset_deliveries: bool = False, unwatch: bool = False) -> bool:
        """Free the lease and the run slots; False, freeing nothing, when another run of the task started after
        this one's lease lapsed (a partition, a stall): that run holds the slots now (it reuses this run's)."""
        self._heartbeat.forget(self)
        runs = self._plane.store.runs
        if not runs.release_lease(self.task.id, self.token, reset_deliveries=reset_deliveries, unwatch=unwatch):
            return False
        admission.release(self._plane, self.task, token=self.token)
        return True


@dataclass(frozen=True)
class StopCheck:
    """The check before a model request: whether the run must stop, and the budget's holder when a budget
    stopped it (its subtree is stopped by `Run.stopped`)."""

    stopped: bool
    budget_holder: str | None = None


def _result_of(task_id: str, ending: Ending, outcome: Ended) -> SubtaskResult:
    """What `subq.run_task` returns for a run that ended its task."""
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


def _outcome_fields(outcome: Ended) -> Outcome:
    completed = outcome.status == "completed"
    return Outcome(
        status=outcome.status, summary=outcome.summary[:MAX_SUMMARY_CHARS], error=outcome.error,
        error_class=outcome.error_class,
        output_json=outcome.output_json if completed else "",  # only a completed task has data
        invalid_outputs=outcome.invalid_outputs,
        error_detail="" if completed else outcome.error_detail[:MAX_SUMMARY_CHARS],
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

    def budget_stopped(self, task: TaskRecord) -> None:
        """Spend of `task`'s run reached a budget and its holder's subtree was stopped: the run's last response, or
        a response recorded after its task was stopped (late spend, the run's own or its heartbeat's)."""


# -- starting runs ---------------------------------------------------------------------------


class RunLifecycle:
    """One per worker process: starts runs, renews their leases, settles batches, hands runs back."""

    def __init__(self, coord: Coordinator, worker_id: str | None = None, hooks: RunHooks | None = None) -> None:
        self.coord = coord
        self.plane = coord.plane  # what the rooms a run goes through are handed
        self.hooks = hooks or RunHooks()
        self.limits = admission.limits(self.plane)  # the settings' admission limits, read once
        self.heartbeat = Heartbeat(
            self.plane, worker_id or f"{socket.gethostname()}:{os.getpid()}", budget_stopped=self.hooks.budget_stopped
        )

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
        if started.verdict == "asked":
            # Its run parked a call that still waits for a person (this is its message delivered again): the
            # decision that ends the wait resumes it.
            return writeback.result_of(started.record, pending="waiting_approval")
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
        if plane.store.convergence.triage([task.id])[0].leased:
            # A duplicate while a live run of it holds the lease (it has just delegated, or a stop ended it and it
            # winds down): that run frees its slot and sends what follows. Freed here, a waiting sibling took the
            # slot beside the live run, past the per-parent and per-tree limits; should the run die, the
            # reconciler does this once its lease lapses.
            return writeback.result_of(task)
        if task.status.terminal:
            delegation.settle_ended(plane, task)  # redelivered, duplicated, or its run died after its end
            return writeback.result_of(task)
        admission.release_delegated(plane, task)  # delegated: a dead run left its slot taken,
        delegation.publish_waiting(plane, task)  # and perhaps its batch unpublished
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
