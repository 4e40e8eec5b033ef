"""GET /v1/tasks/{task_id}/events: the tree's event stream as server-sent events.

Each entry of the tree's Redis stream (`delegated`, `child_applied`,
`task_status`, `batch_done`, ...) becomes one SSE event whose `id` is the
stream entry id and whose `data` is the entry's fields as JSON. A client that
reconnects with `Last-Event-ID` resumes after that entry.

The stream ends once the task has settled, by `Coordinator.wait`'s rule
(terminal; or, for a caller-owned task, no longer `delegated`), after every
event written before that is sent, and, after a stop, once no run of its
subtree may still record spend (`StopHold` over `Coordinator.finishing_runs`: a
run a stop cut off records what its provider billed after the stop, "late
spend"; held at most a heartbeat lapse, the subtree walked once);
a last `end` event carries the status, and the figures read after it are final.
A keep-alive comment goes out every KEEPALIVE_S so proxies keep the connection.

The key is checked again on each pass of the read loop (about once a READ_SLICE_MS
while the tree is quiet), before anything read in that pass is sent: a key revoked,
or no longer allowed to read the tree, while the stream is open is sent no event
written after that, and the stream ends with an `error` event (`unauthorized`).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Annotated, Any

import anyio
import anyio.to_thread
from anyio import CapacityLimiter
from fastapi import APIRouter, Header, Request
from sse_starlette import EventSourceResponse, ServerSentEvent

from coordinator import ids
from coordinator.api.auth import Caller, Gate
from coordinator.api.errors import UNAUTHORIZED, error_responses
from coordinator.api.routes import TaskId
from coordinator.api.schemas import ErrorBody
from coordinator.errors import SubqError, ValidationError
from coordinator.models import StopHold, TaskStatus
from coordinator.service import Coordinator
from coordinator.text import MAX_STREAM_ID_PART, stream_id

__all__ = [
    "KEEPALIVE_S",
    "KEY_REVOKED",
    "READ_SLICE_MS",
    "StreamThreads",
    "check_event_id",
    "event_routes",
    "tree_events",
]

# Proxies commonly close a connection idle for 30-60 s; a comment every 15 s keeps it open.
KEEPALIVE_S = 15.0
# One blocking read of the stream; between reads the task's status is checked again.
READ_SLICE_MS = 1000
READ_BATCH = 500
# Stream reads block a thread for up to READ_SLICE_MS. They get their own pool, so
# many open streams cannot starve the request handlers of FastAPI's pool (40 threads).
STREAM_THREADS = 64
STREAM_ID_PATTERN = r"^\d+-\d+$"

# How a stream ends when its key was revoked, or may no longer read the tree, while it was open.
KEY_REVOKED = ErrorBody(
    code=UNAUTHORIZED,
    message="The API key this stream was opened with was revoked, or may no longer read this tree: the stream ends",
    field="Authorization",
)

# One SSE event (OpenAPI before 3.2 describes each event of a stream with `schema`).
EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "id": {"type": "string", "pattern": STREAM_ID_PATTERN, "description": "The stream entry's id"},
        "event": {
            "type": "string",
            "enum": ["end", "error"],
            "description": "Absent for stream entries; `end` last, `error` if the stream failed or its key was revoked",
        },
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"type": "object"},
            "description": "The entry's fields; for `end` {task_id, status}; for `error` {code, message, field}",
        },
    },
}


class StreamThreads:
    """Runs blocking store reads in this app's own stream thread pool."""

    def __init__(self) -> None:
        self._limiter: CapacityLimiter | None = None

    async def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._limiter is None:  # built inside the app's event loop, as anyio requires
            self._limiter = CapacityLimiter(STREAM_THREADS)
        return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), limiter=self._limiter)


async def tree_events(
    coord: Coordinator,
    threads: StreamThreads,
    task_id: str,
    after_id: str,
    still_allowed: Callable[[], bool],
    revoked: ErrorBody = KEY_REVOKED,
) -> AsyncIterator[ServerSentEvent]:
    """The SSE events of the task's tree after `after_id`, ending once the task settles (also the web view's).

    `still_allowed` says whether the caller may still read the tree (its key, or its web session, as it is
    now); when it says no, the stream ends with `revoked` as an `error` event.
    """
    root_id = ids.root_of(task_id)
    hold: StopHold | None = None  # once settled after a stop: its stopped runs that may still record spend
    try:
        while True:
            # Status first, then the stream: a settling write and its event are one
            # atomic step, so once `done` is seen every event before it is in the stream.
            done, status = await threads.run(coord.settled, task_id)
            if not done:
                hold = None  # retried meanwhile: a later stop waits for its runs again
            entries: list[tuple[str, dict[str, str]]] = await threads.run(
                coord.read_events,
                root_id,
                after_id,
                block_ms=None if done else READ_SLICE_MS,  # None: no BLOCK (0 would block forever)
                count=READ_BATCH,
            )
            # After the read, before sending it: what the read returned was written before this check, so a
            # key revoked meanwhile is sent nothing written after its revocation. Once a pass, not per event.
            if not await threads.run(still_allowed):
                yield ServerSentEvent(event="error", data=revoked.model_dump_json())
                return
            for entry_id, fields in entries:
                yield ServerSentEvent(id=entry_id, data=json.dumps(fields))
                after_id = entry_id
            if done and len(entries) < READ_BATCH:
                # A look at a time, holding no thread between: what is written meanwhile still goes before `end`.
                if TaskStatus(status).stopped:
                    hold = hold or StopHold(math.inf)
                    if hold.due() and hold.holds(
                        await threads.run(partial(coord.finishing_runs, task_id, among=hold.among))
                    ):
                        await anyio.sleep(hold.look_in_s())
                        continue
                yield ServerSentEvent(event="end", data=json.dumps({"task_id": task_id, "status": status}))
                return
    except SubqError as exc:  # Redis went away or the task expired mid-stream
        body = ErrorBody(code=exc.code, message=exc.message, field=exc.field)
        yield ServerSentEvent(event="error", data=body.model_dump_json())


def check_event_id(last_event_id: str | None) -> None:
    """Refuse (422) a `Last-Event-ID` that is no stream id Redis reads. Checked before a stream's response starts:
    past what Redis reads, the stream's first event said Redis failed, which a client retries for good."""
    if last_event_id is not None and not stream_id(last_event_id):
        raise ValidationError(
            f"last-event-id must be an event id as <ms>-<n>, each part at most {MAX_STREAM_ID_PART}",
            field="last-event-id",
        )


def event_routes(coord: Coordinator, *, auth: bool) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["events"])
    denied = (401, 403) if auth else ()
    threads = StreamThreads()
    gate = Gate(coord)

    @router.get(
        "/tasks/{task_id}/events",
        response_class=EventSourceResponse,
        responses={
            200: {
                "description": "text/event-stream: one event per stream entry (`id`: entry id, `data`: JSON fields), "
                "then `event: end` with the task's status",
                "content": {"text/event-stream": {"schema": EVENT_SCHEMA}},
            },
            **error_responses(*denied, 404, 422, 503),
        },
        summary="Live events of the task's tree (server-sent events)",
    )
    async def events(
        request: Request,
        key: Caller,
        task_id: TaskId,
        last_event_id: Annotated[
            str | None,
            Header(pattern=STREAM_ID_PATTERN, description="Resume after this event id (sent by EventSource)"),
        ] = None,
    ) -> EventSourceResponse:
        check_event_id(last_event_id)
        owner = await threads.run(gate.read_tree, request, key, task_id)
        await threads.run(coord.settled, task_id)
        still_allowed = partial(gate.still_reads, request, owner)
        stream = tree_events(coord, threads, task_id, last_event_id or "0-0", still_allowed)
        return EventSourceResponse(stream, ping=KEEPALIVE_S)

    return router
