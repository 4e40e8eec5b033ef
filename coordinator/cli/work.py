"""Commands that start, follow and read work: run (--follow), status, result, todos, tree, history, export.

What they print is in views.py, imported when a command runs (it loads the
pydantic models), so that `subq --help` stays light. Plain functions:
coordinator/cli/__init__.py adds them to the app.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from coordinator.cli.common import JsonOption, TaskId, connect, say, say_json
from coordinator.errors import ValidationError

# A page of `subq history` when --limit is left out.
HISTORY_PAGE = 20
# The widths a timeline is drawn at (views.py draws it; the bounds are checked before connecting).
TIMELINE_MIN_WIDTH = 40
TIMELINE_MAX_WIDTH = 1000

__all__ = ["export", "history", "result", "run", "status", "todos", "tree"]


# -- starting and following work ---------------------------------------------------------


def run(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Argument(help="What the root agent should do.")],
    todos: Annotated[
        Path | None,
        typer.Option(help="A file with the root's todo list: '[ ] item' lines or a JSON list; '-' reads stdin."),
    ] = None,
    profile: Annotated[str | None, typer.Option(help="Model profile (default: SUBQ_DEFAULT_PROFILE).")] = None,
    follow: Annotated[
        bool, typer.Option("--follow", help="Show the tree live until the run ends; exit 1 unless it completed.")
    ] = False,
    budget: Annotated[
        str | None, typer.Option(help="Most the whole tree may spend, in US dollars (e.g. 0.50); it stops there.")
    ] = None,
    output_schema: Annotated[
        Path | None,
        typer.Option(
            help="A file with a JSON Schema (an object) the result's data is held to: the agent ends with "
            "attempt_completion(result, data), and `subq result ID --json` shows the data as `output`; '-' reads stdin."
        ),
    ] = None,
    meta: Annotated[
        list[str] | None,
        typer.Option(
            "--meta",
            metavar="KEY=VALUE",
            help="Tag the tree with your own data (repeatable): a job id, a customer, a ticket. Every task of the "
            "tree carries it, and `subq history --meta KEY=VALUE` finds it. At most 16 keys of 1-64 characters "
            "A-Z a-z 0-9 _ . -, each value 1-256 printable characters.",
        ),
    ] = None,
    webhook: Annotated[
        list[str] | None,
        typer.Option(
            "--webhook",
            metavar="URL",
            help="POST the tree's events there (repeatable, at most 5): its end, approvals, budget warnings, "
            "signed per Standard Webhooks (docs/webhooks.md). Public addresses only, unless SUBQ_WEBHOOK_ALLOW "
            "names the host.",
        ),
    ] = None,
    webhook_secret_env: Annotated[
        str | None,
        typer.Option(
            "--webhook-secret-env",
            metavar="VAR",
            help="The environment variable holding the webhooks' signing secret (whsec_...): a secret is never "
            "given on the command line, where `ps` shows it.",
        ),
    ] = None,
    webhook_event: Annotated[
        list[str] | None,
        typer.Option(
            "--webhook-event",
            metavar="EVENT",
            help="The events the webhooks get (repeatable; default task.* approval.* budget.*; child.* adds "
            "every child's end).",
        ),
    ] = None,
    priority: Annotated[
        int | None,
        typer.Option(
            help="1-5 (default 3): within its tenant's share, a higher priority starts first; cut to the "
            "tenant's max_priority (docs/tenants.md).",
        ),
    ] = None,
    on_complete: Annotated[
        str | None,
        typer.Option(
            "--on-complete",
            metavar="TASK",
            help="A Celery task sent by name (queue `celery`) with the finished root's record (docs/celery-contract.md).",
        ),
    ] = None,
) -> None:
    """Start a root agent on the fleet and print its id.

    The agent plans with its todo list, delegates to subagents and completes.
    """
    # On use: `subq --help` loads no models.
    from coordinator.inputs import CreateTaskInput, meta_pairs, sendable_profile

    # Checked here as the HTTP client checks it, so the line is the same on Redis and through the API.
    sendable_profile(profile)
    metadata = meta_pairs(meta, "--meta") if meta else None
    webhooks = _webhooks(webhook or [], webhook_secret_env, webhook_event or [])
    if str(todos) == str(output_schema) == STDIN:
        # The first to read stdin would leave the second nothing: refused before either is read.
        raise ValidationError(
            "--todos and --output-schema cannot both read stdin ('-'): give one as a file", field="output_schema"
        )
    todo_text = _read_todos(todos) if todos is not None else None
    schema = _read_schema(output_schema) if output_schema is not None else None
    # The API's model of the operation, so a bad prompt, budget or schema reads the same either
    # way, and is refused before anything is reached.
    given = CreateTaskInput.parse(
        {
            "prompt": prompt, "todos": todo_text, "profile": profile, "run": True, "budget_usd": budget,
            "output_schema": schema, "metadata": metadata, "webhooks": webhooks, "on_complete": on_complete,
            "priority": priority,
        }
    )  # fmt: skip
    with connect(ctx) as coord:
        record = coord.create_task(**dict(given))
        say(record.id)  # a server's answer: shown as text
        _warn_ignored_lines(todo_text)
        if follow:
            from coordinator.cli.views import follow_run

            raise typer.Exit(follow_run(coord, record.id))


def _webhooks(urls: list[str], secret_env: str | None, events: list[str]) -> list[dict[str, Any]] | None:
    """`--webhook` URLs with the secret `--webhook-secret-env` names and the `--webhook-event` events."""
    if not urls:
        if secret_env or events:
            raise ValidationError("--webhook-secret-env and --webhook-event need a --webhook URL", field="webhook")
        return None
    secret = None
    if secret_env:
        # A variable the caller names on the command line, read as the argument it stands for (not a
        # subq setting): the secret itself never appears in the process list or the shell's history.
        secret = os.environ.get(secret_env)
        if not secret:
            raise ValidationError(f"--webhook-secret-env: ${secret_env} is not set", field="webhook_secret_env")
    return [
        {"url": url, **({"secret": secret} if secret else {}), **({"events": events} if events else {})} for url in urls
    ]


def _warn_ignored_lines(todo_text: str | None) -> None:
    """On stderr, each line of the plan that looks like an item but was not read as one."""
    from coordinator.todos import ignored_lines

    for line in ignored_lines(todo_text):
        typer.echo(f"subq: warning: --todos {line}", err=True)


# The path that names stdin, for --todos and --output-schema.
STDIN = "-"


def _read_text(path: Path, option: str, field: str) -> str:
    """The UTF-8 text of the file `option` names ('-': stdin), or one line saying why it cannot be read.

    Stdin is read as bytes and decoded as a file is: its text layer decodes with the locale's encoding and
    `surrogateescape`, so under LC_ALL=C a byte that is no UTF-8 became a lone surrogate, stored as '?' (or
    a traceback through the API)."""
    try:
        data = sys.stdin.buffer.read() if str(path) == STDIN else path.read_bytes()
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValidationError(f"Cannot read {option} {path}: {reason}", field=field) from None


def _read_todos(path: Path) -> str:
    return _read_text(path, "--todos", "todos")


def _read_schema(path: Path) -> object:
    """The JSON in `--output-schema FILE` ('-': stdin); CreateTaskInput then checks it is a usable schema."""
    text = _read_text(path, "--output-schema", "output_schema")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        why = f"{exc.msg} (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else "nested too deep"
        raise ValidationError(f"--output-schema {path} is not JSON: {why}", field="output_schema") from None


# -- reading -----------------------------------------------------------------------------


def status(ctx: typer.Context, task_id: TaskId, as_json: JsonOption = False) -> None:
    """Show one task: status, place in the tree, own and total tokens and cost."""
    from coordinator.cli.views import status_lines

    with connect(ctx) as coord:
        record = coord.get_task(task_id)
    if as_json:
        say_json(record)
        return
    for line in status_lines(record):
        say(line)


def result(ctx: typer.Context, task_id: TaskId, as_json: JsonOption = False) -> None:
    """Print a completed task's result text (what its parent reads), then its output as JSON when it has an
    output schema; --json prints its whole record (its data is `output`).

    A task that has not ended, or ended failed or cancelled, has no result: one line on stderr says
    what it is (what it waits for, its error) and the exit code is 1.
    """
    from coordinator.tree import waiting_note

    with connect(ctx) as coord:
        record = coord.get_task(task_id)
    if as_json:
        say_json(record)
        return
    if record.status.value == "completed":
        say(record.summary)
        if record.output is not None:  # a typed task's data, after its words: JSON a program can read
            say_json(record.output)
        return
    if record.status.terminal:
        why = f"{record.error_class}: {record.error}" if record.error else "no detail"
        say(f"subq: task {record.id} {record.status.value}, no result: {why}", err=True)
    else:
        waiting = waiting_note(record.waiting_for)
        say(f"subq: task {record.id} is {record.status.value}{waiting}: no result yet", err=True)
    raise typer.Exit(1)


def todos(ctx: typer.Context, task_id: TaskId, as_json: JsonOption = False) -> None:
    """Show a task's todo list with each item's subtask, tokens and cost."""
    from coordinator.cli.views import todo_lines

    with connect(ctx) as coord:
        items = coord.get_todos(task_id)
        record = coord.get_task(task_id)
    if as_json:
        typer.echo(json.dumps([i.model_dump(mode="json") for i in items], indent=2))
        return
    for line in todo_lines(items, record.unlinked_tokens, record.unlinked_cost_micros):
        say(line)


def tree(
    ctx: typer.Context,
    task_id: TaskId,
    as_json: JsonOption = False,
    timeline: Annotated[
        bool,
        typer.Option(
            "--timeline",
            help="Draw the tree as bars on one time axis: queued, running, each wait by its reason; "
            "the critical path starred.",
        ),
    ] = False,
    width: Annotated[
        int | None,
        typer.Option(help="Columns the timeline is fitted to (40-1000; default: the terminal's width)."),
    ] = None,
) -> None:
    """Show a task and its whole subtree: every todo item's status, tokens and cost, own/total and wall time
    per task; with --timeline, where each task's time went."""
    from coordinator.tree import render_tree

    if width is not None and not timeline:
        raise ValidationError("--width applies to --timeline only", field="width")
    if timeline and as_json:
        raise ValidationError("--timeline draws bars; --json prints the tree with its intervals: pick one")
    if width is not None and not TIMELINE_MIN_WIDTH <= width <= TIMELINE_MAX_WIDTH:
        raise ValidationError(
            f"--width must be {TIMELINE_MIN_WIDTH} to {TIMELINE_MAX_WIDTH} columns, not {width}", field="width"
        )
    with connect(ctx) as coord:
        node = coord.tree(task_id)
    if as_json:
        say_json(node)
    elif timeline:
        from rich.console import Console

        from coordinator.cli.views import timeline_text

        console = Console(width=width, highlight=False, soft_wrap=False)
        console.print(timeline_text(node, width or console.width), no_wrap=True, overflow="crop", crop=True)
    else:
        say("\n".join(render_tree(node)))


def history(
    ctx: typer.Context,
    status: Annotated[
        str | None, typer.Option(help="Only tasks in this status (active, delegated, completed, failed, cancelled).")
    ] = None,
    root: Annotated[str | None, typer.Option(help="Only the tasks of this root's tree.")] = None,
    limit: Annotated[int, typer.Option(help="Most tasks to show (1-500).")] = HISTORY_PAGE,
    cursor: Annotated[int, typer.Option(help="Where to go on from, as the previous page printed.")] = 0,
    meta: Annotated[
        list[str] | None,
        typer.Option(
            "--meta",
            metavar="KEY=VALUE",
            help="Only the tasks of trees tagged with this (`subq run --meta`); repeat it to need every one.",
        ),
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="Only the tasks of trees run for this tenant.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List tasks, newest first, with their own and subtree figures (and their tree's metadata)."""
    from coordinator.cli.views import history_lines
    from coordinator.inputs import meta_pairs

    wanted = meta_pairs(meta, "--meta") if meta else None  # refused before anything is reached
    with connect(ctx) as coord:
        items, next_cursor = coord.list_tasks(
            status=status, root_id=root, limit=limit, cursor=cursor, metadata=wanted, tenant=tenant
        )
    if as_json:
        page = {"items": [i.model_dump(mode="json") for i in items], "next_cursor": next_cursor}
        typer.echo(json.dumps(page, indent=2))
        return
    for line in history_lines(items):
        say(line)
    if next_cursor is not None:
        filters = {"--status": status, "--root": root, "--tenant": tenant}
        typer.echo(f"(more: {_history_command(filters, meta or [], limit, next_cursor)})", err=True)


def _history_command(filters: dict[str, str | None], meta: list[str], limit: int, cursor: int) -> str:
    """The `subq history` that goes on from `cursor` with the same filters and page size, quoted for a shell:
    the cursor alone went on through every task, not the filtered ones."""
    words = ["subq", "history"]
    for option, value in filters.items():
        words += [option, value] if value is not None else []
    for pair in meta:
        words += ["--meta", pair]
    words += ["--limit", str(limit)] if limit != HISTORY_PAGE else []
    return shlex.join([*words, "--cursor", str(cursor)])


def export(
    ctx: typer.Context,
    task_id: TaskId,
    directory: Annotated[Path, typer.Argument(help="Folder to write into (created if missing).")],
) -> None:
    """Write a task's subtree as folders of JSON (conversation, UI messages, history item, todos, timeline, output)."""
    from coordinator.export import export_tree

    with connect(ctx) as coord:
        files = export_tree(coord, task_id, directory)
    tasks = len({f.parent for f in files})
    typer.echo(f"Exported {tasks} tasks ({len(files)} files) to {directory}")
