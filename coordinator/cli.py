"""The `subq` command: a thin CLI over the Coordinator (docs/cli.md).

Every command has `--help`. Errors are one line on stderr and a non-zero exit,
never a traceback: subq's own errors exit 1, malformed arguments (click's usage
errors) exit 2. Read commands take `--json` for scripts. The shared options
(`--redis-url`, `--key-prefix`, `--queue`) come before the command and fall back
to the `SUBQ_` environment through `Settings`.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from kombu.exceptions import OperationalError

from coordinator import up as stack
from coordinator.errors import ConfigError, SubqError, ValidationError
from coordinator.fleet import settings_env
from coordinator.models import MICROS_PER_USD, LiveState, TaskStatus, format_usd
from coordinator.render import MARKS, cut, describe, render_tree, walk
from coordinator.service import Coordinator
from coordinator.settings import Settings, load_settings
from coordinator.tree import build_tree

__all__ = ["app", "main", "run_cli"]

app = typer.Typer(
    name="subq",
    help="subq: a distributed job queue for AI subagents (Celery + Redis). Start with `subq up`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead.")]
TaskId = Annotated[str, typer.Argument(help="A task id, as `subq run` or `subq history` prints it.")]
Port = Annotated[int, typer.Option(min=1, max=65535, help="TCP port to listen on.")]
Host = Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 for every interface).")]
# Long descriptions and todo items are cut so one task stays on one line.
HISTORY_TASK_CHARS = 50
# A live view redraws on every event of the tree's stream and at least this often:
# a safety net, so an event trimmed from the capped stream cannot freeze the view.
FOLLOW_POLL_MS = 1000


@app.callback()
def shared_options(
    ctx: typer.Context,
    redis_url: Annotated[
        str | None, typer.Option(help="Redis for broker, results and state (default: $SUBQ_REDIS_URL).")
    ] = None,
    key_prefix: Annotated[
        str | None, typer.Option(help="Prefix of subq's Redis keys (default: $SUBQ_KEY_PREFIX).")
    ] = None,
    queue: Annotated[str | None, typer.Option(help="Celery queue of subq's tasks (default: $SUBQ_QUEUE).")] = None,
) -> None:
    """Options shared by every command; each falls back to its SUBQ_ variable."""
    given = {"redis_url": redis_url, "key_prefix": key_prefix, "queue": queue}
    ctx.obj = {name: value for name, value in given.items() if value is not None}


def _settings(ctx: typer.Context) -> Settings:
    return load_settings(**(ctx.obj or {}))


@contextmanager
def _coordinator(ctx: typer.Context) -> Iterator[Coordinator]:
    settings = _settings(ctx)
    try:
        coord = Coordinator(settings)
    except ValueError as exc:  # redis-py refuses a malformed URL with a ValueError
        raise ConfigError(f"Invalid setting SUBQ_REDIS_URL: {exc}", field="SUBQ_REDIS_URL") from None
    try:
        yield coord
    finally:
        coord.close()


# -- running the system ------------------------------------------------------------------


@app.command()
def up(
    ctx: typer.Context,
    workers: Annotated[int, typer.Option(min=1, max=64, help="Worker processes to start.")] = 2,
    host: Host = stack.DEFAULT_HOST,
    api_port: Port = stack.DEFAULT_API_PORT,
    flower_port: Port = stack.DEFAULT_FLOWER_PORT,
    no_api: Annotated[bool, typer.Option("--no-api", help="Do not start the HTTP API.")] = False,
    log_dir: Annotated[
        Path | None, typer.Option(help="Keep the processes' logs here (default: a temporary folder).")
    ] = None,
) -> None:
    """Start the whole stack here: Redis (embedded unless SUBQ_REDIS_URL is set), workers, the API, Flower.

    Prints the URLs, a generated Flower password and API token (unless SUBQ_API_TOKEN
    is set), and the `export` line for a second terminal. Ctrl-C stops everything.
    """
    options = stack.UpOptions(workers, host, api_port, flower_port, not no_api, log_dir)
    raise typer.Exit(stack.run_up(_settings(ctx), options, say=typer.echo))


@app.command()
def worker(
    ctx: typer.Context,
    concurrency: Annotated[
        int | None, typer.Option(min=1, help="Threads per process (default SUBQ_WORKER_CONCURRENCY).")
    ] = None,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
) -> None:
    """Run a worker on this machine (the same as `celery -A workers.app worker`)."""
    settings = _settings(ctx)
    settings.require_redis_url()
    argv = [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "--loglevel", loglevel]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    os.execve(sys.executable, argv, settings_env(settings))


@app.command()
def api(ctx: typer.Context, host: Host = stack.DEFAULT_HOST, port: Port = stack.DEFAULT_API_PORT) -> None:
    """Serve the HTTP API on this machine (uvicorn; clients authenticate with SUBQ_API_TOKEN)."""
    settings = _settings(ctx)
    settings.require_redis_url()
    if not stack.api_available():
        raise ConfigError(f"The HTTP API is not installed (no module {stack.API_MODULE})")
    import uvicorn

    # Imported by name: the module is optional in this package layout until it ships.
    create_app: Any = importlib.import_module(stack.API_MODULE).create_app
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")


@app.command()
def flower(
    ctx: typer.Context,
    host: Host = stack.DEFAULT_HOST,
    port: Port = stack.DEFAULT_FLOWER_PORT,
    user: Annotated[str, typer.Option(envvar="SUBQ_FLOWER_USER", help="Basic-auth user.")] = stack.DEFAULT_FLOWER_USER,
    password: Annotated[
        str | None, typer.Option(envvar="SUBQ_FLOWER_PASSWORD", help="Basic-auth password (required unless --no-auth).")
    ] = None,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="Run Flower without a login (anyone who reaches it can revoke tasks).")
    ] = False,
) -> None:
    """Run Flower, Celery's monitor, with basic auth (it refuses to start open unless --no-auth)."""
    settings = _settings(ctx)
    settings.require_redis_url()
    if no_auth and password:
        raise ValidationError("Give either --password or --no-auth, not both", field="password")
    if not no_auth and not password:
        raise ValidationError(
            "Flower needs basic auth: pass --password (or set SUBQ_FLOWER_PASSWORD), or --no-auth to run it open",
            field="password",
        )
    auth = None if no_auth else stack.flower_basic_auth(user, password or "")
    os.execve(sys.executable, stack.flower_argv(host, port), stack.flower_env(settings, auth))


@app.command()
def demo(
    ctx: typer.Context,
    workers: Annotated[int, typer.Option(min=1, max=16, help="Worker processes to start.")] = 2,
) -> None:
    """Run the whole pipeline locally with the offline model and print the figures per todo item.

    Uses SUBQ_REDIS_URL when set, otherwise starts an embedded Redis; starts its own
    worker processes and stops everything it started.
    """
    from coordinator.demo import run_demo

    raise typer.Exit(run_demo(_settings(ctx), workers=workers))


# -- starting and following work ---------------------------------------------------------


@app.command()
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
) -> None:
    """Start a root agent on the fleet and print its id.

    The agent plans with its todo list, delegates to subagents and completes.
    """
    todo_text = _read_todos(todos) if todos is not None else None
    with _coordinator(ctx) as coord:
        record = coord.create_task(prompt, todos=todo_text, profile=profile, run=True, budget_usd=budget)
        typer.echo(record.id)
        if follow:
            raise typer.Exit(follow_run(coord, record.id))


def _read_todos(path: Path) -> str:
    try:
        return sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValidationError(f"Cannot read --todos {path}: {reason}", field="todos") from None


def follow_run(coord: Coordinator, root_id: str) -> int:
    """A live view of the tree until the root ends; 0 if it completed, else 1.

    It redraws on every event of the tree's stream (each model response of any
    task publishes its live state there) and at least every FOLLOW_POLL_MS. On
    a terminal the view is redrawn in place; otherwise (a pipe, a log) it prints
    one line per task whose live state changed.
    """
    redraw = sys.stdout.isatty()
    shown: dict[str, str] = {}
    after = coord.store.last_event_id(root_id)
    try:
        while True:
            node = build_tree(coord, root_id)
            notes = {task_id: _live_note(state) for task_id, state in coord.snapshot(root_id).items()}
            if redraw:
                view = [*render_tree(node, notes), "", "Ctrl-C stops following; the run goes on."]
                typer.echo("\x1b[H\x1b[2J" + "\n".join(view))
            else:
                for task in walk(node):
                    line = f"{task.id}  {describe(task)}  {notes.get(task.id, task.status.value)}"
                    if shown.get(task.id) != line:
                        shown[task.id] = line
                        typer.echo(f"  {line}")
            if node.status.terminal:
                break
            events = coord.store.read_events(root_id, after, block_ms=FOLLOW_POLL_MS)
            after = events[-1][0] if events else after
    except KeyboardInterrupt:
        typer.echo(f"subq: stopped following; the run goes on (subq tree {root_id})", err=True)
        return 130
    typer.echo("")
    typer.echo("\n".join(render_tree(node)))
    if node.status != TaskStatus.COMPLETED:
        typer.echo(f"subq: run {root_id} {node.status.value}: {node.error or 'no detail'}", err=True)
        return 1
    return 0


def _live_note(state: LiveState) -> str:
    """A task's progress: its live state, requests so far, the tool it called last, its cost so far."""
    requests = f"{state.requests} request{'' if state.requests == 1 else 's'}"
    tool = f", tool {state.tool}" if state.tool else ""
    return f"[{state.state}: {requests}{tool}, {format_usd(state.cost_micros)}]"


# -- reading -----------------------------------------------------------------------------


@app.command()
def status(ctx: typer.Context, task_id: TaskId, as_json: JsonOption = False) -> None:
    """Show one task: status, place in the tree, own and total tokens and cost."""
    with _coordinator(ctx) as coord:
        record = coord.get_task(task_id)
    if as_json:
        typer.echo(record.model_dump_json(indent=2))
        return
    typer.echo(f"{record.id}  {record.status.value}  depth {record.depth}  profile {record.profile}")
    if record.parent_id:
        typer.echo(f"  parent {record.parent_id}  todo {record.todo_id or '-'}")
    typer.echo(f"  own:   {record.tokens} tokens  {format_usd(record.cost_micros)}")
    typer.echo(f"  total: {record.total_tokens} tokens  {format_usd(record.total_cost_micros)}")
    typer.echo(f"  children: {len(record.child_ids)} ({len(record.awaiting_ids)} awaited)")
    if record.error:
        typer.echo(f"  error: {record.error_class}: {record.error}")


@app.command()
def todos(ctx: typer.Context, task_id: TaskId, as_json: JsonOption = False) -> None:
    """Show a task's todo list with each item's subtask, tokens and cost."""
    with _coordinator(ctx) as coord:
        items = coord.get_todos(task_id)
    if as_json:
        typer.echo(json.dumps([i.model_dump(mode="json") for i in items], indent=2))
        return
    for item in items:
        linked = f"  ({item.subtask_id}: {item.tokens} tokens, {format_usd(item.cost_micros)})"
        figures = linked if item.subtask_id else ""
        typer.echo(f"{MARKS[item.status.value]} {item.content}{figures}")


@app.command()
def tree(ctx: typer.Context, task_id: TaskId, as_json: JsonOption = False) -> None:
    """Show a task and its whole subtree: every todo item's status, tokens and cost, own/total per task."""
    with _coordinator(ctx) as coord:
        node = build_tree(coord, task_id)
    typer.echo(node.model_dump_json(indent=2) if as_json else "\n".join(render_tree(node)))


@app.command()
def history(
    ctx: typer.Context,
    status: Annotated[
        str | None, typer.Option(help="Only tasks in this status (active, delegated, completed, failed, cancelled).")
    ] = None,
    root: Annotated[str | None, typer.Option(help="Only the tasks of this root's tree.")] = None,
    limit: Annotated[int, typer.Option(help="Most tasks to show (1-500).")] = 20,
    cursor: Annotated[int, typer.Option(help="Where to go on from, as the previous page printed.")] = 0,
    as_json: JsonOption = False,
) -> None:
    """List tasks, newest first, with their own and subtree figures."""
    with _coordinator(ctx) as coord:
        items, next_cursor = coord.list_tasks(status=status, root_id=root, limit=limit, cursor=cursor)
    if as_json:
        page = {"items": [i.model_dump(mode="json") for i in items], "next_cursor": next_cursor}
        typer.echo(json.dumps(page, indent=2))
        return
    typer.echo(
        f"{'#':>5}  {'id':29}  {'status':9}  {'depth':>5}  "
        f"{'own cost':>10}  {'total tokens':>12}  {'total cost':>10}  task"
    )
    for item in items:
        subtree_micros = round(item.subtree_cost * MICROS_PER_USD)
        first_line = (item.task.strip().splitlines() or [""])[0]
        typer.echo(
            f"{item.number:>5}  {item.id:29}  {item.status.value:9}  {item.depth:>5}  "
            f"{format_usd(item.total_cost_micros):>10}  {item.total_tokens:>12}  {format_usd(subtree_micros):>10}  "
            f"{cut(first_line, HISTORY_TASK_CHARS)}"
        )
    if next_cursor is not None:
        typer.echo(f"(more: subq history --cursor {next_cursor})", err=True)


@app.command()
def export(
    ctx: typer.Context,
    task_id: TaskId,
    directory: Annotated[Path, typer.Argument(help="Folder to write into (created if missing).")],
) -> None:
    """Write a task's subtree as folders of JSON (conversation, UI messages, history item)."""
    with _coordinator(ctx) as coord:
        files = coord.export_tree(task_id, directory)
    tasks = len({f.parent for f in files})
    typer.echo(f"Exported {tasks} tasks ({len(files)} files) to {directory}")


# -- control -----------------------------------------------------------------------------


@app.command()
def cancel(
    ctx: typer.Context,
    task_id: TaskId,
    reason: Annotated[str, typer.Option(help="Why: the parent (and you, later) read it.")],
    as_json: JsonOption = False,
) -> None:
    """Cancel a task and its whole subtree; finished results are kept and its parent hears why."""
    with _coordinator(ctx) as coord:
        record = coord.cancel(task_id, reason)
        if as_json:
            typer.echo(record.model_dump_json(indent=2))
            return
        stopped = coord.store.subtree_ids(task_id)
        typer.echo(f"Cancelled {record.id} and its subtree ({len(stopped)} tasks): {record.error}")


@app.command()
def approvals(
    ctx: typer.Context,
    root: Annotated[str | None, typer.Option(help="Only the requests of this root's tree.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List tool calls waiting for a decision (oldest first)."""
    with _coordinator(ctx) as coord:
        pending = coord.list_approvals(root)
    if as_json:
        typer.echo(json.dumps([a.model_dump(mode="json") for a in pending], indent=2))
        return
    if not pending:
        typer.echo("No tool call is waiting for a decision.")
    for approval in pending:
        todo = f"  for todo '{approval.todo_content}'" if approval.todo_content else ""
        typer.echo(f"{approval.id}  task {approval.task_id}  {approval.tool} {json.dumps(approval.args)}{todo}")


@app.command()
def approve(
    ctx: typer.Context, approval_id: Annotated[str, typer.Argument(help="As `subq approvals` prints it.")]
) -> None:
    """Approve a waiting tool call: only that task goes on."""
    with _coordinator(ctx) as coord:
        decided = coord.decide(approval_id, "approve")
    typer.echo(f"Approved {decided.id}: {decided.tool} of task {decided.task_id} goes on.")


@app.command()
def deny(
    ctx: typer.Context,
    approval_id: Annotated[str, typer.Argument(help="As `subq approvals` prints it.")],
    feedback: Annotated[str, typer.Option(help="What the task's model is told instead of the tool's result.")] = "",
) -> None:
    """Deny a waiting tool call; the feedback goes back to that task's model."""
    with _coordinator(ctx) as coord:
        decided = coord.decide(approval_id, "deny", feedback or None)
    typer.echo(f"Denied {decided.id}: task {decided.task_id} is told: {decided.feedback or 'the call was denied'}")


# -- entry point -------------------------------------------------------------------------


def _click_class(name: str) -> type[Exception]:
    """An exception class of the click that Typer runs on.

    Typer >= 0.2x runs on a private copy of click, older versions on the click
    package; both re-export BadParameter, whose bases are the classes needed here.
    """
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


_CLICK_ERROR = _click_class("ClickException")
_USAGE_ERROR = _click_class("UsageError")


def run_cli(args: Sequence[str]) -> int:
    """Run the CLI on `args`; every failure is one line on stderr and an exit code."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=list(args), prog_name="subq", standalone_mode=False)
    except _CLICK_ERROR as exc:
        return _click_failure(cast(Any, exc))
    except typer.Abort:
        typer.echo("subq: aborted", err=True)
        return 1
    except SubqError as exc:
        typer.echo(f"subq: {exc}", err=True)
        return 1
    except OperationalError as exc:  # kombu: the broker refused or dropped a publish
        typer.echo(f"subq: the broker is unreachable: {_one_line(str(exc))}", err=True)
        return 1
    except KeyboardInterrupt:
        typer.echo("subq: interrupted", err=True)
        return 130
    return result if isinstance(result, int) else 0


def _click_failure(exc: Any) -> int:
    """A usage error as one line naming the command; `subq` alone prints the help."""
    code: int = exc.exit_code
    if type(exc).__name__ == "NoArgsIsHelpError":
        typer.echo(exc.ctx.get_help())
        return code
    message = _one_line(exc.format_message())
    if isinstance(exc, _USAGE_ERROR) and getattr(exc, "ctx", None) is not None:
        path = cast(Any, exc).ctx.command_path
        typer.echo(f"{path}: {message} (see: {path} --help)", err=True)
    else:
        typer.echo(f"subq: {message}", err=True)
    return code


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main() -> None:
    """Entry point of the `subq` console script and `python -m coordinator`."""
    sys.exit(run_cli(sys.argv[1:]))
