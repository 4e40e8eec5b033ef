"""A worker process's own observability: its log lines, its Prometheus counters, and the
hooks that attach both (and trace spans) to a run's life.

## Log lines


`SUBQ_LOG_FORMAT=text` (the default) keeps Celery's own lines, made for a
terminal. `SUBQ_LOG_FORMAT=json` writes one JSON object a line, for a log
pipeline: `timestamp`, `level`, `logger`, `message` (and `exc_info` with a
traceback). Either way, every line emitted while a run is in progress (in the
thread that runs it, the agent loop included) carries the run's `task_id`,
`root_id`, `batch_id` (null for a root), `worker` (the Celery node name) and
`delivery` (1 for a first delivery, 2 for a redelivery, ...) as JSON fields,
and `trace_id` when traces are on (docs/tracing.md).

A line may carry a model's or a provider's text (a failed run's error, a tool's
error, an endpoint's answer), which reaches an operator's terminal. A text line
writes every non-printable character of its message as its escape, the line
break included, so a message is one line and never a terminal sequence; a
traceback keeps its line breaks and escapes the rest (`VisibleLineFilter`). A
JSON line is escaped by its JSON.

The run's ids live in a context variable: `workers/tasks.py` opens it around
the run, and the run lifecycle's `started` hook adds what only the task's record
knows (its root, batch and delivery count), through `WorkerRunHooks`.

## Metrics

The events of a worker's runs, counted in memory. Counters of what happens per run and per model request (runs started, tasks
ended, model requests, tokens, micro-USD, budget stops, redeliveries) live in
the memory of the process that ran them, never in Redis: a run's Redis round
trips and commands are budgeted (docs/benchmarks.md), and a counter there would
cost one on every response; in memory a run of one request spends about 12 µs
of CPU on them (measured on the 2-core dev machine). Each worker serves them on its own HTTP port
(`SUBQ_WORKER_METRICS_PORT`, off unless set) and Prometheus sums them across
the fleet, e.g. `sum by (model) (rate(subq_tokens_total[5m]))`. A restarted
worker starts from zero, which `rate()` and `increase()` treat as a counter
reset. State that is the fleet's, not an event (queue depth, runs in flight,
approvals waiting, dead letters, repairs), is read from Redis by the API's
`/metrics` (coordinator/api/ops.py) instead.

The metrics live on a registry of this module (`REGISTRY`), not on
prometheus_client's global one: a process that imports this module beside its
own metrics must not export empty worker counters beside them.

Labels are bounded by configuration: `profile` (a configured profile's name),
`model` (that profile's `model`, e.g. `openai:gpt-4o` or `offline`), `provider`
(`openai`, `anthropic`, `offline`), `status`, `outcome`, `direction`; never a
task id.

## Hooks

`WorkerRunHooks` is what the worker attaches to the run lifecycle
(coordinator/runs.py, `RunHooks`): a started run's log fields and counters, a
budget stop's counter, and the spans of the steps that write shared state. The
lifecycle holds none of this code itself.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from celery import signals
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from pythonjsonlogger.json import JsonFormatter

from coordinator import ConfigError, TaskRecord, TaskStatus, all_shown, current_trace_id, visible_text
from coordinator.runs import Run, RunHooks
from coordinator.tracing import span

if TYPE_CHECKING:
    from coordinator import Usage

__all__ = [
    "BUDGET_STOPS",
    "CACHE_TOKENS",
    "COST",
    "LATENCY",
    "LATENCY_BUCKETS_S",
    "MODEL_REQUESTS",
    "REDELIVERIES",
    "REGISTRY",
    "RUNS_STARTED",
    "TASKS_ENDED",
    "TASKS_STARTED",
    "TOKENS",
    "TOOL_CALLS",
    "TOOL_DURATION",
    "RunContext",
    "RunContextFilter",
    "VisibleLineFilter",
    "WorkerRunHooks",
    "count_replica_shortfalls",
    "current_run",
    "install",
    "model_request",
    "response",
    "run_context",
    "run_ended",
    "serve",
    "tool_call",
]

log = logging.getLogger(__name__)

# The fields of a JSON line besides the run's: Python's names on the left, the line's on the right.
JSON_FIELDS = "{levelname}{name}{message}"
JSON_RENAMES = {"levelname": "level", "name": "logger"}


@dataclass(frozen=True)
class RunContext:
    """The run a log line belongs to; None for what only the task's record knows, until the run starts."""

    task_id: str
    worker: str
    root_id: str | None = None
    batch_id: str | None = None
    delivery: int | None = None


_current: ContextVar[RunContext | None] = ContextVar("subq_run", default=None)


def current_run() -> RunContext | None:
    return _current.get()


@contextmanager
def run_context(task_id: str, worker: str) -> Iterator[RunContext]:
    """Lines logged inside belong to the run of `task_id` on `worker` (reset after: pool threads are reused)."""
    context = RunContext(task_id=task_id, worker=worker)
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


class WorkerRunHooks(RunHooks):
    """The worker's hooks on a run's life: log fields and counters of a started run, a budget stop's
    counter, the spans of the steps that write shared state."""

    def started(self, run: Run) -> None:
        task = run.task
        context = _current.get()
        if context is not None:
            _current.set(replace(context, root_id=task.root_id, batch_id=task.batch_id, delivery=run.deliveries))
        _child(RUNS_STARTED, task.profile).inc()
        if run.run_seq == 1:
            _child(TASKS_STARTED, task.profile).inc()
        if run.deliveries > 1:
            _child(REDELIVERIES, task.profile).inc()

    def span(self, name: str, **attributes: str | int | bool) -> AbstractContextManager[object]:
        return span(name, **attributes)

    def budget_stopped(self, task: TaskRecord) -> None:
        BUDGET_STOPS.labels(task.profile).inc()


class RunContextFilter(logging.Filter):
    """Adds the current run's fields to a record (a JSON line shows them); lines outside a run get none.

    With traces on (docs/tracing.md), a line logged inside a span also gets its `trace_id`.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        context = _current.get()
        if context is not None:
            for name, value in asdict(context).items():
                setattr(record, name, value)
        trace_id = current_trace_id()
        if trace_id is not None:
            record.trace_id = trace_id
        return True


class VisibleLineFilter(logging.Filter):
    """Makes a text line's message one line of visible text, and its traceback visible text (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a call whose arguments do not fit its format: the handler's emit reports it
            return True  # (a filter runs outside the handler's error handling: raising here reached the caller)
        if not all_shown(message):  # (most are: checked in C, where escaping a 1 KB line costs 40 us)
            record.msg, record.args = visible_text(message).replace("\n", "\\n"), None  # args None: `msg` as is
        if record.exc_info and not record.exc_text:
            # Set once here, the formatter shows it as it is (logging.Formatter.format keeps an `exc_text`).
            record.exc_text = visible_text(logging.Formatter().formatException(record.exc_info))
        return True


def json_formatter() -> logging.Formatter:
    return JsonFormatter(JSON_FIELDS, style="{", rename_fields=JSON_RENAMES, timestamp=True)


def install(log_format: str) -> None:
    """Once Celery has set up the worker's loggers, give their handlers the run's fields (and JSON)."""

    def configure(logger: logging.Logger, **_: Any) -> None:
        for handler in logger.handlers:
            if not any(isinstance(f, RunContextFilter) for f in handler.filters):
                handler.addFilter(RunContextFilter())
            if log_format == "json":
                handler.setFormatter(json_formatter())
            elif not any(isinstance(f, VisibleLineFilter) for f in handler.filters):
                handler.addFilter(VisibleLineFilter())

    # Both signals: Celery's task logger (`celery.task`) has handlers of its own.
    signals.after_setup_logger.connect(configure, weak=False)
    signals.after_setup_task_logger.connect(configure, weak=False)


# -- metrics ----------------------------------------------------------------------------

REGISTRY = CollectorRegistry(auto_describe=True)

# The fleet-wide histogram's bounds (coordinator/store/metrics.py), in seconds, so the two agree.
LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# How a task's own run ended it; `delegated` and `waiting_approval` are not ends.
ENDED_STATUSES = frozenset(status.value for status in TaskStatus if status.terminal)


def _counter(name: str, documentation: str, *labels: str) -> Counter:
    """A counter of this module's registry (prometheus_client adds `_total` to the name)."""
    return Counter(name, documentation, list(labels), registry=REGISTRY)


RUNS_STARTED = _counter(
    "subq_runs_started",
    "Runs of agent tasks this worker started (a task's first run, and each resume or redelivery)",
    "profile",
)
TASKS_STARTED = _counter(
    "subq_tasks_started",
    "Agent tasks whose first run this worker started",
    "profile",
)
REDELIVERIES = _counter(
    "subq_run_redeliveries",
    "Runs this worker started that an earlier worker had been given and lost (its delivery count above 1)",
    "profile",
)
TASKS_ENDED = _counter(
    "subq_tasks_ended",
    "Agent tasks a run of this worker ended, by final status (completed, failed, cancelled)",
    "profile",
    "status",
)
BUDGET_STOPS = _counter(
    "subq_budget_stops",
    "Subtrees this worker stopped because a budget over them was spent (by a response, or by late spend)",
    "profile",
)
MODEL_REQUESTS = _counter(
    "subq_model_requests",
    "Model requests this worker made, by outcome: ok, transient_error (waited out), error, cancelled",
    "provider",
    "model",
    "outcome",
)
TOKENS = _counter(
    "subq_tokens",
    "Tokens of the model responses this worker recorded; direction 'in' includes cache reads and writes",
    "model",
    "profile",
    "direction",
)
CACHE_TOKENS = _counter(
    "subq_cache_tokens",
    "Input tokens read from or written to the provider's prompt cache (a part of direction 'in' of subq_tokens)",
    "model",
    "profile",
    "kind",
)
COST = _counter(
    "subq_cost_micro_usd",
    "Cost in micro-USD of the model responses this worker recorded",
    "model",
    "profile",
)
TOOL_CALLS = _counter(
    "subq_tool_calls",
    "Tool calls of this worker's runs, by tool and outcome: ok, error, timeout, denied, interrupted, replayed",
    "tool",
    "outcome",
)
NETWORK_REFUSED = _counter(
    "subq_sandbox_network_refused",
    "Connections a sandboxed command or MCP server asked for that its allow list refused, by source "
    "(run_command, or mcp:<server>: configured names, so the label stays bounded)",
    "source",
)
TOOL_DURATION = Histogram(
    "subq_tool_call_duration_seconds",
    "How long this worker's tool calls ran (those that ran: ok, error, timeout)",
    ["tool"],
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
LATENCY = Histogram(
    "subq_worker_model_request_latency_seconds",
    "Latency of this worker's model requests that got a response",
    ["provider", "model"],
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)


# Each metric's labelled children, once looked up: prometheus_client's `labels()` checks the values and takes a
# lock at every call, eight a child (a tenth of a millisecond of a child's worker CPU, bench/thread_cpu.py). The
# values are configured names (profiles, models, tools) and fixed words, so the dict stays small; a metric's
# children are never removed.
_children: dict[tuple[Counter | Histogram, tuple[str, ...]], Any] = {}


def _child(metric: Counter | Histogram, *values: str) -> Any:
    """`metric.labels(*values)`, looked up once."""
    child = _children.get((metric, values))
    if child is None:
        child = _children[(metric, values)] = metric.labels(*values)
    return child


class _ReplicaShortfalls(Collector):
    """The steps of this worker acknowledged by fewer replicas than SUBQ_REDIS_MIN_REPLICAS asks for.

    The store counts them as they happen (`ReplicaShortfalls`, coordinator/store/base.py); this
    reads its count at each scrape, as the API's /metrics does for the API's own steps.
    """

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "subq_replica_shortfalls",
            "Steps this worker acknowledged whose WAIT heard from fewer replicas than SUBQ_REDIS_MIN_REPLICAS "
            "within SUBQ_REDIS_REPLICA_WAIT_MS (each stands on the master; docs/deploy.md, 'Redis failover')",
            value=self.read(),
        )


_shortfalls = _ReplicaShortfalls(lambda: 0)
REGISTRY.register(_shortfalls)


def count_replica_shortfalls(read: Callable[[], int]) -> None:
    """Report the count `read` gives (the process's store: its runtime is built once per process)."""
    _shortfalls.read = read


def run_ended(profile: str, status: str) -> None:
    """A run returned; its task ended if `status` is terminal (a run that released its worker did not)."""
    if status in ENDED_STATUSES:
        _child(TASKS_ENDED, profile, status).inc()


# The `tool` label of a call naming no tool of its task: the name is the model's text, and a label per
# made-up name would grow the series (and this process's cache of them) without bound.
UNKNOWN_TOOL = "(unknown)"


def tool_call(tool: str, outcome: str, duration_s: float | None = None) -> None:
    """One tool call's outcome. `tool` must be a configured name or UNKNOWN_TOOL, never the model's text:
    each value is a series of its own, kept for the life of the process."""
    _child(TOOL_CALLS, tool, outcome).inc()
    if duration_s is not None:
        _child(TOOL_DURATION, tool).observe(duration_s)


def network_refused(source: str, count: int) -> None:
    """`count` connections of `source` (run_command, mcp:<server>) its network allow list refused."""
    NETWORK_REFUSED.labels(source).inc(count)


def model_request(provider: str, model: str, outcome: str, latency_s: float | None = None) -> None:
    _child(MODEL_REQUESTS, provider, model, outcome).inc()
    if latency_s is not None:
        _child(LATENCY, provider, model).observe(latency_s)


def response(model: str, profile: str, usage: Usage, cost_micros: int) -> None:
    """One response's usage and cost, as the run records it on its task."""
    _child(TOKENS, model, profile, "in").inc(usage.tokens_in)
    _child(TOKENS, model, profile, "out").inc(usage.tokens_out)
    if usage.cache_reads:
        _child(CACHE_TOKENS, model, profile, "read").inc(usage.cache_reads)
    if usage.cache_writes:
        _child(CACHE_TOKENS, model, profile, "write").inc(usage.cache_writes)
    _child(COST, model, profile).inc(cost_micros)


def serve(port: int, host: str) -> None:
    """Serve `REGISTRY` on http://host:port/metrics from a daemon thread, or raise one clear ConfigError.

    A port taken by another process stops the worker at start with this line, rather than
    leaving a worker that runs but is never scraped (a fleet that looks idle in Grafana).
    """
    try:
        start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as exc:
        why = "the port is in use by another process" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise ConfigError(
            f"Invalid setting SUBQ_WORKER_METRICS_PORT: cannot serve metrics on {host}:{port}: {why} "
            "(give each worker process on a host a port of its own, or leave it unset)",
            field="SUBQ_WORKER_METRICS_PORT",
        ) from None
    log.info("subq: serving worker metrics on http://%s:%d/metrics", host, port)
