"""Every error the API returns, as one JSON shape: `{"code", "message", "field"}`.

subq's own errors keep their stable `code` (coordinator/errors.py) and get an
HTTP status from their class; FastAPI's request validation becomes the same
shape with the field path of the body (`subtasks.1.message`) or the parameter
(`limit`); the API's own refusals (auth, body size) are `HttpError`s. Nothing
ever answers with a traceback: an unexpected exception is logged on the
server and the client sees `internal_error`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kombu.exceptions
import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.api.schemas import ErrorBody
from coordinator.errors import (
    BrokerError,
    ConfigError,
    ConflictError,
    CorruptError,
    ForbiddenError,
    NotFoundError,
    QuotaExceeded,
    StateError,
    StoreError,
    SubqError,
    ValidationError,
    WaitTimeout,
)
from coordinator.inputs import error_message, error_path, one_line, visible_text

__all__ = [
    "BODY_TOO_LARGE",
    "INTERNAL_ERROR",
    "RATE_LIMITED",
    "UNAUTHORIZED",
    "HttpError",
    "error_response",
    "error_responses",
    "install_error_handlers",
    "status_of",
]

logger = logging.getLogger("coordinator.api")

UNAUTHORIZED = "unauthorized"
BODY_TOO_LARGE = "body_too_large"
RATE_LIMITED = "rate_limited"
INTERNAL_ERROR = "internal_error"

# The most an error's message says: any refusal's cause fits in far less, and a message that quotes what it refused
# grows with the input (a 1 MB body made a 1.8 MB answer before each quote was cut).
MAX_MESSAGE_CHARS = 4096

# Most specific class first: CorruptError is a StoreError but not a passing outage.
_STATUS_OF_ERROR: tuple[tuple[type[SubqError], int], ...] = (
    (NotFoundError, 404),
    (ForbiddenError, 403),
    (StateError, 409),
    (ConflictError, 409),
    (ValidationError, 422),
    (QuotaExceeded, 429),
    (WaitTimeout, 504),
    (CorruptError, 500),
    (StoreError, 503),  # Redis unreachable: the client may retry
    (ConfigError, 500),
)
# Request parameter sources FastAPI puts first in an error's location.
_SOURCES = frozenset({"body", "query", "path", "header", "cookie"})
_DESCRIPTIONS = {
    401: "Missing or wrong bearer token (code unauthorized)",
    403: "The API key lacks the scope this needs; the message names it (code forbidden)",
    404: "Unknown task id, well-formed or not (code not_found)",
    409: "The task is not in a state that allows this (codes wrong_state, conflict)",
    413: "The request body is over SUBQ_API_MAX_BODY_BYTES (code body_too_large)",
    429: "Too many requests or sign-in attempts from this address (code rate_limited), or a tenant's quota "
    "refuses a new root (code quota_exceeded, naming the tenant, the quota and when it resets); see Retry-After",
    422: "Invalid input, with the field path (codes invalid_input, invalid_todos, invalid_profile, ...)",
    503: "Redis is unreachable (code store_error)",
}


class HttpError(Exception):
    """A refusal by the API layer itself (auth), with its status and stable code."""

    def __init__(
        self,
        status_code: int,
        code: str,
        message: str,
        *,
        field: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.field = field
        self.headers = dict(headers or {})


def status_of(exc: SubqError) -> int:
    for cls, status in _STATUS_OF_ERROR:
        if isinstance(exc, cls):
            return status
    return 500


def error_response(
    status_code: int, code: str, message: str, field: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    # A message quotes what was refused, which may hold a lone surrogate (JSON's "\\ud800"): no JSON encoder writes
    # one, so it goes as its escape, as does any other character a terminal would act on.
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + "…"
    body = ErrorBody(code=code, message=visible_text(message), field=visible_text(field) if field else field)
    return JSONResponse(body.model_dump(mode="json"), status_code=status_code, headers=dict(headers or {}))


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` entries of these error statuses (all `ErrorBody`)."""
    return {status: {"model": ErrorBody, "description": _DESCRIPTIONS[status]} for status in statuses}


def _validation_body(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, field) of the first problem; one at a time, as the service reports them."""
    errors = exc.errors()
    if not errors:
        return "Invalid request", None
    err = errors[0]
    loc = list(err.get("loc", ()))
    source = str(loc[0]) if loc and str(loc[0]) in _SOURCES else ""
    if source:
        loc = loc[1:]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON{f': {detail}' if detail else ''}", None
    # An output schema's problem goes on into the schema (`output_schema.properties.total.type`).
    field = error_path({**err, "loc": loc}) or None
    return f"{field or source or 'request'}: {error_message(err) if 'msg' in err else 'invalid'}", field


async def _on_subq_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SubqError)
    status = status_of(exc)
    if status >= 500:
        logger.warning("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc.message)
    headers = {"Retry-After": str(max(1, exc.retry_after_s))} if isinstance(exc, QuotaExceeded) else None
    return error_response(status, exc.code, exc.message, exc.field, headers)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HttpError)
    return error_response(exc.status_code, exc.code, exc.message, exc.field, exc.headers)


async def _on_request_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, field = _validation_body(exc)
    return error_response(422, ValidationError.code, message, field)


async def _on_starlette_http(request: Request, exc: Exception) -> JSONResponse:
    """Routing refusals (unknown path, wrong method) in the same shape."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:
        # FastAPI's only 400: a body it could not decode (not UTF-8, say). To a client
        # that is invalid input like malformed JSON, so it gets the same 422.
        return error_response(422, ValidationError.code, f"The request body could not be read: {exc.detail}")
    code = {404: NotFoundError.code, 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
    message = f"No such endpoint: {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
    return error_response(exc.status_code, code, message, None, exc.headers)


async def _on_broker_error(request: Request, exc: Exception) -> JSONResponse:
    # A publish that could not reach the broker after its own retries (kombu's OperationalError from a lost
    # connection: the master died, a restart outlasted them), after the store's write: a 503 the client may retry
    # (the write is kept, and the reconciler publishes the run), not a 500 that a script takes for a failure and
    # runs again as a second tree. kombu wraps a broker's refusal (an ACL, OOM, a wrong password) and a TLS file
    # it cannot read in the same class: those stay a 500, with their traceback in the log.
    if not _unreachable(exc.__cause__ or exc.__context__):
        logger.error("subq api: a publish failed", exc_info=exc)
        return await _on_unexpected(request, exc)
    logger.warning("subq api: the broker is unreachable: %s", exc)
    return error_response(503, BrokerError.code, f"The broker is unreachable: {one_line(str(exc))}; the change is kept")


def _unreachable(cause: BaseException | None) -> bool:
    """Whether a publish's failure is the broker out of reach: a lost or refused connection, a timeout."""
    if isinstance(cause, redis.AuthenticationError):
        return False
    return isinstance(cause, redis.ConnectionError | redis.TimeoutError | ConnectionError | TimeoutError)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette's ServerErrorMiddleware re-raises after this response, so the
    # server logs the traceback once; the client never sees it.
    return error_response(500, INTERNAL_ERROR, "Internal server error; the server log has the details")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(SubqError, _on_subq_error)
    app.add_exception_handler(HttpError, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(StarletteHTTPException, _on_starlette_http)
    app.add_exception_handler(kombu.exceptions.OperationalError, _on_broker_error)
    app.add_exception_handler(Exception, _on_unexpected)
