"""The `subq` command: a thin CLI over the Coordinator (docs/cli.md).

Every command has `--help`. Errors are one line on stderr and a non-zero exit,
never a traceback: subq's own errors exit 1, malformed arguments (click's usage
errors) exit 2. Read commands take `--json` for scripts. The shared options
(`--redis-url`, `--key-prefix`, `--queue`) come before the command and fall back
to the `SUBQ_` environment through `Settings`; with `--api-url` the operator commands
go through the HTTP API instead of Redis.

    common.py   the Typer app, the shared options, settings and the Coordinator
    stack.py    up, worker, tools, api, flower, demo
    work.py     run (--follow), status, result, todos, tree, history, export
    control.py  cancel, retry, approvals, approve, deny, dead-letters, audit, deliveries, redeliver, tenants
    views.py    what the read commands print, and `run --follow`'s loop
    live.py     `run --follow`'s terminal view (rich): one table fitted to the width
    mcp.py      `subq mcp`: subq's MCP tools over stdio, through the API (docs/mcp.md)
    backend.py  what the operator commands reach: Redis (the Coordinator) or the HTTP API (the client)
    entry.py    run_cli and main: failures as one line and an exit code

The command modules define plain functions; this module adds them to `app`,
in one place and in the order of `subq --help`.

A command imports Celery, kombu, redis-py, the service, `coordinator.local.up`,
`coordinator.local.fleet` and the pydantic models when it runs, so `subq --help`
loads none of them (tests/test_light_imports.py). Installed without the server
extra (`pip install subagent-queue`, the client alone: no Typer), `main` prints
the install command in one line and exits 1 (tests/test_client_install.py).
"""

from __future__ import annotations

import sys

from coordinator import SERVER_INSTALL, missing_server_module

__all__ = ["app", "main", "run_cli"]

try:
    from coordinator.cli import control, stack, work
    from coordinator.cli.common import app
    from coordinator.cli.entry import main, run_cli
    from coordinator.cli.mcp import mcp as mcp_command
except ModuleNotFoundError as _exc:
    # `pip install subagent-queue` (the client alone) installs the `subq` script too, but not
    # Typer: the script's `main` then says what to install, in one line, instead of a traceback.
    _missing = missing_server_module(_exc)
    if _missing is None:
        raise
    _NEEDS_SERVER = (
        f"subq: the command line needs the server's packages (no module named {_missing!r}): {SERVER_INSTALL}"
    )

    def main() -> None:
        """Entry point of the `subq` console script where the server's packages are not installed."""
        print(_NEEDS_SERVER, file=sys.stderr)
        sys.exit(1)

else:
    # The commands, in the order `subq --help` lists them.
    COMMANDS = (
        *(stack.up, stack.worker, stack.tools, stack.api, stack.flower, stack.demo),
        *(work.run, work.status, work.result, work.todos, work.tree, work.history, work.export),
        *(control.cancel, control.retry, control.approvals, control.approve, control.deny),
        *(control.dead_letters, control.audit, control.deliveries, control.redeliver, control.tenants),
        mcp_command,
    )
    for _command in COMMANDS:
        app.command()(_command)
