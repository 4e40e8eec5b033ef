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

from coordinator.errors import ConfigError, SubqError
from coordinator.loading import loading

# The code of the API's 401 (coordinator/api/errors.py), not imported: that loads the server side.
UNAUTHORIZED = "unauthorized"

if TYPE_CHECKING:
    from coordinator.operations import Operations
    from coordinator.settings import Settings

__all__ = ["Host", "JsonOption", "Port", "TaskId", "app", "connect", "loading", "say_json", "settings_of"]

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
    api_url: Annotated[
        str | None,
        typer.Option(
            help="Reach subq through its HTTP API instead of Redis, with the token in $SUBQ_API_TOKEN "
            "(default: $SUBQ_API_URL). up, worker, api, flower and demo always use Redis."
        ),
    ] = None,
) -> None:
    """Options shared by every command; each falls back to its SUBQ_ variable."""
    given = {"redis_url": redis_url, "key_prefix": key_prefix, "queue": queue, "api_url": api_url}
    ctx.obj = {name: value for name, value in given.items() if value is not None}


def say_json(value: object) -> None:
    """Print JSON (a record, or a JSON value) for a program to read, indented, every non-ASCII character
    escaped (`\\u009b`): valid JSON, and no model's control character (a C1 CSI, a bidi override, a DEL)
    reaches the terminal raw. (`visible_text` would write Python's escapes, `\\x9b`, which JSON refuses.)"""
    import json

    from pydantic import BaseModel  # on use, as in `say`

    dumped = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    typer.echo(json.dumps(dumped, indent=2, ensure_ascii=True))


def say(text: str, err: bool = False) -> None:
    """Print a human-readable line that may carry a model's or a server's text: as visible text only.

    The one place the CLI's tables and messages reach the terminal (`--json` output is
    JSON, escaped already): a control character in them is printed as its escape.
    """
    from coordinator.inputs import visible_text  # on use: `subq --help` loads no models

    typer.echo(visible_text(text), err=err)


def settings_of(ctx: typer.Context) -> Settings:
    """The settings: the shared options over the SUBQ_ environment."""
    from coordinator.settings import load_settings

    return load_settings(**(ctx.obj or {}))


@contextmanager
def connect(ctx: typer.Context) -> Iterator[Operations]:
    """The system as an operator command reaches it, closed when the command is done.

    Through the HTTP API when SUBQ_API_URL (--api-url) is set, so the operator needs
    only the API's token; otherwise on Redis directly.
    """
    with loading():
        settings = settings_of(ctx)
        ops = _api_client(settings) if settings.api_url else _coordinator(settings)
    try:
        yield ops
    except SubqError as exc:
        if exc.code != UNAUTHORIZED:
            raise
        # The server's 401 cannot know where this side keeps its token: say it.
        from coordinator.client import AuthError

        hint = f"set SUBQ_API_TOKEN to the token of the API at {settings.api_url}"
        raise AuthError(f"{exc.message}; {hint}", field="SUBQ_API_TOKEN") from None
    finally:
        ops.close()


def _coordinator(settings: Settings) -> Operations:
    from coordinator.redis_clients import redis_client
    from coordinator.service import Coordinator

    try:
        client = redis_client(settings)
    except ValueError as exc:  # redis-py refuses a malformed URL with a ValueError
        raise ConfigError(f"Invalid setting SUBQ_REDIS_URL: {exc}", field="SUBQ_REDIS_URL") from None
    # (Built apart: a ValueError of the rest, a trace exporter's say, is not the URL's.)
    return Coordinator(settings, client=client)


def _api_client(settings: Settings) -> Operations:
    from coordinator.client import SubqClient

    token = settings.api_token.get_secret_value() if settings.api_token is not None else None
    return SubqClient(settings.api_url or "", token)
