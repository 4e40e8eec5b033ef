"""The client's own errors, and an error response read back as the SubqError of its `code`."""

from __future__ import annotations

from typing import Any

import httpx

from coordinator import errors as error_tree
from coordinator.errors import SubqError
from coordinator.inputs import one_line, visible_text
from coordinator.text import ascii_digits

__all__ = ["ApiError", "AuthError", "error_from", "error_of", "unreachable"]


class ApiError(SubqError):
    """An error response whose code has no class in coordinator.errors, or no usable response at all.

    `code` is the server's code (`unauthorized`, `body_too_large`, `internal_error`, ...),
    or `api_unreachable` / `bad_response` when the client could not get a valid answer.
    """

    code = "api_error"

    def __init__(
        self, message: str, *, field: str | None = None, code: str | None = None, status_code: int | None = None
    ) -> None:
        super().__init__(message, field=field)
        if code is not None:
            self.code = code
        self.status_code = status_code


class AuthError(ApiError):
    """401: the token is missing or wrong."""

    code = "unauthorized"


def _error_classes() -> dict[str, type[SubqError]]:
    """code -> class for every error in coordinator.errors (its __all__ is the registry)."""
    classes = (getattr(error_tree, name) for name in error_tree.__all__)
    return {cls.code: cls for cls in classes if isinstance(cls, type) and issubclass(cls, SubqError)}


def error_of(response: httpx.Response) -> SubqError:
    """The SubqError of an error response (its body read)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    # Not the API's error body (a proxy's page, another server at SUBQ_API_URL: Flower's port answers HTML), said as
    # such, on one line, the server's text shown as text (it reaches a terminal).
    snippet = one_line(visible_text(response.text), 160)
    fallback = (
        f"HTTP {response.status_code} from {response.request.method} {response.request.url.path}, which is not an"
        f" answer of the subq API (is SUBQ_API_URL the API's address?): {snippet}"
    )
    error = error_from(body, response.status_code, fallback)
    if isinstance(error, error_tree.QuotaExceeded):  # the quota's reset, as the server's Retry-After says
        after = response.headers.get("Retry-After", "")
        error.retry_after_s = int(after) if ascii_digits(after) else 0
    return error


def error_from(body: Any, status_code: int | None, fallback: str) -> SubqError:
    """The SubqError of an error body `{code, message, field}`."""
    if not isinstance(body, dict) or not isinstance(body.get("code"), str) or not isinstance(body.get("message"), str):
        return ApiError(fallback, code="bad_response", status_code=status_code)
    code, message = body["code"], body["message"]
    where = str(body["field"]) if body.get("field") is not None else None
    if status_code == 401:
        return AuthError(message, field=where, code=code, status_code=status_code)
    cls = _error_classes().get(code)
    if cls is None:
        return ApiError(message, field=where, code=code, status_code=status_code)
    return cls(message, field=where)


def unreachable(exc: httpx.RequestError, base_url: httpx.URL) -> ApiError:
    """A request that got no answer it could read: `api_unreachable` for a connection's failure, `bad_response`
    for an answer httpx could not read (a body a proxy's compression broke), each in one line."""
    if isinstance(exc, httpx.TransportError):
        return ApiError(
            f"The subq API at {base_url} is unreachable: {type(exc).__name__}: {exc}", code="api_unreachable"
        )
    return ApiError(
        f"The subq API at {base_url} answered with what could not be read: {type(exc).__name__}: {exc}",
        code="bad_response",
    )
