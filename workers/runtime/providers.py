"""The pydantic-ai model a profile runs with: offline, OpenAI-compatible, or Anthropic.

`build_model` only constructs clients; nothing here touches the network, so a
worker can build a task's model before it knows the endpoint is reachable.

Keys and URLs come from the profile alone. Both SDKs would otherwise fall back
to environment variables (`OPENAI_API_KEY`, `ANTHROPIC_BASE_URL`, ...), and in
subq only `Settings` reads the environment: so a missing key is a clear
`ProfileError`, and an unset `base_url` is the vendor's public endpoint.
"""

from __future__ import annotations

from pydantic_ai.models import Model
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider

from coordinator import OFFLINE_PROFILE, Profile, ProfileError
from workers.runtime.offline import OfflineModel

__all__ = ["ANTHROPIC_BASE_URL", "OPENAI_BASE_URL", "build_model"]

# The vendors' public endpoints, passed explicitly so the SDKs never read
# OPENAI_BASE_URL / ANTHROPIC_BASE_URL from the environment behind Settings' back.
OPENAI_BASE_URL = "https://api.openai.com/v1"
ANTHROPIC_BASE_URL = "https://api.anthropic.com"


def build_model(profile: Profile, *, name: str | None = None) -> Model:
    """The model for `profile`; `name` (the profile's name) only sharpens error field paths.

    Raises `ProfileError` when a real provider's profile has no `api_key`.
    """
    if profile.model == OFFLINE_PROFILE:
        return OfflineModel()
    provider, _, model_name = profile.model.partition(":")
    if provider == "openai":
        openai = OpenAIProvider(base_url=profile.base_url or OPENAI_BASE_URL, api_key=_api_key(profile, name))
        return OpenAIChatModel(model_name, provider=openai)
    if provider == "anthropic":
        anthropic = AnthropicProvider(api_key=_api_key(profile, name), base_url=profile.base_url or ANTHROPIC_BASE_URL)
        return AnthropicModel(model_name, provider=anthropic)
    # Profile validation rejects other providers; this guards a Profile built with model_construct().
    raise ProfileError(f"unknown model provider in {profile.model!r}", field=_field(name, "model"))


def _api_key(profile: Profile, name: str | None) -> str:
    key = profile.api_key.get_secret_value() if profile.api_key is not None else ""
    if not key:
        # Fail when the model is built, not with a 401 in the middle of a run. A keyless
        # OpenAI-compatible server (a local vLLM, Ollama) takes any placeholder key.
        raise ProfileError(
            f"profile{f' {name!r}' if name else ''} uses {profile.model!r} and needs an api_key",
            field=_field(name, "api_key"),
        )
    return key


def _field(name: str | None, field: str) -> str:
    return f"profiles.{name}.{field}" if name else field
