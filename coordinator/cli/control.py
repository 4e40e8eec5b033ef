"""Control commands: cancel a subtree, and list, approve or deny tool calls waiting for a decision.

Plain functions: coordinator/cli/__init__.py adds them to the app.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from coordinator.cli.common import JsonOption, TaskId, connect

__all__ = ["approvals", "approve", "cancel", "deny"]

ApprovalId = Annotated[str, typer.Argument(help="As `subq approvals` prints it.")]


def cancel(
    ctx: typer.Context,
    task_id: TaskId,
    reason: Annotated[str, typer.Option(help="Why: the parent (and you, later) read it.")],
    as_json: JsonOption = False,
) -> None:
    """Cancel a task and its whole subtree; finished results are kept and its parent hears why."""
    with connect(ctx) as coord:
        record = coord.cancel(task_id, reason)
        if as_json:
            typer.echo(record.model_dump_json(indent=2))
            return
        stopped = coord.subtree_ids(task_id)
        typer.echo(f"Cancelled {record.id} and its subtree ({len(stopped)} tasks): {record.error}")


def approvals(
    ctx: typer.Context,
    root: Annotated[str | None, typer.Option(help="Only the requests of this root's tree.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List tool calls waiting for a decision (oldest first)."""
    with connect(ctx) as coord:
        pending = coord.list_approvals(root)
    if as_json:
        typer.echo(json.dumps([a.model_dump(mode="json") for a in pending], indent=2))
        return
    if not pending:
        typer.echo("No tool call is waiting for a decision.")
    for approval in pending:
        todo = f"  for todo '{approval.todo_content}'" if approval.todo_content else ""
        typer.echo(f"{approval.id}  task {approval.task_id}  {approval.tool} {json.dumps(approval.args)}{todo}")


def approve(ctx: typer.Context, approval_id: ApprovalId) -> None:
    """Approve a waiting tool call: only that task goes on."""
    with connect(ctx) as coord:
        decided = coord.decide(approval_id, "approve")
    typer.echo(f"Approved {decided.id}: {decided.tool} of task {decided.task_id} goes on.")


def deny(
    ctx: typer.Context,
    approval_id: ApprovalId,
    feedback: Annotated[str, typer.Option(help="What the task's model is told instead of the tool's result.")] = "",
) -> None:
    """Deny a waiting tool call; the feedback goes back to that task's model."""
    with connect(ctx) as coord:
        decided = coord.decide(approval_id, "deny", feedback or None)
    typer.echo(f"Denied {decided.id}: task {decided.task_id} is told: {decided.feedback or 'the call was denied'}")
