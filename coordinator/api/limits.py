"""What one request, and one client address, may ask of the API.

`BodyLimit`: request bodies over `SUBQ_API_MAX_BODY_BYTES` get 413 before
anything parses them. A pure ASGI middleware: a declared `Content-Length` over
the limit is refused without reading a byte; otherwise the body is read up to
the limit (a chunked body declares no length) and replayed to the application,
so neither JSON decoding nor validation ever sees an oversize body.

`RateLimiter` and `OpenRouteLimit`: per client address, the routes that need no
token get `SUBQ_API_OPEN_REQUESTS_PER_MIN`, and sign-ins plus wrong bearer
tokens together get `SUBQ_API_AUTH_ATTEMPTS_PER_MIN`; past either, 429 with
`Retry-After`. The buckets live in this process: each API replica counts on
its own, so N replicas behind one balancer allow N times the rate (the figure
that matters, guessing a token, stays hopeless at 10 a minute a replica). The
client address is the connection's peer, or the address a proxy named in
`SUBQ_API_TRUSTED_PROXIES` forwarded (uvicorn's proxy-headers middleware, set
up in app.py, rewrites it before this runs).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.api.errors import BODY_TOO_LARGE, RATE_LIMITED, error_response
from coordinator.text import ascii_digits

__all__ = ["BodyLimit", "OpenRouteLimit", "RateLimiter", "client_address", "is_open_route", "retry_after"]

# Client addresses one limiter remembers; past it the least recently seen is forgotten
# (its bucket starts full again), so a flood from many addresses cannot grow memory.
MAX_TRACKED_CLIENTS = 50_000


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and ascii_digits(declared) and int(declared) > self.max_body_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            # The body once, then the real channel: a streaming response still hears the disconnect.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            BODY_TOO_LARGE,
            f"The request body is over {self.max_body_bytes} bytes (SUBQ_API_MAX_BODY_BYTES)",
        )
        await response(scope, receive, send)


def client_address(scope: Scope) -> str:
    """The client's address as the server saw it (after a trusted proxy's rewrite); "unknown" if none."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class RateLimiter:
    """A token bucket per client address: `per_min` requests a minute, in bursts of up to `per_min`."""

    def __init__(self, per_min: int, max_clients: int = MAX_TRACKED_CLIENTS) -> None:
        self.per_min = per_min
        self._refill_per_s = per_min / 60
        self._max_clients = max_clients
        # address -> (tokens left, when they were counted); most recently seen last.
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # Sync routes run in a thread pool; the middleware on the event loop.
        self._lock = threading.Lock()

    def _tokens(self, address: str, now_s: float) -> float:
        tokens, since_s = self._buckets.get(address, (float(self.per_min), now_s))
        return min(float(self.per_min), tokens + (now_s - since_s) * self._refill_per_s)

    def take(self, address: str, now_s: float | None = None) -> float:
        """Spend one request of `address`: 0 when allowed, else the seconds until one is."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            tokens = self._tokens(address, now_s)
            allowed = tokens >= 1
            self._buckets[address] = (tokens - 1 if allowed else tokens, now_s)
            self._buckets.move_to_end(address)
            while len(self._buckets) > self._max_clients:
                self._buckets.popitem(last=False)
        return 0.0 if allowed else (1 - tokens) / self._refill_per_s

    def wait_s(self, address: str, now_s: float | None = None) -> float:
        """Seconds until `address` may make one more request (0: now), spending nothing."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            tokens = self._tokens(address, now_s)
        return 0.0 if tokens >= 1 else (1 - tokens) / self._refill_per_s


def retry_after(wait_s: float) -> dict[str, str]:
    """The Retry-After header for a wait, in whole seconds (at least one)."""
    return {"Retry-After": str(max(1, math.ceil(wait_s)))}


def is_open_route(path: str) -> bool:
    """A route that answers without a token: everything but /v1, /mcp and the web view's signed-in pages."""
    if path == "/v1" or path.startswith("/v1/") or path == "/mcp":  # /mcp: the same bearer guard as /v1
        return False
    if path == "/ui" or path.startswith("/ui/"):
        return path == "/ui/login" or path.startswith("/ui/static/")
    return True


class OpenRouteLimit:
    """429 for a client address past its rate on the open routes (health, metrics, docs, sign-in page)."""

    def __init__(self, app: ASGIApp, limiter: RateLimiter) -> None:
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_open_route(scope["path"]):
            wait_s = self.limiter.take(client_address(scope))
            if wait_s:
                response = error_response(
                    429,
                    RATE_LIMITED,
                    f"Too many requests from this address to the routes without a token "
                    f"(SUBQ_API_OPEN_REQUESTS_PER_MIN={self.limiter.per_min}); retry in {math.ceil(wait_s)} s",
                    headers=retry_after(wait_s),
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
