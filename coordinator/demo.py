"""`subq demo`: the whole pipeline on this machine, with the offline model.

Starts an embedded Redis when `SUBQ_REDIS_URL` is unset, starts real worker
processes, creates a parent with a four-item todo list, delegates three
parallel children and then one sequential child, and prints the todo list
with tokens and cost per item, the parent's own and total cost, and where
each figure came from. It stops everything it started.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from coordinator.fleet import WorkerFleet
from coordinator.local_redis import local_redis
from coordinator.models import TaskRecord, TodoItem, format_usd
from coordinator.service import Coordinator
from coordinator.settings import Settings

__all__ = ["run_demo"]

DEMO_TODOS = """\
[ ] Collect the sales figures for Q3
[ ] Summarise customer feedback
[ ] Check the figures against the ledger
[ ] Write the executive summary
"""
# Each child makes one scripted request; the usage is what a real Claude call of
# that size reports, and the latency lets the parallel children overlap visibly.
DEMO_CHILDREN = [
    ("Collect Q3 sales", "Q3 sales: 1,204 orders, $2.1M revenue.", (1200, 450, 2000, 8000)),
    ("Summarise feedback", "Feedback: delivery times praised, pricing page confusing.", (900, 380, 2000, 8000)),
    ("Reconcile with the ledger", "Ledger matches to the cent.", (1500, 220, 2000, 8000)),
]
DEMO_SEQUENTIAL = ("Write the summary", "Q3 was strong; fix the pricing page next.", (2400, 900, 0, 10000))
DEMO_LATENCY_MS = 400
DEMO_WAIT_S = 120.0


def _message(text: str, reply: str, usage: tuple[int, int, int, int]) -> str:
    steps = [
        {
            "reply": reply,
            "latency_ms": DEMO_LATENCY_MS,
            "usage": dict(zip(("input", "output", "cache_write", "cache_read"), usage, strict=True)),
        }
    ]
    return f"{text}.\n\n```subq-script\n{json.dumps({'steps': steps})}\n```\n"


@contextmanager
def _local_stack(settings: Settings, workers: int, say: Callable[[str], None]) -> Iterator[Settings]:
    with ExitStack() as stack:
        if not settings.redis_url:
            url = stack.enter_context(local_redis())
            say(f"Started an embedded Redis at {url} (no SUBQ_REDIS_URL set).")
            settings = settings.model_copy(update={"redis_url": url})
        say(f"Starting {workers} worker processes (celery -A workers.app worker) ...")
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="subq-demo-")))
        fleet = stack.enter_context(WorkerFleet(settings, workers, log_dir))
        fleet.wait_ready()
        yield settings


def run_demo(settings: Settings, workers: int = 2, say: Callable[[str], None] = print) -> int:
    with _local_stack(settings, workers, say) as settings:
        coord = Coordinator(settings)
        try:
            parent = coord.create_task("Prepare the Q3 report", todos=DEMO_TODOS)
            say(f"Created parent task {parent.id} with 4 todo items.")
            started = time.monotonic()
            specs = [{"description": d, "message": _message(d, r, u)} for d, r, u in DEMO_CHILDREN]
            batch = coord.delegate(parent.id, specs, mode="parallel")
            say(f"Delegated {len(specs)} parallel children (batch {batch.id}); waiting ...")
            coord.wait(parent.id, DEMO_WAIT_S)
            say(f"  the chord callback wrote them back in {time.monotonic() - started:.1f}s.")
            d, r, u = DEMO_SEQUENTIAL
            coord.delegate(parent.id, [{"description": d, "message": _message(d, r, u)}], mode="sequential")
            say("Delegated 1 sequential child; waiting ...")
            done = coord.wait(parent.id, DEMO_WAIT_S)
            say("")
            say(render_report(done, coord.get_todos(parent.id), coord.get_children(parent.id)))
            return 0
        finally:
            coord.close()


def render_report(parent: TaskRecord, todos: list[TodoItem], children: list[TaskRecord]) -> str:
    marks = {"pending": "[ ]", "in_progress": "[-]", "completed": "[x]"}
    by_id = {c.id: c for c in children}
    lines = [f"Todo list of {parent.id} ({parent.status.value}):", ""]
    lines.append(f"  {'':3}  {'item':40}  {'subtask':29}  {'tokens':>7}  {'cost':>10}")
    for item in todos:
        lines.append(
            f"  {marks[item.status.value]}  {item.content[:40]:40}  {item.subtask_id or '-':29}  "
            f"{item.tokens:>7}  {format_usd(item.cost_micros):>10}"
        )
    lines += [
        "",
        f"Parent own cost:   {format_usd(parent.cost_micros)} ({parent.tokens} tokens; the parent is this demo, "
        "which made no model requests)",
        f"Parent total cost: {format_usd(parent.total_cost_micros)} ({parent.total_tokens} tokens: own plus every "
        "child's subtree)",
        "",
        "Where the figures come from:",
    ]
    sources = sorted({by_id[i.subtask_id].cost_source for i in todos if i.subtask_id in by_id})
    lines.append("  - tokens: the usage each model response reported, recorded on the child atomically per request;")
    lines.append("    tokens = input (including cache reads and writes) + output.")
    lines.append(f"  - cost: integer micro-USD per request, from {'; '.join(sources) or 'no request'}.")
    lines.append("  - model: the offline model (deterministic, no network), priced as a real model.")
    lines.append("  - each item shows its child's subtree total, written back as the child ended (the chord")
    lines.append("    callback or chain step applies any it missed); the parent's total is the sum over its")
    lines.append("    subtree, never a second copy.")
    return "\n".join(lines)
