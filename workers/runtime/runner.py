"""Running one task: its agent loop, resumable, with usage and cost recorded per request.

`run_child` is the plain function behind `subq.run_task`; tests call it
directly and the worker runs the same function. A run:
1. returns the stored outcome if the task has ended (a redelivered message);
   publishes its committed delegation if it is `delegated` (the run that
   committed it died before publishing; publishing is once-only);
2. takes the task's run lease, so two deliveries never run one task at once;
3. loads the persisted conversation and goes on from it: a pending delegation
   call is answered with the batch's combined result, any other call left
   without a result with `INTERRUPTED`;
4. runs the agent (pydantic-ai), recording each request's usage atomically and
   appending every new message to the conversation as it goes;
5. ends in one of three ways: completed (text or `attempt_completion`), failed
   (any agent-level error, as a result, never a raise), or delegated (the run
   persisted its state and the children are published; the worker is free).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults, ToolOutput
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.usage import UsageLimits

from coordinator.errors import CorruptError, NotFoundError, StoreError
from coordinator.models import SubtaskResult, TaskRecord, TaskStatus, Usage
from coordinator.settings import Profile
from workers.delegation import result_of, settle
from workers.runtime.context import Runtime
from workers.runtime.metering import MeteredModel
from workers.runtime.pricing import cost_of, reported_cost_usd
from workers.runtime.providers import build_model
from workers.runtime.tools import ORCHESTRATION_PROMPT, RunState, attempt_completion, describe_call, orchestration_tools

__all__ = ["INTERRUPTED", "RunInProgress", "run_child"]

log = logging.getLogger(__name__)

INTERRUPTED = "Task was interrupted before this tool call could be completed."
# A summary is what the parent reads back; the full text stays in the conversation.
MAX_SUMMARY_CHARS = 4000
# One line of an error is enough for a parent to act on; no traceback crosses over.
MAX_ERROR_CHARS = 300
MESSAGE = pydantic.TypeAdapter(ModelMessage)


Progress = Callable[[dict[str, Any]], None]


class RunInProgress(Exception):
    """Another delivery of this task is running it now; this one is retried later."""


@dataclass(frozen=True)
class Ended:
    status: str
    summary: str = ""
    error: str = ""
    error_class: str = ""


class Delegated:
    """The run ended on a delegation call; the children are published after the state is saved."""


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
        return result_of(record)  # a redelivered or duplicated message: the outcome stands
    if record.status == TaskStatus.DELEGATED:
        _publish_delegation(rt, record)
        return result_of(record)

    token = secrets.token_hex(8)
    if not store.acquire_lease(task_id, token, rt.settings.task_time_limit_s):
        raise RunInProgress(f"task {task_id} is being run by another delivery")
    try:
        outcome = _run(rt, record, progress)
    finally:
        store.release_lease(task_id, token)

    if isinstance(outcome, Delegated):
        _publish_delegation(rt, store.get_task(task_id))
        return result_of(store.get_task(task_id))
    store.finish_task(task_id, outcome.status, outcome.summary[:MAX_SUMMARY_CHARS], outcome.error, outcome.error_class)
    final = store.get_task(task_id)
    ended_ok = final.status == TaskStatus.COMPLETED
    RunState(rt, final, rt.settings.profile(final.profile)).say(
        "completion_result" if ended_ok else "error",
        final.summary if ended_ok else f"{final.error_class}: {final.error}",
    )
    if final.batch_id and store.task_field(task_id, "resumes"):
        # This child delegated, so its chord header (or chain step) reported it long
        # ago as still running: its end is written back to its parent from here.
        settle(rt, final.batch_id)
    return result_of(final)


def _publish_delegation(rt: Runtime, record: TaskRecord) -> None:
    if record.waiting_batch_id:
        batch = rt.store.get_batch(record.waiting_batch_id)
        rt.coordinator.publish(batch, rt.store.get_records(batch.child_ids))


def _run(rt: Runtime, record: TaskRecord, progress: Progress | None) -> Ended | Delegated:
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
) -> Ended | Delegated:
    store = rt.store
    state = RunState(rt, record, profile)
    history = _load_history(rt, record.id)
    if not history:
        state.say("task", record.prompt)
    elif isinstance(history[-1], ModelResponse) and not _calls_without_result(history):
        return Ended("completed", summary=_text_of(history[-1]))  # it had ended; only the status was lost
    saved = len(history)
    request_no = 0

    def on_response(messages: list[ModelMessage], response: ModelResponse, latency_ms: float) -> None:
        nonlocal request_no
        request_no += 1
        store.observe_latency(latency_ms)
        usage = response.usage
        cost_micros, source = cost_of(usage, profile, reported_cost_usd(response))
        store.record_usage(
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
        for part in response.parts:
            if isinstance(part, TextPart) and part.content.strip():
                state.say("text", part.content)
            elif isinstance(part, ToolCallPart):
                state.say("tool", describe_call(part))
        if progress is not None:
            tool = next((p.tool_name for p in response.parts if isinstance(p, ToolCallPart)), None)
            progress({"task_id": record.id, "request": request_no, "cost_micros": cost_micros, "tool": tool,
                      "latency_ms": round(latency_ms)})  # fmt: skip

    agent = Agent(
        MeteredModel(build_model(profile), on_response),
        deps_type=RunState,
        output_type=[str, ToolOutput(attempt_completion, name="attempt_completion"), DeferredToolRequests],
        system_prompt=f"{profile.system_prompt}\n\n{ORCHESTRATION_PROMPT}",
        toolsets=[orchestration_tools],
    )
    pending = _calls_without_result(history)
    results = DeferredToolResults(calls=_answers(rt, record.id, pending)) if pending else None
    async with agent.iter(
        None if history else record.prompt,
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
    if isinstance(output, DeferredToolRequests):
        if state.delegation is None:
            return Ended("failed", error="the run deferred a call that is not a delegation", error_class="Deferred")
        return Delegated()
    return Ended("completed", summary=str(output))


def _answers(rt: Runtime, task_id: str, pending: Sequence[ToolCallPart]) -> dict[str, object]:
    """Results for the calls of the last response that have none: the batch's, or INTERRUPTED."""
    answers: dict[str, object] = {call.tool_call_id: INTERRUPTED for call in pending}
    resume_batch = rt.store.task_field(task_id, "resume_batch_id")
    if resume_batch:
        batch = rt.store.get_batch(resume_batch)
        if batch.tool_call_id in answers:
            answers[batch.tool_call_id] = batch.result
    return answers


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

