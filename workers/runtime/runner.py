"""Running one task: the agent loop of a child, with usage and cost recorded per request.

`run_child` is the plain function behind `subq.run_task`; tests call it
directly and the worker runs the same function. It never raises for an
agent-level failure: every outcome becomes a small `SubtaskResult`, so the
chord callback always runs.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelResponse
from pydantic_ai.usage import UsageLimits

from coordinator.errors import NotFoundError, StoreError
from coordinator.models import SubtaskResult, TaskRecord, TaskStatus, Usage
from coordinator.settings import Profile
from workers.runtime.context import Runtime
from workers.runtime.metering import MeteredModel
from workers.runtime.pricing import cost_of, reported_cost_usd
from workers.runtime.providers import build_model

__all__ = ["result_of", "run_child"]

log = logging.getLogger(__name__)

# A summary is what the parent reads back; the full text stays in the conversation.
MAX_SUMMARY_CHARS = 4000
# One line of an error is enough for a parent to act on; no traceback crosses over.
MAX_ERROR_CHARS = 300


def run_child(rt: Runtime, task_id: str) -> SubtaskResult:
    """Run the task's agent to its end and make the task terminal; return its result."""
    store = rt.store
    try:
        record = store.get_task(task_id)
    except NotFoundError as exc:
        log.error("subq.run_task for an unknown task %r: %s", task_id, exc)
        return SubtaskResult(child_id=task_id, status="failed", error=str(exc), error_class="NotFoundError")
    if record.status.terminal:
        # A redelivered or duplicated message: the first run's outcome stands.
        return result_of(record)

    deliveries = store.count_delivery(task_id)
    if deliveries > rt.settings.max_deliveries:
        store.finish_task(
            task_id,
            "failed",
            error=f"lost with its worker {deliveries - 1} times (SUBQ_MAX_DELIVERIES={rt.settings.max_deliveries})",
            error_class="WorkerLost",
        )
        return result_of(store.get_task(task_id))

    limit_s = rt.settings.task_time_limit_s
    try:
        # The threads pool does not enforce Celery's task_time_limit, so the runner does:
        # a run must end before the visibility timeout, or Redis would deliver it again
        # while it still runs (Settings checks visibility_timeout_s > task_time_limit_s).
        run = _run_agent(rt, record, rt.settings.profile(record.profile), deliveries)
        summary = asyncio.run(asyncio.wait_for(run, timeout=limit_s))
        status, error, error_class = "completed", "", ""
    except TimeoutError:
        status, summary, error, error_class = "failed", "", f"ran over SUBQ_TASK_TIME_LIMIT_S={limit_s}", "TimeLimit"
    except StoreError:
        raise  # Redis, not the agent, failed: the task is retried (workers.tasks)
    except Exception as exc:  # an agent-level failure is a result, never a crash of the chord
        log.info("task %s failed: %s: %s", task_id, type(exc).__name__, exc)
        status, summary, error, error_class = "failed", "", one_line(str(exc)), type(exc).__name__
    store.finish_task(task_id, status, summary[:MAX_SUMMARY_CHARS], error, error_class)
    final = store.get_task(task_id)
    store.append_ui_message(
        task_id,
        {
            "ts": time.time(),
            "type": "say",
            "say": "completion_result" if final.status == TaskStatus.COMPLETED else "error",
            "text": final.summary if final.status == TaskStatus.COMPLETED else f"{final.error_class}: {final.error}",
        },
    )
    return result_of(final)


async def _run_agent(rt: Runtime, record: TaskRecord, profile: Profile, delivery: int) -> str:
    store = rt.store
    request_no = 0

    def on_response(messages: list[ModelMessage], response: ModelResponse) -> None:
        nonlocal request_no
        request_no += 1
        usage = response.usage
        cost_micros, source = cost_of(usage, profile, reported_cost_usd(response))
        store.record_usage(
            record.id,
            f"{delivery}:{request_no}",
            Usage(
                tokens_in=usage.input_tokens,
                tokens_out=usage.output_tokens,
                cache_reads=usage.cache_read_tokens,
                cache_writes=usage.cache_write_tokens,
            ),
            cost_micros,
            source,
        )
        store.save_conversation(record.id, ModelMessagesTypeAdapter.dump_json([*messages, response]))

    agent = Agent(MeteredModel(build_model(profile), on_response), system_prompt=profile.system_prompt)
    result = await agent.run(record.prompt, usage_limits=UsageLimits(request_limit=profile.max_requests))
    return str(result.output)


def result_of(record: TaskRecord) -> SubtaskResult:
    """The result message of a terminal task, from its record (the system of record)."""
    status = record.status.value if record.status.terminal else "failed"
    return SubtaskResult(
        child_id=record.id,
        status=status,  # type: ignore[arg-type]
        summary=record.summary[:MAX_SUMMARY_CHARS],
        usage=Usage(
            tokens_in=record.tokens_in,
            tokens_out=record.tokens_out,
            cache_reads=record.cache_reads,
            cache_writes=record.cache_writes,
        ),
        cost_micros=record.cost_micros,
        error=record.error or None,
        error_class=record.error_class or None,
    )


def one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 1] + "…"
