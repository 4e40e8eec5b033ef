"""A run's state: deliveries and leases, once-only claims, usage and budgets, admission, rate limits."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import NotFoundError
from coordinator.ids import root_of
from coordinator.models import AdmissionLimits, RunWrites, TaskRecord, ToolCallDone, Usage
from coordinator.store.base import (
    EVENTS_MAXLEN,
    Part,
    ScriptArg,
    StoreCore,
    _decode_record,
    _strs,
    tool_field,
    translate_redis_errors,
)
from coordinator.store.fields import TaskField
from coordinator.store.metrics import latency_bucket
from coordinator.store.records import RecordStore

__all__ = ["ADMISSION_SCAN", "Ending", "RunStore", "Started"]


def _writes_args(writes: RunWrites) -> list[ScriptArg]:
    """flush_run.lua's ARGV from its sixth on: counts, then the messages, usage records, latencies and marks."""
    args: list[ScriptArg] = [
        writes.live, len(writes.conversation), len(writes.ui_messages), len(writes.usage), len(writes.latencies_ms),
        *writes.conversation, *writes.ui_messages,
    ]  # fmt: skip
    for key, usage, cost_micros, source in writes.usage:
        args += [key, usage.tokens_in, usage.tokens_out, usage.cache_reads, usage.cache_writes, cost_micros, source]
    for latency_ms in writes.latencies_ms:
        args += [latency_bucket(latency_ms), latency_ms]
    for t_ms, state in writes.marks:  # to the end: the script reads marks while ARGV lasts
        args += [t_ms, state]
    return args


# The journal field that says a human-approved call started (`started:<tool call id>`).
TOOL_STARTED = "started:"
# How far down the admission list one freed slot looks for a task that now fits.
ADMISSION_SCAN = 50


@dataclass(frozen=True)
class Started:
    """What `begin_run` found: `verdict` 'run' (the lease is the caller's), 'missing', 'other', 'leased',
    'wait' (queued for a run slot) or 'delay' (admitted after `delay_ms`: the caller restarts it then)."""

    verdict: str
    record: TaskRecord | None = None
    deliveries: int = 0
    run_seq: int = 0
    exhausted: str | None = None
    conversation: list[str] = field(default_factory=list)
    delay_ms: int = 0


@dataclass(frozen=True)
class Ending:
    """What `end_run` did: `kind` 'ended', 'fenced' (nothing written) or 'exhausted' (`holder`'s budget)."""

    kind: str
    holder: str | None = None
    status: str = ""
    summary: str = ""
    error: str = ""
    error_class: str = ""
    usage: Usage = field(default_factory=Usage)
    cost_micros: int = 0
    closed: bool = False
    resumes: int = 0
    resume: bool = False
    batch_mode: str = ""
    admitted: list[str] = field(default_factory=list)  # waiting tasks given the freed slot: publish their runs


class RunStore(Part):
    """What one run of a task reads and writes, from its start to its terminal status.

    It reads through the records part it is handed (`RunStore(core, records)`): the usage
    roll-up reads the ancestors, and the in-flight figures walk the tree's tasks.
    """

    def __init__(self, core: StoreCore, records: RecordStore) -> None:
        super().__init__(core)
        self.records = records

    # -- a run's hot path: start, steps, end, one round trip each -----------------------

    @translate_redis_errors
    def begin_run(
        self, task_id: str, token: str, lease_s: int, look_again_s: float, limits: AdmissionLimits
    ) -> Started:
        """Start an agent task's run in one step (start_run.lua): admit, lease, count, due list, live status."""
        root, k = root_of(task_id), self.keys
        keys = [
            k.task(root, task_id), k.lease(root, task_id), k.due(), k.live(root), k.events(root),
            k.conversation(root, task_id), k.ui_messages(root, task_id), k.running(root), k.admission(root),
            k.last_start(root),
        ]  # fmt: skip
        now = time.time()
        args: list[ScriptArg] = [
            token, lease_s, now + look_again_s, now, EVENTS_MAXLEN, k.task(root, ""),
            limits.per_parent, limits.per_tree, limits.stagger_ms, int(now * 1000), self.retention_s,
            k.running_children(root, ""),
        ]  # fmt: skip
        verdict, raw, counts, conversation = self.scripts.start_run(keys=keys, args=args)
        if verdict == "missing":
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        fields = dict(zip(raw[0::2], raw[1::2], strict=True))
        record = _decode_record(fields, [], [])
        if verdict in ("wait", "delay"):
            return Started(str(verdict), record, delay_ms=int(counts[0]))
        if verdict != "run":
            return Started(str(verdict), record)
        deliveries, run_seq, exhausted = counts
        return Started("run", record, int(deliveries), int(run_seq), str(exhausted) or None, _strs(conversation))

    def _run_keys(self, record: TaskRecord) -> list[str]:
        root, k, task_id = record.root_id, self.keys, record.id
        return [
            k.lease(root, task_id), k.task(root, task_id), k.conversation(root, task_id),
            k.ui_messages(root, task_id), k.latency_histogram(), k.live(root), k.events(root),
        ]  # fmt: skip

    def _flush_args(self, token: str, writes: RunWrites) -> list[ScriptArg]:
        """flush_run.lua's ARGV for a step of its own (not end_run's)."""
        return [token, self.retention_s, time.time(), EVENTS_MAXLEN, 0, *_writes_args(writes)]

    @translate_redis_errors
    def flush_run(self, record: TaskRecord, token: str, writes: RunWrites) -> tuple[bool, str, str | None]:
        """Write a run's step (flush_run.lua): (still leased, the task's status, the topmost budget reached)."""
        keys = self._run_keys(record) + [self.keys.task(record.root_id, a) for a in reversed(record.ancestors)]
        reply = self.scripts.flush_run(keys=keys, args=self._flush_args(token, writes))
        if int(reply[0]) == 0:
            return False, "", None
        return True, str(reply[1]), str(reply[2]) or None

    @translate_redis_errors
    def end_run(
        self,
        record: TaskRecord,
        token: str,
        writes: RunWrites,
        outcome: tuple[str, str, str, str],
        resume_grace_s: float,
        limits: AdmissionLimits,
        *,
        stop_on_budget: bool,
    ) -> Ending:
        """End a run in one step (end_run.lua): write, finish, release the lease and the slot, write back,
        close the batch if last.

        With `stop_on_budget`, a budget found reached ends nothing: the caller stops its holder's subtree first.
        """
        root, k = record.root_id, self.keys
        if record.batch_id and record.parent_id:
            parent, batch = record.parent_id, record.batch_id
            batch_keys = [
                k.task(root, parent), k.todos(root, parent), k.awaiting(root, parent), k.batch(root, batch),
                k.ui_messages(root, parent), k.batch_lines(root, batch),
            ]  # fmt: skip
        else:
            batch_keys = [k.task(root, record.id)] * 6
        admitted = limits.applies_to(record)
        if admitted:
            slot_keys = [k.running(root), k.admission(root), k.running_children(root, record.parent_id or record.id)]
        else:
            slot_keys = [k.task(root, record.id)] * 3
        keys = [
            *self._run_keys(record), k.due(), *batch_keys, *slot_keys,
            *(k.task(root, a) for a in reversed(record.ancestors)),
        ]  # fmt: skip
        status, summary, error, error_class = outcome
        args: list[ScriptArg] = [
            token, self.retention_s, time.time(), EVENTS_MAXLEN, status, summary, error, error_class, resume_grace_s,
            int(stop_on_budget), int(admitted), limits.per_parent, limits.per_tree, k.task(root, ""),
            k.running_children(root, ""), ADMISSION_SCAN, *_writes_args(writes),
        ]  # fmt: skip
        reply: list[Any] = self.scripts.end_run(keys=keys, args=args)
        if reply[0] != "ended":
            return Ending(str(reply[0]), holder=str(reply[1]) if len(reply) > 1 else None)
        (
            _,
            status,
            summary,
            error,
            error_class,
            t_in,
            t_out,
            c_reads,
            c_writes,
            cost,
            closed,
            resumes,
            resume,
            mode,
            admitted_ids,
        ) = reply
        return Ending(
            "ended", status=str(status), summary=str(summary), error=str(error), error_class=str(error_class),
            usage=Usage(tokens_in=int(t_in), tokens_out=int(t_out), cache_reads=int(c_reads), cache_writes=int(c_writes)),
            cost_micros=int(cost), closed=bool(int(closed)), resumes=int(resumes), resume=bool(int(resume)),
            batch_mode=str(mode), admitted=_strs(admitted_ids),
        )  # fmt: skip

    # -- starting a run ----------------------------------------------------------------

    @translate_redis_errors
    def reset_deliveries(self, task_id: str) -> None:
        self.client.hset(self.keys.task(root_of(task_id), task_id), TaskField.DELIVERIES, 0)

    @translate_redis_errors
    def release_lease(self, task_id: str, token: str) -> None:
        self.scripts.release_lease(keys=[self.keys.lease(root_of(task_id), task_id)], args=[token])

    @translate_redis_errors
    def claim_resume(self, task_id: str, reason_id: str) -> bool:
        """Once-only guard for resuming a task for one reason (a batch or an approval)."""
        key = self.keys.task(root_of(task_id), task_id)
        return bool(self.client.hsetnx(key, TaskField.resumed(reason_id), 1))

    @translate_redis_errors
    def next_resume(self, task_id: str) -> int:
        return int(self.client.hincrby(self.keys.task(root_of(task_id), task_id), TaskField.RESUMES, 1))

    @translate_redis_errors
    def claim_step_publish(self, task_id: str) -> bool:
        """Once-only: True for the first caller that publishes this task's run as a chain step."""
        return bool(self.client.hsetnx(self.keys.task(root_of(task_id), task_id), TaskField.PUBLISHED, 1))

    @translate_redis_errors
    def resume_batch_id(self, task_id: str) -> str | None:
        """The batch whose result a resumed run answers its delegation call with, if any."""
        value = self.client.hget(self.keys.task(root_of(task_id), task_id), TaskField.RESUME_BATCH_ID)
        return str(value) if value else None

    @translate_redis_errors
    def set_waiting_approvals(self, task_id: str, approval_ids: Sequence[str]) -> None:
        key = self.keys.task(root_of(task_id), task_id)
        self.client.hset(key, TaskField.WAITING_APPROVAL_IDS, json.dumps(list(approval_ids)))

    @translate_redis_errors
    def waiting_approval_ids(self, task_id: str) -> list[str]:
        """The approvals the task's last run asked for (decided or not)."""
        value = self.client.hget(self.keys.task(root_of(task_id), task_id), TaskField.WAITING_APPROVAL_IDS)
        return list(json.loads(str(value))) if value else []

    @translate_redis_errors
    def count_transient_error(self, task_id: str) -> int:
        return int(self.client.hincrby(self.keys.task(root_of(task_id), task_id), TaskField.TRANSIENT_ERRORS, 1))

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
    ) -> tuple[int, str | None]:
        """Record one request's usage on the task and roll it up the ancestors, once per key.

        Returns (recorded, exhausted): recorded is 1, 0 (a repeat of this key) or -1 (the
        task had ended: nothing is recorded after a stop); exhausted is the id of the
        task nearest the root whose budget the subtree has now reached, or None.
        `ancestors` (root first) may be passed by a caller that has the record, to save a read.
        """
        root = root_of(task_id)
        if ancestors is None:
            ancestors = self.records.ancestors(task_id)
        keys = [self.keys.task(root, task_id), *(self.keys.task(root, a) for a in reversed(ancestors))]
        args: list[ScriptArg] = [
            request_key, usage.tokens_in, usage.tokens_out, usage.cache_reads, usage.cache_writes,
            cost_micros, cost_source, time.time(), self.retention_s,
        ]  # fmt: skip
        recorded, exhausted = self.scripts.record_usage(keys=keys, args=args)
        return int(recorded), (str(exhausted) or None)

    # -- the tool-call journal ---------------------------------------------------------

    @translate_redis_errors
    def record_tool_call(
        self, record: TaskRecord, token: str, writes: RunWrites, call: ToolCallDone
    ) -> tuple[bool, str, str | None]:
        """A tool call returned: keep its result (when it has one to keep) the moment it did, count it on its
        task (`tool:<tool>:<outcome>`, `tool:<tool>:ms`), and write the run's step (record_tool.lua): one round
        trip, answered as `flush_run` is."""
        keys = [self.keys.tool_results(record.root_id, record.id), *self._run_keys(record)]
        keys += [self.keys.task(record.root_id, a) for a in reversed(record.ancestors)]
        args: list[ScriptArg] = [
            call.tool_call_id, call.result_json or "", tool_field(call.tool, call.outcome), tool_field(call.tool, "ms"),
            call.ms, *self._flush_args(token, writes),
        ]  # fmt: skip
        reply = self.scripts.record_tool(keys=keys, args=args)
        if int(reply[0]) == 0:
            return False, "", None
        return True, str(reply[1]), str(reply[2]) or None

    @translate_redis_errors
    def mark_tool_started(self, task_id: str, tool_call_id: str) -> None:
        """Note that a human-approved call starts running, so a resume after its worker died knows it may
        have taken effect (it has no result yet)."""
        key = self.keys.tool_results(root_of(task_id), task_id)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(key, f"{TOOL_STARTED}{tool_call_id}", "1")
            pipe.expire(key, self.retention_s)
            pipe.execute()

    @translate_redis_errors
    def tool_results(self, task_id: str, tool_call_ids: Sequence[str]) -> tuple[dict[str, str], set[str]]:
        """The recorded results of these calls (JSON), for those that have one; and which were noted started."""
        if not tool_call_ids:
            return {}, set()
        ids = list(tool_call_ids)
        found = self.client.hmget(
            self.keys.tool_results(root_of(task_id), task_id), [*ids, *(f"{TOOL_STARTED}{i}" for i in ids)]
        )
        results = {
            call_id: str(value) for call_id, value in zip(ids, found[: len(ids)], strict=True) if value is not None
        }
        return results, {call_id for call_id, value in zip(ids, found[len(ids) :], strict=True) if value is not None}

    @translate_redis_errors
    def set_error_detail(self, task_id: str, detail: str) -> None:
        """Keep a failed run's raw error body on its record (only failures have one)."""
        self.client.hset(self.keys.task(root_of(task_id), task_id), TaskField.ERROR_DETAIL, detail)

    @translate_redis_errors
    def finish_task(self, task_id: str, status: str, summary: str = "", error: str = "", error_class: str = "") -> str:
        """Make a task terminal once; returns its status after the call."""
        root = root_of(task_id)
        keys = [self.keys.task(root, task_id), self.keys.events(root), self.keys.live(root)]
        args: list[ScriptArg] = [status, summary, error, error_class, time.time(), self.retention_s, EVENTS_MAXLEN]
        result = self.scripts.finish_task(keys=keys, args=args)
        if result is None:
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")
        return str(result)

    # -- admission and rate limits -----------------------------------------------------

    @translate_redis_errors
    def release_slot(self, record: TaskRecord, limits: AdmissionLimits) -> list[str]:
        """Free the task's run slot and admit waiting tasks that now fit (release_slot.lua); the admitted ids."""
        root, k = record.root_id, self.keys
        keys = [k.running(root), k.admission(root), k.running_children(root, record.parent_id or record.id)]
        args: list[ScriptArg] = [
            record.id, limits.per_parent, limits.per_tree, self.retention_s, k.task(root, ""),
            k.running_children(root, ""), ADMISSION_SCAN, time.time(),
        ]  # fmt: skip
        return _strs(self.scripts.release_slot(keys=keys, args=args))

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
    def take_tool_slot(self, pattern: str, limit: int, lease_s: float, member: str) -> bool:
        """Take one of the `limit` fleet-wide slots of the tool glob `pattern` (tool_slot.lua); False: none free."""
        args: list[ScriptArg] = [limit, int(time.time() * 1000), int(lease_s * 1000), member]
        return bool(int(self.scripts.tool_slot(keys=[self.keys.tool_slots(pattern)], args=args)))

    @translate_redis_errors
    def free_tool_slot(self, pattern: str, member: str) -> None:
        self.client.zrem(self.keys.tool_slots(pattern), member)

    @translate_redis_errors
    def wait_for_rate(self, provider: str, rpm: int) -> int:
        """0 when a request to `provider` may start now (and is counted), else the ms to wait."""
        member = f"{time.time_ns()}-{os.getpid()}-{threading.get_ident()}"
        return int(
            self.scripts.rate_limit(keys=[self.keys.rate(provider)], args=[rpm, int(time.time() * 1000), member])
        )
