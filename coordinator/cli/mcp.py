"""`subq mcp`: subq's MCP tools over stdio, for a desktop agent that starts its MCP servers as commands.

The tools are /mcp's (coordinator/mcp_tools.py), called through the HTTP client on
a subq API: SUBQ_API_URL and SUBQ_API_TOKEN from the environment, as every command
that goes through the API reads them, or from `--credentials`, the file `subq up`
writes. So the API enforces the key's scopes and ownership exactly as for any other
client; `tools/list` shows what the API's /mcp shows the key. Nothing but MCP goes to
stdout: it is the protocol's channel.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from coordinator.cli.common import settings_of
from coordinator.errors import ConfigError

if TYPE_CHECKING:
    from mcp.server.context import ServerRequestContext

    from coordinator.mcp_tools import Session

__all__ = ["mcp", "read_credentials"]

# The two variables of a credentials file `subq mcp` takes; the rest (Redis, Flower) are not its business.
WANTED = ("SUBQ_API_URL", "SUBQ_API_TOKEN")
# An agent's task may take minutes to plan: wait_task holds a call up to MAX_WAIT_S, and each HTTP request of
# the client is short, so the client's own timeout only bounds one request.
CLIENT_TIMEOUT_S = 60.0
# How long `tools/list` waits for the API's /mcp to say which tools the key has.
LIST_TIMEOUT_S = 10.0


def read_credentials(path: Path) -> dict[str, str]:
    """SUBQ_API_URL and SUBQ_API_TOKEN from `subq up`'s credentials file (`export NAME=value` lines, shell-quoted)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--credentials {path}: cannot read it: {exc.strerror}", field="credentials") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--credentials {path}: not UTF-8 text", field="credentials") from None
    found: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:  # an unbalanced quote: `export X='abc`, or a line with "don't"
            raise ConfigError(f"--credentials {path}: line {number}: {exc}", field="credentials") from None
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            if name in WANTED:
                found[name] = value
    if "SUBQ_API_URL" not in found:
        raise ConfigError(
            f"--credentials {path}: no SUBQ_API_URL in it (is it the file `subq up` printed, with its API running?)",
            field="credentials",
        )
    return found


def mcp(
    ctx: typer.Context,
    credentials: Annotated[
        Path | None,
        typer.Option(
            help="The credentials file `subq up` printed: its SUBQ_API_URL and SUBQ_API_TOKEN "
            "(default: those variables from the environment)."
        ),
    ] = None,
) -> None:
    """Serve subq's tools to an MCP client over stdio (run_task, wait_task, get_task, ...), through a subq API.

    Add it to a desktop agent as the command `subq mcp`; see docs/mcp.md."""
    if credentials is not None:
        found = read_credentials(credentials)
        url, token = found["SUBQ_API_URL"], found.get("SUBQ_API_TOKEN")
    else:
        settings = settings_of(ctx)
        url = settings.api_url or ""
        token = settings.api_token.get_secret_value() if settings.api_token is not None else None
    if not url:
        raise ConfigError(
            "subq mcp talks to a subq API: set SUBQ_API_URL and SUBQ_API_TOKEN, or pass --credentials with the "
            "file `subq up` printed",
            field="SUBQ_API_URL",
        )
    serve(url, token)


def serve(url: str, token: str | None) -> None:
    """Serve the tools over stdin and stdout until the client closes them."""
    import anyio
    from mcp.server.stdio import stdio_server

    from coordinator.api.app import _version
    from coordinator.client import SubqClient
    from coordinator.mcp_tools import Session, build_server

    client = SubqClient(url, token, timeout_s=CLIENT_TIMEOUT_S)
    session = Session(ops=client, scopes=None, web_url=url)

    async def session_of(ctx: ServerRequestContext[Any, Any]) -> Session:
        if ctx.method != "tools/list":
            return session
        # /v1 does not say which scopes a token has; the API's /mcp lists the tools they allow, at this moment
        # (a key's scopes change without a restart). An older API, or none: every tool, and the API refuses.
        return Session(ops=client, scopes=None, web_url=url, names=await offered_by_api(url, token))

    server = build_server(session_of, _version())

    async def main() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    try:
        anyio.run(main)
    finally:
        client.close()


async def offered_by_api(url: str, token: str | None) -> frozenset[str] | None:
    """The names of the tools the API's /mcp offers this token (it knows the key's scopes); None if it cannot say."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with (
            httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(LIST_TIMEOUT_S)) as http,
            Client(streamable_http_client(f"{url.rstrip('/')}/mcp", http_client=http), cache=None) as listing,
        ):
            return frozenset(tool.name for tool in (await listing.list_tools()).tools)
    except Exception:  # unreachable, refused, no /mcp: the API refuses each call itself, naming why
        return None
