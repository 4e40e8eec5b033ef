"""Tracing installed in a process: OpenTelemetry's SDK, Celery's and pydantic-ai's instrumentation.

Imported only by `coordinator.tracing.setup` when `SUBQ_TRACES_EXPORTER` names an
exporter; it needs the `otel` extra (`pip install 'subagent-queue[otel]'`).

- One `TracerProvider` of subq's own, with a batch span processor: the standard
  `OTEL_*` variables (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
  `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_*`) apply as the SDK
  reads them. The process's global provider is left as it is: subq may run
  inside another service that has its own.
- Celery: the maintained instrumentation (`opentelemetry-instrumentation-celery`):
  an `apply_async/<task name>` producer span per message, whose context goes in
  the message's headers (`traceparent`), and a `run/<task name>` consumer span
  around each task, the child of the context its message carries. It works for
  subq's publishes by name (`send_task`, signatures, groups, chains) and in the
  threads pool: the run span is attached and detached in the thread that runs the
  task. (For a task the publishing app has not registered, as the coordinator's
  is, the producer span ends before the message is sent instead of after.)
- pydantic-ai: `Agent.instrument_all`, one span per agent run and per model
  request, without prompts or completions (`include_content=False`: a trace
  backend is no place for them, as Flower is not).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from pydantic_ai import Agent
from pydantic_ai.models.instrumented import InstrumentationSettings

from coordinator.errors import ConfigError

__all__ = ["DEFAULT_SERVICE_NAME", "Installed", "install"]

# What a trace backend calls subq's processes unless OTEL_SERVICE_NAME says otherwise.
DEFAULT_SERVICE_NAME = "subq"
TRACER_NAME = "subq"


@dataclass
class Installed:
    """Tracing as installed in this process; `uninstall` undoes it (tests)."""

    provider: TracerProvider
    tracer: trace.Tracer
    celery: CeleryInstrumentor

    def current_trace_id(self) -> str | None:
        context = trace.get_current_span().get_span_context()
        return format(context.trace_id, "032x") if context.is_valid else None

    def flush(self, timeout_s: float) -> bool:
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def uninstall(self) -> None:
        self.celery.uninstrument()
        Agent.instrument_all(False)
        self.provider.shutdown()


def install(exporter_name: str) -> Installed:
    """Install tracing with the named exporter; `ConfigError` if it cannot be made."""
    provider = TracerProvider(resource=_resource())
    provider.add_span_processor(BatchSpanProcessor(_exporter(exporter_name)))
    tracer = provider.get_tracer(TRACER_NAME)
    celery = CeleryInstrumentor()  # type: ignore[no-untyped-call]  # untyped upstream
    celery.instrument(tracer_provider=provider)
    Agent.instrument_all(
        InstrumentationSettings(
            tracer_provider=provider,
            include_content=False,
            include_binary_content=False,
            # Every tool's schema on every request span: large, and the same each time.
            include_model_request_parameters=False,
        )
    )
    return Installed(provider=provider, tracer=tracer, celery=celery)


def _resource() -> Resource:
    """The SDK's resource from the environment, named `subq` unless OTEL_SERVICE_NAME names it."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def _exporter(name: str) -> SpanExporter:
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if name == "console":
        return ConsoleSpanExporter()
    module_name, _, attribute = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
        made = factory()
    except Exception as exc:  # any failure of the named factory is this setting's: a wrong name, or one that raised
        raise ConfigError(
            f"Invalid setting SUBQ_TRACES_EXPORTER: cannot load {name!r}: {type(exc).__name__}: {exc}",
            field="SUBQ_TRACES_EXPORTER",
        ) from None
    if not isinstance(made, SpanExporter):
        raise ConfigError(
            f"Invalid setting SUBQ_TRACES_EXPORTER: {name!r} returned {type(made).__name__}, not a SpanExporter",
            field="SUBQ_TRACES_EXPORTER",
        )
    return made
