"""The models a task's requests go to, and how a run rides out its provider's failures.

`build_model` only constructs clients; nothing there touches the network, so a
worker can build a task's model before it knows the endpoint is reachable.
Keys and URLs come from the profile: a profile that names no key gets the
provider's standard variable (`OPENAI_API_KEY`, `ANTHROPIC_API_KEY`) through
`Settings.profile`, since in subq only `Settings` reads the environment; the
SDKs are never left to read it themselves. A missing key is a clear
`ProfileError`, and an unset `base_url` is the vendor's public endpoint.

The SDKs' own retries are off (`max_retries=0`): subq waits out a transient
error itself, counted (workers/runtime/metering.py); with both, one failing
request was sent six times. Every provider error reads as one line that says
where: the provider's status, error type and message (or the transport's
error), then the profile, the model and the endpoint's host and port, never a
key; the raw body is kept on the exception (`body`).

A task's `Route` is its profile's model, then its `fallback_profiles`' (pydantic-ai's
`FallbackModel`), each behind the fleet's views of its endpoint
(coordinator/endpoints.py: a run waits while the endpoint's host, or its model
there, is down instead of sending, and one probe decides when it is back). Which
view a transient error marks is decided here, once (`view_of`): a transport's
failure (a refused or dropped connection, a timeout) is the host's; anything
the provider answered (429, 5xx, 529, with their Retry-After) is the model's, so
a fallback to another model of the same endpoint goes while the first is down.
After a transient error the
route's `Patience` decides: wait inside the run (a wait of at most
`IN_RUN_WAIT_S`), give the worker back until the endpoint may be tried
(`ProviderWait`, which the runner turns into a parked run), or, past the
profile's `model_wait_out_s`, fail the run with the last error. A request goes
to the next profile of the chain when its provider refuses the model (401, 403,
404) or keeps failing: `FALLBACK_AFTER_FAILURES` failures in a row, or a wait
longer than `IN_RUN_WAIT_S`. Each response is priced at the profile that
answered it (`Route.answered`).

The offline model has no endpoint to share: its scripted failures belong to one
task, so its view is the task's own (`LocalEndpoint`: the endpoint `offline/<task id>`),
marked down by the same script, so the backoff is written once, in
`endpoint_failed.lua`; only its gate is answered in the process, from that answer.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
from pydantic_ai import RunContext
from pydantic_ai.exceptions import (
    FallbackExceptionGroup,
    ModelAPIError,
    ModelAuthenticationError,
    ModelConnectionError,
    ModelEmptyResponseError,
    ModelHTTPError,
    ModelInvalidResponseError,
    ModelNotFoundError,
    ModelRateLimitError,
    ModelRequestRejectedError,
    ModelServerError,
    ModelUnavailableError,
)
from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models.fallback import FallbackModel
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings

from coordinator import OFFLINE_PROFILE, STANDARD_KEYS, Profile, ProfileError, Settings
from coordinator.runs import HOST, MODEL, EndpointState, Released
from workers.runtime.offline import OfflineModel

__all__ = [
    "ANTHROPIC_BASE_URL",
    "FALLBACK_AFTER_FAILURES",
    "IN_RUN_WAIT_S",
    "OPENAI_BASE_URL",
    "TRANSIENT_ERRORS",
    "UNREADABLE_ANSWERS",
    "EndpointDown",
    "OneLineErrors",
    "ProviderWait",
    "Route",
    "build_model",
    "endpoint_of",
    "error_line",
    "load_sdks",
    "sent_errors",
    "tls_context",
    "view_of",
]

# The vendors' public endpoints, passed explicitly so the SDKs never read
# OPENAI_BASE_URL / ANTHROPIC_BASE_URL from the environment behind Settings' back.
OPENAI_BASE_URL = "https://api.openai.com/v1"
ANTHROPIC_BASE_URL = "https://api.anthropic.com"
# A failed request is sent again by subq alone (a route's Patience): the SDKs' own retries would multiply it.
SDK_RETRIES = 0
# A provider's error message is one line of the task's error; longer ones are cut.
ERROR_MESSAGE_CHARS = 200
# ModelTimeoutError is a ModelConnectionError; ModelOverloadedError a ModelUnavailableError. An answer with a 200
# that holds no response (no choices) or none that can be read (a gateway's error object, a body that is no JSON:
# `OneLineErrors` makes pydantic-ai's bare ModelAPIError for those a ModelInvalidResponseError) is a provider's
# glitch as a 5xx is: sent again after a wait, and to the next profile of the chain when it goes on. Failing the
# run at the first one threw a child's work away on a proxy's blip.
UNREADABLE_ANSWERS = (ModelEmptyResponseError, ModelInvalidResponseError)
TRANSIENT_ERRORS = (
    ModelRateLimitError,
    ModelServerError,
    ModelConnectionError,
    ModelUnavailableError,
    *UNREADABLE_ANSWERS,
)
# A wait up to this long is slept inside the run; a longer one gives the worker back: parking
# costs a saved step, a timer and a new run (about a reconciler tick late), more than a short wait.
IN_RUN_WAIT_S = 5.0
# A request goes to the next profile of its chain once its endpoint failed this often in a row
# (about 3.5 s of backoff with the defaults): a blip is waited out, an outage is not waited for.
FALLBACK_AFTER_FAILURES = 3


class EndpointDown(ModelUnavailableError):
    """The fleet knows the endpoint (its host, or the model there) is down: the request was not sent.
    `wait_s`: until it may be tried; `view`: the model's view of the endpoint it waits for, '' for its host's."""

    def __init__(self, model_name: str, message: str, *, wait_s: float, failures: int, hop: Hop, view: str) -> None:
        super().__init__(model_name, message)
        self.wait_s = wait_s
        self.failures = failures
        self.subq_hop = hop
        self.view = view


class ProviderWait(Exception):
    """The run must give its worker back until its provider may be tried again (`released`)."""

    def __init__(self, released: Released) -> None:
        super().__init__(f"waiting for the provider until {released.wake_at_s:.0f}")
        self.released = released


def build_model(profile: Profile, *, name: str | None = None) -> Model:
    """The model for `profile`, its errors one line naming `name`, the model and the endpoint.

    Raises `ProfileError` when a real provider's profile has no `api_key`.
    """
    if profile.model == OFFLINE_PROFILE:
        return OfflineModel()  # no provider: its errors are the lines its script gives
    provider, _, model_name = profile.model.partition(":")
    # The SDKs are imported here, not at the module's top: together they are more than half
    # of a worker's start (anthropic's and openai's pydantic types, about 4 s of CPU on 2
    # cores), and a fleet of offline or one-provider profiles needs neither or one.
    # `load_sdks` imports the ones the profiles name at the worker's start, not in a run.
    if provider == "openai":
        from openai import AsyncOpenAI, DefaultAsyncHttpxClient
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        openai = AsyncOpenAI(
            api_key=_api_key(profile, name), base_url=profile.base_url or OPENAI_BASE_URL, max_retries=SDK_RETRIES,
            http_client=DefaultAsyncHttpxClient(verify=tls_context()),
        )  # fmt: skip
        return OneLineErrors(
            OpenAIChatModel(model_name, provider=OpenAIProvider(openai_client=openai)), _where(profile, name)
        )
    if provider == "anthropic":
        from anthropic import AsyncAnthropic
        from anthropic import DefaultAsyncHttpxClient as AnthropicHttpxClient
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider

        anthropic = AsyncAnthropic(
            api_key=_api_key(profile, name), base_url=profile.base_url or ANTHROPIC_BASE_URL, max_retries=SDK_RETRIES,
            http_client=AnthropicHttpxClient(verify=tls_context()),
        )  # fmt: skip
        return OneLineErrors(
            AnthropicModel(model_name, provider=AnthropicProvider(anthropic_client=anthropic)), _where(profile, name)
        )
    # Profile validation rejects other providers; this guards a Profile built with model_construct().
    raise ProfileError(f"unknown model provider in {profile.model!r}", field=_field(name, "model"))


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one TLS context for its providers' clients, as httpx makes its default.

    A model is built for each run (`build_model`), and an SDK client left to make its own
    context loads the CA bundle each time: 41 of the 53 ms of CPU that building an OpenAI
    model took on 2 cores, a child's whole agent CPU over again. One context serves every
    client, thread and loop; `SSL_CERT_FILE` / `SSL_CERT_DIR` are read as httpx reads them.
    """
    return httpx.create_ssl_context()


# The modules `build_model` imports for each provider, the SDK's and pydantic-ai's model for it.
SDK_MODULES = {
    "openai": ("openai", "pydantic_ai.models.openai", "pydantic_ai.providers.openai"),
    "anthropic": ("anthropic", "pydantic_ai.models.anthropic", "pydantic_ai.providers.anthropic"),
}


def load_sdks(profiles: Sequence[Profile]) -> list[str]:
    """Import the SDKs of the providers `profiles` use, once, at the worker's start; their names.

    So a run's first request does not pay seconds of imports inside the run, and a fleet
    that uses no provider (the offline model) never imports one.
    """
    providers = sorted({p.model.partition(":")[0] for p in profiles} & SDK_MODULES.keys())
    for provider in providers:
        for module in SDK_MODULES[provider]:
            importlib.import_module(module)
    return providers


def endpoint_of(profile: Profile) -> str | None:
    """The `host:port` the profile's requests go to (None for the offline model, which has none)."""
    if profile.model == OFFLINE_PROFILE:
        return None
    default = ANTHROPIC_BASE_URL if profile.provider == "anthropic" else OPENAI_BASE_URL
    parts = urlsplit(profile.base_url or default)
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    host = parts.hostname or "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _where(profile: Profile, name: str | None) -> str:
    """What an error line ends with: the profile, the model and the endpoint (no key, no path, no query)."""
    endpoint = endpoint_of(profile)
    return ", ".join(
        part
        for part in (
            f"profile {name!r}" if name else "",
            f"model {profile.model}",
            f"endpoint {endpoint}" if endpoint else "offline",
        )
        if part
    )


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
    """A provider's model whose errors read as one clear line that says where (`error_line`).

    The exception stays the one pydantic-ai raised (its class tells a transient error from a
    refusal); only its message is rewritten, once, and its raw body is kept.
    """

    def __init__(self, wrapped: Model, where: str) -> None:
        super().__init__(wrapped)
        self.where = where

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        try:
            return await super().request(messages, model_settings, model_request_parameters)
        except ModelAPIError as exc:
            raise self._rewrite(exc) from exc.__cause__

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
        except ModelAPIError as exc:
            raise self._rewrite(exc) from exc.__cause__

    def _rewrite(self, exc: ModelAPIError) -> ModelAPIError:
        """`exc` saying where, once; pydantic-ai's bare ModelAPIError (a 200 whose body is no JSON, or text where
        JSON was expected) as the ModelInvalidResponseError it is, so it is told apart from a refusal."""
        if getattr(exc, "subq_line", None) is not None:
            return exc  # an inner model of the same chain said where already
        if type(exc) is ModelAPIError:
            exc = ModelInvalidResponseError(exc.model_name, exc.message, body=exc.body)
        exc = _as_its_status(exc)
        line = error_line(exc)
        exc.subq_line = line  # type: ignore[attr-defined]  # the line without where, for the fleet's view
        exc.message = f"{line} ({self.where})"
        exc.args = (exc.message,)
        return exc


def _as_its_status(exc: ModelAPIError) -> ModelAPIError:
    """A gateway's error object sent with a 200 (OpenRouter's way), as the HTTP error its `code` says: a 4xx (a
    prompt past the window, a moderation refusal) is a refusal, compacted or failed as a 400 is; a 429 or 5xx, or no
    status at all, a transient error of the model. Taken all for transient, a request that can never succeed was
    sent again for the whole wait-out, and its model marked down for every run of the fleet meanwhile."""
    body = exc.body if isinstance(exc, ModelInvalidResponseError) else None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return exc
    code = error.get("code")
    status = int(code) if isinstance(code, int | str) and str(code).isdigit() and 400 <= int(code) <= 599 else 502
    category: Any = ModelRequestRejectedError
    if status == 429:
        category = ModelRateLimitError
    elif status >= 500:
        category = ModelServerError
    return ModelHTTPError.for_category(category, status_code=status, model_name=exc.model_name, body={"error": error})


def error_line(exc: ModelAPIError) -> str:
    """What went wrong, in one line: `HTTP <status> <provider's error type>: <provider's message>` for an
    error response (OpenAI's body is the `error` object, Anthropic's wraps it; anything else is shown as
    text), else the error's kind and message (`ModelConnectionError: Connection error.`)."""
    if not isinstance(exc, ModelHTTPError):
        return f"{type(exc).__name__}: {_cut(' '.join(exc.message.split()) or 'no message')}"
    body: Any = exc.body
    inner = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(inner, dict):
        kind = inner.get("type") or inner.get("code") or exc.provider_error_type
        kind = None if str(kind) == str(exc.status_code) else kind  # a gateway's `code` is often the status itself
        message = inner.get("message") or ""
    else:
        kind, message = exc.provider_error_type, "" if inner is None else str(inner)
    text = _cut(" ".join(str(message).split()) or "no message")
    return f"HTTP {exc.status_code}{f' {kind}' if kind else ''}: {text}"


def _cut(text: str) -> str:
    return text if len(text) <= ERROR_MESSAGE_CHARS else text[: ERROR_MESSAGE_CHARS - 1] + "…"


def _field(name: str | None, field: str) -> str:
    return f"profiles.{name}.{field}" if name else field


# -- the endpoint's view, and what a route needs of its run --------------------------------


def view_of(exc: Exception) -> str:
    """Which view of its endpoint a transient error marks: `HOST` for what the transport says (a refused or
    dropped connection, a timeout: no answer came), `MODEL` for what the provider answered of the model (429,
    5xx, 529 and their Retry-After): one model's outage is not its host's."""
    # A timeout the provider answered (HTTP 408: OpenRouter's when one upstream model timed out) is an answer of it,
    # as pydantic-ai raises it (a ModelTimeoutError that is a ModelHTTPError too): the model's, not the host's.
    answered = isinstance(exc, ModelHTTPError)
    return HOST if isinstance(exc, ModelConnectionError) and not answered else MODEL


class EndpointView(Protocol):
    """What the fleet knows of one model's endpoint: the gate before a request, a failure (of the `view` it
    marks), an answer (`host_only`: the host answered, of a model whose own view stays down)."""

    def gate(self) -> EndpointState: ...

    def failed(self, line: str, asked_s: float | None, view: str) -> EndpointState: ...

    def answered(self, *, was_down: bool, host_only: bool = False) -> None: ...


class ProviderPort(Protocol):
    """What a route needs of its run: the run's provider port (coordinator/ports/provider.py)."""

    def gate(self, endpoint: str, model: str) -> EndpointState: ...

    def failed(self, endpoint: str, model: str, error: str, asked_s: float | None) -> EndpointState: ...

    def answered(self, endpoint: str, model: str, *, was_down: bool) -> None: ...

    def wait_over(self) -> None: ...

    def wait_since_ms(self) -> int | None: ...

    def waiting(self, endpoint: str, *, waiting: bool) -> None: ...

    def park(self, endpoint: str, model: str, wake_at_s: float, since_ms: int) -> Released: ...

    def transient_errors(self, lines: Sequence[str]) -> None: ...


class SharedEndpoint:
    """A real provider's endpoint: the fleet's views of it (its host's, and `model`'s), in Redis, through the run."""

    def __init__(self, port: ProviderPort, endpoint: str, model: str) -> None:
        self.port = port
        self.endpoint = endpoint
        self.model = model

    def gate(self) -> EndpointState:
        return self.port.gate(self.endpoint, self.model)

    def failed(self, line: str, asked_s: float | None, view: str) -> EndpointState:
        return self.port.failed(self.endpoint, self.model if view == MODEL else "", line, asked_s)

    def answered(self, *, was_down: bool, host_only: bool = False) -> None:
        self.port.answered(self.endpoint, "" if host_only else self.model, was_down=was_down)


class LocalEndpoint(SharedEndpoint):
    """The offline model's: its failures are one task's script, so its view is the task's own (the endpoint
    `offline/<task id>`), marked down by the fleet's rule (endpoint_failed.lua) and gated in the process
    from that answer: a request of the offline model costs no round trip while it is up."""

    def __init__(self, port: ProviderPort, task_id: str, model: str) -> None:
        super().__init__(port, f"{OFFLINE_PROFILE}/{task_id}", model)
        self.down_until_s = 0.0
        self.failures = 0

    def gate(self) -> EndpointState:
        wait_ms = int((self.down_until_s - time.time()) * 1000)
        return EndpointState(max(0, wait_ms), self.failures, view=MODEL if self.failures else "")

    def failed(self, line: str, asked_s: float | None, view: str) -> EndpointState:
        marked = super().failed(line, asked_s, MODEL)  # its script marks the model's view: no host to refuse it
        self.down_until_s, self.failures = time.time() + marked.wait_ms / 1000, marked.failures
        return marked

    def answered(self, *, was_down: bool, host_only: bool = False) -> None:
        if not host_only:
            super().answered(was_down=was_down)
            self.down_until_s, self.failures = 0.0, 0


@dataclass(frozen=True)
class Marked:
    """What marking its endpoint down said of a transient error: the hop, the wait (s), the failures in a row,
    and the view it marked (the model's, or '' for the host's)."""

    hop: Hop
    wait_s: float
    failures: int
    view: str


@dataclass(frozen=True)
class Hop:
    """One profile of a task's chain: its name, the profile, and its endpoint ('' for the offline model)."""

    name: str
    profile: Profile
    endpoint: str


class GatedModel(WrapperModel):
    """One profile's model behind its endpoint's gate: not sent while the fleet knows it is down; each
    transient failure marks it down for the fleet; a success clears it and says which profile answered."""

    def __init__(self, hop: Hop, view: EndpointView, route: Route) -> None:
        super().__init__(build_model(hop.profile, name=hop.name))
        self.hop, self.view, self.route = hop, view, route

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        gate = self.view.gate()
        if gate.wait_ms:
            line = gate.error or "the provider failed"
            down = "the endpoint is down" if gate.view == HOST else "the model is down at its endpoint"
            raise EndpointDown(
                self.hop.profile.model,
                f"not sent, {down}: {line} ({_where(self.hop.profile, self.hop.name)})",
                wait_s=gate.wait_ms / 1000,
                failures=gate.failures,
                hop=self.hop,
                view=self.hop.profile.model if gate.view == MODEL else "",
            )
        try:
            response = await super().request(messages, model_settings, model_request_parameters)
        except TRANSIENT_ERRORS as exc:
            line = str(getattr(exc, "subq_line", None) or error_line(exc))
            view = view_of(exc)
            if view == MODEL and gate.view == HOST:
                self.view.answered(was_down=True, host_only=True)  # the host answered: runs parked on it go on
            marked_gate = self.view.failed(line, exc.retry_after, view)
            marked: Any = exc  # the route reads what the fleet's view said of it
            marked.subq_marked = Marked(
                self.hop, marked_gate.wait_ms / 1000, marked_gate.failures,
                self.hop.profile.model if view == MODEL else "",
            )  # fmt: skip
            raise
        except ModelAPIError:
            # A refusal (400, 401, 404, ...) is an answer: the endpoint and the model are up, and a probe's
            # turn is over.
            self.view.answered(was_down=bool(gate.view))
            raise
        self.view.answered(was_down=bool(gate.view))
        self.route.answered = self.hop
        return response


# -- a task's route, and its patience ----------------------------------------------------------


class Route:
    """The models a task's requests go to (its profile's, then its fallbacks'), and its patience."""

    def __init__(self, settings: Settings, port: ProviderPort, name: str, *, task_id: str) -> None:
        self.settings = settings
        self.port = port
        self.task_id = task_id
        self.hops = [self._hop(n) for n in settings.fallback_chain(name)]
        self.answered = self.hops[0]  # the profile whose model answered the latest response
        self.wait_out_s = self.hops[0].profile.model_wait_out_s
        self._since_ms: int | None = None  # the first transient error of the request now in flight
        self._in_run_wait_s = 0.0  # how long the request has waited inside the run so far
        self._last_error: Exception | None = None
        self._waiting_on: set[str] = set()
        self._counted = False  # the request in flight has failed attempts counted on the task
        self.model = self._model()

    def _hop(self, name: str) -> Hop:
        profile = self.settings.profile(name)
        return Hop(name, profile, endpoint_of(profile) or "")

    def _model(self) -> Model:
        models: list[Model] = []
        for hop in self.hops:
            view: EndpointView
            if hop.endpoint:
                view = SharedEndpoint(self.port, hop.endpoint, hop.profile.model)
            else:
                view = LocalEndpoint(self.port, self.task_id, hop.profile.model)
            models.append(GatedModel(hop, view, self))
        if len(models) == 1:
            return models[0]
        return FallbackModel(models[0], *models[1:], fallback_on=_falls_back)

    @property
    def fell_back(self) -> bool:
        """Whether the latest response came from a fallback profile rather than the task's own."""
        return self.answered is not self.hops[0]

    def succeeded(self) -> None:
        """A response arrived: the request's waits are over (the offline model's are the run's alone)."""
        for endpoint in self._waiting_on:
            self.port.waiting(endpoint, waiting=False)
        self._waiting_on.clear()
        if self.answered.endpoint or self._counted:
            self.port.wait_over()
        self._since_ms, self._in_run_wait_s, self._last_error = None, 0.0, None
        self._counted = False

    async def after_error(self, exc: Exception) -> None:
        """After a transient error (or a gate that said wait): sleep through a short wait, give the worker
        back for a long one (`ProviderWait`), or raise the last error once `model_wait_out_s` is spent.
        A chain whose every profile refused raises the last refusal (which names its profile); one with a
        profile that may come back waits for it."""
        waits, refusal = _waits_of(exc)
        if not waits:
            raise refusal or exc  # nothing to wait for (a transient error no endpoint marked is raised as is)
        wait_s, hop, error, view = min(waits, key=lambda w: w[0])
        endpoint = hop.endpoint or OFFLINE_PROFILE
        now_ms = int(time.time() * 1000)
        if self._since_ms is None:
            self._since_ms = self.port.wait_since_ms() or now_ms
        real = sent_errors(exc)
        if real:
            self._last_error = real[-1]
        spent_s = (now_ms - self._since_ms) / 1000
        if spent_s + wait_s > self.wait_out_s:
            raise self._give_up(error, spent_s)
        if real:  # each will be sent again: counted on the task, told in its UI messages (each line says where)
            self.port.transient_errors([str(e) for e in real])
            self._counted = True
        self._waiting_on.add(endpoint)
        if hop.endpoint and self._in_run_wait_s + wait_s > IN_RUN_WAIT_S:
            raise ProviderWait(self.port.park(hop.endpoint, view, time.time() + wait_s, self._since_ms))
        self.port.waiting(endpoint, waiting=True)
        self._in_run_wait_s += wait_s
        await asyncio.sleep(wait_s)

    def _give_up(self, error: Exception, spent_s: float) -> Exception:
        """The error the run fails with: the last one a request met (a gate's, if none), saying how long it waited."""
        last = self._last_error or error
        if isinstance(last, ModelAPIError):
            # To a tenth under 10 s: a run gives up before the wait-out when its next wait would end past it
            # (a jittered backoff), and "after 0 s" said it had not waited at all.
            waited = f"{spent_s:.1f}" if spent_s < 10 else f"{spent_s:.0f}"
            last.message = f"{last.message}; gave up after {waited} s (model_wait_out_s={self.wait_out_s:g})"
            last.args = (last.message,)
        return last


def _errors_of(exc: BaseException) -> Sequence[BaseException]:
    """The errors of one request: `exc`, or each of a fallback chain's group."""
    return exc.exceptions if isinstance(exc, FallbackExceptionGroup) else [exc]


def sent_errors(exc: BaseException) -> list[Exception]:
    """The transient errors in `exc` of requests that were sent (not those a gate held back): what the task
    counts as `transient_errors`, and a worker's metrics as `transient_error`."""
    return [e for e in _errors_of(exc) if isinstance(e, TRANSIENT_ERRORS) and not isinstance(e, EndpointDown)]


def _waits_of(exc: Exception) -> tuple[list[tuple[float, Hop, Exception, str]], Exception | None]:
    """(wait in s, the hop, the error, the view it waits for) for each transient error in `exc` (one, or a
    fallback chain's group), and the last error that is no wait at all (a refusal the run fails with), if any."""
    waits: list[tuple[float, Hop, Exception, str]] = []
    refusal: Exception | None = None
    for error in _errors_of(exc):
        marked = getattr(error, "subq_marked", None)
        if isinstance(error, EndpointDown):
            waits.append((error.wait_s, error.subq_hop, error, error.view))
        elif isinstance(error, TRANSIENT_ERRORS) and isinstance(marked, Marked):
            waits.append((marked.wait_s, marked.hop, error, marked.view))
        elif isinstance(error, Exception):
            refusal = error
    return waits, refusal


def _falls_back(exc: Exception) -> bool:
    """Whether a request goes on to the next profile: its provider refused the model (401, 403, 404), or
    keeps failing (FALLBACK_AFTER_FAILURES in a row, or a wait longer than a run waits inside itself)."""
    if isinstance(exc, ModelAuthenticationError | ModelNotFoundError):
        return True
    if isinstance(exc, EndpointDown):
        return exc.failures >= FALLBACK_AFTER_FAILURES or exc.wait_s > IN_RUN_WAIT_S
    marked = getattr(exc, "subq_marked", None)
    if isinstance(exc, TRANSIENT_ERRORS) and isinstance(marked, Marked):
        return marked.failures >= FALLBACK_AFTER_FAILURES or marked.wait_s > IN_RUN_WAIT_S
    return False
