"""Retry of failed work (issue 33, point 6): a failed task runs again from its kept conversation and tool
journal, its spend kept and the new spend added; a child's slot in its open batch opened again; a tree's
failed tasks retried children before parents, the parent resuming with the new results; what makes no
sense refused with why, and nothing changed.

The provider is `tests/model_server.py` on loopback, answering 400 until it is "fixed". Tests of a run
make it in this process (`run_child`, the function the worker runs); the acceptance test runs a real
`celery worker` process, retried with `subq retry` and with `POST /v1/tasks/{id}/retry`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from coordinator import Coordinator, Retried, Settings, StateError, TaskStatus
from coordinator.celery_app import make_app
from coordinator.models import Batch, RetrySkip, TaskRecord
from coordinator.settings import Price, Profile
from tests.conftest import dedicated_fleet
from tests.helpers import api_settings, repairs_reach
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
            # Running again, or done already (its one request answers at once): either is not failed.
            refusals = {f"task {by_api.id} is {s}: only a failed task can be retried" for s in ("active", "completed")}
            assert again.json()["message"] in refusals, again.text
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


def _two_parts_the_first_failed(
    coord: Coordinator, runtime: Any, server: ModelServer, steady: str = "main"
) -> tuple[TaskRecord, Batch]:
    """A root whose two-child batch is open: the first child failed on a 400, the second (`steady`'s) not run."""
    root = coord.create_task("Two parts.", todos="[ ] flaky part\n[ ] steady part")
    batch = coord.delegate(root.id, [
        {"description": "flaky part", "message": "Look at the flaky part.", "profile": "main"},
        {"description": "steady part", "message": "Look at the steady part.", "profile": steady},
    ])  # fmt: skip
    server.fail(400)
    assert run_child(runtime, batch.child_ids[0]).status == "failed"
    return root, batch


@pytest.mark.parametrize("unlinked", [False, True], ids=["on-its-row", "unlinked"])
def test_a_failed_child_of_an_open_batch_is_awaited_again_and_written_back_once(
    settings: Settings, server: ModelServer, steady: ModelServer, unlinked: bool
) -> None:
    local = in_process(settings, server, f"open{int(unlinked)}")
    local = local.model_copy(update={"profiles": {**local.profiles, "steady": profile(steady)}})
    coord = Coordinator(local)
    runtime = build_runtime(local, make_app(local))
    root, batch = _two_parts_the_first_failed(coord, runtime, server, steady="steady")
    flaky, sibling = batch.child_ids
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
    stored = coord.store.records.get_todos(root.id)
    assert [i.cost_micros for i in stored] == [0] * len(stored), "and off its row: it is in flight again"
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


def test_a_failed_child_is_not_retried_under_a_parent_a_cancel_stopped_before_its_batch_closed(
    settings: Settings, server: ModelServer
) -> None:
    """A cancel stops the tree's tasks, then closes the batch: between the two (milliseconds, or until the
    reconciler's grace when the cancelling process died there), a retry of a failed child was accepted. The child
    ran and spent under a cancelled root whose figures its waiters had been told were final. Now the planner
    refuses it, and the script does too when the stop lands after the plan was made; nothing is written."""
    from coordinator import retry as retrying
    from coordinator.models import RetryRefused
    from tests.helpers import state

    local = in_process(settings, server, "stopped")
    coord = Coordinator(local)
    runtime = build_runtime(local, make_app(local))
    root, batch = _two_parts_the_first_failed(coord, runtime, server)
    flaky, sibling = batch.child_ids
    server.heal()
    made_before = retrying._plan_one(coord.plane, coord.get_task(flaky))
    # A cancel's first step (control.stop_subtree), its process dead before the batch's write-back.
    coord.store.batches.stop_tasks(
        [root.id, sibling], top_status="cancelled", status="cancelled", top_error="cancelled: stop",
        error="cancelled: stop", top_class="Cancelled", error_class="Cancelled", watch_s=local.reconcile_grace_s,
    )  # fmt: skip
    assert coord.get_batch(batch.id).status == "running"
    before = state(coord, root.id)

    with pytest.raises(StateError, match=f"task {flaky} cannot be retried: its parent {root.id} is cancelled"):
        coord.retry(flaky)
    with pytest.raises(StateError, match=f"no failed task of the tree of {root.id} can be retried: task {flaky}"):
        coord.retry(root.id, failed=True)
    refused = coord.store.retries.retry(
        root.id, made_before.tasks, list(made_before.batches.values()), local.reconcile_grace_s
    )
    assert refused == RetryRefused(root.id, "parent", "cancelled"), refused
    with pytest.raises(StateError, match=f"task {root.id} is cancelled: its children cannot be retried"):
        raise retrying._refused(coord.plane, refused)
    assert state(coord, root.id) == before, "a refused retry changed Redis or published a message"
    assert coord.get_task(flaky).status == TaskStatus.FAILED and len(server.seen) == 1
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
        repairs_reach(lambda: coord.repairs().get("run-lost", 0), 1, "the run the retry never sent published")
        assert task.id not in coord.store.convergence.watched()


# -- a tree: children before parents, the parent resuming with the new results -----------------------

KIDS = [
    {"description": "part one", "message": "Do part one.", "profile": "kid"},
    {"description": "part two", "message": "Do part two.", "profile": "kid"},
]


@pytest.mark.parametrize("went_further", [False, True], ids=["reopened", "parent-went-further"])
def test_a_tree_retry_runs_failed_children_first_and_their_parent_resumes_with_the_new_results(
    settings: Settings, server: ModelServer, steady: ModelServer, went_further: bool
) -> None:
    # The root (on `server`) delegates two children (on `steady`), then, resumed, answers (or first
    # rewrites its plan: it went further after reading the children's results).
    server.turns = [Turn(calls=[call("run_subagents", tasks=KIDS)])]
    if went_further:
        server.turns.append(Turn(calls=[call("update_todo_list", todos="[x] part one\n[x] part two")]))
    server.turns.append(Turn(text="root done"))
    steady.turns = [Turn(text="part done")]
    local = in_process(settings, server, f"tree{int(went_further)}")
    local = local.model_copy(update={"profiles": {**local.profiles, "kid": profile(steady)}})
    coord = Coordinator(local)
    runtime = build_runtime(local, make_app(local))
    root = coord.create_task("Do both parts.", profile="main", run=True, todos="[ ] part one\n[ ] part two")
    assert run_child(runtime, root.id).status == "delegated"
    first, second = coord.get_task(root.id).child_ids
    steady.script([400])
    assert run_child(runtime, first).status == "failed"
    assert run_child(runtime, second).status == "completed"
    assert "1 of 2 completed" in coord.get_batch(coord.get_task(first).batch_id or "").result
    server.script([200] * (1 if went_further else 0) + [400])  # the resumed root fails
    assert run_child(runtime, root.id).status == "failed"
    for alone in (False, True):  # the child's own subtree is the child: its parent is not in it
        with pytest.raises(StateError, match=f"its parent {root.id} already went on with its result; retry the tree"):
            coord.retry(first, failed=alone)
    server.heal()
    steady.heal()

    if went_further:  # through the CLI: what runs again on stdout, what it left (and why) on stderr
        from tests.test_cli import cli

        env = {"SUBQ_REDIS_URL": local.redis_url or "", "SUBQ_KEY_PREFIX": local.key_prefix, "SUBQ_QUEUE": local.queue}
        printed = cli("retry", root.id, "--failed", env=env)
        assert printed.returncode == 0, printed.stderr
        assert printed.stdout.splitlines() == [f"Retried {root.id}: it runs again from its conversation."]
        assert printed.stderr.startswith(f"Left {first}: ") and "already went on" in printed.stderr
        done = Retried(
            task=coord.get_task(root.id), retried=[root.id], skipped=[RetrySkip(task_id=first, reason=printed.stderr)]
        )
    else:
        done = coord.retry(root.id, failed=True)

    # A second retry of the same tree: what was retried is not failed now, and the rest is left again, saying why.
    nothing = "no failed task of the tree of .* can be retried: .* already went on" if went_further else "has failed"
    with pytest.raises(StateError, match=nothing):
        coord.retry(root.id, failed=True)
    if went_further:
        assert done.retried == [root.id] and done.reopened == []
        assert [s.task_id for s in done.skipped] == [first]
        assert "already went on with its result" in done.skipped[0].reason
        assert coord.get_task(first).status == TaskStatus.FAILED, "left as it was"
        assert run_child(runtime, root.id).status == "completed"
        assert "1 of 2 completed" in json.dumps(server.seen[-1].body), "the parent read the old result"
    else:
        assert (done.retried, done.reopened, done.skipped) == ([first], [root.id], [])
        assert done.task.status == TaskStatus.DELEGATED and done.task.awaiting_ids == [first]
        assert run_child(runtime, first).status == "completed"
        assert coord.get_task(root.id).status == TaskStatus.ACTIVE, "the batch closed again: the parent resumes"
        assert run_child(runtime, root.id).status == "completed"
        last = json.dumps(server.seen[-1].body)
        assert "2 of 2 completed" in last and "1 of 2 completed" not in last, "it read the new combined result"
    record = coord.get_task(root.id)
    assert record.summary == "root done" and record.retries == 1
    tree = [root.id, first, second]
    assert record.total_cost_micros == request_costs(coord, tree), "Σ request costs == the root's total"
    answered = len(server.answered()) + len(steady.answered())
    assert record.total_cost_micros == micros(answered), "each answered request counted once, none twice"
    items = coord.get_todos(root.id)
    assert (
        sum(i.cost_micros for i in items) + record.unlinked_cost_micros == record.total_cost_micros - record.cost_micros
    )
    coord.close()


# -- what makes no sense is refused with why, and changes nothing ------------------------------------


def test_retries_that_make_no_sense_are_refused_with_why_and_change_nothing(
    settings: Settings, server: ModelServer
) -> None:
    from coordinator import ValidationError
    from coordinator.api import create_app
    from coordinator.client import SubqClient
    from tests.helpers import TOKEN, ApiServer, state
    from tests.test_cli import cli

    local = in_process(settings, server, "refused")
    coord = Coordinator(local)
    runtime = build_runtime(local, make_app(local))
    completed = coord.create_task("Look and report.", profile="main", run=True)
    assert run_child(runtime, completed.id).status == "completed"
    # A budget below one response's cost: its first response spends it, and the task fails on it.
    broke = coord.create_task("Look and report.", profile="main", run=True, budget_usd="0.000001")
    assert run_child(runtime, broke.id).status == "failed"
    assert coord.get_task(broke.id).error_class == "BudgetExhausted"
    # A chain whose first step fails: the steps after it are cancelled, the batch closes.
    chain_root = coord.create_task("Two steps.")
    chain = coord.delegate(chain_root.id, [dict(k, profile="main") for k in KIDS], mode="sequential")
    server.script([400])
    assert run_child(runtime, chain.child_ids[0]).status == "failed"
    assert coord.get_task(chain.child_ids[1]).status == TaskStatus.CANCELLED

    # A caller's root that failed (a submission whose publish failed ends its root so): no run to go on with.
    callers = coord.create_task("Driven by its caller.")
    coord.store.runs.finish_task(callers.id, "failed", "", "the broker refused the publish")
    refusals = [
        (completed.id, {}, f"task {completed.id} is completed: only a failed task can be retried"),
        (callers.id, {}, f"task {callers.id} is run by its caller, not by an agent on the fleet"),
        (broke.id, {}, f"task {broke.id} failed on its budget (budget of $0.000001 exhausted"),
        (chain.child_ids[0], {}, "a stopped chain is not re-opened"),
        (chain.child_ids[1], {}, f"task {chain.child_ids[1]} is cancelled: only a failed task can be retried"),
        (completed.id, {"failed": True}, f"no task of the tree of {completed.id} has failed"),
        (broke.id, {"failed": True}, "retrying it would hit the same budget"),
    ]
    roots = (completed.id, broke.id, chain_root.id, callers.id)
    before = state(coord, *roots)
    api_coord = Coordinator(api_settings(local))
    env = {"SUBQ_REDIS_URL": settings.redis_url or "", "SUBQ_KEY_PREFIX": local.key_prefix, "SUBQ_QUEUE": local.queue}
    with ApiServer(create_app(coordinator=api_coord)) as api, api.client() as http:
        client = SubqClient(api.url, TOKEN)
        for task_id, body, why in refusals:
            with pytest.raises(StateError) as direct:
                coord.retry(task_id, **body)
            assert why in str(direct.value)
            answer = http.post(f"/v1/tasks/{task_id}/retry", json=body)
            assert (answer.status_code, answer.json()["code"], answer.json()["field"]) == (
                409,
                "wrong_state",
                "task_id",
            )
            assert why in answer.json()["message"]
            with pytest.raises(StateError) as by_client:
                client.retry(task_id, **body)
            assert why in str(by_client.value)
            with pytest.raises(StateError) as by_async:
                asyncio.run(_retry_async(api.url, task_id, body.get("failed", False)))
            assert why in str(by_async.value)
            for reach in (env, {"SUBQ_API_URL": api.url, "SUBQ_API_TOKEN": TOKEN}):  # on Redis, and through the API
                shown = cli("retry", task_id, *(["--failed"] if body else []), env=reach)
                assert shown.returncode == 1 and shown.stdout == "" and why in shown.stderr
                assert shown.stderr.startswith("subq: ") and shown.stderr.count("\n") == 1
        # Malformed input: the body's field, and an unknown field, named; nothing sent by the client.
        for body, field, words in [
            ({"failed": "yes"}, "failed", "Input should be a valid boolean"),
            ({"failed": False, "reason": "x"}, "reason", "Extra inputs are not permitted"),
        ]:
            answer = http.post(f"/v1/tasks/{completed.id}/retry", json=body)
            assert (answer.status_code, answer.json()["field"]) == (422, field), answer.text
            assert words in answer.json()["message"]
        with pytest.raises(ValidationError, match="failed: Input should be a valid boolean"):
            client.retry(completed.id, failed="yes")  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match="failed: Input should be a valid boolean"):
            asyncio.run(_retry_async(api.url, completed.id, "yes"))  # type: ignore[arg-type]
        unknown = http.post(f"/v1/tasks/{completed.id[:16]}-000000000000/retry")
        assert unknown.status_code == 404 and unknown.json()["code"] == "not_found"
        client.close()
    api_coord.close()
    assert state(coord, *roots) == before, "a refused retry changed Redis or published a message"
    coord.close()


async def _retry_async(url: str, task_id: str, failed: bool) -> object:
    from coordinator.client import AsyncSubqClient
    from tests.helpers import TOKEN

    async with AsyncSubqClient(url, TOKEN) as client:
        return await client.retry(task_id, failed=failed)


def test_the_python_clients_retry_sync_and_async(settings: Settings, server: ModelServer) -> None:
    from coordinator.api import create_app
    from coordinator.client import SubqClient
    from tests.helpers import TOKEN, ApiServer

    local = in_process(settings, server, "clients")
    coord = Coordinator(local)
    runtime = build_runtime(local, make_app(local))
    server.fail(400)
    tasks = [coord.create_task(f"Look and report ({face}).", profile="main", run=True) for face in ("sync", "async")]
    assert [run_child(runtime, task.id).status for task in tasks] == ["failed", "failed"]
    server.heal()
    api_coord = Coordinator(api_settings(local))
    with ApiServer(create_app(coordinator=api_coord)) as api, SubqClient(api.url, TOKEN) as client:
        by_sync = client.retry(tasks[0].id)
        by_async = asyncio.run(_retry_async(api.url, tasks[1].id, False))
    api_coord.close()
    for done, task in ((by_sync, tasks[0]), (by_async, tasks[1])):
        assert isinstance(done, Retried) and done.retried == [task.id] and done.task.status == TaskStatus.ACTIVE
        assert run_child(runtime, task.id).status == "completed"
        assert coord.get_task(task.id).cost_micros == micros(2)
    coord.close()


def test_a_tool_call_that_returned_before_the_failure_is_not_run_again(
    settings: Settings, server: ModelServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("TOOL_KIT_MARKS", str(marks))
    server.turns = [Turn(calls=[call("leave_mark", label="once")]), Turn(text="all done")]
    local = in_process(settings, server, "journal")
    local = local.model_copy(
        update={"profiles": {**local.profiles, "main": profile(server, tools=["tests.tool_kit:leave_mark"])}}
    )
    coord = Coordinator(local)
    runtime = build_runtime(local, make_app(local))
    server.script([200, 400])  # the tool's call is answered and runs; the next request is refused
    task = coord.create_task("Leave a mark, then report.", profile="main", run=True)
    assert run_child(runtime, task.id).status == "failed"
    (mark,) = marks.glob("once.*")
    written_ns = mark.stat().st_mtime_ns
    assert coord.get_task(task.id).tool_use["leave_mark"].outcomes == {"ok": 1}

    coord.retry(task.id)
    result = run_child(runtime, task.id)

    record = coord.get_task(task.id)
    assert result.status == "completed" and record.summary == "all done", record.error
    assert [s.status for s in server.seen] == [200, 400, 200], "the call's response was not asked for again"
    assert list(marks.glob("once.*")) == [mark] and mark.stat().st_mtime_ns == written_ns, "the tool ran once"
    assert record.tool_use["leave_mark"].outcomes == {"ok": 1}, "counted once"
    assert record.cost_micros == micros(2)
    coord.close()


def test_a_retrys_celery_id_names_its_task() -> None:
    """The reconciler finds a run in the queue by the task its Celery id names, and Flower shows its record."""
    from coordinator import task_of_run_id

    child = "0123456789abcdef-0123456789ab"
    assert task_of_run_id(f"{child}-t1") == child and task_of_run_id("0123456789abcdef-t12") == "0123456789abcdef"
    assert task_of_run_id(f"{child}-t") is None


def test_a_tree_retry_reopens_each_level_a_failure_climbed(
    settings: Settings, server: ModelServer, steady: ModelServer
) -> None:
    """A leaf's failure failed its parent, and that one's its root: each level's batch is re-opened in one
    step, the leaf runs again, and each parent resumes in turn with the new result."""
    mid = {"description": "middle", "message": "Ask the leaf.", "profile": "mid"}
    leaf = {"description": "leaf", "message": "Answer.", "profile": "leaf"}
    server.turns = [Turn(calls=[call("run_subagents", tasks=[mid])]), Turn(text="root done")]
    steady.turns = [Turn(calls=[call("run_subagents", tasks=[leaf])]), Turn(text="middle done")]
    with ModelServer([Turn(text="leaf done")]) as leaf_server:
        local = in_process(settings, server, "levels")
        local = local.model_copy(
            update={"profiles": {**local.profiles, "mid": profile(steady), "leaf": profile(leaf_server)}}
        )
        coord = Coordinator(local)
        runtime = build_runtime(local, make_app(local))
        root = coord.create_task("Ask down the tree.", profile="main", run=True)
        assert run_child(runtime, root.id).status == "delegated"
        (middle,) = coord.get_task(root.id).child_ids
        assert run_child(runtime, middle).status == "delegated"
        (bottom,) = coord.get_task(middle).child_ids
        for failing in (leaf_server, steady, server):
            failing.fail(400, times=1)
        for task_id in (bottom, middle, root.id):  # each failure reaches the parent, which fails on it
            assert run_child(runtime, task_id).status == "failed", task_id

        done = coord.retry(root.id, failed=True)

        assert (done.retried, done.reopened) == ([bottom], [middle, root.id])
        assert [coord.get_task(t).status for t in (bottom, middle, root.id)] == ["active", "delegated", "delegated"]
        # Each re-opened batch's awaiting set, gone when it closed, is made again with its tree's retention: with
        # none, a tree that stalled kept it for good (the keeper of trees' keys passes a key with no expiry by).
        for parent in (middle, root.id):
            assert coord.client.ttl(coord.store.keys.awaiting(root.id, parent)) > 0, parent
        for task_id in (bottom, middle, root.id):
            assert run_child(runtime, task_id).status == "completed", coord.get_task(task_id).error
        record = coord.get_task(root.id)
        assert record.summary == "root done"
        assert "1 of 1 completed" in json.dumps(server.seen[-1].body)
        answered = len(server.answered()) + len(steady.answered()) + len(leaf_server.answered())
        assert record.total_cost_micros == request_costs(coord, [root.id, middle, bottom]) == micros(answered)
        coord.close()
