"""`subq.submit` from a plain Celery client that knows only the task name (docs/celery-contract.md).

The client below is `Celery(broker=url, backend=url)`: no subq import, no subq
settings, only the task name, the queue and JSON kwargs, as a producer in any
language would send them. The test workers run the task.

Every bad submission is checked on `submit()`, the plain function the task calls,
and a few of them also through a worker, to prove the error comes back over the wire.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from coordinator import Coordinator, Settings, TaskStatus, TodoStatus
from coordinator.celery_app import describe_kwargs
from tests.agents import STEP_COST_MICROS, STEP_TOKENS, agent, call, reply, subtask
from tests.helpers import script, state, usage_step
from tests.test_bad_input import NO_TREE
from workers.submit import submit

RESULT_TIMEOUT_S = 30
RUN_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def producer(settings: Settings) -> Iterator[Celery]:
    client = Celery("any-producer", broker=settings.redis_url, backend=settings.redis_url)
    yield client
    client.close()


def send(producer: Celery, settings: Settings, *args: Any, **kwargs: Any) -> Any:
    result = producer.send_task("subq.submit", args=list(args), kwargs=kwargs, queue=settings.queue)
    try:
        return result.get(timeout=RESULT_TIMEOUT_S)
    finally:
        result.forget()


def test_an_agent_run_started_by_name_completes_with_its_figures(
    producer: Celery, settings: Settings, coordinator: Coordinator
) -> None:
    root = agent(
        call("run_subagents", tasks=[subtask("A", reply("A done")), subtask("B", reply("B done"))]),
        call("attempt_completion", result="both done"),
    )
    result = send(producer, settings, prompt=root, todos="[ ] A\n[ ] B", profile="offline")

    assert set(result) == {"task_id"}
    done = coordinator.wait(result["task_id"], RUN_TIMEOUT_S)
    assert done.status == TaskStatus.COMPLETED, done.error
    assert done.runner == "agent" and done.summary == "both done"
    items = coordinator.get_todos(done.id)
    assert [(i.content, i.status, i.tokens, i.cost_micros) for i in items] == [
        ("A", TodoStatus.COMPLETED, STEP_TOKENS, STEP_COST_MICROS),
        ("B", TodoStatus.COMPLETED, STEP_TOKENS, STEP_COST_MICROS),
    ]
    # The root's two requests plus one per child, each counted once.
    assert (done.total_tokens, done.total_cost_micros) == (4 * STEP_TOKENS, 4 * STEP_COST_MICROS)


def test_subtasks_under_a_caller_owned_parent_are_delegated_and_written_back(
    producer: Celery, settings: Settings, coordinator: Coordinator
) -> None:
    subtasks = [
        {"description": "Collect", "message": script(usage_step())},
        {"description": "Summarise", "message": script(usage_step())},
    ]
    result = send(
        producer, settings, prompt="Q3 report", todos="[ ] Collect\n[ ] Summarise", run=False,
        subtasks=subtasks, mode="sequential",
    )  # fmt: skip

    assert set(result) == {"task_id", "batch_id"}
    parent = coordinator.wait(result["task_id"], RUN_TIMEOUT_S)
    # Nobody holds a submission's root: it ends as its batch closes, its summary the combined result.
    assert parent.status == TaskStatus.COMPLETED and parent.runner == "caller"
    assert parent.summary.startswith("Subtask results (sequential, 2 of 2 completed):")
    batch = coordinator.get_batch(result["batch_id"])
    assert (batch.mode, batch.status, batch.parent_id) == ("sequential", "done", parent.id)
    items = coordinator.get_todos(parent.id)
    assert [i.subtask_id for i in items] == batch.child_ids
    assert all(i.status == TodoStatus.COMPLETED and i.cost_micros == STEP_COST_MICROS for i in items)
    assert parent.total_tokens == 2 * STEP_TOKENS


def _spec(**extra: Any) -> dict[str, Any]:
    return {"description": "child", "message": script(usage_step()), **extra}


# The message is read with the API's own model (coordinator.inputs.SubmitInput): a wrong type, a
# missing or unknown field is worded as the API words it (`path: message`), a blank prompt or
# an over-long key in the service's words, as every face words them.
BAD_SUBMISSIONS: list[tuple[str, tuple[Any, ...], dict[str, Any], str, str, str]] = [
    # (case, args, kwargs, code, field, message)
    ("positional", ("a prompt",), {}, "invalid_input", "args", "keyword arguments only"),
    ("no prompt", (), {"todos": "[ ] a"}, "invalid_input", "prompt", "prompt: Field required"),
    ("empty prompt", (), {"prompt": "  "}, "invalid_input", "prompt", "prompt must be a non-empty string"),
    ("prompt not text", (), {"prompt": 42}, "invalid_input", "prompt", "prompt: Input should be a valid string"),
    ("unknown field", (), {"prompt": "p", "budget": 5}, "invalid_input", "budget", "budget: Extra inputs are not permitted"),
    ("run not bool", (), {"prompt": "p", "run": "yes"}, "invalid_input", "run", "run: Input should be a valid boolean"),
    ("profile unknown", (), {"prompt": "p", "profile": "nope"}, "invalid_profile", "profile", "Invalid profile: nope"),
    ("profile not text", (), {"prompt": "p", "profile": ["x"]}, "invalid_input", "profile", "profile: Input should be a valid string"),
    ("todos without items", (), {"prompt": "p", "todos": "no checkbox"}, "invalid_todos", "todos", "has no items"),
    ("todos not a list", (), {"prompt": "p", "todos": 7}, "invalid_todos", "todos", "markdown text or a list"),
    ("mode alone", (), {"prompt": "p", "mode": "parallel"}, "invalid_input", "mode", "only together with subtasks"),
    ("subtasks with run", (), {"prompt": "p", "subtasks": [_spec()]}, "invalid_input", "run", "subtasks need run=false"),
    ("bad mode", (), {"prompt": "p", "run": False, "subtasks": [_spec()], "mode": "diagonal"},
     "invalid_input", "mode", "mode: Input should be 'parallel' or 'sequential'"),
    ("subtasks empty", (), {"prompt": "p", "run": False, "subtasks": []},
     "invalid_input", "subtasks", "subtasks: List should have at least 1 item"),
    ("subtasks not a list", (), {"prompt": "p", "run": False, "subtasks": "do it"},
     "invalid_input", "subtasks", "subtasks: Input should be a valid list"),
    ("spec without message", (), {"prompt": "p", "run": False, "subtasks": [_spec(), {"description": "d"}]},
     "invalid_input", "subtasks.1.message", "subtasks.1.message: Field required"),
    ("spec unknown key", (), {"prompt": "p", "run": False, "subtasks": [_spec(prompt="x")]},
     "invalid_input", "subtasks.0.prompt", "subtasks.0.prompt"),
    ("spec profile", (), {"prompt": "p", "run": False, "subtasks": [_spec(profile="nope")]},
     "invalid_profile", "subtasks.0.profile", "Invalid profile: nope"),
    ("unknown todo_id", (), {"prompt": "p", "run": False, "todos": "[ ] a", "subtasks": [_spec(todo_id="zzz")]},
     "invalid_todos", "subtasks.0.todo_id", "Unknown todo_id 'zzz'"),
    ("bad todos with subtasks", (), {"prompt": "p", "run": False, "todos": "nothing", "subtasks": [_spec()]},
     "invalid_todos", "todos", "has no items"),
    ("bad prompt with subtasks", (), {"prompt": "", "run": False, "subtasks": [_spec()]},
     "invalid_input", "prompt", "prompt must be a non-empty string"),
    ("idempotency key not text", (), {"prompt": "p", "idempotency_key": 5},
     "invalid_input", "idempotency_key", "idempotency_key: Input should be a valid string"),
    ("idempotency key too long", (), {"prompt": "p", "idempotency_key": "k" * 201},
     "invalid_input", "idempotency_key", "idempotency_key is 201 characters; the limit is 200"),
    # A lone surrogate (JSON's "\\ud800") is no text: it raised past the result, after a tenant's root was counted.
    ("prompt with a lone surrogate", (), {"prompt": "a\ud800"},
     "invalid_input", "prompt", "prompt holds a lone surrogate '\\ud800' at character 2"),
    ("profile empty", (), {"prompt": "p", "profile": ""}, "invalid_profile", "profile", "profile must not be empty"),
    ("spec message too long", (), {"prompt": "p", "run": False, "subtasks": [_spec(message="m" * 200_001)]},
     "invalid_input", "subtasks.0.message", "String should have at most 200000 characters"),
]  # fmt: skip


# Sent through a worker as well: a refusal before any write, a nested spec field
# renamed to `subtasks.N`, and a profile check that reads the worker's settings.
SENT_BY_NAME = ("positional", "profile unknown", "spec without message")
CASES = {case[0]: case for case in BAD_SUBMISSIONS}  # a missing name fails at collection


@pytest.mark.parametrize(
    ("args", "kwargs", "code", "field", "message"),
    [case[1:] for case in BAD_SUBMISSIONS],
    ids=[case[0] for case in BAD_SUBMISSIONS],
)
def test_bad_submissions_return_an_error_and_change_nothing(
    idle_coordinator: Coordinator,
    args: tuple[Any, ...], kwargs: dict[str, Any], code: str, field: str, message: str,
) -> None:  # fmt: skip
    # The coordinator publishes to a queue no worker consumes: its length counts any message sent.
    before = state(idle_coordinator, NO_TREE)  # no root created, nothing else of subq's touched
    result = submit(idle_coordinator, args, kwargs)
    assert json.loads(json.dumps(result)) == result, "the task's result must travel as JSON"
    assert set(result) == {"error"}, result
    assert (result["error"]["code"], result["error"]["field"]) == (code, field), result
    assert message in result["error"]["message"]
    assert state(idle_coordinator, NO_TREE) == before, "a refused submission changed Redis or published a message"


@pytest.mark.parametrize(
    ("args", "kwargs", "code", "field", "message"),
    [CASES[name][1:] for name in SENT_BY_NAME],
    ids=list(SENT_BY_NAME),
)
def test_bad_submissions_sent_by_name_return_the_error_and_change_nothing(
    producer: Celery, settings: Settings, coordinator: Coordinator,
    args: tuple[Any, ...], kwargs: dict[str, Any], code: str, field: str, message: str,
) -> None:  # fmt: skip
    before = state(coordinator, NO_TREE)[0]  # no root created, nothing else of subq's touched
    result = send(producer, settings, *args, **kwargs)
    assert set(result) == {"error"}, result
    assert (result["error"]["code"], result["error"]["field"]) == (code, field), result
    assert message in result["error"]["message"]
    assert state(coordinator, NO_TREE)[0] == before, "a refused submission changed Redis"


def test_flower_sees_sizes_of_a_submission_never_its_text() -> None:
    shown = describe_kwargs(
        {"prompt": "SECRET plan", "todos": "[ ] a\n[ ] b", "run": False, "subtasks": [{"message": "SECRET"}],
         "mode": "parallel", "profile": "offline", "extra": "SECRET"}
    )  # fmt: skip
    assert "SECRET" not in shown
    assert shown == (
        "prompt=<11 chars> todos=<2 items> run=False subtasks=<1> mode='parallel' profile='offline' extra=<unknown field>"
    )


def test_subqs_own_app_publishes_a_submission_with_a_safe_summary(idle_coordinator: Coordinator) -> None:
    """The producer's sent event carries kwargsrepr; subq's app sets it, so the prompt never reaches Flower."""
    queue = idle_coordinator.settings.queue
    secret = "SECRET plan for the quarter"
    idle_coordinator.app.send_task("subq.submit", kwargs={"prompt": secret, "run": True}, queue=queue)
    (raw,) = idle_coordinator.client.lrange(queue, 0, -1)
    headers = json.loads(raw)["headers"]
    assert headers["kwargsrepr"] == f"prompt=<{len(secret)} chars> run=True"
    assert secret not in headers["kwargsrepr"] and secret not in headers["argsrepr"]


def test_one_message_delivered_twice_makes_one_root(idle_coordinator: Coordinator) -> None:
    """A worker lost after it started a submission: the message's second delivery returns the first root."""
    kwargs = {"prompt": "p", "run": False, "todos": "[ ] a", "subtasks": [_spec()]}
    first = submit(idle_coordinator, (), kwargs, message_id="msg-twice")
    roots = idle_coordinator.client.zcard(idle_coordinator.store.keys.roots())
    queued = idle_coordinator.client.llen(idle_coordinator.settings.queue)
    again = submit(idle_coordinator, (), kwargs, message_id="msg-twice")
    assert again == first and set(first) == {"task_id", "batch_id"}
    assert idle_coordinator.client.zcard(idle_coordinator.store.keys.roots()) == roots, "no second root"
    assert idle_coordinator.client.llen(idle_coordinator.settings.queue) == queued, "nothing published twice"
    assert len(idle_coordinator.get_children(first["task_id"])) == 1
    other = submit(idle_coordinator, (), kwargs, message_id="msg-other")
    assert other["task_id"] != first["task_id"]


def test_a_submission_whose_first_delivery_died_before_delegating_delegates_once(
    idle_coordinator: Coordinator,
) -> None:
    coord = idle_coordinator
    parent, created = coord.create_task_once("p", run=False, idempotency_key="subq.submit:msg-half")
    assert created  # and the process died here, before the delegation
    result = submit(coord, (), {"prompt": "p", "run": False, "subtasks": [_spec()]}, message_id="msg-half")
    assert result["task_id"] == parent.id and "batch_id" in result
    assert len(coord.get_children(parent.id)) == 1


def test_an_idempotency_key_sent_by_name_returns_the_first_root(
    producer: Celery, settings: Settings, coordinator: Coordinator
) -> None:
    key = f"order-{coordinator.store.records.next_numbers(1)}"
    first = send(producer, settings, prompt="p", run=False, idempotency_key=key)
    again = send(producer, settings, prompt="p", run=False, idempotency_key=key)
    assert first == again and coordinator.get_task(first["task_id"]).status == TaskStatus.ACTIVE


def test_lines_that_look_like_plan_items_are_named_in_the_result(idle_coordinator: Coordinator) -> None:
    todos = "[ ] a\n* [ ] starred\n1. [ ] numbered"
    caller = submit(idle_coordinator, (), {"prompt": "p", "run": False, "todos": todos, "subtasks": [_spec()]})
    agent_root = submit(idle_coordinator, (), {"prompt": "p", "run": False, "todos": todos})

    for result in (caller, agent_root):
        assert [(i["line"], i["text"]) for i in result["ignored_todo_lines"]] == [
            (2, "* [ ] starred"),
            (3, "1. [ ] numbered"),
        ]
        assert [item.content for item in idle_coordinator.get_todos(result["task_id"])] == ["a"]
    clean = submit(idle_coordinator, (), {"prompt": "p", "run": False, "todos": "[ ] a"})
    assert "ignored_todo_lines" not in clean
