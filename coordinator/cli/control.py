"""Control commands: cancel a subtree; retry failed work; list, approve or deny tool calls waiting for a decision; dead letters;
the audit log.

Plain functions: coordinator/cli/__init__.py adds them to the app.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from coordinator.cli.common import JsonOption, TaskId, connect, say, say_json
from coordinator.errors import ValidationError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from coordinator.models import Approval, Delivery
    from coordinator.tree import TreeNode

__all__ = [
    "approvals",
    "approve",
    "audit",
    "cancel",
    "dead_letters",
    "deliveries",
    "deny",
    "redeliver",
    "retry",
    "tenants",
]

# A screenful; the service takes up to 500 at once.
DEAD_LETTERS_SHOWN = 20

ApprovalId = Annotated[str, typer.Argument(help="As `subq approvals` prints it.")]

Entry = TypeVar("Entry", bound="BaseModel")


def _say_entries(
    entries: Sequence[Entry], as_json: bool, none: str, lines: Callable[[Sequence[Entry]], Iterable[str]]
) -> None:
    """A listing command's output: the entries as a JSON list with --json, else `none` when there are none and
    their lines (a model's text in them escaped, as `say` prints)."""
    if as_json:
        say_json([entry.model_dump(mode="json") for entry in entries])
        return
    if not entries:
        typer.echo(none)
    for line in lines(entries):
        say(line)


def cancel(
    ctx: typer.Context,
    task_id: TaskId,
    reason: Annotated[str, typer.Option(help="Why: the parent (and you, later) read it.")],
    as_json: JsonOption = False,
) -> None:
    """Cancel a task and its whole subtree; finished results are kept and its parent hears why."""
    from coordinator.inputs import CancelInput

    given = CancelInput.parse({"reason": reason})
    with connect(ctx) as coord:
        record = coord.cancel(task_id, given.reason)
        if as_json:
            say_json(record)
            return
        below = _cancelled_below(coord.tree(task_id), task_id)
    reason_given = record.error.removeprefix(CANCELLED_PREFIX)
    tasks = f"{below} task{'' if below == 1 else 's'}"
    say(f"Cancelled {record.id} and {tasks} below it that had not ended: {reason_given}")  # the reason escaped


# How the service words a cancelled task's error (coordinator/control.py): the task the
# operator named gets "cancelled: <reason>", each descendant it stopped
# "cancelled with <task id>: <reason>".
CANCELLED_PREFIX = "cancelled: "


def _cancelled_below(node: TreeNode, task_id: str) -> int:
    """Descendants this cancel stopped: not those that had ended, nor those an earlier cancel stopped."""
    from coordinator.models import TaskStatus
    from coordinator.tree import walk

    stopped_by = f"cancelled with {task_id}: "
    return sum(
        1
        for task in walk(node)
        if task.id != task_id and task.status == TaskStatus.CANCELLED and stopped_by in task.error
    )


def retry(
    ctx: typer.Context,
    task_id: TaskId,
    failed: Annotated[
        bool,
        typer.Option(
            "--failed",
            help="Retry every failed task of the task's tree, children before parents (its parents resume with "
            "the new results), not the task alone.",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Run a failed task again from its conversation: finished tool calls are not run again, its spend stays.

    Only a failed task can be retried; one that failed on its budget, or whose parent already went on with
    its result, is refused with why (with --failed on the root, such a parent takes the new results when
    it failed too and had not gone further). Follow it with `subq status ID` or `subq result ID`.
    """
    from coordinator.inputs import RetryInput

    given = RetryInput.parse({"failed": failed})
    with connect(ctx) as coord:
        done = coord.retry(task_id, failed=given.failed)
    if as_json:
        say_json(done)
        return
    for retried in done.retried:
        say(f"Retried {retried}: it runs again from its conversation.")  # (ids a server answered: shown as text)
    for reopened in done.reopened:
        say(f"Retried {reopened}: it waits on its retried children and resumes with their new results.")
    for skipped in done.skipped:
        say(f"Left {skipped.task_id}: {skipped.reason}", err=True)  # stdout lists only what runs again


def approvals(
    ctx: typer.Context,
    root: Annotated[str | None, typer.Option(help="Only the requests of this root's tree.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List tool calls waiting for a decision (oldest first)."""
    with connect(ctx) as coord:
        pending = coord.list_approvals(root)
    _say_entries(pending, as_json, "No tool call is waiting for a decision.", _approval_lines)


def _approval_lines(pending: Sequence[Approval]) -> Iterable[str]:
    for approval in pending:
        todo = f"  for todo '{approval.todo_content}'" if approval.todo_content else ""
        yield f"{approval.id}  task {approval.task_id}  {approval.tool} {json.dumps(approval.args)}{todo}"


def approve(ctx: typer.Context, approval_id: ApprovalId) -> None:
    """Approve a waiting tool call: only that task goes on."""
    decided = _decide(ctx, approval_id, {"decision": "approve"})
    say(f"Approved {decided.id}: {decided.tool} of task {decided.task_id} goes on.")


def deny(
    ctx: typer.Context,
    approval_id: ApprovalId,
    feedback: Annotated[str, typer.Option(help="What the task's model is told instead of the tool's result.")] = "",
) -> None:
    """Deny a waiting tool call; the feedback goes back to that task's model."""
    decided = _decide(ctx, approval_id, {"decision": "deny", "feedback": feedback or None})
    say(f"Denied {decided.id}: task {decided.task_id} is told: {decided.feedback or 'the call was denied'}")


def _decide(ctx: typer.Context, approval_id: str, decision: dict[str, str | None]) -> Approval:
    """The decision read with the API's model of it, then made."""
    from coordinator.inputs import DecisionInput

    given = DecisionInput.parse(decision)
    with connect(ctx) as coord:
        return coord.decide(approval_id, given.decision, given.feedback)


def deliveries(ctx: typer.Context, task_id: TaskId, as_json: JsonOption = False) -> None:
    """List the tree's deliveries of outbound events (webhooks, Celery callbacks): each one's event, target,
    state, attempts, next try and last answer (docs/webhooks.md)."""
    with connect(ctx) as coord:
        found = coord.deliveries(task_id)
    _say_entries(found, as_json, "No deliveries.", _delivery_lines)


def _delivery_lines(found: Sequence[Delivery]) -> Iterable[str]:
    import time

    for d in found:
        when = f" next in {max(0.0, d.next_at - time.time()):.0f}s" if d.next_at and d.state == "retrying" else ""
        last = f" ({d.last})" if d.last else ""
        yield f"{d.id}  {d.type:<18} {d.state:<9} {d.attempts} attempt(s){when}{last}  -> {d.target}"


def redeliver(
    ctx: typer.Context,
    task_id: TaskId,
    delivery_id: Annotated[str, typer.Argument(help="As `subq deliveries` prints it.")],
    as_json: JsonOption = False,
) -> None:
    """Send a delivery of the task's tree again now, whatever its state (scope operate; on the audit log)."""
    with connect(ctx) as coord:
        done = coord.redeliver(task_id, delivery_id)
    if as_json:
        say_json(done)
        return
    say(f"Redelivering {done.id} ({done.type}) to {done.target}")


def dead_letters(
    ctx: typer.Context,
    limit: Annotated[
        int | None, typer.Option(help=f"Most to show, newest first (1-500, default {DEAD_LETTERS_SHOWN}).")
    ] = None,
    purge: Annotated[bool, typer.Option("--purge", help="Delete every dead letter instead of listing them.")] = False,
    as_json: JsonOption = False,
) -> None:
    """List the messages no worker could decode or validate (newest first), or delete them all with --purge."""
    if purge and limit is not None:
        raise ValidationError("--purge deletes every dead letter; it takes no --limit", field="limit")
    with connect(ctx) as coord:
        if purge:
            purged = coord.purge_dead_letters()
            typer.echo(json.dumps({"purged": purged}) if as_json else f"Purged {purged} dead letters.")
            return
        shown = coord.dead_letters(DEAD_LETTERS_SHOWN if limit is None else limit)
        count = coord.count_dead_letters()
    from coordinator.cli.views import dead_letter_lines

    _say_entries(shown, as_json, "No dead letters.", dead_letter_lines)
    if not as_json and count > len(shown):
        typer.echo(f"({count - len(shown)} older: subq dead-letters --limit {min(count, 500)})", err=True)


def tenants(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Each tenant: tasks running and waiting, roots running, submits this minute and today's spend against its
    quotas (scope operate; docs/tenants.md)."""
    with connect(ctx) as coord:
        found = coord.tenants()
    from coordinator.cli.views import tenant_lines

    _say_entries(found, as_json, "No tenants yet.", tenant_lines)


# A screenful of the audit log; the service takes up to 500 at once.
AUDIT_SHOWN = 20


def audit(
    ctx: typer.Context,
    limit: Annotated[
        int, typer.Option(help=f"Most entries to show, newest first (1-500, default {AUDIT_SHOWN}).")
    ] = AUDIT_SHOWN,
    before: Annotated[
        str | None, typer.Option(help="Only entries older than this entry id (the cursor the last page printed).")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """List the audit log, newest first: every decision, cancel, retry, purge, web sign-in and refused request.

    Each line: when (UTC), who (the API key's name; `local` for a step taken straight on Redis), what,
    on which target, from which address and through which face. Through the API it needs the scope
    `operate` or `admin`.
    """
    with connect(ctx) as coord:
        entries, next_before = coord.audit(limit, before)
    if as_json:
        page = {"entries": [e.model_dump(mode="json") for e in entries], "next_before": next_before}
        typer.echo(json.dumps(page, indent=2))
        return
    from coordinator.cli.views import audit_lines

    if not entries:
        typer.echo("No entries.")
    for line in audit_lines(entries):
        say(line)
    if next_before is not None:
        say(f"(older: subq audit --before {next_before})", err=True)
