"""Cost truth with real workers: random agent trees that rewrite their plans, and every plan adds up.

Sixty agents, each from a seeded random script, run at once on the session's
worker processes (the offline model plays the scripts): each plans, fans out
children (some fail, some delegate a grandchild in turn), rewrites its plan
while or after they run (drops, duplicates, rewords, reorders lines), may
delegate again, and completes. Once every tree has settled, for every task:
Σ row cost + unlinked cost == total − own, and the same for tokens, so no
child's spend is off the plan or on it twice. (The in-process property suite,
tests/test_cost_properties.py, covers hundreds more trees and every step.)
"""

from __future__ import annotations

import random
from typing import Any

from coordinator import Coordinator
from tests.agents import USAGE, agent, call, reply

TREES = 60
SEED = 20261122
LINES = ["Collect figures", "Summarise", "Write it up", "Review", "Ünïcode ✓", "Collect figures"]


def _plan(rng: random.Random) -> list[str]:
    return [f"[ ] {line}" for line in rng.sample(LINES, rng.randint(2, 4))]


def _rewrite(rng: random.Random, plan: list[str]) -> list[str]:
    lines = list(plan)
    how = rng.choice(["drop", "dup", "reword", "reverse", "flip"])
    k = rng.randrange(len(lines))
    if how == "drop" and len(lines) > 1:
        del lines[k]
    elif how == "dup":
        lines.insert(k, lines[k])
    elif how == "reword":
        lines[k] += " (again)"
    elif how == "reverse":
        lines.reverse()
    else:
        lines[k] = "[x]" + lines[k][3:]
    return lines


def _child(rng: random.Random, n: int) -> dict[str, Any]:
    kind = rng.choice(["reply", "reply", "fail", "nested"])
    if kind == "fail":
        steps = [{"fail": "the provider refused", "usage": USAGE}]
    elif kind == "nested":
        grandchild = {"description": f"grandchild of {n}", "message": agent(reply("deep done"))}
        steps = [call("update_todo_list", todos="[ ] go deeper"), call("new_task", **grandchild), reply("nested done")]
    else:
        steps = [reply(f"child {n} done")]
    return {"description": f"child {n}", "message": agent(*steps, text=f"Child {n}.")}


def random_root(rng: random.Random) -> str:
    plan = _plan(rng)
    steps = [call("update_todo_list", todos="\n".join(plan))]
    steps.append(call("run_subagents", tasks=[_child(rng, n) for n in range(rng.randint(1, 3))]))
    plan = _rewrite(rng, plan)
    steps.append(call("update_todo_list", todos="\n".join(plan)))
    if rng.random() < 0.5:
        steps.append(call("run_subagents", tasks=[_child(rng, 10 + n) for n in range(rng.randint(1, 2))]))
        steps.append(call("update_todo_list", todos="\n".join(_rewrite(rng, plan))))
    steps.append(call("attempt_completion", result="done"))
    return agent(*steps, text="A random plan.")


def test_random_agent_trees_always_add_up(coordinator: Coordinator) -> None:
    rng = random.Random(SEED)
    roots = [coordinator.create_task(random_root(rng), run=True).id for _ in range(TREES)]
    for root in roots:
        coordinator.wait(root, 120)
    checked = 0
    for root in roots:
        for record in coordinator.store.records.get_records(coordinator.store.records.tree_task_ids(root)):
            record = coordinator.get_task(record.id)
            rows = coordinator.store.records.get_todos(record.id)
            assert not record.awaiting_ids, record.id
            cost = sum(r.cost_micros for r in rows) + record.unlinked_cost_micros
            tokens = sum(r.tokens for r in rows) + record.unlinked_tokens
            assert cost == record.total_cost_micros - record.cost_micros, (record.id, rows, record.unlinked_cost_micros)
            assert tokens == record.total_tokens - record.tokens_in - record.tokens_out, (record.id, rows)
            checked += 1
    assert checked > 3 * TREES, "the trees had children"
