"""Settings from the environment (`SUBQ_` prefix), and model profiles.

One `Settings` class; nothing else in subq reads the environment. Every
default is a named constant with the reason for its value. `load_settings()`
turns a validation failure into one `ConfigError` line naming the variable.
"""

from __future__ import annotations

import difflib
import importlib
import ipaddress
import json
import logging
import os
import re
import ssl
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit, urlunsplit

import pydantic
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    StringConstraints,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from coordinator.access import ApiKeySpec, check_distinct, parse_keys, read_keys_file
from coordinator.config_file import json_value, read_data
from coordinator.errors import ConfigError, ProfileError
from coordinator.inputs import MAX_SUBTASKS
from coordinator.local import MAX_CONCURRENCY
from coordinator.output_schema import schema_problem
from coordinator.subscriptions import HOST_NAME_RE, check_webhook_events, check_webhook_secret, check_webhook_url
from coordinator.tenants import (
    DEFAULT_POLICY_NAME,
    DEFAULT_TENANT,
    TenantPolicy,
    Tenants,
    check_tenant_name,
    parse_tenants,
    read_tenants_file,
)
from coordinator.text import ascii_digits, cut_value

__all__ = [
    "DEFAULT_PRICED_AS",
    "OFFLINE_PROFILE",
    "STANDARD_KEYS",
    "McpServer",
    "Price",
    "Profile",
    "RunCommand",
    "Settings",
    "ToolLimit",
    "load_settings",
    "network_label",
    "unknown_variables",
]

log = logging.getLogger(__name__)

# A week: long enough to inspect yesterday's runs, short enough that Redis memory stays bounded.
DEFAULT_RETENTION_S = 7 * 24 * 3600
# What the examples' secrets hold until an operator fills them in (.env.example, the overlays' secrets.env.example):
# refused as a token or a password, so a copy started before it was filled in is not open to anyone who reads them.
PLACEHOLDER_SECRET = "change-me"
GENERATE_HINT = 'generate one: python -c "import secrets; print(secrets.token_urlsafe(32))"'
# Subagents wait on model APIs, not on the CPU: threads let one process run many at once.
DEFAULT_POOL = "threads"
DEFAULT_CONCURRENCY = 32
# Six hours: agent runs of several hours are allowed; a dead worker is found by its
# heartbeat, not by this limit, so a long limit costs nothing when a worker dies.
DEFAULT_TASK_TIME_LIMIT_S = 6 * 3600
# Redis redelivers an unacked message after this; it must exceed the longest task or a
# slow task would be delivered twice (kombu's visibility_timeout semantics). It applies to
# messages other than runs (a worker holds a run message in memory: workers/run_acks.py);
# a dead worker's runs are published again by the reconciler within seconds.
DEFAULT_VISIBILITY_TIMEOUT_S = 7 * 3600
# A run's lease lapses this long after its worker's last heartbeat (renewed every third
# of it): a killed worker's subagents resume elsewhere within about this plus a tick.
DEFAULT_HEARTBEAT_LAPSE_S = 15
# How often the reconciler's leader looks for stuck trees and due timers.
DEFAULT_RECONCILE_INTERVAL_S = 2.0
# How many passes over the trees' keys the reconciler's leader starts within a retention (coordinator/keeper.py); its
# interval is held to half a pass at most, so that a pass ends in time.
KEEPER_PASSES_PER_RETENTION = 4
# How long a published run may take to show up (a lease, or its message in the queue)
# before the reconciler counts it lost; only stragglers wait this long.
DEFAULT_RECONCILE_GRACE_S = 30
# On SIGTERM a worker hands its runs back within this (Kubernetes' default grace is 30 s).
DEFAULT_SHUTDOWN_GRACE_S = 25
# How often a worker looks for messages other than runs lost with another worker (older
# than the visibility timeout) and queues them again; kombu's own default is ~100 s. (A
# lost run is the reconciler's to publish again: workers/run_acks.py.)
DEFAULT_RESTORE_INTERVAL_S = 10
# An unanswered tool approval counts as a denial after an hour.
DEFAULT_APPROVAL_TIMEOUT_S = 3600
# Transient model errors (rate limits, timeouts, 5xx) are waited out with exponential backoff from
# the base delay (the OpenAI and Anthropic SDKs start at half a second too), capped so that,
# with one probe for the whole fleet (coordinator/endpoints.py), runs are back within about
# this long of their provider's return, at the cost of one request to it per cap.
DEFAULT_MODEL_BACKOFF_BASE_S = 0.5
DEFAULT_MODEL_BACKOFF_MAX_S = 10.0
# A profile's provider is waited out this long (from a request's first transient error) before
# the run fails: ten minutes ride out a restarting model server or a provider's incident.
DEFAULT_MODEL_WAIT_OUT_S = 600.0
# Settings renamed (new name: old name), each still read under its old one, deprecated (docs/configuration.md):
# "retry" means running failed work again (`subq retry`), so waiting out a provider took words of its own
# (docs/architecture.md, "Retry, wait out, backoff").
RENAMED_SETTINGS = {
    "SUBQ_MODEL_BACKOFF_BASE_S": "SUBQ_MODEL_RETRY_BASE_S",
    "SUBQ_MODEL_BACKOFF_MAX_S": "SUBQ_MODEL_RETRY_MAX_S",
}
RENAMED_PROFILE_KEYS = {"model_wait_out_s": "model_retry_for_s"}


def _renamed(new: str, table: dict[str, str]) -> AliasChoices:
    """The names a renamed setting is read under: its new one, then its deprecated one (an alias takes no prefix)."""
    return AliasChoices(new, table[new])


# A request body over this is refused with 413 before it is parsed (1 MiB holds
# a fan-out of 256 long messages).
DEFAULT_API_MAX_BODY_BYTES = 1024 * 1024
# Requests a minute one client address may make to the routes that need no token
# (/healthz, /livez, /readyz, /metrics, /openapi.json, /docs, the sign-in page): a
# probe every few seconds and a scrape every 15 s use a few; a flood gets 429.
DEFAULT_API_OPEN_REQUESTS_PER_MIN = 600
# Sign-ins and wrong bearer tokens a minute from one client address: a person mistyping
# needs a few; guessing a token needs millions.
DEFAULT_API_AUTH_ATTEMPTS_PER_MIN = 10
# Defaults (docs/configuration.md says why each one).
# A worker's log lines: text for a terminal; json (one object a line) for a log pipeline.
LogFormat = Literal["text", "json"]
DEFAULT_LOG_FORMAT: LogFormat = "text"
# A worker serves its Prometheus metrics only when given a port: several worker processes on
# one host (`subq up`, `subq demo`, the tests) would otherwise fight over one default port.
# All interfaces when it is set: Prometheus scrapes the pod's IP (the figures hold no task data).
DEFAULT_WORKER_METRICS_HOST = "0.0.0.0"
# Traces (docs/tracing.md): off by default, so a run pays nothing for them; `otlp`, `console`,
# or `package.module:factory` (a callable returning an OpenTelemetry SpanExporter) turn them on.
DEFAULT_TRACES_EXPORTER = "none"
TRACES_EXPORTER_PATTERN = r"^(none|otlp|console|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$"
# Under Sentinel a step a caller sees waits for one replica: a failover promotes a replica, so
# one that has the step is what keeps it; more than one would stop every step while one is down.
DEFAULT_MIN_REPLICAS_SENTINEL = 1
# How long such a step waits for its replicas: a replica on the same network acknowledges within a
# millisecond or two; a second means one is gone, and the step goes on (docs/deploy.md says what that risks).
DEFAULT_REPLICA_WAIT_MS = 1000
# The TLS settings, used only under Sentinel.
TLS_FIELDS = ("redis_tls", "redis_sentinel_tls", "redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file")
# SUBQ_REDIS_SENTINELS as the error messages show it (26379 is Sentinel's own port).
SENTINEL_EXAMPLE = "sentinel-0:26379,sentinel-1:26379,sentinel-2:26379"
DEFAULT_MAX_FANOUT = 256
DEFAULT_MAX_DEPTH = 3
# A task lost with its worker is run again (published by the reconciler) at most this many
# times in all.
DEFAULT_MAX_DELIVERIES = 3
# The offline model is priced as a named real model so demo figures are realistic.
DEFAULT_PRICED_AS = "anthropic:claude-sonnet-4-5"
OFFLINE_PROFILE = "offline"
# Bounds one agent run so a looping model cannot spend without end.
DEFAULT_MAX_REQUESTS = 25
# How often in a row one tool's calls may fail to run (an unknown tool, arguments that do not validate, a
# `ModelRetry`), each answered with its error for the model to mend, before the task fails `ToolRetries`.
# pydantic-ai's own default is 1: a real model's second typo of a tool name failed a child's whole run.
DEFAULT_MAX_TOOL_RETRIES = 3
# A tool call runs at most this long by default (a profile's `tool_timeout_s` changes it).
DEFAULT_TOOL_TIMEOUT_S = 300.0
# One response of a model may call many tools; a run makes at most this many calls at once.
DEFAULT_MAX_TOOL_CALLS_AT_ONCE = 8
# A run compacts its conversation before a request that would pass this share of the model's context
# window (docs/context.md): the rest is room for the answer and for the estimate being short.
DEFAULT_COMPACT_AT_SHARE = 0.8
# The most of one tool result the model reads (its beginning and its end): about 5,000 tokens, so a
# `git log` or a whole file cannot fill a 128k window in a few calls, and most results pass whole.
DEFAULT_MAX_TOOL_OUTPUT_CHARS = 20_000
# Below this a window holds no more than the system prompt and the tools' schemas.
MIN_CONTEXT_WINDOW = 1_000
# A cut result keeps at least this much of its beginning and end together: less says nothing.
MIN_TOOL_OUTPUT_CHARS = 200


class Price(BaseModel):
    """An explicit per-profile price in USD per million tokens (overrides the price library)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Decimal, not float: money is exact from the setting to the micro-USD.
    input_per_mtok: Decimal = Field(ge=0)
    output_per_mtok: Decimal = Field(ge=0)
    cache_read_per_mtok: Decimal | None = Field(default=None, ge=0)
    cache_write_per_mtok: Decimal | None = Field(default=None, ge=0)


# A tool's import path: `package.module:attribute`.
TOOL_PATH_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"


# A command's limits in its sandbox (docs/tools.md), each a default a profile can raise:
# processes at once (a parallel build starts a few dozen; a fork bomb is stopped at this),
MAX_COMMAND_PROCESSES = 256
# its data segment in MiB (RLIMIT_DATA: the memory it writes; unlike RLIMIT_AS it does not
# count what Node, Go or a JVM merely reserve, which is tens of GiB and would stop them at start),
COMMAND_MEMORY_MB = 4096
# its CPU seconds (a busy loop is stopped even when its wall-clock timeout_s is long),
COMMAND_CPU_TIME_S = 600
# and the size in MiB of a file it writes (RLIMIT_FSIZE: a runaway writer's one file does not fill the worker's
# disk; a model's weights or a large repository's pack still fit). A bound on each file, not on their sum.
COMMAND_MAX_FILE_MB = 16384


# A host a sandboxed command may reach (`network = ["docs.example.org", "*.example.com"]`): a DNS
# name (or an IPv4 address), or `*.` and a name for every name under it (workers/runtime/egress.py).
NETWORK_HOST_PATTERN = (
    r"^(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$"
)
# An allow list longer than this is a sign of wanting `network = true` (each name is checked per connection).
MAX_NETWORK_HOSTS = 256


def _check_network(value: object) -> bool | list[str]:
    """`network` as false, true or a list of host names; one line naming the bad entry otherwise."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(
            "give false (no network), true (public hosts) or a list of host names, e.g. ['packages.example.net']"
        )
    if len(value) > MAX_NETWORK_HOSTS:
        raise ValueError(f"at most {MAX_NETWORK_HOSTS} hosts (true allows every public host)")
    for host in value:
        if not isinstance(host, str) or len(host) > 253 or not re.fullmatch(NETWORK_HOST_PATTERN, host):
            raise ValueError(f"{host!r} is not a host name (a DNS name, or *. and a name for every name under it)")
    return [host.lower() for host in value]


# What a sandbox may reach: false (nothing), true (public hosts: never the host's own loopback or its
# private, link-local and metadata ranges), or the hosts it may reach through subq's filtering proxy.
Network = Annotated[bool | list[str], BeforeValidator(_check_network)]


def network_label(network: bool | list[str]) -> str:
    """A sandbox's network in words: none, public, or the hosts (as `subq tools` shows it)."""
    if network is True:
        return "public"
    return "hosts " + ", ".join(network) if network else "none"


class RunCommand(BaseModel):
    """How `run_command` runs a command for a profile that enables it (docs/tools.md).

    The command line is split into argv as a POSIX shell would (`shlex`) and run without a
    shell, in `cwd`, with no SUBQ_* value and no provider key in its environment; it is
    stopped after `timeout_s`, and the model reads at most `max_output_chars` of its output.
    It runs in an OS sandbox (`sandbox`, workers/runtime/sandbox.py): the filesystem read-only
    but for `cwd` and a private /tmp, subq's own files hidden, no network unless `network`,
    and at most `max_processes`, `memory_mb`, `max_file_mb` and `cpu_time_s`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    cwd: Path
    timeout_s: float = Field(default=60.0, gt=0)
    max_output_chars: int = Field(default=20_000, ge=1)
    sandbox: bool = True
    network: Network = False
    max_processes: int = Field(default=MAX_COMMAND_PROCESSES, ge=1)
    memory_mb: int = Field(default=COMMAND_MEMORY_MB, ge=16)
    cpu_time_s: int = Field(default=COMMAND_CPU_TIME_S, ge=1)
    max_file_mb: int = Field(default=COMMAND_MAX_FILE_MB, ge=1)


# An MCP server's name: its tools' source (`mcp:<name>`) in `subq tools` and in errors.
MCP_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
# A tool-name prefix (`<prefix>_<tool>`): what providers accept in a tool name.
MCP_PREFIX_PATTERN = r"^[A-Za-z0-9_-]+$"
# How long a server may take to start and answer `initialize`, and to list its tools: a
# program that needs longer is usually waiting on something that will not come.
DEFAULT_MCP_TIMEOUT_S = 10.0
# `${VAR}`: the value is read from the worker's environment when it starts (docs/tools.md).
MCP_SECRET_PATTERN = r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$"


class McpServer(BaseModel):
    """An MCP server whose tools a profile offers (docs/tools.md): a program over stdio, or a Streamable HTTP URL.

    Exactly one of `command` (stdio: `args`, `env`, `cwd`) and `url` (`headers`). A value of
    `env` or `headers` written `${VAR}` is read from the worker's environment at its start.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=MCP_NAME_PATTERN)
    command: str | None = Field(default=None, min_length=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: Path | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    prefix: str | None = Field(default=None, pattern=MCP_PREFIX_PATTERN)
    timeout_s: float = Field(default=DEFAULT_MCP_TIMEOUT_S, gt=0)
    # A stdio server run in run_command's OS sandbox (workers/runtime/sandbox.py): it writes only
    # in the `writable` folders (absolute) and a private /tmp, and reaches the network only with `network`.
    sandbox: bool = False
    writable: list[Path] = Field(default_factory=list)
    network: Network = False

    @staticmethod
    def secret_name(value: str) -> str | None:
        """The variable of the worker's environment a value written `${VAR}` reads; None for a value as it is."""
        named = re.match(MCP_SECRET_PATTERN, value)
        return named[1] if named else None

    def secret_names(self) -> list[str]:
        """The worker's environment variables its `env` and `headers` read."""
        values = (*self.env.values(), *self.headers.values())
        return [name for value in values if (name := self.secret_name(value)) is not None]

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        # extra="forbid" names the key but not the server: this line names both.
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in data if key not in cls.model_fields)
            if unknown:
                name = data.get("name", "?")
                raise ValueError(
                    f"mcp server {name!r}: unknown key {unknown[0]!r} (known: {', '.join(cls.model_fields)})"
                )
        return data

    @model_validator(mode="after")
    def _one_transport(self) -> Self:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"mcp server {self.name!r}: give exactly one of command (stdio) and url (HTTP)")
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"mcp server {self.name!r}: url {self.url!r} is not an http:// or https:// URL")
            if self.args or self.env or self.cwd is not None:
                raise ValueError(f"mcp server {self.name!r}: args, env and cwd are for a stdio server (command)")
            if self.sandbox or self.writable or self.network:
                raise ValueError(f"mcp server {self.name!r}: sandbox, writable and network are for a stdio server")
        elif self.headers:
            raise ValueError(f"mcp server {self.name!r}: headers are for an HTTP server (url)")
        if (self.writable or self.network) and not self.sandbox:
            raise ValueError(f"mcp server {self.name!r}: writable and network confine a sandbox: set sandbox = true")
        if any(not path.is_absolute() for path in self.writable):
            raise ValueError(f"mcp server {self.name!r}: every writable folder must be an absolute path")
        return self


class ToolLimit(BaseModel):
    """A fleet-wide limit on the calls of the tools one glob matches: at once, and a minute."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    concurrency: int | None = Field(default=None, ge=1)
    rpm: int | None = Field(default=None, ge=1)


# A model that breaks the schema three times running is not converging: fail with its errors
# rather than spend more requests (each invalid answer is one request more).
DEFAULT_MAX_INVALID_OUTPUTS = 3


def _profile_output_schema(value: object) -> object:
    """A profile's `output_schema`: a JSON Schema table, or `package.module:Model` read as that pydantic
    model's JSON Schema; either checked as every output schema is (coordinator/output_schema.py)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = _model_schema(value)
    problem = schema_problem(value)
    if problem is not None:
        where, reason = problem
        raise ValueError(".".join(["output_schema", *map(str, where)]) + f": {reason}")
    return value


def _model_schema(path: str) -> dict[str, Any]:
    """The JSON Schema of the pydantic model `package.module:Model`, or a ValueError saying why not."""
    if not re.fullmatch(TOOL_PATH_PATTERN, path):
        raise ValueError(f"output_schema must be a JSON Schema table or 'package.module:Model', not {path!r}")
    module_name, _, attr = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as exc:  # an import runs the module: any error is the profile's to report
        raise ValueError(f"output_schema {path!r} does not import: {type(exc).__name__}: {exc}") from None
    if not (isinstance(target, type) and issubclass(target, BaseModel)):
        raise ValueError(f"output_schema {path!r} is not a pydantic model class")
    return target.model_json_schema()


class Profile(BaseModel):
    """A model configuration a task runs with, and the tools it offers the model (docs/tools.md).

    `model` is `offline`, `openai:<model>` (any OpenAI-compatible endpoint with
    `base_url`) or `anthropic:<model>`. `priced_as` names the `provider:model`
    whose price applies when the provider reports no cost (for `offline` it is
    the real model the offline model is priced as).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = OFFLINE_PROFILE
    base_url: str | None = None
    api_key: SecretStr | None = None
    priced_as: str | None = None
    price: Price | None = None
    system_prompt: str = "You are a focused subagent. Do the task you are given and report the result briefly."
    # The JSON Schema its tasks' result data is held to when a task has none of its own: a table, or
    # `package.module:Model` naming a pydantic model, read as its JSON Schema when the settings load.
    output_schema: Annotated[dict[str, Any] | None, BeforeValidator(_profile_output_schema)] = None
    # How many answers of a typed task's model may break its schema: each is sent back with its errors,
    # and the last fails the task (`OutputInvalid`).
    max_invalid_outputs: int = Field(default=DEFAULT_MAX_INVALID_OUTPUTS, ge=1, le=100)
    max_requests: int = Field(default=DEFAULT_MAX_REQUESTS, ge=1)
    max_tool_retries: int = Field(default=DEFAULT_MAX_TOOL_RETRIES, ge=0, le=100)
    # Tools whose calls need a decision, and the policy that decides where it can:
    # a rule is "tool" or "tool:argument prefix" (run_command:npm test allows
    # `npm test -- --watch`); deny wins; a chained command needs every part allowed.
    approval_tools: list[str] = Field(default_factory=lambda: ["run_command"])
    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    # The tools offered beside the orchestration tools: functions or pydantic-ai toolsets by
    # import path, imported when a worker starts; then which of all offered tools the model
    # gets (`*` globs; `allowed_tools` unset: all of them; `disallowed_tools` wins).
    tools: list[Annotated[str, StringConstraints(pattern=TOOL_PATH_PATTERN)]] = Field(default_factory=list)
    allowed_tools: list[str] | None = None
    disallowed_tools: list[str] = Field(default_factory=list)
    # Set: `run_command` executes commands, as this says; unset: the profile has no `run_command`.
    run_command: RunCommand | None = None
    # How long a call of one of the profile's tools may run before the model is told it timed out:
    # the default, and by name or `*` glob (the first glob that matches wins).
    tool_timeout_s: float = Field(default=DEFAULT_TOOL_TIMEOUT_S, gt=0)
    tool_timeouts: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    # Fleet-wide limits on the calls of the tools a glob matches (the first glob that matches a
    # tool is its limit), and how many tool calls one run makes at once.
    tool_limits: dict[str, ToolLimit] = Field(default_factory=dict)
    max_tool_calls_at_once: int = Field(default=DEFAULT_MAX_TOOL_CALLS_AT_ONCE, ge=1)
    # What a call of the tools a glob matches costs, in USD (the first glob that matches wins):
    # the task's own spend, beside its tokens' cost, on its parent's plan item.
    tool_prices: dict[str, Annotated[Decimal, Field(ge=0)]] = Field(default_factory=dict)
    # Tools (names or `*` globs) safe to call twice: a call cut off by its worker's death runs again
    # on resume, and a response calling only such tools is not written before its calls run.
    idempotent_tools: list[str] = Field(default_factory=list)
    # MCP servers whose tools the profile offers beside its own (each once per worker process).
    mcp_servers: list[McpServer] = Field(default_factory=list)
    # How long transient provider errors are waited out before the run fails (docs/providers.md),
    # and the profiles whose models a request goes to, in order, when this one's provider keeps
    # failing or refuses the model (each checked against the profiles when settings load).
    model_wait_out_s: float = Field(
        default=DEFAULT_MODEL_WAIT_OUT_S, ge=0, validation_alias=_renamed("model_wait_out_s", RENAMED_PROFILE_KEYS)
    )
    fallback_profiles: list[str] = Field(default_factory=list)
    # A context that never overflows (docs/context.md): the model's window in tokens (unset: what
    # genai-prices or pydantic-ai know of the model; none known, a run compacts only when the provider
    # refuses a request as too long), the share of it past which a run compacts before a request, the
    # most of one tool result the model reads, and the profile whose model writes the summary of older
    # turns (unset: this one's; checked against the profiles when settings load).
    context_window: int | None = Field(default=None, ge=MIN_CONTEXT_WINDOW)
    compact_at_share: float = Field(default=DEFAULT_COMPACT_AT_SHARE, gt=0, le=0.95)
    max_tool_output_chars: int = Field(default=DEFAULT_MAX_TOOL_OUTPUT_CHARS, ge=MIN_TOOL_OUTPUT_CHARS)
    compaction_profile: str | None = Field(default=None, min_length=1)

    @field_validator("mcp_servers")
    @classmethod
    def _unique_servers(cls, servers: list[McpServer]) -> list[McpServer]:
        seen: set[str] = set()
        for server in servers:
            if server.name in seen:
                raise ValueError(f"mcp server {server.name!r}: two servers of one profile have this name")
            seen.add(server.name)
        return servers

    @model_validator(mode="after")
    def _known_provider(self) -> Self:
        if self.priced_as is not None:
            provider, _, model = self.priced_as.partition(":")
            if not provider or not model:
                raise ValueError(f"priced_as must be '<provider>:<model>', not {self.priced_as!r}")
        if self.model != OFFLINE_PROFILE:
            provider, _, name = self.model.partition(":")
            if provider not in ("openai", "anthropic") or not name:
                raise ValueError(
                    f"model must be 'offline', 'openai:<model>' or 'anthropic:<model>', not {self.model!r}"
                )
        return self

    @property
    def provider(self) -> str:
        """The provider name for rate limits: 'openai', 'anthropic' or 'offline'."""
        return self.model.partition(":")[0]

    @property
    def price_ref(self) -> tuple[str, str]:
        """(provider_id, model_ref) for the price library."""
        ref = self.priced_as or (DEFAULT_PRICED_AS if self.model == OFFLINE_PROFILE else self.model)
        provider, _, model = ref.partition(":")
        return provider, model


# The providers' own variables for their keys, read when a profile names no api_key:
# where users already keep them, for every tool that calls these APIs.
STANDARD_KEYS = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}

# -- outbound events (docs/webhooks.md, coordinator/outbound.py) ---------------------------------------
# A receiver down for a night's maintenance still gets the event in the morning; past a day nobody waits.
DEFAULT_WEBHOOK_RETRY_FOR_S = 24 * 3600.0
# One attempt: a receiver should answer at once and work later; a slow one holds a delivery slot this long.
DEFAULT_WEBHOOK_TIMEOUT_S = 10.0
# Backoff between attempts: doubling from the base, capped, each one jittered (a random 50 to 100 %).
DEFAULT_WEBHOOK_RETRY_BASE_S = 2.0
DEFAULT_WEBHOOK_RETRY_MAX_S = 600.0
# A delivery's claim outlives an attempt's timeout by this much, so a live attempt is never taken twice
# (coordinator/outbound.py).
WEBHOOK_CLAIM_MARGIN_S = 30.0
# Deliveries one worker process makes at once (sockets of its deliverer's one thread, not run slots): a
# slow or dead receiver holds at most these, never a subagent's slot; 32 keep up with a 1,000-wide tree's
# ends at a receiver that takes 200 ms an answer, in large batches (docs/benchmarks.md).
DEFAULT_WEBHOOK_CONCURRENCY = 32
# The most deliveries one tree's outbox holds (a 1,000-wide fan-out with `child.*` is 1,001), and the
# most pending ones of all trees together (a day of a dead receiver's events); past them an event is
# counted as dropped, not written, so a dead receiver cannot grow Redis without bound.
DEFAULT_WEBHOOK_TREE_CAP = 5_000
DEFAULT_WEBHOOK_OUTBOX_CAP = 100_000
# The share of a budget whose crossing sends `budget.warning` (issue 40's default): a fifth of it left is
# time for a person or a service to act before the budget stop.
DEFAULT_BUDGET_WARN_AT = 0.8


class NotifySink(BaseModel):
    """An operator's sink (SUBQ_NOTIFY): the approvals and budget warnings of every tree go there, as the signed
    payload (`json`) or a Slack incoming-webhook body (`slack`: one line with a link to the web view)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: Annotated[str, AfterValidator(check_webhook_url)]
    format: Literal["json", "slack"] = "json"
    secret: Annotated[SecretStr, AfterValidator(check_webhook_secret)] | None = None
    events: Annotated[list[str], AfterValidator(check_webhook_events)] = Field(
        default_factory=lambda: ["approval.*", "budget.*"], min_length=1
    )

    @field_serializer("secret")
    def _passed_on(self, secret: SecretStr | None) -> str | None:
        # As a Webhook's: the settings reach a worker or `subq up`'s processes as JSON, and a masked secret
        # would sign nothing there. A repr or a log line keeps it masked.
        return None if secret is None else secret.get_secret_value()


def _json_table(value: object) -> object:
    """A JSON table setting's text (SUBQ_API_KEYS, SUBQ_TENANTS, SUBQ_PROFILES, SUBQ_PROVIDER_RPM) as the table
    it holds ('' or blanks: none), any other value as given.

    Parsed here, not by pydantic-settings' JSON decoding (NoDecode), whose error on bad JSON is a SettingsError
    traceback naming no variable: here bad JSON is one line naming the setting, like any other bad value."""
    if not isinstance(value, str):
        return value
    if not value.strip():
        return {}
    try:
        return json_value(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None


def _notify(value: object) -> object:
    if isinstance(value, str):
        value = json_value(value) if value.strip() else []
    return value


def _webhook_allow(value: object) -> object:
    """`SUBQ_WEBHOOK_ALLOW`: host names and addresses or networks (`127.0.0.1`, `10.0.0.0/8`, `hooks.corp`),
    comma-separated or a JSON list, that a webhook may reach although private."""
    if isinstance(value, str):
        value = json_value(value) if value.lstrip().startswith("[") else [w.strip() for w in value.split(",")]
    if not isinstance(value, list):
        return value
    entries = [str(entry).strip() for entry in value if str(entry).strip()]
    for entry in entries:
        try:
            ipaddress.ip_network(entry.strip("[]"), strict=False)
        except ValueError:
            if not HOST_NAME_RE.match(entry):
                raise ValueError(f"{entry[:80]!r} is neither a host name nor an address or network") from None
    return entries


class Settings(BaseSettings):
    # populate_by_name: the provider keys are read from their own variables (aliases),
    # and tests and callers still pass them by field name.
    model_config = SettingsConfigDict(env_prefix="SUBQ_", extra="ignore", frozen=True, populate_by_name=True)

    redis_url: str | None = Field(default=None, description="Redis URL; unset means an embedded local Redis (demo, up)")
    # Redis Sentinel instead of one Redis (docs/deploy.md, "Redis failover"): the sentinels as
    # "host:port,host:port,...", the name of the master they watch, the sentinels' own password, and
    # the data password of the master and replicas (which SUBQ_REDIS_URL carries in its URL).
    redis_sentinels: str | None = None
    redis_sentinel_master: str | None = None
    redis_sentinel_password: SecretStr | None = None
    redis_password: SecretStr | None = None
    # TLS under Sentinel, which has no URL to carry it (one Redis takes rediss:// and its ssl_*
    # query in SUBQ_REDIS_URL): to the master and replicas, to the sentinels (unset: as the nodes),
    # the CA that signed their certificates (unset: the system's), and a client certificate and
    # key for servers that ask for one (Redis's tls-auth-clients). Certificates are always
    # verified, host names included.
    redis_tls: bool = False
    redis_sentinel_tls: bool | None = None
    redis_tls_ca_file: pydantic.FilePath | None = None
    redis_tls_cert_file: pydantic.FilePath | None = None
    redis_tls_key_file: pydantic.FilePath | None = None
    # Replicas that must acknowledge a step a caller sees (WAIT) before it counts as done; unset:
    # DEFAULT_MIN_REPLICAS_SENTINEL under Sentinel, 0 (no WAIT at all) with one Redis.
    redis_min_replicas: int | None = Field(default=None, ge=0)
    redis_replica_wait_ms: int = Field(default=DEFAULT_REPLICA_WAIT_MS, ge=1, le=60_000)
    key_prefix: str = Field(default="subq", pattern=r"^[A-Za-z0-9_.-]+$")
    queue: str = Field(default="subq", pattern=r"^[A-Za-z0-9_.-]+$")
    result_retention_s: int = Field(default=DEFAULT_RETENTION_S, ge=60)
    worker_pool: str = Field(default=DEFAULT_POOL, pattern=r"^(threads|prefork|solo|gevent|eventlet)$")
    worker_concurrency: int = Field(default=DEFAULT_CONCURRENCY, ge=1, le=MAX_CONCURRENCY)
    task_time_limit_s: int = Field(default=DEFAULT_TASK_TIME_LIMIT_S, ge=1)
    visibility_timeout_s: int = Field(default=DEFAULT_VISIBILITY_TIMEOUT_S, ge=1)
    restore_interval_s: int = Field(default=DEFAULT_RESTORE_INTERVAL_S, ge=1)
    heartbeat_lapse_s: int = Field(default=DEFAULT_HEARTBEAT_LAPSE_S, ge=3, le=3600)
    reconcile_interval_s: float = Field(default=DEFAULT_RECONCILE_INTERVAL_S, ge=0.1, le=60)
    reconcile_grace_s: int = Field(default=DEFAULT_RECONCILE_GRACE_S, ge=1, le=3600)
    shutdown_grace_s: int = Field(default=DEFAULT_SHUTDOWN_GRACE_S, ge=0, le=3600)
    log_format: LogFormat = DEFAULT_LOG_FORMAT
    # A worker's own /metrics (workers/observe.py); unset: not served.
    worker_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    worker_metrics_host: str = DEFAULT_WORKER_METRICS_HOST
    traces_exporter: str = DEFAULT_TRACES_EXPORTER
    # Test-only: the named crash point (coordinator/faults.py) at which a process kills itself.
    fault_crash_at: str = ""
    max_fanout: int = Field(default=DEFAULT_MAX_FANOUT, ge=1, le=MAX_SUBTASKS)
    max_depth: int = Field(default=DEFAULT_MAX_DEPTH, ge=0, le=32)
    max_deliveries: int = Field(default=DEFAULT_MAX_DELIVERIES, ge=1, le=100)
    # Admission control; 0 means no limit.
    max_running_per_parent: int = Field(default=0, ge=0)
    max_running_per_root: int = Field(default=0, ge=0)
    start_stagger_ms: int = Field(default=0, ge=0)
    # Requests per minute per model provider ("anthropic", "openai", "offline"), fleet-wide; 0: no limit
    # (admission.wait_for_rate). A negative one would break the rate script's arithmetic on every request.
    provider_rpm: Annotated[dict[str, Annotated[int, Field(ge=0)]], NoDecode, BeforeValidator(_json_table)] = Field(
        default_factory=dict
    )
    # The backoff between two tries of a provider's endpoint (renamed: also read under its old variable).
    model_backoff_base_s: float = Field(
        default=DEFAULT_MODEL_BACKOFF_BASE_S, ge=0, validation_alias=_renamed("SUBQ_MODEL_BACKOFF_BASE_S", RENAMED_SETTINGS),
    )  # fmt: skip
    model_backoff_max_s: float = Field(
        default=DEFAULT_MODEL_BACKOFF_MAX_S, gt=0, validation_alias=_renamed("SUBQ_MODEL_BACKOFF_MAX_S", RENAMED_SETTINGS),
    )  # fmt: skip
    approval_timeout_s: int = Field(default=DEFAULT_APPROVAL_TIMEOUT_S, ge=1)
    api_token: SecretStr | None = None
    # Scoped API keys (coordinator/access.py, docs/security.md): {"<name>": {"token_sha256": "<hex>",
    # "scopes": [...]}} as JSON, and/or a TOML or JSON file of the same table, read again whenever it
    # changes (a key is revoked by editing the file, without a restart). Only hashes: no token is kept.
    api_keys: Annotated[dict[str, ApiKeySpec], NoDecode] = Field(default_factory=dict)
    api_keys_file: Path | None = None
    # Where the operator commands reach subq when they should not need Redis (docs/cli.md).
    api_url: str | None = None
    api_auth_disabled: bool = False
    api_max_body_bytes: int = Field(default=DEFAULT_API_MAX_BODY_BYTES, ge=1024)
    # The deployment is served over https (TLS at the ingress): the web session cookie is Secure.
    api_https: bool = False
    # Proxies (addresses or networks, comma-separated) whose X-Forwarded-For and
    # X-Forwarded-Proto are believed; from anyone else those headers are ignored.
    api_trusted_proxies: str = ""
    api_open_requests_per_min: int = Field(default=DEFAULT_API_OPEN_REQUESTS_PER_MIN, ge=1)
    api_auth_attempts_per_min: int = Field(default=DEFAULT_API_AUTH_ATTEMPTS_PER_MIN, ge=1)
    default_profile: str = OFFLINE_PROFILE
    profiles: Annotated[dict[str, Profile], NoDecode, BeforeValidator(_json_table)] = Field(default_factory=dict)
    profiles_file: Path | None = None
    # The profiles read from profiles_file (and not replaced by SUBQ_PROFILES): where each came from.
    _from_file: frozenset[str] = PrivateAttr(default=frozenset())
    # SUBQ_TENANTS_FILE as it was read at start (its path, its table): the table a process keeps until an edit
    # parses, should the file be broken by its first look after the start (`tenants_at_start`).
    _tenants_read: tuple[Path, Tenants] | None = PrivateAttr(default=None)
    # Paths no sandboxed command may read, beside those subq knows of itself (the profiles file,
    # the API keys file, the Redis TLS key): absolute, separated by ':' as in PATH. `subq up`
    # adds its log folder, where it writes its credentials file (workers/runtime/sandbox.py).
    sandbox_hidden_paths: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # Names the sandbox's filtering proxy resolves to a fixed address before DNS, as curl's --resolve
    # does (a JSON object {"name": "address"}): a split-horizon name, or a test's host. Each address is
    # still checked against the ranges no sandbox reaches (docs/security.md).
    sandbox_resolve: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    openai_api_key: SecretStr | None = Field(default=None, validation_alias="OPENAI_API_KEY")
    anthropic_api_key: SecretStr | None = Field(default=None, validation_alias="ANTHROPIC_API_KEY")
    # Outbound events (docs/webhooks.md): what a webhook may reach besides public addresses, how long and
    # how often a delivery is tried, and the caps that bound a dead receiver's cost (constants above).
    webhook_allow: Annotated[list[str], NoDecode, BeforeValidator(_webhook_allow)] = Field(default_factory=list)
    webhook_retry_for_s: float = Field(default=DEFAULT_WEBHOOK_RETRY_FOR_S, gt=0)
    webhook_timeout_s: float = Field(default=DEFAULT_WEBHOOK_TIMEOUT_S, gt=0, le=300)
    webhook_retry_base_s: float = Field(default=DEFAULT_WEBHOOK_RETRY_BASE_S, gt=0)
    webhook_retry_max_s: float = Field(default=DEFAULT_WEBHOOK_RETRY_MAX_S, gt=0)
    webhook_concurrency: int = Field(default=DEFAULT_WEBHOOK_CONCURRENCY, ge=1, le=256)
    webhook_tree_cap: int = Field(default=DEFAULT_WEBHOOK_TREE_CAP, ge=1)
    webhook_outbox_cap: int = Field(default=DEFAULT_WEBHOOK_OUTBOX_CAP, ge=1)
    notify: Annotated[list[NotifySink], NoDecode, BeforeValidator(_notify)] = Field(default_factory=list, max_length=10)
    # The share of a budget whose crossing sends the budgeted task's `budget.warning`, once, from the step
    # that records the spend (the workers' setting: their steps record it).
    budget_warn_at: float = Field(default=DEFAULT_BUDGET_WARN_AT, gt=0, lt=1)
    # Tenants (coordinator/tenants.py, docs/tenants.md): {"<tenant>": {max_running, weight, max_priority,
    # submits_per_minute, max_running_roots, max_cost_usd_per_day}, "*": {...the rest's...}} as JSON, and/or a
    # TOML or JSON file of the same table, read again whenever it changes; and the tenant of a tree that no
    # key or argument names.
    tenants: Annotated[dict[str, TenantPolicy], NoDecode] = Field(default_factory=dict)
    tenants_file: Path | None = None
    default_tenant: str = DEFAULT_TENANT

    @field_validator("sandbox_hidden_paths", mode="before")
    @classmethod
    def _split_hidden_paths(cls, value: object) -> object:
        if isinstance(value, str):  # a JSON list (as subq passes settings on to its workers), or a:b:c
            value = json_value(value) if value.startswith("[") else [part for part in value.split(os.pathsep) if part]
        if isinstance(value, list) and any(not Path(str(path)).is_absolute() for path in value):
            raise ValueError("every path must be absolute")
        return value

    @field_validator("sandbox_resolve", mode="before")
    @classmethod
    def _check_sandbox_resolve(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                value = json_value(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f'not JSON ({exc.msg}); give {{"name": "address"}}') from None
        if not isinstance(value, dict):
            raise ValueError('give a JSON object {"name": "address"}')
        for name, address in value.items():
            if not isinstance(name, str) or not re.fullmatch(NETWORK_HOST_PATTERN, name) or name.startswith("*."):
                raise ValueError(f"{name!r} is not a host name")
            try:
                ipaddress.ip_address(str(address))
            except ValueError:
                raise ValueError(f"{name}: {address!r} is not an IP address") from None
        return {name.lower(): str(address) for name, address in value.items()}

    @field_validator("traces_exporter")
    @classmethod
    def _check_traces_exporter(cls, exporter: str) -> str:
        if not re.match(TRACES_EXPORTER_PATTERN, exporter):
            raise ValueError(f"{exporter!r} is not none, otlp, console or package.module:factory (docs/tracing.md)")
        return exporter

    @field_validator("api_keys", mode="before")
    @classmethod
    def _parse_api_keys(cls, value: object) -> object:
        keys = parse_keys(_json_table(value), "")
        return {name: key.as_setting() for name, key in keys.items()}

    @field_validator("tenants", mode="before")
    @classmethod
    def _parse_tenants(cls, value: object) -> object:
        value = _json_table(value)
        table = parse_tenants(value, "")
        given = dict(table.listed)
        if isinstance(value, dict) and DEFAULT_POLICY_NAME in value:
            given[DEFAULT_POLICY_NAME] = table.default
        return given

    @field_validator("default_tenant")
    @classmethod
    def _check_default_tenant(cls, name: str) -> str:
        try:
            return check_tenant_name(name, "SUBQ_DEFAULT_TENANT")
        except Exception as exc:  # a ValidationError: pydantic wants a ValueError
            raise ValueError(str(exc).removeprefix("SUBQ_DEFAULT_TENANT: ")) from None

    def tenants_at_start(self) -> Tenants | None:
        """SUBQ_TENANTS_FILE's table as the start read it (None: no file, or another than these settings name)."""
        read = self._tenants_read
        return read[1] if read is not None and read[0] == self.tenants_file else None

    def tenants_inline(self) -> Tenants:
        """SUBQ_TENANTS as a table (without the file's)."""
        return parse_tenants(self.tenants, "SUBQ_TENANTS")  # policies as given (model_copy does not validate)

    @field_validator("api_url")
    @classmethod
    def _check_api_url(cls, url: str | None) -> str | None:
        if not url:
            return None
        parts = urlsplit(url)
        if "@" in parts.netloc:  # a user and password: never echoed, and never sent (they replaced the bearer token)
            shown = urlunsplit(parts._replace(netloc="<user>@" + parts.netloc.rpartition("@")[2]))
            raise ValueError(f"{shown!r} carries a user and password: give the API's base URL alone, and its token in "
                             "SUBQ_API_TOKEN")  # fmt: skip
        if url != url.strip():
            raise ValueError(f"{url!r} has spaces around it")
        try:
            parts.port  # noqa: B018 - parsing the port is what checks it
        except ValueError as exc:
            raise ValueError(f"{url!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL with a host (e.g. http://127.0.0.1:8000)")
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: give the API's base URL, without a query or fragment")
        return url.rstrip("/")

    @field_validator("api_trusted_proxies")
    @classmethod
    def _check_trusted_proxies(cls, proxies: str) -> str:
        for part in proxies.split(","):
            if part.strip():
                try:
                    ipaddress.ip_network(part.strip(), strict=False)
                except ValueError:
                    raise ValueError(f"{part.strip()!r} is not an IP address or network (e.g. 10.0.0.0/8)") from None
        return proxies

    def trusted_proxy_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """SUBQ_API_TRUSTED_PROXIES as networks (a lone address is a network of one)."""
        return [ipaddress.ip_network(p.strip(), strict=False) for p in self.api_trusted_proxies.split(",") if p.strip()]

    @field_validator("redis_sentinels")
    @classmethod
    def _check_sentinels(cls, sentinels: str | None) -> str | None:
        if sentinels is not None:
            _sentinel_addresses(sentinels)  # raises, naming the first address that is not host:port
        return sentinels

    @field_validator("redis_sentinel_master")
    @classmethod
    def _check_master_name(cls, name: str | None) -> str | None:
        if name is not None and not re.match(r"^[A-Za-z0-9_.-]+$", name):
            raise ValueError(f"{name!r} is not a master name as the sentinels know it (letters, digits, _ . -)")
        return name

    @field_validator("worker_metrics_port", mode="before")
    @classmethod
    def _unset_port(cls, port: object) -> object:
        return None if isinstance(port, str) and not port.strip() else port  # `VAR=` in an env file: unset

    @field_validator("redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file", mode="wrap")
    @classmethod
    def _check_tls_file(cls, path: object, handler: pydantic.ValidatorFunctionWrapHandler) -> object:
        try:
            return handler(path)
        except OSError as exc:  # FilePath's is_file() lets some out (a name too long) where others say "no file"
            raise ValueError(f"cannot read it: {exc.strerror}") from None

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.worker_metrics_port is not None and self.worker_pool == "prefork":
            # A prefork child counts in its own memory; the port, served by the parent, would show zeros.
            raise ValueError(
                "SUBQ_WORKER_METRICS_PORT: not served with SUBQ_WORKER_POOL=prefork (each child process would "
                "count its runs where the port cannot see them); use the threads pool, or leave the port unset"
            )
        self._check_redis_form()
        if self.reconcile_interval_s > self.result_retention_s / (2 * KEEPER_PASSES_PER_RETENTION):
            raise ValueError(
                f"SUBQ_RECONCILE_INTERVAL_S: {self.reconcile_interval_s} must be at most an eighth of "
                f"SUBQ_RESULT_RETENTION_S ({self.result_retention_s}): the reconciler keeps the keys of the trees in "
                "flight a slice a tick, a pass every quarter retention, and a slower tick lets them lapse"
            )
        longest_wait_s = self.webhook_retry_max_s + self.webhook_timeout_s + WEBHOOK_CLAIM_MARGIN_S
        if longest_wait_s >= self.result_retention_s:
            raise ValueError(
                f"SUBQ_WEBHOOK_RETRY_MAX_S: {self.webhook_retry_max_s} plus SUBQ_WEBHOOK_TIMEOUT_S "
                f"({self.webhook_timeout_s}) and a claim's margin ({WEBHOOK_CLAIM_MARGIN_S:g} s) must be under "
                f"SUBQ_RESULT_RETENTION_S ({self.result_retention_s}): each attempt keeps what a webhook delivery "
                "reads for a retention, and a longer wait for the next one finds it lapsed"
            )
        if self.visibility_timeout_s <= self.task_time_limit_s:
            raise ValueError(
                f"SUBQ_VISIBILITY_TIMEOUT_S: {self.visibility_timeout_s} must be above "
                f"SUBQ_TASK_TIME_LIMIT_S ({self.task_time_limit_s}), or a task still running is delivered twice"
            )
        if self.profiles_file is not None:
            try:
                from_file = _read_profiles_file(self.profiles_file)
            except pydantic.ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"SUBQ_PROFILES_FILE: {self.profiles_file}: {where}: {err['msg']}") from None
            except ValueError as exc:
                raise ValueError(f"SUBQ_PROFILES_FILE: {self.profiles_file}: {exc}") from None
            object.__setattr__(self, "profiles", {**from_file, **self.profiles})
        # The keys file is read at start, so a bad one stops the start (then again on every change).
        keys_from_file = read_keys_file(self.api_keys_file) if self.api_keys_file is not None else {}
        legacy_token = self.api_token.get_secret_value() if self.api_token is not None else None
        check_distinct(self.api_keys, keys_from_file, legacy_token or None)
        if self.tenants_file is not None:  # read at start, so a bad one stops the start (then again on each change)
            self._tenants_read = (self.tenants_file, read_tenants_file(self.tenants_file))
        if self.default_profile not in self.all_profiles():
            raise ValueError(f"SUBQ_DEFAULT_PROFILE: {self.default_profile!r} is not a defined profile")
        # Named by where each profile was read from: the file's, unless SUBQ_PROFILES gave one of that name.
        read_from_file = from_file if self.profiles_file is not None else {}
        self._from_file = frozenset(name for name, p in read_from_file.items() if self.profiles.get(name) is p)
        self._check_fallbacks(set(self._from_file))
        self._check_compaction_profiles(set(self._from_file))
        return self

    def _check_fallbacks(self, from_file: set[str]) -> None:
        """Each `fallback_profiles` entry names another known profile, and no chain comes back to where it began."""
        profiles = self.all_profiles()
        for name, profile in profiles.items():
            variable = f"SUBQ_PROFILES_FILE: {self.profiles_file}" if name in from_file else "SUBQ_PROFILES"
            for fallback in profile.fallback_profiles:
                if fallback not in profiles:
                    raise ValueError(
                        f"{variable}: profile {name!r}: fallback_profiles names {fallback!r}, which is not a profile "
                        f"(known: {', '.join(sorted(profiles))})"
                    )
            cycle = _fallback_cycle(name, profiles)
            if cycle:
                raise ValueError(
                    f"{variable}: profile {name!r}: fallback_profiles go round in a cycle ({' -> '.join(cycle)})"
                )

    def _check_compaction_profiles(self, from_file: set[str]) -> None:
        """Each `compaction_profile` names a known profile (its model writes the summaries)."""
        profiles = self.all_profiles()
        for name, profile in profiles.items():
            wanted = profile.compaction_profile
            if wanted is not None and wanted not in profiles:
                variable = f"SUBQ_PROFILES_FILE: {self.profiles_file}" if name in from_file else "SUBQ_PROFILES"
                raise ValueError(
                    f"{variable}: profile {name!r}: compaction_profile names {wanted!r}, which is not a profile "
                    f"(known: {', '.join(sorted(profiles))})"
                )

    def fallback_chain(self, name: str) -> list[str]:
        """`name`, then its fallbacks in order, each followed by its own (depth first), each profile once."""
        profiles = self.all_profiles()
        chain: list[str] = []

        def visit(current: str) -> None:
            if current in chain or current not in profiles:
                return
            chain.append(current)
            for fallback in profiles[current].fallback_profiles:
                visit(fallback)

        visit(name)
        return chain

    def _check_redis_form(self) -> None:
        """One Redis (SUBQ_REDIS_URL) or Redis Sentinel (SUBQ_REDIS_SENTINELS + master), never both."""
        if self.redis_sentinels is None:
            for name in ("redis_sentinel_master", "redis_sentinel_password", "redis_password", *TLS_FIELDS):
                if getattr(self, name) not in (None, False):
                    where = "with SUBQ_REDIS_SENTINELS"
                    if name == "redis_password":
                        where = "in SUBQ_REDIS_URL"
                    elif name in TLS_FIELDS:
                        where = "in SUBQ_REDIS_URL (rediss://host:6380/0?ssl_ca_certs=...)"
                    raise ValueError(f"SUBQ_{name.upper()}: only used with Redis Sentinel; give it {where}")
            return
        self._check_tls()
        if self.redis_url:
            raise ValueError(
                "SUBQ_REDIS_SENTINELS: set together with SUBQ_REDIS_URL; give one Redis (SUBQ_REDIS_URL) "
                "or the sentinels (SUBQ_REDIS_SENTINELS with SUBQ_REDIS_SENTINEL_MASTER), not both"
            )
        if not self.redis_sentinel_master:
            raise ValueError(
                "SUBQ_REDIS_SENTINEL_MASTER: not set; with SUBQ_REDIS_SENTINELS, name the master the sentinels "
                "watch (their `sentinel monitor <name> ...` line, e.g. subq)"
            )

    def _check_tls(self) -> None:
        """TLS files only with TLS on, a certificate with its key, and each file one `ssl` can load."""
        files = ("redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file")
        if not self.tls_anywhere:
            for name in files:
                if getattr(self, name) is not None:
                    raise ValueError(f"SUBQ_{name.upper()}: set without TLS; set SUBQ_REDIS_TLS=true as well")
            return
        if (self.redis_tls_cert_file is None) != (self.redis_tls_key_file is None):
            given, missing = ("CERT", "KEY") if self.redis_tls_key_file is None else ("KEY", "CERT")
            raise ValueError(
                f"SUBQ_REDIS_TLS_{missing}_FILE: not set; SUBQ_REDIS_TLS_{given}_FILE needs it "
                "(a client certificate and its private key go together)"
            )
        self._load_tls_files()

    def _load_tls_files(self) -> None:
        """Each TLS file loaded as a connection will load it: a file that is no PEM, or one this process may
        not read (it exists, FilePath says, and a secret's mode keeps it from this user), is one line."""
        context = ssl.create_default_context()
        if self.redis_tls_ca_file is not None:
            try:
                context.load_verify_locations(cafile=self.redis_tls_ca_file)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"SUBQ_REDIS_TLS_CA_FILE: {self.redis_tls_ca_file} holds no PEM certificate ({exc.reason})"
                ) from None
            except OSError as exc:
                raise ValueError(
                    f"SUBQ_REDIS_TLS_CA_FILE: {self.redis_tls_ca_file}: cannot read it: {exc.strerror or exc}"
                ) from None
        if self.redis_tls_cert_file is not None:
            try:
                context.load_cert_chain(self.redis_tls_cert_file, self.redis_tls_key_file)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"SUBQ_REDIS_TLS_CERT_FILE: {self.redis_tls_cert_file} with SUBQ_REDIS_TLS_KEY_FILE "
                    f"{self.redis_tls_key_file} is not a PEM certificate and its key ({exc.reason})"
                ) from None
            except OSError as exc:
                raise ValueError(
                    f"SUBQ_REDIS_TLS_CERT_FILE: {self.redis_tls_cert_file} or SUBQ_REDIS_TLS_KEY_FILE "
                    f"{self.redis_tls_key_file}: cannot read it: {exc.strerror or exc}"
                ) from None

    @property
    def tls_anywhere(self) -> bool:
        """Whether any connection under Sentinel uses TLS (to the nodes or to the sentinels)."""
        return self.redis_tls or bool(self.redis_sentinel_tls)

    @property
    def sentinels_over_tls(self) -> bool:
        """Whether the sentinels are spoken to over TLS: SUBQ_REDIS_SENTINEL_TLS, unset as the nodes."""
        return self.redis_tls if self.redis_sentinel_tls is None else self.redis_sentinel_tls

    @property
    def redis_given(self) -> bool:
        """Whether a Redis is configured: one URL, or the sentinels (unset: `subq demo` and `up` start one)."""
        return bool(self.redis_url) or self.redis_sentinels is not None

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """SUBQ_REDIS_SENTINELS as (host, port) pairs; empty with one Redis."""
        return [] if self.redis_sentinels is None else _sentinel_addresses(self.redis_sentinels)

    def min_replicas(self) -> int:
        """Replicas a step a caller sees waits for: SUBQ_REDIS_MIN_REPLICAS, or its default for the form."""
        if self.redis_min_replicas is not None:
            return self.redis_min_replicas
        return DEFAULT_MIN_REPLICAS_SENTINEL if self.redis_sentinels is not None else 0

    def require_redis(self) -> None:
        """Nothing when a Redis is configured (a URL or the sentinels); else a ConfigError saying how to give one."""
        if not self.redis_given:
            raise ConfigError(
                "Invalid setting SUBQ_REDIS_URL: not set (point it at your Redis, e.g. redis://localhost:6379/0, "
                "or give SUBQ_REDIS_SENTINELS and SUBQ_REDIS_SENTINEL_MASTER; `subq demo` starts an embedded one)",
                field="SUBQ_REDIS_URL",
            )

    def require_redis_url(self) -> str:
        """The one Redis's URL, or a ConfigError saying how to give one (under Sentinel there is none)."""
        self.require_redis()
        if not self.redis_url:
            raise ConfigError(
                "Invalid setting SUBQ_REDIS_URL: not set; this needs one Redis's URL, not SUBQ_REDIS_SENTINELS",
                field="SUBQ_REDIS_URL",
            )
        return self.redis_url

    def all_profiles(self) -> dict[str, Profile]:
        """Configured profiles plus the built-in `offline` (which a configured one may replace)."""
        return {OFFLINE_PROFILE: Profile(), **self.profiles}

    def profile_sources(self) -> dict[str, str]:
        """Each known profile and where it was read from: `built in`, `SUBQ_PROFILES_FILE=<path>` or `SUBQ_PROFILES`."""
        return {
            name: "built in" if name not in self.profiles
            else f"SUBQ_PROFILES_FILE={self.profiles_file}" if name in self._from_file
            else "SUBQ_PROFILES"
            for name in self.all_profiles()
        }  # fmt: skip

    def unknown_profile(self, name: str) -> ProfileError:
        """The one line for a profile name no source defines: the known ones, and where each was read from (a
        user who follows an example naming a profile of their own learns which file this process read)."""
        by_source: dict[str, list[str]] = {}
        for known, source in self.profile_sources().items():
            by_source.setdefault(source, []).append(known)
        known = "; ".join(f"{', '.join(sorted(names))} ({source})" for source, names in sorted(by_source.items()))
        unread = "" if self.profiles_file is not None else "; SUBQ_PROFILES_FILE is not set"
        return ProfileError(f"Invalid profile: {cut_value(name)} (known: {known}{unread})", field="profile")

    def profile(self, name: str | None) -> Profile:
        """The named profile (the default one for None), with its provider's standard key if it names none."""
        name = name or self.default_profile
        try:
            profile = self.all_profiles()[name]
        except KeyError:
            raise self.unknown_profile(name) from None
        standard = self.standard_key(profile.model.partition(":")[0])
        if profile.api_key is None and standard is not None:
            return profile.model_copy(update={"api_key": standard})
        return profile

    def standard_key(self, provider: str) -> SecretStr | None:
        """The key in the provider's own variable (OPENAI_API_KEY, ANTHROPIC_API_KEY), if set."""
        key = {"openai": self.openai_api_key, "anthropic": self.anthropic_api_key}.get(provider)
        return key if key is not None and key.get_secret_value() else None


def _sentinel_addresses(sentinels: str) -> list[tuple[str, int]]:
    """ "host:port,host:port" as pairs; a ValueError naming the first part that is not one."""
    parts = [part.strip() for part in sentinels.split(",")]
    if not any(parts):
        raise ValueError(f"names no sentinel; give them as host:port,host:port,... (e.g. {SENTINEL_EXAMPLE})")
    addresses = []
    for part in parts:
        host, colon, port = part.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # [::1]:26379
        if not part or not colon or not host or not ascii_digits(port) or not 0 < int(port) < 65536:
            raise ValueError(f"{part!r} is not host:port (e.g. {SENTINEL_EXAMPLE})")
        addresses.append((host, int(port)))
    return addresses


_PROFILES = pydantic.TypeAdapter(dict[str, Profile])


def _fallback_cycle(start: str, profiles: dict[str, Profile]) -> list[str]:
    """A path of fallbacks from `start` that comes back to it ([start, ..., start]), or [] when none does."""
    path = [start]

    def walk(current: str) -> list[str]:
        for fallback in profiles[current].fallback_profiles:
            if fallback == start:
                return [*path, start]
            if fallback in path or fallback not in profiles:
                continue
            path.append(fallback)
            found = walk(fallback)
            if found:
                return found
            path.pop()
        return []

    return walk(start)


def _read_profiles_file(path: Path) -> dict[str, Profile]:
    data = read_data(path)  # a ValueError for a file unreadable, not UTF-8, malformed or nested too deep
    raw = data.get("profiles", data) if isinstance(data, dict) else data
    if not isinstance(raw, dict):
        raise ValueError("it must hold a table of profiles")
    return _PROFILES.validate_python(raw)


# SUBQ_ variables read by something other than the settings: the CLI's Flower options, the deploy files' passwords
# (a pod's environment holds its Secret's keys), and the README's first command's folder.
OTHER_SUBQ_VARIABLES = frozenset(
    {
        "SUBQ_FLOWER_USER",
        "SUBQ_FLOWER_PASSWORD",
        "SUBQ_COMPOSE_REDIS_PASSWORD",
        "SUBQ_KUBERNETES_REDIS_PASSWORD",
        "SUBQ_VENV",
    }
)
# The variables Kubernetes gives every pod for each Service of its namespace (`enableServiceLinks`, on by default):
# the shipped manifests' Services subq-api, subq-redis, subq-flower make SUBQ_API_SERVICE_HOST, SUBQ_REDIS_PORT,
# SUBQ_REDIS_PORT_6379_TCP_ADDR, ... No subq setting ends so.
_SERVICE_LINK = re.compile(
    r"_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$"
)
_warned: set[str] = set()


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line for each SUBQ_ variable in `environ` that nothing reads (a misspelling: SUBQ_API_KEY_FILE left the
    scoped keys off without a word), with the setting it is nearest, and for each deprecated name still set."""
    known = {f"SUBQ_{name.upper()}" for name in Settings.model_fields} | OTHER_SUBQ_VARIABLES
    lines = []
    for variable in sorted(environ):
        name = variable.upper()  # the settings read names in any case
        if not name.startswith("SUBQ_") or _SERVICE_LINK.search(name):
            continue
        if name in RENAMED_SETTINGS.values():
            new = next(new for new, old in RENAMED_SETTINGS.items() if old == name)
            lines.append(f"{variable} is deprecated: it is read as {new}; rename it")
        elif name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            hint = f" (did you mean {near[0]}?)" if near else ""
            lines.append(f"{variable} is not a subq setting and is ignored{hint}; docs/configuration.md lists them")
    return lines


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> None:
    """Log `unknown_variables` once each per process (a process loads its settings more than once)."""
    for line in unknown_variables(os.environ if environ is None else environ):
        if line not in _warned:
            _warned.add(line)
            log.warning("subq: %s", line)


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment (and overrides), or one clear `ConfigError`; a SUBQ_ variable nothing reads is
    a warning (`unknown_variables`)."""
    try:
        settings = Settings(**overrides)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        msg = err["msg"].removeprefix("Value error, ")
        if loc:  # a field's name, or its alias (a variable's whole name: SUBQ_MODEL_BACKOFF_BASE_S)
            name = f"SUBQ_{loc[0].upper()}" if loc[0] in Settings.model_fields else loc[0].upper()
            if name in RENAMED_SETTINGS:
                msg = f"{msg} (read from {name} or {RENAMED_SETTINGS[name]}, its deprecated name)"
        else:  # a check across fields names its variable first: "SUBQ_X: why"
            name, _, msg = msg.partition(": ")
        where = f" ({'.'.join(loc[1:])})" if len(loc) > 1 else ""
        raise ConfigError(f"Invalid setting {name}{where}: {msg}", field=name) from None
    warn_unknown_variables()
    return settings
