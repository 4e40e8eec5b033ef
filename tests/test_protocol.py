"""The step protocol's one table (coordinator/store/protocol.py) against the Lua files it declares.

Every script's header must say, line for line, what the table declares of its KEYS, ARGV and
reply; every KEYS[n] and ARGV[n] its body reads must be declared; and the table's packing must
lay the fields out where the header says. A header edited without the table (or the table
without the header) fails here, before a step sends a key to the wrong place.
"""

from __future__ import annotations

import dataclasses
import re
from importlib import resources
from typing import Any

import pytest

from coordinator.replies import Ending, Stepped
from coordinator.runs import StepState
from coordinator.store import protocol
from coordinator.store.base import ACKNOWLEDGED, _load_script
from coordinator.store.fair import FairShares, fair_args
from coordinator.store.keys import Keys
from coordinator.store.protocol import (
    CALLS,
    EndRun,
    FairKeys,
    FinishTask,
    FlushRun,
    Lead,
    OutboxKeys,
    RecordTool,
    Retry,
    RunKeys,
    StartRun,
    StepWrites,
    Unwatch,
    arg,
    declared_header,
    render_header,
)
from coordinator.timeline import FOLD_MARKS, MAX_MARKS, OUTCOMES

LUA = resources.files("coordinator.store").joinpath("lua")
# The prelude every script is sent with (base.py), not a script of its own.
PRELUDE = "hashes.lua"


def lua_text(script: str) -> str:
    return LUA.joinpath(f"{script}.lua").read_text(encoding="utf-8")


def test_every_lua_file_is_declared_once_and_every_declaration_has_its_file() -> None:
    files = {p.name.removesuffix(".lua") for p in LUA.iterdir() if p.name.endswith(".lua") and p.name != PRELUDE}
    assert files == set(CALLS)
    for call in CALLS.values():
        assert set(call.uses) <= set(CALLS), f"{call.script} uses an undeclared script"


@pytest.mark.parametrize("script", sorted(CALLS))
def test_each_lua_header_says_what_the_table_declares(script: str) -> None:
    assert declared_header(lua_text(script)) == render_header(CALLS[script])


def _declared_range(call: type[protocol.Call[Any]], side: str) -> tuple[int, bool]:
    """How many fixed KEYS or ARGV the call declares, and whether a tail follows them."""
    lines = protocol._layout(call)[0 if side == "KEYS" else 1]
    fixed = max((last for _, last, _ in lines if last is not None), default=0)
    return fixed, any(last is None for _, last, _ in lines)


@pytest.mark.parametrize("script", sorted(CALLS))
def test_each_index_a_script_body_reads_is_declared(script: str) -> None:
    text = lua_text(script)
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    for side in ("KEYS", "ARGV"):
        fixed, tail = _declared_range(CALLS[script], side)
        used = {int(n) for n in re.findall(rf"\b{side}\[(\d+)\]", body)}
        beyond = sorted(n for n in used if n > fixed)
        assert tail or not beyond, f"{script}.lua reads {side}{beyond}, beyond the {fixed} declared"


def test_a_changed_header_line_fails_the_check() -> None:
    text = lua_text("end_run")
    assert declared_header(text) == render_header(EndRun)
    renamed = text.replace("-- KEYS[7] the due list", "-- KEYS[7] the due set", 1)
    moved = text.replace("-- ARGV[12] int: per-parent limit", "-- ARGV[13] int: per-parent limit", 1)
    dropped = text.replace("-- ARGV[16] int: how many waiting tasks to look at\n", "", 1)
    for changed in (renamed, moved, dropped):
        assert changed != text
        assert declared_header(changed) != render_header(EndRun)


def test_a_changed_table_fails_the_check() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class LeadWithMore(Lead):
        also: int = arg("one argument more")

    LeadWithMore.returns = Lead.returns
    assert declared_header(lua_text("lead")) == render_header(Lead)
    assert declared_header(lua_text("lead")) != render_header(LeadWithMore)


def test_acknowledged_scripts_are_those_the_table_marks() -> None:
    assert {name for name, call in CALLS.items() if call.acknowledged} == ACKNOWLEDGED
    assert "end_run" in ACKNOWLEDGED and "flush_run" not in ACKNOWLEDGED


def _run_keys(task: str) -> RunKeys:
    return RunKeys(
        lease=f"lease:{task}", task=f"task:{task}", conversation="conv", ui_messages="ui", live="live",
        events="events",
    )  # fmt: skip


_OUTBOX = OutboxKeys(hooks="hooks", outbox="outbox", pending="pending")


def _writes() -> StepWrites:
    return StepWrites(
        live="{}", conversation=["m1", "m2"], ui_messages=["u1"],
        usage=[("req-1", 10, 5, 0, 0, 123, "provider")], marks=[(1000, "running")],
    )  # fmt: skip


def _end_run(fair_on: bool, output: str = "", invalid_outputs: int = 0) -> EndRun:
    """An end_run call with every field set, fair shares on or off."""
    return EndRun(
        run=_run_keys("t"), due="due", parent="p", todos="todos", awaiting="await", batch="b", parent_ui="pui",
        lines="lines", running="running", admission="adm", parent_running="prun", outbox=_OUTBOX,
        fair=FairKeys(wanting="want", policies="pol", holding="hold", capacity="cap"), ancestors=["task:p", "task:root"],
        token="tok", retention_s=60, now=1.5, events_maxlen=100, status="completed", summary="s", error="",
        error_class="", resume_grace_s=2.0, stop_on_budget=1, free_slot=0, per_parent=3, per_tree=9,
        task_prefix="pre:", running_children_prefix="rc:", admission_scan=50, kept=output,
        invalid_outputs=invalid_outputs, budget_warn_at=0.8,
        fair_args=fair_args(Keys("p"), FairShares(on=fair_on, capacity=16)), writes=_writes(),
    )  # fmt: skip


def test_end_run_packs_its_keys_and_arguments_where_its_header_says() -> None:
    call = _end_run(fair_on=True, output='{"total":3}', invalid_outputs=2)
    keys, args = call.pack()
    assert keys[:2] == ["lease:t", "task:t"] and keys[6] == "due" and keys[15] == "prun"  # KEYS[1], [2], [7], [16]
    assert keys[16:19] == ["hooks", "outbox", "pending"]  # KEYS[17..19]: the tree's outbox
    assert keys[19:23] == ["want", "pol", "hold", "cap"]  # KEYS[20..23]: fair shares' fleet-wide keys
    assert keys[23:] == ["task:p", "task:root"]  # KEYS[24..]: the ancestors
    assert args[0] == "tok" and args[15] == 50  # ARGV[1], ARGV[16]
    assert args[16:18] == ['{"total":3}', 2]  # ARGV[17], ARGV[18]: the typed task's output, its invalid answers
    assert args[18] == 0.8  # ARGV[19]: the budget's warning share
    # ARGV[20..31]: how fair shares are read (on, the tenant keys' head and tails, ...).
    assert args[19:22] == [1, "p:tenant:{", "}:running"] and args[27] == 16  # ARGV[28]: the capacity
    # ARGV[32..]: flush_run's from its seventh: live, the three counts, then each tail laid out flat.
    assert args[31:35] == ["{}", 2, 1, 1]
    assert args[35:] == ["m1", "m2", "u1", "req-1", 10, 5, 0, 0, 123, "provider", 1000, "running"]


def test_with_fair_shares_off_a_runs_start_and_end_leave_their_keys_and_arguments_off() -> None:
    # Only `on` (0) is sent: each key or argument costs the server a call's work, and neither script reads them
    # then. end_run.lua finds the ancestors at KEYS[20..] and flush_run's ARGV from ARGV[21].
    fair = FairKeys(wanting="want", policies="pol", holding="hold", capacity="cap")
    end = _end_run(fair_on=False)
    keys, args = end.pack()
    assert keys[16:19] == ["hooks", "outbox", "pending"] and keys[19:] == ["task:p", "task:root"]
    assert args[18:20] == [0.8, 0]  # ARGV[19], ARGV[20]: fair shares off
    assert args[20:24] == ["{}", 2, 1, 1]  # ARGV[21..]: flush_run's from its seventh
    start = StartRun(
        task="task:t", lease="lease:t", due="due", live="live", events="ev", ui_messages="ui",
        running="running", admission="adm", last_start="last", fair=fair, token="tok", lease_s=15, look_at=2.0,
        now=1.0, events_maxlen=100, task_prefix="pre:", per_parent=0, per_tree=0, stagger_ms=0, now_ms=1000,
        retention_s=60, running_children_prefix="rc:", approval_prefix="ap:",
        fair_args=fair_args(Keys("p"), FairShares(on=False)),
    )  # fmt: skip
    keys, args = start.pack()
    assert len(keys) == 9 and args[12:] == ["ap:", 0]  # KEYS[1..9], ARGV[14]: fair shares off, nothing after it


def test_a_spliced_call_packs_as_the_script_it_calls_reads_it() -> None:
    flush = FlushRun(
        run=_run_keys("t"), outbox=_OUTBOX, ancestors=["task:p"], token="tok", retention_s=60, now=1.5,
        events_maxlen=100, by_end_run=0, budget_warn_at=0.8, writes=_writes(),
    )  # fmt: skip
    tool = RecordTool(
        results="results", tool_call_id="c1", result="", outcome_field="tool:x:ok", ms_field="tool:x:ms", ms=7,
        flush=flush,
    )  # fmt: skip
    flush_keys, flush_args = flush.pack()
    keys, args = tool.pack()
    # record_tool.lua hands flush_run its KEYS[2..] and ARGV[6..].
    assert keys == ["results", *flush_keys] and args[5:] == flush_args
    # flush_run.lua hands record_usage its task, the outbox (KEYS[7..9]) and the ancestors (KEYS[10..]).
    assert flush_keys[6:] == ["hooks", "outbox", "pending", "task:p"] and flush_args[5:7] == [0.8, "{}"]


def test_a_script_is_sent_with_what_the_scripts_it_uses_use_defined_first() -> None:
    # base.py defines each used script as a local function in the order of `uses`: one that calls another
    # (record_usage calls outbox_add) must come after it, or Lua reads an undefined global.
    for call in CALLS.values():
        for at, used in enumerate(call.uses):
            before = call.uses[:at]
            missing = [inner for inner in CALLS[used].uses if inner not in before]
            assert not missing, f"{call.script}: {used} uses {missing}, not defined before it"


def test_counts_are_packed_from_their_tails_and_groups_laid_out_flat() -> None:
    call = Retry(
        due="due", live="live", events="events",
        task_keys=[("t1", "u1", "l1", "c1"), ("t2", "u2", "l2", "c2")], batch_keys=[("b", "bl", "p", "pa", "pt")],
        now=1.0, look_at=2.0, pace_s=0.01, retention_s=60, events_maxlen=100,
        tasks=[("t1", "run", 0, 0, 0), ("t2", "wait", 1, 3, 4)], batches=[("b", "closed", "p")],
    )  # fmt: skip
    keys, args = call.pack()
    assert keys == ["due", "live", "events", "t1", "u1", "l1", "c1", "t2", "u2", "l2", "c2", "b", "bl", "p", "pa", "pt"]
    assert args[5:7] == [2, 1]  # ARGV[6], ARGV[7]: the counts
    assert args[7:] == ["t1", "run", 0, 0, 0, "t2", "wait", 1, 3, 4, "b", "closed", "p"]
    unwatch = Unwatch(due="due", tasks=[("l1", "t1")], while_status="", task_ids=["a"])
    assert unwatch.pack() == (["due", "l1", "t1"], ["", "a"])


def test_an_optional_argument_left_unset_is_left_off_argv() -> None:
    base: dict[str, Any] = dict(
        task="t", events="e", live="l", outbox=_OUTBOX, status="failed", summary="", error="x", error_class="", now=1.0,
        retention_s=60, events_maxlen=100,
    )  # fmt: skip
    assert len(FinishTask(**base).pack()[1]) == 7
    assert FinishTask(**base, live_status="{}").pack()[1][-1] == "{}"


def test_typed_replies() -> None:
    assert EndRun.decode(["fenced"]).kind == "fenced"
    ended = EndRun.decode(
        ["ended", "completed", "s", "", "", 10, 5, 1, 2, 300, 1, 2, 1, "parallel", ["t9"], 0],
    )
    assert (ended.usage.tokens_in, ended.cost_micros, ended.closed, ended.resumes, ended.resume) == (
        10,
        300,
        True,
        2,
        True,
    )
    assert ended.admitted == ["t9"] and not ended.refused_spend
    exhausted = EndRun.decode(["exhausted", "root", 1])
    assert (exhausted.kind, exhausted.holder, exhausted.refused_spend) == ("exhausted", "root", True)
    assert FlushRun.decode([0]) == Stepped(False, "", None)
    assert FlushRun.decode([1, "active", "root", 0, 0]) == Stepped(True, "active", "root")
    assert FlushRun.decode([1, "cancelled", "", 0, 1]) == Stepped(True, "cancelled", None, refused_spend=True)


# -- a run's one state of "what the last step already did", updated by each step's typed reply ------


def test_a_runs_step_state_follows_each_reply() -> None:
    state = StepState.started("active", exhausted="holder")
    assert state.announced and state.take_checks() == Stepped(True, "active", "holder")
    assert state.take_checks() is None, "the start's checks serve the first request only"

    state.responded()
    assert state.response_unwritten and state.take_checks() is None
    state.stepped(Stepped(True, "active", None), keep=True)  # the step that kept a tool call's result
    assert not state.response_unwritten
    state.wrote_own_state()
    assert state.take_checks() is None, "a tool of subq's own wrote state: the next request writes a step"
    state.checked()
    assert state.take_checks() == Stepped(True, "active", None)

    state.stepped(Stepped(True, "cancelled", None), keep=False)  # a flush's checks are not kept
    assert state.take_checks() is None and not state.fenced
    state.stepped(Stepped(False, "", None), keep=True)
    assert state.fenced and state.take_checks() is None

    ended = StepState()
    ended.ended(Ending("ended"))
    assert not ended.fenced
    ended.ended(Ending("fenced"))
    assert ended.fenced


def test_the_lua_timeline_fold_takes_its_bound_and_outcomes_from_python() -> None:
    prelude = _load_script("lead.lua")
    assert f"local TIMELINE_MAX, TIMELINE_FOLD = {MAX_MARKS}, {FOLD_MARKS}\n" in prelude
    assert "local ENDED = {" + ", ".join(f"{o} = true" for o in OUTCOMES) + "}\n" in prelude
    assert "{MAX_MARKS}" not in prelude and "{OUTCOMES}" not in prelude
