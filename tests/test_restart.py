"""Nothing lost when a worker dies: redelivery, resume from the persisted conversation, no double count.

The killed-worker test runs its own fleet on a separate Redis database with a
short heartbeat lapse, reconciler tick and grace, so a run lost with its worker
is published again in seconds: its lease lapses and the reconciler finds it
(a run still listed as held by the dead worker's last beat waits for the grace). The
broker does not deliver a run message again (a worker holds its delivery in
memory: workers/run_acks.py), whatever the visibility timeout.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pydantic
import pytest
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, ToolCallPart, UserPromptPart

from coordinator import Coordinator, CorruptError, Settings, TaskStatus
from coordinator.celery_app import make_app
from coordinator.local.fleet import WorkerFleet
from tests.agents import STEP_COST_MICROS, USAGE, agent, call, reply
from tests.conftest import dedicated_fleet
from workers.runtime.context import build_runtime
from workers.runtime.runner import INTERRUPTED, run_child

MESSAGE = pydantic.TypeAdapter(ModelMessage)
# The killed worker's heartbeat lapses after this (a run on a live worker stalled this long would be fenced:
# more than the least, 3 s, for a loaded host), and the reconciler looks every half second.
LAPSE_S = 5


@pytest.fixture(scope="module")
def fragile(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Coordinator, WorkerFleet]]:
    assert settings.redis_url
    with dedicated_fleet(
        settings,
        tmp_path_factory.mktemp("fragile"),
        2,
        redis_url=settings.redis_url.rsplit("/", 1)[0] + "/1",
        queue="subq-kill",
        heartbeat_lapse_s=LAPSE_S,
        reconcile_interval_s=0.5,
        reconcile_grace_s=3,
        worker_concurrency=4,
    ) as fleet_and_coord:
        yield fleet_and_coord


def _worker_running(fleet: WorkerFleet, celery_task_id: str) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for proc, log in zip(fleet.procs, fleet.logs, strict=True):
            if f"subq.run_task[{celery_task_id}] received" in log.read_text(errors="replace"):
                return proc.pid
        time.sleep(0.05)
    raise AssertionError(f"no worker received {celery_task_id}")


def test_a_worker_killed_while_a_child_waits_on_its_model(fragile: tuple[Coordinator, WorkerFleet]) -> None:
    coord, fleet = fragile
    parent = coord.create_task("Three children, one slow", todos="[ ] a\n[ ] b\n[ ] c")
    slow = agent({"reply": "slow done", "usage": USAGE, "latency_ms": 2500})
    batch = coord.delegate(
        parent.id,
        [
            {"description": "quick a", "message": agent(reply("a done"))},
            {"description": "slow b", "message": slow},
            {"description": "quick c", "message": agent(reply("c done"))},
        ],
    )
    slow_id = batch.child_ids[1]
    pid = _worker_running(fleet, slow_id)
    deadline = time.monotonic() + 20
    while not any(m["say"] == "task" for m in coord.messages(slow_id)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the run has started and waits on its (offline) model
    # Only the slow child may be caught by the kill: a quick one killed between recording its
    # request and saving its reply would rightly make (and pay for) that request again.
    quick = [batch.child_ids[0], batch.child_ids[2]]
    while not all(coord.get_task(c).status.terminal for c in quick) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)

    done = coord.wait(parent.id, 60)

    child = coord.get_task(slow_id)
    assert child.status == TaskStatus.COMPLETED and child.summary == "slow done"
    assert coord.store.records.task_field(slow_id, "run_seq") == "2", "the child ran again after the kill"
    assert (child.requests, child.cost_micros) == (1, STEP_COST_MICROS), "the lost request cost nothing twice"
    assert done.status == TaskStatus.ACTIVE
    runs = {
        c.description: (c.requests, c.cost_micros, coord.store.records.task_field(c.id, "run_seq"))
        for c in coord.get_children(parent.id)
    }
    assert done.total_cost_micros == 3 * STEP_COST_MICROS, f"(requests, cost, runs) per child: {runs}"
    todos = coord.get_todos(parent.id)
    assert todos[1].subtask_id == slow_id and todos[1].cost_micros == STEP_COST_MICROS
    assert [m["say"] for m in coord.messages(parent.id)].count("subtask_result") == 1, "the callback closed once"
    assert coord.store.records.task_field(parent.id, "resumes") == "1"


def test_a_tool_call_left_without_result_is_answered_as_interrupted(idle_coordinator: Coordinator) -> None:
    """A run that died between a model response and its tool results resumes with INTERRUPTED."""
    coord = idle_coordinator
    prompt = agent(call("update_todo_list", todos="[ ] never ran"), reply("carried on"))
    task = coord.create_task(prompt, todos="[ ] original", run=True)  # on a queue no worker consumes
    lost = [
        ModelRequest(parts=[UserPromptPart(content=prompt)]),
        ModelResponse(parts=[ToolCallPart(tool_name="update_todo_list", args={"todos": "[ ] x"}, tool_call_id="c1")]),
    ]
    coord.client.rpush(coord.store.keys.conversation(task.id, task.id), *[MESSAGE.dump_json(m).decode() for m in lost])

    result = run_child(build_runtime(coord.settings, make_app(coord.settings)), task.id)

    assert result.status == "completed" and result.summary == "carried on"
    api = coord.messages(task.id, kind="api")
    returns = [p for m in api for p in m["parts"] if p.get("part_kind") == "tool-return"]
    assert [(p["tool_call_id"], p["content"]) for p in returns] == [("c1", INTERRUPTED)]
    assert [t.content for t in coord.get_todos(task.id)] == ["original"], "the interrupted call did not run"
    assert coord.get_task(task.id).requests == 1, "only the request after the resume was made"


def test_a_corrupt_conversation_fails_the_task_clearly(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    task = coord.create_task(agent(reply("x")), run=True)
    conversation = coord.store.keys.conversation(task.id, task.id)
    coord.client.rpush(conversation, "{not a message")
    coord.client.expire(conversation, coord.settings.result_retention_s)  # as a run's step writes it
    result = run_child(build_runtime(coord.settings, make_app(coord.settings)), task.id)
    assert (result.status, result.error_class) == ("failed", "CorruptError")
    assert result.error == f"Conversation message 0 of task {task.id} is corrupt"
    record = coord.get_task(task.id)
    assert record.status == TaskStatus.FAILED and record.requests == 0, "no model request on a corrupt history"
    with pytest.raises(CorruptError, match="Conversation message 0 .* is corrupt"):
        coord.messages(task.id, kind="api")


def test_a_run_whose_record_does_not_read_fails_its_delivery_at_once(coordinator: Coordinator) -> None:
    """A corrupt record is not a passing outage: the delivery fails with the error at once, where Celery's retries
    read it the same twenty times, up to a quarter of an hour (this `get` timed out then), each counting another
    delivery on the record."""
    coord = coordinator
    task = coord.create_task(agent(reply("x")))  # not published: only the message below runs it
    record = coord.store.keys.task(task.root_id, task.id)
    coord.client.hset(record, mapping={"runner": "agent", "tokens_in": "many"})  # an agent's task, as run=True makes
    try:
        with pytest.raises(CorruptError, match=f"Task record {task.id} is corrupt"):
            coord.app.send_task("subq.run_task", args=[task.id]).get(timeout=30)
        assert coord.client.hget(record, "deliveries") == "1", "one try, not retried"
    finally:
        coord.client.hset(record, "tokens_in", "0")
        coord.cancel(task.id, "the test is over")  # (nothing of it is left for the session's reconciler)
