"""Request cost in micro-USD, and building each kind of model from a profile."""

from __future__ import annotations

import json
import socket
from decimal import Decimal
from typing import Any

import genai_prices
import pytest
from genai_prices.data_snapshot import get_snapshot
from pydantic import SecretStr
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart
from pydantic_ai.usage import RequestUsage

from coordinator import usd_to_micros
from coordinator.errors import ProfileError
from coordinator.settings import Price, Profile, Settings
from workers.runtime.offline import OfflineModel
from workers.runtime.pricing import _read_token_rates, cost_of, reported_cost_usd
from workers.runtime.providers import ANTHROPIC_BASE_URL, OPENAI_BASE_URL, OneLineErrors, build_model

SONNET_SOURCE = f"genai-prices {genai_prices.__version__}: anthropic/claude-sonnet-4-5"


def acceptance_usage() -> RequestUsage:
    """input 1000 + cache_write 2000 + cache_read 10000 (= input_tokens 13000), output 500."""
    return RequestUsage(input_tokens=13000, output_tokens=500, cache_write_tokens=2000, cache_read_tokens=10000)


# --- the price library -----------------------------------------------------


def test_acceptance_figure_offline_priced_as_claude_sonnet_4_5() -> None:
    # 1000 x $3 + 2000 x $3.75 + 10000 x $0.30 + 500 x $15 per MTok = $0.021
    assert cost_of(acceptance_usage(), Profile()) == (21000, SONNET_SOURCE)


def test_a_real_anthropic_profile_is_priced_as_its_model() -> None:
    profile = Profile(model="anthropic:claude-sonnet-4-5", api_key=SecretStr("k"))
    assert cost_of(acceptance_usage(), profile) == (21000, SONNET_SOURCE)


def test_priced_as_overrides_the_model() -> None:
    profile = Profile(model="openai:my-local-llama", api_key=SecretStr("k"), priced_as="anthropic:claude-sonnet-4-5")
    assert cost_of(acceptance_usage(), profile) == (21000, SONNET_SOURCE)


def test_the_acceptance_figure_end_to_end_through_an_offline_run() -> None:
    script = {
        "steps": [
            {"reply": "ok", "usage": {"input": 1000, "output": 500, "cache_write": 2000, "cache_read": 10000}},
        ]
    }
    result = Agent(OfflineModel()).run_sync(f"Do it\n```subq-script\n{json.dumps(script)}\n```")
    (response,) = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert cost_of(response.usage, Profile(), reported_cost_usd(response)) == (21000, SONNET_SOURCE)


def test_cache_tokens_are_cheaper_than_plain_input() -> None:
    cached = RequestUsage(input_tokens=10000, cache_read_tokens=10000)
    plain = RequestUsage(input_tokens=10000)
    assert cost_of(cached, Profile())[0] == 3000  # $0.30 / MTok
    assert cost_of(plain, Profile())[0] == 30000  # $3 / MTok


@pytest.mark.parametrize(
    ("priced_as", "source"),
    [
        ("anthropic:claude-nonexistent-9", "unpriced: anthropic/claude-nonexistent-9 is not in genai-prices"),
        ("nobody:some-model", "unpriced: nobody/some-model is not in genai-prices"),
    ],
)
def test_an_unknown_model_costs_zero_and_says_so(priced_as: str, source: str) -> None:
    assert cost_of(acceptance_usage(), Profile(priced_as=priced_as)) == (0, source)


def test_a_profile_priced_at_zero_is_warned_of_and_its_first_request_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model through OpenRouter, Ollama or LiteLLM under a name genai-prices does not know, with no price: every
    request cost $0, no budget or quota could be reached, and nothing said so but a `cost_source` the next request
    replaced. A worker's start and `subq tools` now warn of the profile, and the first request of it is logged."""
    from workers.runtime import pricing
    from workers.runtime.profile_tools import policy_warnings

    local = Profile(model="openai:llama3.1:8b")
    settings = Settings(profiles={"local": local, "priced": local.model_copy(update={"price": Price(
        input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))}), "known": Profile()})  # fmt: skip
    assert policy_warnings(settings, ["local", "priced", "known"]) == [
        "profile 'local' has no price, and openai/llama3.1:8b is not in genai-prices: its requests are recorded at "
        "$0, and no budget or quota counts them (give it a price, or priced_as a model the library knows)"
    ]
    pricing._said_unpriced.discard(("openai", "llama3.1:8b"))
    with caplog.at_level("WARNING", logger="workers.runtime.pricing"):
        for _ in range(3):
            assert cost_of(acceptance_usage(), local)[0] == 0
    said = [r.getMessage() for r in caplog.records if "llama3.1:8b" in r.getMessage()]
    assert len(said) == 1 and "recorded at $0" in said[0], said


def test_inconsistent_usage_costs_zero_rather_than_failing_the_run() -> None:
    cost, source = cost_of(RequestUsage(input_tokens=0, cache_read_tokens=100), Profile())
    assert cost == 0
    assert source.startswith("unpriced: anthropic/claude-sonnet-4-5: ")
    assert "cache_read_tokens" in source


def _library_figure(usage: RequestUsage, provider: str, model: str) -> tuple[int, str]:
    calc = genai_prices.calc_price(usage, model, provider_id=provider)
    return usd_to_micros(
        calc.total_price
    ), f"genai-prices {genai_prices.__version__}: {calc.provider.id}/{calc.model.id}"


def _usages() -> list[RequestUsage]:
    """Plain text usage around the tier starts the library uses (200k input tokens) and far past them."""
    usages = [RequestUsage(), RequestUsage(input_tokens=1, output_tokens=1)]
    for input_tokens in (999, 128_000, 200_000, 200_001, 1_234_567):
        usages += [
            RequestUsage(input_tokens=input_tokens, output_tokens=4321),
            RequestUsage(input_tokens=input_tokens, output_tokens=77, cache_read_tokens=input_tokens // 3),
            RequestUsage(
                input_tokens=input_tokens,
                output_tokens=5,
                cache_read_tokens=input_tokens // 2,
                cache_write_tokens=input_tokens // 4,
            ),
        ]
    return usages


def test_rates_read_once_price_every_model_as_the_library_does() -> None:
    # The fast path reads a model's token rates once; the library's full calculation is the reference.
    snapshot = get_snapshot()
    checked = 0
    for provider in snapshot.providers:
        for model in provider.models:
            if _read_token_rates(snapshot, provider.id, model.id) is None:
                continue
            for usage in _usages():
                assert cost_of(usage, Profile(priced_as=f"{provider.id}:{model.id}")) == _library_figure(
                    usage, provider.id, model.id
                ), (provider.id, model.id, usage)
            checked += 1
    # Most of the snapshot, and the models subq's own profiles are priced as, take the fast path.
    assert checked > 1000
    assert _read_token_rates(snapshot, "anthropic", "claude-sonnet-4-5") is not None
    assert _read_token_rates(snapshot, "openai", "gpt-4o-mini") is not None


def test_usage_the_rates_do_not_cover_goes_through_the_library() -> None:
    audio = RequestUsage(input_tokens=5000, input_audio_tokens=3000, output_tokens=100, output_audio_tokens=50)
    assert cost_of(audio, Profile(priced_as="openai:gpt-4o-audio-preview")) == _library_figure(
        audio, "openai", "gpt-4o-audio-preview"
    )
    assert cost_of(audio, Profile(priced_as="openai:gpt-4o-audio-preview"))[0] > 0


# --- an explicit profile price ---------------------------------------------


def test_an_explicit_profile_price_wins_over_the_library() -> None:
    price = Price(input_per_mtok=3, output_per_mtok=15, cache_read_per_mtok=0.3, cache_write_per_mtok=3.75)
    assert cost_of(acceptance_usage(), Profile(price=price)) == (21000, "profile price")
    cheaper = Price(input_per_mtok=1, output_per_mtok=2, cache_read_per_mtok=0.1, cache_write_per_mtok=1.25)
    # 1000 x 1 + 2000 x 1.25 + 10000 x 0.1 + 500 x 2
    assert cost_of(acceptance_usage(), Profile(price=cheaper)) == (5500, "profile price")


def test_cache_prices_default_to_the_input_price() -> None:
    price = Price(input_per_mtok=2, output_per_mtok=10)
    # (1000 + 2000 + 10000) x 2 + 500 x 10
    assert cost_of(acceptance_usage(), Profile(price=price)) == (31000, "profile price")


def test_profile_price_is_exact_decimal_and_rounds_half_up() -> None:
    # 100 tokens x $0.145 / MTok is exactly 14.5 micro-USD; in float it is 14.4999...
    price = Price(input_per_mtok=0.145, output_per_mtok=0)
    assert cost_of(RequestUsage(input_tokens=100), Profile(price=price)) == (15, "profile price")


@pytest.mark.parametrize(
    ("usd", "micros"),
    [
        (Decimal("0.021"), 21000),
        (Decimal("0.0000025"), 3),
        (Decimal("0.0000015"), 2),
        (Decimal("0.0000024999"), 2),
        (Decimal("0"), 0),
        (Decimal("12.3456785"), 12345679),
    ],
)
def test_usd_to_micros(usd: Decimal, micros: int) -> None:
    assert usd_to_micros(usd) == micros


# --- a provider-reported cost ----------------------------------------------


def test_a_provider_reported_cost_wins_over_everything() -> None:
    profile = Profile(price=Price(input_per_mtok=3, output_per_mtok=15))
    assert cost_of(acceptance_usage(), profile, Decimal("0.0123455")) == (12346, "provider-reported")
    assert cost_of(acceptance_usage(), Profile(), Decimal("0.5")) == (500000, "provider-reported")
    # A reported zero (say a cache hit) is a real cost, not a missing one.
    assert cost_of(acceptance_usage(), Profile(), Decimal(0)) == (0, "provider-reported")


def test_an_invalid_reported_cost_falls_through_to_the_next_source() -> None:
    assert cost_of(acceptance_usage(), Profile(), Decimal("-1")) == (21000, SONNET_SOURCE)
    assert cost_of(acceptance_usage(), Profile(), Decimal("NaN")) == (21000, SONNET_SOURCE)


@pytest.mark.parametrize(
    ("details", "expected"),
    [
        ({"cost": 0.0123}, Decimal("0.0123")),
        ({"cost": "0.5"}, Decimal("0.5")),
        ({"cost": 0}, Decimal(0)),
        ({"cost": -0.1}, None),
        ({"cost": "abc"}, None),
        ({"cost": True}, None),
        ({"cost": float("nan")}, None),
        ({"downstream_provider": "x"}, None),
        (None, None),
    ],
)
def test_reported_cost_usd_reads_provider_details(details: dict[str, Any] | None, expected: Decimal | None) -> None:
    response = ModelResponse(parts=[TextPart("x")], provider_details=details)
    assert reported_cost_usd(response) == expected


def test_usage_cost_is_not_taken_as_provider_reported() -> None:
    # pydantic-ai fills usage.cost with its own genai-prices estimate after every request.
    response = ModelResponse(parts=[TextPart("x")], usage=RequestUsage(input_tokens=1, cost=Decimal("9")))
    assert reported_cost_usd(response) is None


# --- building a model from a profile ----------------------------------------


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to resolve or connect fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("building a model touched the network")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.usefixtures("no_network")
def test_build_model_for_each_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDKs would read these; the profile alone must decide.
    monkeypatch.setenv("OPENAI_BASE_URL", "http://from-the-environment.invalid/v1")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://from-the-environment.invalid")

    assert isinstance(build_model(Profile()), OfflineModel)
    # Imported here, not at the top: the SDKs cost 3.9 s of CPU to import, paid by every pytest-xdist
    # worker that collects this file, not only the one that runs this test (issue 43).
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.models.openai import OpenAIChatModel

    openai = build_model(Profile(model="openai:gpt-4o-mini", api_key=SecretStr("sk-test")))
    assert isinstance(openai, OneLineErrors) and isinstance(openai.wrapped, OpenAIChatModel)
    assert openai.wrapped.client.max_retries == 0, "retries happen once, in subq"
    assert openai.model_name == "gpt-4o-mini"
    assert openai.base_url == OPENAI_BASE_URL + "/"

    local = build_model(
        Profile(model="openai:llama-3.1-8b", api_key=SecretStr("placeholder"), base_url="http://localhost:8000/v1")
    )
    assert isinstance(local, OneLineErrors) and isinstance(local.wrapped, OpenAIChatModel)
    assert local.base_url == "http://localhost:8000/v1/"

    claude = build_model(Profile(model="anthropic:claude-sonnet-4-5", api_key=SecretStr("sk-ant-test")))
    assert isinstance(claude, OneLineErrors) and isinstance(claude.wrapped, AnthropicModel)
    assert claude.wrapped.client.max_retries == 0
    assert claude.model_name == "claude-sonnet-4-5"
    assert (claude.base_url or "").rstrip("/") == ANTHROPIC_BASE_URL

    proxied = build_model(
        Profile(model="anthropic:claude-sonnet-4-5", api_key=SecretStr("k"), base_url="https://proxy.example/anthropic")
    )
    assert (proxied.base_url or "").rstrip("/") == "https://proxy.example/anthropic"


@pytest.mark.parametrize("model", ["openai:gpt-4o-mini", "anthropic:claude-sonnet-4-5"])
@pytest.mark.parametrize("api_key", [None, ""])
def test_a_real_provider_without_an_api_key_is_a_profile_error(
    model: str, api_key: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A key in the environment must not paper over a profile that has none.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-env")
    profile = Profile(model=model, api_key=None if api_key is None else SecretStr(api_key))
    with pytest.raises(ProfileError) as caught:
        build_model(profile)
    assert caught.value.field == "api_key"
    assert "api_key" in caught.value.message
    with pytest.raises(ProfileError) as named:
        build_model(profile, name="fast")
    assert named.value.field == "profiles.fast.api_key"
    assert "'fast'" in named.value.message
