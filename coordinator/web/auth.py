"""Who may see the web view: the API's own token, carried by a cookie.

A browser cannot add `Authorization: Bearer` to a page load or an EventSource,
so the operator signs in once with SUBQ_API_TOKEN on /ui/login and gets a
session cookie. The cookie holds an HMAC of the token, never the token itself:
a copied cookie does not reveal the credential of the /v1 API, and changing
SUBQ_API_TOKEN signs every browser out. With SUBQ_API_AUTH_DISABLED=true the
view is open, as the API is.

Cross-site requests: the cookie is SameSite=Strict and HttpOnly, and every
action (approve, deny, cancel) is a POST with a JSON body, which an HTML form
on another site cannot send without a CORS preflight that this server never
grants.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from coordinator.settings import Settings

__all__ = ["COOKIE", "WebAuth"]

COOKIE = "subq_session"
# A label mixed into the HMAC, so the cookie's value is good for this purpose only.
_PURPOSE = b"subq web session v1"
# A day: an operator's working session; signing in again costs one paste of the token.
SESSION_MAX_AGE_S = 24 * 3600


class WebAuth:
    """Checks the session cookie against SUBQ_API_TOKEN (or lets everyone in when auth is disabled)."""

    def __init__(self, settings: Settings) -> None:
        token = settings.api_token.get_secret_value() if settings.api_token is not None else ""
        self.disabled = settings.api_auth_disabled
        self._token = token.encode()
        self._session = hmac.new(self._token, _PURPOSE, hashlib.sha256).hexdigest() if token else ""

    def token_matches(self, candidate: str) -> bool:
        # Constant time: a wrong guess must not tell how much of it was right.
        return bool(self._token) and hmac.compare_digest(candidate.strip().encode(), self._token)

    def session_value(self) -> str:
        return self._session

    def signed_in(self, request: Request) -> bool:
        if self.disabled:
            return True
        cookie = request.cookies.get(COOKIE, "")
        return bool(self._session) and hmac.compare_digest(cookie.encode(), self._session.encode())
