"""Every operation of the API, described once: the request to send and how to read its answer.

`SubqClient` and `AsyncSubqClient` send the same `Call`s; they only differ in
how they send and sleep. `wait` is a generator of calls and `Sleep`s, driven by
either client.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Generic, Literal, TypeVar, cast
from urllib.parse import quote

import httpx
import pydantic
from pydantic import TypeAdapter

from coordinator import ids
from coordinator.api.schemas import (
    ApprovalList,
    AuditPage,
    DeadLetterList,
    DeadLettersPurged,
    DelegationResult,
    DeliveryList,
    Health,
    HistoryPage,
    MessageList,
    Snapshot,
    TodoList,
)
from coordinator.audit import AuditEntry, check_before
from coordinator.client.errors import ApiError, error_of
from coordinator.client.sse import Event
from coordinator.deadletters import DeadLetter
from coordinator.errors import ConfigError, ValidationError, WaitTimeout
from coordinator.inputs import (
    META_PREFIX,
    CancelInput,
    CreateTaskInput,
    DecisionInput,
    DelegateInput,
    OperationInput,
    RetryInput,
    TodosInput,
    check_dead_letter_limit,
    check_delivery_id,
    check_history_query,
    check_root_id,
    check_wait_timeout,
    sendable_profile,
)
from coordinator.models import (
    FINISHING_AMONG_MAX,
    Approval,
    DelegationMode,
    Delivery,
    FinishingRuns,
    HistoryItem,
    LiveState,
    Retried,
    StopHold,
    SubtaskSpec,
    TaskRecord,
    TaskStatus,
    TodoItem,
)
from coordinator.tenants import TenantList, TenantState, check_tenant_name
from coordinator.text import lone_surrogate
from coordinator.tree import TreeNode

__all__ = ["DEFAULT_TIMEOUT_S", "Call", "Sleep"]

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


@dataclass(frozen=True)
class Call(Generic[T]):
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
    # Statuses whose result is None, whatever the body (an API without the route answers 404).
    none_on: tuple[int, ...] = ()


@dataclass(frozen=True)
class Sleep:
    seconds: float


_TASK = TypeAdapter(TaskRecord)
_TODOS = TypeAdapter(TodoList)
_BATCH = TypeAdapter(DelegationResult)
_TREE = TypeAdapter(TreeNode)
_FINISHING = TypeAdapter(FinishingRuns)
_MESSAGES = TypeAdapter(MessageList)
_HISTORY = TypeAdapter(HistoryPage)
_TENANTS = TypeAdapter(TenantList)
_HEALTH = TypeAdapter(Health)
_SNAPSHOT = TypeAdapter(Snapshot)
_APPROVALS = TypeAdapter(ApprovalList)
_APPROVAL = TypeAdapter(Approval)
_DEAD_LETTERS = TypeAdapter(DeadLetterList)
_PURGED = TypeAdapter(DeadLettersPurged)
_AUDIT = TypeAdapter(AuditPage)
_RETRIED = TypeAdapter(Retried)
_DELIVERIES = TypeAdapter(DeliveryList)
_DELIVERY = TypeAdapter(Delivery)


def task_path(task_id: str, suffix: str = "") -> str:
    """The path of a task's route. An id of no task's shape is refused here as on Redis (NotFoundError: "Unknown
    id: ... is not a subq task or batch id"): percent-encoded, ".." and "" still became another path (httpx
    resolves dot segments: `cancel ..` asked for POST /v1/cancel), and the server decodes "a%2Fb" into a path
    before it routes ("<root>/todos" reached the todo list's route)."""
    ids.root_of(task_id)
    return f"/v1/tasks/{quote(task_id, safe='')}{suffix}"


# -- the operations, in the order of the clients' methods ---------------------------------


def create_task(
    prompt: str,
    todos: object,
    profile: str | None,
    run: bool,
    budget_usd: Decimal | float | str | None,
    idempotency_key: str | None = None,
    output_schema: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
    webhooks: Sequence[Mapping[str, Any]] | None = None,
    on_complete: Mapping[str, Any] | str | None = None,
    priority: int | None = None,
) -> Call[TaskRecord]:
    # The body is read with the API's own model before sending: a bad input is refused
    # here in the server's words (the service's, for a blank prompt or a bad budget), and nothing is sent.
    sendable_profile(profile)
    body = _body(
        CreateTaskInput,
        {
            "prompt": prompt,
            "todos": todos,
            "profile": profile,
            "run": run,
            "budget_usd": budget_usd,
            "idempotency_key": idempotency_key,
            "output_schema": output_schema,
            "metadata": metadata,
            "webhooks": webhooks,
            "on_complete": on_complete,
            "priority": priority,
        },
    )
    return Call("POST", "/v1/tasks", _TASK, json=body, ok=(201,))


def cancel(task_id: str, reason: str) -> Call[TaskRecord]:
    return Call("POST", task_path(task_id, "/cancel"), _TASK, json=_body(CancelInput, {"reason": reason}))


def retry(task_id: str, failed: bool) -> Call[Retried]:
    return Call("POST", task_path(task_id, "/retry"), _RETRIED, json=_body(RetryInput, {"failed": failed}))


def deliveries(task_id: str) -> Call[list[Delivery]]:
    return Call("GET", task_path(task_id, "/deliveries"), _DELIVERIES, unwrap=lambda page: page.deliveries)


def redeliver(task_id: str, delivery_id: str) -> Call[Delivery]:
    path = task_path(task_id)
    # As `task_path`: "..", "." and "" became another route (httpx resolves dot segments), and a lone surrogate
    # no request line can carry; refused as the service refuses an unknown delivery.
    check_delivery_id(task_id, delivery_id)
    return Call("POST", f"{path}/deliveries/{quote(delivery_id, safe='')}/redeliver", _DELIVERY)


def snapshot(root_id: str) -> Call[dict[str, LiveState]]:
    return Call("GET", task_path(root_id, "/snapshot"), _SNAPSHOT, unwrap=lambda page: page.tasks)


def list_approvals(root_id: str | None) -> Call[list[Approval]]:
    if root_id is not None:  # as the service checks it (a lone surrogate, a child's id), before a query is made of it
        check_root_id(root_id)
    params = {"root_id": root_id} if root_id is not None else {}
    return Call("GET", "/v1/approvals", _APPROVALS, unwrap=lambda page: page.approvals, params=params)


def decide(approval_id: str, decision: str, feedback: str | None) -> Call[Approval]:
    body = _body(DecisionInput, {"decision": decision, "feedback": feedback})
    ids.root_of(approval_id, field="approval_id")  # as `task_path`
    return Call("POST", f"/v1/approvals/{quote(approval_id, safe='')}", _APPROVAL, json=body)


def dead_letters(limit: int) -> Call[list[DeadLetter]]:
    check_dead_letter_limit(limit)
    params = {"limit": limit}
    return Call("GET", "/v1/dead-letters", _DEAD_LETTERS, unwrap=lambda page: page.dead_letters, params=params)


def count_dead_letters() -> Call[int]:
    # The list's answer carries the count of every kept entry; one entry is the least it sends.
    return Call("GET", "/v1/dead-letters", _DEAD_LETTERS, unwrap=lambda page: page.count, params={"limit": 1})


def tenants() -> Call[list[TenantState]]:
    return Call("GET", "/v1/tenants", _TENANTS, unwrap=lambda page: page.tenants)


def purge_dead_letters() -> Call[int]:
    return Call("DELETE", "/v1/dead-letters", _PURGED, unwrap=lambda answer: answer.purged)


def audit(limit: int, before: str | None) -> Call[tuple[list[AuditEntry], str | None]]:
    check_dead_letter_limit(limit)
    check_before(before)  # the audit store's check, before a query is made of it
    params: dict[str, Any] = {"limit": limit, **({"before": before} if before is not None else {})}
    return Call("GET", "/v1/audit", _AUDIT, unwrap=lambda page: (page.entries, page.next_before), params=params)


def delegate(
    task_id: str, subtasks: Sequence[SubtaskSpec | Mapping[str, Any]], mode: DelegationMode
) -> Call[DelegationResult]:
    body = _body(DelegateInput, {"mode": mode, "subtasks": subtasks})
    return Call("POST", task_path(task_id, "/subtasks"), _BATCH, json=body, ok=(202,))


def get_task(task_id: str) -> Call[TaskRecord]:
    return Call("GET", task_path(task_id), _TASK)


def get_todos(task_id: str) -> Call[list[TodoItem]]:
    return Call("GET", task_path(task_id, "/todos"), _TODOS, unwrap=lambda page: page.todos)


def update_todos(task_id: str, todos: str | Sequence[Mapping[str, Any]]) -> Call[list[TodoItem]]:
    body = _body(TodosInput, {"todos": todos if isinstance(todos, str) else [dict(item) for item in todos]})
    return Call("PUT", task_path(task_id, "/todos"), _TODOS, unwrap=lambda page: page.todos, json=body)


def tree(task_id: str) -> Call[TreeNode]:
    return Call("GET", task_path(task_id, "/tree"), _TREE)


def finishing_runs(task_id: str, among: Sequence[str] | None = None) -> Call[FinishingRuns]:
    """`among`: look only at these tasks of the tree (a waiter's last look, `StopHold.among`), when there are at
    most FINISHING_AMONG_MAX of them; more are not sent, and the server walks the subtree."""
    sent = among is not None and len(among) <= FINISHING_AMONG_MAX
    params: dict[str, str | int] = {"among": ",".join(among or [])} if sent else {}
    return Call("GET", task_path(task_id, "/finishing"), _FINISHING, params=params)


def _finishing_if_known(task_id: str, among: Sequence[str] | None) -> Call[FinishingRuns | None]:
    """`finishing_runs` as `wait` asks it: a 404 is None, nothing known to wait for (an API older than the
    route, or the task gone since it was read), so the wait answers with the record it has. (An API older than
    `among` leaves it out, and walks the subtree at every look.)"""
    return cast("Call[FinishingRuns | None]", replace(finishing_runs(task_id, among), none_on=(404,)))


def messages(task_id: str, kind: Literal["ui", "api"]) -> Call[list[dict[str, Any]]]:
    return Call(
        "GET", task_path(task_id, "/messages"), _MESSAGES, unwrap=lambda page: page.messages, params={"kind": kind}
    )


def list_tasks(
    status: TaskStatus | str | None,
    root_id: str | None,
    limit: int,
    cursor: int,
    metadata: Mapping[str, str] | None = None,
    tenant: str | None = None,
) -> Call[tuple[list[HistoryItem], int | None]]:
    status_text = status.value if isinstance(status, TaskStatus) else status
    check_history_query(status_text, root_id, limit, cursor, metadata)
    if tenant is not None:
        check_tenant_name(tenant)
    params: dict[str, str | int] = {"limit": limit, "cursor": cursor}
    # One `meta.<key>` parameter per pair, all to match (the keys need no quoting: coordinator/inputs.py).
    params |= {f"{META_PREFIX}{key}": value for key, value in (metadata or {}).items()}
    if status_text is not None:
        params["status"] = status_text
    if root_id is not None:
        params["root_id"] = root_id
    if tenant is not None:
        params["tenant"] = tenant
    return Call("GET", "/v1/tasks", _HISTORY, unwrap=lambda page: (page.items, page.next_cursor), params=params)


def _body(model: type[OperationInput], given: Mapping[str, Any]) -> dict[str, Any]:
    """A request body read with its operation's model (refused as the server would), as JSON; money as decimal strings."""
    body: dict[str, Any] = model.parse(given).model_dump(mode="json", exclude_none=True)
    _refuse_lone_surrogates(body, "")
    return body


def _refuse_lone_surrogates(value: object, path: str) -> None:
    """A ValidationError naming the first string of a body (a todo list, a subtask's profile) that holds a lone
    surrogate, which no request body can carry: it was an encoding error deep in httpx, a traceback."""
    if isinstance(value, str) and (where := lone_surrogate(value)) is not None:
        raise ValidationError(
            f"{path or 'body'} holds a lone surrogate {where}, which is no character", field=path or None
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(key, path)
            _refuse_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for n, item in enumerate(value):
            _refuse_lone_surrogates(item, f"{path}.{n}" if path else str(n))


def _settled(record: TaskRecord) -> bool:
    """Coordinator.wait's rule: terminal, or a caller-owned task no longer `delegated`."""
    return record.status.terminal or (record.runner == "caller" and record.status != TaskStatus.DELEGATED)


def wait(task_id: str, timeout_s: float) -> Generator[Call[Any] | Sleep, Any, TaskRecord]:
    """Poll the task until it settles: yields calls (answered with their result) and sleeps.

    After a stop (`TaskStatus.stopped`) it answers once the subtree's stopped runs have recorded their late
    spend (GET .../finishing, alone while it holds), for at most their lapse and within `timeout_s`, so the
    figures are final: the rule of `Coordinator.wait` (`StopHold`)."""
    check_wait_timeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    delay_s = POLL_FIRST_S
    while True:
        record: TaskRecord = yield get_task(task_id)
        if _settled(record):
            if not record.status.stopped:
                return record
            hold = StopHold(deadline)
            while hold.due() and hold.holds((yield _finishing_if_known(task_id, hold.among))):
                yield Sleep(hold.look_in_s())
            # None is left (or the lapse passed): read it again, so the spend recorded meanwhile is in.
            record = yield get_task(task_id)
            if _settled(record):
                return record
            # Retried meanwhile: it runs again.
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise WaitTimeout(
                f"Task {task_id} is still {record.status.value} after {timeout_s:g}s "
                f"({len(record.awaiting_ids)} of {len(record.child_ids)} children outstanding)"
            )
        yield Sleep(min(delay_s, remaining_s))
        delay_s = min(delay_s * POLL_GROWTH, POLL_MAX_S)


def health() -> Call[Health]:
    return Call("GET", "/healthz", _HEALTH, ok=(200, 503))


def events(task_id: str, last_event_id: str | None) -> tuple[str, dict[str, str]]:
    """The event stream's path and headers (the stream is read line by line, not parsed whole)."""
    headers = {"Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    return task_path(task_id, "/events"), headers


# -- sending and reading -------------------------------------------------------------------


def result(call: Call[T], response: httpx.Response) -> T:
    """The call's result from its response, or the error the response stands for."""
    if response.status_code in call.none_on:
        return cast(T, None)  # such a call's T includes None
    if response.status_code not in call.ok:
        raise error_of(response)
    try:
        parsed = call.parse.validate_json(response.content)
    except pydantic.ValidationError as exc:
        raise ApiError(
            f"The server's answer to {call.method} {call.path} does not match the API: {exc.errors()[0]['msg']}",
            code="bad_response",
            status_code=response.status_code,
        ) from None
    value: T = call.unwrap(parsed) if call.unwrap is not None else parsed
    return value


def headers(token: str | None) -> dict[str, str]:
    """Every request's headers: who is asking, with the bearer token when there is one."""
    try:
        agent = f"subq-client/{version('subagent-queue')}"
    except PackageNotFoundError:
        agent = "subq-client"
    sent = {"User-Agent": agent, "Accept": "application/json"}
    if token:
        # A header carries ASCII alone: a token pasted with a no-break space or an accented letter was an
        # encoding error deep in the HTTP client (a traceback from the CLI), not a word on what to fix.
        if not (token.isascii() and token.isprintable()) or " " in token:
            raise ConfigError(
                "The API token (SUBQ_API_TOKEN) must be printable ASCII with no spaces: check it was pasted whole",
                field="SUBQ_API_TOKEN",
            )
        sent["Authorization"] = f"Bearer {token}"
    return sent


# A stream that closed before its `end` (the API restarting, a proxy's time limit on a response, a dropped
# connection) is opened again from the last event id it gave: first after RESUME_FIRST_S, doubling to
# RESUME_MAX_S (an event starts it over), while its failures last less than the client's timeout (an opening
# answered 200 starts that over); then the failure is raised.
RESUME_FIRST_S = 0.5
RESUME_MAX_S = 5.0
# A restarting API behind a proxy answers these while it is away: waited out as a dropped connection is.
RESUME_STATUSES = frozenset({502, 503, 504})


@dataclass
class StreamResume:
    """Where a task's event stream opens again after it closed before its `end`, and when."""

    task_id: str
    last_id: str | None
    within_s: float  # how long its failures in a row may last before the last is raised
    delay_s: float = RESUME_FIRST_S
    failing_since: float | None = None

    def saw(self, event: Event) -> None:
        self.last_id = event.id or self.last_id
        self.delay_s = RESUME_FIRST_S

    def opened(self) -> None:
        self.failing_since = None

    def after(self, failure: ApiError | None) -> float:
        """How long to wait before opening the stream again, after it closed before its `end` (`failure`: how, or
        None for a close with no error). Raises `failure` when it is no reason to (an error the API itself sent,
        a `StoreError` among them, is not an ApiError at all), or once failures have lasted past `within_s`."""
        if failure is None:
            failure = ApiError(
                f"The event stream of {self.task_id} closed before its end event (last event {self.last_id or 'none'})",
                code="stream_ended",
            )
        elif failure.code != "api_unreachable" and failure.status_code not in RESUME_STATUSES:
            raise failure
        now = time.monotonic()
        self.failing_since = now if self.failing_since is None else self.failing_since
        if now - self.failing_since + self.delay_s > self.within_s:
            raise failure
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, RESUME_MAX_S)
        return delay


def stream_timeout(timeout_s: float) -> httpx.Timeout:
    return httpx.Timeout(timeout_s, read=max(timeout_s, STREAM_READ_TIMEOUT_S))
