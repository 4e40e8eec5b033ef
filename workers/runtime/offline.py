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
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, Self

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator
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

from coordinator import OFFLINE_PROFILE, ScriptError

__all__ = [
    "MAX_LATENCY_MS",
    "SCRIPT_INFO_STRING",
    "OfflineModel",
    "Script",
    "ScriptUsage",
    "Step",
    "ToolCall",
    "estimate_tokens",
    "final_reply",
    "offline_model",
    "parse_script",
    "task_message",
]

SCRIPT_INFO_STRING = "subq-script"
# Ten minutes: longer than any API call worth simulating, short enough that a typo
# cannot park a worker slot for the task's whole time limit.
MAX_LATENCY_MS = 600_000
# A rough, common rule of thumb for English text with BPE tokenizers; only needs
# to be deterministic and plausible, not exact.
CHARS_PER_TOKEN = 4
# Keeps the default reply a one-liner when a task's first line is a paragraph.
MAX_SUMMARY_CHARS = 80

# An opening fence of three backticks and the info string, then everything up to
# the next closing fence. CommonMark allows up to three spaces of indentation.
_SCRIPT_BLOCK = re.compile(
    r"^ {0,3}```[ \t]*" + re.escape(SCRIPT_INFO_STRING) + r"[ \t]*\n(?P<body>.*?)^ {0,3}```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_SCRIPT_OPENING = re.compile(r"^ {0,3}```[ \t]*" + re.escape(SCRIPT_INFO_STRING) + r"[ \t]*$", re.MULTILINE)


class ToolCall(BaseModel):
    """One tool call a step makes: the tool's name and its JSON arguments."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    args: dict[str, Any] = Field(default_factory=dict)


class ScriptUsage(BaseModel):
    """Token counts a step reports. `input` excludes cache tokens, as in Anthropic's protocol."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # strict: a JSON 1.5 or "7" is a mistake in the script, not a count to round or parse.
    input: int = Field(default=0, ge=0, strict=True)
    output: int = Field(default=0, ge=0, strict=True)
    cache_write: int = Field(default=0, ge=0, strict=True)
    cache_read: int = Field(default=0, ge=0, strict=True)

    def request_usage(self) -> RequestUsage:
        """As pydantic-ai counts it: `input_tokens` includes the cache reads and writes."""
        return RequestUsage(
            input_tokens=self.input + self.cache_write + self.cache_read,
            output_tokens=self.output,
            cache_write_tokens=self.cache_write,
            cache_read_tokens=self.cache_read,
        )


class TransientFailure(BaseModel):
    """The first `times` attempts of a step fail with a transient error (retried by the runtime)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["rate_limit", "server", "timeout"]
    times: int = Field(default=1, ge=1, le=100, strict=True)


class Step(BaseModel):
    """What one model request answers: exactly one of `reply`, `tool_calls` or `fail`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reply: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, min_length=1)
    fail: str | None = Field(default=None, min_length=1)
    usage: ScriptUsage | None = None
    latency_ms: int | None = Field(default=None, ge=0, le=MAX_LATENCY_MS, strict=True)
    transient: TransientFailure | None = None

    @model_validator(mode="after")
    def _exactly_one_action(self) -> Self:
        given = [name for name in ("reply", "tool_calls", "fail") if getattr(self, name) is not None]
        if len(given) != 1:
            got = " and ".join(given) if given else "none"
            raise ValueError(f"a step needs exactly one of reply, tool_calls or fail (got {got})")
        if self.fail is not None and self.usage is not None:
            # Rejected requests are not billed, and silently dropping the numbers would mislead.
            raise ValueError("a fail step reports no usage (a rejected request is not billed)")
        return self

    @property
    def kind(self) -> Literal["reply", "tool_calls", "fail"]:
        """Which of the three actions the step takes."""
        if self.reply is not None:
            return "reply"
        return "tool_calls" if self.tool_calls is not None else "fail"


class Script(BaseModel):
    """The steps of a scripted task, one per model request, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: list[Step]


def parse_script(message: str) -> Script | None:
    """The script in a task message's `subq-script` block, or None when it has none.

    Raises `ScriptError` (with the field path, such as `script.steps.1.usage.input`)
    when the block is unclosed, repeated, not JSON, or not a valid script.
    """
    text = message.replace("\r\n", "\n")
    blocks = list(_SCRIPT_BLOCK.finditer(text))
    openings = len(_SCRIPT_OPENING.findall(text))
    if not blocks and not openings:
        return None
    if openings > len(blocks) or not blocks:
        raise ScriptError("subq-script block is not closed with a line of ```", field="script")
    if len(blocks) > 1:
        # Silently playing the first of two would surprise whoever edited the second.
        raise ScriptError(f"the message has {len(blocks)} subq-script blocks; put every step in one", field="script")
    body = blocks[0]["body"]
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        # exc.lineno counts lines of the block's body, the text the author wrote as JSON.
        raise ScriptError(
            f"subq-script block is not valid JSON: {exc.msg} (line {exc.lineno})", field="script"
        ) from None
    try:
        return Script.model_validate(data)
    except pydantic.ValidationError as exc:
        raise _script_error(exc) from None


def _script_error(exc: pydantic.ValidationError) -> ScriptError:
    """The first validation error as one readable line with its dotted field path."""
    err = exc.errors()[0]
    loc = err["loc"]
    field = ".".join(["script", *(str(part) for part in loc)])
    if err["type"] == "extra_forbidden" and loc:
        allowed = ", ".join(_model_at(loc[:-1]).model_fields)
        reason = f"unknown key {loc[-1]!r} (allowed: {allowed})"
    else:
        reason = err["msg"].removeprefix("Value error, ")
    return ScriptError(f"invalid subq-script at {field}: {reason}", field=field)


def _model_at(loc: Sequence[int | str]) -> type[BaseModel]:
    """Which script model sits at a location, to list the keys it allows."""
    names = [part for part in loc if isinstance(part, str)]
    if not names:
        return Script
    by_key: dict[str, type[BaseModel]] = {"steps": Step, "usage": ScriptUsage, "tool_calls": ToolCall}
    return by_key.get(names[-1], Script)


def estimate_tokens(text: str) -> int:
    """A deterministic token estimate: about four characters a token, and at least one."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def task_message(messages: Sequence[ModelMessage]) -> str:
    """The task's message: the text of the first user prompt in the history ("" if none)."""
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart):
                    return _user_prompt_text(part)
    return ""


def final_reply(message: str) -> str:
    """The reply without a script and after its last step: `Done: <first line of the task>`."""
    text = _SCRIPT_BLOCK.sub("", message.replace("\r\n", "\n"))
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not first:
        return "Done."
    if len(first) > MAX_SUMMARY_CHARS:
        first = first[: MAX_SUMMARY_CHARS - 1].rstrip() + "…"
    return f"Done: {first}"


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
        message = task_message(messages)
        script = parse_script(message)
        index = sum(isinstance(m, ModelResponse) for m in messages)
        step = script.steps[index] if script is not None and index < len(script.steps) else None

        if step is not None and step.latency_ms:
            # Awaited, not slept: other subagents on the worker's event loop keep running,
            # as they would while a real API call is in flight.
            await asyncio.sleep(step.latency_ms / 1000)
        if step is not None and step.transient is not None:
            key = (hash(message), index)
            attempts = self._attempts.get(key, 0)
            if attempts < step.transient.times:
                self._attempts[key] = attempts + 1
                raise _TRANSIENT[step.transient.kind](self.model_name, f"scripted transient {step.transient.kind}")

        parts: list[ModelResponsePart]
        finish: FinishReason
        if step is None or step.reply is not None:
            parts = [TextPart(content=final_reply(message) if step is None else str(step.reply))]
            finish = "stop"
        elif step.tool_calls is not None:
            parts = [
                ToolCallPart(tool_name=call.name, args=dict(call.args), tool_call_id=f"call_{index}_{i}")
                for i, call in enumerate(step.tool_calls)
            ]
            finish = "tool_call"
        else:
            # Rejected, not rate-limited/unavailable/5xx: the runtime retries those, and a
            # scripted failure must fail the same way on every attempt.
            raise ModelRequestRejectedError(self.model_name, str(step.fail), body={"script_step": index})

        if step is not None and step.usage is not None:
            usage = step.usage.request_usage()
        else:
            usage = RequestUsage(
                input_tokens=estimate_tokens(_request_text(messages, params)),
                output_tokens=estimate_tokens(_response_text(parts)),
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


_TRANSIENT: dict[str, type[ModelAPIError]] = {
    "rate_limit": ModelRateLimitError,
    "server": ModelServerError,
    "timeout": ModelTimeoutError,
}


def offline_model() -> OfflineModel:
    """The offline model for the `offline` profile."""
    return OfflineModel()


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
