"""A model wrapper: gates each request, retries transient errors, reports each response.

- Before every request, `before()` runs: the runner stops a cancelled run or a
  spent budget there, and waits for the provider's fleet-wide rate limit.
- A transient model error (rate limit, timeout, connection, 5xx, overloaded) is
  retried with exponential backoff, up to `retries` times, each one reported to
  `on_transient`; any other error ends the run as an agent failure.
- After every response, `on_response` records its usage atomically and
  persists the conversation, so a worker killed mid-run loses at most the
  request in flight, and spend is never counted twice (each request has a key).
- Every attempt is counted in the worker's own metrics by its outcome (ok,
  transient_error, error, cancelled), with the latency of those answered, under
  `labels` (provider, model): workers/observe.py, in memory, no Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from pydantic_ai.exceptions import (
    ModelConnectionError,
    ModelRateLimitError,
    ModelServerError,
    ModelUnavailableError,
)
from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings

from workers import observe

__all__ = ["TRANSIENT_ERRORS", "MeteredModel", "ResponseHook"]

# ModelTimeoutError is a ModelConnectionError; ModelOverloadedError a ModelUnavailableError.
TRANSIENT_ERRORS = (ModelRateLimitError, ModelServerError, ModelConnectionError, ModelUnavailableError)
# The longest single backoff, so a long run of retries does not sleep past the time limit.
MAX_BACKOFF_S = 30.0

# (messages sent, the response, the request's latency in ms)
ResponseHook = Callable[[list[ModelMessage], ModelResponse, float], None]


async def _nothing() -> None:
    return None


class MeteredModel(WrapperModel):
    def __init__(
        self,
        wrapped: Model,
        on_response: ResponseHook,
        *,
        before: Callable[[], Awaitable[None]] = _nothing,
        retries: int = 0,
        retry_base_s: float = 0.5,
        on_transient: Callable[[Exception, int], None] = lambda exc, attempt: None,
        labels: tuple[str, str] = ("", ""),
    ) -> None:
        super().__init__(wrapped)
        self._on_response = on_response
        self._before = before
        self._retries = retries
        self._retry_base_s = retry_base_s
        self._on_transient = on_transient
        self._labels = labels

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        attempt = 0
        while True:
            await self._before()
            started = time.perf_counter()
            try:
                response = await super().request(messages, model_settings, model_request_parameters)
            except TRANSIENT_ERRORS as exc:
                observe.model_request(*self._labels, "transient_error")
                if attempt >= self._retries:
                    raise
                attempt += 1
                self._on_transient(exc, attempt)
                await asyncio.sleep(min(MAX_BACKOFF_S, self._retry_base_s * 2 ** (attempt - 1)))
                continue
            except asyncio.CancelledError:  # a stop abandoned the request in flight
                observe.model_request(*self._labels, "cancelled")
                raise
            except Exception:
                observe.model_request(*self._labels, "error")
                raise
            latency_s = time.perf_counter() - started
            observe.model_request(*self._labels, "ok", latency_s)
            self._on_response(messages, response, latency_s * 1000)
            return response
