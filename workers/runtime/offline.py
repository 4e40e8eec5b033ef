"""The offline model (profile `offline`): deterministic, local, scriptable. NOT a real LLM.

It answers without any network so the demo and the tests run anywhere, and it
reports token usage so the cost accounting has something realistic to price
(pricing happens elsewhere, from the profile's `priced_as` real model; see
`workers.runtime.pricing`). `docs/offline-model.md` is the user's guide.

A task's message (the first user prompt of the conversation) may hold one
fenced block with the info string `subq-script`::

    ```subq-script
    {"steps": [
      {"tool_calls": [{"name": "lookup", "args": {"q": "x"}}], "usage": {"input": 900, "output": 40}},
      {"reply": "Found it.", "latency_ms": 200}
    ]}
    ```

Request number *n* of the conversation (counted as the `ModelResponse`
messages already in the history, so the count survives persisting and resuming
a task) plays step *n*. Without a script, and after the last step, the model
answers `Done: <first line of the task>` so every agent run ends.

Compaction (workers/runtime/compaction.py): a compacted conversation's first
request says how many responses it folded, and they count among the steps
played; a summariser's request is answered with notes made from its transcript
(the tool calls it names), not a step of the script.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from pydantic_ai import RunContext
from pydantic_ai.exceptions import (
    ModelAPIError,
    ModelRateLimitError,
    ModelRequestRejectedError,
    ModelServerError,
    ModelTimeoutError,
)
from pydantic_ai.messages import (
    FinishReason,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ModelResponsePart,
    RetryFeedbackPart,
    SystemPromptPart,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import CompletedStreamedResponse, Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import RequestUsage

from coordinator import OFFLINE_PROFILE
from workers.runtime.compaction import folded_responses, is_summary_request
from workers.runtime.planner import next_step, read_plan
from workers.runtime.script import (
    MAX_LATENCY_MS,
    MAX_SUMMARY_CHARS,
    SCRIPT_INFO_STRING,
    Script,
    ScriptUsage,
    Step,
    ToolCall,
    final_reply,
    parse_script,
)

__all__ = [
    "MAX_LATENCY_MS",
    "MAX_SUMMARY_CHARS",
    "SCRIPT_INFO_STRING",
    "OfflineModel",
    "Script",
    "ScriptUsage",
    "Step",
    "ToolCall",
    "final_reply",
    "offline_model",
    "parse_script",
    "task_message",
    "text_tokens",
]

# A rough, common rule of thumb for English text with BPE tokenizers; only needs
# to be deterministic and plausible, not exact.
CHARS_PER_TOKEN = 4


def text_tokens(text: str) -> int:
    """The tokens the offline model reports for `text`: about four characters a token, and at least one
    (deterministic; what a request sends is counted for its window by compaction.estimate_tokens)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def task_message(messages: Sequence[ModelMessage]) -> str:
    """The task's message: the text of the first user prompt in the history ("" if none)."""
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart):
                    return _user_prompt_text(part)
    return ""


class OfflineModel(Model):
    """A local pydantic-ai model that plays a task's `subq-script`, or answers `Done: ...`.

    It keeps no state between requests: the step comes from the history it is
    given, so one instance may serve any number of tasks at once, and a task
    resumed from its persisted history continues its script where it stopped.
    """

    def __init__(self, *, settings: ModelSettings | None = None) -> None:
        super().__init__(settings=settings)
        # Attempts of steps with `transient` failures, keyed by (task message, step):
        # the one state it keeps, so "fail twice, then answer" holds within a run.
        self._attempts: dict[tuple[int, int], int] = {}

    @property
    def model_name(self) -> str:
        return OFFLINE_PROFILE

    @property
    def system(self) -> str:
        return OFFLINE_PROFILE

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        _, model_request_parameters = self.prepare_request(model_settings, model_request_parameters)
        return await self._respond(messages, model_request_parameters)

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        # Streamed runs (an agent with an event handler streams without asking) get the
        # same response, replayed as part events, so both paths play the same script.
        _, model_request_parameters = self.prepare_request(model_settings, model_request_parameters)
        response = await self._respond(messages, model_request_parameters)
        yield CompletedStreamedResponse(response, model_request_parameters=model_request_parameters, replay_events=True)

    async def _respond(self, messages: list[ModelMessage], params: ModelRequestParameters) -> ModelResponse:
        if is_summary_request(messages):
            return _notes(messages, params)
        message = task_message(messages)
        script = parse_script(message)
        # The steps played: the responses in the history, and those a compaction folded away.
        index = folded_responses(messages) + sum(isinstance(m, ModelResponse) for m in messages)
        step: Step | None
        if script is None:
            step = _planned_step(messages, message, params)
        else:
            step = script.steps[index] if index < len(script.steps) else None
            if step is not None:
                await self._delay_or_fail(step, message, index)
        parts, finish = _response_parts(step, message, index, self.model_name)
        if step is not None and step.usage is not None:
            usage = step.usage.request_usage()
        else:
            usage = RequestUsage(
                input_tokens=text_tokens(_request_text(messages, params)),
                output_tokens=text_tokens(_response_text(parts)),
            )
        return ModelResponse(
            parts=parts,
            usage=usage,
            model_name=self.model_name,
            provider_name=OFFLINE_PROFILE,
            provider_details={"script_step": index if step is not None else None},
            provider_response_id=f"offline-{index}",
            finish_reason=finish,
        )

    async def _delay_or_fail(self, step: Step, message: str, index: int) -> None:
        """A scripted step's latency, then its transient failure while it has failed fewer than `times` times."""
        if step.latency_ms:
            # Awaited, not slept: other subagents on the worker's event loop keep running,
            # as they would while a real API call is in flight.
            await asyncio.sleep(step.latency_ms / 1000)
        if step.transient is not None:
            key = (hash(message), index)
            attempts = self._attempts.get(key, 0)
            if attempts < step.transient.times:
                self._attempts[key] = attempts + 1
                raise _TRANSIENT[step.transient.kind](self.model_name, f"scripted transient {step.transient.kind}")


def _planned_step(messages: Sequence[ModelMessage], message: str, params: ModelRequestParameters) -> Step | None:
    """Without a script: the next step of the plan in the instructions, if any (None: the final reply)."""
    tools = [tool.name for tool in params.function_tools]
    planned = next_step(read_plan(_instructions(messages)), message, _last_tool_result(messages), tools)
    if planned is not None and planned.tool_calls:
        return Step(tool_calls=[ToolCall(name=name, args=args) for name, args in planned.tool_calls])
    if planned is not None:
        return Step(reply=planned.reply)
    return None


def _response_parts(
    step: Step | None, message: str, index: int, model_name: str
) -> tuple[list[ModelResponsePart], FinishReason]:
    """The response a step gives: its reply (no step: the final reply), or its tool calls; a `fail` step raises."""
    if step is None or step.reply is not None:
        return [TextPart(content=final_reply(message) if step is None else str(step.reply))], "stop"
    if step.tool_calls is not None:
        calls: list[ModelResponsePart] = [
            ToolCallPart(tool_name=call.name, args=dict(call.args), tool_call_id=f"call_{index}_{i}")
            for i, call in enumerate(step.tool_calls)
        ]
        return calls, "tool_call"
    # Rejected, not rate-limited/unavailable/5xx: the runtime waits those out, and a
    # scripted failure must fail the same way on every attempt.
    raise ModelRequestRejectedError(model_name, str(step.fail), body={"script_step": index})


_TRANSIENT: dict[str, type[ModelAPIError]] = {
    "rate_limit": ModelRateLimitError,
    "server": ModelServerError,
    "timeout": ModelTimeoutError,
}


# The notes the offline model writes for a summariser: at most this many of the calls it read, each cut.
NOTES_CALLS = 30
NOTE_CHARS = 120


def _notes(messages: Sequence[ModelMessage], params: ModelRequestParameters) -> ModelResponse:
    """A summariser's answer: the tool calls its transcript names (compaction.py writes them one a line)."""
    transcript = "\n".join(
        _user_prompt_text(part) for m in messages if isinstance(m, ModelRequest) for part in m.parts
        if isinstance(part, UserPromptPart)
    )  # fmt: skip
    calls = [line[len("[agent calls] ") :] for line in transcript.splitlines() if line.startswith("[agent calls] ")]
    shown = [call if len(call) <= NOTE_CHARS else call[: NOTE_CHARS - 1] + "…" for call in calls[-NOTES_CALLS:]]
    earlier = f" ({len(calls) - len(shown)} earlier ones left out)" if len(calls) > len(shown) else ""
    text = f"Notes (offline model): the agent made {len(calls)} tool calls{earlier}:\n" + "\n".join(shown)
    parts: list[ModelResponsePart] = [TextPart(content=text)]
    return ModelResponse(
        parts=parts,
        usage=RequestUsage(input_tokens=text_tokens(_request_text(messages, params)), output_tokens=text_tokens(text)),
        model_name=OFFLINE_PROFILE,
        provider_name=OFFLINE_PROFILE,
        provider_response_id="offline-notes",
        finish_reason="stop",
    )


def offline_model() -> OfflineModel:
    """The offline model for the `offline` profile."""
    return OfflineModel()


def _instructions(messages: Sequence[ModelMessage]) -> str | None:
    """The instructions in force for this request (pydantic-ai records them on each request)."""
    requests = [m for m in messages if isinstance(m, ModelRequest)]
    return requests[-1].instructions if requests else None


def _last_tool_result(messages: Sequence[ModelMessage]) -> str | None:
    """The last tool result sent back, if the last request carries one; a denied call's as an error."""
    if not messages or not isinstance(messages[-1], ModelRequest):
        return None
    results = [part for part in messages[-1].parts if isinstance(part, ToolReturnPart)]
    if not results:
        return None
    last = results[-1]
    if last.outcome == "denied":  # a human's no (the policy's is a result, "Denied by policy: …"): the planner stops
        return f"Error: {last.tool_name} was denied: {last.model_response_str()}"
    return last.model_response_str()


def _user_prompt_text(part: UserPromptPart) -> str:
    if isinstance(part.content, str):
        return part.content
    return "\n".join(item for item in part.content if isinstance(item, str))


def _request_text(messages: Sequence[ModelMessage], params: ModelRequestParameters) -> str:
    """All the text a real API would be sent for this request: history, instructions, tool schemas."""
    chunks: list[str] = []
    # Every request records the instructions in force, but an API is sent them once.
    requests = [m for m in messages if isinstance(m, ModelRequest)]
    if requests and requests[-1].instructions:
        chunks.append(requests[-1].instructions)
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, SystemPromptPart):
                    chunks.append(part.content)
                elif isinstance(part, UserPromptPart):
                    chunks.append(_user_prompt_text(part))
                elif isinstance(part, ToolReturnPart):
                    chunks.append(part.model_response_str())
                elif isinstance(part, RetryFeedbackPart):
                    chunks.append(part.model_response())
        else:
            chunks.append(_response_text(message.parts))
    for tool in params.function_tools:
        chunks.append(json.dumps([tool.name, tool.description, tool.parameters_json_schema], sort_keys=True))
    return "\n".join(chunks)


def _response_text(parts: Sequence[ModelResponsePart]) -> str:
    chunks: list[str] = []
    for part in parts:
        if isinstance(part, TextPart | ThinkingPart):
            chunks.append(part.content)
        elif isinstance(part, ToolCallPart):
            chunks.append(part.tool_name + part.args_as_json_str())
    return "\n".join(chunks)
