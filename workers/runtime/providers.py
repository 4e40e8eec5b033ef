"""The pydantic-ai model a profile runs with: offline, OpenAI-compatible, or Anthropic.

`build_model` only constructs clients; nothing here touches the network, so a
worker can build a task's model before it knows the endpoint is reachable.

Keys and URLs come from the profile: a profile that names no key gets the
provider's standard variable (`OPENAI_API_KEY`, `ANTHROPIC_API_KEY`) through
`Settings.profile`, since in subq only `Settings` reads the environment; the
SDKs are never left to read it themselves. A missing key is a clear
`ProfileError`, and an unset `base_url` is the vendor's public endpoint.

The SDKs' own retries are off (`max_retries=0`): subq retries a transient error
itself, once per attempt, counted (workers/runtime/metering.py); with both, one
failing request was sent six times. A provider's error reads as one line, its
status, the provider's error type and message, with the raw body kept on the
exception (`body`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from anthropic import AsyncAnthropic
from openai import AsyncOpenAI
from pydantic_ai import RunContext
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from coordinator import OFFLINE_PROFILE, STANDARD_KEYS, Profile, ProfileError
from workers.runtime.offline import OfflineModel

__all__ = ["ANTHROPIC_BASE_URL", "OPENAI_BASE_URL", "OneLineErrors", "build_model", "error_line"]

# The vendors' public endpoints, passed explicitly so the SDKs never read
# OPENAI_BASE_URL / ANTHROPIC_BASE_URL from the environment behind Settings' back.
OPENAI_BASE_URL = "https://api.openai.com/v1"
ANTHROPIC_BASE_URL = "https://api.anthropic.com"
# Retries happen once, in subq (SUBQ_MODEL_RETRIES): the SDKs' own would multiply them.
SDK_RETRIES = 0
# A provider's error message is one line of the task's error; longer ones are cut.
ERROR_MESSAGE_CHARS = 200


def build_model(profile: Profile, *, name: str | None = None) -> Model:
    """The model for `profile`; `name` (the profile's name) only sharpens error field paths.

    Raises `ProfileError` when a real provider's profile has no `api_key`.
    """
    if profile.model == OFFLINE_PROFILE:
        return OfflineModel()
    provider, _, model_name = profile.model.partition(":")
    if provider == "openai":
        openai = AsyncOpenAI(
            api_key=_api_key(profile, name), base_url=profile.base_url or OPENAI_BASE_URL, max_retries=SDK_RETRIES
        )
        return OneLineErrors(OpenAIChatModel(model_name, provider=OpenAIProvider(openai_client=openai)))
    if provider == "anthropic":
        anthropic = AsyncAnthropic(
            api_key=_api_key(profile, name), base_url=profile.base_url or ANTHROPIC_BASE_URL, max_retries=SDK_RETRIES
        )
        return OneLineErrors(AnthropicModel(model_name, provider=AnthropicProvider(anthropic_client=anthropic)))
    # Profile validation rejects other providers; this guards a Profile built with model_construct().
    raise ProfileError(f"unknown model provider in {profile.model!r}", field=_field(name, "model"))


def _api_key(profile: Profile, name: str | None) -> str:
    key = profile.api_key.get_secret_value() if profile.api_key is not None else ""
    if not key:
        # Fail when the model is built, not with a 401 in the middle of a run. A keyless
        # OpenAI-compatible server (a local vLLM, Ollama) takes any placeholder key.
        variable = STANDARD_KEYS.get(profile.model.partition(":")[0], "the provider's key variable")
        raise ProfileError(
            f"profile{f' {name!r}' if name else ''} uses {profile.model!r} and needs an api_key "
            f"(in the profile, or in {variable})",
            field=_field(name, "api_key"),
        )
    return key


class OneLineErrors(WrapperModel):
    """A provider's model whose HTTP errors read as one clear line (`error_line`), raw body kept.

    The exception stays the one pydantic-ai raised (its class tells subq's retries a
    transient error from a refusal); only its message is rewritten.
    """

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        try:
            return await super().request(messages, model_settings, model_request_parameters)
        except ModelHTTPError as exc:
            exc.message = error_line(exc)
            raise

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        try:
            async with super().request_stream(
                messages, model_settings, model_request_parameters, run_context
            ) as response:
                yield response
        except ModelHTTPError as exc:
            exc.message = error_line(exc)
            raise


def error_line(exc: ModelHTTPError) -> str:
    """`HTTP <status> <provider's error type>: <provider's message>` from an error response.

    OpenAI's body is the `error` object (`{"message", "type", "code"}`); Anthropic's
    wraps it (`{"type": "error", "error": {"type", "message"}}`); anything else is
    shown as text.
    """
    body: Any = exc.body
    inner = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(inner, dict):
        kind = inner.get("type") or inner.get("code") or exc.provider_error_type
        message = inner.get("message") or ""
    else:
        kind, message = exc.provider_error_type, "" if inner is None else str(inner)
    text = " ".join(str(message).split()) or "no message"
    if len(text) > ERROR_MESSAGE_CHARS:
        text = text[: ERROR_MESSAGE_CHARS - 1] + "…"
    return f"HTTP {exc.status_code}{f' {kind}' if kind else ''}: {text} (model {exc.model_name})"


def _field(name: str | None, field: str) -> str:
    return f"profiles.{name}.{field}" if name else field
