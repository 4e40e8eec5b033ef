"""Bearer-token authentication for the /v1 endpoints.

The token is `SUBQ_API_TOKEN`. Authentication is off only when
`SUBQ_API_AUTH_DISABLED=true` says so, and then the server logs a warning at
start; with neither setting, building the app fails with a ConfigError naming
SUBQ_API_TOKEN, so a server is never open by accident. `/healthz`,
`/metrics`, `/openapi.json` and `/docs` stay open: they carry no task data.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from coordinator.api.errors import UNAUTHORIZED, HttpError
from coordinator.errors import ConfigError
from coordinator.settings import Settings

__all__ = ["AUTH_DISABLED_WARNING", "bearer_auth"]

logger = logging.getLogger("coordinator.api")

AUTH_DISABLED_WARNING = (
    "SUBQ_API_AUTH_DISABLED=true: the subq API accepts requests WITHOUT authentication; "
    "anyone who can reach it can create, read and delegate tasks. Set SUBQ_API_TOKEN instead outside development."
)
_CHALLENGE = {"WWW-Authenticate": "Bearer"}

Guard = Callable[..., Awaitable[None]]


def bearer_auth(settings: Settings) -> Guard | None:
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
    async def check(credentials: HTTPAuthorizationCredentials | None = Security(scheme)) -> None:
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
            raise HttpError(401, UNAUTHORIZED, "Invalid bearer token", field="Authorization", headers=_CHALLENGE)

    return check
