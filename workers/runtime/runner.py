"""Running one task: its agent loop, resumable and controllable, with usage and cost per request.

`run_child` is the plain function behind `subq.run_task`; tests call it
directly and the worker runs the same function. A run:
1. returns the stored outcome if the task has ended (a redelivered message, or
   a task cancelled before it started); publishes its committed delegation if it
   is `delegated` (the run that committed it died before publishing);
2. passes admission control (per-parent and per-tree run limits, a stagger):
   a task that must wait is queued in order and its worker is released;
3. takes the task's run lease, so two deliveries never run one task at once;
4. loads the persisted conversation and goes on from it, answering the calls of
   its last response that have no result: a delegation with the batch's
   combined result, an approval with the human's decision, anything else with
   `INTERRUPTED`;
5. runs the agent, with, before each model request, a stop check (cancel, a
   spent budget) and the provider's fleet-wide rate limit, transient model
   errors retried with backoff, each response's usage recorded atomically and
   every new message appended to the conversation; a cancel also abandons the
   request in flight;
6. ends completed, failed, cancelled, delegated (children published after the
   state is saved) or waiting for approval; it frees its run slot, and a task
   that has ended writes itself back to its parent at once.
It never raises for an agent-level failure: every outcome is a `SubtaskResult`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults, ToolApproved, ToolDenied, ToolOutput
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.usage import UsageLimits

from coordinator import dispatch, ids, writeback
from coordinator.errors import CorruptError, NotFoundError, StoreError
from coordinator.models import Approval, SubtaskResult, TaskRecord, TaskStatus, Usage
from coordinator.settings import Profile
from workers.runtime.context import Runtime
from workers.runtime.metering import MeteredModel
from workers.runtime.pricing import cost_of, reported_cost_usd
from workers.runtime.providers import build_model
from workers.runtime.tools import ORCHESTRATION_PROMPT, RunState, attempt_completion, describe_call, orchestration_tools

__all__ = ["INTERRUPTED", "Progress", "RunInProgress", "run_child"]

log = logging.getLogger(__name__)

INTERRUPTED = "Task was interrupted before this tool call could be completed."
# A summary is what the parent reads back; the full text stays in the conversation.
MAX_SUMMARY_CHARS = 4000
# One line of an error is enough for a parent to act on; no traceback crosses over.
MAX_ERROR_CHARS = 300
# Live status carries an excerpt of the latest model text, not the whole of it.
LIVE_TEXT_CHARS = 200
# How often a running task looks for a cancel of its own; a cancel stops it within this
# (plus the time to unwind), and the check is one small HMGET.
CANCEL_POLL_S = 0.25
MESSAGE = pydantic.TypeAdapter(ModelMessage)

Progress = Callable[[dict[str, Any]], None]


class RunInProgress(Exception):
    """Another delivery of this task is running it now; this one is retried later."""


class StopRun(Exception):
    """The run must stop now: its task was stopped, or a budget over it is spent."""

    def __init__(self, budget_holder: str | None = None) -> None:
        super().__init__(budget_holder or "stopped")
        self.budget_holder = budget_holder


@dataclass(frozen=True)
class Ended:
    status: str
    summary: str = ""
    error: str = ""
    error_class: str = ""


@dataclass(frozen=True)
class Released:
    """The run ended before the task did: delegated, or waiting for a decision."""

    state: str


def run_child(rt: Runtime, task_id: str, progress: Progress | None = None) -> SubtaskResult:
    """Run (or resume) the task's agent; return its result, never raise for an agent failure.

    `progress`, when given, is called after every model response with a small dict
    (task_id, request, cost_micros, tool, latency_ms); the Celery task turns it into
    a Flower-visible event.
    """
    store = rt.store
    try:
        record = store.get_task(task_id)
    except NotFoundError as exc:
        log.error("subq.run_task for an unknown task %r: %s", task_id, exc)
        return SubtaskResult(child_id=task_id, status="failed", error=str(exc), error_class="NotFoundError")
    if record.status.terminal:
        # Redelivered, duplicated, or stopped before it started (it may have been given a
        # run slot from the admission list meanwhile: free it for the next one).
        _release_slot(rt, record)
        return writeback.result_of(record)
    if record.status == TaskStatus.DELEGATED:
        _publish_delegation(rt, record)
        return writeback.result_of(record)
    if not _admitted(rt, record):
        return writeback.result_of(record, pending="queued")

    token = secrets.token_hex(8)
    if not store.acquire_lease(task_id, token, rt.settings.task_time_limit_s):
        raise RunInProgress(f"task {task_id} is being run by another delivery")
    try:
        store.set_live(record, "running")
        outcome = _run(rt, record, progress)
    finally:
        store.release_lease(task_id, token)
        _release_slot(rt, record)

    if isinstance(outcome, Released):
        if outcome.state == "delegated":
            _publish_delegation(rt, store.get_task(task_id))
        store.set_live(record, outcome.state)
        return writeback.result_of(store.get_task(task_id), pending=outcome.state)
    store.finish_task(task_id, outcome.status, outcome.summary[:MAX_SUMMARY_CHARS], outcome.error, outcome.error_class)
    (final,) = store.get_records([task_id])  # one read; the result needs no child lists
    ended_ok = final.status == TaskStatus.COMPLETED
    RunState(rt, final, rt.settings.profile(final.profile)).say(
        "completion_result" if ended_ok else "error",
        final.summary if ended_ok else f"{final.error_class}: {final.error}",
    )
    writeback.settle_child(rt.coordinator, final)  # its todo item is written as soon as it ends
    return writeback.result_of(final)


def _limits(rt: Runtime) -> tuple[int, int, int]:
    s = rt.settings
    return s.max_running_per_parent, s.max_running_per_root, s.start_stagger_ms


def _admitted(rt: Runtime, record: TaskRecord) -> bool:
    """Admission control for a child's run; the root always runs. False: the run waits."""
    per_parent, per_tree, stagger_ms = _limits(rt)
    if record.parent_id is None or not (per_parent or per_tree or stagger_ms):
        return True
    verdict, delay_ms = rt.store.admit(record, per_parent, per_tree, stagger_ms)
    if verdict == "run":
        return True
    if verdict == "delay":
        dispatch.publish_restart(rt.app, record, countdown_s=delay_ms / 1000)
    rt.store.set_live(record, "queued")
    return False


def _release_slot(rt: Runtime, record: TaskRecord) -> None:
    per_parent, per_tree, stagger_ms = _limits(rt)
    if record.parent_id is None or not (per_parent or per_tree or stagger_ms):
        return
    for admitted in rt.store.release_slot(record, per_parent, per_tree):
        dispatch.publish_restart(rt.app, rt.store.get_task(admitted))


def _publish_delegation(rt: Runtime, record: TaskRecord) -> None:
    if record.waiting_batch_id:
        batch = rt.store.get_batch(record.waiting_batch_id)
        rt.coordinator.publish(batch, rt.store.get_records(batch.child_ids))


def _run(rt: Runtime, record: TaskRecord, progress: Progress | None) -> Ended | Released:
    deliveries, run_seq = rt.store.start_run(record.id)
    if deliveries > rt.settings.max_deliveries:
        error = f"lost with its worker {deliveries - 1} times (SUBQ_MAX_DELIVERIES={rt.settings.max_deliveries})"
        return Ended("failed", error=error, error_class="WorkerLost")
    limit_s = rt.settings.task_time_limit_s
    try:
        profile = rt.settings.profile(record.profile)
        # The threads pool does not enforce Celery's task_time_limit, so the runner does:
        # a run must end before the visibility timeout, or Redis would deliver it again
        # while it still runs (Settings checks visibility_timeout_s > task_time_limit_s).
        return asyncio.run(asyncio.wait_for(_run_agent(rt, record, profile, run_seq, progress), timeout=limit_s))
    except StopRun as stop:
        if stop.budget_holder:
            rt.coordinator.stop_budget(stop.budget_holder)
        stopped = rt.store.get_task(record.id)
        return Ended(stopped.status.value if stopped.status.terminal else "cancelled", error=stopped.error)
    except TimeoutError:
        return Ended("failed", error=f"ran over SUBQ_TASK_TIME_LIMIT_S={limit_s}", error_class="TimeLimit")
    except CorruptError as exc:
        # Its history cannot be read: end it visibly rather than retry or guess an empty one.
        return Ended("failed", error=str(exc), error_class="CorruptError")
    except StoreError:
        raise  # Redis, not the agent, failed: the task is retried (workers.tasks)
    except Exception as exc:  # an agent-level failure is a result, never a crash of the chord
        log.info("task %s failed: %s: %s", record.id, type(exc).__name__, exc)
        return Ended("failed", error=one_line(str(exc)), error_class=type(exc).__name__)


async def _run_agent(
    rt: Runtime, record: TaskRecord, profile: Profile, run_seq: int, progress: Progress | None
) -> Ended | Released:
    """The agent's run, raced against a watcher that abandons it when the task is stopped."""
    run = asyncio.create_task(_drive(rt, record, profile, run_seq, progress))
    watcher = asyncio.create_task(_watch_for_stop(rt, record.id))
    done, _ = await asyncio.wait({run, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if run in done:
        watcher.cancel()
        return run.result()
    run.cancel()  # abandons the model call in flight
    try:
        await run
    except (asyncio.CancelledError, Exception):
        pass
    raise StopRun()


async def _watch_for_stop(rt: Runtime, task_id: str) -> None:
    while True:
        await asyncio.sleep(CANCEL_POLL_S)
        status, _ = rt.store.status_of(task_id)
        if TaskStatus(status).terminal:
            return


async def _drive(
    rt: Runtime, record: TaskRecord, profile: Profile, run_seq: int, progress: Progress | None
) -> Ended | Released:
    store = rt.store
    state = RunState(rt, record, profile)
    history = _load_history(rt, record.id)
    if not history:
        state.say("task", record.prompt)
    elif isinstance(history[-1], ModelResponse) and not _calls_without_result(history):
        return Ended("completed", summary=_text_of(history[-1]))  # it had ended; only the status was lost
    saved = len(history)
    request_no = 0
    rpm = rt.settings.provider_rpm.get(profile.provider, 0)

    async def before_request() -> None:
        status, _ = store.status_of(record.id)
        if TaskStatus(status).terminal:
            raise StopRun()
        holder = store.budget_exhausted(record.id, record.ancestors)
        if holder:
            raise StopRun(holder)
        while rpm and (wait_ms := store.wait_for_rate(profile.provider, rpm)):
            await asyncio.sleep(wait_ms / 1000)

    def on_transient(exc: Exception, attempt: int) -> None:
        store.count(record.id, "transient_errors")
        state.say("retry", f"{type(exc).__name__}: retrying (attempt {attempt})")

    def on_response(messages: list[ModelMessage], response: ModelResponse, latency_ms: float) -> None:
        nonlocal request_no
        request_no += 1
        store.observe_latency(latency_ms)
        usage = response.usage
        cost_micros, source = cost_of(usage, profile, reported_cost_usd(response))
        recorded, exhausted = store.record_usage(
            record.id,
            f"{run_seq}:{request_no}",
            Usage(
                tokens_in=usage.input_tokens,
                tokens_out=usage.output_tokens,
                cache_reads=usage.cache_read_tokens,
                cache_writes=usage.cache_write_tokens,
            ),
            cost_micros,
            source,
            ancestors=record.ancestors,
        )
        if recorded < 0:
            raise StopRun()  # stopped while the request was in flight: nothing more is recorded
        text = " ".join(p.content for p in response.parts if isinstance(p, TextPart)).strip()
        tool = next((p.tool_name for p in response.parts if isinstance(p, ToolCallPart)), None)
        for part in response.parts:
            if isinstance(part, TextPart) and part.content.strip():
                state.say("text", part.content)
            elif isinstance(part, ToolCallPart):
                state.say("tool", describe_call(part))
        current = store.get_records([record.id])[0]
        store.set_live(
            record, "running", tool=tool, text=text[:LIVE_TEXT_CHARS] or None,
            requests=current.requests, cost_micros=current.total_cost_micros,
        )  # fmt: skip
        if progress is not None:
            progress({"task_id": record.id, "request": request_no, "cost_micros": cost_micros, "tool": tool,
                      "latency_ms": round(latency_ms)})  # fmt: skip
        if exhausted:
            raise StopRun(exhausted)

    model = MeteredModel(
        build_model(profile),
        on_response,
        before=before_request,
        retries=rt.settings.model_retries,
        retry_base_s=rt.settings.model_retry_base_s,
        on_transient=on_transient,
    )
    pending = _calls_without_result(history)
    results = _answers(rt, record.id, pending) if pending else None
    try:
        async with _agent_for(profile.system_prompt).iter(
            None if history else record.prompt,
            model=model,
            message_history=history or None,
            deferred_tool_results=results,
            deps=state,
            usage_limits=UsageLimits(request_limit=profile.max_requests),
        ) as run:
            async for _node in run:
                saved = _save_new(rt, record.id, run.all_messages(), saved)
            _save_new(rt, record.id, run.all_messages(), saved)
            assert run.result is not None
            output = run.result.output
    except StopRun:
        raise
    if isinstance(output, DeferredToolRequests):
        if output.approvals:
            _park_for_approval(rt, record, output)
            return Released("waiting_approval")
        if state.delegation is None:
            return Ended("failed", error="the run deferred a call that is not a delegation", error_class="Deferred")
        return Released("delegated")
    return Ended("completed", summary=str(output))


@functools.cache
def _agent_for(system_prompt: str) -> Agent[RunState, Any]:
    """One agent per system prompt and process: building one generates every tool's JSON
    schema (about 1.5 ms, measured as 12% of a worker's CPU in bench/), and nothing in it
    is per task: the model, with the task's hooks, is given to each run."""
    return Agent(
        deps_type=RunState,
        output_type=[str, ToolOutput(attempt_completion, name="attempt_completion"), DeferredToolRequests],
        system_prompt=f"{system_prompt}\n\n{ORCHESTRATION_PROMPT}",
        toolsets=[orchestration_tools],
    )


def _park_for_approval(rt: Runtime, record: TaskRecord, requests: DeferredToolRequests) -> None:
    """Queue each call that needs a decision; the task resumes once all are decided."""
    todo = next((t for t in _parent_todos(rt, record) if t.id == record.todo_id), None)
    now = time.time()
    approval_ids = []
    for call in requests.approvals:
        meta = requests.metadata.get(call.tool_call_id, {})
        approval = Approval(
            id=ids.new_approval_id(record.root_id),
            task_id=record.id,
            root_id=record.root_id,
            tool=call.tool_name,
            args=dict(meta.get("args") or call.args_as_dict()),
            tool_call_id=call.tool_call_id,
            todo_id=record.todo_id,
            todo_content=todo.content if todo else None,
            created_at=now,
            deadline=now + rt.settings.approval_timeout_s,
        )
        rt.store.save_approval(approval)
        approval_ids.append(approval.id)
        dispatch.publish_approval_timeout(rt.app, approval.id, rt.settings.approval_timeout_s)
        RunState(rt, record, rt.settings.profile(record.profile)).say(
            "approval_request", f"{approval.id}: {call.tool_name} {json.dumps(approval.args)}"
        )
    rt.store.set_fields(record.id, {"waiting_approval_ids": json.dumps(approval_ids)})


def _parent_todos(rt: Runtime, record: TaskRecord) -> list[Any]:
    return rt.store.get_todos(record.parent_id) if record.parent_id else []


def _answers(rt: Runtime, task_id: str, pending: Sequence[ToolCallPart]) -> DeferredToolResults:
    """Results for the calls of the last response that have none: a batch's, a decision, or INTERRUPTED."""
    calls: dict[str, Any] = {call.tool_call_id: INTERRUPTED for call in pending}
    approvals: dict[str, Any] = {}
    resume_batch = rt.store.task_field(task_id, "resume_batch_id")
    if resume_batch:
        batch = rt.store.get_batch(resume_batch)
        if batch.tool_call_id in calls:
            calls[batch.tool_call_id] = batch.result
    for approval_id in json.loads(rt.store.task_field(task_id, "waiting_approval_ids") or "[]"):
        approval = rt.store.get_approval(approval_id)
        if approval.tool_call_id in calls and approval.status != "pending":
            del calls[approval.tool_call_id]
            approvals[approval.tool_call_id] = (
                ToolApproved()
                if approval.status == "approved"
                else ToolDenied(message=approval.feedback or f"The call was {approval.status}.")
            )
    return DeferredToolResults(calls=calls, approvals=approvals)


def _calls_without_result(history: Sequence[ModelMessage]) -> list[ToolCallPart]:
    last_response = max((i for i, m in enumerate(history) if isinstance(m, ModelResponse)), default=None)
    if last_response is None:
        return []
    calls = [p for p in history[last_response].parts if isinstance(p, ToolCallPart)]
    answered = {
        part.tool_call_id
        for message in history[last_response + 1 :]
        if isinstance(message, ModelRequest)
        for part in message.parts
        if hasattr(part, "tool_call_id")
    }
    return [c for c in calls if c.tool_call_id not in answered and c.tool_name != "attempt_completion"]


def _load_history(rt: Runtime, task_id: str) -> list[ModelMessage]:
    messages = []
    for index, entry in enumerate(rt.store.conversation(task_id)):
        try:
            messages.append(MESSAGE.validate_json(entry))
        except pydantic.ValidationError:
            raise CorruptError(f"Conversation message {index} of task {task_id} is corrupt") from None
    return messages


def _save_new(rt: Runtime, task_id: str, messages: Sequence[ModelMessage], saved: int) -> int:
    """Append the messages not yet persisted; returns how many are persisted now."""
    rt.store.append_conversation(task_id, [MESSAGE.dump_json(m).decode() for m in messages[saved:]])
    return max(saved, len(messages))


def _text_of(response: ModelResponse) -> str:
    return "\n".join(p.content for p in response.parts if isinstance(p, TextPart))


def one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 1] + "…"
