"""`subq demo`: the whole pipeline on this machine, with the offline model and a real tool.

Starts an embedded Redis when `SUBQ_REDIS_URL` is unset and real worker
processes, then does what a first `subq run "Prepare the Q3 report" --todos
plan.md --profile demo --follow` does: a root agent on the offline model
carries out a four-item plan (three items in parallel, one of them nested in
two steps, then a sequential one; docs/offline-model.md), shown live. The
first item calls a real tool: the profile `demo` offers the Python function
`sales_total` (coordinator/local/example_tools.py), and that item's child calls
it on a CSV of sales figures the demo writes, then replies with what it
returned. Then it shows that child's UI messages (the call and the reply), and
the report gives each item's tokens and cost, the root's own and total cost,
and where each figure came from. It stops everything it started and removes
its files.
"""

from __future__ import annotations

import json
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from coordinator.inputs import visible_text
from coordinator.local.embedded_redis import local_redis
from coordinator.local.fleet import WorkerFleet
from coordinator.models import TaskRecord, TodoItem, format_usd
from coordinator.redis_clients import describe
from coordinator.service import Coordinator
from coordinator.settings import Profile, Settings
from coordinator.tree import cut

__all__ = [
    "DEMO_PLAN",
    "DEMO_PROFILE",
    "DEMO_PROFILES_TOML",
    "DEMO_PROMPT",
    "DEMO_SALES_CSV",
    "demo_plan",
    "run_demo",
]

DEMO_PROMPT = "Prepare the Q3 report"
# The profile the demo's agents run on: the offline model, offering one tool, a plain Python
# function (docs/tools.md, section 1). Shown to the user as written here, and parsed from it.
DEMO_PROFILE = "demo"
DEMO_PROFILES_TOML = f"""\
[profiles.{DEMO_PROFILE}]
model = "offline"
tools = ["coordinator.local.example_tools:sales_total"]
"""
# The data the first item's tool reads: twelve orders of Q3, written to the demo's own folder.
DEMO_SALES_CSV = """\
order_id,date,region,amount
Q3-1001,2025-07-02,North,1250.00
Q3-1002,2025-07-09,South,980.50
Q3-1003,2025-07-15,West,2310.00
Q3-1004,2025-07-28,North,640.25
Q3-1005,2025-08-04,West,1575.00
Q3-1006,2025-08-12,South,1120.00
Q3-1007,2025-08-19,North,2045.75
Q3-1008,2025-08-30,South,455.00
Q3-1009,2025-09-03,West,890.40
Q3-1010,2025-09-11,North,1310.00
Q3-1011,2025-09-22,South,1765.10
Q3-1012,2025-09-29,West,600.00
"""
# The plan convention of the offline model's planner: consecutive items run in parallel,
# "X: a; b" nests a child with steps of its own, "Then ..." runs after the rest, and an item
# that ends with a call of one of the task's tools, `name(key=value)`, goes to a child that
# makes that call. {sales_csv} is the path of the CSV (demo_plan).
DEMO_PLAN = """\
[ ] Collect the sales figures for Q3 with sales_total(path={sales_csv})
[ ] Summarise customer feedback
[ ] Check the figures against the ledger: reconcile the orders; reconcile the refunds
[ ] Then write the executive summary
"""


def demo_plan(sales_csv: Path) -> str:
    """DEMO_PLAN with the CSV's path in its call (a JSON string is a Python string literal too)."""
    return DEMO_PLAN.replace("{sales_csv}", json.dumps(str(sales_csv)))


@contextmanager
def _local_stack(settings: Settings, workers: int, say: Callable[[str], None]) -> Iterator[tuple[Settings, Path]]:
    """Redis (embedded unless SUBQ_REDIS_URL is set), the demo's folder with its data, and the workers."""
    with ExitStack() as stack:
        if not settings.redis_given:
            url = stack.enter_context(local_redis())
            settings = settings.model_copy(update={"redis_url": url})
            # Where it is, not its password: the workers get the whole URL in their environment.
            say(f"Started an embedded Redis at {describe(settings)} (no SUBQ_REDIS_URL set; it has a password).")
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="subq-demo-")))
        sales = folder / "sales-q3.csv"
        sales.write_text(DEMO_SALES_CSV, encoding="utf-8")
        orders = len(DEMO_SALES_CSV.splitlines()) - 1
        say(f"Wrote the demo's data: {sales} ({orders} orders of Q3, by region).")
        profile = Profile.model_validate(tomllib.loads(DEMO_PROFILES_TOML)["profiles"][DEMO_PROFILE])
        settings = settings.model_copy(update={"profiles": {**settings.profiles, DEMO_PROFILE: profile}})
        say(
            f"Its agents run on the profile `{DEMO_PROFILE}`: the offline model, offering one tool beside subq's "
            "own,\nthe Python function sales_total (coordinator/local/example_tools.py). "
            "In a profiles file (docs/tools.md):"
        )
        say("")
        say("\n".join(f"  {line}" for line in DEMO_PROFILES_TOML.splitlines()))
        say("")
        say(f"Starting {workers} worker processes (celery -A workers.app worker); each checks that tool at start ...")
        fleet = stack.enter_context(WorkerFleet(settings, workers, folder / "logs"))
        fleet.wait_ready()
        yield settings, sales


def run_demo(settings: Settings, workers: int = 2, say: Callable[[str], None] = print) -> int:
    """0 when the root completed with its plan carried out, 1 otherwise."""
    from coordinator.cli.views import follow_run

    with _local_stack(settings, workers, say) as (settings, sales):
        coord = Coordinator(settings)
        try:
            plan = demo_plan(sales)
            say(
                "The offline model (deterministic, no network, priced as a real model) carries out this plan;\n"
                "its first item ends with a call of that tool, so the child that carries it out makes the call\n"
                "(the planner's convention, docs/offline-model.md):"
            )
            say("")
            say("\n".join(f"  {line}" for line in plan.splitlines()))
            say("")
            root = coord.create_task(DEMO_PROMPT, todos=plan, profile=DEMO_PROFILE, run=True)
            say(
                f'Root agent {root.id}, as `subq run "{DEMO_PROMPT}" --todos plan.md --profile {DEMO_PROFILE} '
                "--follow` starts it:"
            )
            code = follow_run(coord, root.id)
            done = coord.get_task(root.id)
            todos = coord.get_todos(root.id)
            say("")
            say(render_tool_call(coord, todos[0]))
            say("")
            say(render_report(done, todos, coord.get_children(root.id)))
            return code
        finally:
            coord.close()


def render_tool_call(coord: Coordinator, item: TodoItem) -> str:
    """What the child of the tool's item did, from its UI messages: the call, and the reply that read its result."""
    if item.subtask_id is None:
        return f"The item {item.content!r} has no child: its tool was not called."
    # A tool's result is data from outside: printed as visible text, as the CLI prints a model's.
    messages = [
        (visible_text(str(m.get("say", m.get("type", "?")))), visible_text(str(m.get("text", ""))))
        for m in coord.messages(item.subtask_id, "ui")
    ]
    width = max((len(kind) for kind, _ in messages), default=0)
    lines = [f"The first item's child {item.subtask_id}, from its UI messages (`subq export` writes them too):"]
    lines += [f"  {kind:<{width}}  {text}" for kind, text in messages]
    return "\n".join(lines)


def render_report(parent: TaskRecord, todos: list[TodoItem], children: list[TaskRecord]) -> str:
    marks = {"pending": "[ ]", "in_progress": "[-]", "completed": "[x]"}
    by_id = {c.id: c for c in children}
    lines = [f"Todo list of {parent.id} ({parent.status.value}):", ""]
    lines.append(f"  {'':3}  {'item':40}  {'subtask':29}  {'tokens':>7}  {'cost':>10}")
    for item in todos:
        lines.append(
            f"  {marks[item.status.value]}  {cut(item.content, 40):40}  {item.subtask_id or '-':29}  "
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
    lines.append("  - model: the offline model (deterministic, no network), priced as a real model. A leaf")
    lines.append("    replies once, with the scripted usage of a real call; the planners' requests, and the two")
    lines.append("    of the tool's item (the call, then the reply that reads its result), report an estimate")
    lines.append("    from the text they carry (docs/offline-model.md).")
    lines.append("  - the tool call itself costs nothing: the profile gives sales_total no price (tool_prices).")
    lines.append("  - each item shows its child's subtree total, written back in the same step that ended the")
    lines.append("    child (the last child's end also resumes the parent); the parent's total is the sum over")
    lines.append("    its subtree, never a second copy.")
    return "\n".join(lines)
