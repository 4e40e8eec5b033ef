"""`/mcp` on the API: subq as an MCP server over Streamable HTTP, under the same keys, scopes and ownership.

    install_mcp(app, coord, guard)      one line in create_app: the route and its session manager's lifespan

Every request to /mcp goes through the /v1 routes' bearer guard first (the same
keys, the same 401 and rate limit on wrong tokens, the same audit entries). The
tools (coordinator/mcp_tools.py) then call the service through `KeyedOperations`:
each operation asks the same `Gate` questions as the HTTP route it mirrors, as the
caller's key, before it calls the Coordinator. So a missing scope is an error naming
it and on the audit log (its target `POST /mcp/<tool>`), a tree the key may not read
does not exist for it ("Unknown task"), and a tree it creates is its own (`owner`).
A tree it may not read is also put on the audit log by this face, with the reason
`not_found`: a model probing ids is worth an operator's look.
Each operation asks with the key as the keys are now (`key_now`), not as they were
when the request came: a call that lasts (wait_task polls for up to 300 s) stops
serving a key revoked or changed meanwhile, and ends with an `unauthorized` error.

Stateless Streamable HTTP (no MCP session kept between requests): every API replica
serves any request, as for the /v1 routes, and a tool's progress notifications ride
on its own request's response stream.

The MCP SDK and the tools (coordinator/mcp_tools.py) are imported, and the server and its
session manager built and started, at the first /mcp request of an app's lifespan, once a
process: importing them costs about 1 s of CPU (issue 43, point 5), which an API process
that never serves /mcp (the CLI's `subq api` in most deployments, and most of the suite's
API servers) need not pay. The manager runs in a task of its own until the lifespan ends.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from coordinator.access import Principal
from coordinator.access import Scope as KeyScope
from coordinator.api.auth import Gate, KeyRevoked, actor_of, guarded, key_now
from coordinator.api.errors import HttpError, error_response
from coordinator.service import Coordinator

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from mcp.server.context import ServerRequestContext
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    from coordinator.mcp_tools import McpOperations, Session
    from coordinator.models import Approval, FinishingRuns, Retried, TaskRecord, TodoItem
    from coordinator.tree import TreeNode

__all__ = ["MCP_PATH", "KeyedOperations", "McpEndpoint", "install_mcp"]

MCP_PATH = "/mcp"

Guard = Callable[..., Awaitable[Principal]]


class KeyedOperations:
    """The service as one key may use it: the HTTP routes' gate questions, then the Coordinator's call.

    `request` is the /mcp request, `tool` the tool called (the audit log's target names it).
    """

    def __init__(self, coord: Coordinator, request: Request, key: Principal, tool: str) -> None:
        self.coord = coord
        self.caller = key  # as the request named it: the audit log's name for it, even once it is revoked
        self.gate = Gate(coord, record_unreadable=False)  # a refused read is recorded by not_found, naming the tool
        # The audit log names a refused call `POST /mcp/<tool>`: the tool, not only the endpoint.
        self.request = Request({**request.scope, "path": f"{MCP_PATH}/{tool}", "raw_path": b""})

    @property
    def key(self) -> Principal:
        """The caller's key as the keys are now, asked at every operation: a call that lasts (wait_task polls
        for up to 300 s) must stop serving a key revoked meanwhile. One `stat` of the keys file, no Redis."""
        key = key_now(self.request)
        if key is None:
            raise KeyRevoked(
                f"The API key {self.caller.name!r} was revoked, or given a new token, while this call ran",
                field="Authorization",
            )
        return key

    def create_task(
        self,
        prompt: str,
        todos: str | Sequence[Any] | None = None,
        profile: str | None = None,
        run: bool = False,
        budget_usd: Decimal | float | str | None = None,
        idempotency_key: str | None = None,
        *,
        output_schema: Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        **more: Any,
    ) -> TaskRecord:
        """As POST /v1/tasks: scope `submit`, the tree the key's; `more` is what the route also passes on
        (coordinator/mcp_tools.py names what it does not)."""
        key = self.key
        self.gate.need(self.request, key, KeyScope.SUBMIT)
        return self.coord.create_task(
            prompt, todos=todos, profile=profile, run=run, budget_usd=budget_usd, idempotency_key=idempotency_key,
            owner=key.name, output_schema=dict(output_schema) if output_schema is not None else None,
            metadata=metadata, key_webhooks=key.webhooks, tenant=key.tenant, **more,
        )  # fmt: skip

    def get_task(self, task_id: str, /) -> TaskRecord:
        key = self.key  # wait_task calls this at each poll: a key revoked meanwhile is refused here
        self.gate.need(self.request, key, KeyScope.READ, KeyScope.READ_ALL)
        record = self.coord.get_task(task_id)
        self.gate.readable(key, task_id, record.owner)
        return record

    def get_todos(self, task_id: str, /) -> list[TodoItem]:
        self.gate.read_tree(self.request, self.key, task_id)
        return self.coord.get_todos(task_id)

    def tree(self, task_id: str, /) -> TreeNode:
        self.gate.read_tree(self.request, self.key, task_id)
        return self.coord.tree(task_id)

    def finishing_runs(self, task_id: str, /, *, among: Sequence[str] | None = None) -> FinishingRuns:
        self.gate.read_tree(self.request, self.key, task_id)
        return self.coord.finishing_runs(task_id, among=among)

    def messages(self, task_id: str, kind: Literal["ui", "api"], /) -> list[dict[str, Any]]:
        self.gate.read_tree(self.request, self.key, task_id)
        return self.coord.messages(task_id, kind)

    def cancel(self, task_id: str, reason: str, /) -> TaskRecord:
        key = self.key
        owner = self.gate.write_tree(self.request, key, task_id, others=KeyScope.OPERATE)
        return self.gate.as_read_by(key, owner, self.coord.cancel(task_id, reason, actor=actor_of(self.request, key)))

    def retry(self, task_id: str, /, *, failed: bool = False) -> Retried:
        key = self.key
        owner = self.gate.write_tree(self.request, key, task_id, others=KeyScope.OPERATE)
        done = self.coord.retry(task_id, failed=failed, actor=actor_of(self.request, key))
        return self.gate.as_read_by(key, owner, done)

    def list_approvals(self, root_id: str | None = None, /) -> list[Approval]:
        return self.gate.approvals(self.request, self.key, root_id)

    def decide(
        self, approval_id: str, decision: Literal["approve", "deny"], feedback: str | None = None, /
    ) -> Approval:
        key = self.key
        self.gate.need(self.request, key, KeyScope.DECIDE)
        return self.coord.decide(approval_id, decision, feedback, actor=actor_of(self.request, key))

    def not_found(self, tool: str, detail: str) -> None:
        """Put a call about a tree the key may not read (or no tree at all) on the audit log."""
        self.coord.record(
            actor_of(self.request, self.caller), "refused", f"POST {MCP_PATH}/{tool}", reason="not_found", detail=detail
        )


if TYPE_CHECKING:

    def _keyed_is_mcp_operations(ops: KeyedOperations) -> McpOperations:
        """The type checker's proof that the gated service answers what the tools call."""
        return ops


class McpEndpoint:
    """The ASGI endpoint of /mcp: the bearer guard, then the MCP SDK's Streamable HTTP transport.

    The SDK's session manager is made and started at the first request of each lifespan
    (`_started_manager`), not at the app's start: see the module's docstring.
    """

    def __init__(self, coord: Coordinator, guard: Guard, auth: bool, version: str) -> None:
        self.coord = coord
        self.guard = guard
        self.auth = auth
        self.version = version
        self.server: Any = None  # the MCP server (mcp_tools.build_server), built at the first request
        self.manager: StreamableHTTPSessionManager | None = None  # made anew in each lifespan (one run() each)
        self._live = False  # the app's lifespan is running
        self._starting: asyncio.Lock | None = None
        self._stop: asyncio.Event | None = None
        self._serving: asyncio.Task[None] | None = None

    async def _session_of(self, ctx: ServerRequestContext[Any, Any]) -> Session:
        from coordinator.mcp_tools import Session  # loaded by then: the server that calls this is built from it

        request = ctx.request
        key = getattr(request.state, "principal", None) if isinstance(request, Request) else None
        if not isinstance(request, Request) or not isinstance(key, Principal):  # never served without the guard
            raise HttpError(401, "unauthorized", "Not authenticated")
        tool = str((ctx.params or {}).get("name", ctx.method)) if ctx.method == "tools/call" else ctx.method
        ops = KeyedOperations(self.coord, request, key, tool)
        return Session(ops=ops, scopes=key.scopes, web_url=str(request.base_url), on_not_found=ops.not_found)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The app's lifespan: /mcp serves while it runs; a manager started in it stops with it."""
        self._starting, self._stop, self._live = asyncio.Lock(), asyncio.Event(), True
        try:
            yield
        finally:
            self._live = False
            serving, self._serving, self.manager = self._serving, None, None
            self._stop.set()  # also a manager a request is starting now: it stops once started
            if serving is not None:
                await serving

    async def _started_manager(self) -> StreamableHTTPSessionManager | None:
        """The lifespan's session manager, made and started by the first request that needs it; None when
        the lifespan this request came in has ended meanwhile (nothing is started then)."""
        starting, stop = self._starting, self._stop
        assert starting is not None and stop is not None  # set by running()
        async with starting:
            if self.server is None:
                # In a thread: the imports take about a second, which the event loop's other requests need not wait.
                tools = await asyncio.to_thread(importlib.import_module, "coordinator.mcp_tools")
                self.server = tools.build_server(self._session_of, self.version)
            # The lifespan may have ended during the import: running()'s end found no manager to stop then, so
            # one started now would serve on, stopped by nothing (review V4, item 6).
            if not self._live or self._stop is not stop:
                return None
            if self.manager is not None:
                return self.manager
            from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

            manager = StreamableHTTPSessionManager(app=self.server, stateless=True)
            ready = asyncio.Event()
            serving = asyncio.create_task(self._serve(manager, ready, stop))
            waiting = asyncio.create_task(ready.wait())
            await asyncio.wait({serving, waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if serving.done():  # run() failed before it served: raise its error
                serving.result()
            if stop.is_set():  # the lifespan ended while it started: it stops at once
                await serving
                return None
            self._serving, self.manager = serving, manager
            return manager

    @staticmethod
    async def _serve(manager: StreamableHTTPSessionManager, ready: asyncio.Event, stop: asyncio.Event) -> None:
        # run() enters and leaves its task group in this one task, as anyio requires.
        async with manager.run():
            ready.set()
            await stop.wait()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not await guarded(self.guard, self.auth, scope, receive, send):
            return
        # Not live: the app's lifespan did not run (a test client without it), or has ended.
        manager = await self._started_manager() if self._live else None
        if manager is None:
            response = error_response(503, "mcp_unavailable", "The MCP endpoint serves only while the app runs")
            await response(scope, receive, send)
            return
        await manager.handle_request(scope, receive, send)


def install_mcp(app: FastAPI, coord: Coordinator, guard: Guard, *, auth: bool) -> None:
    """Serve /mcp on `app` (Streamable HTTP), its session manager running with the app's lifespan."""
    endpoint = McpEndpoint(coord, guard, auth, app.version)
    app.router.routes.append(Route(MCP_PATH, endpoint=endpoint, methods=["GET", "POST", "DELETE"]))
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(started: Any) -> AsyncIterator[Any]:
        async with endpoint.running(), inner(started) as state:
            yield state

    app.router.lifespan_context = lifespan
