"""Security headers on every response: a strict Content-Security-Policy and its companions.

The web view's pages carry text a model wrote (plan items, tool arguments,
replies). Templates escape every value for the context it lands in; the policy
is the second wall, so that a value that ever slipped through still could not
run: no inline script, no inline style, no plugin, nothing fetched from another
origin, no framing (clickjacking an Approve button), no form posting elsewhere.

| header                      | value                                                            |
|-----------------------------|------------------------------------------------------------------|
| Content-Security-Policy     | `STRICT_CSP`; on /docs and /redoc (Swagger UI and ReDoc, which   |
|                             | ship one inline script and inline styles) the hash of each inline |
|                             | script is allowed, never `unsafe-inline` script                  |
| X-Frame-Options             | DENY (the older form of `frame-ancestors 'none'`)                |
| X-Content-Type-Options      | nosniff                                                          |
| Referrer-Policy             | same-origin                                                      |
| Cache-Control               | no-store, on the web view's pages (they show task data)          |
| Strict-Transport-Security   | with SUBQ_API_HTTPS=true only                                    |

`LocalHostsOnly` guards a server run with SUBQ_API_AUTH_DISABLED=true, which is for
a trusted local machine: any web page the machine's browser opens could otherwise
drive it by DNS rebinding (its own name made to resolve to 127.0.0.1, so the
browser sends the page's requests, submits and approvals included, to subq as
same-origin ones). Such a request names the page's host in `Host`; one addressed
to an IP address or to `localhost` cannot come from a rebound name.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.api.errors import error_response

__all__ = ["DOCS_CSP_PATHS", "STRICT_CSP", "LocalHostsOnly", "SecurityHeaders", "csp_with_inline_scripts"]

STRICT_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
# The API's documentation pages, whose HTML comes from fastapi-offline with inline parts.
DOCS_CSP_PATHS = frozenset({"/docs", "/redoc", "/docs/oauth2-redirect"})
# A year: the usual HSTS age once a deployment has committed to https.
HSTS_MAX_AGE_S = 365 * 24 * 3600
_INLINE_SCRIPT = re.compile(rb"<script>(.*?)</script>", re.DOTALL)
_WEB_PAGES = "/ui"


def csp_with_inline_scripts(html: bytes) -> str:
    """The policy for a documentation page: its own inline scripts by hash; styles inline (ReDoc injects them)."""
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(script).digest()).decode()}'"
        for script in _INLINE_SCRIPT.findall(html)
    )
    return (
        f"default-src 'none'; script-src 'self' {hashes}; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; font-src 'self'; worker-src 'self' blob:; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    )


class SecurityHeaders:
    """Adds the headers above to every HTTP response (a pure ASGI middleware: streams pass through)."""

    def __init__(self, app: ASGIApp, https: bool = False) -> None:
        self.app = app
        self.https = https

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in DOCS_CSP_PATHS:
            await self._docs_page(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._add(MutableHeaders(scope=message), path, STRICT_CSP)
            await send(message)

        await self.app(scope, receive, send_with_headers)

    async def _docs_page(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Hold the (small) page back to hash its inline scripts into the policy."""
        start: Message | None = None
        body: list[bytes] = []

        async def hold(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                assert start is not None
                page = b"".join(body)
                headers = MutableHeaders(scope=start)
                self._add(headers, scope["path"], csp_with_inline_scripts(page))
                headers["content-length"] = str(len(page))
                await send(start)
                await send({"type": "http.response.body", "body": page})
                return
            await send(message)

        await self.app(scope, receive, hold)

    def _add(self, headers: MutableHeaders, path: str, csp: str) -> None:
        headers["Content-Security-Policy"] = csp
        headers["X-Frame-Options"] = "DENY"
        headers["X-Content-Type-Options"] = "nosniff"
        headers["Referrer-Policy"] = "same-origin"
        if path.startswith(f"{_WEB_PAGES}/") and not path.startswith(f"{_WEB_PAGES}/static/"):
            headers["Cache-Control"] = "no-store"
        if self.https:
            headers["Strict-Transport-Security"] = f"max-age={HSTS_MAX_AGE_S}"


def addressed_locally(host: str) -> bool:
    """Whether a `Host` header (`name[:port]`, `[v6]:port`) names an IP address or localhost: no DNS name that
    a web page could rebind. An absent one (HTTP/1.0) is local: a browser always sends it."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if not name or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class LocalHostsOnly:
    """403 for a request addressed by a DNS name other than localhost (with auth disabled: see above)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not addressed_locally(host):
                response = error_response(
                    403,
                    "forbidden",
                    f"SUBQ_API_AUTH_DISABLED=true: this server answers requests addressed to an IP address or "
                    f"localhost only, not to the name {host[:100]!r} (a web page could rebind a name to it); "
                    "use http://127.0.0.1:<port>, or turn authentication on to serve it by name",
                    field="Host",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
