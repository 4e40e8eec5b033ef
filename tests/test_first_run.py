"""A newcomer's first run: `subq run "…" --todos plan.md --follow` on the offline model, through the console script.

The offline model's planner (workers/runtime/planner.py) carries the plan out:
three items fan out in parallel (one of them nests two steps of its own), a
`Then …` item runs after them, and the run completes with every item checked
and the figures adding up.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from coordinator import Coordinator, Settings, TaskStatus
from tests.helpers import Transport, most_at_once
from tests.test_console_script import script

PLAN = """\
[ ] Collect the sales figures for Q3
[ ] Summarise customer feedback
[ ] Check the figures against the ledger: reconcile the orders; reconcile the refunds
[ ] Then write the executive summary
"""
# "  <task id>  '<description>'  <status>…": one line of the live log each time a task changes.
LOG_LINE = re.compile(r"^  (?P<id>[0-9a-f]{16}(?:-[0-9a-f]{12})?)  '.*'  (?P<status>[a-z_]+)")


def test_a_first_run_fans_the_plan_out_and_checks_every_item(
    coordinator: Coordinator, settings: Settings, transport: Transport, tmp_path: Path
) -> None:
    plan = tmp_path / "plan.md"
    plan.write_text(PLAN)
    env = transport.env(settings)  # on Redis, and through the API as `subq up`'s export line sets it
    run = script("run", "Prepare the Q3 report", "--todos", str(plan), "--follow", env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    root_id = run.stdout.splitlines()[0]

    # The live log: a line each time a task changed, the last of each task of the tree `completed`.
    last_line: dict[str, str] = {}
    for line in run.stdout.split("\n\n")[0].splitlines()[1:]:
        if (seen := LOG_LINE.match(line)) is not None:
            last_line[seen["id"]] = seen["status"]

    tree = json.loads(script("tree", root_id, "--json", env=env).stdout)
    assert tree["status"] == "completed"
    assert [(i["content"], i["status"]) for i in tree["todos"]] == [
        (line[4:], "completed") for line in PLAN.splitlines()
    ]
    assert last_line == dict.fromkeys(_ids(tree), "completed"), run.stdout
    first, second, ledger, summary = tree["children"]
    # The three items ran side by side: each had started before any of them ended, by the order of the
    # tree's event stream (the followed log polls, and a loaded poller can miss a short `running`).
    assert most_at_once(coordinator, root_id, {first["id"], second["id"], ledger["id"]}) == 3
    assert [i["status"] for i in ledger["todos"]] == ["completed", "completed"] and len(ledger["children"]) == 2
    # The sequential step started only after the three before it had ended.
    records = {t: coordinator.get_task(t) for t in (first["id"], second["id"], ledger["id"], summary["id"])}
    started = records[summary["id"]].created_at
    assert all(r.finished_at is not None and r.finished_at <= started for t, r in records.items() if t != summary["id"])
    # The figures add up: each item shows its child's subtree, the root its own and every child's.
    for item, child in zip(tree["todos"], tree["children"], strict=True):
        assert item["subtask_id"] == child["id"]
        assert (item["tokens"], item["cost_micros"]) == (child["total_tokens"], child["total_cost_micros"]) != (0, 0)
    items_micros = sum(i["cost_micros"] for i in tree["todos"])
    assert tree["total_cost_micros"] == tree["cost_micros"] + items_micros + tree["unlinked_cost_micros"]
    assert tree["cost_micros"] > 0, "the root's own planning requests are counted too"
    assert coordinator.get_task(root_id).status == TaskStatus.COMPLETED
    assert "offline" in script("status", root_id, env=env).stdout  # profile offline: never mistaken for a real run


def _ids(node: dict[str, Any]) -> list[str]:
    """The ids of a `subq tree --json` node and of every task below it."""
    return [node["id"], *(i for child in node["children"] for i in _ids(child))]
