"""Span exporters for the traces' tests (`SUBQ_TRACES_EXPORTER=tests.trace_dump:<factory>`).

`memory`: OpenTelemetry's in-memory exporter, one per process, read by the test
itself. `to_file`: the same in-memory exporter in a worker process, whose
spans so far are written after each export as JSON lines to a file of that
process's own under `$SUBQTEST_SPANS_DIR` (the test reads them from there).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

SPANS_DIR = "SUBQTEST_SPANS_DIR"
MEMORY = InMemorySpanExporter()


def memory() -> SpanExporter:
    return MEMORY


class FileDump(SpanExporter):
    """The in-memory exporter, whose spans are written to `path` after each export (atomically)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.memory = InMemorySpanExporter()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.memory.export(spans)
        partial = self.path.with_suffix(".partial")
        partial.write_text("".join(json.dumps(record(s)) + "\n" for s in self.memory.get_finished_spans()))
        partial.replace(self.path)
        return result

    def shutdown(self) -> None:
        self.memory.shutdown()


def to_file() -> SpanExporter:
    return FileDump(Path(os.environ[SPANS_DIR]) / f"spans-{os.getpid()}.jsonl")


def record(span: ReadableSpan) -> dict[str, Any]:
    """A span as JSON: its name, kind, trace, own and parent ids (hex), and attributes."""
    context = span.get_span_context()
    assert context is not None
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent is not None else None,
        "attributes": {
            k: v if isinstance(v, (str, int, float, bool)) else list(v) for k, v in (span.attributes or {}).items()
        },  # type: ignore[union-attr]
    }


def read_dir(directory: Path) -> list[dict[str, Any]]:
    """Every span the worker processes have written under `directory`."""
    return [
        json.loads(line) for path in sorted(directory.glob("spans-*.jsonl")) for line in path.read_text().splitlines()
    ]
