"""`subq demo`: the whole pipeline on this machine, with the offline model.

Starts an embedded Redis when `SUBQ_REDIS_URL` is unset and real worker
processes, then does what a first `subq run "Prepare the Q3 report" --todos
plan.md --follow` does: a root agent on the offline model carries out a
four-item plan (three items in parallel, one of them nested in two steps, then
a sequential one; docs/offline-model.md), shown live, and the report gives each
item's tokens and cost, the root's own and total cost, and where each figure
came from. It stops everything it started.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from coordinator.local.embedded_redis import local_redis
from coordinator.local.fleet import WorkerFleet
from coordinator.models import TaskRecord, TodoItem, format_usd
from coordinator.service import Coordinator
from coordinator.settings import Settings

__all__ = ["DEMO_PLAN", "DEMO_PROMPT", "run_demo"]

DEMO_PROMPT = "Prepare the Q3 report"
# The plan convention of the offline model's planner: consecutive items run in parallel,
# "X: a; b" nests a child with steps of its own, "Then ..." runs after the rest.
DEMO_PLAN = """\
[ ] Collect the sales figures for Q3
[ ] Summarise customer feedback
[ ] Check the figures against the ledger: reconcile the orders; reconcile the refunds
[ ] Then write the executive summary
"""


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
    """0 when the root completed with its plan carried out, 1 otherwise."""
    from coordinator.cli.views import follow_run

    with _local_stack(settings, workers, say) as settings:
        coord = Coordinator(settings)
        try:
            say("The offline model (deterministic, no network, priced as a real model) carries out this plan:")
            say("")
            say("\n".join(f"  {line}" for line in DEMO_PLAN.splitlines()))
            say("")
            root = coord.create_task(DEMO_PROMPT, todos=DEMO_PLAN, run=True)
            say(f'Root agent {root.id}, as `subq run "{DEMO_PROMPT}" --todos plan.md --follow` starts it:')
            code = follow_run(coord, root.id)
            done = coord.get_task(root.id)
            say("")
            say(render_report(done, coord.get_todos(root.id), coord.get_children(root.id)))
            return code
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
        f"Root own cost:   {format_usd(parent.cost_micros)} ({parent.tokens} tokens: the root agent's own planning "
        "requests)",
        f"Root total cost: {format_usd(parent.total_cost_micros)} ({parent.total_tokens} tokens: own plus every "
        "item's child subtree)",
        "",
        "Where the figures come from:",
    ]
    sources = sorted({by_id[i.subtask_id].cost_source for i in todos if i.subtask_id in by_id})
    lines.append("  - tokens: the usage each model response reported, recorded on the child atomically per request;")
    lines.append("    tokens = input (including cache reads and writes) + output.")
    lines.append(f"  - cost: integer micro-USD per request, from {'; '.join(sources) or 'no request'}.")
    lines.append("  - model: the offline model (deterministic, no network), priced as a real model.")
    lines.append("  - each item shows its child's subtree total, written back in the same step that ended the")
    lines.append("    child (the last child's end also resumes the parent); the parent's total is the sum over")
    lines.append("    its subtree, never a second copy.")
    return "\n".join(lines)
