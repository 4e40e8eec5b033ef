"""The web view's sign-in sessions: one random id per sign-in, held server-side.

The store's `sessions` part: only the web view uses it (as `Coordinator.sessions`),
and it reads only the client and the keys. The cookie carries the session id; Redis
keeps only its SHA-256 (someone who can read Redis cannot sign in with what
they read) and, as the value, the fingerprint of the API token the session was
made with, so a changed SUBQ_API_TOKEN revokes every session at once.
"""

from __future__ import annotations

import hashlib
import hmac

from coordinator.store.base import Part, translate_redis_errors

__all__ = ["WebSessions"]


def _id_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class WebSessions(Part):
    """Sign-in sessions in Redis: `store.sessions`, `WebSessions(core)`."""

    @translate_redis_errors
    def open(self, session_id: str, fingerprint: str, max_age_s: int) -> None:
        """Record a new session made with the token of `fingerprint`, for `max_age_s`."""
        self.client.set(self.keys.web_session(_id_hash(session_id)), fingerprint, ex=max_age_s)

    @translate_redis_errors
    def valid(self, session_id: str, fingerprint: str) -> bool:
        """True while the session exists and was made with the token of `fingerprint`."""
        stored = self.client.get(self.keys.web_session(_id_hash(session_id)))
        if not isinstance(stored, str | bytes):
            return False
        stored_bytes = stored.encode() if isinstance(stored, str) else stored
        return hmac.compare_digest(stored_bytes, fingerprint.encode())

    @translate_redis_errors
    def close(self, session_id: str) -> None:
        """Revoke the session (sign-out); closing an unknown one changes nothing."""
        self.client.delete(self.keys.web_session(_id_hash(session_id)))
