"""subq's MCP tools and resources, defined once for both faces (docs/mcp.md).

    /mcp        Streamable HTTP on the API (coordinator/api/mcp.py): the tools call the service in
                process, behind the same Gate as the HTTP routes, as the caller's API key
    subq mcp    stdio (coordinator/cli/mcp.py): the tools call a subq API through the HTTP client

Each tool is a thin face over one operation of `McpOperations`, which both the
`Coordinator` behind a key's gate and `coordinator.client.SubqClient` satisfy, so
a tool answers the same through either face. A tool's arguments are read with the
operation's own input model (coordinator/inputs.py) before anything is called, so
a malformed one is refused in the HTTP API's words (`prompt is 200001 characters;
the limit is 200000`, `foo: Extra inputs are not permitted`) and nothing is
written. A refusal is a tool result with `isError` (the calling model reads it and
can correct itself), carrying the API's error body `{code, message, field}`.

`tools/list` offers a key only the tools its scopes allow (`Tools.offered`): the
in-process face knows the key's scopes; the stdio face asks the API's /mcp which
tools the key has (and lists every tool when the API cannot say); either way the
service refuses, naming the scope, a call the key may not make.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio
import anyio.to_thread
import mcp.types as types
from pydantic import BaseModel, Field, StrictBool

from coordinator.access import Scope
from coordinator.errors import NotFoundError, SubqError, ValidationError
from coordinator.ids import ROOT_ID_PATTERN
from coordinator.inputs import CancelInput, CreateTaskInput, DecisionInput, OperationInput, RetryInput
from coordinator.models import StopHold, finishing_if_known

if TYPE_CHECKING:
    from mcp.server.context import ServerRequestContext
    from mcp.server.lowlevel import Server

    from coordinator.models import Approval, FinishingRuns, Retried, TaskRecord, TodoItem
    from coordinator.tree import TreeNode

__all__ = [
    "MAX_WAIT_S",
    "RESOURCE_TEMPLATES",
    "TOOLS",
    "McpOperations",
    "Session",
    "build_server",
    "task_view",
]

# wait_task holds a request open: long enough for a small tree to finish, short enough that a client's
# read timeout (often 60 s or more) is not reached; the model calls it again for more.
DEFAULT_WAIT_S = 30.0
MAX_WAIT_S = 300.0
# How often wait_task reads the task while it waits: a progress notification follows a child's end within this.
WAIT_POLL_S = 0.25
# The URI scheme of subq's resources: subq://tasks/<id>/tree, .../conversation, .../export.
RESOURCE_PREFIX = "subq://tasks/"
JSON_MIME = "application/json"
# JSON-RPC's code for an unknown resource, as the MCP specification gives it.
RESOURCE_NOT_FOUND = -32002


class McpOperations(Protocol):
    """What the tools call: the operations of coordinator/operations.py they face, with a typed result's schema.

    The in-process face's gate (coordinator/api/mcp.py) and `SubqClient` both satisfy it.
    """

    def create_task(
        self,
        prompt: str,
        todos: str | Sequence[Any] | None = None,
        profile: str | None = None,
        run: bool = False,
        budget_usd: Any = None,
        idempotency_key: str | None = None,
        *,
        output_schema: Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> TaskRecord: ...
    def get_task(self, task_id: str, /) -> TaskRecord: ...
    def get_todos(self, task_id: str, /) -> list[TodoItem]: ...
    def tree(self, task_id: str, /) -> TreeNode: ...
    def finishing_runs(self, task_id: str, /, *, among: Sequence[str] | None = None) -> FinishingRuns: ...
    def messages(self, task_id: str, kind: Literal["ui", "api"], /) -> list[dict[str, Any]]: ...
    def cancel(self, task_id: str, reason: str, /) -> TaskRecord: ...
    def retry(self, task_id: str, /, *, failed: bool = False) -> Retried: ...
    def list_approvals(self, root_id: str | None = None, /) -> list[Approval]: ...
    def decide(
        self, approval_id: str, decision: Literal["approve", "deny"], feedback: str | None = None, /
    ) -> Approval: ...


@dataclass(frozen=True)
class Session:
    """One caller as the tools see it: its operations, its scopes (None: unknown, every tool listed),
    the web view's address (None: not known), and how a refusal the face does not already log is recorded."""

    ops: McpOperations
    scopes: frozenset[Scope] | None
    web_url: str | None
    on_not_found: Callable[[str, str], None] | None = None  # (tool, detail): a tree the key may not read
    # The tools a face was told the key has, where it cannot know the scopes (`subq mcp` asks the API's /mcp).
    names: frozenset[str] | None = None

    def allows(self, tool: ToolDef) -> bool:
        if self.names is not None and tool.name not in self.names:
            return False
        if self.scopes is None or not tool.needs:
            return True
        return Scope.ADMIN in self.scopes or any(scope in self.scopes for scope in tool.needs)

    def link(self, task_id: str, root_id: str) -> str | None:
        """The web view's page of the task's tree, where a person can watch it, approve and cancel."""
        if self.web_url is None:
            return None
        anchor = "" if task_id == root_id else f"#{task_id}"
        return f"{self.web_url.rstrip('/')}/ui/tasks/{root_id}{anchor}"


# -- each tool's arguments: the operation's own input model, with the id it acts on ----------------

_TASK_ID = "A task id as run_task returned it: 16 hex digits for a root, `<root>-<12 hex>` for a child"


class TaskArgs(OperationInput):
    task_id: str = Field(min_length=1, max_length=200, description=_TASK_ID)


class WaitArgs(OperationInput):
    task_id: str = Field(min_length=1, max_length=200, description=_TASK_ID)
    timeout_s: float = Field(
        default=DEFAULT_WAIT_S,
        gt=0,
        le=MAX_WAIT_S,
        description=f"Most seconds to wait (at most {MAX_WAIT_S:g}); if the task has not ended by then, "
        "the answer has `settled: false` and you may call wait_task again",
    )


class CancelArgs(OperationInput):
    task_id: str = Field(min_length=1, max_length=200, description=_TASK_ID)
    reason: str = Field(description="Why: the task's parent and the history read it")


class RetryArgs(OperationInput):
    task_id: str = Field(min_length=1, max_length=200, description=_TASK_ID)
    failed: StrictBool = Field(
        default=False, description="true: every failed task of the task's subtree, children before parents"
    )


class ApprovalsArgs(OperationInput):
    root_id: str | None = Field(
        default=None, pattern=ROOT_ID_PATTERN, description="Only this root's tree (16 hex digits)"
    )


class DecideArgs(OperationInput):
    approval_id: str = Field(min_length=1, max_length=200, description="An approval id as list_approvals gives it")
    decision: Literal["approve", "deny"]
    feedback: str | None = Field(default=None, description="What the task's model is told on a denial")


def _run_task_schema() -> dict[str, Any]:
    """POST /v1/tasks' body without `run` (run_task always starts an agent): the same fields, the same checks."""
    schema = CreateTaskInput.model_json_schema()
    schema["properties"].pop("run", None)
    schema["properties"]["prompt"] = {
        **schema["properties"]["prompt"],
        "description": "The instruction for the agent that carries the task out: what to do, and what to answer",
    }
    schema["properties"]["todos"] = {
        **schema["properties"]["todos"],
        "description": "A plan for it, as markdown checkbox lines ('[ ] Collect the figures') or a list of "
        "{content} items; the agent delegates items to children that run in parallel on the fleet",
    }
    schema.pop("title", None)
    schema.pop("description", None)
    schema["additionalProperties"] = False
    return schema


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    schema.pop("title", None)
    schema.pop("description", None)
    schema["additionalProperties"] = False
    return schema


@dataclass(frozen=True)
class ToolDef:
    name: str
    needs: tuple[Scope, ...]  # any one of these lets a key see the tool (admin has all)
    description: str
    input_schema: dict[str, Any]
    read_only: bool = True


# The fields of CreateTaskInput run_task passes by name; any other one it passes on as it is (`Tools._run_task`).
_NAMED_RUN_FIELDS = {"prompt", "todos", "profile", "run", "budget_usd", "idempotency_key", "output_schema", "metadata"}
_READS = (Scope.READ, Scope.READ_ALL)
TOOLS: tuple[ToolDef, ...] = (
    ToolDef(
        "run_task",
        (Scope.SUBMIT,),
        "Hand a task to subq's fleet of AI agents and return at once with its id, status and the web page "
        "where a person can watch it. The agent carries out the instruction (and the plan, if given: each plan "
        "item can become a child agent, run in parallel). Follow it with wait_task (blocks, with progress) or "
        "get_task. Give an output_schema (JSON Schema) to get the answer as validated JSON in `output`; an "
        "idempotency_key makes a retried call return the first task instead of starting another.",
        _run_task_schema(),
        read_only=False,
    ),
    ToolDef(
        "get_task",
        _READS,
        "A task's state now: status (queued, running, delegated, active, completed, failed, cancelled), "
        "waiting_for (approval, children, admission, rate_limit, tool_limit, provider, or null), its result "
        "text, its typed output, its error, its own and its whole subtree's tokens and cost (micro-USD).",
        _schema(TaskArgs),
    ),
    ToolDef(
        "wait_task",
        _READS,
        "Wait until a task has ended (completed, failed or cancelled), at most timeout_s seconds, with a "
        "progress notification as its children finish; then answer as get_task does, with final figures (after "
        "a stop it waits for the stopped runs to record their spend). `settled: false` means it is still going: "
        "call again, or get_task later.",
        _schema(WaitArgs),
    ),
    ToolDef(
        "get_tree",
        _READS,
        "A task and its whole subtree: each task's plan items with each item's child, tokens and cost, and "
        "each task's own and total tokens and cost (micro-USD; 21000 is $0.021).",
        _schema(TaskArgs),
    ),
    ToolDef(
        "cancel_task",
        (Scope.SUBMIT, Scope.OPERATE),
        "Cancel a task and its whole subtree: queued children never start, running ones stop at their next "
        "step; what had finished is kept. Refused if it has already ended.",
        _schema(CancelArgs),
        read_only=False,
    ),
    ToolDef(
        "retry_task",
        (Scope.SUBMIT, Scope.OPERATE),
        "Run a failed task again from its kept conversation (finished tool calls are not run again; its "
        "spend adds up). failed=true retries every failed task of its subtree.",
        _schema(RetryArgs),
        read_only=False,
    ),
    ToolDef(
        "list_approvals",
        (Scope.DECIDE, *_READS),
        "Tool calls of subq's agents waiting for a human decision, oldest first: the tool, its arguments, "
        "the task and the plan item. Each task waits alone; its siblings go on.",
        _schema(ApprovalsArgs),
    ),
    ToolDef(
        "decide_approval",
        (Scope.DECIDE,),
        "Approve or deny a tool call waiting for a decision (list_approvals); only that task resumes. "
        "A denial's feedback is what the task's model is told.",
        _schema(DecideArgs),
        read_only=False,
    ),
)
_BY_NAME = {tool.name: tool for tool in TOOLS}

RESOURCE_TEMPLATES: tuple[types.ResourceTemplate, ...] = (
    types.ResourceTemplate(
        uri_template=RESOURCE_PREFIX + "{task_id}/tree",
        name="tree",
        description="A task's subtree as get_tree answers it (JSON)",
        mime_type=JSON_MIME,
    ),
    types.ResourceTemplate(
        uri_template=RESOURCE_PREFIX + "{task_id}/conversation",
        name="conversation",
        description="A task's conversation: its UI messages and its model conversation, oldest first (JSON)",
        mime_type=JSON_MIME,
    ),
    types.ResourceTemplate(
        uri_template=RESOURCE_PREFIX + "{task_id}/export",
        name="export",
        description="Every task of a subtree as `subq export` writes it: record, plan, UI messages, model "
        "conversation and typed output (JSON)",
        mime_type=JSON_MIME,
    ),
)


# -- what the tools answer -----------------------------------------------------------------------------


def task_view(record: TaskRecord, session: Session) -> dict[str, Any]:
    """A task as get_task, wait_task and run_task answer: what a calling model needs, figures as the API has them."""
    done = record.status.terminal or (record.runner == "caller" and record.status.value != "delegated")
    return {
        "id": record.id,
        "root_id": record.root_id,
        "parent_id": record.parent_id,
        "status": record.status.value,
        "settled": done,
        "waiting_for": record.waiting_for,
        "result": record.summary,
        "output": record.output,
        "error": record.error,
        "tokens": record.tokens,
        "cost_micros": record.cost_micros,
        "total_tokens": record.total_tokens,
        "total_cost_micros": record.total_cost_micros,
        "children": len(record.child_ids),
        "children_outstanding": len(record.awaiting_ids),
        "owner": record.owner,
        "metadata": record.metadata,
        "link": session.link(record.id, record.root_id),
    }


def _ok(value: Any) -> types.CallToolResult:
    text = json.dumps(value, ensure_ascii=False)
    structured = value if isinstance(value, dict) else {"result": value}
    return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=structured)


def _refused(exc: SubqError) -> types.CallToolResult:
    """A refusal in the API's words and shape (`{code, message, field}`): the message is the text the model reads."""
    body = {"code": exc.code, "message": exc.message, "field": exc.field}
    return types.CallToolResult(content=[types.TextContent(text=exc.message)], structured_content=body, is_error=True)


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Both backends block (the service on Redis, the client on HTTP): a thread keeps the event loop free.
    return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))


Progress = Callable[[float, float | None, str], Awaitable[None]]


class Tools:
    """The tools over one caller's `Session`."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.ops = session.ops

    def offered(self) -> list[types.Tool]:
        return [
            types.Tool(
                name=tool.name,
                description=tool.description,
                input_schema=tool.input_schema,
                annotations=types.ToolAnnotations(read_only_hint=tool.read_only, open_world_hint=False),
            )
            for tool in TOOLS
            if self.session.allows(tool)
        ]

    async def call(self, name: str, arguments: Mapping[str, Any], progress: Progress | None) -> types.CallToolResult:
        tool = _BY_NAME.get(name)
        if tool is None:
            return _refused(ValidationError(f"Unknown tool: {name!r} (the tools: {', '.join(_BY_NAME)})", field="name"))
        try:
            return _ok(await getattr(self, f"_{name}")(dict(arguments), progress))
        except NotFoundError as exc:
            if self.session.on_not_found is not None:
                await _call(self.session.on_not_found, name, exc.message)
            return _refused(exc)
        except SubqError as exc:
            return _refused(exc)

    async def _run_task(self, args: dict[str, Any], _progress: Progress | None) -> dict[str, Any]:
        if "run" in args:  # run_task always starts an agent: `run` is no argument of it
            raise ValidationError("run: Extra inputs are not permitted", field="run")
        given = CreateTaskInput.parse({**args, "run": True})
        # A field of POST /v1/tasks this face does not name (the tree's webhooks and on_complete, issue 40) is
        # passed on as given, in its JSON form, under its own name: the service and the client take it so.
        more = given.model_dump(mode="json", include=set(given.model_fields_set) - _NAMED_RUN_FIELDS)
        record = await _call(
            self.ops.create_task,
            given.prompt,
            todos=given.todos,
            profile=given.profile,
            run=True,
            budget_usd=given.budget_usd,
            idempotency_key=given.idempotency_key,
            output_schema=given.output_schema,
            metadata=given.metadata,
            **more,
        )
        return task_view(record, self.session)

    async def _get_task(self, args: dict[str, Any], _progress: Progress | None) -> dict[str, Any]:
        given = TaskArgs.parse(args)
        return task_view(await _call(self.ops.get_task, given.task_id), self.session)

    async def _wait_task(self, args: dict[str, Any], progress: Progress | None) -> dict[str, Any]:
        given = WaitArgs.parse(args)
        deadline = time.monotonic() + given.timeout_s
        told: tuple[int, int] | None = None
        while True:
            # Each poll is a read of its own, asked as the key is now (the /mcp face looks the key up again, the
            # stdio face sends a request): a key revoked during the wait ends it with that refusal.
            record = await _call(self.ops.get_task, given.task_id)
            view = task_view(record, self.session)
            done = len(record.child_ids) - len(record.awaiting_ids)
            # Told at once (a task that ended before the call still reports where it is), then at each change.
            if progress is not None and (done, len(record.child_ids)) != told:
                told = (done, len(record.child_ids))
                total = float(len(record.child_ids)) if record.child_ids else None
                await progress(
                    float(done), total, f"{record.status.value}: {done} of {len(record.child_ids)} children finished"
                )
            if view["settled"] and record.status.stopped:
                # A stop's late spend: the answer waits for the stopped runs to record it (Coordinator.wait's rule).
                hold = StopHold(deadline)
                while hold.due() and hold.holds(
                    await _call(finishing_if_known, self.ops.finishing_runs, record.id, hold.among)
                ):
                    await anyio.sleep(hold.look_in_s())
                view = task_view(await _call(self.ops.get_task, given.task_id), self.session)  # with that spend
            if view["settled"] or time.monotonic() >= deadline:
                return view
            await anyio.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))

    async def _get_tree(self, args: dict[str, Any], _progress: Progress | None) -> dict[str, Any]:
        given = TaskArgs.parse(args)
        node = await _call(self.ops.tree, given.task_id)
        tree: dict[str, Any] = node.model_dump(mode="json", exclude={"timeline", "tool_calls", "times"})
        return tree

    async def _cancel_task(self, args: dict[str, Any], _progress: Progress | None) -> dict[str, Any]:
        given = CancelArgs.parse(args)
        reason = CancelInput.parse({"reason": given.reason}).reason  # the reason's checks in the API's words
        return task_view(await _call(self.ops.cancel, given.task_id, reason), self.session)

    async def _retry_task(self, args: dict[str, Any], _progress: Progress | None) -> dict[str, Any]:
        given = RetryArgs.parse(args)
        RetryInput.parse({"failed": given.failed})
        done = await _call(self.ops.retry, given.task_id, failed=given.failed)
        retried: dict[str, Any] = done.model_dump(mode="json")
        return retried

    async def _list_approvals(self, args: dict[str, Any], _progress: Progress | None) -> dict[str, Any]:
        given = ApprovalsArgs.parse(args)
        approvals = await _call(self.ops.list_approvals, given.root_id)
        return {"approvals": [approval.model_dump(mode="json") for approval in approvals]}

    async def _decide_approval(self, args: dict[str, Any], _progress: Progress | None) -> dict[str, Any]:
        given = DecideArgs.parse(args)
        decision = DecisionInput.parse({"decision": given.decision, "feedback": given.feedback})
        decided = await _call(self.ops.decide, given.approval_id, decision.decision, decision.feedback)
        answer: dict[str, Any] = decided.model_dump(mode="json")
        return answer

    # -- resources ---------------------------------------------------------------------------------

    async def read(self, uri: str) -> str:
        """The JSON text of a resource `subq://tasks/<id>/<tree|conversation|export>`; NotFoundError otherwise."""
        rest = uri.removeprefix(RESOURCE_PREFIX) if uri.startswith(RESOURCE_PREFIX) else ""
        task_id, _, kind = rest.partition("/")
        if not task_id or kind not in {"tree", "conversation", "export"}:
            raise NotFoundError(
                f"Unknown resource: {uri} (subq://tasks/<task id>/tree, /conversation or /export)", field="uri"
            )
        if kind == "tree":
            value: Any = (await _call(self.ops.tree, task_id)).model_dump(mode="json")
        elif kind == "conversation":
            value = {
                "task_id": task_id,
                "ui_messages": await _call(self.ops.messages, task_id, "ui"),
                "api_conversation_history": await _call(self.ops.messages, task_id, "api"),
            }
        else:
            value = await self._export(task_id)
        return json.dumps(value, ensure_ascii=False)

    async def _export(self, task_id: str) -> dict[str, Any]:
        """The subtree as `subq export` writes its folders (coordinator/export.py), one entry per task, top first."""
        tasks: list[dict[str, Any]] = []
        queue = [task_id]
        while queue:
            current = queue.pop(0)
            record = await _call(self.ops.get_task, current)
            queue.extend(record.child_ids)
            tasks.append(
                {
                    "id": record.id,
                    "history_item": record.model_dump(mode="json", exclude={"timeline", "tool_calls"}),
                    "todos": [item.model_dump(mode="json") for item in await _call(self.ops.get_todos, current)],
                    "ui_messages": await _call(self.ops.messages, current, "ui"),
                    "api_conversation_history": await _call(self.ops.messages, current, "api"),
                    "output": {"schema": record.output_schema, "data": record.output},
                }
            )
        return {"task_id": task_id, "tasks": tasks}


# -- the MCP server both faces serve -------------------------------------------------------------------

SessionOf = Callable[["ServerRequestContext[Any, Any]"], Awaitable[Session]]

INSTRUCTIONS = (
    "subq runs tasks on a fleet of AI agents. run_task hands one over and returns at once with its id; "
    "wait_task waits for it (with progress), get_task and get_tree read it, cancel_task and retry_task "
    "control it. Money is integer micro-USD (21000 is $0.021)."
)


def _progress_to(ctx: ServerRequestContext[Any, Any]) -> Progress | None:
    """Where a tool call reports its progress: None unless the client sent a progress token with the call."""
    from mcp.shared.jsonrpc_dispatcher import progress_token_from_params

    token = progress_token_from_params(ctx.params)  # the raw `_meta.progressToken` the client sent
    if token is None:
        return None

    async def progress(done: float, total: float | None, message: str) -> None:
        # On the call's own stream (related to its request): a stateless /mcp has no other.
        await ctx.session.send_progress_notification(
            token, done, total, message, related_request_id=str(ctx.request_id)
        )

    return progress


async def _read_resource(tools: Tools, uri: str) -> str:
    """A resource's JSON text; a refusal becomes the MCP error a client reads (an unknown one is also told to
    the session's `on_not_found`)."""
    from mcp.shared.exceptions import MCPError

    try:
        return await tools.read(uri)
    except NotFoundError as exc:
        if tools.session.on_not_found is not None:
            await _call(tools.session.on_not_found, "resources/read", exc.message)
        raise MCPError(code=RESOURCE_NOT_FOUND, message=exc.message) from None
    except SubqError as exc:
        raise MCPError(code=types.INVALID_PARAMS, message=exc.message) from None


def build_server(session_of: SessionOf, version: str) -> Server[Any]:
    """The MCP server: each request's caller is `session_of(ctx)` (the key's gate, or the stdio face's client)."""
    from mcp.server.lowlevel import Server

    async def list_tools(ctx: ServerRequestContext[Any, Any], _params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=Tools(await session_of(ctx)).offered())

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        tools = Tools(await session_of(ctx))
        return await tools.call(params.name, params.arguments or {}, _progress_to(ctx))

    async def list_resources(ctx: ServerRequestContext[Any, Any], _params: Any) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[])

    async def list_templates(ctx: ServerRequestContext[Any, Any], _params: Any) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=list(RESOURCE_TEMPLATES))

    async def read_resource(
        ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        tools = Tools(await session_of(ctx))
        uri = str(params.uri)
        text = await _read_resource(tools, uri)
        return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, mime_type=JSON_MIME, text=text)])

    return Server(
        "subq",
        version=version,
        title="subq",
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_list_resource_templates=list_templates,
        on_read_resource=read_resource,
    )
