"""`create_app`: the subq HTTP API as a FastAPI application.

    uvicorn --factory coordinator.api:create_app      (or `subq api`)

Built on the same Coordinator as the CLI and the Python API. The layers, from
the outside in: a trusted proxy's forwarded address and scheme (only from
SUBQ_API_TRUSTED_PROXIES), the security headers (coordinator/api/security.py),
the rate limit of the open routes (429), the body-size limit (413 before
parsing), routing, the bearer token (a dependency of the /v1 routes; wrong
ones are rate limited), request validation (422), then the Coordinator, which
validates everything again before it writes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import Depends, FastAPI
from fastapi_offline import FastAPIOffline
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from coordinator.api.audit import audit_routes
from coordinator.api.auth import GuardFirst, bearer_auth, key_ring
from coordinator.api.control import control_routes
from coordinator.api.errors import install_error_handlers
from coordinator.api.events import event_routes
from coordinator.api.limits import BodyLimit, OpenRouteLimit, RateLimiter
from coordinator.api.mcp import install_mcp
from coordinator.api.ops import ops_routes
from coordinator.api.routes import reject_unknown_query, task_routes
from coordinator.api.security import LocalHostsOnly, SecurityHeaders
from coordinator.redis_clients import password_warning
from coordinator.service import Coordinator
from coordinator.settings import Settings, load_settings
from coordinator.web import install_web

__all__ = ["DOCS_ASSETS_URL", "create_app"]

# Where the API serves the Swagger UI and ReDoc scripts and styles (fastapi-offline's default path).
DOCS_ASSETS_URL = "/static-offline-docs"

DESCRIPTION = """\
A distributed job queue for AI subagents on Celery and Redis.

Authenticate the `/v1` endpoints with `Authorization: Bearer <token>`: an API key's token (each key
has scopes; a missing one answers 403 naming it), or SUBQ_API_TOKEN (every scope);
`/livez`, `/readyz`, `/healthz`, `/metrics`, `/openapi.json`, `/docs` and `/redoc` are open
(rate limited per client address). Every error is `{"code", "message", "field"}`. See docs/api.md.
"""


def _version() -> str:
    try:
        return version("subagent-queue")
    except PackageNotFoundError:  # running from a source checkout
        return "0.0.0+source"


def create_app(settings: Settings | None = None, coordinator: Coordinator | None = None) -> FastAPI:
    """The API over `coordinator` (built from `settings`, or SUBQ_* variables, when not given).

    Raises ConfigError naming SUBQ_API_TOKEN when no token is set and auth is not
    explicitly disabled (SUBQ_API_AUTH_DISABLED=true), so a server never starts open by accident.
    """
    if settings is None:
        settings = coordinator.settings if coordinator is not None else load_settings()
    # Sign-ins and wrong bearer tokens share one count per client address.
    auth_attempts = RateLimiter(settings.api_auth_attempts_per_min)
    ring = key_ring(settings)  # before anything connects: no token and no key stops the start
    owned = coordinator is None
    coord = coordinator if coordinator is not None else Coordinator(settings)
    guard = bearer_auth(settings, auth_attempts, coord, ring)
    auth_on = ring is not None
    if (unprotected := password_warning(settings)) is not None:
        # Beside bearer_auth's warning when auth is off: a Redis without a password takes orders from
        # anything that reaches it, a sandboxed command allowed the network included (issue 39).
        logging.getLogger("coordinator.api").warning("subq api: warning: %s", unprotected)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if owned:  # a Coordinator passed in belongs to the caller
            coord.close()

    # Swagger UI and ReDoc from files the fastapi-offline package ships, served under
    # DOCS_ASSETS_URL: FastAPI's own pages load them from a CDN, and /docs was blank
    # on a host without internet (issue 12).
    app = FastAPIOffline(
        title="subq",
        version=_version(),
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url="/redoc",
        static_url=DOCS_ASSETS_URL,
        # Swagger UI would otherwise load a validity badge from swagger.io's online validator.
        swagger_ui_parameters={"validatorUrl": None},
    )
    install_error_handlers(app)
    # Added innermost first: each add_middleware wraps the ones before it.
    app.add_middleware(GuardFirst, guard=guard, auth=auth_on)
    app.add_middleware(BodyLimit, max_body_bytes=settings.api_max_body_bytes)
    app.add_middleware(OpenRouteLimit, limiter=RateLimiter(settings.api_open_requests_per_min))
    app.add_middleware(SecurityHeaders, https=settings.api_https)
    if not auth_on:
        app.add_middleware(LocalHostsOnly)
    if proxies := settings.trusted_proxy_networks():
        # uvicorn's own parser of X-Forwarded-For/-Proto, believed from these peers only.
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=[str(network) for network in proxies])
    # The token first: an anonymous caller learns nothing about the parameters.
    dependencies = [Depends(guard), Depends(reject_unknown_query)]
    app.include_router(task_routes(coord, auth=auth_on), dependencies=dependencies)
    app.include_router(event_routes(coord, auth=auth_on), dependencies=dependencies)
    app.include_router(control_routes(coord, auth=auth_on), dependencies=dependencies)
    app.include_router(audit_routes(coord, auth=auth_on), dependencies=dependencies)
    app.include_router(ops_routes(coord))
    install_web(app, coord, settings, auth_attempts)  # /ui: the operator's view in a browser (docs/web.md)
    install_mcp(app, coord, guard, auth=auth_on)  # /mcp: subq as an MCP server, under the same keys (docs/mcp.md)
    return app
