"""A run's state: deliveries and leases, once-only claims, usage and budgets, admission, rate limits."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.errors import NotFoundError
from coordinator.ids import root_of
from coordinator.models import AdmissionLimits, Outcome, RunWrites, Spend, TaskRecord, ToolCallDone, Usage
from coordinator.replies import Ending, LateSpendRecorded, Stepped, UsageRecorded
from coordinator.store.base import (
    EVENTS_MAXLEN,
    Part,
    StoreCore,
    _strs,
    hash_reply,
    outbox_keys,
    tool_field,
    translate_redis_errors,
)
from coordinator.store.fair import NO_FAIR_SHARES, FairShares, fair_args, fair_keys
from coordinator.store.fields import TaskField
from coordinator.store.protocol import (
    ClaimResume,
    EndRun,
    FinishTask,
    FlushRun,
    FreeToolSlot,
    MarkToolStarted,
    RateLimit,
    RecordLateSpend,
    RecordTool,
    RecordUsage,
    ReleaseLease,
    ReleaseSlot,
    RunKeys,
    SetWaitingApprovals,
    StartRun,
    StepWrites,
    ToolSlot,
    UsageArgs,
)
from coordinator.store.records import RecordStore, decode_record

__all__ = ["ADMISSION_SCAN", "Ending", "RunStore", "Started"]


def _usage_args(spends: Sequence[Spend]) -> list[UsageArgs]:
    """Each response's usage (or a tool call's price) as the scripts read it."""
    return [UsageArgs.of(s.request_key, s.usage, s.cost_micros, s.cost_source) for s in spends]


def _step_writes(writes: RunWrites) -> StepWrites:
    """What a run did since its last step, as flush_run.lua (and end_run.lua after its own ARGV) reads it."""
    return StepWrites(
        live=writes.live, conversation=writes.conversation, ui_messages=writes.ui_messages,
        usage=_usage_args(writes.usage),
        marks=writes.marks,
    )  # fmt: skip


# The journal field that says a human-approved call started (`started:<tool call id>`).
TOOL_STARTED = "started:"
# How far down the admission list one freed slot looks for a task that now fits.
ADMISSION_SCAN = 50


@dataclass(frozen=True)
class Started:
    """What `begin_run` found: `verdict` 'run' (the lease is the caller's), 'missing', 'other', 'leased',
    'asked' (a call its run parked waits for a person), 'wait' (queued for a run slot of its tree), 'park' (parked for a fleet slot of its tenant: fair shares) or
    'delay' (admitted after `delay_ms`: the caller restarts it then)."""

    verdict: str
    record: TaskRecord | None = None
    deliveries: int = 0
    run_seq: int = 0
    exhausted: str | None = None
    conversation: list[str] = field(default_factory=list)
    delay_ms: int = 0
    parked_for: str = ""  # 'park': why its tenant's fleet slot was refused (max_running, share, fleet, order)
    admitted: list[str] = field(default_factory=list)  # 'park': the parked runs given the slot instead


class RunStore(Part):
    """What one run of a task reads and writes, from its start to its terminal status.

    It reads through the records part it is handed (`RunStore(core, records, budget_warn_at)`): the usage
    roll-up reads the ancestors, and the in-flight figures walk the tree's tasks. `budget_warn_at`
    (SUBQ_BUDGET_WARN_AT) is the share of a budget whose crossing the step that records the spend
    sends as `budget.warning` (record_usage.lua).
    """

    def __init__(self, core: StoreCore, records: RecordStore, budget_warn_at: float) -> None:
        super().__init__(core)
        self.records = records
        self.budget_warn_at = budget_warn_at

    # -- a run's hot path: start, steps, end, one round trip each -----------------------

    @translate_redis_errors
    def begin_run(
        self,
        task_id: str,
        token: str,
        lease_s: int,
        look_again_s: float,
        limits: AdmissionLimits,
        fair: FairShares = NO_FAIR_SHARES,
    ) -> Started:
        """Start an agent task's run in one step (start_run.lua): admit, lease, count, due list, live status."""
        root, k = root_of(task_id), self.keys
        now = time.time()
        task_key, conversation_key = k.task(root, task_id), k.conversation(root, task_id)

        started, (fields, conversation) = self.scripts.then_read(
            StartRun(
                task=task_key, lease=k.lease(root, task_id), due=k.due(), live=k.live(root),
                events=k.events(root), ui_messages=k.ui_messages(root, task_id), running=k.running(root), admission=k.admission(root),
                last_start=k.last_start(root), fair=fair_keys(k), token=token, lease_s=lease_s, look_at=now + look_again_s, now=now,
                events_maxlen=EVENTS_MAXLEN, task_prefix=k.task(root, ""), per_parent=limits.per_parent,
                per_tree=limits.per_tree, stagger_ms=limits.stagger_ms, now_ms=int(now * 1000),
                retention_s=self.retention_s, running_children_prefix=k.running_children(root, ""),
                approval_prefix=k.approval(root, ""), fair_args=fair_args(k, fair),
            ),
            [("HGETALL", task_key), ("LRANGE", conversation_key, 0, -1)],
        )  # fmt: skip
        if started.verdict == "missing":
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        # The record as the step left it (its delivery counted, its timeline marked).
        record = decode_record(hash_reply(fields), [], [])
        if started.verdict in ("wait", "delay", "park"):
            return Started(
                started.verdict, record, delay_ms=started.delay_ms, parked_for=started.parked_for,
                admitted=list(started.admitted),
            )  # fmt: skip
        if started.verdict != "run":
            return Started(started.verdict, record)
        return Started("run", record, started.deliveries, started.run_seq, started.exhausted, _strs(conversation))

    def _run_keys(self, record: TaskRecord) -> RunKeys:
        root, k, task_id = record.root_id, self.keys, record.id
        return RunKeys(
            lease=k.lease(root, task_id), task=k.task(root, task_id), conversation=k.conversation(root, task_id),
            ui_messages=k.ui_messages(root, task_id), live=k.live(root), events=k.events(root),
        )  # fmt: skip

    def _flush(self, record: TaskRecord, token: str, writes: RunWrites) -> FlushRun:
        """flush_run.lua's call for a step of its own (not end_run's)."""
        return FlushRun(
            run=self._run_keys(record), outbox=outbox_keys(self.keys, record.root_id),
            ancestors=self._ancestor_keys(record), token=token, retention_s=self.retention_s, now=time.time(),
            events_maxlen=EVENTS_MAXLEN, by_end_run=0, budget_warn_at=self.budget_warn_at,
            writes=_step_writes(writes),
        )  # fmt: skip

    def _ancestor_keys(self, record: TaskRecord) -> list[str]:
        """The ancestors' hashes, parent first, root last (the order the usage roll-up walks)."""
        return [self.keys.task(record.root_id, a) for a in reversed(record.ancestors)]

    @translate_redis_errors
    def flush_run(self, record: TaskRecord, token: str, writes: RunWrites) -> Stepped:
        """Write a run's step (flush_run.lua): (still leased, the task's status, the topmost budget reached)."""
        return self.scripts(self._flush(record, token, writes))

    @translate_redis_errors
    def end_run(
        self,
        record: TaskRecord,
        token: str,
        writes: RunWrites,
        outcome: Outcome,
        resume_grace_s: float,
        limits: AdmissionLimits,
        *,
        stop_on_budget: bool,
        fair: FairShares = NO_FAIR_SHARES,
    ) -> Ending:
        """End a run in one step (end_run.lua): write, finish, release the lease and the slot, write back,
        close the batch if last.

        With `stop_on_budget`, a budget found reached ends nothing: the caller stops its holder's subtree first.
        """
        root, k, own = record.root_id, self.keys, self.keys.task(record.root_id, record.id)
        # Without a batch, the batch's keys are the task's own hash again (end_run.lua reads none of them);
        # without admission limits, so are the run slot's.
        parent = batch = ""
        if record.batch_id and record.parent_id:
            parent, batch = record.parent_id, record.batch_id
        admitted = limits.applies_to(record)
        slot_parent = record.parent_id or record.id
        now = time.time()
        steps = _step_writes(writes)
        if steps.live:
            # The run's latest live status made terminal here, so end_run.lua writes it as it is (JSON
            # decoded and encoded again in Lua cost a run's end about a tenth of its Redis CPU).
            live = {**json.loads(steps.live), "state": outcome.status, "ts": now}
            steps = dataclasses.replace(steps, live=json.dumps(live))
        return self.scripts(
            EndRun(
                run=self._run_keys(record), due=k.due(),
                parent=k.task(root, parent) if parent else own, todos=k.todos(root, parent) if parent else own,
                awaiting=k.awaiting(root, parent) if parent else own, batch=k.batch(root, batch) if batch else own,
                parent_ui=k.ui_messages(root, parent) if parent else own,
                lines=k.batch_lines(root, batch) if batch else own,
                running=k.running(root) if admitted else own, admission=k.admission(root) if admitted else own,
                parent_running=k.running_children(root, slot_parent) if admitted else own, outbox=outbox_keys(k, root),
                fair=fair_keys(k),
                ancestors=self._ancestor_keys(record), token=token, retention_s=self.retention_s, now=now,
                events_maxlen=EVENTS_MAXLEN, status=outcome.status, summary=outcome.summary, error=outcome.error,
                error_class=outcome.error_class, resume_grace_s=resume_grace_s, stop_on_budget=int(stop_on_budget), free_slot=int(admitted),
                per_parent=limits.per_parent, per_tree=limits.per_tree, task_prefix=k.task(root, ""),
                running_children_prefix=k.running_children(root, ""), admission_scan=ADMISSION_SCAN,
                # (One argument for both: only a completed task has data, only an unsuccessful end an error body.)
                kept=outcome.output_json or outcome.error_detail, invalid_outputs=outcome.invalid_outputs,
                budget_warn_at=self.budget_warn_at, fair_args=fair_args(k, fair), writes=steps,
            )
        )  # fmt: skip

    # -- starting a run ----------------------------------------------------------------

    @translate_redis_errors
    def release_lease(self, task_id: str, token: str, *, reset_deliveries: bool = False, unwatch: bool = False) -> bool:
        """Free the run's lease if it still holds it; False when another run of the task has started since (the
        slots are that run's then). With `reset_deliveries`, the task's delivery count starts again, in the same
        step and only if the run is still the task's last; with `unwatch`, the task leaves the due list in the
        same step as the lease (its timer publishes it: a step after would take off the watch of the run its
        timer published in between, whose lost message then left the task to nobody)."""
        root = root_of(task_id)
        return self.scripts(
            ReleaseLease(
                lease=self.keys.lease(root, task_id), task=self.keys.task(root, task_id), due=self.keys.due(),
                token=token, reset_deliveries=int(reset_deliveries), unwatch=task_id if unwatch else "",
            )
        )  # fmt: skip

    @translate_redis_errors
    def claim_resume(self, task_id: str, reason_id: str) -> int:
        """Once-only: resume a task for one reason (an approval decided). The resume count its resumed
        run is published under, for the first caller; 0 for any other (claim_resume.lua)."""
        key = self.keys.task(root_of(task_id), task_id)
        return self.scripts(ClaimResume(task=key, field=TaskField.resumed(reason_id), token=uuid.uuid4().hex))

    @translate_redis_errors
    def claim_step_publish(self, task_id: str) -> bool:
        """Once-only: True for the first caller that publishes this task's run as a chain step."""
        return self.core.claim_once(self.keys.task(root_of(task_id), task_id), TaskField.PUBLISHED)

    @translate_redis_errors
    def step_published(self, task_id: str) -> bool:
        """Whether a caller has claimed this chain step's publish (`claim_step_publish`)."""
        return bool(self.client.hexists(self.keys.task(root_of(task_id), task_id), TaskField.PUBLISHED))

    @translate_redis_errors
    def resume_batch_id(self, task_id: str) -> str | None:
        """The batch whose result a resumed run answers its delegation call with, if any."""
        value = self.client.hget(self.keys.task(root_of(task_id), task_id), TaskField.RESUME_BATCH_ID)
        return str(value) if value else None

    @translate_redis_errors
    def set_waiting_approvals(self, task_id: str, approval_ids: Sequence[str], token: str = "") -> bool:
        """The approvals a run parked, as the task's list of those its last run asked for: only while the run of
        lease `token` holds the lease ('' for a park no run makes: not checked). Whether it was written."""
        root = root_of(task_id)
        return self.scripts(
            SetWaitingApprovals(
                lease=self.keys.lease(root, task_id), task=self.keys.task(root, task_id), token=token,
                approval_ids=json.dumps(list(approval_ids)),
            )
        )  # fmt: skip

    @translate_redis_errors
    def waiting_approval_ids(self, task_id: str) -> list[str]:
        """The approvals the task's last run asked for (decided or not)."""
        value = self.client.hget(self.keys.task(root_of(task_id), task_id), TaskField.WAITING_APPROVAL_IDS)
        return list(json.loads(str(value))) if value else []

    # -- usage, budgets and the end of a run -------------------------------------------

    @translate_redis_errors
    def record_usage(
        self,
        task_id: str,
        request_key: str,
        usage: Usage,
        cost_micros: int,
        cost_source: str,
        ancestors: Sequence[str] | None = None,
    ) -> UsageRecorded:
        """Record one request's usage on the task and roll it up the ancestors, once per key; a budget of the
        chain whose warning share it crosses has its `budget.warning` written in the same step.

        Returns `recorded` and `exhausted`: recorded is 1, 0 (a repeat of this key) or -1 (the
        task had ended: nothing is recorded after a stop); exhausted is the id of the
        task nearest the root whose budget the subtree has now reached, or None.
        `ancestors` (root first) may be passed by a caller that has the record, to save a read.
        """
        root = root_of(task_id)
        if ancestors is None:
            ancestors = self.records.ancestors(task_id)
        return self.scripts(
            RecordUsage(
                task=self.keys.task(root, task_id), outbox=outbox_keys(self.keys, root),
                ancestors=[self.keys.task(root, a) for a in reversed(ancestors)], request_key=request_key,
                tokens_in=usage.tokens_in, tokens_out=usage.tokens_out, cache_reads=usage.cache_reads,
                cache_writes=usage.cache_writes, cost_micros=cost_micros, cost_source=cost_source, now=time.time(),
                retention_s=self.retention_s, budget_warn_at=self.budget_warn_at,
            )
        )  # fmt: skip

    @translate_redis_errors
    def record_late_spend(
        self, record: TaskRecord, spends: Sequence[Spend], *, refused: bool = True
    ) -> LateSpendRecorded:
        """Record what a run spent before its task was stopped, which its step refused for the stop
        (record_late_spend.lua): on the task, up its ancestors, and on each plan item and line of the combined
        result already written back. Once per request key; how many were recorded now, and, when any was, the
        topmost task whose budget its subtree has reached (its caller stops it: `budgets.stop_late`). `refused`
        False: spend a worker kept when Redis failed the step that would have written it, which leaves the
        task's mark of spend still to record (`late_spend_at`) to the run that set it."""
        root = record.root_id
        return self.scripts(
            RecordLateSpend(
                task=self.keys.task(root, record.id), outbox=outbox_keys(self.keys, root),
                ancestors=self._ancestor_keys(record), now=time.time(), retention_s=self.retention_s,
                budget_warn_at=self.budget_warn_at, todos_prefix=self.keys.todos(root, ""),
                lines_prefix=self.keys.batch_lines(root, ""), clears_mark=int(refused),
                usage=_usage_args(spends),
            )
        )  # fmt: skip

    # -- the tool-call journal ---------------------------------------------------------

    @translate_redis_errors
    def record_tool_call(self, record: TaskRecord, token: str, writes: RunWrites, call: ToolCallDone) -> Stepped:
        """A tool call returned: keep its result (when it has one to keep) the moment it did, count it on its
        task (`tool:<tool>:<outcome>`, `tool:<tool>:ms`), and write the run's step (record_tool.lua): one round
        trip, answered as `flush_run` is."""
        return self.scripts(
            RecordTool(
                results=self.keys.tool_results(record.root_id, record.id), tool_call_id=call.tool_call_id,
                result=call.result_json or "", outcome_field=tool_field(call.tool, call.outcome),
                ms_field=tool_field(call.tool, "ms"), ms=call.ms, flush=self._flush(record, token, writes),
            )
        )  # fmt: skip

    @translate_redis_errors
    def mark_tool_started(self, task_id: str, tool_call_id: str, token: str) -> bool:
        """Note that a human-approved call starts running, so a resume after its worker died knows it may
        have taken effect (it has no result yet); only while the run of lease `token` holds the lease. False,
        with nothing written, when it does not: the call must not run."""
        root = root_of(task_id)
        return self.scripts(
            MarkToolStarted(
                lease=self.keys.lease(root, task_id), journal=self.keys.tool_results(root, task_id), token=token,
                field_name=f"{TOOL_STARTED}{tool_call_id}", retention_s=self.retention_s,
            )
        )  # fmt: skip

    @translate_redis_errors
    def tool_results(self, task_id: str, tool_call_ids: Sequence[str]) -> tuple[dict[str, str], set[str], set[str]]:
        """The recorded results of these calls (JSON), for those that have one; which were noted started; and
        which were answered without running (denied, interrupted: kept empty by record_tool.lua)."""
        if not tool_call_ids:
            return {}, set(), set()
        ids = list(tool_call_ids)
        found = self.client.hmget(
            self.keys.tool_results(root_of(task_id), task_id), [*ids, *(f"{TOOL_STARTED}{i}" for i in ids)]
        )
        kept = dict(zip(ids, found[: len(ids)], strict=True))
        results = {call_id: str(value) for call_id, value in kept.items() if value}
        answered = {call_id for call_id, value in kept.items() if value == ""}
        started = {call_id for call_id, value in zip(ids, found[len(ids) :], strict=True) if value is not None}
        return results, started, answered

    @translate_redis_errors
    def finish_task(self, task_id: str, status: str, summary: str = "", error: str = "", error_class: str = "") -> str:
        """Make a task terminal once; returns its status after the call."""
        root = root_of(task_id)
        result = self.scripts(
            FinishTask(
                task=self.keys.task(root, task_id), events=self.keys.events(root), live=self.keys.live(root),
                outbox=outbox_keys(self.keys, root), status=status, summary=summary, error=error, error_class=error_class, now=time.time(),
                retention_s=self.retention_s, events_maxlen=EVENTS_MAXLEN,
            )
        )  # fmt: skip
        if result is None:
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        return result

    # -- admission and rate limits -----------------------------------------------------

    @translate_redis_errors
    def release_slot(
        self,
        record: TaskRecord,
        limits: AdmissionLimits,
        *,
        while_status: str = "",
        while_run: str = "",
        while_asked: bool = False,
    ) -> list[str]:
        """Free the task's run slot and admit waiting tasks that now fit (release_slot.lua); the admitted ids.

        With `while_status`, only while the task's status is one of those (space-separated); with `while_run` (a
        run's token), only while that run is the task's last start; with `while_asked`, only while one of the
        calls it waits on is still pending (each checked in the same step)."""
        root, k = record.root_id, self.keys
        return self.scripts(
            ReleaseSlot(
                running=k.running(root), admission=k.admission(root),
                parent_running=k.running_children(root, record.parent_id or record.id), task_id=record.id,
                per_parent=limits.per_parent, per_tree=limits.per_tree, retention_s=self.retention_s,
                task_prefix=k.task(root, ""), running_children_prefix=k.running_children(root, ""),
                admission_scan=ADMISSION_SCAN, now=time.time(), while_status=while_status, while_run=while_run,
                while_asked=k.approval(root, "") if while_asked else None,
            )
        )  # fmt: skip

    @translate_redis_errors
    def running_ids(self, root_id: str) -> set[str]:
        """The tasks of the tree that hold a run slot (its running set)."""
        return set(_strs(self.client.smembers(self.keys.running(root_id))))

    @translate_redis_errors
    def in_flight(self, root_id: str) -> dict[str, int]:
        """Sizes of the tree's in-flight structures (empty once every run has ended)."""
        k = self.keys
        with self.client.pipeline(transaction=False) as pipe:
            pipe.scard(k.running(root_id))
            pipe.llen(k.admission(root_id))
            task_ids = self.records.tree_task_ids(root_id)
            for task_id in task_ids:
                pipe.scard(k.awaiting(root_id, task_id))
                pipe.exists(k.lease(root_id, task_id))
            pipe.zmscore(k.due(), task_ids or [root_id])
            running, admission, *rest, due = pipe.execute()
        return {"running": int(running), "admission": int(admission), "awaiting": sum(rest[0::2]),
                "leases": sum(rest[1::2]), "watched": sum(1 for score in due if score is not None)}  # fmt: skip

    @translate_redis_errors
    def take_tool_slot(self, pattern: str, limit: int, lease_s: float, member: str) -> int:
        """Take one of the `limit` fleet-wide slots of the tool glob `pattern` (tool_slot.lua): when its lease
        ends (ms), which frees it (`free_tool_slot`); 0: none free."""
        return self.scripts(
            ToolSlot(
                slots=self.keys.tool_slots(pattern), limit=limit, now_ms=int(time.time() * 1000),
                lease_ms=int(lease_s * 1000), member=member,
            )
        )  # fmt: skip

    @translate_redis_errors
    def free_tool_slot(self, pattern: str, member: str, lease_ends_ms: int) -> bool:
        """Free the slot `take_tool_slot` took, unless the call has taken it again since (free_tool_slot.lua)."""
        return self.scripts(
            FreeToolSlot(slots=self.keys.tool_slots(pattern), member=member, lease_ends_ms=lease_ends_ms)
        )

    @translate_redis_errors
    def wait_for_rate(self, provider: str, rpm: int) -> int:
        """0 when a request to `provider` may start now (and is counted), else the ms to wait."""
        member = f"{time.time_ns()}-{os.getpid()}-{threading.get_ident()}"
        return self.scripts(
            RateLimit(requests=self.keys.rate(provider), rpm=rpm, now_ms=int(time.time() * 1000), member=member)
        )
