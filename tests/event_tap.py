"""Celery's event messages as Redis carries them: one entry per PUBLISH, with the events it held.

Celery's event receiver (and so Flower) reads a `task.multi` message event by
event, so counting events never shows how many messages carried them; this tap
subscribes to the event exchange's channels itself and keeps each message whole.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

__all__ = ["EventMessage", "EventTap"]

# kombu's Redis transport publishes the `celeryev` exchange's messages on channels named after it.
EVENT_CHANNELS = "*celeryev*"
POLL_S = 0.05


@dataclass(frozen=True)
class EventMessage:
    routing_key: str  # `task.multi` for a list of events, `task.<type>` for one published alone
    events: list[dict[str, Any]]
    received_at: float  # time.time() in the tap when the message came


class EventTap:
    """Every event message published while it is open, in order (a context manager)."""

    def __init__(self, redis_url: str) -> None:
        self._client = redis.Redis.from_url(redis_url)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="event-tap", daemon=True)
        self._lock = threading.Lock()
        self._messages: list[EventMessage] = []

    def __enter__(self) -> EventTap:
        self._pubsub.psubscribe(EVENT_CHANNELS)
        self._pubsub.get_message(timeout=1)  # the subscription is confirmed: nothing published from now is missed
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()
        self._client.close()

    @property
    def messages(self) -> list[EventMessage]:
        with self._lock:
            return list(self._messages)

    def events(self, type_: str, uuids: set[str] | list[str]) -> list[tuple[EventMessage, dict[str, Any]]]:
        """Each event of `type_` for one of the Celery ids, with the message that carried it."""
        wanted = set(uuids)
        return [(m, e) for m in self.messages for e in m.events if e.get("type") == type_ and e.get("uuid") in wanted]

    def _read(self) -> None:
        while not self._stop.is_set():
            raw = self._pubsub.get_message(timeout=POLL_S)
            if raw is not None and raw["type"] == "pmessage":
                message = _decode(raw["data"])
                with self._lock:
                    self._messages.append(message)


def _decode(data: bytes) -> EventMessage:
    envelope = json.loads(data)
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    events = json.loads(body)
    routing_key = envelope["properties"]["delivery_info"]["routing_key"]
    return EventMessage(routing_key, events if isinstance(events, list) else [events], time.time())
