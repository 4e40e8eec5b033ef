"""Traces: the switch, and the spans subq opens itself (docs/tracing.md).

`SUBQ_TRACES_EXPORTER` (default `none`) turns traces on: `otlp` (OTLP over
HTTP, configured by the standard `OTEL_EXPORTER_OTLP_*` variables), `console`,
or `package.module:factory`, a callable that returns an OpenTelemetry
`SpanExporter`. Every process that builds subq's Celery app or a `Coordinator`
calls `setup(settings)`; the first call with an exporter installs tracing for
the whole process (coordinator/otel.py), and it stays installed.

Off, this module costs one global read per span site: `span()` returns a shared
null context and `traced` calls straight through. Nothing imports the
OpenTelemetry SDK, no Celery signal gets a receiver (Celery skips a signal with
none), and no header or Redis command is added (issue 11's budget per run).

subq's own spans, beside Celery's publish and run spans and pydantic-ai's model
request spans: `subq.submit` (a root is created), `subq.delegate` (a run commits
a delegation), `subq.publish` (a batch's children are published),
`subq.write_back` (a child's end writes it back onto its parent),
`subq.end_run` (a root's end), and `subq.resume` (a parent's resume is published).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from coordinator.errors import ConfigError

if TYPE_CHECKING:
    from coordinator.otel import Installed
    from coordinator.settings import Settings

__all__ = ["DISTRIBUTION", "current_trace_id", "enabled", "flush", "setup", "shutdown", "span", "traced"]

# The distribution to install with its `otel` extra when tracing is on but OpenTelemetry is absent.
DISTRIBUTION = "subagent-queue"
# A span site when tracing is off: one shared object, nothing allocated per call.
_OFF: AbstractContextManager[None] = nullcontext()

_installed: Installed | None = None
_lock = threading.Lock()

P = ParamSpec("P")
R = TypeVar("R")


def enabled() -> bool:
    return _installed is not None


def setup(settings: Settings) -> None:
    """Install tracing for this process if `settings` name an exporter; a no-op when off or already on.

    Raises `ConfigError` (one line naming the setting) when the exporter cannot be
    made: OpenTelemetry is not installed, or a factory cannot be imported.
    """
    global _installed
    exporter = settings.traces_exporter
    if exporter == "none" or _installed is not None:
        return
    with _lock:
        if _installed is not None:
            return
        try:
            from coordinator import otel

            _installed = otel.install(exporter)
        except ImportError as exc:
            if not (exc.name or "").startswith("opentelemetry"):
                raise
            raise ConfigError(
                f"Invalid setting SUBQ_TRACES_EXPORTER: {exporter!r} needs OpenTelemetry ({exc.name} is not "
                f"installed): pip install '{DISTRIBUTION}[otel]'",
                field="SUBQ_TRACES_EXPORTER",
            ) from None


def span(name: str, **attributes: str | int | bool) -> AbstractContextManager[Any]:
    """A span around a step, child of the current one (its attributes named `subq.<key>`); a null context when off."""
    installed = _installed
    if installed is None:
        return _OFF
    return installed.tracer.start_as_current_span(name, attributes={f"subq.{k}": v for k, v in attributes.items()})


def traced(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A function run inside a span named `name` (a flag check per call when off)."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            installed = _installed
            if installed is None:
                return function(*args, **kwargs)
            with installed.tracer.start_as_current_span(name):
                return function(*args, **kwargs)

        return call

    return decorate


def current_trace_id() -> str | None:
    """The current trace's id (32 hex digits), or None when off or outside a span: for log lines."""
    installed = _installed
    return None if installed is None else installed.current_trace_id()


def flush(timeout_s: float = 5.0) -> bool:
    """Export the spans ended so far; True when done (or off)."""
    installed = _installed
    return True if installed is None else installed.flush(timeout_s)


def shutdown() -> None:
    """Flush and uninstall: the process is untraced again (tests; the SDK flushes at exit anyway)."""
    global _installed
    with _lock:
        installed, _installed = _installed, None
    if installed is not None:
        installed.uninstall()
