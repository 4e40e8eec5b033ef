"""subq's HTTP API (FastAPI): `create_app(settings=None, coordinator=None)`.

    uvicorn --factory coordinator.api:create_app      (or `subq api`)

    app.py      create_app: middleware, auth, routers
    routes.py   /v1/tasks...: create, delegate, read, todos, tree, messages, history
    events.py   /v1/tasks/{id}/events: the tree's event stream as server-sent events
    ops.py      /livez, /readyz, /healthz and /metrics (Prometheus), from caches
    auth.py     the bearer token (SUBQ_API_TOKEN), wrong ones rate limited
    limits.py   the request body limit (413 before parsing), per-address rate limits (429)
    security.py the security headers: CSP, frame and sniffing refusals, referrer, HSTS
    errors.py   one error shape {code, message, field} for everything
    schemas.py  the wire models, shared with coordinator.client

`create_app` is imported on first use, so `coordinator.client` can use the
wire models without loading the server's dependencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.api.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from coordinator.api.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
