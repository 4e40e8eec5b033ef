"""The `subq` command: a thin CLI over the Coordinator.

Every command has `--help`; errors are one clear line on stderr and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer

from coordinator.errors import SubqError
from coordinator.models import format_usd
from coordinator.service import Coordinator
from coordinator.settings import load_settings

__all__ = ["app", "main"]

app = typer.Typer(
    name="subq",
    help="subq: a distributed job queue for AI subagents (Celery + Redis).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command()
def demo(
    workers: Annotated[int, typer.Option(min=1, max=16, help="Worker processes to start.")] = 2,
) -> None:
    """Run the whole pipeline locally with the offline model and print the figures per todo item.

    Uses SUBQ_REDIS_URL when set, otherwise starts an embedded Redis; starts its own
    worker processes and stops everything it started.
    """
    from coordinator.demo import run_demo

    raise typer.Exit(run_demo(load_settings(), workers=workers))


@app.command()
def worker(
    concurrency: Annotated[int | None, typer.Option(help="Threads per process (default SUBQ_WORKER_CONCURRENCY).")] = None,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
) -> None:
    """Run a worker on this machine (the same as `celery -A workers.app worker`)."""
    load_settings().require_redis_url()
    argv = [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "--loglevel", loglevel]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    os.execv(sys.executable, argv)


@app.command()
def status(task_id: str, as_json: JsonOption = False) -> None:
    """Show one task: status, place in the tree, own and total tokens and cost."""
    coord = Coordinator(load_settings())
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
def todos(task_id: str, as_json: JsonOption = False) -> None:
    """Show a task's todo list with each item's subtask, tokens and cost."""
    coord = Coordinator(load_settings())
    items = coord.get_todos(task_id)
    if as_json:
        typer.echo(json.dumps([i.model_dump(mode="json") for i in items], indent=2))
        return
    marks = {"pending": "[ ]", "in_progress": "[-]", "completed": "[x]"}
    for item in items:
        figures = f"  ({item.subtask_id}: {item.tokens} tokens, {format_usd(item.cost_micros)})" if item.subtask_id else ""
        typer.echo(f"{marks[item.status.value]} {item.content}{figures}")


def main() -> None:
    """Entry point: subq's own errors become one line and exit code 1."""
    try:
        app()
    except SubqError as exc:
        typer.echo(f"subq: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("subq: interrupted", err=True)
        sys.exit(130)
