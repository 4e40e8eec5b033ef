"""The /v1 task endpoints: create, delegate, read, update todos, history.

Each handler is a plain `def`: the Coordinator talks to Redis synchronously,
so FastAPI runs handlers in its thread pool and the event loop stays free.
Each one is a thin call into the same Coordinator the CLI uses; a body is read
with its operation's input model (coordinator/inputs.py), the one `subq.submit`
and the CLI use, and the Coordinator validates everything before it writes anything.
Each first asks the `Gate` (coordinator/api/auth.py) whether the caller's key may:
a tree it may not read is a 404, a missing scope a 403 naming it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.routing import APIRoute

from coordinator.access import Scope
from coordinator.api.auth import Caller, Gate
from coordinator.api.errors import error_responses
from coordinator.api.schemas import CreatedTask, DelegationResult, HistoryPage, MessageList, TodoList, TodosUpdated
from coordinator.errors import ValidationError
from coordinator.ids import ROOT_ID_PATTERN
from coordinator.inputs import (
    MAX_CURSOR,
    META_PREFIX,
    CreateTaskInput,
    DelegateInput,
    TodosInput,
    finishing_among,
    meta_filter,
)
from coordinator.models import FINISHING_AMONG_MAX, FinishingRuns, TaskRecord, TaskStatus
from coordinator.service import DEFAULT_PAGE, MAX_PAGE, Coordinator
from coordinator.todos import ignored_lines
from coordinator.tree import TreeNode

__all__ = ["TaskId", "reject_unknown_query", "task_routes"]

# The routes that take `meta.<key>=<value>` filters besides their declared parameters (their names are
# the caller's own keys, so OpenAPI cannot list them): the history.
META_FILTERED_ROUTES = frozenset({"list_tasks"})

TaskId = Annotated[
    str,
    Path(description="A task id: 16 hex digits for a root, `<root>-<12 hex>` for a descendant"),
]


async def reject_unknown_query(request: Request) -> None:
    """Refuse a query parameter the endpoint does not take, as bodies refuse unknown fields.

    A typo such as `?staus=failed` would otherwise return the unfiltered history.
    """
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    allowed = {param.alias for param in route.dependant.query_params}
    meta = route.name in META_FILTERED_ROUTES
    for name in request.query_params:
        if name not in allowed and not (meta and name.startswith(META_PREFIX)):
            takes = ", ".join([*sorted(allowed), *([f"{META_PREFIX}<key>"] if meta else [])]) or "no query parameters"
            raise ValidationError(f"{name}: unknown query parameter (this endpoint takes {takes})", field=name)


def task_routes(coord: Coordinator, *, auth: bool) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["tasks"])
    denied = (401, 403) if auth else ()
    gate = Gate(coord)

    @router.post(
        "/tasks",
        status_code=201,
        response_model=CreatedTask,
        responses=error_responses(*denied, 413, 422, 503),
        summary="Create a root task",
        dependencies=[gate.needs(Scope.SUBMIT)],
    )
    def create_task(request: Request, key: Caller, body: CreateTaskInput) -> CreatedTask:
        """A caller-owned task (`run: false`, you delegate) or an agent on the fleet (`run: true`).

        `ignored_todo_lines` names the plan's lines that look like items but were not read as any.
        The tree belongs to the caller's key (scope `submit`)."""
        gate.need(request, key, Scope.SUBMIT)
        record = coord.create_task(
            body.prompt,
            todos=body.todos,
            profile=body.profile,
            run=body.run,
            budget_usd=body.budget_usd,
            idempotency_key=body.idempotency_key,
            owner=key.name,
            tenant=key.tenant,
            priority=body.priority,
            output_schema=body.output_schema,
            metadata=body.metadata,
            webhooks=body.webhooks,
            on_complete=body.on_complete,
            key_webhooks=key.webhooks,
        )
        return CreatedTask(**dict(record), ignored_todo_lines=ignored_lines(body.todos))

    @router.post(
        "/tasks/{task_id}/subtasks",
        status_code=202,
        response_model=DelegationResult,
        responses=error_responses(*denied, 404, 409, 413, 422, 503),
        summary="Delegate subtasks to children",
        dependencies=[gate.writes()],
    )
    def delegate(request: Request, key: Caller, task_id: TaskId, body: DelegateInput) -> DelegationResult:
        """Validated as a whole, committed atomically, then published; 202: the children run on the fleet.
        (`gate.writes`, its dependency, checked the key may change the tree.)"""
        batch = coord.delegate(task_id, body.subtasks, body.mode)
        return DelegationResult(
            batch_id=batch.id, parent_id=batch.parent_id, mode=batch.mode, child_ids=batch.child_ids
        )

    @router.get(
        "/tasks/{task_id}",
        response_model=TaskRecord,
        responses=error_responses(*denied, 404, 503),
        summary="A task with its own and total figures",
    )
    def get_task(request: Request, key: Caller, task_id: TaskId) -> TaskRecord:
        """Own usage (`tokens_in`, `tokens_out`, `cost_micros`) and the subtree's (`total_tokens`, `total_cost_micros`)."""
        gate.need(request, key, Scope.READ, Scope.READ_ALL)
        record = coord.get_task(task_id)  # the record names its owner: no second read
        gate.readable_on_record(request, key, task_id, record.owner)
        return record

    @router.get(
        "/tasks/{task_id}/todos",
        response_model=TodoList,
        responses=error_responses(*denied, 404, 503),
        summary="A task's todo list with each item's subtask, tokens and cost",
    )
    def get_todos(request: Request, key: Caller, task_id: TaskId) -> TodoList:
        gate.read_tree(request, key, task_id)
        return TodoList(task_id=task_id, todos=coord.get_todos(task_id))

    @router.put(
        "/tasks/{task_id}/todos",
        response_model=TodosUpdated,
        responses=error_responses(*denied, 404, 409, 413, 422, 503),
        summary="Replace a task's todo list",
        dependencies=[gate.writes()],
    )
    def update_todos(request: Request, key: Caller, task_id: TaskId, body: TodosInput) -> TodosUpdated:
        """Links and figures of existing items survive the rewrite; an update with no items is refused.

        `ignored_lines` names the lines that look like items but were not read as any. (`gate.writes`, its
        dependency, checked the key may change the tree.)"""
        items = coord.update_todos(task_id, body.todos)
        return TodosUpdated(task_id=task_id, todos=items, ignored_lines=ignored_lines(body.todos))

    @router.get(
        "/tasks/{task_id}/tree",
        response_model=TreeNode,
        responses=error_responses(*denied, 404, 503),
        summary="The task's subtree: every task with its todos, own and total figures",
    )
    def tree(request: Request, key: Caller, task_id: TaskId) -> TreeNode:
        gate.read_tree(request, key, task_id)
        return coord.tree(task_id)

    @router.get(
        "/tasks/{task_id}/finishing",
        response_model=FinishingRuns,
        responses=error_responses(*denied, 404, 422, 503),
        summary="The tasks of the subtree whose runs may still record spend",
    )
    def finishing_runs(
        request: Request,
        key: Caller,
        task_id: TaskId,
        among: Annotated[
            str | None,
            Query(
                description="Look only at these tasks of the tree, comma-separated (at most "
                f"{FINISHING_AMONG_MAX}; empty for none): the `task_ids` of the last look. Left out, the whole "
                "subtree is walked."
            ),
        ] = None,
    ) -> FinishingRuns:
        """A stopped run may record what its provider billed after its task settled (late spend). A tree that
        ended `cancelled` or `failed` has its final figures once `task_ids` is empty; wait at most `lapse_s` from
        the first look, send each later look `among` the last one's tasks (a stopped tree starts no new run), and
        walk once more when none of them is left (a child a stop's later pass reached after its run began). The
        clients' `wait` and MCP's `wait_task` hold their answer so."""
        named = None if among is None else finishing_among(among)
        gate.read_tree(request, key, task_id)
        return coord.finishing_runs(task_id, among=named)

    @router.get(
        "/tasks/{task_id}/messages",
        response_model=MessageList,
        responses=error_responses(*denied, 404, 422, 503),
        summary="The task's UI messages or model conversation, oldest first",
    )
    def messages(
        request: Request,
        key: Caller,
        task_id: TaskId,
        kind: Annotated[Literal["ui", "api"], Query(description="ui: UI messages; api: the model conversation")] = "ui",
    ) -> MessageList:
        gate.read_tree(request, key, task_id)
        return MessageList(task_id=task_id, kind=kind, messages=coord.messages(task_id, kind))

    @router.get(
        "/tasks",
        name="list_tasks",
        response_model=HistoryPage,
        responses=error_responses(*denied, 422, 503),
        summary="The history: tasks newest first, with their figures",
    )
    def list_tasks(
        request: Request,
        key: Caller,
        status: Annotated[TaskStatus | None, Query(description="Only tasks with this status")] = None,
        root_id: Annotated[
            str | None, Query(pattern=ROOT_ID_PATTERN, description="Only tasks of this root's tree")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="Most items in the page")] = DEFAULT_PAGE,
        cursor: Annotated[
            int, Query(ge=0, le=MAX_CURSOR, description="`next_cursor` of the previous page; 0 for the first")
        ] = 0,
        tenant: Annotated[
            str | None, Query(max_length=64, description="Only tasks of trees run for this tenant (docs/tenants.md)")
        ] = None,
    ) -> HistoryPage:
        """A key with `read` (not `read_all`) sees the tasks of the trees it created.

        `meta.<key>=<value>` (repeatable, one per key): only the tasks of trees whose metadata holds every
        one of those pairs, e.g. `?meta.customer=acme&meta.ticket=T-1234`."""
        owner = gate.history_owner(request, key)
        pairs = [
            (name.removeprefix(META_PREFIX), value)
            for name, value in request.query_params.multi_items()
            if name.startswith(META_PREFIX)
        ]
        items, next_cursor = coord.list_tasks(
            status=status.value if status else None, root_id=root_id, limit=limit, cursor=cursor, owner=owner,
            metadata=meta_filter(pairs) if pairs else None, tenant=tenant,
        )  # fmt: skip
        return HistoryPage(items=items, next_cursor=next_cursor)

    return router
