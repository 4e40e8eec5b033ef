"""`SubqClient`: the subq API over HTTP, synchronously (httpx.Client)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from decimal import Decimal
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import httpx

from coordinator.api.schemas import DelegationResult, Health
from coordinator.audit import AuditEntry
from coordinator.client import calls
from coordinator.client.calls import DEFAULT_TIMEOUT_S, Call, Sleep
from coordinator.client.errors import ApiError, error_of, unreachable
from coordinator.client.sse import Event, SseParser
from coordinator.deadletters import DeadLetter
from coordinator.models import (
    Approval,
    DelegationMode,
    Delivery,
    FinishingRuns,
    HistoryItem,
    LiveState,
    Retried,
    SubtaskSpec,
    TaskRecord,
    TaskStatus,
    TodoItem,
)
from coordinator.tenants import TenantState
from coordinator.tree import TreeNode

__all__ = ["SubqClient"]

T = TypeVar("T")


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
        self._token = token
        self._http = httpx.Client(
            base_url=base_url, headers=calls.headers(token), timeout=timeout_s, transport=transport
        )

    def fork(self) -> SubqClient:
        """A client of its own to the same API with the same token: for a stream read in another thread."""
        return SubqClient(str(self._http.base_url), self._token, self.timeout_s)

    def _send(self, call: Call[T]) -> T:
        try:
            response = self._http.request(call.method, call.path, json=call.json, params=call.params)
        except httpx.RequestError as exc:
            raise unreachable(exc, self._http.base_url) from exc
        return calls.result(call, response)

    def _drive(self, steps: Generator[Call[Any] | Sleep, Any, T]) -> T:
        try:
            step = next(steps)
            while True:
                if isinstance(step, Sleep):
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
        idempotency_key: str | None = None,
        output_schema: Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        webhooks: Sequence[Mapping[str, Any]] | None = None,
        on_complete: Mapping[str, Any] | str | None = None,
        priority: int | None = None,
    ) -> TaskRecord:
        """A root task: caller-owned (`run=False`, you delegate) or an agent on the fleet (`run=True`).

        A retry with the same `idempotency_key` returns the first call's root, never a second one.
        With an `output_schema` (a JSON Schema object; `run=True`), the agent ends with data held to it,
        its record's `output`; a bad schema is refused here (ValidationError naming the path) and nothing is sent.
        `metadata` (string keys and values: a job id, a customer) tags the tree: every task of it carries them,
        and `list_tasks(metadata=...)` finds them; bad metadata is refused here too (`metadata.<key>`).
        `webhooks` (`[{"url", "secret"?, "events"?}]`) and `on_complete` (a Celery task's name, or
        `{"task", "queue"}`) are where the tree's events go (docs/webhooks.md); a malformed one is refused
        here (`webhooks.0.url`) and nothing is sent.
        """
        call = calls.create_task(
            prompt, todos, profile, run, budget_usd, idempotency_key, output_schema, metadata, webhooks, on_complete,
            priority,
        )  # fmt: skip
        return self._send(call)

    def cancel(self, task_id: str, reason: str) -> TaskRecord:
        """Cancel the task and its subtree (docs/control.md); ConflictError-style 409 if it has ended."""
        return self._send(calls.cancel(task_id, reason))

    def retry(self, task_id: str, *, failed: bool = False) -> Retried:
        """Run the failed task again from its conversation (docs/control.md, "Retry"); with `failed`, every
        failed task of its tree, children before parents. StateError (409) naming why it cannot be retried."""
        return self._send(calls.retry(task_id, failed))

    def deliveries(self, task_id: str) -> list[Delivery]:
        """The tree's deliveries of outbound events, oldest event first (docs/webhooks.md)."""
        return self._send(calls.deliveries(task_id))

    def redeliver(self, task_id: str, delivery_id: str) -> Delivery:
        """Send a delivery of the task's tree again now (scope `operate`; on the audit log)."""
        return self._send(calls.redeliver(task_id, delivery_id))

    def snapshot(self, root_id: str) -> dict[str, LiveState]:
        """The live state of every task of the tree."""
        return self._send(calls.snapshot(root_id))

    def list_approvals(self, root_id: str | None = None) -> list[Approval]:
        """Tool calls waiting for a decision, oldest first; only this root's tree when given."""
        return self._send(calls.list_approvals(root_id))

    def decide(self, approval_id: str, decision: Literal["approve", "deny"], feedback: str | None = None) -> Approval:
        return self._send(calls.decide(approval_id, decision, feedback))

    def dead_letters(self, limit: int = 50) -> list[DeadLetter]:
        """Messages no worker could decode or validate, newest first (docs/api.md)."""
        return self._send(calls.dead_letters(limit))

    def tenants(self) -> list[TenantState]:
        """Every tenant: tasks running and waiting, roots running, submits and spend against its quotas (operate)."""
        return self._send(calls.tenants())

    def count_dead_letters(self) -> int:
        """How many dead letters are kept."""
        return self._send(calls.count_dead_letters())

    def purge_dead_letters(self) -> int:
        """Delete every dead letter; returns how many there were."""
        return self._send(calls.purge_dead_letters())

    def audit(self, limit: int = 50, before: str | None = None) -> tuple[list[AuditEntry], str | None]:
        """The audit log newest first, `limit` entries older than `before`; and the next page's cursor or None."""
        return self._send(calls.audit(limit, before))

    def delegate(
        self, task_id: str, subtasks: Sequence[SubtaskSpec | Mapping[str, Any]], mode: DelegationMode = "parallel"
    ) -> DelegationResult:
        return self._send(calls.delegate(task_id, subtasks, mode))

    def get_task(self, task_id: str) -> TaskRecord:
        return self._send(calls.get_task(task_id))

    def get_todos(self, task_id: str) -> list[TodoItem]:
        return self._send(calls.get_todos(task_id))

    def update_todos(self, task_id: str, todos: str | Sequence[Mapping[str, Any]]) -> list[TodoItem]:
        return self._send(calls.update_todos(task_id, todos))

    def tree(self, task_id: str) -> TreeNode:
        return self._send(calls.tree(task_id))

    def finishing_runs(self, task_id: str, /, *, among: Sequence[str] | None = None) -> FinishingRuns:
        """The tasks of the subtree whose runs may still record spend (late spend after a stop); with `among`
        (the last look's `task_ids`), those of its tasks only, when there are at most FINISHING_AMONG_MAX (100)
        of them: more are not sent, and the server walks the subtree."""
        return self._send(calls.finishing_runs(task_id, among))

    def messages(self, task_id: str, kind: Literal["ui", "api"] = "ui") -> list[dict[str, Any]]:
        return self._send(calls.messages(task_id, kind))

    def list_tasks(
        self,
        *,
        status: TaskStatus | str | None = None,
        root_id: str | None = None,
        limit: int = 50,
        cursor: int = 0,
        metadata: Mapping[str, str] | None = None,
        tenant: str | None = None,
    ) -> tuple[list[HistoryItem], int | None]:
        """Tasks newest first: (page, next cursor or None), as Coordinator.list_tasks; with `metadata`, only
        those of trees that carry every one of its key/value pairs."""
        return self._send(calls.list_tasks(status, root_id, limit, cursor, metadata, tenant))

    def wait(self, task_id: str, timeout_s: float) -> TaskRecord:
        """Poll until the task settles (Coordinator.wait's rule: after a stop, until its stopped runs have
        recorded their late spend, at most their lapse); WaitTimeout after timeout_s."""
        return self._drive(calls.wait(task_id, timeout_s))

    def health(self) -> Health:
        """GET /healthz; a server whose Redis is down answers with status `down` (not an exception)."""
        return self._send(calls.health())

    def events(self, task_id: str, last_event_id: str | None = None) -> Iterator[Event]:
        """The task tree's events until the task settles; the last one is `end`. A stream that closes before
        it (the API restarting, a proxy's limit, a dropped connection) is opened again from its last event,
        none given twice, while its openings fail for less than `timeout_s` in a row (calls.StreamResume)."""
        resume = calls.StreamResume(task_id, last_event_id, self.timeout_s)
        while True:
            try:
                for event in self._stream(task_id, resume.last_id, resume.opened):
                    resume.saw(event)
                    yield event
                    if event.event == "end":
                        return
                delay = resume.after(None)
            except ApiError as exc:
                delay = resume.after(exc)
            time.sleep(delay)

    def _stream(self, task_id: str, last_event_id: str | None, opened: Callable[[], None]) -> Iterator[Event]:
        """One opening of the task tree's event stream, from after `last_event_id` (`opened` once it answers)."""
        path, headers = calls.events(task_id, last_event_id)
        parser = SseParser()
        timeout = calls.stream_timeout(self.timeout_s)
        try:
            with self._http.stream("GET", path, headers=headers, timeout=timeout) as response:
                if response.status_code != 200:
                    response.read()
                    raise error_of(response)
                opened()
                for line in response.iter_lines():
                    if (event := parser.feed(line)) is not None:
                        yield event
        except httpx.RequestError as exc:
            raise unreachable(exc, self._http.base_url) from exc

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
