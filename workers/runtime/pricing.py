"""The cost of one model request, in integer micro-USD, and where the figure came from.

Sources, first that applies wins (docs/architecture.md, "Money and tokens"):

1. a cost the provider reported in its response (`"provider-reported"`);
2. the profile's explicit `price`, USD per million tokens (`"profile price"`);
3. genai-prices for the profile's `price_ref`
   (`"genai-prices 0.2.3: anthropic/claude-sonnet-4-5"`).

A model the price library does not know costs 0 with an `"unpriced: ..."`
source: a run must not fail because a price is missing. It is said where an
operator looks: a worker's start and `subq tools` warn of each profile priced
so (`unpriced`), and a worker logs the first such request of each model.

Most models in genai-prices are priced by four token rates (each a number, or
tiers chosen by the request's input). For those, the rates are read once per
model and a request with plain text usage is priced by the same arithmetic as a
profile price: the library's own figure to the micro-USD (tests/test_pricing.py
checks every such model of the snapshot against `genai_prices.calc_price`). The
library's full calculation takes about 125 µs a request, most of a tool call's
CPU budget of 0.3 ms; anything else (audio, dated prices, per-request fees)
still goes through it.

Money is `Decimal` until the one rounding to micros (ROUND_HALF_UP); it never
passes through float. Each request is rounded on its own, so a task's stored
sum is the sum of its requests' figures, and may differ from the cost of all
their tokens priced at once by at most half a micro-USD a request.
"""

from __future__ import annotations

import logging
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from threading import Lock

import genai_prices
from genai_prices.data_snapshot import DataSnapshot, get_snapshot
from genai_prices.types import ModelPrice, TieredPrices
from pydantic_ai.messages import ModelResponse
from pydantic_ai.usage import RequestUsage

from coordinator import Price, Profile, usd_to_micros

__all__ = [
    "PROFILE_PRICE_SOURCE",
    "PROVIDER_REPORTED_SOURCE",
    "cost_of",
    "parse_usd",
    "reported_cost_usd",
    "unpriced",
]

PROVIDER_REPORTED_SOURCE = "provider-reported"
PROFILE_PRICE_SOURCE = "profile price"
UNPRICED_SOURCE = "unpriced: "

log = logging.getLogger(__name__)
# The (provider, model) pairs this process has logged a request of at $0 for (once each).
_said_unpriced: set[tuple[str, str]] = set()


def unpriced(profile: Profile) -> str | None:
    """Why every request of `profile` would be recorded at $0 (no price, and a model the price library does not
    know), or None when it is priced."""
    if profile.price is not None:
        return None
    _, source = _library_price(RequestUsage(input_tokens=1, output_tokens=1), *profile.price_ref, said=True)
    return source.removeprefix(UNPRICED_SOURCE) if source.startswith(UNPRICED_SOURCE) else None


def cost_of(usage: RequestUsage, profile: Profile, reported_usd: Decimal | None = None) -> tuple[int, str]:
    """(cost_micros, source) of one request's `usage` under `profile`.

    `usage.input_tokens` includes cache reads and writes, as pydantic-ai and
    genai-prices both count it. A `reported_usd` that is negative or not finite
    is no cost at all, so the next source applies.
    """
    if reported_usd is not None and _valid_usd(reported_usd):
        return usd_to_micros(reported_usd), PROVIDER_REPORTED_SOURCE
    if profile.price is not None:
        return _profile_price_micros(usage, profile.price), PROFILE_PRICE_SOURCE
    return _library_price(usage, *profile.price_ref)


def reported_cost_usd(response: ModelResponse) -> Decimal | None:
    """The cost the provider itself reported in `response`, if it carries one.

    pydantic-ai keeps OpenRouter's reported cost in `provider_details["cost"]`, in its OpenRouter model only;
    the OpenAI-compatible model subq builds for any `base_url` keeps none, so a profile through OpenRouter is
    priced by its `price` or `priced_as` (docs/architecture.md, "Money and tokens").
    `response.usage.cost` is deliberately NOT read: the agent loop fills it with
    pydantic-ai's own genai-prices estimate (`fill_response_cost`), priced as the
    model that answered, which for the offline model or a re-priced profile is
    the wrong model, and it cannot be told apart from a cost the provider reported.
    """
    details = response.provider_details or {}
    return parse_usd(details.get("cost"))


def _profile_price_micros(usage: RequestUsage, price: Price) -> int:
    return _token_micros(
        usage,
        input_rate=price.input_per_mtok,
        output_rate=price.output_per_mtok,
        cache_read_rate=price.cache_read_per_mtok,
        cache_write_rate=price.cache_write_per_mtok,
    )


def _token_micros(
    usage: RequestUsage,
    *,
    input_rate: Decimal,
    output_rate: Decimal,
    cache_read_rate: Decimal | None,
    cache_write_rate: Decimal | None,
) -> int:
    """Micro-USD of `usage` at rates in USD per million tokens; a missing cache rate is the input rate."""
    # Price per MTok in USD times tokens is micro-USD, so no division is needed.
    cache_read = input_rate if cache_read_rate is None else cache_read_rate
    cache_write = input_rate if cache_write_rate is None else cache_write_rate
    # Never negative, even for inconsistent usage whose cache counts exceed the input.
    uncached = max(usage.input_tokens - usage.cache_read_tokens - usage.cache_write_tokens, 0)
    micros = (
        uncached * input_rate
        + usage.cache_write_tokens * cache_write
        + usage.cache_read_tokens * cache_read
        + usage.output_tokens * output_rate
    )
    return int(micros.quantize(Decimal(1), rounding=ROUND_HALF_UP))


def _library_price(usage: RequestUsage, provider: str, model: str, *, said: bool = False) -> tuple[int, str]:
    fast = _fast_library_price(usage, provider, model)
    if fast is not None:
        return fast
    try:
        calc = genai_prices.calc_price(usage, model, provider_id=provider)
    except LookupError:
        if not said and (provider, model) not in _said_unpriced:
            # Once a model and process: the task's `cost_source` says it too, until its next request's replaces it.
            _said_unpriced.add((provider, model))
            log.warning(
                "subq: %s/%s is not in genai-prices: its requests are recorded at $0, and no budget or quota counts "
                "them; give its profile a price, or priced_as a model the library knows",
                provider, model,
            )  # fmt: skip
        return 0, f"{UNPRICED_SOURCE}{provider}/{model} is not in genai-prices"
    except ValueError as exc:
        # genai-prices rejects inconsistent usage (e.g. more cache reads than input);
        # the run goes on and the source says why it cost nothing.
        return 0, f"{UNPRICED_SOURCE}{provider}/{model}: {exc}"
    # The matched ids, not the reference: "claude-sonnet-4-5-20250929" shows what it was priced as.
    source = f"genai-prices {genai_prices.__version__}: {calc.provider.id}/{calc.model.id}"
    return usd_to_micros(calc.total_price), source


# The token rates a request is priced by; a rate is a number or tiers chosen by the request's input.
_TOKEN_RATE_KEYS = ("input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok")
# Rates of counts a request with plain text usage (no audio, no `details`) has none of.
_UNUSED_RATE_KEYS = {"cache_write_1h_mtok", "web_searches_kcount", "storage_searches_kcount"}

_Rate = Decimal | TieredPrices
# (input, output, cache read, cache write) per million tokens; a missing cache rate is the input rate.
_TokenRates = tuple[_Rate, _Rate, _Rate | None, _Rate | None]

# (provider, model) -> the snapshot it was read from, and the model's token rates with its source, or None.
_token_rates: dict[tuple[str, str], tuple[DataSnapshot, tuple[_TokenRates, str] | None]] = {}
_token_rates_lock = Lock()


def _fast_library_price(usage: RequestUsage, provider: str, model: str) -> tuple[int, str] | None:
    """The library's price of plain text usage from rates read once per model; None where it must calculate."""
    if usage.input_audio_tokens or usage.cache_audio_read_tokens or usage.output_audio_tokens or usage.details:
        return None
    if usage.cache_read_tokens + usage.cache_write_tokens > usage.input_tokens:
        return None  # the library rejects it, and its message says why
    found = _rates_of(provider, model)
    if found is None:
        return None
    (input_rate, output_rate, cache_read_rate, cache_write_rate), source = found
    # A tier applies to the whole request once its input passes the tier's start (genai-prices' rule).
    tokens = usage.input_tokens
    micros = _token_micros(
        usage,
        input_rate=_applicable(input_rate, tokens),
        output_rate=_applicable(output_rate, tokens),
        cache_read_rate=None if cache_read_rate is None else _applicable(cache_read_rate, tokens),
        cache_write_rate=None if cache_write_rate is None else _applicable(cache_write_rate, tokens),
    )
    return micros, source


def _applicable(rate: _Rate, input_tokens: int) -> Decimal:
    if isinstance(rate, Decimal):
        return rate
    for tier in reversed(rate.tiers):
        if input_tokens > tier.start:
            return tier.price
    return rate.base


def _rates_of(provider: str, model: str) -> tuple[_TokenRates, str] | None:
    snapshot = get_snapshot()  # read each time: a program may swap in its own snapshot
    cached = _token_rates.get((provider, model))
    if cached is not None and cached[0] is snapshot:
        return cached[1]
    rates = _read_token_rates(snapshot, provider, model)
    with _token_rates_lock:
        _token_rates[provider, model] = (snapshot, rates)
    return rates


def _read_token_rates(snapshot: DataSnapshot, provider: str, model: str) -> tuple[_TokenRates, str] | None:
    try:
        found_provider, info = snapshot.find_provider_model(model, None, provider, None)
    except LookupError:
        return None  # the full calculation says why it is unpriced
    if not isinstance(info.prices, ModelPrice):
        return None  # dated prices: the library picks one by the request's time
    # Variants (batch, service tiers) apply only with a request context, which subq never passes.
    rates = {key: value for key, value in vars(info.prices).items() if not key.startswith("_") and value is not None}
    if not rates.keys() <= {*_TOKEN_RATE_KEYS, *_UNUSED_RATE_KEYS}:
        return None  # audio, images, per-request fees: the library's calculation
    token_rates = [rates.get(key) for key in _TOKEN_RATE_KEYS]
    if not all(rate is None or isinstance(rate, Decimal | TieredPrices) for rate in token_rates):
        return None
    input_rate, output_rate, cache_read_rate, cache_write_rate = token_rates
    if input_rate is None or output_rate is None:
        return None
    source = f"genai-prices {genai_prices.__version__}: {found_provider.id}/{info.id}"
    return (input_rate, output_rate, cache_read_rate, cache_write_rate), source


def parse_usd(value: object) -> Decimal | None:
    """A number of dollars (a number or its text), or None when it is not a non-negative, finite one."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        return None
    try:
        usd = value if isinstance(value, Decimal) else Decimal(str(value))
    except InvalidOperation:
        return None
    return usd if _valid_usd(usd) else None


def _valid_usd(usd: Decimal) -> bool:
    return usd.is_finite() and usd >= 0
