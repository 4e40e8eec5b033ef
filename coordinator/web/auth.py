"""Who may see the web view: a server-side session per sign-in, made with the API's token.

A browser cannot add `Authorization: Bearer` to a page load or an EventSource,
so the operator signs in once with SUBQ_API_TOKEN on /ui/login and gets a
session cookie: a random id, new at every sign-in, that names a session held
in Redis for a day (`Coordinator.sessions`). Signing out deletes it;
a changed SUBQ_API_TOKEN revokes every session, since each one records the
fingerprint (an HMAC) of the token it was made with, and a session made with
another token is refused. The cookie never holds the token or anything derived
from it. With SUBQ_API_AUTH_DISABLED=true the view is open, as the API is.

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

from coordinator.service import Coordinator
from coordinator.settings import Settings

__all__ = ["COOKIE", "SESSION_MAX_AGE_S", "WebAuth"]

COOKIE = "subq_session"
# The web view's own path (routes.WEB_PATH): the cookie goes to no other route.
COOKIE_PATH = "/ui"
# A label mixed into the HMAC, so the fingerprint is good for this purpose only.
_PURPOSE = b"subq web session v2"
# A day: an operator's working session; signing in again costs one paste of the token.
SESSION_MAX_AGE_S = 24 * 3600
# 32 random bytes: a session id nobody can guess.
SESSION_ID_BYTES = 32
# A real id is 43 characters; anything much longer is not one, and is not hashed.
MAX_COOKIE_CHARS = 128


class WebAuth:
    """Signs operators in and out, and checks a request's session (or lets everyone in when auth is disabled)."""

    def __init__(self, settings: Settings, coord: Coordinator) -> None:
        token = settings.api_token.get_secret_value() if settings.api_token is not None else ""
        self.disabled = settings.api_auth_disabled
        self.https = settings.api_https
        self.coord = coord
        self._token = token.encode()
        self._fingerprint = hmac.new(self._token, _PURPOSE, hashlib.sha256).hexdigest() if token else ""

    def token_matches(self, candidate: str) -> bool:
        # Constant time: a wrong guess must not tell how much of it was right.
        return bool(self._token) and hmac.compare_digest(candidate.strip().encode(), self._token)

    def sign_in(self, request: Request, response: Response) -> None:
        """Open a new session and set its cookie on `response` (the caller checked the token)."""
        session_id = secrets.token_urlsafe(SESSION_ID_BYTES)
        self.coord.sessions.open(session_id, self._fingerprint, SESSION_MAX_AGE_S)
        response.set_cookie(
            COOKIE,
            session_id,
            max_age=SESSION_MAX_AGE_S,
            path=COOKIE_PATH,
            httponly=True,
            samesite="strict",
            secure=self.https or request.url.scheme == "https",
        )

    def sign_out(self, request: Request, response: Response) -> None:
        """Revoke the request's session, whatever the browser does with the cookie, and clear it."""
        cookie = self._cookie(request)
        if cookie:
            self.coord.sessions.close(cookie)
        response.delete_cookie(COOKIE, path=COOKIE_PATH)

    def signed_in(self, request: Request) -> bool:
        if self.disabled:
            return True
        cookie = self._cookie(request)
        return bool(cookie and self._fingerprint) and self.coord.sessions.valid(cookie, self._fingerprint)

    @staticmethod
    def _cookie(request: Request) -> str:
        cookie = request.cookies.get(COOKIE, "")
        return cookie if len(cookie) <= MAX_COOKIE_CHARS else ""
