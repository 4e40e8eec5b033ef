"""`AsyncSubqClient`: the subq API over HTTP, for asyncio (httpx.AsyncClient).

It sends the same `Call`s as `SubqClient` (coordinator/client/calls.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Generator, Mapping, Sequence
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

__all__ = ["AsyncSubqClient"]

T = TypeVar("T")


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
            base_url=base_url, headers=calls.headers(token), timeout=timeout_s, transport=transport
        )

    async def _send(self, call: Call[T]) -> T:
        try:
            response = await self._http.request(call.method, call.path, json=call.json, params=call.params)
        except httpx.RequestError as exc:
            raise unreachable(exc, self._http.base_url) from exc
        return calls.result(call, response)

    async def _drive(self, steps: Generator[Call[Any] | Sleep, Any, T]) -> T:
        # Here, not at the top: a program that only uses SubqClient never loads asyncio.
        import asyncio

        try:
            step = next(steps)
            while True:
                if isinstance(step, Sleep):
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
        idempotency_key: str | None = None,
        output_schema: Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        webhooks: Sequence[Mapping[str, Any]] | None = None,
        on_complete: Mapping[str, Any] | str | None = None,
        priority: int | None = None,
    ) -> TaskRecord:
        call = calls.create_task(
            prompt, todos, profile, run, budget_usd, idempotency_key, output_schema, metadata, webhooks, on_complete,
            priority,
        )  # fmt: skip
        return await self._send(call)

    async def cancel(self, task_id: str, reason: str) -> TaskRecord:
        return await self._send(calls.cancel(task_id, reason))

    async def retry(self, task_id: str, *, failed: bool = False) -> Retried:
        """Run the failed task again, or with `failed` every failed task of its tree (SubqClient.retry)."""
        return await self._send(calls.retry(task_id, failed))

    async def deliveries(self, task_id: str) -> list[Delivery]:
        """The tree's deliveries of outbound events, oldest event first (docs/webhooks.md)."""
        return await self._send(calls.deliveries(task_id))

    async def redeliver(self, task_id: str, delivery_id: str) -> Delivery:
        """Send a delivery of the task's tree again now (scope `operate`; on the audit log)."""
        return await self._send(calls.redeliver(task_id, delivery_id))

    async def snapshot(self, root_id: str) -> dict[str, LiveState]:
        return await self._send(calls.snapshot(root_id))

    async def list_approvals(self, root_id: str | None = None) -> list[Approval]:
        return await self._send(calls.list_approvals(root_id))

    async def decide(
        self, approval_id: str, decision: Literal["approve", "deny"], feedback: str | None = None
    ) -> Approval:
        return await self._send(calls.decide(approval_id, decision, feedback))

    async def dead_letters(self, limit: int = 50) -> list[DeadLetter]:
        """Messages no worker could decode or validate, newest first (docs/api.md)."""
        return await self._send(calls.dead_letters(limit))

    async def tenants(self) -> list[TenantState]:
        """Every tenant: tasks running and waiting, roots running, submits and spend against its quotas (operate)."""
        return await self._send(calls.tenants())

    async def count_dead_letters(self) -> int:
        """How many dead letters are kept."""
        return await self._send(calls.count_dead_letters())

    async def audit(self, limit: int = 50, before: str | None = None) -> tuple[list[AuditEntry], str | None]:
        """The audit log newest first, `limit` entries older than `before`; and the next page's cursor or None."""
        return await self._send(calls.audit(limit, before))

    async def purge_dead_letters(self) -> int:
        """Delete every dead letter; returns how many there were."""
        return await self._send(calls.purge_dead_letters())

    async def delegate(
        self, task_id: str, subtasks: Sequence[SubtaskSpec | Mapping[str, Any]], mode: DelegationMode = "parallel"
    ) -> DelegationResult:
        return await self._send(calls.delegate(task_id, subtasks, mode))

    async def get_task(self, task_id: str) -> TaskRecord:
        return await self._send(calls.get_task(task_id))

    async def get_todos(self, task_id: str) -> list[TodoItem]:
        return await self._send(calls.get_todos(task_id))

    async def update_todos(self, task_id: str, todos: str | Sequence[Mapping[str, Any]]) -> list[TodoItem]:
        return await self._send(calls.update_todos(task_id, todos))

    async def tree(self, task_id: str) -> TreeNode:
        return await self._send(calls.tree(task_id))

    async def finishing_runs(self, task_id: str, /, *, among: Sequence[str] | None = None) -> FinishingRuns:
        """The tasks of the subtree whose runs may still record spend (late spend after a stop); with `among`
        (the last look's `task_ids`), those of its tasks only, when there are at most FINISHING_AMONG_MAX (100)
        of them: more are not sent, and the server walks the subtree."""
        return await self._send(calls.finishing_runs(task_id, among))

    async def messages(self, task_id: str, kind: Literal["ui", "api"] = "ui") -> list[dict[str, Any]]:
        return await self._send(calls.messages(task_id, kind))

    async def list_tasks(
        self,
        *,
        status: TaskStatus | str | None = None,
        root_id: str | None = None,
        limit: int = 50,
        cursor: int = 0,
        metadata: Mapping[str, str] | None = None,
        tenant: str | None = None,
    ) -> tuple[list[HistoryItem], int | None]:
        return await self._send(calls.list_tasks(status, root_id, limit, cursor, metadata, tenant))

    async def wait(self, task_id: str, timeout_s: float) -> TaskRecord:
        return await self._drive(calls.wait(task_id, timeout_s))

    async def health(self) -> Health:
        return await self._send(calls.health())

    async def events(self, task_id: str, last_event_id: str | None = None) -> AsyncIterator[Event]:
        """As SubqClient.events: until `end`, opened again from its last event when it closes before."""
        resume = calls.StreamResume(task_id, last_event_id, self.timeout_s)
        while True:
            try:
                async for event in self._stream(task_id, resume.last_id, resume.opened):
                    resume.saw(event)
                    yield event
                    if event.event == "end":
                        return
                delay = resume.after(None)
            except ApiError as exc:
                delay = resume.after(exc)
            await asyncio.sleep(delay)

    async def _stream(
        self, task_id: str, last_event_id: str | None, opened: Callable[[], None]
    ) -> AsyncIterator[Event]:
        path, headers = calls.events(task_id, last_event_id)
        parser = SseParser()
        timeout = calls.stream_timeout(self.timeout_s)
        try:
            async with self._http.stream("GET", path, headers=headers, timeout=timeout) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise error_of(response)
                opened()
                async for line in response.aiter_lines():
                    if (event := parser.feed(line)) is not None:
                        yield event
        except httpx.RequestError as exc:
            raise unreachable(exc, self._http.base_url) from exc

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
