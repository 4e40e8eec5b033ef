"""subq's control plane: settings, models, todo lists, the Redis store and the Coordinator.

    from coordinator import Coordinator, Settings, SubtaskSpec

Services that trigger work need only this package (or only Celery, sending
`subq.*` tasks by name); it never imports `workers`.

Names are imported on first use (PEP 562), so `import coordinator.client` or
`subq --help` does not load Celery, kombu and redis-py until something needs them.
`pip install subagent-queue` installs only what the client needs (httpx, pydantic);
a name whose module needs more (`Coordinator`, `Settings`, ...) raises a
ModuleNotFoundError that says to install the `server` extra.
This surface, `coordinator.runs` (the run-lifecycle seam) and
`coordinator.celery_app` (the app factory and the task names) are all that the
worker package imports.
"""

# ruff: noqa: I001 (isort would split the `X as X` imports below into one statement per name)
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # For type checkers only (`X as X`: re-exported); at run time `__getattr__` imports each on first use.
    from coordinator.access import (
        Scope as Scope,
        token_sha256 as token_sha256,
    )
    from coordinator.audit import (
        Actor as Actor,
        AuditEntry as AuditEntry,
    )
    from coordinator.deadletters import (
        dead_letter as dead_letter,
        message_digest as message_digest,
    )
    from coordinator.errors import (
        BrokerError as BrokerError,
        ConfigError as ConfigError,
        ConflictError as ConflictError,
        CorruptError as CorruptError,
        ForbiddenError as ForbiddenError,
        NotFoundError as NotFoundError,
        ProfileError as ProfileError,
        ScriptError as ScriptError,
        StateError as StateError,
        StoreError as StoreError,
        SubqError as SubqError,
        TodoError as TodoError,
        ValidationError as ValidationError,
        WaitTimeout as WaitTimeout,
    )
    from coordinator.ids import (
        is_batch_id as is_batch_id,
        is_task_id as is_task_id,
        task_of_run_id as task_of_run_id,
    )
    from coordinator.inputs import (
        SubmitInput as SubmitInput,
        error_message as error_message,
        error_path as error_path,
        one_line as one_line,
        visible_text as visible_text,
    )
    from coordinator.text import all_shown as all_shown
    from coordinator.models import (
        Batch as Batch,
        Retried as Retried,
        RetrySkip as RetrySkip,
        SubtaskResult as SubtaskResult,
        SubtaskSpec as SubtaskSpec,
        TaskRecord as TaskRecord,
        TaskStatus as TaskStatus,
        TodoItem as TodoItem,
        TodoStatus as TodoStatus,
        Usage as Usage,
        format_usd as format_usd,
        usd_to_micros as usd_to_micros,
    )
    from coordinator.output_schema import (
        compact as compact,
        completion_parameters as completion_parameters,
        output_errors as output_errors,
    )
    from coordinator.redis_clients import (
        credentials_refused as credentials_refused,
        password_warning as password_warning,
        redis_client as redis_client,
    )
    from coordinator.service import (
        Coordinator as Coordinator,
    )
    from coordinator.settings import (
        OFFLINE_PROFILE as OFFLINE_PROFILE,
        STANDARD_KEYS as STANDARD_KEYS,
        McpServer as McpServer,
        Price as Price,
        Profile as Profile,
        RunCommand as RunCommand,
        Settings as Settings,
        load_settings as load_settings,
        network_label as network_label,
    )
    from coordinator.todos import (
        IgnoredLine as IgnoredLine,
        ignored_lines as ignored_lines,
        parse_markdown as parse_markdown,
        render_markdown as render_markdown,
    )
    from coordinator.tracing import (
        current_trace_id as current_trace_id,
    )

# The public surface, each name with the module that defines it: the one list of it (`__all__` too).
_EXPORTS = {
    "Scope": "coordinator.access",
    "token_sha256": "coordinator.access",
    "Actor": "coordinator.audit",
    "AuditEntry": "coordinator.audit",
    "dead_letter": "coordinator.deadletters",
    "message_digest": "coordinator.deadletters",
    "BrokerError": "coordinator.errors",
    "ConfigError": "coordinator.errors",
    "ConflictError": "coordinator.errors",
    "CorruptError": "coordinator.errors",
    "ForbiddenError": "coordinator.errors",
    "NotFoundError": "coordinator.errors",
    "ProfileError": "coordinator.errors",
    "ScriptError": "coordinator.errors",
    "StateError": "coordinator.errors",
    "StoreError": "coordinator.errors",
    "SubqError": "coordinator.errors",
    "TodoError": "coordinator.errors",
    "ValidationError": "coordinator.errors",
    "WaitTimeout": "coordinator.errors",
    "is_batch_id": "coordinator.ids",
    "is_task_id": "coordinator.ids",
    "task_of_run_id": "coordinator.ids",
    "SubmitInput": "coordinator.inputs",
    "error_message": "coordinator.inputs",
    "error_path": "coordinator.inputs",
    "one_line": "coordinator.inputs",
    "visible_text": "coordinator.inputs",
    "all_shown": "coordinator.text",
    "Batch": "coordinator.models",
    "Retried": "coordinator.models",
    "RetrySkip": "coordinator.models",
    "SubtaskResult": "coordinator.models",
    "SubtaskSpec": "coordinator.models",
    "TaskRecord": "coordinator.models",
    "TaskStatus": "coordinator.models",
    "TodoItem": "coordinator.models",
    "TodoStatus": "coordinator.models",
    "Usage": "coordinator.models",
    "format_usd": "coordinator.models",
    "usd_to_micros": "coordinator.models",
    "compact": "coordinator.output_schema",
    "completion_parameters": "coordinator.output_schema",
    "output_errors": "coordinator.output_schema",
    "credentials_refused": "coordinator.redis_clients",
    "password_warning": "coordinator.redis_clients",
    "redis_client": "coordinator.redis_clients",
    "Coordinator": "coordinator.service",
    "OFFLINE_PROFILE": "coordinator.settings",
    "STANDARD_KEYS": "coordinator.settings",
    "McpServer": "coordinator.settings",
    "Price": "coordinator.settings",
    "Profile": "coordinator.settings",
    "RunCommand": "coordinator.settings",
    "Settings": "coordinator.settings",
    "load_settings": "coordinator.settings",
    "network_label": "coordinator.settings",
    "IgnoredLine": "coordinator.todos",
    "ignored_lines": "coordinator.todos",
    "parse_markdown": "coordinator.todos",
    "render_markdown": "coordinator.todos",
    "current_trace_id": "coordinator.tracing",
}

# The top-level modules of the `server` extra (pyproject.toml) that subq imports and a client-only
# install lacks; a ModuleNotFoundError for one of these is answered with SERVER_INSTALL
# (tests/test_client_install.py holds this set to the extra and to subq's imports).
SERVER_MODULES = frozenset(
    {
        *("anthropic", "anyio", "celery", "fastapi", "fastapi_offline", "fastmcp", "flower", "genai_prices", "kombu"),
        *("httpx2", "mcp", "openai", "prometheus_client", "pydantic_ai", "pydantic_settings", "pythonjsonlogger"),
        *("redis", "rich", "sse_starlette", "standardwebhooks", "starlette", "tornado", "typer", "uvicorn", "vine"),
        *("h11", "hiredis"),
    }
)
SERVER_INSTALL = 'pip install "subagent-queue[server]"'


def missing_server_module(exc: ImportError) -> str | None:
    """The server-side module whose absence `exc` reports, or None when it is anything else.

    Anything else (a module of subq's own, a broken install, the otel extra, which names
    itself) is not answered with the server's install command.
    """
    top = (exc.name or "").partition(".")[0]
    return top if isinstance(exc, ModuleNotFoundError) and top in SERVER_MODULES else None


__all__ = [*_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        missing = missing_server_module(exc)
        if missing is None:
            raise
        # Still a ModuleNotFoundError (an ImportError), so `except ImportError` goes on working.
        message = f"coordinator.{name} needs the server's packages (no module named {missing!r}): {SERVER_INSTALL}"
        raise ModuleNotFoundError(message, name=exc.name) from exc
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
