"""Commands that run the system on this machine: up, worker, tools, api, flower, demo.

Each imports what it starts (`coordinator.local.up`, `coordinator.local.fleet`, uvicorn, ...)
when it runs. Plain functions: coordinator/cli/__init__.py adds them to the app.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from coordinator.cli.common import Host, Port, loading, settings_of
from coordinator.errors import ConfigError, ValidationError
from coordinator.loading import freeze_loaded
from coordinator.local import DEFAULT_API_PORT, DEFAULT_FLOWER_PORT, DEFAULT_FLOWER_USER, DEFAULT_HOST, MAX_CONCURRENCY

if TYPE_CHECKING:  # (`subq --help` loads no settings library: tests/test_light_imports.py)
    from coordinator.settings import Settings

__all__ = ["api", "demo", "flower", "tools", "up", "worker"]


def require_redis(settings: Settings) -> None:
    """A Redis is given, and its URL is one (a process started with another fails later, with a traceback)."""
    from coordinator.redis_clients import check_redis_url

    settings.require_redis()
    if settings.redis_url:
        check_redis_url(settings.redis_url)


def up(
    ctx: typer.Context,
    workers: Annotated[int, typer.Option(min=1, max=64, help="Worker processes to start.")] = 2,
    host: Host = DEFAULT_HOST,
    api_port: Port = DEFAULT_API_PORT,
    flower_port: Port = DEFAULT_FLOWER_PORT,
    no_api: Annotated[bool, typer.Option("--no-api", help="Do not start the HTTP API.")] = False,
    log_dir: Annotated[
        Path | None, typer.Option(help="Keep the processes' logs here (default: a temporary folder).")
    ] = None,
) -> None:
    """Start the whole stack here: Redis (embedded unless SUBQ_REDIS_URL is set), workers, the API, Flower.

    Prints the URLs and where its credentials file is (mode 0600: the API token, the
    Flower password, the Redis URL; load it with `. <file>` in a second terminal).
    Ctrl-C stops everything.
    """
    from coordinator.local import up as stack

    options = stack.UpOptions(workers, host, api_port, flower_port, not no_api, log_dir)
    raise typer.Exit(stack.run_up(settings_of(ctx), options, say=typer.echo))


def worker(
    ctx: typer.Context,
    concurrency: Annotated[
        int | None,
        typer.Option(min=1, max=MAX_CONCURRENCY, help="Threads per process (default SUBQ_WORKER_CONCURRENCY)."),
    ] = None,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
) -> None:
    """Run a worker on this machine (the same as `celery -A workers.app worker`, started as `python -m workers`)."""
    from coordinator.local.fleet import settings_env

    settings = settings_of(ctx)
    require_redis(settings)
    argv = [sys.executable, "-m", "workers", "--loglevel", loglevel]  # workers/app.py: Celery's worker command
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
        # The setting too: fair shares count the fleet's capacity from what each worker's settings say.
        settings = settings.model_copy(update={"worker_concurrency": concurrency})
    os.execve(sys.executable, argv, settings_env(settings))


def tools(
    ctx: typer.Context,
    profile: Annotated[str | None, typer.Option(help="Only this profile.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object: profile -> tool -> source.")] = False,
) -> None:
    """Check every profile's tools as a worker does at start, and list each tool with where it comes from.

    A bad entry (an import that fails, an attribute that is no tool, two tools of one
    name) is one line naming the profile and the entry, and the exit status is 1.
    """
    from coordinator.local.fleet import settings_env

    # The worker package checks them, in a process of its own: the control plane never imports it.
    argv = [sys.executable, "-m", "workers.runtime.profile_tools"]
    argv += ["--profile", profile] if profile else []
    argv += ["--json"] if as_json else []
    os.execve(sys.executable, argv, settings_env(settings_of(ctx)))


def api(ctx: typer.Context, host: Host = DEFAULT_HOST, port: Port = DEFAULT_API_PORT) -> None:
    """Serve the HTTP API on this machine (uvicorn; clients authenticate with SUBQ_API_TOKEN)."""
    from coordinator.local import up as stack

    with loading():
        settings = settings_of(ctx)
        require_redis(settings)
        if not stack.api_available():
            raise ConfigError(f"The HTTP API is not installed (no module {stack.API_MODULE})")
        import uvicorn

        # Imported by name: the module is optional in this package layout until it ships.
        create_app: Any = importlib.import_module(stack.API_MODULE).create_app
        served = create_app(settings)
    freeze_loaded()
    # proxy_headers off: the app believes X-Forwarded-* only from SUBQ_API_TRUSTED_PROXIES
    # (uvicorn's default would believe them from 127.0.0.1, whatever the settings say).
    uvicorn.run(served, host=host, port=port, log_level="info", proxy_headers=False)


def flower(
    ctx: typer.Context,
    host: Host = DEFAULT_HOST,
    port: Port = DEFAULT_FLOWER_PORT,
    user: Annotated[str, typer.Option(envvar="SUBQ_FLOWER_USER", help="Basic-auth user.")] = DEFAULT_FLOWER_USER,
    password: Annotated[
        str | None, typer.Option(envvar="SUBQ_FLOWER_PASSWORD", help="Basic-auth password (required unless --no-auth).")
    ] = None,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="Run Flower without a login (anyone who reaches it can revoke tasks).")
    ] = False,
) -> None:
    """Run Flower, Celery's monitor, with basic auth (it refuses to start open unless --no-auth)."""
    from coordinator.local import up as stack
    from coordinator.settings import GENERATE_HINT, PLACEHOLDER_SECRET

    settings = settings_of(ctx)
    require_redis(settings)
    if no_auth and password:
        raise ValidationError("Give either --password or --no-auth, not both", field="password")
    if not no_auth and not password:
        raise ValidationError(
            "Flower needs basic auth: pass --password (or set SUBQ_FLOWER_PASSWORD), or --no-auth to run it open",
            field="password",
        )
    if password == PLACEHOLDER_SECRET:
        raise ValidationError(
            f"Flower's password {PLACEHOLDER_SECRET!r} is the example's placeholder (Flower can revoke tasks); "
            f"{GENERATE_HINT}",
            field="password",
        )
    auth = None if no_auth else stack.flower_basic_auth(user, password or "")
    os.execve(sys.executable, stack.flower_argv(host, port), stack.flower_env(settings, auth))


def demo(
    ctx: typer.Context,
    workers: Annotated[int, typer.Option(min=1, max=16, help="Worker processes to start.")] = 2,
) -> None:
    """Run the whole pipeline locally with the offline model and print the figures per todo item.

    One item is carried out by a real tool (sales_total, on a CSV it writes). Uses
    SUBQ_REDIS_URL when set, otherwise starts an embedded Redis; starts its own
    worker processes and stops everything it started.
    """
    from coordinator.local.demo import run_demo

    raise typer.Exit(run_demo(settings_of(ctx), workers=workers))
