"""The web view's sign-in sessions: one random id per sign-in, held server-side.

The store's `sessions` part: only the web view uses it (as `Coordinator.sessions`),
and it reads only the client and the keys. The cookie carries the session id; Redis
keeps only its SHA-256 (someone who can read Redis cannot sign in with what
they read) and, as the value, the name of the API key the session was made
with and that key's fingerprint, so a key removed or given a new token ends
every session made with it.
"""

from __future__ import annotations

import hashlib

from coordinator.store.base import Part, translate_redis_errors

__all__ = ["WebSessions"]

# Between the key's name and its fingerprint in the stored value; a key name holds no ':'.
_SEPARATOR = ":"


def _id_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class WebSessions(Part):
    """Sign-in sessions in Redis: `store.sessions`, `WebSessions(core)`."""

    @translate_redis_errors
    def open(self, session_id: str, key_name: str, fingerprint: str, max_age_s: int) -> None:
        """Record a new session made with the key `key_name` (of `fingerprint`), for `max_age_s`."""
        value = f"{key_name}{_SEPARATOR}{fingerprint}"
        self.client.set(self.keys.web_session(_id_hash(session_id)), value, ex=max_age_s)

    @translate_redis_errors
    def get(self, session_id: str) -> tuple[str, str] | None:
        """(key name, fingerprint) of a live session, or None."""
        stored = self.client.get(self.keys.web_session(_id_hash(session_id)))
        if isinstance(stored, bytes):
            stored = stored.decode("utf-8", "replace")
        if not isinstance(stored, str) or _SEPARATOR not in stored:
            return None  # gone, or made before sessions named their key: sign in again
        name, _, fingerprint = stored.rpartition(_SEPARATOR)
        return name, fingerprint

    @translate_redis_errors
    def close(self, session_id: str) -> None:
        """Revoke the session (sign-out); closing an unknown one changes nothing."""
        self.client.delete(self.keys.web_session(_id_hash(session_id)))
