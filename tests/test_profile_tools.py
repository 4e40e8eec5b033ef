"""A profile's own tools (workers/runtime/profile_tools.py): checked at a worker's start, offered, guarded.

The checks run on the profiles as a worker reads them; the runs go through real
worker processes that import `tests.tool_kit` by path, as a deployment's
workers import its tools.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest

from coordinator import ConfigError, Coordinator, Profile, RunCommand, Settings, TaskRecord, TaskStatus
from coordinator.local.fleet import WorkerFleet
from coordinator.settings import ToolLimit
from coordinator.tree import render_tree
from tests.agents import STEP_COST_MICROS, agent, call, calls, reply, subtask
from tests.conftest import dedicated_fleet
from tests.event_tap import EventTap
from tests.helpers import HostLag, assert_worker_refuses, eventually, processes_with, subq_tools
from workers import observe
from workers.runtime.profile_tools import answer_without_running, load_profile
from workers.runtime.thread_holds import HoldingExecutor, SlotHold, holding

ROOT = Path(__file__).resolve().parent.parent
TOOLED = Profile(tools=["tests.tool_kit:add_numbers", "tests.tool_kit:kit", "tests.tool_kit:leave_mark"])
# Every call of leave_mark waits for a human; shout is not offered at all.
GUARDED = TOOLED.model_copy(update={"approval_tools": ["leave_*"], "disallowed_tools": ["shout"]})
LEAF = TOOLED.model_copy(update={"allowed_tools": ["add_*"]})


def _settings(settings: Settings, **profiles: Profile) -> Settings:
    return settings.model_copy(update={"profiles": {**settings.profiles, **profiles}})


def test_a_profile_offers_its_tools_with_their_sources(settings: Settings) -> None:
    own = _settings(settings, tooled=TOOLED, guarded=GUARDED, leaf=LEAF)
    assert load_profile("tooled", own).sources == {
        "update_todo_list": "subq",
        "new_task": "subq",
        "run_subagents": "subq",
        "add_numbers": "tests.tool_kit:add_numbers",
        "shout": "tests.tool_kit:kit",
        "leave_mark": "tests.tool_kit:leave_mark",
    }, "run_command is offered only where the profile enables it"
    assert "shout" not in load_profile("guarded", own).sources
    assert set(load_profile("leaf", own).sources) == {"add_numbers"}, "a leaf can drop the orchestration tools"
    assert load_profile("leaf", own).names == {"add_numbers", "attempt_completion"}


BAD_ENTRIES = [
    ("tests.nowhere:tool", "tools entry 'tests.nowhere:tool': cannot import tests.nowhere: ModuleNotFoundError"),
    ("tests.tool_kit:missing", "tools entry 'tests.tool_kit:missing': tests.tool_kit has no attribute 'missing'"),
    ("tests.tool_kit:NOT_A_TOOL", "is a int, neither a function nor a pydantic-ai FunctionToolset"),
    ("tests.tool_kit:update_todo_list", "its tool 'update_todo_list' has the same name as a tool of subq's own"),
]


@pytest.mark.parametrize(("entry", "why"), BAD_ENTRIES, ids=[e for e, _ in BAD_ENTRIES])
def test_a_bad_entry_is_one_line_naming_the_profile_and_the_entry(settings: Settings, entry: str, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_profile("bad", _settings(settings, bad=Profile(tools=[entry])))
    assert str(caught.value).startswith("Invalid profile 'bad': ") and why in str(caught.value)
    assert "\n" not in str(caught.value)


def test_two_tools_of_one_name_name_both(settings: Settings) -> None:
    twice = Profile(tools=["tests.tool_kit:add_numbers", "tests.tool_kit:kit", "tests.tool_kit:add_numbers"])
    with pytest.raises(ConfigError, match=r"'tests.tool_kit:add_numbers': its tool 'add_numbers' has the same "
                       r"name as a tool of 'tests.tool_kit:add_numbers'"):  # fmt: skip
        load_profile("twice", _settings(settings, twice=twice))


def test_a_profile_with_an_unknown_key_is_refused(settings: Settings) -> None:
    with pytest.raises(ValueError, match="tool_list"):
        Profile.model_validate({"tool_list": ["tests.tool_kit:add_numbers"]})
    with pytest.raises(ValueError, match="tools.0"):
        Profile.model_validate({"tools": ["not an import path"]})


def test_the_worker_and_subq_tools_refuse_a_bad_entry_with_the_same_line(settings: Settings, tmp_path: Path) -> None:
    own = _settings(settings, bad=Profile(tools=["tests.tool_kit:NOT_A_TOOL"]))
    line = (
        "Invalid profile 'bad': tools entry 'tests.tool_kit:NOT_A_TOOL': is a int, neither a function nor a "
        "pydantic-ai FunctionToolset"
    )
    assert_worker_refuses(own, tmp_path, line)


def test_subq_tools_lists_each_profiles_tools(settings: Settings) -> None:
    own = _settings(settings, tooled=TOOLED)
    listed = subq_tools(own, "--profile", "tooled", "--json", through_cli=True)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == {"tooled": load_profile("tooled", own).sources}
    unknown = subq_tools(own, "--profile", "nope")
    # It names every profile this process knows and where each was read from (a child process is given
    # them all in SUBQ_PROFILES).
    known = ", ".join(sorted(own.all_profiles()))
    assert unknown.returncode == 1, "a refusal of subq's own (docs/cli.md): 2 is for malformed arguments"
    line = f"subq: Invalid profile: nope (known: {known} (SUBQ_PROFILES); SUBQ_PROFILES_FILE is not set)\n"
    assert unknown.stderr == line


class Tooled(NamedTuple):
    coord: Coordinator
    marks: Path  # where the tools leave their marks
    fleet: WorkerFleet


@pytest.fixture(scope="module")
def tooled(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tooled]:
    """A worker whose profiles offer the tool kit; its side effects land in a folder of the test's."""
    marks = tmp_path_factory.mktemp("marks")
    os.environ["TOOL_KIT_MARKS"] = str(marks)  # the worker inherits it (settings_env passes on what is not SUBQ_*)
    # A profile that may run `sleep` without asking: a long tool call that a cancel must stop.
    commander = Profile(run_command=RunCommand(cwd=marks), allow=["run_command:sleep"])
    # run_command enabled, approval_tools naming another tool, and a deny rule: the rule still wins.
    unguarded = Profile(run_command=RunCommand(cwd=marks), approval_tools=["git_commit"], deny=["run_command:rm"])
    # Tools that fail and time out: their calls are results for the model, and the run goes on.
    fragile = Profile(tools=["tests.tool_kit:explode", "tests.tool_kit:journal_kit"], tool_timeouts={"slow_*": 0.5})
    # A tool with a price: each call is the task's own spend.
    priced = TOOLED.model_copy(update={"tool_prices": {"add_*": Decimal("0.25")}})
    # Tools that report their own cost, which wins over a price the profile gives them.
    reporting = Profile(
        tools=["tests.tool_kit:paid_search", "tests.tool_kit:confused_bill"], tool_prices={"paid_*": Decimal("0.25")}
    )
    # Priced calls that do not all run: a denied command, and a tool that asks the model to call again.
    charged = Profile(
        run_command=RunCommand(cwd=marks), allow=["run_command:sleep"], deny=["run_command:rm"],
        tools=["tests.tool_kit:even_only"], tool_prices={"run_command": Decimal("0.01"), "even_only": Decimal("0.25")},
    )  # fmt: skip
    own = _settings(
        settings, tooled=TOOLED, guarded=GUARDED, commander=commander, fragile=fragile, priced=priced,
        reporting=reporting, unguarded=unguarded, charged=charged, tally=Profile(tools=["tests.tool_kit:add_numbers", "tests.tool_kit:explode", "tests.tool_kit:charge_card"]),
    )  # fmt: skip
    try:
        with dedicated_fleet(own, tmp_path_factory.mktemp("tooled"), 1, queue="subq-tools") as (coord, fleet):
            yield Tooled(coord, marks, fleet)
    finally:
        del os.environ["TOOL_KIT_MARKS"]


def _says(coord: Coordinator, task_id: str, kind: str) -> list[str]:
    return [m["text"] for m in coord.messages(task_id) if m.get("say") == kind]


def test_a_subagent_calls_a_profile_tool(tooled: Tooled) -> None:
    coord = tooled.coord
    task = coord.create_task(
        agent(call("add_numbers", a=2, b=40), call("shout", text="done"), reply("42")), profile="tooled", run=True
    )
    done = coord.wait(task.id, 60)
    assert done.status == TaskStatus.COMPLETED
    returns = [json.loads(m) for m in coord.store.records.conversation(task.id)]
    results = [p["content"] for m in returns for p in m.get("parts", []) if p.get("part_kind") == "tool-return"]
    assert results == [42, "DONE"]
    assert _says(coord, task.id, "tool") == ['add_numbers({"a": 2, "b": 40})', 'shout({"text": "done"})']
    use = coord.get_task(task.id).tool_use
    assert {tool: dict(u.outcomes) for tool, u in use.items()} == {"add_numbers": {"ok": 1}, "shout": {"ok": 1}}
    drawn = "\n".join(render_tree(coord.tree(task.id)))
    assert "tools: add_numbers 1 call " in drawn and ", shout 1 call " in drawn, drawn


def test_a_call_to_a_tool_the_task_lacks_is_an_error_never_shown_as_run(tooled: Tooled) -> None:
    coord, marks = tooled.coord, tooled.marks
    before = len(list(marks.iterdir()))
    task = coord.create_task(
        agent(call("shout", text="hi"), call("read_file", path="/etc/passwd"), reply("finished")), profile="guarded",
        run=True,
    )  # fmt: skip
    done = coord.wait(task.id, 60)
    assert done.status == TaskStatus.COMPLETED
    errors = _says(coord, task.id, "error")
    assert [e.split(":")[1].strip() for e in errors] == [
        "shout is not a tool of this task",
        "read_file is not a tool of this task",
    ]
    assert _says(coord, task.id, "tool") == []
    assert len(list(marks.iterdir())) == before


def test_children_delegated_beside_a_call_for_a_person_run_while_it_waits(tooled: Tooled) -> None:
    """One response delegates and calls a tool that needs a decision: the child runs and ends before anyone
    decides (it waited for the decision before), and the parent, resumed by the decision, has both."""
    coord, marks = tooled.coord, tooled.marks
    both = calls(("run_subagents", {"tasks": [subtask("A", reply("A done"))]}), ("leave_mark", {"label": "beside"}))
    task = coord.create_task(agent(both, reply("finished")), profile="guarded", run=True)
    eventually(lambda: coord.list_approvals(task.root_id) != [], "the call waits for a decision", 60)
    (child,) = coord.tree(task.id).children
    assert coord.wait(child.id, 60).status == TaskStatus.COMPLETED, "the child ran while the call waited"
    assert list(marks.glob("beside.*")) == [], "nothing ran before the decision"
    (approval,) = coord.list_approvals(task.root_id)
    coord.decide(approval.id, "approve")
    done = coord.wait(task.id, 60)
    assert done.status == TaskStatus.COMPLETED and done.summary == "finished", done
    assert len(list(marks.glob("beside.*"))) == 1, "the approved call ran once"


def test_any_tool_can_need_a_decision_and_runs_once_approved(tooled: Tooled) -> None:
    coord, marks = tooled.coord, tooled.marks
    task = coord.create_task(
        agent(call("add_numbers", a=1, b=1), call("leave_mark", label="approved"), reply("marked")),
        profile="guarded", run=True,
    )  # fmt: skip
    eventually(lambda: coord.list_approvals(task.root_id) != [], "the call waits for a decision", 60)
    (approval,) = coord.list_approvals(task.root_id)
    assert (approval.tool, approval.args) == ("leave_mark", {"label": "approved"})
    assert list(marks.glob("approved.*")) == [], "nothing ran before the decision"
    coord.decide(approval.id, "approve")
    assert coord.wait(task.id, 60).status == TaskStatus.COMPLETED
    assert len(list(marks.glob("approved.*"))) == 1, "it ran once"


def test_a_denied_call_never_runs(tooled: Tooled) -> None:
    coord, marks = tooled.coord, tooled.marks
    task = coord.create_task(agent(call("leave_mark", label="denied"), reply("gave up")), profile="guarded", run=True)
    eventually(lambda: coord.list_approvals(task.root_id) != [], "the call waits for a decision", 60)
    (approval,) = coord.list_approvals(task.root_id)
    coord.decide(approval.id, "deny", feedback="not today")
    assert coord.wait(task.id, 60).status == TaskStatus.COMPLETED
    assert list(marks.glob("denied.*")) == []


def test_a_deny_rule_wins_where_approval_tools_does_not_name_the_tool(tooled: Tooled) -> None:
    coord, canary = tooled.coord, tooled.marks / "canary"
    canary.write_text("still here")
    steps = (call("run_command", command="rm canary"), call("run_command", command="cat canary"), reply("tried"))
    task = coord.create_task(agent(*steps), profile="unguarded", run=True)
    assert coord.wait(task.id, 60).status == TaskStatus.COMPLETED
    assert canary.read_text() == "still here"
    assert _says(coord, task.id, "command") == ["cat canary"], "rm never ran; what no rule denies runs"
    returns = [p["content"] for m in coord.messages(task.id, kind="api") for p in m["parts"]
               if p.get("part_kind") == "tool-return"]  # fmt: skip
    assert returns[0].startswith("Denied by policy: run_command") and returns[1] == "exit 0\nstill here"
    warned = "warning: profile 'unguarded' enables run_command and nothing guards it"
    assert any(warned in log.read_text(errors="replace") for log in tooled.fleet.logs), "the worker says so at start"


def test_subq_tools_warns_of_an_unguarded_run_command(settings: Settings, tmp_path: Path) -> None:
    open_commands = Profile(run_command=RunCommand(cwd=tmp_path), approval_tools=[])
    listed = subq_tools(
        _settings(settings, builder=open_commands, careful=Profile(run_command=RunCommand(cwd=tmp_path)))
    )
    assert listed.returncode == 0, listed.stderr
    warned = [line for line in listed.stderr.splitlines() if "warning" in line]
    assert warned == [
        "subq: warning: profile 'builder' enables run_command and nothing guards it: every command no deny rule "
        'catches runs without a decision (add "run_command" to approval_tools, with narrow allow rules)'
    ]


def test_a_cancel_stops_a_long_tool_call_and_its_process(tooled: Tooled) -> None:
    coord = tooled.coord
    seconds = "61.73"  # a sleep no other test starts, found by its argument
    task = coord.create_task(
        agent(call("run_command", command=f"sleep {seconds}"), reply("slept")), profile="commander", run=True
    )
    eventually(lambda: processes_with(seconds) != [], "the command is running", 60)
    with HostLag() as lag:
        cancelled_at = time.monotonic()
        coord.cancel(task.id, "no need to wait")
        eventually(lambda: processes_with(seconds) == [], "the command's process is gone", 30, every_s=0.05)
        gone_s = time.monotonic() - cancelled_at
    print(f"the command's process was gone {gone_s:.3f} s after the cancel (the host late by {lag.worst_s:.3f} s)")
    # 1 s is the promise (a stop watch poll is 0.25 s), 2 s with the polls around it on an idle host, plus what
    # the host's load delayed everything by.
    assert gone_s < lag.bound_s(2.0), f"the command ran on for {gone_s:.2f} s after the cancel"
    assert coord.wait(task.id, 30).status == TaskStatus.CANCELLED


def _tool_returns(coord: Coordinator, task_id: str) -> dict[str, object]:
    return {
        part["tool_name"]: part["content"]
        for message in coord.store.records.conversation(task_id)
        for part in json.loads(message).get("parts", [])
        if part.get("part_kind") == "tool-return"
    }


def test_a_failing_or_slow_tool_is_a_result_and_the_run_goes_on(tooled: Tooled) -> None:
    coord, marks = tooled.coord, tooled.marks
    task = coord.create_task(
        agent(call("explode", reason="disk full"), call("slow_mark", label="late", seconds=3), reply("carried on")),
        profile="fragile", run=True,
    )  # fmt: skip
    done = coord.wait(task.id, 60)
    assert done.status == TaskStatus.COMPLETED and done.summary == "carried on"
    assert _tool_returns(coord, task.id) == {
        "explode": "Error: ValueError: disk full",
        "slow_mark": "Error: slow_mark timed out after 0.5 s",
    }
    use = coord.get_task(task.id).tool_use
    assert {tool: dict(u.outcomes) for tool, u in use.items()} == {"explode": {"error": 1}, "slow_mark": {"timeout": 1}}
    assert _says(coord, task.id, "tool_error") == [
        "explode: Error: ValueError: disk full",
        "Error: slow_mark timed out after 0.5 s",
    ]
    time.sleep(3)
    assert list(marks.glob("late.*")) == [], "the timed-out call was stopped, not left to finish"
    log = tooled.fleet.logs[0].read_text(errors="replace")
    assert "subq: tool explode failed" in log and "ValueError: disk full" in log, "the traceback is in the log"


def test_a_fleet_wide_tool_limit_holds_across_processes(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    limited = Profile(tools=["tests.tool_kit:crowd"], tool_limits={"cro*": ToolLimit(concurrency=2)})
    own = _settings(settings, limited=limited)
    monkeypatch.setenv("TOOL_KIT_MARKS", str(marks))  # the workers inherit it
    with dedicated_fleet(own, tmp_path / "fleet", 2, queue="subq-tool-limits") as (coord, _fleet):
        root = coord.create_task("ten at once", todos="\n".join(f"[ ] crowd {n}" for n in range(10)))
        child = {"message": agent(call("crowd", seconds=0.4), reply("done")), "profile": "limited"}
        batch = coord.delegate(root.id, [{**child, "description": f"crowd {n}"} for n in range(10)])
        for child_id in batch.child_ids:
            assert coord.wait(child_id, 90).status == TaskStatus.COMPLETED
        waited = [c for c in batch.child_ids if _says(coord, c, "tool_waiting")]
    at_once = [int(line) for line in (marks / "crowd.log").read_text().split()]
    assert len(at_once) == 10, "every call ran, once"
    assert max(at_once) == 2, f"never more than 2 at once across the fleet, and the limit was used: {at_once}"
    assert waited, "calls over the limit waited, and said so"


def test_a_slot_hold_is_freed_once_its_call_and_every_thread_it_started_have_ended() -> None:
    freed: list[str] = []
    hold = SlotHold(lambda: freed.append("slot"))
    gate = threading.Event()
    with HoldingExecutor(2) as pool:
        with holding(hold):
            pool.submit(gate.wait, 10)
            pool.submit(lambda: None).result()
        unheld = pool.submit(gate.wait, 10)  # started outside any call's hold
        assert freed == [], "the call has ended, one of its threads runs on"
        gate.set()
        unheld.result()
    assert freed == ["slot"], "freed once, by its last thread"
    alone = SlotHold(lambda: freed.append("alone"))
    with holding(alone):
        pass
    assert freed == ["slot", "alone"], "a call that started no thread frees its slot as it ends"


def test_a_timed_out_calls_thread_keeps_its_tool_slot_until_it_returns(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain function's call times out, and its run goes on, but its thread runs on (Python cannot stop it): it
    keeps the call's fleet-wide slot until it returns, so the next call of the tool waits for it. Before, the
    timeout freed the slot and a second call ran beside the first's thread, past the limit of one."""
    marks = tmp_path / "marks"
    marks.mkdir()
    limited = Profile(
        tools=["tests.tool_kit:crowd_in_a_thread"], tool_limits={"crowd*": ToolLimit(concurrency=1)},
        tool_timeouts={"crowd*": 0.3},
    )  # fmt: skip
    own = _settings(settings, limited=limited)
    monkeypatch.setenv("TOOL_KIT_MARKS", str(marks))  # the workers inherit it
    with dedicated_fleet(own, tmp_path / "fleet", 1, queue="subq-thread-slots", worker_concurrency=2) as (coord, _):
        root = coord.create_task("two at once", todos="[ ] one\n[ ] two")
        child = {"message": agent(call("crowd_in_a_thread", seconds=1.5), reply("done")), "profile": "limited"}
        batch = coord.delegate(root.id, [{**child, "description": d} for d in ("one", "two")])
        children = [coord.wait(child_id, 90) for child_id in batch.child_ids]
        eventually(lambda: not list((marks / "crowd").iterdir()), "the threads to return", 30)
    assert [c.tool_use["crowd_in_a_thread"].outcomes for c in children] == [{"timeout": 1}] * 2
    at_once = [int(line) for line in (marks / "crowd.log").read_text().split()]
    assert at_once == [1, 1], f"the second call started beside the first's thread: {at_once}"


def _one_child_on_an_item(coord: Coordinator, item: str, profile: str, message: str) -> tuple[TaskRecord, str]:
    """A parent whose one plan item is delegated to a child of `profile` running `message`."""
    parent = coord.create_task(f"carry out {item}", todos=f"[ ] {item}")
    (todo,) = coord.get_todos(parent.id)
    spec = {"description": item, "todo_id": todo.id, "profile": profile, "message": message}
    (child_id,) = coord.delegate(parent.id, [spec]).child_ids
    return parent, child_id


def test_a_tools_price_is_its_tasks_spend_on_the_parents_plan_item(tooled: Tooled) -> None:
    coord = tooled.coord
    message = agent(call("add_numbers", a=1, b=2), call("add_numbers", a=3, b=4), reply("10"))
    parent, child_id = _one_child_on_an_item(coord, "add twice", "priced", message)
    child = coord.wait(child_id, 60)
    assert child.status == TaskStatus.COMPLETED and child.requests == 3, "two calls, no model request of their own"
    assert child.cost_micros == 3 * STEP_COST_MICROS + 2 * 250_000, "three responses and two priced calls"
    assert child.cost_source != "tool:add_numbers", "the source says how the tokens were priced"
    coord.wait(parent.id, 30)
    (item,) = coord.get_todos(parent.id)
    assert item.cost_micros == child.total_cost_micros == child.cost_micros
    assert coord.get_task(parent.id).total_cost_micros == child.cost_micros


def test_a_response_held_for_its_idempotent_call_is_spend_when_a_stop_lands_during_the_call(tooled: Tooled) -> None:
    """A response whose calls are all idempotent is written with its first call's result; a cancel of the tree
    during the call still records it: on the child, on its plan item and on the root's total."""
    coord, marks = tooled.coord, tooled.marks
    label = f"held-{uuid.uuid4().hex[:8]}"
    message = agent(call("linger", label=label, seconds=120), reply("never read"))
    parent, child_id = _one_child_on_an_item(coord, "linger", "fragile", message)
    eventually(lambda: (marks / f"{label}.started").exists(), "the idempotent call has started", 60)
    coord.cancel(parent.id, "stopped during the call")
    child = coord.wait(child_id, 30)
    assert child.status == TaskStatus.CANCELLED
    eventually(lambda: coord.get_task(child_id).requests == 1, "the held response is recorded", 30)
    child = coord.get_task(child_id)
    assert child.cost_micros == child.total_cost_micros == STEP_COST_MICROS, "the provider billed the response"
    (item,) = coord.get_todos(parent.id)
    assert (item.subtask_id, item.cost_micros) == (child_id, STEP_COST_MICROS), "the plan item shows it too"
    assert coord.get_task(parent.id).total_cost_micros == STEP_COST_MICROS


def test_spend_recorded_after_a_stop_reaches_every_level_already_written_back(tooled: Tooled) -> None:
    """Root -> middle -> leaf, the leaf's response held for its idempotent call when the root is cancelled: the
    stop wrote the leaf back onto the middle's item and the middle onto the root's, and both items show the
    leaf's spend."""
    coord, marks = tooled.coord, tooled.marks
    label = f"deep-{uuid.uuid4().hex[:8]}"
    leaf = subtask("leaf", call("linger", label=label, seconds=120), reply("never read"))
    middle = agent(call("new_task", **leaf, profile="fragile"), reply("never read"))
    root, middle_id = _one_child_on_an_item(coord, "delegate deeper", "fragile", middle)
    eventually(lambda: (marks / f"{label}.started").exists(), "the leaf's idempotent call has started", 60)
    coord.cancel(root.id, "stopped during the call")
    (leaf_id,) = coord.get_task(middle_id).child_ids
    eventually(lambda: coord.get_task(leaf_id).requests == 1, "the leaf's held response is recorded", 30)
    leaf_record, middle_record = coord.get_task(leaf_id), coord.get_task(middle_id)
    assert leaf_record.status == middle_record.status == TaskStatus.CANCELLED
    assert leaf_record.total_cost_micros == STEP_COST_MICROS
    (leaf_item,) = coord.get_todos(middle_id)  # new_task puts its child on a row of the middle's plan
    assert (leaf_item.subtask_id, leaf_item.cost_micros) == (leaf_id, STEP_COST_MICROS)
    assert middle_record.total_cost_micros == middle_record.cost_micros + STEP_COST_MICROS == 2 * STEP_COST_MICROS
    (item,) = coord.get_todos(root.id)
    assert (item.subtask_id, item.cost_micros) == (middle_id, middle_record.total_cost_micros)
    assert coord.get_task(root.id).total_cost_micros == 2 * STEP_COST_MICROS
    # The middle's line of the root's combined result says the figures its item shows.
    lines = coord.store.client.hgetall(coord.store.keys.batch_lines(root.id, middle_record.batch_id))
    assert "$0.042000)" in lines[middle_id], lines


def test_a_tool_reports_its_own_cost_and_it_lands_on_the_plan_item(tooled: Tooled) -> None:
    coord = tooled.coord
    message = agent(
        call("paid_search", query="q1"), call("paid_search", query="q2"), call("confused_bill", query="q3"),
        reply("found"),
    )  # fmt: skip
    parent, child_id = _one_child_on_an_item(coord, "search twice", "reporting", message)
    child = coord.wait(child_id, 60)
    assert child.status == TaskStatus.COMPLETED and child.requests == 4
    # Each search said it cost $0.0125 (its reported cost wins over the profile's $0.25); the bad report is no cost.
    assert child.cost_micros == 4 * STEP_COST_MICROS + 2 * 12_500
    assert child.tool_use["confused_bill"].outcomes == {"ok": 1}, "the call with a bad report still returned"
    returns = [
        part["content"]
        for message in coord.store.records.conversation(child_id)
        for part in json.loads(message).get("parts", [])
        if part.get("part_kind") == "tool-return"
    ]
    assert returns == ["results for q1", "results for q2", "billed q3"], "the model reads the value, not the bill"
    coord.wait(parent.id, 30)
    (item,) = coord.get_todos(parent.id)
    assert item.cost_micros == child.total_cost_micros == child.cost_micros
    log = tooled.fleet.logs[0].read_text(encoding="utf-8")
    assert "tool confused_bill reported a cost of '-3', not a non-negative number of USD: not charged" in log


def test_flowers_progress_names_the_tool_calls(tooled: Tooled, settings: Settings) -> None:
    coord = tooled.coord
    with EventTap(settings.require_redis_url()) as tap:
        task = coord.create_task(
            agent(*(call("add_numbers", a=i, b=1) for i in range(6)), call("explode", reason="x"), reply("summed")),
            profile="tally",
            run=True,
        )
        assert coord.wait(task.id, 60).status == TaskStatus.COMPLETED
        progress = eventually(
            lambda: (found := tap.events("task-progress", [task.id])) and found[-1][1]["request"] == 8 and found,
            "the run's last progress event",
        )
    named = [c for _, event in progress for c in event["tool_calls"]]
    assert [(c["tool"], c["outcome"]) for c in named] == [("add_numbers", "ok")] * 6 + [("explode", "error")]
    assert all(isinstance(c["ms"], int) and c["ms"] >= 0 for c in named)
    assert len(progress) < 8, "quick steps share their progress events (at most one each LIVE_EVERY_S)"


def test_a_tool_gets_a_stable_idempotency_key_for_its_call(tooled: Tooled) -> None:
    coord = tooled.coord
    task = coord.create_task(agent(call("charge_card", amount=5), reply("paid")), profile="tally", run=True)
    assert coord.wait(task.id, 60).status == TaskStatus.COMPLETED
    parts = [p for m in coord.store.records.conversation(task.id) for p in json.loads(m).get("parts", [])]
    (call_id,) = [p["tool_call_id"] for p in parts if p.get("part_kind") == "tool-call"]
    (result,) = [p["content"] for p in parts if p.get("part_kind") == "tool-return"]
    assert result == f"charged 5 with key {task.id}:{call_id}"


def test_a_budget_spent_by_tool_calls_stops_the_run_before_its_next_request(tooled: Tooled) -> None:
    """The step that keeps a call's result carries its price and checks the budgets for the next request."""
    coord = tooled.coord
    task = coord.create_task(
        agent(*(call("add_numbers", a=n, b=1) for n in range(4)), reply("summed")),
        profile="priced",
        budget_usd="0.40",
        run=True,
    )
    done = coord.wait(task.id, 60)
    assert done.status == TaskStatus.FAILED and done.error_class == "BudgetExhausted", done
    # Two calls at $0.25 cross $0.40 with their results: no third request is made.
    assert done.requests == 2 and done.tool_use["add_numbers"].calls == 2
    assert done.cost_micros == 2 * STEP_COST_MICROS + 2 * 250_000


def test_a_priced_call_is_charged_when_it_ran_whatever_its_outcome_and_never_when_it_did_not(tooled: Tooled) -> None:
    """A command the policy denied never runs and was charged its price all the same (run_command applies the
    policy itself, after the point the charge was skipped for a denial); a tool that did its work and then asked
    the model to call again (ModelRetry) ran and was not charged."""
    coord = tooled.coord
    calls = [call("run_command", command="rm -rf x"), call("run_command", command="sleep 0"),
             call("even_only", n=1), call("even_only", n=2)]  # fmt: skip
    task = coord.create_task(agent(*calls, reply("done")), profile="charged", run=True)
    done = coord.wait(task.id, 60)
    assert done.status == TaskStatus.COMPLETED, done
    assert {tool: dict(u.outcomes) for tool, u in done.tool_use.items()} == {
        "run_command": {"denied": 1, "ok": 1}, "even_only": {"error": 1, "ok": 1},
    }, done.tool_use  # fmt: skip
    ran = 10_000 + 2 * 250_000  # the command that ran, and both calls of even_only
    assert done.cost_micros == done.requests * STEP_COST_MICROS + ran, (done.cost_micros, done.requests)


def test_a_call_naming_no_tool_of_its_task_is_counted_under_one_label_not_the_models_name() -> None:
    """The name is the model's text: a label per made-up name would grow the series without bound."""
    said: list[str] = []
    recorded: list[str] = []
    run = SimpleNamespace(
        say=lambda kind, line: said.append(line), journal=SimpleNamespace(record=lambda *a: recorded.append(a[1]))
    )
    state = SimpleNamespace(run=run, tool_calls=[], answered=frozenset())
    made_up = f"made_up_{uuid.uuid4().hex}"
    counted = observe.TOOL_CALLS.labels(observe.UNKNOWN_TOOL, "error")
    before = counted._value.get()
    answer_without_running(state, "call-1", made_up, "error", f"not run: {made_up} is not a tool", known=False)  # type: ignore[arg-type]
    assert counted._value.get() == before + 1
    labels = {sample.labels.get("tool") for metric in observe.TOOL_CALLS.collect() for sample in metric.samples}
    assert made_up not in labels
    assert recorded == [made_up] and state.tool_calls == [{"tool": made_up, "outcome": "error", "ms": 0}], (
        "shown as named"
    )
