"""The cost of one model request, in integer micro-USD, and where the figure came from.

Sources, first that applies wins (docs/architecture.md, "Money and tokens"):

1. a cost the provider reported in its response (`"provider-reported"`);
2. the profile's explicit `price`, USD per million tokens (`"profile price"`);
3. genai-prices for the profile's `price_ref`
   (`"genai-prices 0.2.3: anthropic/claude-sonnet-4-5"`).

A model the price library does not know costs 0 with an `"unpriced: ..."`
source: a run must not fail because a price is missing.

Money is `Decimal` until the one rounding to micros (ROUND_HALF_UP); it never
passes through float, so a sum of stored costs equals the cost of the sum.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

import genai_prices
from pydantic_ai.messages import ModelResponse
from pydantic_ai.usage import RequestUsage

from coordinator import Price, Profile, usd_to_micros

__all__ = [
    "PROFILE_PRICE_SOURCE",
    "PROVIDER_REPORTED_SOURCE",
    "cost_of",
    "parse_usd",
    "reported_cost_usd",
]

PROVIDER_REPORTED_SOURCE = "provider-reported"
PROFILE_PRICE_SOURCE = "profile price"


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

    pydantic-ai 2.68 keeps OpenRouter's reported cost in `provider_details["cost"]`.
    `response.usage.cost` is deliberately NOT read: the agent loop fills it with
    pydantic-ai's own genai-prices estimate (`fill_response_cost`), priced as the
    model that answered, which for the offline model or a re-priced profile is
    the wrong model, and it cannot be told apart from a cost the provider reported.
    """
    details = response.provider_details or {}
    return parse_usd(details.get("cost"))


def _profile_price_micros(usage: RequestUsage, price: Price) -> int:
    # Price per MTok in USD times tokens is micro-USD, so no division is needed.
    input_rate = price.input_per_mtok
    cache_read_rate = input_rate if price.cache_read_per_mtok is None else price.cache_read_per_mtok
    cache_write_rate = input_rate if price.cache_write_per_mtok is None else price.cache_write_per_mtok
    # Never negative, even for inconsistent usage whose cache counts exceed the input.
    uncached = max(usage.input_tokens - usage.cache_read_tokens - usage.cache_write_tokens, 0)
    micros = (
        uncached * input_rate
        + usage.cache_write_tokens * cache_write_rate
        + usage.cache_read_tokens * cache_read_rate
        + usage.output_tokens * price.output_per_mtok
    )
    return int(micros.quantize(Decimal(1), rounding=ROUND_HALF_UP))


def _library_price(usage: RequestUsage, provider: str, model: str) -> tuple[int, str]:
    try:
        calc = genai_prices.calc_price(usage, model, provider_id=provider)
    except LookupError:
        return 0, f"unpriced: {provider}/{model} is not in genai-prices"
    except ValueError as exc:
        # genai-prices rejects inconsistent usage (e.g. more cache reads than input);
        # the run goes on and the source says why it cost nothing.
        return 0, f"unpriced: {provider}/{model}: {exc}"
    # The matched ids, not the reference: "claude-sonnet-4-5-20250929" shows what it was priced as.
    source = f"genai-prices {genai_prices.__version__}: {calc.provider.id}/{calc.model.id}"
    return usd_to_micros(calc.total_price), source


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
