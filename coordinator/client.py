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

Both clients share every request and response rule: each operation is
described once, as a `_Call` (or, for `wait`, a generator of calls and
sleeps), and the two classes only differ in how they send and sleep.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from importlib.metadata import PackageNotFoundError, version
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar
from urllib.parse import quote

import httpx
import pydantic
from pydantic import BaseModel, ConfigDict, TypeAdapter

from coordinator import errors as error_tree
from coordinator.api.schemas import (
    ApprovalList,
    DelegationResult,
    Health,
    HistoryPage,
    MessageList,
    Snapshot,
    TodoList,
)
from coordinator.errors import SubqError, ValidationError, WaitTimeout
from coordinator.models import (
    Approval,
    DelegationMode,
    HistoryItem,
    LiveState,
    SubtaskSpec,
    TaskRecord,
    TaskStatus,
    TodoItem,
)
from coordinator.tree import TreeNode

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

# Every endpoint but the event stream answers within a Redis round trip or two;
# 30 s leaves room for a busy server without hanging a caller for minutes.
DEFAULT_TIMEOUT_S = 30.0
# The event stream is idle between events, with a keep-alive every 15 s: three
# missed keep-alives mean the connection is dead.
STREAM_READ_TIMEOUT_S = 45.0
# wait() polls GET /v1/tasks/{id}: quickly at first (short subtasks), then at
# most once a second, so a long wait costs one small request a second.
POLL_FIRST_S = 0.1
POLL_MAX_S = 1.0
POLL_GROWTH = 1.5

T = TypeVar("T")


class ApiError(SubqError):
    """An error response whose code has no class in coordinator.errors, or no usable response at all.

    `code` is the server's code (`unauthorized`, `body_too_large`, `internal_error`, ...),
    or `api_unreachable` / `bad_response` when the client could not get a valid answer.
    """

    code = "api_error"

    def __init__(
        self, message: str, *, field: str | None = None, code: str | None = None, status_code: int | None = None
    ) -> None:
        super().__init__(message, field=field)
        if code is not None:
            self.code = code
        self.status_code = status_code


class AuthError(ApiError):
    """401: the token is missing or wrong."""

    code = "unauthorized"


class Event(BaseModel):
    """One server-sent event of a task tree's stream.

    `event` is `message` for a stream entry (`data` holds its fields: `type`,
    `task_id`, ...), and `end` for the last one (`data`: `task_id`, `status`).
    """

    model_config = ConfigDict(frozen=True)

    id: str | None
    event: str
    data: dict[str, Any]


# -- one description of each operation ---------------------------------------------------


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One request and how to read its answer."""

    method: str
    path: str
    parse: TypeAdapter[Any]
    # From the parsed body to the result, when the result is a part of it (a page's items).
    unwrap: Callable[[Any], Any] | None = None
    json: Any = None
    params: Mapping[str, str | int] = field(default_factory=dict)
    # Statuses whose body is the result's shape (the health check answers 503 with a Health).
    ok: tuple[int, ...] = (200,)


@dataclass(frozen=True)
class _Sleep:
    seconds: float


_TASK = TypeAdapter(TaskRecord)
_TODOS = TypeAdapter(TodoList)
_BATCH = TypeAdapter(DelegationResult)
_TREE = TypeAdapter(TreeNode)
_MESSAGES = TypeAdapter(MessageList)
_HISTORY = TypeAdapter(HistoryPage)
_HEALTH = TypeAdapter(Health)
_SNAPSHOT = TypeAdapter(Snapshot)
_APPROVALS = TypeAdapter(ApprovalList)
_APPROVAL = TypeAdapter(Approval)


def _task_path(task_id: str, suffix: str = "") -> str:
    # Percent-encode the id: a malformed one ("a/b", "x?y") must reach the server as
    # an unknown id (404), not as another path or a query.
    return f"/v1/tasks/{quote(task_id, safe='')}{suffix}"


def _create_task(
    prompt: str, todos: object, profile: str | None, run: bool, budget_usd: Decimal | float | str | None
) -> _Call[TaskRecord]:
    body: dict[str, Any] = {"prompt": prompt, "run": run}
    if todos is not None:
        body["todos"] = todos
    if profile is not None:
        body["profile"] = profile
    if budget_usd is not None:
        body["budget_usd"] = str(budget_usd)  # a decimal string: money never goes through float here
    return _Call("POST", "/v1/tasks", _TASK, json=body, ok=(201,))


def _cancel(task_id: str, reason: str) -> _Call[TaskRecord]:
    return _Call("POST", _task_path(task_id, "/cancel"), _TASK, json={"reason": reason})


def _snapshot(root_id: str) -> _Call[dict[str, LiveState]]:
    return _Call("GET", _task_path(root_id, "/snapshot"), _SNAPSHOT, unwrap=lambda page: page.tasks)


def _list_approvals(root_id: str | None) -> _Call[list[Approval]]:
    params = {"root": root_id} if root_id is not None else {}
    return _Call("GET", "/v1/approvals", _APPROVALS, unwrap=lambda page: page.approvals, params=params)


def _decide(approval_id: str, decision: str, feedback: str | None) -> _Call[Approval]:
    body: dict[str, Any] = {"decision": decision}
    if feedback is not None:
        body["feedback"] = feedback
    return _Call("POST", f"/v1/approvals/{quote(approval_id, safe='')}", _APPROVAL, json=body)


def _delegate(
    task_id: str, subtasks: Sequence[SubtaskSpec | Mapping[str, Any]], mode: DelegationMode
) -> _Call[DelegationResult]:
    specs = [s.model_dump(mode="json", exclude_none=True) if isinstance(s, SubtaskSpec) else dict(s) for s in subtasks]
    return _Call("POST", _task_path(task_id, "/subtasks"), _BATCH, json={"mode": mode, "subtasks": specs}, ok=(202,))


def _get_todos(task_id: str) -> _Call[list[TodoItem]]:
    return _Call("GET", _task_path(task_id, "/todos"), _TODOS, unwrap=lambda page: page.todos)


def _update_todos(task_id: str, todos: str | Sequence[Mapping[str, Any]]) -> _Call[list[TodoItem]]:
    body = {"todos": todos if isinstance(todos, str) else [dict(item) for item in todos]}
    return _Call("PUT", _task_path(task_id, "/todos"), _TODOS, unwrap=lambda page: page.todos, json=body)


def _messages(task_id: str, kind: Literal["ui", "api"]) -> _Call[list[dict[str, Any]]]:
    return _Call(
        "GET", _task_path(task_id, "/messages"), _MESSAGES, unwrap=lambda page: page.messages, params={"kind": kind}
    )


def _list_tasks(
    status: TaskStatus | str | None, root_id: str | None, limit: int, cursor: int
) -> _Call[tuple[list[HistoryItem], int | None]]:
    params: dict[str, str | int] = {"limit": limit, "cursor": cursor}
    if status is not None:
        params["status"] = str(status.value if isinstance(status, TaskStatus) else status)
    if root_id is not None:
        params["root"] = root_id
    return _Call("GET", "/v1/tasks", _HISTORY, unwrap=lambda page: (page.items, page.next_cursor), params=params)


def _settled(record: TaskRecord) -> bool:
    """Coordinator.wait's rule: terminal, or a caller-owned task no longer `delegated`."""
    return record.status.terminal or (record.runner == "caller" and record.status != TaskStatus.DELEGATED)


def _wait(task_id: str, timeout_s: float) -> Generator[_Call[TaskRecord] | _Sleep, Any, TaskRecord]:
    """Poll the task until it settles: yields calls (answered with their result) and sleeps."""
    if timeout_s < 0:
        raise ValidationError("timeout_s must not be negative", field="timeout_s")
    deadline = time.monotonic() + timeout_s
    delay_s = POLL_FIRST_S
    while True:
        record: TaskRecord = yield _Call("GET", _task_path(task_id), _TASK)
        if _settled(record):
            return record
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise WaitTimeout(
                f"Task {task_id} is still {record.status.value} after {timeout_s:g}s "
                f"({len(record.awaiting_ids)} of {len(record.child_ids)} children outstanding)"
            )
        yield _Sleep(min(delay_s, remaining_s))
        delay_s = min(delay_s * POLL_GROWTH, POLL_MAX_S)


# -- reading answers -------------------------------------------------------------------------


def _error_classes() -> dict[str, type[SubqError]]:
    """code -> class for every error in coordinator.errors (its __all__ is the registry)."""
    classes = (getattr(error_tree, name) for name in error_tree.__all__)
    return {cls.code: cls for cls in classes if isinstance(cls, type) and issubclass(cls, SubqError)}


def _error_of(response: httpx.Response) -> SubqError:
    try:
        body = response.json()
    except ValueError:
        body = None
    return _error_from(body, response.status_code, f"HTTP {response.status_code}: {response.text[:200]}")


def _error_from(body: Any, status_code: int | None, fallback: str) -> SubqError:
    """The SubqError of an error body `{code, message, field}`."""
    if not isinstance(body, dict) or not isinstance(body.get("code"), str) or not isinstance(body.get("message"), str):
        return ApiError(fallback, code="bad_response", status_code=status_code)
    code, message = body["code"], body["message"]
    where = str(body["field"]) if body.get("field") is not None else None
    if status_code == 401:
        return AuthError(message, field=where, code=code, status_code=status_code)
    cls = _error_classes().get(code)
    if cls is None:
        return ApiError(message, field=where, code=code, status_code=status_code)
    return cls(message, field=where)


def _result(call: _Call[T], response: httpx.Response) -> T:
    if response.status_code not in call.ok:
        raise _error_of(response)
    try:
        parsed = call.parse.validate_json(response.content)
    except pydantic.ValidationError as exc:
        raise ApiError(
            f"The server's answer to {call.method} {call.path} does not match the API: {exc.errors()[0]['msg']}",
            code="bad_response",
            status_code=response.status_code,
        ) from None
    result: T = call.unwrap(parsed) if call.unwrap is not None else parsed
    return result


def _unreachable(exc: httpx.TransportError, base_url: httpx.URL) -> ApiError:
    return ApiError(f"The subq API at {base_url} is unreachable: {type(exc).__name__}: {exc}", code="api_unreachable")


class _SseParser:
    """Server-sent events, line by line (the WHATWG event-stream format)."""

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
            raise _error_from(data, None, f"The event stream failed: {raw[:200]}")
        return Event(id=self._id, event=event, data=data)


def _headers(token: str | None) -> dict[str, str]:
    try:
        agent = f"subq-client/{version('subagent-queue')}"
    except PackageNotFoundError:
        agent = "subq-client"
    headers = {"User-Agent": agent, "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _stream_request(task_id: str, last_event_id: str | None) -> tuple[str, dict[str, str]]:
    headers = {"Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    return _task_path(task_id, "/events"), headers


def _stream_timeout(timeout_s: float) -> httpx.Timeout:
    return httpx.Timeout(timeout_s, read=max(timeout_s, STREAM_READ_TIMEOUT_S))


# -- the two clients -------------------------------------------------------------------------


class SubqClient:
    """The subq API over HTTP, synchronously. Use as a context manager, or call close()."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=base_url, headers=_headers(token), timeout=timeout_s, transport=transport)

    def _send(self, call: _Call[T]) -> T:
        try:
            response = self._http.request(call.method, call.path, json=call.json, params=call.params)
        except httpx.TransportError as exc:
            raise _unreachable(exc, self._http.base_url) from exc
        return _result(call, response)

    def _drive(self, steps: Generator[_Call[Any] | _Sleep, Any, T]) -> T:
        try:
            step = next(steps)
            while True:
                if isinstance(step, _Sleep):
                    time.sleep(step.seconds)
                    step = steps.send(None)
                else:
                    step = steps.send(self._send(step))
        except StopIteration as stop:
            result: T = stop.value
            return result

    def create_task(
        self,
        prompt: str,
        todos: str | Sequence[Mapping[str, Any]] | None = None,
        profile: str | None = None,
        run: bool = False,
        budget_usd: Decimal | float | str | None = None,
    ) -> TaskRecord:
        """A root task: caller-owned (`run=False`, you delegate) or an agent on the fleet (`run=True`)."""
        return self._send(_create_task(prompt, todos, profile, run, budget_usd))

    def cancel(self, task_id: str, reason: str) -> TaskRecord:
        """Cancel the task and its subtree (docs/control.md); ConflictError-style 409 if it has ended."""
        return self._send(_cancel(task_id, reason))

    def snapshot(self, root_id: str) -> dict[str, LiveState]:
        """The live state of every task of the tree."""
        return self._send(_snapshot(root_id))

    def list_approvals(self, root_id: str | None = None) -> list[Approval]:
        return self._send(_list_approvals(root_id))

    def decide(self, approval_id: str, decision: Literal["approve", "deny"], feedback: str | None = None) -> Approval:
        return self._send(_decide(approval_id, decision, feedback))

    def delegate(
        self, task_id: str, subtasks: Sequence[SubtaskSpec | Mapping[str, Any]], mode: DelegationMode = "parallel"
    ) -> DelegationResult:
        return self._send(_delegate(task_id, subtasks, mode))

    def get_task(self, task_id: str) -> TaskRecord:
        return self._send(_Call("GET", _task_path(task_id), _TASK))

    def get_todos(self, task_id: str) -> list[TodoItem]:
        return self._send(_get_todos(task_id))

    def update_todos(self, task_id: str, todos: str | Sequence[Mapping[str, Any]]) -> list[TodoItem]:
        return self._send(_update_todos(task_id, todos))

    def tree(self, task_id: str) -> TreeNode:
        return self._send(_Call("GET", _task_path(task_id, "/tree"), _TREE))

    def messages(self, task_id: str, kind: Literal["ui", "api"] = "ui") -> list[dict[str, Any]]:
        return self._send(_messages(task_id, kind))

    def list_tasks(
        self, *, status: TaskStatus | str | None = None, root_id: str | None = None, limit: int = 50, cursor: int = 0
    ) -> tuple[list[HistoryItem], int | None]:
        """Tasks newest first: (page, next cursor or None), as Coordinator.list_tasks."""
        return self._send(_list_tasks(status, root_id, limit, cursor))

    def wait(self, task_id: str, timeout_s: float) -> TaskRecord:
        """Poll until the task settles (Coordinator.wait's rule); WaitTimeout after timeout_s."""
        return self._drive(_wait(task_id, timeout_s))

    def health(self) -> Health:
        """GET /healthz; a server whose Redis is down answers with status `down` (not an exception)."""
        return self._send(_Call("GET", "/healthz", _HEALTH, ok=(200, 503)))

    def events(self, task_id: str, last_event_id: str | None = None) -> Iterator[Event]:
        """The task tree's events until the task settles; the last one is `end`."""
        path, headers = _stream_request(task_id, last_event_id)
        parser = _SseParser()
        try:
            with self._http.stream("GET", path, headers=headers, timeout=_stream_timeout(self.timeout_s)) as response:
                if response.status_code != 200:
                    response.read()
                    raise _error_of(response)
                for line in response.iter_lines():
                    if (event := parser.feed(line)) is not None:
                        yield event
        except httpx.TransportError as exc:
            raise _unreachable(exc, self._http.base_url) from exc

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncSubqClient:
    """The subq API over HTTP, for asyncio. Use as an async context manager, or await aclose()."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(token), timeout=timeout_s, transport=transport
        )

    async def _send(self, call: _Call[T]) -> T:
        try:
            response = await self._http.request(call.method, call.path, json=call.json, params=call.params)
        except httpx.TransportError as exc:
            raise _unreachable(exc, self._http.base_url) from exc
        return _result(call, response)

    async def _drive(self, steps: Generator[_Call[Any] | _Sleep, Any, T]) -> T:
        try:
            step = next(steps)
            while True:
                if isinstance(step, _Sleep):
                    await asyncio.sleep(step.seconds)
                    step = steps.send(None)
                else:
                    step = steps.send(await self._send(step))
        except StopIteration as stop:
            result: T = stop.value
            return result

    async def create_task(
        self,
        prompt: str,
        todos: str | Sequence[Mapping[str, Any]] | None = None,
        profile: str | None = None,
        run: bool = False,
        budget_usd: Decimal | float | str | None = None,
    ) -> TaskRecord:
        return await self._send(_create_task(prompt, todos, profile, run, budget_usd))

    async def cancel(self, task_id: str, reason: str) -> TaskRecord:
        return await self._send(_cancel(task_id, reason))

    async def snapshot(self, root_id: str) -> dict[str, LiveState]:
        return await self._send(_snapshot(root_id))

    async def list_approvals(self, root_id: str | None = None) -> list[Approval]:
        return await self._send(_list_approvals(root_id))

    async def decide(
        self, approval_id: str, decision: Literal["approve", "deny"], feedback: str | None = None
    ) -> Approval:
        return await self._send(_decide(approval_id, decision, feedback))

    async def delegate(
        self, task_id: str, subtasks: Sequence[SubtaskSpec | Mapping[str, Any]], mode: DelegationMode = "parallel"
    ) -> DelegationResult:
        return await self._send(_delegate(task_id, subtasks, mode))

    async def get_task(self, task_id: str) -> TaskRecord:
        return await self._send(_Call("GET", _task_path(task_id), _TASK))

    async def get_todos(self, task_id: str) -> list[TodoItem]:
        return await self._send(_get_todos(task_id))

    async def update_todos(self, task_id: str, todos: str | Sequence[Mapping[str, Any]]) -> list[TodoItem]:
        return await self._send(_update_todos(task_id, todos))

    async def tree(self, task_id: str) -> TreeNode:
        return await self._send(_Call("GET", _task_path(task_id, "/tree"), _TREE))

    async def messages(self, task_id: str, kind: Literal["ui", "api"] = "ui") -> list[dict[str, Any]]:
        return await self._send(_messages(task_id, kind))

    async def list_tasks(
        self, *, status: TaskStatus | str | None = None, root_id: str | None = None, limit: int = 50, cursor: int = 0
    ) -> tuple[list[HistoryItem], int | None]:
        return await self._send(_list_tasks(status, root_id, limit, cursor))

    async def wait(self, task_id: str, timeout_s: float) -> TaskRecord:
        return await self._drive(_wait(task_id, timeout_s))

    async def health(self) -> Health:
        return await self._send(_Call("GET", "/healthz", _HEALTH, ok=(200, 503)))

    async def events(self, task_id: str, last_event_id: str | None = None) -> AsyncIterator[Event]:
        path, headers = _stream_request(task_id, last_event_id)
        parser = _SseParser()
        try:
            async with self._http.stream(
                "GET", path, headers=headers, timeout=_stream_timeout(self.timeout_s)
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise _error_of(response)
                async for line in response.aiter_lines():
                    if (event := parser.feed(line)) is not None:
                        yield event
        except httpx.TransportError as exc:
            raise _unreachable(exc, self._http.base_url) from exc

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
