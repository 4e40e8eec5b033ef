"""Retry of failed work (issue 33, point 6): a failed task runs again from its kept conversation and tool
journal, its spend kept and the new spend added; a child's slot in its open batch opened again; a tree's
failed tasks retried children before parents, the parent resuming with the new results; what makes no
sense refused with why, and nothing changed.

The provider is `tests/model_server.py` on loopback, answering 400 until it is "fixed". Tests of a run
make it in this process (`run_child`, the function the worker runs); the acceptance test runs a real
`celery worker` process, retried with `subq retry` and with `POST /v1/tasks/{id}/retry`.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from coordinator import Coordinator, Settings, StateError, TaskStatus
from coordinator.celery_app import make_app
from coordinator.settings import Price, Profile
from tests.conftest import dedicated_fleet
from tests.helpers import api_settings
from tests.model_server import USAGE, ModelServer, Turn, call
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child

PRICE = Price(input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))
# A tool call, then the answer: the retried run must not lose the first response's work.
TURNS = [Turn(calls=[call("update_todo_list", todos="[-] look")]), Turn(text="all done")]
WAIT_S = 60


def micros(responses: int) -> int:
    prompt, completion = USAGE
    return int(responses * (prompt * PRICE.input_per_mtok + completion * PRICE.output_per_mtok))


def profile(server: ModelServer, **fields: object) -> Profile:
    return Profile.model_validate(
        {"model": "openai:test-model", "base_url": server.base_url, "api_key": server.key, "price": PRICE, **fields}
    )


@pytest.fixture
def server() -> Iterator[ModelServer]:
    with ModelServer(TURNS) as running:
        yield running


def in_process(settings: Settings, server: ModelServer, prefix: str) -> Settings:
    """A run made in this process: a queue no worker reads, keys no session reconciler serves."""
    return settings.model_copy(
        update={
            "queue": "subq-nobody",
            "key_prefix": f"subqretry{prefix}",
            "profiles": {**settings.profiles, "main": profile(server)},
        }
    )


def request_costs(coord: Coordinator, task_ids: list[str]) -> int:
    """Σ of the costs of every request the tasks recorded, as the record's own counters hold them."""
    return sum(coord.get_task(task_id).cost_micros for task_id in task_ids)


def test_a_task_failed_by_a_400_goes_on_from_its_conversation_when_retried(
    settings: Settings, server: ModelServer
) -> None:
    local = in_process(settings, server, "one")
    coord = Coordinator(local)
    runtime = build_runtime(local, make_app(local))
    task = coord.create_task("Look and report.", profile="main", run=True)
    server.script([200, 400])  # the first request is answered, the second refused

    failed = run_child(runtime, task.id)

    record = coord.get_task(task.id)
    assert failed.status == record.status == TaskStatus.FAILED, record
    assert (record.error or "").startswith("HTTP 400"), record.error
    assert record.cost_micros == micros(1) and record.requests == 1
    conversation_before = coord.messages(task.id, kind="api")

    server.heal()
    done = coord.retry(task.id)

    assert done.retried == [task.id] and done.task.status == TaskStatus.ACTIVE and done.task.retries == 1
    assert done.task.error == "" and task.id in coord.store.convergence.watched(), "on the due list before its run"
    said = [m["text"] for m in coord.messages(task.id) if m.get("say") == "retried"]
    assert len(said) == 1 and "retry 1" in said[0] and "HTTP 400" in said[0], said
    with pytest.raises(StateError, match=f"task {task.id} is active: only a failed task can be retried"):
        coord.retry(task.id)

    result = run_child(runtime, task.id)

    record = coord.get_task(task.id)
    assert result.status == record.status == TaskStatus.COMPLETED, record.error
    assert record.summary == "all done"
    # The first response was not asked again: one more answered request, after the refused one.
    assert [s.status for s in server.seen] == [200, 400, 200]
    assert coord.messages(task.id, kind="api")[: len(conversation_before)] == conversation_before
    assert record.cost_micros == record.total_cost_micros == micros(2), "the spend before stays, the new adds"
    assert record.requests == 2 and record.retries == 1
    assert record.timeline is not None and [s for _, s in record.timeline.m][-3:] == ["queued", "running", "completed"]
    assert "wait:retry" in [s for _, s in record.timeline.m]
    with pytest.raises(StateError, match=f"task {task.id} is completed: only a failed task can be retried"):
        coord.retry(task.id)
    coord.close()


# -- the acceptance: a real worker, retried with `subq retry` and with POST /v1/tasks/{id}/retry -------


def test_tasks_failed_by_a_400_complete_when_retried_from_the_cli_and_the_api(
    settings: Settings, server: ModelServer, tmp_path: Path
) -> None:
    from coordinator.api import create_app
    from tests.helpers import ApiServer
    from tests.test_cli import cli

    profiles = {**settings.profiles, "main": profile(server)}
    with dedicated_fleet(
        settings, tmp_path, 1, queue="subq-retry", key_prefix="subqretryfleet", profiles=profiles
    ) as (coord, _fleet):  # fmt: skip
        server.fail(400)  # until it is fixed
        by_cli, by_api = (coord.create_task(f"Look and report ({face}).", profile="main", run=True) for face in "ab")
        for task in (by_cli, by_api):
            failed = coord.wait(task.id, WAIT_S)
            assert failed.status == TaskStatus.FAILED and (failed.error or "").startswith("HTTP 400"), failed.error
        refused_before = len(server.seen)

        server.heal()
        env = {
            "SUBQ_REDIS_URL": settings.redis_url or "",
            "SUBQ_KEY_PREFIX": "subqretryfleet",
            "SUBQ_QUEUE": "subq-retry",
        }
        shown = cli("retry", by_cli.id, env=env)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.strip() == f"Retried {by_cli.id}: it runs again from its conversation."
        api_coord = Coordinator(api_settings(coord.settings))
        with ApiServer(create_app(coordinator=api_coord)) as api, api.client() as http:
            answer = http.post(f"/v1/tasks/{by_api.id}/retry")
            assert answer.status_code == 200, answer.text
            assert answer.json()["retried"] == [by_api.id] and answer.json()["task"]["retries"] == 1
            again = http.post(f"/v1/tasks/{by_api.id}/retry", json={"failed": False})
            assert (again.status_code, again.json()["code"], again.json()["field"]) == (409, "wrong_state", "task_id")
            assert again.json()["message"] == f"task {by_api.id} is active: only a failed task can be retried"
        api_coord.close()

        for task in (by_cli, by_api):
            done = coord.wait(task.id, WAIT_S)
            assert done.status == TaskStatus.COMPLETED and done.summary == "all done", done.error
            # The refused requests cost nothing; the two answered ones are the whole cost, on its own counters.
            assert done.cost_micros == done.total_cost_micros == micros(2) and done.requests == 2
            assert done.retries == 1
        assert len(server.seen) == refused_before + 4, "each retried task asked twice, nothing more"
        retries = [e for e in coord.audit(50)[0] if e.action == "retry"]
        assert {e.target for e in retries} == {by_cli.id, by_api.id}


# -- a child whose batch is still open: its slot opened again ---------------------------------------


@pytest.fixture
def steady() -> Iterator[ModelServer]:
    with ModelServer(TURNS) as running:
        yield running


@pytest.mark.parametrize("unlinked", [False, True], ids=["on-its-row", "unlinked"])
def test_a_failed_child_of_an_open_batch_is_awaited_again_and_written_back_once(
    settings: Settings, server: ModelServer, steady: ModelServer, unlinked: bool
) -> None:
    local = in_process(settings, server, f"open{int(unlinked)}")
    local = local.model_copy(update={"profiles": {**local.profiles, "steady": profile(steady)}})
    coord = Coordinator(local)
    runtime = build_runtime(local, make_app(local))
    root = coord.create_task("Two parts.", todos="[ ] flaky part\n[ ] steady part")
    batch = coord.delegate(root.id, [
        {"description": "flaky part", "message": "Look at the flaky part.", "profile": "main"},
        {"description": "steady part", "message": "Look at the steady part.", "profile": "steady"},
    ])  # fmt: skip
    flaky, sibling = batch.child_ids
    server.fail(400)

    assert run_child(runtime, flaky).status == "failed"
    assert coord.get_task(root.id).awaiting_ids == [sibling], "written back; the batch waits on its sibling"
    if unlinked:  # the plan is rewritten without its row: its figures are the parent's unlinked spend
        coord.update_todos(root.id, "[-] steady part")
        assert coord.get_task(root.id).unlinked_cost_micros == 0  # it had spent nothing on its refused request
    server.heal()
    server.script([200, 400])  # the retry's run spends a response, then fails again: spend on the record
    coord.retry(flaky)
    assert run_child(runtime, flaky).status == "failed"
    spent = coord.get_task(flaky).total_cost_micros
    assert spent == micros(1)
    if unlinked:
        assert coord.get_task(root.id).unlinked_cost_micros == spent

    server.heal()
    done = coord.retry(flaky)

    assert done.retried == [flaky] and done.task.retries == 2
    parent = coord.get_task(root.id)
    assert sorted(parent.awaiting_ids) == sorted([flaky, sibling]), "awaited again"
    assert parent.status == TaskStatus.DELEGATED
    assert parent.unlinked_cost_micros == 0, "its figures are taken back out until it is written back again"
    assert run_child(runtime, flaky).status == "completed"
    assert coord.get_task(root.id).status == TaskStatus.DELEGATED, "the batch still waits on the sibling"
    assert run_child(runtime, sibling).status == "completed"

    parent = coord.get_task(root.id)
    assert parent.status == TaskStatus.ACTIVE and parent.awaiting_ids == []
    result = coord.get_batch(batch.id).result
    assert result.startswith("Subtask results (parallel, 2 of 2 completed)") and "[failed]" not in result, result
    flaky_total = coord.get_task(flaky).total_cost_micros
    # The second run's response and the third's (which went on from it): each request counted once.
    assert flaky_total == micros(2) and coord.get_task(flaky).requests == 2
    items = coord.get_todos(root.id)
    assert parent.total_cost_micros == request_costs(coord, [root.id, flaky, sibling]) == flaky_total + micros(2)
    assert sum(item.cost_micros for item in items) + parent.unlinked_cost_micros == parent.total_cost_micros
    if unlinked:
        assert parent.unlinked_cost_micros == flaky_total and [i.content for i in items] == ["steady part"]
    else:
        assert [(i.content, i.cost_micros, i.status.value) for i in items] == [
            ("flaky part", flaky_total, "completed"), ("steady part", micros(2), "completed")
        ]  # fmt: skip
    coord.close()


# -- a process that dies between the retry's commit and its publish --------------------------------


def test_a_retry_whose_process_dies_before_the_publish_is_run_by_the_reconciler(
    settings: Settings, server: ModelServer, tmp_path: Path
) -> None:
    import signal

    from tests.test_cli import subq

    own = {
        "queue": "subq-retrykill",
        "key_prefix": "subqretrykill",
        "reconcile_interval_s": 0.5,
        "reconcile_grace_s": 3,
    }
    profiles = {**settings.profiles, "main": profile(server)}
    with dedicated_fleet(settings, tmp_path, 1, profiles=profiles, **own) as (coord, _fleet):
        server.fail(400)
        task = coord.create_task("Look and report.", profile="main", run=True)
        assert coord.wait(task.id, WAIT_S).status == TaskStatus.FAILED
        server.heal()
        env = {"SUBQ_REDIS_URL": settings.redis_url or "", "SUBQ_KEY_PREFIX": own["key_prefix"],
               "SUBQ_QUEUE": own["queue"], "SUBQ_FAULT_CRASH_AT": "after-retry"}  # fmt: skip

        killed = subq("retry", task.id, env=env)

        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert coord.get_task(task.id).status == TaskStatus.ACTIVE, "committed before it died"
        done = coord.wait(task.id, WAIT_S)
        assert done.status == TaskStatus.COMPLETED and done.cost_micros == micros(2), done.error
        assert coord.repairs().get("run-lost", 0) >= 1, "the reconciler published the run the retry never sent"
        assert task.id not in coord.store.convergence.watched()
