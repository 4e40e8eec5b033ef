"""The demo's first plan item is carried out with a real tool (coordinator/local/example_tools.py).

`subq demo` runs as a user runs it (a separate process), on the session's Redis under
keys and a queue of its own, so what its tasks did can be read back afterwards: the
tool's result, computed from the demo's CSV, is in the child's conversation and UI
messages, and the item is checked with exactly what the child's requests cost. Then
the planner's convention (workers/runtime/planner.py) and the tool itself, without
workers.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Literal

import pytest
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.tools import ToolDefinition

from coordinator import Coordinator, Profile, Settings, TodoStatus
from coordinator.local.demo import DEMO_PLAN, DEMO_PROFILE, DEMO_PROFILES_TOML, DEMO_SALES_CSV
from coordinator.local.example_tools import sales_total
from coordinator.models import TaskRecord, format_usd
from coordinator.todos import parse_markdown
from tests.test_cli import subq
from workers.runtime.offline import OfflineModel
from workers.runtime.planner import PlanItem, next_step, tool_call
from workers.runtime.pricing import cost_of
from workers.runtime.script import parse_script

PREFIX, QUEUE = "subqdemotool", "subq-demo-tool"


def _usd(amount: Decimal) -> str:
    return f"${amount:,.2f}"


def _expected_figures() -> list[str]:
    """The figures the tool must find in the demo's CSV, summed here independently of it."""
    totals: dict[str, Decimal] = defaultdict(Decimal)
    for row in csv.DictReader(io.StringIO(DEMO_SALES_CSV)):
        totals[row["region"]] += Decimal(row["amount"])
    orders = len(DEMO_SALES_CSV.strip().splitlines()) - 1
    return [f"{orders} orders", f"{_usd(sum(totals.values(), Decimal(0)))} in total"] + [
        f"{region} {_usd(total)}" for region, total in sorted(totals.items())
    ]


class DemoRun:
    def __init__(self, out: str, coord: Coordinator, root: TaskRecord) -> None:
        self.out, self.coord, self.root = out, coord, root


@pytest.fixture(scope="module")
def demo(settings: Settings) -> Iterator[DemoRun]:
    """`subq demo` on the session's Redis (SUBQ_REDIS_URL set, as a user with a Redis of their own has it)."""
    proc = subq(
        "demo",
        env={"SUBQ_REDIS_URL": settings.redis_url or "", "SUBQ_KEY_PREFIX": PREFIX, "SUBQ_QUEUE": QUEUE},
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root_id = re.search(r"Root agent ([0-9a-f]{16}),", proc.stdout)
    assert root_id is not None, proc.stdout
    coord = Coordinator(settings.model_copy(update={"key_prefix": PREFIX, "queue": QUEUE}))
    try:
        yield DemoRun(proc.stdout, coord, coord.get_task(root_id.group(1)))
    finally:
        coord.close()


def test_the_first_item_is_carried_out_by_calling_the_tool_on_the_demos_data(demo: DemoRun) -> None:
    item = demo.coord.get_todos(demo.root.id)[0]
    assert item.content.startswith("Collect the sales figures for Q3 with sales_total(path=")
    assert item.status == TodoStatus.COMPLETED and item.subtask_id is not None
    conversation = ModelMessagesTypeAdapter.validate_python(demo.coord.messages(item.subtask_id, "api"))
    calls = [p for m in conversation for p in m.parts if isinstance(p, ToolCallPart)]
    returns = [p for m in conversation for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [c.tool_name for c in calls] == ["sales_total"] and [r.tool_name for r in returns] == ["sales_total"]
    path = Path(calls[0].args_as_dict()["path"])
    assert path.name == "sales-q3.csv" and not path.exists()  # the demo removed its folder when it ended
    result = returns[0].model_response_str()
    for figure in _expected_figures():
        assert figure in result, (figure, result)
    # The UI messages show the call, and the reply that read the result.
    ui = [(m.get("say"), m.get("text")) for m in demo.coord.messages(item.subtask_id, "ui")]
    assert ("tool", f"sales_total({json.dumps({'path': str(path)})})") in ui, ui
    assert ("text", f"Done: sales_total returned {result}") in ui, ui
    assert demo.coord.get_task(item.subtask_id).summary == f"Done: sales_total returned {result}"


def test_the_items_figures_are_exactly_what_its_childs_requests_cost(demo: DemoRun) -> None:
    item = demo.coord.get_todos(demo.root.id)[0]
    assert item.subtask_id is not None
    child = demo.coord.get_task(item.subtask_id)
    conversation = ModelMessagesTypeAdapter.validate_python(demo.coord.messages(item.subtask_id, "api"))
    responses = [m for m in conversation if isinstance(m, ModelResponse)]
    assert len(responses) == 2  # the call, then the reply that read its result
    profile = Profile.model_validate(tomllib.loads(DEMO_PROFILES_TOML)["profiles"][DEMO_PROFILE])
    tokens = sum(r.usage.input_tokens + r.usage.output_tokens for r in responses)
    micros = sum(cost_of(r.usage, profile)[0] for r in responses)
    assert tokens > 0 and micros > 0
    assert (item.tokens, item.cost_micros) == (child.total_tokens, child.total_cost_micros) == (tokens, micros)
    # ... and the report prints those figures on the item's row.
    report = demo.out[demo.out.index("Todo list of ") :]
    row = next(line for line in report.splitlines() if line.startswith("  [x]  Collect the sales figures"))
    assert row.split()[-3:] == [item.subtask_id, str(tokens), format_usd(micros)], row


def test_the_output_shows_the_profile_the_plan_the_call_and_its_result(demo: DemoRun) -> None:
    out = demo.out
    assert DEMO_PROFILES_TOML.splitlines()[-1] in out  # tools = ["coordinator.local.example_tools:sales_total"]
    plan_shown = out[out.index("carries out this plan") : out.index("Root agent ")]
    assert re.search(
        r'\[ \] Collect the sales figures for Q3 with sales_total\(path="[^"]+sales-q3\.csv"\)', plan_shown
    )
    follow = out[out.index("Root agent ") : out.index("The first item's child ")]
    # The final tree counts the child's call (the live line naming it shows only if a redraw catches it).
    assert re.search(r"^\|       tools: sales_total 1 call \d+\.\d\d s$", follow, re.M), follow
    shown = out[out.index("The first item's child ") : out.index("Todo list of ")]
    assert re.search(r"^  tool +sales_total\(\{\"path\": ", shown, re.M), shown
    for figure in _expected_figures():
        assert figure in shown, (figure, shown)


# -- the planner's convention, without workers -------------------------------------------


def _items(plan: str) -> list[PlanItem]:
    return [PlanItem(id=i.id, content=i.content, status=i.status, linked=False) for i in parse_markdown(plan)]


def test_an_item_ending_with_a_call_of_a_tool_of_the_task_goes_to_a_child_that_makes_the_call() -> None:
    plan = _items('[ ] Total it with sales_total(path="/data/q3.csv")\n[ ] Summarise')
    step = next_step(plan, "Report", None, tools=["update_todo_list", "sales_total"])
    assert step is not None and step.tool_calls[0][0] == "run_subagents"
    caller, leaf = step.tool_calls[0][1]["tasks"]
    assert caller["message"] == 'Total it with sales_total(path="/data/q3.csv")'  # no script: it plans the call
    assert parse_script(caller["message"]) is None and parse_script(leaf["message"]) is not None
    # The same item where the task has no such tool is an ordinary leaf.
    other = next_step(plan, "Report", None, tools=["update_todo_list"])
    assert other is not None and parse_script(other.tool_calls[0][1]["tasks"][0]["message"]) is not None


def test_the_child_calls_the_tool_then_replies_with_its_result_or_stops_on_an_error() -> None:
    message, tools = 'Total it with sales_total(path="/data/q3.csv")', ["sales_total"]
    first = next_step([], message, None, tools)
    assert first is not None and first.tool_calls == [("sales_total", {"path": "/data/q3.csv"})]
    done = next_step([], message, "12 orders, $14,942.00 in total", tools)
    assert done is not None and done.reply == "Done: sales_total returned 12 orders, $14,942.00 in total"
    failed = next_step([], message, "Error: FileNotFoundError: /data/q3.csv", tools)
    assert failed is not None and failed.reply == "Stopped: Error: FileNotFoundError: /data/q3.csv"
    assert next_step([], message, None, ["other_tool"]) is None  # not a tool of this task: the default reply


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('Total with sales_total(path="a.csv")', ("sales_total", {"path": "a.csv"})),
        ("f(n=3, tags=['a', 'b'], on=True, x=None)", ("f", {"n": 3, "tags": ["a", "b"], "on": True, "x": None})),
        ('sales_total(path="a (old).csv")  ', ("sales_total", {"path": "a (old).csv"})),
        ("f()", ("f", {})),
        ('sales_total("a.csv")', None),  # positional: the convention takes keyword arguments only
        ("f(n=open('x'))", None),  # not a literal: never run
        ("f(n=1).g(m=2)", None),
        ("f(n=1) + f(n=2)", ("f", {"n": 2})),  # the call that ends the line
        ("f(**{'n': 1})", None),
        ("f(n={1, 2})", None),  # a set is not JSON
        ("f(n=1e999)", None),  # nor is infinity
        ('sales_total(path="a.csv") later', None),  # the call must end the line
        ('unknown(path="a.csv")', None),  # not a tool of the task
    ],
)
def test_a_call_is_keyword_literals_of_a_tool_of_the_task_at_the_end_of_the_line(
    line: str, expected: tuple[str, dict[str, object]] | None
) -> None:
    assert tool_call(line, {"sales_total", "f"}) == expected


def test_the_demo_plan_names_the_tool_its_profile_offers() -> None:
    profile = Profile.model_validate(tomllib.loads(DEMO_PROFILES_TOML)["profiles"][DEMO_PROFILE])
    assert profile.model == "offline" and profile.tools == ["coordinator.local.example_tools:sales_total"]
    first = parse_markdown(DEMO_PLAN.replace("{sales_csv}", '"x.csv"'))[0].content
    assert tool_call(first, {"sales_total"}) == ("sales_total", {"path": "x.csv"})


def _answer(history: list[ModelMessage]) -> ModelResponse:
    """The offline model's answer to `history`, for a task that has the tool sales_total."""
    tool = ToolDefinition(name="sales_total", parameters_json_schema={"type": "object", "properties": {}})
    params = ModelRequestParameters(function_tools=[tool])
    return asyncio.run(OfflineModel().request(history, None, params))


def test_the_offline_model_makes_the_call_of_a_tool_it_is_offered_and_reads_the_outcome() -> None:
    asked = ModelRequest(parts=[UserPromptPart('Total it with sales_total(path="q3.csv")')])
    first = _answer([asked])
    assert [(p.tool_name, p.args) for p in first.parts if isinstance(p, ToolCallPart)] == [
        ("sales_total", {"path": "q3.csv"})
    ]
    call = ModelResponse(parts=[ToolCallPart(tool_name="sales_total", args={"path": "q3.csv"}, tool_call_id="c0")])

    def then(content: str, outcome: Literal["success", "denied"] = "success") -> str:
        back = ToolReturnPart(tool_name="sales_total", content=content, tool_call_id="c0", outcome=outcome)
        reply = _answer([asked, call, ModelRequest(parts=[back])])
        return "".join(p.content for p in reply.parts if isinstance(p, TextPart))

    assert then("2 orders, $3.00 in total") == "Done: sales_total returned 2 orders, $3.00 in total"
    assert then("not this file", "denied") == "Stopped: Error: sales_total was denied: not this file"
    denied = 'Denied by policy: sales_total {"path": "q3.csv"} is not allowed for this task.'
    assert then(denied) == f"Stopped: {denied}"
    # A task that is not offered the tool gets the default reply, and makes no call.
    plain = asyncio.run(OfflineModel().request([asked], None, ModelRequestParameters()))
    assert [type(p) for p in plain.parts] == [TextPart]


# -- the tool ---------------------------------------------------------------------------


def test_sales_total_sums_the_csv_by_region(tmp_path: Path) -> None:
    data = tmp_path / "sales.csv"
    data.write_text(DEMO_SALES_CSV, encoding="utf-8")
    assert sales_total(str(data)) == (
        "12 orders, $14,942.00 in total: North $5,246.00 (4 orders), South $4,320.60 (4 orders), "
        "West $5,375.40 (4 orders)"
    )
    data.write_text("region,amount\nEast,1.50\nEast,-0.25\n", encoding="utf-8")
    assert sales_total(str(data)) == "2 orders, $1.25 in total: East $1.25 (2 orders)"
    data.write_text("region,amount\n", encoding="utf-8")
    assert sales_total(str(data)) == "0 orders, $0.00 in total"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("region,total\nEast,1\n", "no amount column in its header row"),
        ("region,amount\nEast,12x\n", "line 2: amount '12x' is not a number"),
        ("region,amount\nEast,NaN\n", "line 2: amount 'NaN' is not a number"),
    ],
)
def test_sales_total_names_what_is_wrong_with_a_file(tmp_path: Path, text: str, error: str) -> None:
    data = tmp_path / "sales.csv"
    data.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(error)):
        sales_total(str(data))
