"""A model wrapper that reports every model response as soon as it arrives.

The runner records each request's usage on the task atomically and persists the
conversation after every request, so a worker killed mid-run loses at most the
request in flight, and spend is never counted twice (each request has a key).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings

__all__ = ["MeteredModel", "ResponseHook"]

# (messages sent, the response, the request's latency in ms)
ResponseHook = Callable[[list[ModelMessage], ModelResponse, float], None]


class MeteredModel(WrapperModel):
    def __init__(self, wrapped: Model, on_response: ResponseHook) -> None:
        super().__init__(wrapped)
        self._on_response = on_response

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        started = time.perf_counter()
        response = await super().request(messages, model_settings, model_request_parameters)
        self._on_response(messages, response, (time.perf_counter() - started) * 1000)
        return response
