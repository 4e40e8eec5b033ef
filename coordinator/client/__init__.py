"""A Python client for the subq HTTP API: `SubqClient` (sync) and `AsyncSubqClient` (async).

    from coordinator.client import SubqClient
    from coordinator.errors import NotFoundError

    with SubqClient("http://subq.internal:8000", token="...") as subq:
        parent = subq.create_task("Prepare the Q3 report", todos="[ ] Collect figures\\n[ ] Summarise")
        subq.delegate(parent.id, [{"description": "Collect figures", "message": "..."}])
        subq.wait(parent.id, timeout_s=300)
        for item in subq.get_todos(parent.id):
            print(item.content, item.tokens, item.cost_micros)

Results are the domain's own pydantic models (`TaskRecord`, `TodoItem`,
`HistoryItem`, `TreeNode`) and the API's (`DelegationResult`, `Health`). An
error response becomes the SubqError subclass of its `code`, with its
message and field, so `except NotFoundError` works across HTTP as it does in
process. Codes that only HTTP has (`unauthorized`, `body_too_large`, ...) and
transport failures raise `ApiError` (a SubqError), `AuthError` for 401.

    calls.py         every operation described once: request, answer, `wait`'s polling
    sync_client.py   SubqClient: sends the calls with httpx.Client
    async_client.py  AsyncSubqClient: the same calls with httpx.AsyncClient
    sse.py           the event stream's parser and `Event`
    errors.py        ApiError, AuthError, and error responses as SubqErrors

Importing this package loads httpx, pydantic and subq's models only: no Celery,
kombu, redis-py, pydantic-settings or server (tests/test_light_imports.py).
"""

from __future__ import annotations

from coordinator.api.schemas import DelegationResult, Health
from coordinator.client.async_client import AsyncSubqClient
from coordinator.client.calls import DEFAULT_TIMEOUT_S
from coordinator.client.errors import ApiError, AuthError
from coordinator.client.sse import Event
from coordinator.client.sync_client import SubqClient

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ApiError",
    "AsyncSubqClient",
    "AuthError",
    "DelegationResult",
    "Event",
    "Health",
    "SubqClient",
]
