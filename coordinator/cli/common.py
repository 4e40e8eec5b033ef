"""The `subq` Typer app, its shared options, and what every command uses to reach the system.

Settings and the Coordinator are imported when a command runs, not here: `subq
--help` and a malformed command line never load pydantic-settings, the service,
Celery, kombu or redis-py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

import typer

from coordinator.errors import ConfigError

if TYPE_CHECKING:
    from coordinator.service import Coordinator
    from coordinator.settings import Settings

__all__ = ["Host", "JsonOption", "Port", "TaskId", "app", "connect", "settings_of"]

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


def settings_of(ctx: typer.Context) -> Settings:
    """The settings: the shared options over the SUBQ_ environment."""
    from coordinator.settings import load_settings

    return load_settings(**(ctx.obj or {}))


@contextmanager
def connect(ctx: typer.Context) -> Iterator[Coordinator]:
    """A Coordinator on the configured Redis, closed when the command is done."""
    from coordinator.service import Coordinator

    settings = settings_of(ctx)
    try:
        coord = Coordinator(settings)
    except ValueError as exc:  # redis-py refuses a malformed URL with a ValueError
        raise ConfigError(f"Invalid setting SUBQ_REDIS_URL: {exc}", field="SUBQ_REDIS_URL") from None
    try:
        yield coord
    finally:
        coord.close()
