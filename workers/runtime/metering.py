"""A model wrapper: gates each request, waits out transient errors, reports each response.

- Before every request, `before()` runs: the runner stops a cancelled run or a
  spent budget there, and waits for the provider's fleet-wide rate limit.
- A transient model error (rate limit, timeout, connection, 5xx, overloaded),
  a request its endpoint's gate held back, or a fallback chain's group of them,
  goes to `after_error`, which waits and returns (the request is tried again) or
  raises (the run parks, or fails): the route's patience
  (workers/runtime/providers.py). Any other error ends the run as an agent failure.
- After every response, `on_response` records its usage atomically and
  persists the conversation, so a worker killed mid-run loses at most the
  request in flight, and spend is never counted twice (each request has a key).
- Every attempt is counted in the worker's own metrics by its outcome (ok,
  transient_error, error, cancelled), with the latency of those answered, under
  `labels` (provider, model): workers/observe.py, in memory, no Redis. A
  fallback chain's failed attempt counts each request it sent that failed
  transiently (`sent_errors`), and a request its gate held back counts none:
  the same requests the task counts as `transient_errors`.
- A response that reports no usage (`unmeasured_requests`: some OpenAI-compatible servers leave `usage`
  out) is given subq's own overstated estimate of what was sent and answered
  (`estimate_tokens`, as compaction counts), still marked unmeasured, so it is priced and counted by every
  budget and quota instead of passing at $0; the cost source says it was estimated.
- With a `compactor` (workers/runtime/compaction.py), what is sent is the
  compacted view of the messages, compacted further when the request would
  pass its share of the context window; a provider's refusal of a request as
  too long compacts and sends it once more, instead of failing the run. The
  messages themselves (the run's history) are never changed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from pydantic_ai.exceptions import FallbackExceptionGroup
from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import RequestUsage

from workers import observe
from workers.runtime.compaction import Compactor, estimate_tokens, is_context_overflow
from workers.runtime.providers import TRANSIENT_ERRORS, sent_errors

__all__ = ["TRANSIENT_ERRORS", "MeteredModel", "ResponseHook"]

# (messages sent, the response, the request's latency in ms)
ResponseHook = Callable[[list[ModelMessage], ModelResponse, float], None]


async def _nothing() -> None:
    return None


async def _give_up(exc: Exception) -> None:
    raise exc


class MeteredModel(WrapperModel):
    def __init__(
        self,
        wrapped: Model,
        on_response: ResponseHook,
        *,
        before: Callable[[], Awaitable[None]] = _nothing,
        after_error: Callable[[Exception], Awaitable[None]] = _give_up,
        labels: tuple[str, str] = ("", ""),
        compactor: Compactor | None = None,
    ) -> None:
        super().__init__(wrapped)
        self._on_response = on_response
        self._before = before
        self._after_error = after_error
        self._labels = labels
        self.compactor = compactor

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        sent = messages
        overflowed = False  # the provider refused it as too long once: compacted and sent again
        if self.compactor is not None:
            sent = await self.compactor.view(messages, model_request_parameters)
        while True:
            await self._before()
            started = time.perf_counter()
            try:
                response = await super().request(sent, model_settings, model_request_parameters)
            except (*TRANSIENT_ERRORS, FallbackExceptionGroup) as exc:
                for _ in sent_errors(exc):  # one held back by its gate was never sent
                    observe.model_request(*self._labels, "transient_error")
                await self._after_error(exc)
                continue
            except asyncio.CancelledError:  # a stop abandoned the request in flight
                observe.model_request(*self._labels, "cancelled")
                raise
            except Exception as exc:
                observe.model_request(*self._labels, "error")
                if self.compactor is not None and not overflowed and is_context_overflow(exc):
                    overflowed = True
                    again = await self.compactor.after_overflow(messages, model_request_parameters, sent)
                    if again is not None:
                        sent = again
                        continue
                raise
            latency_s = time.perf_counter() - started
            observe.model_request(*self._labels, "ok", latency_s)
            if response.usage.unmeasured_requests and not response.usage.total_tokens:
                response.usage = RequestUsage(
                    input_tokens=estimate_tokens(sent, model_request_parameters),
                    output_tokens=estimate_tokens([response]), unmeasured_requests=1,
                )  # fmt: skip
            self._on_response(sent, response, latency_s * 1000)
            return response
