"""Who may see the web view, and as which key: a server-side session per sign-in.

A browser cannot add `Authorization: Bearer` to a page load or an EventSource,
so the operator signs in once on /ui/login with the token of any API key (or
SUBQ_API_TOKEN, the key `admin`) and gets a session cookie: a random id, new at
every sign-in, that names a session held in Redis for a day
(`Coordinator.sessions`). The session records the key's name and its
fingerprint (an HMAC of the key's token hash); every request looks the key up
again (coordinator/access.py), so a key removed from the keys file, or given a
new token, ends its sessions at once, and the view shows and offers only what
the key's scopes allow. Signing out deletes the session. The cookie never
holds the token or anything derived from it. With SUBQ_API_AUTH_DISABLED=true
the view is open, as the API is.

The cookie is HttpOnly and SameSite=Strict, and Secure whenever the request
came over https: directly, through a proxy named in SUBQ_API_TRUSTED_PROXIES
(its X-Forwarded-Proto), or always with SUBQ_API_HTTPS=true (TLS ends at an
ingress the server cannot see). Every action (approve, deny, cancel) is a POST
with a JSON body, which an HTML form on another site cannot send without a CORS
preflight that this server never grants.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from fastapi import Request
from fastapi.responses import Response

from coordinator.access import OPEN, ApiKey, Principal
from coordinator.api.auth import key_ring
from coordinator.service import Coordinator
from coordinator.settings import Settings

__all__ = ["COOKIE", "SESSION_MAX_AGE_S", "WebAuth"]

COOKIE = "subq_session"
# The web view's own path (routes.WEB_PATH): the cookie goes to no other route.
COOKIE_PATH = "/ui"
# A label mixed into the HMAC, so the fingerprint is good for this purpose only.
_PURPOSE = b"subq web session v3"
# A day: an operator's working session; signing in again costs one paste of the token.
SESSION_MAX_AGE_S = 24 * 3600
# 32 random bytes: a session id nobody can guess.
SESSION_ID_BYTES = 32
# A real id is 43 characters; anything much longer is not one, and is not hashed.
MAX_COOKIE_CHARS = 128
# A token longer than this is no key's: it is not hashed.
MAX_TOKEN_CHARS = 4096


def _fingerprint(key: ApiKey) -> str:
    return hmac.new(key.token_sha256.encode(), _PURPOSE, hashlib.sha256).hexdigest()


class WebAuth:
    """Signs operators in and out, and names the key of a request's session (everyone, when auth is disabled)."""

    def __init__(self, settings: Settings, coord: Coordinator) -> None:
        self.ring = key_ring(settings)
        self.disabled = self.ring is None
        self.https = settings.api_https
        self.coord = coord

    def key_of_token(self, candidate: str) -> ApiKey | None:
        """The key whose token this is (compared by SHA-256, as the API compares it), or None."""
        candidate = candidate.strip()
        if self.ring is None or not candidate or len(candidate) > MAX_TOKEN_CHARS:
            return None
        return self.ring.find(candidate)

    def sign_in(self, request: Request, response: Response, key: ApiKey) -> None:
        """Open a new session for `key` and set its cookie on `response` (the caller checked the token)."""
        session_id = secrets.token_urlsafe(SESSION_ID_BYTES)
        self.coord.sessions.open(session_id, key.name, _fingerprint(key), SESSION_MAX_AGE_S)
        response.set_cookie(
            COOKIE,
            session_id,
            max_age=SESSION_MAX_AGE_S,
            path=COOKIE_PATH,
            httponly=True,
            samesite="strict",
            secure=self.https or request.url.scheme == "https",
        )

    def sign_out(self, request: Request, response: Response) -> Principal | None:
        """Revoke the request's session, whatever the browser does with the cookie, and clear it; whose it was."""
        key = self.principal(request)
        cookie = self._cookie(request)
        if cookie:
            self.coord.sessions.close(cookie)
        response.delete_cookie(COOKIE, path=COOKIE_PATH)
        return key

    def principal(self, request: Request) -> Principal | None:
        """The key the request's session was made with, while that key still exists unchanged; else None."""
        if self.ring is None:
            return OPEN
        cookie = self._cookie(request)
        if not cookie:
            return None
        session = self.coord.sessions.get(cookie)
        if session is None:
            return None
        name, fingerprint = session
        key = self.ring.named(name)
        if key is None or not hmac.compare_digest(fingerprint.encode(), _fingerprint(key).encode()):
            return None
        return Principal(key.name, key.scopes, tenant=key.tenant or key.name)

    def signed_in(self, request: Request) -> bool:
        return self.principal(request) is not None

    @staticmethod
    def _cookie(request: Request) -> str:
        cookie = request.cookies.get(COOKIE, "")
        return cookie if len(cookie) <= MAX_COOKIE_CHARS else ""
