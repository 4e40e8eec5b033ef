"""Running one task's agent loop: resumable and controllable, with usage and cost per request.

`run_child` is the plain function behind `subq.run_task`; tests call it
directly and the worker runs the same function. It drives the pydantic-ai agent
and nothing else: every step that touches shared state goes through the
coordinator's run-lifecycle seam (`coordinator.runs`), which admits the run,
holds its lease, records each response, and ends it in the right order. A run:
1. starts through the seam, which may answer at once (the task ended, is
   delegated, or waits for a run slot);
2. loads the persisted conversation and goes on from it, answering the calls of
   its last response that have no result: a delegation with the batch's
   combined result (capped as a tool's result is), an approval with the human's decision, anything else with
   `INTERRUPTED`;
3. runs the agent, with, before each model request, a stop check (cancel, a
   spent budget) and the provider's fleet-wide rate limit, transient model
   errors waited out with backoff, each response's usage recorded atomically and
   every new message appended to the conversation; a cancel also abandons the
   request in flight; what each request sends is the conversation compacted to
   fit the model's context window (workers/runtime/compaction.py: the run's
   `Compaction`), the summariser's requests recorded as the task's own;
4. ends completed, failed, cancelled, delegated (children published after the
   state is saved) or waiting for approval, through `Run.end`.
It never raises for an agent-level failure: every outcome is a `SubtaskResult`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pydantic
from pydantic_ai import (
    Agent,
    AgentRun,
    DeferredToolRequests,
    DeferredToolResults,
    RunContext,
    ToolApproved,
    ToolDenied,
    ToolOutput,
)
from pydantic_ai.agent import AgentRetries

try:  # not exported by pydantic-ai: the drain every agent holds unless given one (`_RunChecks` says why)
    from pydantic_ai.capabilities._pending_messages import PendingMessageDrainCapability as _ChecksBase
except ImportError:  # moved by a later pydantic-ai: a capability of subq's own, as before (about 700 calls a child)
    from pydantic_ai.capabilities import AbstractCapability as _ChecksBase  # type: ignore[assignment]
from pydantic_ai.exceptions import UnexpectedModelBehavior
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelRequestPart,
    ModelResponse,
    ModelResponsePart,
    RetryFeedbackPart,
    RetryInfo,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.models.fallback import FallbackModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.usage import UsageLimits

from coordinator import (
    CorruptError,
    Profile,
    StoreError,
    SubtaskResult,
    Usage,
    completion_parameters,
    one_line,
    render_markdown,
)
from coordinator.runs import (
    Ended,
    HandBack,
    LeaseLost,
    Released,
    Run,
    RunStopped,
    ToolCall,
)
from workers import observe
from workers.runtime.compaction import (
    CompactionRecord,
    Compactor,
    combined_result_chars,
    load_records,
    message_adapter,
    summary_request,
)
from workers.runtime.context import Runtime
from workers.runtime.metering import MeteredModel
from workers.runtime.pricing import PROVIDER_REPORTED_SOURCE, cost_of, reported_cost_usd
from workers.runtime.profile_tools import (
    APPROVED_BY_HUMAN,
    CUT_OFF,
    OUTPUT_TOOLS,
    OWN_STATE_TOOLS,
    ProfileTools,
    answer_without_running,
    capped,
)
from workers.runtime.providers import GatedModel, ProviderWait, Route
from workers.runtime.tools import (
    DATA_AGAIN,
    NO_COMPLETION,
    ORCHESTRATION_PROMPT,
    OUTPUT_INVALID,
    OutputInvalid,
    RunState,
    TypedResult,
    attempt_completion,
    bound_invalid_answers,
    check_completion,
    describe_call,
    invalid_answers,
    offline_plan_toolset,
    plans_offline,
    typed_completion,
    typed_parameters,
)

__all__ = ["INTERRUPTED", "Progress", "run_child"]

log = logging.getLogger(__name__)

INTERRUPTED = "Task was interrupted before this tool call could be completed."
# How often one run may answer a completion "not taken" (it came with other calls, or bad arguments)
# before pydantic-ai fails the run: high, as each is an ordinary turn of the conversation, and a
# model that batches its completion every time is still bounded by the profile's `max_requests`.
COMPLETION_RETRIES = 100
# A typed task that fails on its data keeps its last errors in `error`: every one of them, within reason.
MAX_OUTPUT_ERROR_CHARS = 4000
# A final answer its provider ended for another reason than the model's own end is no whole answer: the task
# fails with the class and error given here (the cut text is its record's `summary`), never `completed` with
# half a report. pydantic-ai ends a run on such text as on any; it refuses only an empty one.
CUT_ANSWERS = {
    "length": (
        "OutputTruncated",
        "the model's answer was cut at its output token limit (finish_reason 'length'): ask for a shorter "
        "answer, or use a model with a larger output limit",
    ),
    "content_filter": (
        "ContentFilter",
        "the provider's content filter cut the model's answer (finish_reason 'content_filter')",
    ),
}
# pydantic-ai's words when a tool's calls failed more often in a row than the run allows (tool_manager.py).
TOOL_RETRIES_SPENT = re.compile(r"^Tool (?P<tool>'.*') exceeded max retries count of (?P<max>\d+)\.")

Progress = Callable[[dict[str, Any]], None]


class StopRun(Exception):
    """The run must stop now: its task was stopped, or a budget over it is spent."""

    def __init__(self, budget_holder: str | None = None) -> None:
        super().__init__(budget_holder or "stopped")
        self.budget_holder = budget_holder


def run_child(rt: Runtime, task_id: str, progress: Progress | None = None) -> SubtaskResult:
    """Run (or resume) the task's agent; return its result, never raise for an agent failure.

    `progress`, when given, is called with the latest response's figures as a small dict
    (task_id, request, cost_micros, tool, latency_ms, and tool_calls: each call answered
    since the last, as tool, outcome and ms), at most every LIVE_EVERY_S and after the
    run's last response (the process's `ProgressPacer`); the Celery task turns it into a
    Flower-visible event.
    """
    started = rt.lifecycle.start(task_id)
    if isinstance(started, SubtaskResult):
        return started  # nothing to run: ended, delegated, or waiting for a slot
    run = started
    try:
        result = run.end(run.lost_too_often or _run(rt, run, progress))
        observe.run_ended(run.task.profile, result.status)
        return result
    except LeaseLost:
        return run.lost()  # another run owns the task now (this worker was cut off too long)
    except HandBack:
        return hand_back(run)  # the worker is shutting down: another worker goes on from here
    except BaseException:
        run.abandon()  # Redis failed, not the agent: the delivery is retried (workers.tasks)
        raise


def hand_back(run: Run) -> SubtaskResult:
    """Queue the task again for another worker (`Run.hand_back`); one whose hand-back Redis failed is abandoned
    as any run Redis failed (its lease freed, its held spend owed to the heartbeat), and the error raised on. A
    handler of its own: raised inside `run_child`'s `except HandBack`, it passed that try's other handlers by,
    and the heartbeat renewed the lease of a run that had ended until the process exited."""
    try:
        return run.hand_back()
    except BaseException:
        run.abandon()
        raise


def _run(rt: Runtime, run: Run, progress: Progress | None) -> Ended | Released:
    limit_s = rt.settings.task_time_limit_s
    try:
        profile = run.profile()
        # The threads pool does not enforce Celery's task_time_limit, so the runner does: a
        # runaway run ends here. (Redis never delivers a run message again, whatever the
        # visibility timeout: workers/run_acks.py.)
        return rt.agent_loop.run(_run_agent(rt, run, profile, progress, limit_s))
    except StopRun as stop:
        return run.stopped(stop.budget_holder)
    except RunStopped:  # a tool found its task stopped: the stop's outcome, written by the stop
        return run.stopped(None)
    except (LeaseLost, HandBack):
        raise  # the run ends without an outcome of its own (run_child)
    except TimeoutError:
        return Ended("failed", error=f"ran over SUBQ_TASK_TIME_LIMIT_S={limit_s}", error_class="TimeLimit")
    except CorruptError as exc:
        # Its history cannot be read: end it visibly rather than retry or guess an empty one.
        return Ended("failed", error=str(exc), error_class="CorruptError")
    except StoreError:
        raise  # Redis, not the agent, failed: the task is retried (workers.tasks)
    except Exception as exc:  # an agent-level failure is a result, never a crash of the chord
        log.info("task %s failed: %s: %s", run.task.id, type(exc).__name__, exc)
        return Ended("failed", error=one_line(str(exc)), error_class=type(exc).__name__, error_detail=_body_of(exc))


async def _run_agent(
    rt: Runtime, run: Run, profile: Profile, progress: Progress | None, limit_s: float
) -> Ended | Released:
    """The agent's run, raced against the process's stop watch, which abandons it when the task is stopped, within
    `limit_s` (TimeoutError). The limit is a scope of this coroutine, not `asyncio.wait_for`, which wraps it in a
    task of its own on Python 3.11: one task and its steps less for every run. The scope covers a stopped run's
    unwinding too (a tool's cleanup that awaits), as `wait_for` did: past the limit the run ends all the same."""
    agent_run = asyncio.create_task(_drive(rt, run, profile, progress))
    stop = rt.stop_watch.watch(run)
    try:
        waited: set[asyncio.Future[Any]] = {agent_run, stop}
        async with asyncio.timeout(limit_s):
            done, _ = await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
            if agent_run in done:
                return agent_run.result()
            agent_run.cancel()  # abandons the model call in flight
            try:
                await agent_run
            except (asyncio.CancelledError, Exception):
                pass  # its unwinding ended, or the limit cut it short: stopped either way
    except BaseException:  # the time limit: the agent must not go on after its run has ended
        agent_run.cancel()
        raise
    finally:
        rt.stop_watch.forget(run)
    raise StopRun()


async def _drive(rt: Runtime, run: Run, profile: Profile, progress: Progress | None) -> Ended | Released:
    """The agent's run: from its persisted conversation (or its prompt) to its outcome."""
    history = _load_history(run)
    if not history:
        run.announce_task()
    schema = _schema_of(run.task.output_schema, profile)
    journal = len(history)  # what the journal holds: a request `_ended_before` adds is saved with its answer
    if history and isinstance(history[-1], ModelResponse) and not _calls_without_result(history):
        ended = _ended_before(run, history, schema, profile.max_invalid_outputs)
        if ended is not None:
            return ended
    return await _Drive(rt, run, profile, progress, history, journal).drive(schema)


class _Drive:
    """One run of the agent: its model behind its route, each response recorded, its progress paced,
    and the messages it adds saved (`saved`: how many of them the journal holds)."""

    def __init__(
        self,
        rt: Runtime,
        run: Run,
        profile: Profile,
        progress: Progress | None,
        history: list[ModelMessage],
        saved: int,
    ) -> None:
        self.rt, self.run, self.profile, self.progress = rt, run, profile, progress
        self.task = run.task
        self.state = RunState(run, profile, sandbox=rt.sandbox)
        self.offered = rt.toolbox.tools(self.task.profile).names
        self.history = history
        # The messages the journal holds: all of `history` but a request that asks a resumed typed run's model
        # again, which goes with its answer (counted as saved, it never was: a later resume sent its call alone).
        self.saved = saved
        self.request_no = 0
        self.unsent: dict[str, Any] | None = None  # the latest response's progress, not yet sent
        self.run_key = f"{self.task.id}:{run.token}"
        # Its profile's model, then its fallbacks', each behind its endpoint's gate, and its patience.
        self.route = Route(
            rt.settings, run.provider, self.task.profile or rt.settings.default_profile, task_id=self.task.id
        )

    # -- each response ------------------------------------------------------------------

    def record(self, response: ModelResponse, latency_ms: float, via: Route, *, tool: str | None, text: str) -> int:
        """A response's usage and cost on the task, priced at the profile whose model answered it."""
        self.request_no += 1
        usage = response.usage
        via.succeeded()
        # Priced at the profile whose model answered, which a fallback names in the source and the UI.
        answered = via.answered
        cost_micros, source = cost_of(usage, answered.profile, reported_cost_usd(response))
        if usage.unmeasured_requests and source != PROVIDER_REPORTED_SOURCE:
            source = f"{source} (estimated: the answer reported no usage)"
        if via.fell_back:
            source = f"{source} (fallback: profile {answered.name!r}, {answered.profile.model})"
            self.run.say("fallback", f"answered by profile {answered.name!r} ({answered.profile.model})")
        used = Usage(
            tokens_in=usage.input_tokens,
            tokens_out=usage.output_tokens,
            cache_reads=usage.cache_read_tokens,
            cache_writes=usage.cache_write_tokens,
        )
        self.run.record_response(
            self.request_no, used, cost_micros, source, latency_ms=latency_ms, tool=tool, text=text
        )
        # This worker's counters, in memory, under the model of the route's profile.
        observe.response(via.hops[0].profile.model, self.task.profile, used, cost_micros)
        return cost_micros

    def on_response(self, messages: list[ModelMessage], response: ModelResponse, latency_ms: float) -> None:
        text = " ".join(p.content for p in response.parts if isinstance(p, TextPart)).strip()
        tool = next((p.tool_name for p in response.parts if isinstance(p, ToolCallPart)), None)
        cost_micros = self.record(response, latency_ms, self.route, tool=tool, text=text)
        for part in response.parts:
            self._say_part(part)
        self.unsent = {
            "task_id": self.task.id, "request": self.request_no, "cost_micros": cost_micros, "tool": tool,
            "latency_ms": round(latency_ms),
        }  # fmt: skip
        self.send_progress()

    def _say_part(self, part: ModelResponsePart) -> None:
        if isinstance(part, TextPart) and part.content.strip():
            self.run.say("text", part.content)
        elif isinstance(part, ToolCallPart) and part.tool_name not in self.offered:
            # pydantic-ai answers it "Unknown tool name" and runs nothing: never shown as if it ran,
            # and counted as the error it is.
            line = f"not run: {part.tool_name} is not a tool of this task: {describe_call(part)}"
            answer_without_running(
                self.state, part.tool_call_id, part.tool_name, "error", line, kind="error", known=False
            )
        elif isinstance(part, ToolCallPart):
            self.run.say("tool", describe_call(part))

    def send_progress(self) -> None:
        # Due on the process's pacer: sent with every other run's at most every LIVE_EVERY_S (the
        # latest figures then, naming the tool calls answered since the last, for Flower).
        if self.progress is not None and self.unsent is not None:
            self.rt.progress_pacer.due(self.run_key, self._send_latest)

    def _send_latest(self) -> None:
        if self.progress is None or self.unsent is None:
            return
        self.unsent["tool_calls"], self.state.tool_calls = self.state.tool_calls, []
        self.progress(self.unsent)
        self.unsent = None

    # -- the run ------------------------------------------------------------------------

    async def drive(self, schema: dict[str, Any] | None) -> Ended | Released:
        rt, run, profile, task, history = self.rt, self.run, self.profile, self.task, self.history
        model = MeteredModel(
            self.route.model, self.on_response, labels=(profile.provider, profile.model),
            before=_before_request(run, profile.provider), after_error=self.route.after_error,
            compactor=_compactor(rt, run, profile, self.route, self.record, history),
        )  # fmt: skip
        pending = _calls_without_result(history)
        results = _answers(run, self.state, pending, self.offered, chain_window(self.route)[0]) if pending else None
        agent: Agent[RunState, Any] = rt.toolbox.agent(task.profile, plans_offline(profile, task.prompt), build_agent)
        output_type, output_retries = _typed(schema, profile, self.state)
        retries: AgentRetries = {"tools": profile.max_tool_retries}
        if output_retries is not None:
            retries["output"] = output_retries
        async with agent.iter(
            None if history else task.prompt,
            output_type=output_type,
            model=model,
            message_history=history or None,
            deferred_tool_results=results,
            deps=self.state,
            usage_limits=UsageLimits(request_limit=profile.max_requests),
            retries=retries,
        ) as agent_run:
            ended = await self._iterate(agent_run)
            if ended is not None:
                return ended
            assert agent_run.result is not None
            output = agent_run.result.output
            messages = agent_run.all_messages()
            invalid = invalid_answers(messages)
        if self.state.tool_calls and self.unsent is None:
            self.unsent = {
                "task_id": task.id,
                "request": self.request_no,
                "cost_micros": 0,
                "tool": None,
                "latency_ms": 0,
            }
        self.send_progress()  # the run's last figures (sent within LIVE_EVERY_S: a run that answers at once sends one)
        return self._outcome(output, invalid, messages)

    async def _iterate(self, agent_run: AgentRun[RunState, Any]) -> Ended | Released | None:
        """Each node of the agent's run, its messages saved as they come; an outcome when the run ends early."""
        try:
            async for _node in agent_run:
                # The response is among the messages before its calls run: the step that keeps it
                # (`PolicyToolset`: before a call that must not run twice, or with a result) writes it.
                self.saved = _save_new(self.run, agent_run.all_messages(), self.saved)
        except ProviderWait as wait:  # its provider is down: the run gives its worker back, its request kept
            _save_new(self.run, agent_run.all_messages(), self.saved)
            return wait.released
        except OutputInvalid as refused:  # its `max_invalid_outputs`-th invalid answer (bound_invalid_answers)
            _save_new(self.run, agent_run.all_messages(), self.saved)
            return Ended(
                "failed", error=str(refused)[:MAX_OUTPUT_ERROR_CHARS], error_class="OutputInvalid",
                invalid_outputs=refused.answers,
            )  # fmt: skip
        except UnexpectedModelBehavior as exc:
            _save_new(self.run, agent_run.all_messages(), self.saved)
            spent = TOOL_RETRIES_SPENT.match(str(exc))
            if spent is None:
                raise
            allowed = int(spent["max"])
            last = one_line(str(exc.__cause__ or ""))[:500]
            return Ended(
                "failed", error_class="ToolRetries",
                error=f"the model's calls of tool {spent['tool']} failed {allowed + 1} times in a row (the profile's "
                f"max_tool_retries is {allowed}); the last: {last}",
            )  # fmt: skip
        _save_new(self.run, agent_run.all_messages(), self.saved)
        return None

    def _outcome(self, output: object, invalid: int, messages: Sequence[ModelMessage]) -> Ended | Released:
        run = self.run
        if isinstance(output, DeferredToolRequests):
            if output.approvals:
                approval_ids = run.approvals.park([_tool_call(call, output) for call in output.approvals])
                for approval_id, call in zip(approval_ids, output.approvals, strict=True):
                    args = _tool_call(call, output).args
                    run.say("approval_request", f"{approval_id}: {call.tool_name} {json.dumps(args)}")
                return Released("waiting_approval")
            if run.plan.delegation is None:
                return Ended("failed", error="the run deferred a call that is not a delegation", error_class="Deferred")
            return Released("delegated")
        if isinstance(output, TypedResult):
            return Ended("completed", summary=output.result, output_json=output.data_json, invalid_outputs=invalid)
        last = next(m for m in reversed(messages) if isinstance(m, ModelResponse))
        return _cut_answer(last) or Ended("completed", summary=str(output))


def _typed(schema: dict[str, Any] | None, profile: Profile, state: RunState) -> tuple[Any, int | None]:
    """The run's output type and output retries (None, None: the agent's own). A task with an output schema (its
    own, else its profile's) ends only with attempt_completion(result, data), built for this run: no plain text ends
    it. Its invalid answers are bounded by `bound_invalid_answers`, so pydantic-ai's own retries are set past that
    bound, "not taken" answers aside (COMPLETION_RETRIES)."""
    if schema is None:
        return None, None
    state.completion_parameters = completion_parameters(schema)
    retries = COMPLETION_RETRIES + profile.max_invalid_outputs
    return [typed_completion(schema, retries), DeferredToolRequests], retries


def _before_request(run: Run, provider: str) -> Callable[[], Awaitable[None]]:
    """What runs before each request to `provider`'s model: the run's stop check, then `provider`'s fleet-wide
    rate limit (a summariser on another provider waits on its own)."""

    async def before_request() -> None:
        check = run.check_stop()
        if check.stopped:
            raise StopRun(check.budget_holder)
        while wait_ms := run.limits.rate_wait_ms(provider):
            await asyncio.sleep(wait_ms / 1000)

    return before_request


def chain_window(route: Route) -> tuple[int | None, str]:
    """The context window a route's requests must fit, and whose it is: each hop's `context_window`, else what
    pydantic-ai and genai-prices know of its model, the smallest of them (any hop may answer); None where no hop's
    is known."""
    models = route.model.models if isinstance(route.model, FallbackModel) else [route.model]
    known: list[tuple[int, str]] = []
    for model in models:
        assert isinstance(model, GatedModel)
        window = model.hop.profile.context_window or model.context_window
        if window:
            known.append((window, model.hop.name))
    if not known:
        return None, ""
    window, name = min(known)
    return window, f"profile {name!r}"


class Compaction:
    """What a run's compaction needs of it (compaction.CompactionPort): the task's plan, and keeping a record."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def plan(self) -> str:
        items = self.run.plan.todos()
        return render_markdown(items) if items else ""

    def keep(self, record: CompactionRecord, ui_text: str) -> None:
        if not self.run.compaction.keep(record.number, record.model_dump_json(), ui_text):
            # Only a second live run could have kept it: the lease says there is none.
            log.warning("subq: compaction %d of %s was kept already", record.number, self.run.task_id)


def _compactor(
    rt: Runtime,
    run: Run,
    profile: Profile,
    route: Route,
    record: Callable[..., int],
    history: Sequence[ModelMessage],
) -> Compactor:
    """The run's compaction: its window (`chain_window`), and its summariser: `compaction_profile`'s route
    (its fallbacks and its endpoint's gate, its provider's rate limit), or the run's own, each summary recorded as
    one of the run's responses. A resumed run (one with a conversation) reads the records its task kept."""
    window, window_of = chain_window(route)
    name = profile.compaction_profile or run.task.profile or rt.settings.default_profile
    own = name == (run.task.profile or rt.settings.default_profile)
    via = route if own else Route(rt.settings, run.provider, name, task_id=run.task.id)
    summariser = via.hops[0].profile

    def on_summary(messages: list[ModelMessage], response: ModelResponse, latency_ms: float) -> None:
        record(response, latency_ms, via, tool=None, text="")

    model = MeteredModel(
        via.model, on_summary, labels=(summariser.provider, summariser.model),
        before=_before_request(run, summariser.provider),
        after_error=via.after_error,
    )  # fmt: skip

    async def summarise(transcript: str, max_tokens: int) -> str:
        settings = ModelSettings(max_tokens=max_tokens)
        response = await model.request([summary_request(transcript)], settings, ModelRequestParameters())
        return "\n".join(p.content for p in response.parts if isinstance(p, TextPart))

    kept = load_records(run.compaction.records()) if history else []
    return Compactor(
        Compaction(run), summarise, window=window, share=profile.compact_at_share, summariser_name=name,
        summariser_window=chain_window(via)[0], records=kept, window_of=window_of,
    )  # fmt: skip


def build_agent(tools: ProfileTools, with_planner: bool) -> Agent[RunState, Any]:
    """A profile's agent (and its planner use), built once per process by the toolbox: building
    one generates every tool's JSON schema (about 1.5 ms, measured as 12% of a worker's CPU in
    bench/), and nothing in it is per task: the model, with the task's hooks, is given to each run."""
    completion = ToolOutput(attempt_completion, name="attempt_completion", max_retries=COMPLETION_RETRIES)
    return Agent(
        deps_type=RunState,
        output_type=[str, completion, DeferredToolRequests],
        system_prompt=f"{tools.system_prompt}\n\n{ORCHESTRATION_PROMPT}",
        toolsets=[tools.toolset, offline_plan_toolset] if with_planner else [tools.toolset],
        capabilities=[_RunChecks()],
    )


class _RunChecks(_ChecksBase):
    """subq's three hooks into every run of its agents: a tool call's invalid arguments (`_invalid_arguments`), a
    typed run's completion schema (`typed_parameters`) and its bound on invalid answers (`bound_invalid_answers`).
    A capability of its own rather than pydantic-ai's `Hooks`, which looks up a registry of its hooks at each of
    the ~30 hook points of a run's every step whether it has any there or not (about 100 calls of a child's).

    It is pydantic-ai's pending-message drain, which every agent is given unless it holds one, with subq's hooks
    added: pydantic-ai copies the run's context for each capability at each hook point, overridden there or not
    (about 700 calls of a child's for a capability of its own, bench/run_calls.py), so subq's agents hold the two
    (b)'s does. The drain's own hook (`before_model_request`) and its place (outermost) are kept as inherited."""

    async def on_tool_validate_error(
        self, ctx: RunContext[RunState], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any, error: Any
    ) -> Any:
        return await _invalid_arguments(ctx, call=call, tool_def=tool_def, args=args, error=error)

    async def prepare_output_tools(
        self, ctx: RunContext[RunState], tool_defs: list[ToolDefinition]
    ) -> list[ToolDefinition]:
        return await typed_parameters(ctx, tool_defs)

    async def after_node_run(self, ctx: RunContext[RunState], *, node: Any, result: Any) -> Any:
        return await bound_invalid_answers(ctx, node=node, result=result)


async def _invalid_arguments(
    ctx: RunContext[RunState], /, *, call: ToolCallPart, tool_def: ToolDefinition, args: Any, error: Exception
) -> Any:
    """A call whose arguments fail validation: pydantic-ai answers it with the errors for the model to fix;
    it is a `tool_error` line and counts as `error` (an output tool's bad call is the completion's, not a tool's)."""
    if tool_def.kind == "function":
        why = one_line(str(error))[:500]
        line = f"{call.tool_name}: invalid arguments: {why}"
        answer_without_running(ctx.deps, call.tool_call_id, call.tool_name, "error", line)
    raise error


def _ended_before(run: Run, history: list[ModelMessage], schema: dict[str, Any] | None, bound: int) -> Ended | None:
    """The last response of a resumed run whose calls all have results: its completion (the run had ended, only
    its status was lost), checked again for a typed task. A typed task's invalid answer is its run's last
    message when its worker died before the next request was saved (it is saved with that request's answer):
    below the bound, the request that asks again is appended to `history` (None: the run goes on from it);
    at the bound, the task fails as the answer's own run would have failed it."""
    last = history[-1]
    assert isinstance(last, ModelResponse)
    if schema is None:
        return _cut_answer(last) or Ended("completed", summary=_text_of(last))
    calls = [p for p in last.parts if isinstance(p, ToolCallPart) and p.tool_name == "attempt_completion"]
    taken, errors = check_completion(schema, calls[-1].args_as_dict()) if calls else (None, ["no attempt_completion"])
    invalid = invalid_answers(history)
    if taken is not None:
        return Ended("completed", summary=taken.result, output_json=taken.data_json, invalid_outputs=invalid)
    answers = invalid + 1
    run.say("output_invalid", f"answer {answers} of at most {bound}: " + "; ".join(errors))
    if answers >= bound:
        refused = OutputInvalid(answers, errors)
        return Ended(
            "failed", error=str(refused)[:MAX_OUTPUT_ERROR_CHARS], error_class="OutputInvalid", invalid_outputs=answers
        )
    left = bound - answers
    warning = f" ({left} more invalid answer{'s fail' if left != 1 else ' fails'} the task)."
    if calls:
        text = f"{OUTPUT_INVALID}{'; '.join(errors)}{DATA_AGAIN}{warning}"
        ask: ModelRequestPart = ToolReturnPart("attempt_completion", text, calls[-1].tool_call_id, outcome="retried")
    else:
        ask = RetryFeedbackPart(NO_COMPLETION + warning, retry=RetryInfo("no_output"))
    history.append(ModelRequest(parts=[ask]))
    return None


def _schema_of(own: dict[str, Any] | None, profile: Profile) -> dict[str, Any] | None:
    """A task's output schema: its own, else its profile's. `{}` is a schema (any JSON is valid), not none."""
    return own if own is not None else profile.output_schema


def _tool_call(call: ToolCallPart, requests: DeferredToolRequests) -> ToolCall:
    meta = requests.metadata.get(call.tool_call_id, {})
    return ToolCall(
        tool=call.tool_name, args=dict(meta.get("args") or call.args_as_dict()), tool_call_id=call.tool_call_id
    )


def _answers(
    run: Run, state: RunState, pending: Sequence[ToolCallPart], offered: frozenset[str], window: int | None
) -> DeferredToolResults:
    """Results for the calls of the last response that have none: the kept result of a call that
    returned (replayed; its cost was recorded with it), a batch's, a decision; a tool's call that may
    have been cut off by its worker's death (it has no decision yet, or a human approved it and it had
    started) goes to `PolicyToolset` as `CUT_OFF`: run again only if idempotent; else INTERRUPTED."""
    calls: dict[str, Any] = {}
    approvals: dict[str, Any] = {}
    metadata: dict[str, dict[str, Any]] = {}
    answers = run.approvals.answers()
    batch, decisions = answers.batch, answers.decisions
    journal = run.journal.kept([c.tool_call_id for c in pending if c.tool_name not in OWN_STATE_TOOLS])
    kept, started = journal.results, journal.started
    # Answered without running by an earlier run of the task (its worker died before the request carrying the
    # answer was saved): answered the same way again, neither said nor counted again (`answer_without_running`).
    state.answered = frozenset(journal.answered)
    for call in pending:
        call_id = call.tool_call_id
        if call_id in kept:
            calls[call_id] = kept[call_id]
            run.say("tool_replayed", describe_call(call))
            # Counted on the task once already, as it returned. The label is a tool of the task's or "(unknown)": a
            # kept answer to a tool the model made up would have put its text in a series of its own.
            tool = call.tool_name if call.tool_name in offered else observe.UNKNOWN_TOOL
            observe.tool_call(tool, "replayed")
        elif batch is not None and batch.tool_call_id == call_id:
            # The children's combined result (up to 256 KiB): what the parent delegated for, typed outputs
            # among it, so it is cut only where the parent's window asks (`combined_result_chars`); the
            # conversation keeps what the model read.
            limit = combined_result_chars(window, state.profile.max_tool_output_chars)
            calls[call_id] = batch.result if limit is None else capped(batch.result, limit, call.tool_name)
        elif call_id in decisions and decisions[call_id].approved and call_id in started:
            approvals[call_id] = ToolApproved()  # approved, and running when its worker died
            metadata[call_id] = {CUT_OFF: True, APPROVED_BY_HUMAN: True}
        elif call_id in decisions and decisions[call_id].approved:
            approvals[call_id] = ToolApproved()  # it runs now, and counts as it ends
        elif call_id in decisions:
            # A human's no: the model reads it as the call's result, and it counts as `denied` here, where the
            # run applies it (pydantic-ai answers a ToolDenied without calling the toolset).
            denial = ToolDenied(message=decisions[call_id].feedback)
            approvals[call_id] = denial
            line = f"{describe_call(call)}: denied: {denial.message}"  # by a person, or its approval expired
            answer_without_running(state, call_id, call.tool_name, "denied", line)
        elif call.tool_name in offered and call.tool_name not in OWN_STATE_TOOLS | OUTPUT_TOOLS:
            approvals[call_id] = ToolApproved()
            metadata[call_id] = {CUT_OFF: True}
        else:
            calls[call_id] = INTERRUPTED
    return DeferredToolResults(calls=calls, approvals=approvals, metadata=metadata)


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


def _load_history(run: Run) -> list[ModelMessage]:
    messages = []
    adapter = message_adapter()
    for index, entry in enumerate(run.history()):
        try:
            messages.append(adapter.validate_json(entry))
        except pydantic.ValidationError:
            raise CorruptError(f"Conversation message {index} of task {run.task.id} is corrupt") from None
    return messages


def _save_new(run: Run, messages: Sequence[ModelMessage], saved: int) -> int:
    """Append the messages not yet persisted; returns how many are persisted now."""
    adapter = message_adapter()
    run.save([adapter.dump_json(m).decode() for m in messages[saved:]])
    return max(saved, len(messages))


def _cut_answer(last: ModelResponse) -> Ended | None:
    """The failure of a final answer its provider cut (`CUT_ANSWERS`), or None for a whole one."""
    cut = CUT_ANSWERS.get(last.finish_reason or "")
    if cut is None:
        return None
    error_class, error = cut
    return Ended("failed", summary=_text_of(last), error=error, error_class=error_class)


def _text_of(response: ModelResponse) -> str:
    return "\n".join(p.content for p in response.parts if isinstance(p, TextPart))


def _body_of(exc: Exception) -> str:
    """A provider's raw error body (pydantic-ai's ModelHTTPError keeps it as `body`), as text."""
    body = getattr(exc, "body", None)
    if body is None:
        return ""
    return body if isinstance(body, str) else json.dumps(body, default=str)
