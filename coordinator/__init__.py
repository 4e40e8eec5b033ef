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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.deadletters import dead_letter
    from coordinator.errors import (
        BrokerError,
        ConfigError,
        ConflictError,
        CorruptError,
        NotFoundError,
        ProfileError,
        ScriptError,
        StateError,
        StoreError,
        SubqError,
        TodoError,
        ValidationError,
        WaitTimeout,
    )
    from coordinator.ids import is_batch_id, is_task_id, task_of_run_id
    from coordinator.inputs import SubmitInput, one_line
    from coordinator.models import (
        Batch,
        SubtaskResult,
        SubtaskSpec,
        TaskRecord,
        TaskStatus,
        TodoItem,
        TodoStatus,
        Usage,
        format_usd,
        usd_to_micros,
    )
    from coordinator.redis_clients import redis_client
    from coordinator.service import Coordinator
    from coordinator.settings import OFFLINE_PROFILE, STANDARD_KEYS, Price, Profile, RunCommand, Settings, load_settings
    from coordinator.todos import IgnoredLine, ignored_lines, parse_markdown, render_markdown
    from coordinator.tracing import current_trace_id

# name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(
        (
            "BrokerError",
            "ConfigError",
            "ConflictError",
            "CorruptError",
            "NotFoundError",
            "ProfileError",
            "RunCommand",
            "ScriptError",
            "StateError",
            "StoreError",
            "SubqError",
            "TodoError",
            "ValidationError",
            "WaitTimeout",
        ),
        "coordinator.errors",
    ),
    **dict.fromkeys(
        (
            "Batch",
            "SubtaskResult",
            "SubtaskSpec",
            "TaskRecord",
            "TaskStatus",
            "TodoItem",
            "TodoStatus",
            "Usage",
            "format_usd",
            "usd_to_micros",
        ),
        "coordinator.models",
    ),
    "Coordinator": "coordinator.service",
    "OFFLINE_PROFILE": "coordinator.settings",
    "STANDARD_KEYS": "coordinator.settings",
    "Price": "coordinator.settings",
    "Profile": "coordinator.settings",
    "RunCommand": "coordinator.settings",
    "Settings": "coordinator.settings",
    "load_settings": "coordinator.settings",
    "is_task_id": "coordinator.ids",
    "is_batch_id": "coordinator.ids",
    "task_of_run_id": "coordinator.ids",
    "dead_letter": "coordinator.deadletters",
    "one_line": "coordinator.inputs",
    "SubmitInput": "coordinator.inputs",
    "render_markdown": "coordinator.todos",
    "parse_markdown": "coordinator.todos",
    "ignored_lines": "coordinator.todos",
    "IgnoredLine": "coordinator.todos",
    "current_trace_id": "coordinator.tracing",
    "redis_client": "coordinator.redis_clients",
}

# The top-level modules of the `server` extra (pyproject.toml) that subq imports and a client-only
# install lacks; a ModuleNotFoundError for one of these is answered with SERVER_INSTALL
# (tests/test_client_install.py holds this set to the extra and to subq's imports).
SERVER_MODULES = frozenset(
    {
        *("anthropic", "anyio", "celery", "fastapi", "fastapi_offline", "fastmcp", "flower", "genai_prices", "kombu"),
        *("openai", "prometheus_client", "pydantic_ai", "pydantic_settings", "pythonjsonlogger", "redis"),
        *("rich", "sse_starlette", "starlette", "tornado", "typer", "uvicorn", "vine"),
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


__all__ = [
    "OFFLINE_PROFILE",
    "STANDARD_KEYS",
    "Batch",
    "BrokerError",
    "ConfigError",
    "ConflictError",
    "Coordinator",
    "CorruptError",
    "IgnoredLine",
    "NotFoundError",
    "Price",
    "Profile",
    "ProfileError",
    "RunCommand",
    "ScriptError",
    "Settings",
    "StateError",
    "StoreError",
    "SubmitInput",
    "SubqError",
    "SubtaskResult",
    "SubtaskSpec",
    "TaskRecord",
    "TaskStatus",
    "TodoError",
    "TodoItem",
    "TodoStatus",
    "Usage",
    "ValidationError",
    "WaitTimeout",
    "current_trace_id",
    "dead_letter",
    "format_usd",
    "ignored_lines",
    "is_batch_id",
    "is_task_id",
    "load_settings",
    "one_line",
    "parse_markdown",
    "redis_client",
    "render_markdown",
    "task_of_run_id",
    "usd_to_micros",
]


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
