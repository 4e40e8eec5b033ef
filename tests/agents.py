"""Scripts for offline agents that plan, delegate and complete (tests of the agent runtime)."""

from __future__ import annotations

from typing import Any

from tests.helpers import script

USAGE = {"input": 1000, "output": 500, "cache_write": 2000, "cache_read": 10_000}
STEP_TOKENS = 13_500
STEP_COST_MICROS = 21_000


def call(name: str, **args: Any) -> dict[str, Any]:
    """A scripted model response that calls one tool, with the standard usage."""
    return {"tool_calls": [{"name": name, "args": args}], "usage": USAGE}


def calls(*pairs: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"tool_calls": [{"name": n, "args": a} for n, a in pairs], "usage": USAGE}


def reply(text: str) -> dict[str, Any]:
    return {"reply": text, "usage": USAGE}


def agent(*steps: dict[str, Any], text: str = "Do the task.") -> str:
    return script(*steps, text=text)


def subtask(description: str, *steps: dict[str, Any], todo_id: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"description": description, "message": agent(*steps, text=description)}
    if todo_id:
        spec["todo_id"] = todo_id
    return spec


# The acceptance tree of `tree_root`: the root, three children, two nested; eleven model requests.
TREE_TASKS = 6
TREE_REQUESTS = 11


def tree_root() -> str:
    """The root of the acceptance tree: plan, fan out three, child 2 nests two in turn, complete."""
    child2 = subtask(
        "B",
        call("new_task", **subtask("B1", reply("B1 done"))),
        call("new_task", **subtask("B2", reply("B2 done"))),
        reply("B done"),
    )
    return agent(
        call("update_todo_list", todos="[ ] A\n[ ] B\n[ ] C"),
        call("run_subagents", tasks=[subtask("A", reply("A done")), child2, subtask("C", reply("C done"))]),
        call("update_todo_list", todos="[x] A\n[x] B\n[x] C"),
        call("attempt_completion", result="Report ready"),
        text="Prepare the report.",
    )
