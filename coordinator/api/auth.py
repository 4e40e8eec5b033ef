"""Bearer-token authentication for the /v1 endpoints.

The token is `SUBQ_API_TOKEN`. Authentication is off only when
`SUBQ_API_AUTH_DISABLED=true` says so, and then the server logs a warning at
start; with neither setting, building the app fails with a ConfigError naming
SUBQ_API_TOKEN, so a server is never open by accident. `/livez`, `/readyz`,
`/healthz`, `/metrics`, `/openapi.json` and `/docs` stay open: they carry no
task data.

Wrong tokens are counted per client address (`auth_attempts`, shared with the
web view's sign-in): past SUBQ_API_AUTH_ATTEMPTS_PER_MIN the address gets 429
for every request, the right token too, until its bucket refills; otherwise a
guesser would only have to wait for the one guess that works.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from coordinator.api.errors import RATE_LIMITED, UNAUTHORIZED, HttpError
from coordinator.api.limits import RateLimiter, client_address, retry_after
from coordinator.errors import ConfigError
from coordinator.settings import Settings

__all__ = ["AUTH_DISABLED_WARNING", "bearer_auth", "too_many_attempts"]

logger = logging.getLogger("coordinator.api")

AUTH_DISABLED_WARNING = (
    "SUBQ_API_AUTH_DISABLED=true: the subq API accepts requests WITHOUT authentication; "
    "anyone who can reach it can create, read and delegate tasks. Set SUBQ_API_TOKEN instead outside development."
)
_CHALLENGE = {"WWW-Authenticate": "Bearer"}

Guard = Callable[..., Awaitable[None]]


def too_many_attempts(limiter: RateLimiter, wait_s: float) -> HttpError:
    return HttpError(
        429,
        RATE_LIMITED,
        f"Too many wrong tokens or sign-ins from this address (SUBQ_API_AUTH_ATTEMPTS_PER_MIN={limiter.per_min}); "
        f"retry in {max(1, round(wait_s))} s",
        headers=retry_after(wait_s),
    )


def bearer_auth(settings: Settings, auth_attempts: RateLimiter) -> Guard | None:
    """The dependency that checks the bearer token, or None when auth is explicitly disabled."""
    if settings.api_auth_disabled:
        ignored = " (SUBQ_API_TOKEN is set and ignored)" if settings.api_token else ""
        logger.warning(AUTH_DISABLED_WARNING + ignored)
        return None
    token = settings.api_token.get_secret_value() if settings.api_token is not None else ""
    if not token:
        raise ConfigError(
            "Invalid setting SUBQ_API_TOKEN: not set. Set it to the bearer token clients must send, "
            "or set SUBQ_API_AUTH_DISABLED=true to run without authentication (development only)",
            field="SUBQ_API_TOKEN",
        )
    expected = token.encode()
    scheme = HTTPBearer(auto_error=False, description="The token of SUBQ_API_TOKEN: `Authorization: Bearer <token>`")

    # A default, not Annotated: annotations are strings here (PEP 563), and FastAPI
    # resolves them in the module's namespace, where this closure's `scheme` is not.
    async def check(request: Request, credentials: HTTPAuthorizationCredentials | None = Security(scheme)) -> None:
        address = client_address(request.scope)
        if wait_s := auth_attempts.wait_s(address):
            raise too_many_attempts(auth_attempts, wait_s)
        if credentials is None:
            raise HttpError(
                401,
                UNAUTHORIZED,
                "Missing bearer token: send 'Authorization: Bearer <token>' (the server's SUBQ_API_TOKEN)",
                field="Authorization",
                headers=_CHALLENGE,
            )
        # Constant time: the comparison must not tell an attacker how much of a guess was right.
        if not hmac.compare_digest(credentials.credentials.encode(), expected):
            auth_attempts.take(address)
            raise HttpError(401, UNAUTHORIZED, "Invalid bearer token", field="Authorization", headers=_CHALLENGE)

    return check
