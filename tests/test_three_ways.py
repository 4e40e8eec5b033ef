"""The same run started three ways (HTTP, the CLI, Celery's send_task by name) gives the same tree.

One scripted root agent (tests/agents.tree_root: three children, one of which
nests two in turn) is started over the HTTP API, with `subq run`, and by a
plain Celery producer that knows only the task name `subq.submit`; the three
trees are compared with their ids left out: the same tasks, statuses, todo
items, and tokens and cost per item and per task.
"""

from __future__ import annotations

from typing import Any

import httpx
from celery import Celery

from coordinator import Coordinator, Settings
from coordinator.tree import TreeNode, build_tree
from tests.agents import STEP_COST_MICROS, tree_root
from tests.test_cli import subq

WAIT_S = 90


def _shape(node: TreeNode) -> dict[str, Any]:
    """The tree without ids: what a user compares between two runs."""
    return {
        "status": node.status.value,
        "description": node.description if node.parent_id else "(root)",
        "own": (node.tokens, node.cost_micros),
        "total": (node.total_tokens, node.total_cost_micros),
        "summary": node.summary,
        "todos": [(t.content, t.status.value, t.tokens, t.cost_micros, t.subtask_id is not None) for t in node.todos],
        "children": [_shape(child) for child in node.children],
    }


def test_http_cli_and_send_task_give_the_same_tree(
    settings: Settings, live: Coordinator, live_http: httpx.Client
) -> None:
    prompt = tree_root()

    over_http = live_http.post("/v1/tasks", json={"prompt": prompt, "run": True})
    assert over_http.status_code == 201, over_http.text
    http_root = over_http.json()["id"]

    env = {
        "SUBQ_REDIS_URL": settings.redis_url or "",
        "SUBQ_KEY_PREFIX": settings.key_prefix,
        "SUBQ_QUEUE": settings.queue,
    }
    from_cli = subq("run", prompt, "--follow", env=env)
    assert from_cli.returncode == 0, from_cli.stderr
    cli_root = from_cli.stdout.splitlines()[0]

    producer = Celery("any-producer", broker=settings.redis_url, backend=settings.redis_url)
    try:
        sent = producer.send_task("subq.submit", kwargs={"prompt": prompt, "run": True}, queue=settings.queue)
        by_name = sent.get(timeout=WAIT_S)
        sent.forget()
    finally:
        producer.close()
    assert set(by_name) == {"task_id"}, by_name

    trees = []
    for root_id in (http_root, cli_root, by_name["task_id"]):
        live.wait(root_id, WAIT_S)
        trees.append(_shape(build_tree(live, root_id)))
    assert trees[0] == trees[1] == trees[2]
    assert trees[0]["status"] == "completed" and trees[0]["total"][1] == 11 * STEP_COST_MICROS
