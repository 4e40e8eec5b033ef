"""Running the app: every failure becomes one line on stderr and an exit code."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import typer

from coordinator import SERVER_INSTALL, missing_server_module
from coordinator.cli.common import app
from coordinator.errors import QuotaExceeded, SubqError

__all__ = ["main", "run_cli"]


def _click_class(name: str) -> type[Exception]:
    """An exception class of the click that Typer runs on.

    Typer >= 0.2x runs on a private copy of click, older versions on the click
    package; both re-export BadParameter, whose bases are the classes needed here.
    """
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


_CLICK_ERROR = _click_class("ClickException")
_USAGE_ERROR = _click_class("UsageError")


# A submit a tenant's quota refused (sysexits' EX_TEMPFAIL: a temporary failure, try again later).
QUOTA_EXIT_CODE = 75
# subq could not be reached or answered nothing readable: Redis, the broker or the API (sysexits' EX_UNAVAILABLE).
# Not 1, which `run --follow` and `result` give a root that failed: a script that runs the work again on 1 must not
# start a second tree (and spend twice) because it lost sight of one that may still be running.
UNAVAILABLE_EXIT_CODE = 69
# The errors' codes that say so (a corrupt record is a StoreError too, and not one of them).
UNAVAILABLE_CODES = frozenset({"store_error", "broker_error", "api_unreachable", "bad_response"})


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
    except QuotaExceeded as exc:
        # A tenant's quota: the same line as any error, and EX_TEMPFAIL, so a script knows to try again later.
        typer.echo(f"subq: {_one_line(str(exc))}", err=True)
        return QUOTA_EXIT_CODE
    except SubqError as exc:
        # One line, always: an error's message can come from an API server (or a model's text
        # inside it), and a new line or a terminal escape in it must not draw on the terminal.
        typer.echo(f"subq: {_one_line(str(exc))}", err=True)
        return _exit_code(exc)
    except ModuleNotFoundError as exc:
        # Typer alone (installed for something else) beside the client-only install: `--help` works,
        # and a command that imports Celery, redis-py or the server says what to install.
        missing = missing_server_module(exc)
        if missing is None:
            raise
        typer.echo(
            f"subq: this command needs the server's packages (no module named {missing!r}): {SERVER_INSTALL}", err=True
        )
        return 1
    except Exception as exc:
        if not _broker_error(exc):
            raise
        typer.echo(f"subq: the broker is unreachable: {_one_line(str(exc))}", err=True)
        return UNAVAILABLE_EXIT_CODE
    except KeyboardInterrupt:
        typer.echo("subq: interrupted", err=True)
        return 130
    return result if isinstance(result, int) else 0


def _exit_code(exc: SubqError) -> int:
    """UNAVAILABLE_EXIT_CODE for a subq out of reach; 1 for the rest, a Redis that answered and refused among them
    (a wrong password, an ACL's NOPERM, OOM): trying again later changes nothing there."""
    if exc.code not in UNAVAILABLE_CODES:
        return 1
    redis_errors = sys.modules.get("redis.exceptions")  # (not imported here: a command on the API never loads it)
    refused = redis_errors is not None and isinstance(
        exc.__cause__, (redis_errors.ResponseError, redis_errors.AuthenticationError)
    )
    return 1 if refused else UNAVAILABLE_EXIT_CODE


def _broker_error(exc: Exception) -> bool:
    """kombu's OperationalError: the broker refused or dropped a publish.

    Looked up in sys.modules rather than imported, so that a command that never
    published (or `subq --help`) does not load kombu: if kombu is not loaded,
    the error cannot be one of its.
    """
    kombu_errors = sys.modules.get("kombu.exceptions")
    return kombu_errors is not None and isinstance(exc, kombu_errors.OperationalError)


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
    """`text` on one line, control characters (ESC of a terminal sequence, CR, BEL) shown as escapes."""
    from coordinator.inputs import visible_text

    return visible_text(" ".join(text.split()))


def main() -> None:
    """Entry point of the `subq` console script and `python -m coordinator`."""
    sys.exit(run_cli(sys.argv[1:]))
