"""A task tree's event stream: server-sent events (the WHATWG event-stream format), line by line."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from coordinator.client.errors import ApiError, error_from

__all__ = ["Event", "SseParser"]


class Event(BaseModel):
    """One server-sent event of a task tree's stream.

    `event` is `message` for a stream entry (`data` holds its fields: `type`,
    `task_id`, ...), and `end` for the last one (`data`: `task_id`, `status`).
    """

    model_config = ConfigDict(frozen=True)

    id: str | None
    event: str
    data: dict[str, Any]


class SseParser:
    """Feed it the stream's lines; it returns an Event when a blank line ends one."""

    def __init__(self) -> None:
        self._id: str | None = None
        self._event = "message"
        self._data: list[str] = []

    def feed(self, line: str) -> Event | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):  # a keep-alive comment
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        return None

    def _dispatch(self) -> Event | None:
        if not self._data:
            self._event = "message"
            return None
        raw = "\n".join(self._data)
        event, self._event, self._data = self._event, "message", []
        try:
            data = json.loads(raw)
        except ValueError:
            raise ApiError(f"An event of the stream is not JSON: {raw[:200]}", code="bad_response") from None
        if event == "error":  # the server hit an error mid-stream (Redis went away)
            raise error_from(data, None, f"The event stream failed: {raw[:200]}")
        return Event(id=self._id, event=event, data=data)
