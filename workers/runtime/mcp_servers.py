"""A profile's MCP servers: checked when a worker starts, then one per worker process, shared by every run.

A profile's `mcp_servers` (coordinator/settings.py `McpServer`, docs/tools.md)
name programs that speak MCP over stdio (`command`) or servers over Streamable
HTTP (`url`). Their tools join the profile's own (profile_tools.py): their
source is `mcp:<name>`, they are filtered by `allowed_tools` /
`disallowed_tools` and guarded by the approval policy like any tool.

- **The check** (`checked_tools`, from `load_profile` on a worker's start and
  by `subq tools`): each server is started, its tools are listed within its
  `timeout_s`, and it is stopped; a `${VAR}` value whose variable is not set,
  a command that cannot start, a server that does not answer `initialize` in
  time: one `ConfigError` line naming the profile and the server.
- **At run time** (`SharedServer`): each server runs once per worker process,
  on the process's agent event loop, started by the first run that lists its
  tools and kept running for all of them (pydantic-ai's `MCPToolset`, entered
  once). A supervisor task restarts it with backoff when it stops (its session
  is gone, or a call found it gone); while it is down its tools stay offered
  and a call answers `Error: ...`, never a crashed run. `stop_all` stops the
  servers at the worker's shutdown.
- **Hints**: a tool the server marks `destructiveHint` needs a decision unless
  a rule allows it; one marked `readOnlyHint` needs none unless the profile's
  `approval_tools` names it exactly or a deny rule matches
  (`needs_decision_by_hint`, `hinted_verdict`).

pydantic-ai's MCP support (and FastMCP under it) is imported only when a
profile has MCP servers: it takes a second and a half to import.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from contextlib import suppress
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from pydantic_ai import RunContext
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import AbstractToolset
from pydantic_ai.toolsets.abstract import ToolsetTool

from coordinator import ConfigError, McpServer, Profile, one_line
from workers.runtime.approval_policy import Verdict, verdict
from workers.runtime.egress import MAX_REFUSALS_BYTES
from workers.runtime.sandbox import Sandbox
from workers.runtime.tools import CallFailed, report_refused

if TYPE_CHECKING:
    from pydantic_ai.mcp import MCPToolset

__all__ = [
    "SharedServer",
    "checked_tools",
    "hinted_verdict",
    "in_schema_order",
    "list_at_once",
    "needs_decision_by_hint",
    "resolve_secrets",
    "shared_server",
    "source_of",
    "stop_all",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# How often the supervisor looks whether a running server's session is gone.
WATCH_S = 1.0
# Restarts after a failed start or a stop: 0.5 s, doubling, at most 30 s; a server that
# ran this long before it stopped is restarted at once (its failures are forgotten).
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 60.0
# How long a stop may take: the MCP SDK closes a server's stdin, waits 2 s, then kills it.
STOP_S = 10.0
# JSON-RPC's "connection closed" (the MCP SDK's CONNECTION_CLOSED): the server is gone.
CONNECTION_CLOSED = -32000


def source_of(server: McpServer) -> str:
    """Where a server's tools come from, as `subq tools` shows it."""
    return f"mcp:{server.name}"


def _fail(profile: str, server: McpServer, why: str) -> ConfigError:
    return ConfigError(f"Invalid profile {profile!r}: mcp_servers entry {server.name!r}: {why}", field="profile")


def resolve_secrets(
    profile: str,
    server: McpServer,
    values: Mapping[str, str],
    what: str,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """`values` with each `${VAR}` read from the environment; a variable that is not set is a ConfigError."""
    environ = os.environ if environ is None else environ
    resolved = {}
    for key, value in values.items():
        named = McpServer.secret_name(value)
        if named is None:
            resolved[key] = value
        elif named in environ:
            resolved[key] = environ[named]
        else:
            why = f"{what} {key}: ${{{named}}} is not set in the worker's environment"
            raise _fail(profile, server, why)
    return resolved


def _build(profile: str, server: McpServer, hidden: Sandbox, refusals: Path | None = None) -> MCPToolset[Any]:
    """A fresh pydantic-ai toolset for the server (not started): one per start of its process; a sandboxed
    one never sees what `hidden` names, and a proxied one's refused connections are lines in `refusals`."""
    from fastmcp.client.transports import StdioTransport
    from pydantic_ai.mcp import MCPToolset

    if server.command is not None:
        env = resolve_secrets(profile, server, server.env, "env")
        # keep_alive=False: the process ends with its session, so a restart is a new process.
        # The MCP SDK starts it with PATH, HOME, USER, LOGNAME, SHELL and TERM and these only.
        command, args = server.command, list(server.args)
        if server.sandbox:  # writes only where the entry says (workers/runtime/sandbox.py)
            # No limits: a server lives as long as the worker, shared by every run, and RLIMIT_CPU counts a
            # process's whole life (a command's 600 s would kill a server that had worked ten minutes in all).
            # The container's memory limit bounds it (docs/tools.md).
            cwd = server.cwd or (server.writable[0] if server.writable else Path("/"))
            # The home's credentials shown: the operator's server may work with them (a kubeconfig, gh's token).
            wrapped = hidden.wrap(
                [command, *args], cwd, network=server.network, writable=server.writable, refusals=refusals,
                home_credentials=True,
            )  # fmt: skip
            command, args = wrapped[0], wrapped[1:]
        transport = StdioTransport(
            command=command,
            args=args,
            env=env or None,
            cwd=str(server.cwd) if server.cwd is not None else None,
            keep_alive=False,
            log_file=_errlog(),
        )
        return MCPToolset(transport, id=source_of(server), init_timeout=server.timeout_s, tool_error_behavior="error")
    assert server.url is not None
    headers = resolve_secrets(profile, server, server.headers, "header")
    return MCPToolset(
        server.url,
        id=source_of(server),
        headers=headers or None,
        init_timeout=server.timeout_s,
        tool_error_behavior="error",
    )


# A line of a stdio server's stderr longer than this many bytes is logged in pieces of it.
MAX_STDERR_LINE_CHARS = 4000
_relay_lock = threading.Lock()
_relay: TextIO | None = None  # the write end of the pipe every stdio server of the process writes its stderr into


def _errlog() -> TextIO:
    """Where a stdio server's stderr goes: a pipe whose lines a thread of the process logs (`_relay_lines`).

    Given the process's own stderr, a server wrote to it as it pleased: an argument a model chose that the server
    echoed in an error reached an operator's terminal as an escape sequence (retitle, write the clipboard) and, with
    `SUBQ_LOG_FORMAT=json`, a line of the server's could read as one of the worker's own. Logged, each line is one
    line of visible text, or one JSON record, as every other. (One pipe for the process: its writes of a line are
    whole up to PIPE_BUF, 4 KB.)"""
    global _relay
    with _relay_lock:
        if _relay is None:
            read_fd, write_fd = os.pipe()
            reader = os.fdopen(read_fd, "rb")
            threading.Thread(target=_relay_lines, args=(reader,), name="subq-mcp-stderr", daemon=True).start()
            _relay = os.fdopen(write_fd, "w")
        return _relay


def _relay_lines(reader: Any) -> None:
    # At most MAX_STDERR_LINE_CHARS bytes a read: a server that never ends its line (a progress bar drawn with CRs,
    # a binary dump) is logged in pieces, not held in memory until a new line comes.
    for raw in iter(lambda: reader.readline(MAX_STDERR_LINE_CHARS), b""):
        for piece in raw.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n").split("\n"):
            if piece:
                log.info("mcp server stderr: %s", piece)


def _leaf(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio reports a task group's failure as one)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _why_not_started(server: McpServer, exc: BaseException) -> str:
    exc = _leaf(exc)
    cause = exc.__cause__
    if isinstance(exc, OSError) or isinstance(cause, OSError):
        error = exc if isinstance(exc, OSError) else cause
        assert isinstance(error, OSError)
        return f"cannot start {server.command!r}: {error.strerror or error}"
    if isinstance(exc, TimeoutError) or "Failed to initialize" in str(exc):
        return f"did not answer initialize within {server.timeout_s:g}s"
    if _code(exc) == CONNECTION_CLOSED:
        return "it exited before it answered initialize"
    failed, _, why = str(exc).partition(": ")
    if server.url is not None and failed == "Client failed to connect":  # the FastMCP client's words
        return one_line(f"cannot connect to {server.url!r}: {why or exc}")
    return one_line(f"{type(exc).__name__}: {exc}")


def _code(exc: BaseException) -> int | None:
    """The JSON-RPC error code of an MCP error, if it is one."""
    code = getattr(exc, "code", None)
    if code is None:
        code = getattr(getattr(exc, "error", None), "code", None)
    return code if isinstance(code, int) else None


def _wire(tool: Any) -> dict[str, Any]:
    """An MCP tool as the server sent it (MCP's own camelCase names, whichever SDK generation parsed it)."""
    dumped: dict[str, Any] = tool.model_dump(by_alias=True, exclude_none=True)
    return dumped


def _definition(tool: Any) -> ToolDefinition:
    wire = _wire(tool)
    return ToolDefinition(
        name=wire["name"],
        description=wire.get("description"),
        parameters_json_schema=wire.get("inputSchema") or {"type": "object", "properties": {}},
        metadata={"annotations": wire.get("annotations")},
    )


async def _list_once(profile: str, server: McpServer, hidden: Sandbox) -> dict[str, ToolDefinition]:
    toolset = _build(profile, server, hidden)
    try:
        await asyncio.wait_for(toolset.__aenter__(), server.timeout_s + STOP_S)
    except ConfigError:
        raise
    except Exception as exc:
        raise _fail(profile, server, _why_not_started(server, exc)) from None
    try:
        try:
            tools = await asyncio.wait_for(toolset.list_tools(), server.timeout_s)
        except Exception as exc:
            if isinstance(_leaf(exc), TimeoutError):
                raise _fail(profile, server, f"did not list its tools within {server.timeout_s:g}s") from None
            why = one_line(f"listing its tools failed: {type(_leaf(exc)).__name__}: {_leaf(exc)}")
            raise _fail(profile, server, why) from None
        return {definition.name: definition for definition in map(_definition, tools)}
    finally:
        with suppress(Exception):
            await asyncio.wait_for(toolset.__aexit__(None, None, None), STOP_S)


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end from synchronous code, on an event loop of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called on a running loop (a profile first loaded by a run, on the agent loop): a thread of its own.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="subq-mcp-check") as pool:
        return pool.submit(asyncio.run, coro).result()


# How many servers a worker's start lists at once: each is an interpreter or a checkout starting, and
# more at once on a small host only race each other's `timeout_s` (each server's own, from its start).
LIST_AT_ONCE = 4
_checked: dict[tuple[str, str], dict[str, ToolDefinition]] = {}
# A server that `list_at_once` found broken: `checked_tools` raises its error in the check's order.
_refused: dict[tuple[str, str], ConfigError] = {}
_checked_lock = threading.Lock()


def list_at_once(servers: Sequence[tuple[str, McpServer]], hidden: Sandbox | None = None) -> None:
    """List every (profile, server) not listed yet, all at once, for `checked_tools` to answer.

    A worker's start checks each profile's servers; one after another, a fleet of five
    servers waited for five starts (each an interpreter or a `git` checkout). Errors are
    kept and raised by `checked_tools` in the check's own order, so the line a broken
    profile gets is the same. A server whose secrets are missing is left to `checked_tools`.
    """
    todo = []
    for profile, server in servers:
        with _checked_lock:
            if (profile, repr(server)) in _checked:
                continue
        try:
            resolve_secrets(profile, server, server.env, "env")
            resolve_secrets(profile, server, server.headers, "header")
        except ConfigError:
            continue
        todo.append((profile, server))

    async def every() -> list[dict[str, ToolDefinition] | ConfigError]:
        at_once = asyncio.Semaphore(LIST_AT_ONCE)

        async def one(profile: str, server: McpServer) -> dict[str, ToolDefinition] | ConfigError:
            async with at_once:
                try:
                    return await _list_once(profile, server, hidden or Sandbox())
                except ConfigError as exc:
                    return exc

        return await asyncio.gather(*(one(profile, server) for profile, server in todo))

    for (profile, server), listed in zip(todo, _run_sync(every()), strict=True):
        with _checked_lock:
            if isinstance(listed, ConfigError):
                _refused[(profile, repr(server))] = listed
            else:
                _checked[(profile, repr(server))] = listed


def checked_tools(profile: str, server: McpServer, hidden: Sandbox | None = None) -> dict[str, ToolDefinition]:
    """The server's tools (unprefixed names): started, listed within its `timeout_s`, stopped.

    Once per process for each profile's server (a worker's start lists them; its runs
    reuse the list); raises ConfigError naming the profile and the server.
    """
    key = (profile, repr(server))
    with _checked_lock:
        if key in _checked:
            return _checked[key]
        refused = _refused.pop(key, None)
    if refused is not None:
        raise refused
    # Secrets first: a missing variable is named before anything starts.
    resolve_secrets(profile, server, server.env, "env")
    resolve_secrets(profile, server, server.headers, "header")
    listed = _run_sync(_list_once(profile, server, hidden or Sandbox()))
    with _checked_lock:
        _checked[key] = listed
    return listed


def needs_decision_by_hint(tool_def: ToolDefinition) -> bool | None:
    """What an MCP server's annotations say of a call: True (marked `destructiveHint`: a human
    decides unless a rule allows it), False (marked `readOnlyHint`: no one is asked unless the
    profile says so), None (no hint, or not an MCP tool: the policy alone decides).

    Only a hint the server states counts (MCP's default for a tool without one is destructive:
    that would ask about every call of every server that annotates nothing).
    """
    annotations = (tool_def.metadata or {}).get("annotations")
    if not isinstance(annotations, dict):
        return None
    if annotations.get("readOnlyHint") is True:
        return False
    if annotations.get("destructiveHint") is True:
        return True
    return None


def hinted_verdict(profile: Profile, tool: str, args: Mapping[str, object], tool_def: ToolDefinition) -> Verdict:
    """`verdict`, with the tool's MCP hints: a destructive tool is asked about as if
    `approval_tools` named it (an allow rule still allows it, a deny rule denies it); a read-only
    tool that `approval_tools` catches only by a glob is not guarded (a deny rule still denies it)."""
    hint = needs_decision_by_hint(tool_def)
    args = in_schema_order(args, tool_def)
    if hint is False and tool not in profile.approval_tools:
        return verdict(profile, tool, args, guarded=False)
    return verdict(profile, tool, args, guarded=True if hint is True else None)


def in_schema_order(args: Mapping[str, object], tool_def: ToolDefinition) -> dict[str, object]:
    """`args` in the order of the tool's schema's properties, then the rest as given: the rules match a call's
    main argument, its first string, and an MCP tool's arguments came in the model's own order (`{"content":
    "/srv/out x", "path": "/etc/passwd"}` was matched on its content, allowed by `write_file:/srv/out`)."""
    properties = tool_def.parameters_json_schema.get("properties")
    order = list(properties) if isinstance(properties, dict) else []
    return {**{name: args[name] for name in order if name in args}, **args}


class SharedServer(AbstractToolset[Any]):
    """One MCP server of a profile, as every run of the worker process sees it.

    Entering it (each run does) starts nothing: the first `get_tools` on the process's agent
    loop starts its supervisor, which starts the server, keeps it entered for every run, and
    restarts it with backoff when it stops. Tools are offered under `<prefix>_<name>` when the
    server has a prefix, else under their own names.
    """

    def __init__(self, profile: str, server: McpServer, checked: dict[str, ToolDefinition], hidden: Sandbox) -> None:
        self.profile = profile
        self.server = server
        self._hidden = hidden  # what the server never sees, when it runs in the sandbox
        self._checked = checked  # the tools the worker's start listed: offered while the server is down
        self._last: dict[str, ToolDefinition] = {}  # the tools the running server listed last
        self._toolset: MCPToolset[Any] | None = None  # the running server's session, or None
        self._supervisor: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0
        self._up = asyncio.Event()
        self._broken = asyncio.Event()
        self._stopping = False
        self._last_error = ""
        self.starts = 0  # how often this process started the server (its first start included)
        # Where the sandbox's proxy writes each connection it refused (an allow list only), and how far
        # the calls have read: each refusal is told to the run whose call to this server ends next.
        proxied = server.sandbox and isinstance(server.network, list)
        self._refusals = Path(tempfile.mkdtemp(prefix="subq-mcp-")) / "refused" if proxied else None
        self._refusals_read = 0

    @property
    def id(self) -> str:
        return f"{self.profile}:{source_of(self.server)}"

    @property
    def label(self) -> str:
        return f"MCP server {self.server.name!r} of profile {self.profile!r}"

    async def __aenter__(self) -> SharedServer:
        return self  # a run does not start or stop the server: the process does

    async def __aexit__(self, *args: Any) -> bool | None:
        return None

    # --- the supervisor, on the agent loop ---

    def _supervise_here(self) -> None:
        loop = asyncio.get_running_loop()
        supervised = self._supervisor is not None and not self._supervisor.done()
        if supervised and self._loop is loop and self._pid == os.getpid():
            return
        self._loop, self._pid, self._stopping = loop, os.getpid(), False
        self._up, self._broken = asyncio.Event(), asyncio.Event()
        self._toolset = None
        self._supervisor = loop.create_task(self._supervise(), name=f"subq-mcp-{self.server.name}")
        with _shared_lock:
            _running.add(self)

    async def _supervise(self) -> None:
        failures = 0
        while not self._stopping:
            started = time.monotonic()
            toolset: MCPToolset[Any] | None = None
            try:
                toolset = _build(self.profile, self.server, self._hidden, self._refusals)
                await asyncio.wait_for(toolset.__aenter__(), self.server.timeout_s + STOP_S)
                await asyncio.wait_for(toolset.list_tools(), self.server.timeout_s)
            except Exception as exc:
                failures += 1
                self._last_error = _why_not_started(self.server, exc)
                log.warning("subq: %s did not start: %s", self.label, self._last_error)
                if toolset is not None:
                    await _close(toolset)
                await self._backoff(failures)
                continue
            self.starts += 1
            self._toolset, self._last_error = toolset, ""
            self._broken.clear()
            self._up.set()
            log.info("subq: %s started", self.label)
            try:
                await self._until_gone(toolset)
            finally:
                self._up.clear()
                self._toolset = None
                await _close(toolset)
            if self._stopping:
                return
            self._last_error = self._last_error or "it stopped"
            failures = 0 if time.monotonic() - started > BACKOFF_RESET_S else failures + 1
            log.warning("subq: %s stopped (%s); restarting it", self.label, self._last_error)
            await self._backoff(failures)

    async def _until_gone(self, toolset: MCPToolset[Any]) -> None:
        while not self._stopping and not self._broken.is_set() and not _gone(toolset):
            with suppress(TimeoutError):
                await asyncio.wait_for(self._broken.wait(), WATCH_S)

    async def _backoff(self, failures: int) -> None:
        delay = 0.0 if failures == 0 else min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (failures - 1))
        with suppress(TimeoutError):
            await asyncio.wait_for(self._stopped(), delay)

    async def _stopped(self) -> None:
        while not self._stopping:
            await self._broken.wait()
            self._broken.clear()

    async def stop(self) -> None:
        """Stop the server and its supervisor (the worker's shutdown)."""
        self._stopping = True
        self._broken.set()
        if self._supervisor is not None:
            with suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._supervisor, STOP_S)
        if self._refusals is not None:
            shutil.rmtree(self._refusals.parent, ignore_errors=True)

    # --- the toolset every run sees ---

    def _name(self, name: str) -> str:
        return f"{self.server.prefix}_{name}" if self.server.prefix else name

    def _offered(self, tool: ToolsetTool[Any]) -> ToolsetTool[Any]:
        metadata = dict(tool.tool_def.metadata or {})
        metadata["mcp_server"] = self.server.name
        annotations = metadata.get("annotations") or {}
        if annotations.get("readOnlyHint") is True or annotations.get("idempotentHint") is True:
            metadata["idempotent"] = True  # safe to call again (profile_tools.idempotent)
        tool_def = replace(tool.tool_def, name=self._name(tool.tool_def.name), metadata=metadata)
        return replace(tool, toolset=self, tool_def=tool_def)

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        self._supervise_here()
        if self._toolset is None:  # starting, or restarting: wait for it a while, then go on without it
            with suppress(TimeoutError):
                await asyncio.wait_for(self._up.wait(), self.server.timeout_s)
        toolset = self._toolset
        if toolset is not None:
            try:
                tools = await toolset.get_tools(ctx)
            except Exception as exc:
                self._lost(toolset, exc)
            else:
                self._last = {name: tool.tool_def for name, tool in tools.items()}
                return {self._name(name): self._offered(tool) for name, tool in tools.items()}
        from pydantic_ai.mcp import TOOL_SCHEMA_VALIDATOR

        known = self._last or self._checked
        return {
            self._name(name): self._offered(
                ToolsetTool(
                    toolset=self, tool_def=tool_def, max_retries=ctx.max_retries, args_validator=TOOL_SCHEMA_VALIDATOR
                )
            )
            for name, tool_def in known.items()
        }

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        from fastmcp.exceptions import ToolError

        # A failed call is an error result for the model, and counts as `error` with its `tool_error` line
        # (`CallFailed`, answered by the guarded toolset): it once counted as `ok`, with no line.
        toolset = self._toolset
        if toolset is None:
            why = self._last_error or "it is starting"
            raise CallFailed(f"Error: MCP server {self.server.name!r} is not running ({why}); it is being restarted")
        original = name.removeprefix(f"{self.server.prefix}_") if self.server.prefix else name
        inner = replace(tool, toolset=toolset, tool_def=replace(tool.tool_def, name=original))
        try:
            return await toolset.call_tool(original, tool_args, ctx, inner)
        except ToolError as exc:  # the tool failed, the server answered
            text = one_line(str(exc)).removeprefix("Error executing tool ")
            raise CallFailed(f"Error: {text}", ran=True) from None
        except Exception as exc:
            if self._lost(toolset, exc):
                stopped = f"Error: MCP server {self.server.name!r} stopped during the call; it is being restarted"
                raise CallFailed(stopped, ran=True) from None
            raise CallFailed(f"Error: {one_line(str(exc)) or type(exc).__name__}", ran=True) from None
        finally:
            report_refused(ctx.deps.run, source_of(self.server), self._new_refusals())

    def _new_refusals(self) -> list[str]:
        """The connections the proxy refused since the last call read them (whole lines only)."""
        if self._refusals is None:
            return []
        try:
            with self._refusals.open("rb") as written:
                written.seek(self._refusals_read)
                data = written.read(MAX_REFUSALS_BYTES)
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self._refusals_read += len(whole)
        return [line for line in whole.decode(errors="replace").splitlines() if line]

    def _lost(self, toolset: MCPToolset[Any], exc: BaseException) -> bool:
        """Whether a failure means the server is gone; if so, the supervisor restarts it."""
        leaf = _leaf(exc)
        from fastmcp.exceptions import McpError

        gone = _gone(toolset) or not isinstance(leaf, McpError) or _code(leaf) == CONNECTION_CLOSED
        if gone and toolset is self._toolset:
            self._last_error = one_line(f"{type(leaf).__name__}: {leaf}")
            self._broken.set()
        return gone


def _gone(toolset: MCPToolset[Any]) -> bool:
    """Whether the server's session is over: its client disconnected, or (stdio) its process exited."""
    if not toolset.client.is_connected():
        return True
    # FastMCP's own test of a stdio session whose process is gone (it has no public one); without
    # it, a call that finds the server gone still has it restarted.
    dead = getattr(toolset.client.transport, "_is_session_dead", None)
    return bool(dead()) if callable(dead) else False


async def _close(toolset: MCPToolset[Any]) -> None:
    if toolset.is_running:
        with suppress(Exception):
            await asyncio.wait_for(toolset.__aexit__(None, None, None), STOP_S)


_shared: dict[tuple[int, str, str], SharedServer] = {}
_running: set[SharedServer] = set()
_shared_lock = threading.Lock()


def shared_server(
    profile: str, server: McpServer, checked: dict[str, ToolDefinition], hidden: Sandbox | None = None
) -> SharedServer:
    """The process's one `SharedServer` for a profile's server."""
    key = (os.getpid(), profile, repr(server))
    with _shared_lock:
        if key not in _shared:
            _shared[key] = SharedServer(profile, server, checked, hidden or Sandbox())
        return _shared[key]


def stop_all(timeout_s: float = STOP_S) -> None:
    """Stop every MCP server this process started (a worker's shutdown); from any thread but the agent loop's."""
    with _shared_lock:
        running = [s for s in _running if s._pid == os.getpid() and s._loop is not None]
        _running.clear()
    futures = []
    for server in running:
        loop = server._loop
        assert loop is not None
        if loop.is_running():
            futures.append(asyncio.run_coroutine_threadsafe(server.stop(), loop))
    if futures:
        concurrent.futures.wait(futures, timeout=timeout_s)
