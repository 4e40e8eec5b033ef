"""The tools each profile offers the model: imported when a worker starts, checked, filtered, guarded.

A profile (coordinator/settings.py, docs/tools.md) offers the orchestration
tools (workers/runtime/tools.py: `update_todo_list`, `new_task`,
`run_subagents`, and `run_command` when the profile enables it) and its own
`tools`, each a `package.module:attribute` naming a function (plain, or taking
pydantic-ai's `RunContext` first) or a pydantic-ai `FunctionToolset`. Then:

- `allowed_tools` / `disallowed_tools` (names or `*` globs, over everything
  the profile offers) choose which tools the model gets; a disallowed tool is
  not offered at all, so a call to it is a call to an unknown tool;
- every call goes through the profile's approval policy (`PolicyToolset`,
  workers/runtime/approval_policy.py), whatever the tool: a call the policy
  asks about ends the run and waits for a human decision, as `run_command`'s
  always did; a denied call gets the denial as its result and never runs;
- the model reads at most the profile's `max_tool_output_chars` of one result
  (its beginning and its end, with a line saying how much was cut between
  them): a `git log` or a whole file cannot fill the context window at once
  (docs/context.md); the journal keeps what the model read.

A tool is offered under its own name; two tools of one name in a profile are an
error. Every bad entry (an import path that does not import, an attribute that
is neither a function nor a `FunctionToolset`, a name clash) stops the worker at
start with one line naming the profile and the entry (`check`, called on
Celery's `worker_init`), and `subq tools` runs the same check and lists each
profile's tools with where each comes from (`python -m
workers.runtime.profile_tools`). Tools are imported once per worker process, and
each profile's agent is built once per process from them (`Toolbox`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib
import inspect
import itertools
import json
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Any

import pydantic
from pydantic_ai import ApprovalRequired, CallDeferred, ModelRetry, RunContext, ToolReturn
from pydantic_ai.messages import AudioUrl, BinaryContent, DocumentUrl, ImageUrl, VideoUrl
from pydantic_ai.toolsets import AbstractToolset, CombinedToolset, FunctionToolset, WrapperToolset
from pydantic_ai.toolsets.abstract import ToolsetTool

from coordinator import (
    ConfigError,
    McpServer,
    Profile,
    ProfileError,
    RunCommand,
    Settings,
    load_settings,
    network_label,
    one_line,
    usd_to_micros,
)
from coordinator.runs import LeaseLost, Run
from coordinator.tracing import span
from workers import observe
from workers.runtime import mcp_servers, pricing, sandbox, thread_holds
from workers.runtime.approval_policy import unguarded_command
from workers.runtime.compaction import cap_text
from workers.runtime.pricing import parse_usd
from workers.runtime.tools import SELF_GUARDED, CallAnswered, RunState, apply_verdict, orchestration_tools

__all__ = [
    "APPROVED_BY_HUMAN",
    "BUILT_IN",
    "COST_KEY",
    "CUT_OFF",
    "INTERRUPTED",
    "OUTPUT_TOOLS",
    "OWN_STATE_TOOLS",
    "PolicyToolset",
    "ProfileTools",
    "Toolbox",
    "answer_without_running",
    "capped",
    "check",
    "idempotency_key",
    "idempotent",
    "load_profile",
    "policy_warnings",
    "reported_cost",
]

log = logging.getLogger(__name__)

# Where a tool comes from when subq itself offers it.
BUILT_IN = "subq"
# The output tools the agent always has (not a toolset's: pydantic-ai ends the run with them).
OUTPUT_TOOLS = frozenset({"attempt_completion"})


# subq's tools whose effects subq keeps itself (the plan, a delegation, answered by its batch on
# resume): never journaled. Every other call's result is (`Run.record_tool_call`).
OWN_STATE_TOOLS = frozenset({"update_todo_list", "new_task", "run_subagents"})
# The metadata a resumed run gives a call of its last response that has no kept result: it may
# have been running when its worker died.
CUT_OFF = "subq_cut_off"
# ... and one a human had approved: the policy is not asked again (the decision stands), but the
# approval is no leave to run a call that may have taken effect again.
APPROVED_BY_HUMAN = "subq_approved"
INTERRUPTED = (
    "Error: interrupted: this call was running when its worker stopped, and may or may not have taken "
    "effect; check before calling it again."
)


def timeout_of(profile: Profile, tool: str) -> float:
    """How long a call of `tool` may run: the first of the profile's `tool_timeouts` globs that matches it,
    else its `tool_timeout_s`. (A plain function runs in a thread, which a timeout leaves to finish.)"""
    for pattern, seconds in profile.tool_timeouts.items():
        if fnmatchcase(tool, pattern):
            return seconds
    return profile.tool_timeout_s


# A call that waits for a fleet-wide tool slot asks again this often (growing to the last), and
# holds a slot it took for its timeout plus this, after which a dead worker's slot is free again.
SLOT_WAITS_S = (0.05, 0.1, 0.2, 0.5)
SLOT_LEASE_MARGIN_S = 30.0


@asynccontextmanager
async def _fleet_limit(ctx: RunContext[RunState], tool: str, timeout_s: float) -> AsyncIterator[None]:
    """Wait, inside the run, until the profile's `tool_limits` let this call start; hold its slot while it runs."""
    run, limits = ctx.deps.run, ctx.deps.profile.tool_limits
    pattern = next((p for p in limits if fnmatchcase(tool, p)), None)
    if pattern is None:
        yield
        return
    limit, call_id, said = limits[pattern], ctx.tool_call_id or "", False

    def waiting() -> None:
        nonlocal said
        if not said:
            run.say("tool_waiting", f"{tool}: waiting for the fleet-wide limit of {pattern!r}")
            said = True

    if limit.rpm:
        while wait_ms := run.limits.tool_rate_wait_ms(pattern, limit.rpm):
            waiting()
            await asyncio.sleep(wait_ms / 1000)
    if not limit.concurrency:
        yield
        return
    lease_s = timeout_s + SLOT_LEASE_MARGIN_S
    for attempt in itertools.count():
        if lease_ends_ms := run.limits.take_tool_slot(pattern, limit.concurrency, lease_s, call_id):
            break
        waiting()
        await asyncio.sleep(SLOT_WAITS_S[min(attempt, len(SLOT_WAITS_S) - 1)])
    # Freed as the call ends, or, when a sync tool's thread runs on past it (a timeout, a stop), as that ends.
    free = functools.partial(run.limits.free_tool_slot, pattern, call_id, lease_ends_ms)
    with thread_holds.holding(thread_holds.SlotHold(free)):
        yield


# The key of a `ToolReturn`'s metadata by which a tool reports what its call cost, in USD.
COST_KEY = "cost_usd"


def reported_cost(tool: str, result: object) -> Decimal | None:
    """What a call says it cost: `ToolReturn(value, metadata={"cost_usd": "0.0042"})`; None when it says nothing.
    A value that is not a non-negative number of dollars is left out, with a warning naming the tool."""
    if not isinstance(result, ToolReturn) or not isinstance(result.metadata, dict) or COST_KEY not in result.metadata:
        return None
    usd = parse_usd(result.metadata[COST_KEY])  # read as a provider's reported cost is
    if usd is None:
        value = result.metadata[COST_KEY]
        log.warning("subq: tool %s reported a cost of %r, not a non-negative number of USD: not charged", tool, value)
    return usd


def charge(run: Run, profile: Profile, tool: str, tool_call_id: str, reported_usd: Decimal | None = None) -> None:
    """Put a call's cost on its task's spend: what the tool reported, else the price of the first of the
    profile's `tool_prices` globs that matches. Written with the call's journal entry, in its step."""
    price = next((usd for pattern, usd in profile.tool_prices.items() if fnmatchcase(tool, pattern)), None)
    usd = reported_usd if reported_usd is not None else price
    if usd:
        run.journal.cost(tool_call_id, tool, usd_to_micros(usd))


def idempotency_key(ctx: RunContext[Any]) -> str:
    """A stable key for this tool call, `<task_id>:<tool_call_id>`: the same on every resume of the run,
    so a tool that calls an external API can pass it as the API's idempotency key (a second call with
    it does nothing twice). For a tool that takes pydantic-ai's `RunContext` (docs/tools.md)."""
    return f"{ctx.deps.run.task_id}:{ctx.tool_call_id}"


def idempotent(tool: ToolsetTool[Any], profile: Profile) -> bool:
    """A tool declared safe to run twice: `metadata={"idempotent": True}` on a function tool (an MCP
    server's read-only and idempotent hints set it too), or named by the profile's `idempotent_tools`."""
    name = tool.tool_def.name
    return bool((tool.tool_def.metadata or {}).get("idempotent")) or any(
        fnmatchcase(name, pattern) for pattern in profile.idempotent_tools
    )


@dataclass(eq=False)
class PolicyToolset(WrapperToolset[RunState]):
    """Every call of the wrapped tools goes through the run's profile's approval policy first, and
    its result is kept the moment it returns (the journal: a resume replays it, never calls again).

    A call that was cut off by its worker's death (`CUT_OFF`) runs again only if its tool is
    idempotent; otherwise its result says it was interrupted. Either way the policy decides anew.
    """

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[RunState], tool: ToolsetTool[RunState]
    ) -> Any:
        run, call_id, metadata = ctx.deps.run, ctx.tool_call_id or "", ctx.tool_call_metadata or {}
        cut_off = bool(ctx.tool_call_approved and metadata.get(CUT_OFF))
        asks_policy = not ctx.tool_call_approved or (cut_off and not metadata.get(APPROVED_BY_HUMAN))
        # A self-guarded tool applies the policy itself, after its own checks; a call of it cut off with no
        # person's approval is asked here, as any other: run_command took the resume's approval for a person's, and
        # an idempotent one ran a command nobody approved (a worker dead before its park saved every approval).
        guarded_here = name not in SELF_GUARDED or cut_off
        if asks_policy and guarded_here and (denied := _policy_denial(ctx, name, tool_args, tool)):
            return denied
        safe_twice = idempotent(tool, ctx.deps.profile)
        if cut_off and not safe_twice:
            line = f"{name}({json.dumps(tool_args)})"
            answer_without_running(ctx.deps, call_id, name, "interrupted", line, kind="tool_interrupted")
            return INTERRUPTED
        if name in OWN_STATE_TOOLS:
            return await super().call_tool(name, tool_args, ctx, tool)  # their refusals are results already
        if not safe_twice:
            # The response is kept before a call that must not run twice starts: a run resumed after this
            # worker dies finds the call, and does not ask the model again (which might repeat it). A response of
            # idempotent calls only is kept by the step of its first call's result.
            run.journal.keep_calls()
        # A call a human approved is marked started once it holds its slots, as it starts: a resume after this
        # worker dies must not take the approval as leave to run it again. Marked before its wait for a slot (as
        # it was), a call still queued behind `max_tool_calls_at_once` or a tool limit was answered "interrupted"
        # by the resume, though it had never run: the approved action was never carried out.
        approved = bool(ctx.tool_call_approved and not cut_off)
        outcome, result, started_s = await self._call_within_limits(name, tool_args, ctx, tool, approved=approved)
        ran_s = time.monotonic() - started_s if started_s else None
        if started_s:  # a call that ran is charged, whatever its outcome; one refused or that never started is not
            charge(run, ctx.deps.profile, name, call_id, reported_cost(name, result))
        result = capped(result, ctx.deps.profile.max_tool_output_chars, name)
        # A ToolReturn's value is what the model reads: the journal keeps that for a replay.
        _done(ctx, name, outcome, result.return_value if isinstance(result, ToolReturn) else result, ran_s)
        return result

    async def _call_within_limits(
        self,
        name: str,
        tool_args: dict[str, Any],
        ctx: RunContext[RunState],
        tool: ToolsetTool[RunState],
        *,
        approved: bool,
    ) -> tuple[str, Any, float]:
        """The call, within the worker's and the fleet's limits and its timeout: its outcome, its result (a failure's
        is the text the model reads) and when it started (0.0: it never did). A tool's failure is a result; a
        ModelRetry is answered as an error and raised on, and pydantic-ai's own signals are raised on. `approved`:
        a human approved it, and the journal marks it started once it holds its slots."""
        run = ctx.deps.run
        timeout_s = timeout_of(ctx.deps.profile, name)
        outcome, started_s = "ok", 0.0
        try:
            async with ctx.deps.calls_at_once, _fleet_limit(ctx, name, timeout_s):
                if approved:
                    run.journal.mark_started(ctx.tool_call_id or "")  # (LeaseLost, raised on below)
                started_s = time.monotonic()
                # asyncio.timeout, not wait_for: no task of its own a call (wait_for makes one on 3.11).
                with span("subq.tool", task_id=run.task_id, tool=name):  # under the run's trace
                    async with asyncio.timeout(timeout_s):
                        result = await super().call_tool(name, tool_args, ctx, tool)
        except TimeoutError:
            outcome, result = "timeout", f"Error: {name} timed out after {timeout_s:g} s"
            run.say("tool_error", result)
        except CallAnswered as answered:  # the tool decided the outcome itself (a denial, a failure)
            outcome, result = answered.outcome, answered.text
            started_s = started_s if answered.ran else 0.0  # refused, or it could not start: it never ran
            run.say("tool_denied" if outcome == "denied" else "tool_error", f"{name}: {result}")
        except ModelRetry as retry:  # the tool asks the model to call again: this call failed
            run.say("tool_error", f"{name}: {one_line(str(retry))}")
            ran_s = time.monotonic() - started_s if started_s else None
            if started_s:  # it ran (and did its work, it may be): its price is charged as any call's that ran
                charge(run, ctx.deps.profile, name, ctx.tool_call_id or "", None)
            _done(ctx, name, "error", f"Error: {one_line(str(retry))}", ran_s)
            raise
        except (ApprovalRequired, CallDeferred, LeaseLost):
            raise  # pydantic-ai's own signals: wait for a decision, defer; a run that lost its lease writes nothing
        except Exception as exc:  # a tool's failure is a result for the model; the run goes on
            log.warning("subq: tool %s failed", name, exc_info=True)  # with the run's fields (workers/observe.py)
            outcome, result = "error", f"Error: {type(exc).__name__}: {one_line(str(exc))}"
            run.say("tool_error", f"{name}: {result}")
        return outcome, result, started_s


def _policy_denial(
    ctx: RunContext[RunState], name: str, tool_args: dict[str, Any], tool: ToolsetTool[RunState]
) -> str | None:
    """The policy's denial of a call, said and answered as the call's result; None where the call may run (and
    ApprovalRequired raised where the policy asks a human)."""
    # An MCP tool's hints count where no rule of the profile names it (workers/runtime/mcp_servers.py).
    decided = mcp_servers.hinted_verdict(ctx.deps.profile, name, tool_args, tool.tool_def)
    denied = apply_verdict(name, tool_args, decided)  # raises ApprovalRequired to ask
    if denied:
        answer_without_running(ctx.deps, ctx.tool_call_id or "", name, "denied", f"{name}: {denied}")
    return denied


# Any result as the JSON pydantic-ai sends the model.
_JSON: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(Any)
# What a tool may return that is not text to cut (an image, a file): the model reads it as it is.
_MEDIA = (AudioUrl, BinaryContent, DocumentUrl, ImageUrl, VideoUrl)
# A result this little over the cap is left whole: it is a result its tool cut itself, to the same cap, with
# its own line saying so (run_command's `max_output_chars`, 20,000 too by default); cut again, it read twice cut.
CAP_SLACK_CHARS = 200


def capped(result: Any, max_chars: int, tool: str) -> Any:
    """What the model reads of a call's result: the result, or where its text (a structured result's JSON, as
    pydantic-ai sends it) is longer than `max_chars` (and `CAP_SLACK_CHARS`), its beginning and end with a line
    saying how much was cut."""
    if isinstance(result, ToolReturn):
        value = capped(result.return_value, max_chars, tool)
        return result if value is result.return_value else dataclasses.replace(result, return_value=value)
    if isinstance(result, str):
        text = result
    elif isinstance(result, dict | list | tuple | pydantic.BaseModel) and not _has_media(result):
        text = _JSON.dump_json(result, fallback=str).decode()
    else:
        return result  # a number, None, media: short, or not text to cut
    if len(text) <= max_chars + CAP_SLACK_CHARS:
        return result
    return cap_text(text, max_chars, f"{tool}'s result (max_tool_output_chars is {max_chars:,})")


def _has_media(result: object) -> bool:
    return isinstance(result, list | tuple) and any(isinstance(item, _MEDIA) for item in result)


def _done(
    ctx: RunContext[RunState], tool: str, outcome: str, result: object = None, ran_s: float | None = None
) -> None:
    """A call answered: journaled and counted on its task in its run's step, and told to the metrics and to
    the run's next progress event (`ran_s` None: it never ran)."""
    ms = round((ran_s or 0) * 1000)
    observe.tool_call(tool, outcome, ran_s)
    ctx.deps.tool_calls.append({"tool": tool, "outcome": outcome, "ms": ms})
    ctx.deps.run.journal.record(ctx.tool_call_id or "", tool, outcome, result, ms)


def answer_without_running(
    run_state: RunState,
    tool_call_id: str,
    tool: str,
    outcome: str,
    line: str,
    *,
    kind: str | None = None,
    known: bool = True,
) -> None:
    """A call answered before its tool could run (its arguments failed validation, it names no tool of the
    task, a human denied it): a UI line of its outcome (`kind`, else `tool_error` or `tool_denied`), and counted on its task as `outcome`. An error's line
    is kept as its result, so a run resumed before its conversation was saved answers it the same way; a denial's
    answer is kept empty, so that run answers it again without a second line or count (`RunState.answered`)."""
    if tool_call_id in run_state.answered:
        return
    run_state.run.say(kind or ("tool_denied" if outcome == "denied" else "tool_error"), line)
    observe.tool_call(tool if known else observe.UNKNOWN_TOOL, outcome, None)  # (`known`: a tool of the task)
    run_state.tool_calls.append({"tool": tool, "outcome": outcome, "ms": 0})
    kept = None if outcome in ("denied", "interrupted") else line  # (the journal keeps those two empty)
    run_state.run.journal.record(tool_call_id, tool, outcome, kept)


@dataclass(frozen=True)
class ProfileTools:
    """What one profile offers: its toolset (filtered and guarded) and each tool's source."""

    profile: str
    system_prompt: str
    toolset: AbstractToolset[RunState]
    sources: dict[str, str]  # tool name -> `subq` or the import path it came from, in offer order
    names: frozenset[str] = field(init=False)  # every tool the model may call, the output tools included

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(self.sources) | OUTPUT_TOOLS)


def _fail(profile: str, entry: str, why: str) -> ConfigError:
    return ConfigError(f"Invalid profile {profile!r}: {entry}: {why}", field="profile")


def _claim(profile: str, entry: str, tool: str, source: str, sources: dict[str, str]) -> None:
    """Offer `tool` from `source`; a name the profile offers already (or an output tool's) is an error naming both."""
    if tool in sources or tool in OUTPUT_TOOLS:
        other = "subq's own" if sources.get(tool, BUILT_IN) == BUILT_IN else repr(sources[tool])
        raise _fail(profile, entry, f"its tool {tool!r} has the same name as a tool of {other}")
    sources[tool] = source


def _import(profile: str, path: str) -> FunctionToolset[Any]:
    """The toolset an import path names: a function becomes a toolset of one tool."""
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import error, or any error the module raises as it loads
        why = f"cannot import {module_name}: {type(exc).__name__}: {exc}"
        raise _fail(profile, f"tools entry {path!r}", why) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise _fail(profile, f"tools entry {path!r}", f"{module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    if isinstance(target, FunctionToolset):
        return target
    if inspect.isfunction(target) or inspect.isbuiltin(target) or inspect.ismethod(target):
        try:
            return FunctionToolset([target])
        except Exception as exc:  # pydantic-ai could not make a schema of its parameters
            why = f"not usable as a tool: {type(exc).__name__}: {exc}"
            raise _fail(profile, f"tools entry {path!r}", why) from None
    kind = type(target).__name__
    raise _fail(profile, f"tools entry {path!r}", f"is a {kind}, neither a function nor a pydantic-ai FunctionToolset")


def _check_sandbox(profile: str, entry: str, network: bool | list[str]) -> None:
    """The profile's commands run confined: the sandbox must start on this machine, or the worker refuses."""
    try:
        sandbox.probe(network)
    except sandbox.SandboxUnavailable as exc:
        why = f"its OS sandbox cannot start here ({exc}); the worker needs {sandbox.NEEDS}, or set sandbox = false"
        raise _fail(profile, entry, why) from None


def _offered(name: str, allowed: list[str] | None, disallowed: list[str]) -> bool:
    if any(fnmatchcase(name, pattern) for pattern in disallowed):
        return False
    return allowed is None or any(fnmatchcase(name, pattern) for pattern in allowed)


def _mcp_server(
    profile: str, server: McpServer, sources: dict[str, str], hidden: sandbox.Sandbox
) -> AbstractToolset[Any]:
    """A profile's MCP server: listed by the check (started, listed, stopped), its names added to
    `sources` (`mcp:<name>`); the process's one shared server, started by the first run that uses it."""
    if server.sandbox:
        _check_sandbox(profile, f"mcp_servers entry {server.name!r}", server.network)
    checked = mcp_servers.checked_tools(profile, server, hidden)
    for tool in checked:
        offered = f"{server.prefix}_{tool}" if server.prefix else tool
        _claim(profile, f"mcp_servers entry {server.name!r}", offered, mcp_servers.source_of(server), sources)
    return mcp_servers.shared_server(profile, server, checked, hidden)


def load_profile(name: str, settings: Settings) -> ProfileTools:
    """Import and check one profile's tools; raises ConfigError naming the profile and the entry."""
    profile = settings.profile(name)
    sources = {tool: BUILT_IN for tool in orchestration_tools.tools if tool != "run_command"}
    if profile.run_command is not None:
        sources["run_command"] = BUILT_IN
        if profile.run_command.sandbox:
            _check_sandbox(name, "run_command", profile.run_command.network)
    functions: list[FunctionToolset[Any]] = []
    for path in profile.tools:
        toolset = _import(name, path)
        for tool in toolset.tools:
            _claim(name, f"tools entry {path!r}", tool, path, sources)
        functions.append(toolset)
    servers = [_mcp_server(name, server, sources, sandbox.Sandbox.of(settings)) for server in profile.mcp_servers]
    offered = {
        tool: source
        for tool, source in sources.items()
        if _offered(tool, profile.allowed_tools, profile.disallowed_tools)
    }
    return ProfileTools(name, profile.system_prompt, PolicyToolset(_offered_only(functions, servers, offered)), offered)


def _offered_only(
    functions: list[FunctionToolset[Any]], servers: list[AbstractToolset[Any]], offered: dict[str, str]
) -> AbstractToolset[RunState]:
    """subq's own tools and the profile's, only those it offers: every step of every run lists them through each
    layer (each a few hundred calls of a child's ~11,000 in pydantic-ai, bench/thread_cpu.py), so a layer is added
    only where it hides something. subq's own tools are a toolset of the offered ones (run_command only where the
    profile enables it); a function toolset keeps its tools as imported unless one is not offered; an MCP
    server's is always filtered, as it may list a tool later that the worker's start did not check."""
    own = FunctionToolset([tool for tool_name, tool in orchestration_tools.tools.items() if tool_name in offered])
    parts: list[AbstractToolset[Any]] = [own]
    for toolset in functions:
        parts.append(toolset if offered.keys() >= toolset.tools.keys() else _filtered(toolset, offered))
    parts += [_filtered(server, offered) for server in servers]
    return parts[0] if len(parts) == 1 else CombinedToolset(parts)


def _filtered(toolset: AbstractToolset[Any], offered: dict[str, str]) -> AbstractToolset[Any]:
    return toolset.filtered(lambda _ctx, tool_def: tool_def.name in offered)


def check(settings: Settings) -> dict[str, ProfileTools]:
    """Every profile's tools, imported and checked (a worker's start; `subq tools`)."""
    # Every profile's MCP servers are started and listed at once first; the loop below checks
    # them in order from that list, so a start takes the slowest server's time, not their sum.
    profiles = settings.all_profiles()
    servers = [(name, server) for name, profile in profiles.items() for server in profile.mcp_servers]
    mcp_servers.list_at_once(servers, sandbox.Sandbox.of(settings))
    return {name: load_profile(name, settings) for name in profiles}


def policy_warnings(settings: Settings, names: list[str] | None = None) -> list[str]:
    """One line for each profile whose policy lets something risky through (a worker's start and
    `subq tools` print them): a profile that may be meant that way is warned about, not refused."""
    lines = []
    for name in names if names is not None else list(settings.all_profiles()):
        profile = settings.profile(name)
        if profile.run_command is not None and not profile.run_command.sandbox:
            lines.append(f"profile {name!r} runs its commands without the OS sandbox (sandbox = false)")
        if unguarded_command(profile):
            lines.append(
                f"profile {name!r} enables run_command and nothing guards it: every command no deny rule "
                'catches runs without a decision (add "run_command" to approval_tools, with narrow allow rules)'
            )
        if (why := pricing.unpriced(profile)) is not None:
            lines.append(
                f"profile {name!r} has no price, and {why}: its requests are recorded at $0, and no budget or quota "
                "counts them (give it a price, or priced_as a model the library knows)"
            )
    return lines


@dataclass
class Toolbox:
    """One per worker process: each profile's tools, loaded once, and the agent built on them."""

    settings: Settings
    _tools: dict[str, ProfileTools] = field(default_factory=dict)
    _agents: dict[tuple[str, bool], Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def tools(self, profile: str | None) -> ProfileTools:
        name = profile or self.settings.default_profile
        with self._lock:
            if name not in self._tools:
                self._tools[name] = load_profile(name, self.settings)
            return self._tools[name]

    def agent(self, profile: str | None, with_planner: bool, build: Callable[[ProfileTools, bool], Any]) -> Any:
        """The profile's agent, built by `build` once per process (building one generates every tool's schema)."""
        tools = self.tools(profile)
        key = (tools.profile, with_planner)
        with self._lock:
            if key not in self._agents:
                self._agents[key] = build(tools, with_planner)
            return self._agents[key]


def networks(profile: Profile) -> list[str]:
    """What each program the profile runs may reach: run_command's and each stdio MCP server's network
    (none, public, or the hosts), or `unconfined` where it runs without the sandbox."""
    confined: list[tuple[str, RunCommand | McpServer]] = (
        [("run_command", profile.run_command)] if profile.run_command is not None else []
    )
    confined += [(mcp_servers.source_of(server), server) for server in profile.mcp_servers if server.command]
    return [
        f"{what}: {network_label(entry.network) if entry.sandbox else 'unconfined (sandbox = false)'}"
        for what, entry in confined
    ]


def _describe(loaded: dict[str, ProfileTools], settings: Settings) -> list[str]:
    lines = []
    for name, tools in loaded.items():
        lines.append(f"{name}:")
        width = max(len(tool) for tool in [*tools.sources, *OUTPUT_TOOLS])
        lines += [f"  {tool:<{width}}  {source}" for tool, source in tools.sources.items()]
        lines += [f"  {tool:<{width}}  {BUILT_IN} (ends the task)" for tool in sorted(OUTPUT_TOOLS)]
        if reach := networks(settings.profile(name)):
            lines.append(f"  network: {'; '.join(reach)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """`subq tools`: check every profile's tools as a worker would at start, and list them."""
    parser = argparse.ArgumentParser(prog="subq tools")
    parser.add_argument("--profile", help="only this profile")
    parser.add_argument("--json", action="store_true", help="one JSON object: profile -> tool -> source")
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        if args.profile is not None:
            settings.profile(args.profile)  # an unknown profile: one line
        names = [args.profile] if args.profile else list(settings.all_profiles())
        loaded = {name: load_profile(name, settings) for name in names}
    except (ConfigError, ProfileError) as exc:
        print(f"subq: {exc}", file=sys.stderr)
        return 1  # a refusal of subq's own, as every subq command's (2 is argparse's, for malformed arguments)
    for line in policy_warnings(settings, names):
        print(f"subq: warning: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps({name: tools.sources for name, tools in loaded.items()}))
    else:
        print("\n".join(_describe(loaded, settings)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
