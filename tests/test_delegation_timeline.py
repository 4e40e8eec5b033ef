"""The mark a delegation commit writes on a caller's task (`wait:children`) is hashes.lua's fold, run inside the
commit's own transaction (mark_timeline.lua queued in its MULTI, store/delegation.py), on a real Redis: the fold
is written in Lua alone (issue 43, point 3), and the mark survives a server that forgot every script.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis

from coordinator import Coordinator
from coordinator.store.fields import TaskField
from coordinator.timeline import FOLD_MARKS, MAX_MARKS, Timeline
from tests.agents import agent, reply

# Where the crafted marks start, and how far apart they are (ms): long before the commit's own clock.
FIRST_MARK_MS = 1_764_000_000_000
MARK_STEP_MS = 7
STATES = ("running", "wait:approval")


def _two_children() -> list[dict[str, str]]:
    return [{"description": "x", "message": agent(reply("x"))}, {"description": "y", "message": agent(reply("y"))}]


def test_a_caller_delegation_at_the_bound_is_folded_by_the_lua_fold(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    parent = coord.create_task("a caller's parent", todos="[ ] x\n[ ] y")
    assert parent.runner == "caller"
    # Its timeline holds the bound's marks already: the commit's mark is the one that folds.
    marks = [[FIRST_MARK_MS + n * MARK_STEP_MS, STATES[n % 2]] for n in range(MAX_MARKS)]
    key = coord.store.keys.task(parent.root_id, parent.id)
    coord.client.hset(key, TaskField.TIMELINE, json.dumps({"m": marks}, separators=(",", ":")))
    before_ms = int(time.time() * 1000)
    coord.delegate(parent.id, _two_children())
    stored = Timeline.model_validate(coord.client.hget(key, TaskField.TIMELINE))
    t_ms, state = stored.m[-1]
    assert state == "wait:children" and before_ms - 1 <= t_ms <= int(time.time() * 1000) + 1
    assert (stored.n, stored.t0, len(stored.m)) == (FOLD_MARKS, FIRST_MARK_MS, MAX_MARKS + 1 - FOLD_MARKS)
    assert [list(mark) for mark in stored.m[:-1]] == marks[FOLD_MARKS:]
    # The folded marks' lengths, by state: every interval of the first FOLD_MARKS lasted MARK_STEP_MS.
    assert stored.f == {s: MARK_STEP_MS * FOLD_MARKS // 2 for s in STATES}
    assert coord.get_task(parent.id).waiting_for == "children"


def test_the_mark_is_written_when_the_server_forgot_its_scripts(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    parent = coord.create_task("a caller's parent", todos="[ ] x\n[ ] y")
    coord.client.script_flush()
    coord.delegate(parent.id, _two_children())
    task = coord.get_task(parent.id)
    assert [state for _, state in task.timeline.m][-2:] == ["running", "wait:children"]
    assert task.status == "delegated"


def test_a_script_the_server_forgot_fails_alone_inside_multi(redis_client: redis.Redis) -> None:
    """Why the commit sends its mark by the script's text (Scripts.queue_in): by its SHA, a NOSCRIPT inside MULTI
    fails that command alone at EXEC, and the transaction's other commands commit without it."""
    key = f"test-noscript-in-multi:{uuid.uuid4().hex}"
    try:
        with redis_client.pipeline(transaction=True) as pipe:
            pipe.set(key, "committed")
            pipe.evalsha("0" * 40, 0)
            with pytest.raises(redis.exceptions.NoScriptError):
                pipe.execute()
        assert redis_client.get(key) == "committed"
    finally:
        redis_client.delete(key)
