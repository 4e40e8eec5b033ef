"""The Python client, sync and async, against a real API server (real uvicorn, Redis, workers).

The same flow runs through `SubqClient` and `AsyncSubqClient`, and every error
response must come back as the SubqError subclass of its code.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coordinator import (
    Coordinator,
    NotFoundError,
    ProfileError,
    Settings,
    StateError,
    StoreError,
    SubqError,
    SubtaskSpec,
    TaskRecord,
    TaskStatus,
    TodoError,
    TodoStatus,
    ValidationError,
    WaitTimeout,
)
from coordinator.api import create_app
from coordinator.client import ApiError, AsyncSubqClient, AuthError, Event, SubqClient, calls
from coordinator.local.fleet import WorkerFleet
from coordinator.models import FINISHING_AMONG_MAX, FinishingRuns
from tests.conftest import WORKER_PROCESSES
from tests.helpers import TOKEN, ApiServer, api_settings, script, state, usage_step
from tests.test_api import closed_port, spec

ONE_STEP_TOKENS = 13_500
ONE_STEP_COST_MICROS = 21_000
WAIT_S = 60


@pytest.fixture(scope="module")
def idle(settings: Settings) -> Iterator[Coordinator]:
    coord = Coordinator(api_settings(settings, key_prefix="subqclient", queue="subq-client-idle"))
    yield coord
    for key in [*coord.client.scan_iter("subqclient:*"), "subq-client-idle"]:
        coord.client.delete(key)
    coord.close()


@pytest.fixture(scope="module")
def idle_url(idle: Coordinator) -> Iterator[str]:
    with ApiServer(create_app(coordinator=idle)) as server:
        yield server.url


@pytest.fixture(scope="module")
def live_url(settings: Settings, workers: WorkerFleet) -> Iterator[str]:
    coord = Coordinator(api_settings(settings))
    with ApiServer(create_app(coordinator=coord)) as server:
        yield server.url
    coord.close()


@pytest.fixture(scope="module")
def subq(idle_url: str) -> Iterator[SubqClient]:
    with SubqClient(idle_url, token=TOKEN) as client:
        yield client


@pytest.fixture
def parent(idle: Coordinator) -> TaskRecord:
    return idle.create_task("A parent", todos="[ ] one\n[ ] two")


def _check_flow_result(done: TaskRecord, todos: list[Any], child_ids: list[str], parent_id: str) -> None:
    assert done.id == parent_id and done.status == TaskStatus.ACTIVE
    for n, item in enumerate(todos[:3]):
        assert item.subtask_id == child_ids[n]
        assert (item.tokens, item.cost_micros, item.status) == (
            ONE_STEP_TOKENS,
            ONE_STEP_COST_MICROS,
            TodoStatus.COMPLETED,
        )
    assert done.total_cost_micros == 3 * ONE_STEP_COST_MICROS


def test_sync_client_happy_path(live_url: str) -> None:
    with SubqClient(live_url, token=TOKEN) as subq:
        parent = subq.create_task("Plan and delegate", todos="[ ] T1\n[ ] T2\n[ ] T3\n[ ] T4")
        assert isinstance(parent, TaskRecord) and parent.runner == "caller"
        items = subq.get_todos(parent.id)
        specs: list[Any] = [
            SubtaskSpec(description="child 0", message=script(usage_step()), todo_id=items[0].id),
            spec(1, todo_id=items[1].id),
            spec(2, todo_id=items[2].id),
        ]
        batch = subq.delegate(parent.id, specs)
        assert batch.parent_id == parent.id and len(batch.child_ids) == 3

        done = subq.wait(parent.id, timeout_s=WAIT_S)

        todos = subq.get_todos(parent.id)
        _check_flow_result(done, todos, batch.child_ids, parent.id)
        assert subq.get_task(parent.id) == done
        tree = subq.tree(parent.id)
        assert [c.id for c in tree.children] == batch.child_ids
        assert all(c.status == TaskStatus.COMPLETED for c in tree.children)
        assert any(m.get("say") == "subtask_result" for m in subq.messages(parent.id))
        assert subq.messages(batch.child_ids[0], kind="api")[0]["kind"] == "request"
        page, cursor = subq.list_tasks(root_id=parent.id, status="completed", limit=2)
        rest, end = subq.list_tasks(root_id=parent.id, status=TaskStatus.COMPLETED, limit=2, cursor=cursor or 0)
        assert {i.id for i in [*page, *rest]} == set(batch.child_ids) and end is None
        # The rewrite keeps each linked item's figures.
        kept = subq.update_todos(parent.id, "[x] T1\n[x] T2\n[x] T3\n[-] T4")
        assert [(t.subtask_id, t.cost_micros) for t in kept[:3]] == [(c, ONE_STEP_COST_MICROS) for c in batch.child_ids]
        assert kept[3].status == TodoStatus.IN_PROGRESS
        events = list(subq.events(parent.id))
        assert [e.data["type"] for e in events[:1]] == ["delegated"]
        # As in a browser's EventSource, an event without its own id keeps the last one seen.
        assert events[-1] == Event(id=events[-2].id, event="end", data={"task_id": parent.id, "status": "active"})
        resumed = list(subq.events(parent.id, last_event_id=events[-1].id))
        assert [e.event for e in resumed] == ["end"]
        health = subq.health()
        assert health.status == "ok" and health.workers.count >= WORKER_PROCESSES


def test_async_client_happy_path(live_url: str) -> None:
    async def flow() -> None:
        async with AsyncSubqClient(live_url, token=TOKEN) as subq:
            parent = await subq.create_task("Plan and delegate", todos=[{"content": f"T{n}"} for n in range(1, 5)])
            items = await subq.get_todos(parent.id)
            batch = await subq.delegate(parent.id, [spec(n, todo_id=items[n].id) for n in range(3)], mode="parallel")
            seen = [event async for event in subq.events(parent.id)]  # ends when the parent settles
            assert seen[-1].event == "end" and seen[-1].data["status"] == "active"
            assert sum(e.data.get("type") == "child_applied" for e in seen) == 3
            done = await subq.wait(parent.id, timeout_s=WAIT_S)
            _check_flow_result(done, await subq.get_todos(parent.id), batch.child_ids, parent.id)
            tree = await subq.tree(parent.id)
            assert tree.total_cost_micros == 3 * ONE_STEP_COST_MICROS
            page, _ = await subq.list_tasks(root_id=parent.id)
            assert {i.id for i in page} == {parent.id, *batch.child_ids}
            assert await subq.messages(parent.id)
            updated = await subq.update_todos(parent.id, [{"content": "T1", "status": "completed"}])
            assert updated[0].subtask_id == batch.child_ids[0]
            assert (await subq.health()).status == "ok"

    asyncio.run(flow())


# -- errors, mapped back into the SubqError tree -----------------------------------------------


def test_errors_map_to_their_classes(idle: Coordinator, subq: SubqClient, parent: TaskRecord) -> None:
    before = state(idle, parent.id)  # its tree, and the roots and approvals indexes
    with pytest.raises(NotFoundError, match="Unknown task: 0123456789abcdef") as unknown:
        subq.get_task("0123456789abcdef")
    assert unknown.value.field == "task_id"
    for malformed in ("not-an-id", "a/b", "x?y=1", "../tasks"):
        with pytest.raises(NotFoundError):
            subq.get_todos(malformed)
    with pytest.raises(ProfileError, match="Invalid profile: gpt-9") as profile:
        subq.delegate(parent.id, [spec(0), spec(1, profile="gpt-9")])
    assert profile.value.field == "subtasks.1.profile"
    with pytest.raises(TodoError) as todo:
        subq.update_todos(parent.id, [{"content": "ok"}, {"content": " "}])
    assert todo.value.field == "todos.1.content"
    with pytest.raises(ValidationError) as empty:
        subq.delegate(parent.id, [])
    assert (type(empty.value), empty.value.field) == (ValidationError, "subtasks")
    with pytest.raises(ValidationError) as limit:
        subq.list_tasks(limit=0)
    assert limit.value.field == "limit"
    # An over-long prompt is refused before sending (the service's own check); an oversize
    # body of another kind reaches the server's limit.
    with pytest.raises(ValidationError, match="prompt is 1048577 characters; the limit is 200000"):
        subq.create_task("x" * (idle.settings.api_max_body_bytes + 1))
    with pytest.raises(ApiError) as too_big:
        subq.update_todos(parent.id, "[ ] " + "x" * idle.settings.api_max_body_bytes)
    assert (too_big.value.code, too_big.value.status_code) == ("body_too_large", 413)
    assert state(idle, parent.id) == before, "refused calls changed nothing"

    idle.delegate(parent.id, [spec()])
    with pytest.raises(StateError, match="is delegated, not active") as wrong_state:
        subq.delegate(parent.id, [spec(1)])
    assert wrong_state.value.field == "task_id"


def test_wait_times_out_and_checks_its_argument(idle: Coordinator, subq: SubqClient, parent: TaskRecord) -> None:
    idle.delegate(parent.id, [spec()])  # nobody runs the child
    with pytest.raises(WaitTimeout, match=f"Task {parent.id} is still delegated after 0.3s"):
        subq.wait(parent.id, timeout_s=0.3)
    with pytest.raises(ValidationError) as negative:
        subq.wait(parent.id, timeout_s=-1)
    assert negative.value.field == "timeout_s"
    assert subq.wait(idle.create_task("settled").id, timeout_s=0).status == TaskStatus.ACTIVE


def _raised_at_once(call: Any) -> BaseException | None:
    """What `call()` raised, run in a thread given REFUSAL_S: a wait that never ends fails the test, not hangs it."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            raised.append(None)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(REFUSAL_S)
    assert raised, f"still waiting after {REFUSAL_S} s"
    return raised[0]


# Far more than a refusal takes, far less than pytest's timeout.
REFUSAL_S = 10


def test_a_nan_timeout_is_refused_not_a_wait_without_end(
    idle: Coordinator, subq: SubqClient, parent: TaskRecord
) -> None:
    """`nan < 0` is False: wait(timeout_s=nan) passed the check, and a NaN deadline never came. inf still waits
    without end, and answers a settled task at once."""
    idle.delegate(parent.id, [spec()])  # nobody runs the child: only a deadline ends a wait on it
    for wait in (subq.wait, idle.wait):
        refused = _raised_at_once(lambda wait=wait: wait(parent.id, timeout_s=float("nan")))
        assert isinstance(refused, ValidationError), refused
        assert (refused.message, refused.field) == ("timeout_s must be 0 or more seconds, not nan", "timeout_s")
        settled = idle.create_task("settled").id
        assert wait(settled, timeout_s=float("inf")).status == TaskStatus.ACTIVE


def test_auth_and_transport_errors(idle_url: str) -> None:
    for token in (None, "wrong"):
        with SubqClient(idle_url, token=token) as anonymous, pytest.raises(AuthError) as denied:
            anonymous.list_tasks()
        assert (denied.value.code, denied.value.status_code, denied.value.field) == (
            "unauthorized",
            401,
            "Authorization",
        )
        assert isinstance(denied.value, SubqError)
    with SubqClient(f"http://127.0.0.1:{closed_port()}", token=TOKEN) as nowhere, pytest.raises(ApiError) as down:
        nowhere.get_task("0123456789abcdef")
    assert down.value.code == "api_unreachable" and down.value.status_code is None


def test_async_errors_map_to_their_classes(idle: Coordinator, idle_url: str, parent: TaskRecord) -> None:
    idle.delegate(parent.id, [spec()])

    async def calls() -> None:
        async with AsyncSubqClient(idle_url, token=TOKEN) as subq:
            with pytest.raises(NotFoundError):
                await subq.get_task("not-an-id")
            with pytest.raises(StateError):
                await subq.delegate(parent.id, [spec(1)])
            with pytest.raises(WaitTimeout):
                await subq.wait(parent.id, timeout_s=0.2)
            with pytest.raises(NotFoundError):
                [e async for e in subq.events("0123456789abcdef")]
        async with AsyncSubqClient(idle_url, token="wrong") as denied:
            with pytest.raises(AuthError):
                await denied.tree(parent.id)
        async with AsyncSubqClient(f"http://127.0.0.1:{closed_port()}") as nowhere:
            with pytest.raises(ApiError, match="unreachable"):
                await nowhere.health()

    asyncio.run(calls())


def test_events_raise_for_unknown_tasks(subq: SubqClient) -> None:
    with pytest.raises(NotFoundError):
        next(subq.events("0123456789abcdef"))


# -- what the client makes of answers it did not expect (a fake server) --------------------------


def _fake(status: int, body: Any = None, content: bytes | None = None) -> SubqClient:
    def answer(request: httpx.Request) -> httpx.Response:
        if content is not None:
            return httpx.Response(status, content=content)
        return httpx.Response(status, json=body)

    return SubqClient("http://subq.test", token=TOKEN, transport=httpx.MockTransport(answer))


def test_unknown_codes_and_bad_answers_are_api_errors() -> None:
    with pytest.raises(ApiError) as unknown:
        _fake(418, {"code": "teapot", "message": "I am one", "field": "kettle"}).get_task("0123456789abcdef")
    assert (unknown.value.code, unknown.value.message, unknown.value.field, unknown.value.status_code) == (
        "teapot", "I am one", "kettle", 418,
    )  # fmt: skip
    with pytest.raises(ApiError) as not_json:
        _fake(502, content=b"<html>Bad Gateway</html>").get_task("0123456789abcdef")
    assert (not_json.value.code, not_json.value.status_code) == ("bad_response", 502)
    assert "Bad Gateway" in not_json.value.message
    assert not_json.value.message.startswith(
        "HTTP 502 from GET /v1/tasks/0123456789abcdef, which is not an answer of the subq API (is SUBQ_API_URL"
    ), not_json.value.message
    with pytest.raises(ApiError) as elsewhere:  # another server at the URL (Flower's port), its page shown as text
        _fake(404, content=b"<!doctype html>\n<title>\x1b]0;x\x07Flower</title>").get_task("0123456789abcdef")
    assert "\n" not in elsewhere.value.message and "\x1b" not in elsewhere.value.message
    assert "<title>\\x1b]0;x\\x07Flower</title>" in elsewhere.value.message, elsewhere.value.message
    with pytest.raises(ApiError) as wrong_shape:
        _fake(200, {"id": "x"}).get_task("0123456789abcdef")
    assert wrong_shape.value.code == "bad_response"
    with pytest.raises(StateError):  # a known code maps to its class whatever the status
        _fake(409, {"code": "wrong_state", "message": "busy", "field": None}).get_todos("0123456789abcdef")


def test_health_of_a_server_whose_redis_is_down_is_a_value() -> None:
    down = {
        "status": "down",
        "redis": {"ok": False, "error": "Redis is unreachable"},
        "workers": {"count": 0, "names": []},
    }
    health = _fake(503, down).health()
    assert (health.status, health.redis.ok) == ("down", False)


def test_requests_carry_the_token_and_an_id_of_no_tasks_shape_is_sent_nowhere() -> None:
    """An id of no task's shape is refused as on Redis, before any request: percent-encoded, ".." still became
    another path (httpx resolves dot segments: `cancel ..` was POST /v1/cancel), and the server decodes "a%2Fb"
    into a path before it routes ("<root>/todos" reached the todo list's route, and its answer read as broken)."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(404, json={"code": "not_found", "message": "Unknown", "field": "task_id"})

    with SubqClient("http://subq.test/", token=TOKEN, transport=httpx.MockTransport(answer)) as subq:
        for malformed in ("a/b?c", "..", "", "0123456789abcdef/todos"):
            with pytest.raises(NotFoundError, match="is not a subq task or batch id"):
                subq.get_todos(malformed)
            with pytest.raises(NotFoundError, match="is not a subq task or batch id"):
                subq.cancel(malformed, "r")
        with pytest.raises(NotFoundError, match="is not a subq task or batch id") as approval:
            subq.decide("../approvals", "approve")
        assert approval.value.field == "approval_id"
        assert seen == [], "no request was sent"
        with pytest.raises(NotFoundError):
            subq.get_todos("0123456789abcdef")
    assert seen[0].headers["authorization"] == f"Bearer {TOKEN}"
    assert seen[0].url.raw_path == b"/v1/tasks/0123456789abcdef/todos"


def test_input_no_request_can_carry_is_refused_before_sending() -> None:
    """A command-line argument that is not UTF-8 (a lone surrogate) was an encoding error deep in httpx, a
    traceback from the CLI; a delivery id "..", "." or "a/b" reached another route (httpx resolves dot segments).
    Each is refused as the service refuses it on Redis, and nothing is sent."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(404, json={"code": "not_found", "message": "Unknown", "field": "delivery_id"})

    root, child = "0123456789abcdef", "0123456789abcdef-0123456789ab"
    with SubqClient("http://subq.test", token=TOKEN, transport=httpx.MockTransport(answer)) as subq:
        refusals: list[tuple[Any, type[SubqError], str, str]] = [
            (lambda: subq.create_task("ok", profile="\udcff"), ProfileError, "profile",
             "Invalid profile: '\\udcff' holds a lone surrogate '\\udcff' at character 1, which is no character"),
            (lambda: subq.audit(before="\udcff"), ValidationError, "before",
             "before must be an entry id as <ms>-<n>, not '\\udcff'"),
            (lambda: subq.audit(before="x"), ValidationError, "before", "before must be an entry id as <ms>-<n>, not 'x'"),
            (lambda: subq.list_approvals("\udcff"), NotFoundError, "root_id",
             "Unknown id: '\\udcff' is not a subq task or batch id"),
            (lambda: subq.list_approvals(child), ValidationError, "root_id",
             f"root_id: {child} is not a root task (its root is {root})"),
            (lambda: subq.list_tasks(root_id=child), ValidationError, "root_id",
             f"root_id: {child} is not a root task (its root is {root})"),
            # Any string of a body, named by its path.
            (lambda: subq.create_task("ok", todos="[ ] caf\udce9"), ValidationError, "todos",
             "todos holds a lone surrogate '\\udce9' at character 8, which is no character"),
            (lambda: subq.update_todos(root, [{"content": "caf\udce9"}]), ValidationError, "todos.0.content",
             "todos.0.content holds a lone surrogate '\\udce9' at character 4, which is no character"),
            (lambda: subq.delegate(root, [{"description": "d", "message": "m", "profile": "\udcff"}]), ValidationError,
             "subtasks.0.profile", "subtasks.0.profile holds a lone surrogate '\\udcff' at character 1, which is no character"),
        ]  # fmt: skip
        for delivery_id in ("\udcff", ".", "..", "", "a/b", "evt_x_1.0/..", "evt_x_1.0\n"):
            refusals.append(
                (lambda d=delivery_id: subq.redeliver(root, d), NotFoundError, "delivery_id",
                 f"Unknown delivery {delivery_id!r} of task {root}")
            )  # fmt: skip
        for call, error, field, message in refusals:
            with pytest.raises(error) as refused:
                call()
            assert (refused.value.message, refused.value.field) == (message, field)
        assert seen == [], "no request was sent"
        with pytest.raises(NotFoundError):  # a delivery id of the shape subq gives one is sent, as it is
            subq.redeliver(root, f"evt_{root}_12.c")
    assert seen[0].url.raw_path == f"/v1/tasks/{root}/deliveries/evt_{root}_12.c/redeliver".encode()


def test_the_root_filter_is_sent_as_root_id() -> None:
    """GET /v1/tasks and GET /v1/approvals filter by `root_id`, the name the service uses."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/approvals":
            return httpx.Response(200, json={"approvals": []})
        return httpx.Response(200, json={"items": [], "next_cursor": None})

    async def both_async() -> None:
        async with AsyncSubqClient("http://subq.test", transport=httpx.MockTransport(answer)) as subq:
            await subq.list_tasks(root_id="0123456789abcdef", status="completed")
            await subq.list_approvals("0123456789abcdef")

    with SubqClient("http://subq.test", transport=httpx.MockTransport(answer)) as subq:
        assert subq.list_tasks(root_id="0123456789abcdef", status=TaskStatus.COMPLETED, limit=5) == ([], None)
        assert subq.list_approvals("0123456789abcdef") == []
        subq.list_approvals()
    asyncio.run(both_async())
    queries = [dict(r.url.params) for r in seen]
    assert queries[0] == {"root_id": "0123456789abcdef", "status": "completed", "limit": "5", "cursor": "0"}
    assert queries[1] == {"root_id": "0123456789abcdef"} and queries[2] == {}
    assert queries[3]["root_id"] == queries[4]["root_id"] == "0123456789abcdef"


def test_event_stream_parsing_and_a_mid_stream_error() -> None:
    body = (
        b": ping\n\n"
        b'id: 1-0\ndata: {"type": "delegated",\ndata:  "children": "2"}\n\n'
        b": ping - keep-alive\n"
        b'event: error\ndata: {"code": "store_error", "message": "Redis is unreachable", "field": null}\n\n'
    )

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["accept"] == "text/event-stream"
        assert request.headers["last-event-id"] == "0-1"
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    seen: list[Event] = []
    with SubqClient("http://subq.test", transport=httpx.MockTransport(answer)) as subq:
        with pytest.raises(StoreError, match="Redis is unreachable"):
            for event in subq.events("0123456789abcdef", last_event_id="0-1"):
                seen.append(event)
    assert seen == [Event(id="1-0", event="message", data={"type": "delegated", "children": "2"})]


# -- wait's hold after a stop, step by step (calls.wait is a generator of requests: no server needed) ------------

TASK_ID = "0123456789abcdef"
RUNS = FinishingRuns(task_id=TASK_ID, task_ids=[f"{TASK_ID}-000000000001"], lapse_s=15)


def _record(status: str, cost_micros: int = 0) -> TaskRecord:
    return TaskRecord(id=TASK_ID, root_id=TASK_ID, status=TaskStatus(status), prompt="p", profile="offline",
                      runner="agent", created_at=1.0, updated_at=1.0, total_cost_micros=cost_micros)  # fmt: skip


def _asked(step: calls.Call[Any] | calls.Sleep) -> str:
    """What a step of wait's asks: 'task', 'finishing' or 'sleep'."""
    if isinstance(step, calls.Sleep):
        return "sleep"
    return "finishing" if step.path.endswith("/finishing") else "task"


def _drive(
    steps: Any, answers: dict[str, list[object]], slept: list[float] | None = None
) -> tuple[TaskRecord, list[str]]:
    """Answer wait's steps in turn from `answers` (by what each asks; a sleep is slept, and noted in `slept`),
    until it returns."""
    asked: list[str] = []
    step = next(steps)
    try:
        while True:
            asked.append(kind := _asked(step))
            if isinstance(step, calls.Sleep):
                assert 0 <= step.seconds <= 1.0, step
                time.sleep(step.seconds)
                (slept if slept is not None else []).append(step.seconds)
                step = steps.send(None)
            else:
                queue = answers[kind]
                step = steps.send(queue.pop(0) if len(queue) > 1 else queue[0])
    except StopIteration as stop:
        return stop.value, asked


def test_a_completed_tasks_wait_asks_nothing_after_it() -> None:
    done, asked = _drive(calls.wait(TASK_ID, 60), {"task": [_record("completed")]})
    assert done == _record("completed") and asked == ["task"], "one read, no look at the finishing runs"


def test_a_stopped_tasks_wait_looks_at_its_runs_until_none_is_left_then_reads_it_again() -> None:
    answers: dict[str, list[object]] = {
        "task": [_record("cancelled"), _record("cancelled", 900)],
        "finishing": [RUNS, RUNS.model_copy(update={"task_ids": []})],
    }
    done, asked = _drive(calls.wait(TASK_ID, 60), answers)
    assert done == _record("cancelled", 900), "the record read after the last look, with the late spend"
    # A walk, a look among the runs it found, and a walk more once none of them is left.
    assert asked == ["task", "finishing", "sleep", "finishing", "sleep", "finishing", "task"]


@pytest.mark.parametrize("found", [1, 2, FINISHING_AMONG_MAX, FINISHING_AMONG_MAX + 1])
def test_a_stopped_tasks_wait_looks_again_only_among_the_runs_it_found(found: int) -> None:
    """The first look walks the subtree; each later one names the tasks the last found (`among`), up to
    FINISHING_AMONG_MAX of them (a URL of a few KB), and asks for the whole subtree again past that."""
    runs = RUNS.model_copy(update={"task_ids": [f"{TASK_ID}-{n:012x}" for n in range(1, found + 1)]})
    steps = calls.wait(TASK_ID, 60)
    next(steps)
    first = steps.send(_record("cancelled"))
    assert isinstance(first, calls.Call) and first.path.endswith("/finishing") and first.params == {}, first
    assert isinstance(steps.send(runs), calls.Sleep)
    second = steps.send(None)
    assert isinstance(second, calls.Call) and second.path.endswith("/finishing"), second
    among = ",".join(runs.task_ids)
    assert second.params == ({"among": among} if found <= FINISHING_AMONG_MAX else {}), second.params
    assert len(among) < 4_000
    # None of them is left: one walk more (a run begun since the first look), then the record.
    assert isinstance(steps.send(runs.model_copy(update={"task_ids": []})), calls.Sleep)
    last = steps.send(None)
    assert isinstance(last, calls.Call) and last.path.endswith("/finishing") and last.params == {}, last
    assert _asked(steps.send(runs.model_copy(update={"task_ids": []}))) == "task"


@pytest.mark.parametrize(("timeout_s", "lapse_s"), [(1.0, 60), (60, 1.0)])
def test_a_stopped_tasks_wait_holds_no_longer_than_its_timeout_or_the_lapse(timeout_s: float, lapse_s: float) -> None:
    """Runs that never let go (a lease renewed on): the hold ends at the first of the timeout and the lapse (its
    sleeps are cut at the hold's end), and the task is read again."""
    runs = RUNS.model_copy(update={"lapse_s": lapse_s})
    slept: list[float] = []
    answers: dict[str, list[object]] = {"task": [_record("failed")], "finishing": [runs]}
    done, asked = _drive(calls.wait(TASK_ID, timeout_s), answers, slept)
    assert done == _record("failed") and asked[:3] == ["task", "finishing", "sleep"] and asked[-1] == "task", asked
    assert 0.5 < sum(slept) <= 1.0 + 1e-6, slept  # it held (more than half, a loaded host's lateness aside)


def test_a_wait_whose_task_is_retried_during_the_hold_waits_for_it_again() -> None:
    answers: dict[str, list[object]] = {
        "task": [_record("cancelled"), _record("active"), _record("completed", 1_500)],
        "finishing": [RUNS.model_copy(update={"task_ids": []})],
    }
    done, asked = _drive(calls.wait(TASK_ID, 60), answers)
    assert done == _record("completed", 1_500) and asked == ["task", "finishing", "task", "sleep", "task"]


def test_an_api_without_the_finishing_route_answers_with_the_record() -> None:
    """A 404 from /finishing (an API older than this client, or the task gone), whatever its body, reads as None:
    nothing to wait for. A 200 of another shape is the server's error, as for every call."""
    steps = calls.wait(TASK_ID, 60)
    next(steps)
    finishing = steps.send(_record("failed"))
    assert isinstance(finishing, calls.Call)
    for body in ('{"detail": "Not Found"}', '{"code": "not_found", "message": "Unknown task"}', "<html>gone</html>"):
        assert calls.result(finishing, httpx.Response(404, text=body)) is None
    with pytest.raises(ApiError, match="does not match the API") as bad:
        calls.result(finishing, httpx.Response(200, json={"task_ids": "not a list"}))
    assert bad.value.code == "bad_response"
    assert _asked(steps.send(None)) == "task"


# -- a stream that closes before its end is opened again from its last event ------------------------------------


class CuttingProxy:
    """A TCP relay to `upstream` that closes the first event stream through it after `cut_s` (an API restarting,
    a proxy's limit on a response's time); everything else passes."""

    def __init__(self, upstream: str, cut_s: float) -> None:
        self.upstream_port = int(upstream.rsplit(":", 1)[1])
        self.cut_s, self.cuts, self.port = cut_s, 0, 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._serving = self._loop.create_task(self._serve())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._serving)
        self._loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await server.serve_forever()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        head = await reader.read(65536)
        up_writer.write(head)
        cut = b"/events" in head and self.cuts == 0
        self.cuts += int(cut)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        both = asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        if cut:
            await asyncio.sleep(self.cut_s)
            both.cancel()
            writer.close()
            up_writer.close()
        else:
            await both

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._serving.cancel)
        self._thread.join(10)


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_stream_cut_before_its_end_is_opened_again_from_its_last_event(
    idle: Coordinator, idle_url: str, face: str
) -> None:
    """A stream closed before its `end` (the API restarting, a proxy's limit) ended the client's iteration as if the
    tree had: `async for event in subq.events(root)` went on to read figures of a tree still running. It is now
    opened again from its last event id: every event once, in order, and the `end` last."""
    root = idle.create_task("Followed through a proxy", todos="[ ] a")
    idle.delegate(root.id, [{"description": "a", "message": "m"}])
    proxy = CuttingProxy(idle_url, cut_s=1.0)
    seen: list[Event] = []

    def cancel_after_the_cut() -> None:
        time.sleep(2.0)
        idle.cancel(root.id, "seen through the proxy")

    async def read_async() -> None:
        async with AsyncSubqClient(proxy.url, token=TOKEN) as client:
            seen.extend([event async for event in client.events(root.id)])

    stopper = threading.Thread(target=cancel_after_the_cut)
    stopper.start()
    try:
        if face == "sync":
            with SubqClient(proxy.url, token=TOKEN) as client:
                seen.extend(client.events(root.id))
        else:
            asyncio.run(read_async())
    finally:
        stopper.join()
        proxy.close()
    assert proxy.cuts == 1
    assert seen[-1].event == "end" and seen[-1].data["status"] == "cancelled", seen[-1]
    ids = [event.id for event in seen if event.event != "end"]
    assert len(ids) == len(set(ids)) >= 2, ids
    assert ids == sorted(ids, key=lambda i: tuple(int(p) for p in i.split("-")))


def test_a_stream_that_keeps_failing_is_given_up_within_the_clients_timeout() -> None:
    """Opened again while its failures last under the client's timeout, then the last failure is raised."""
    opened: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        opened.append(request.headers.get("last-event-id"))
        if len(opened) == 1:
            body = b'id: 5-0\ndata: {"type": "task_status"}\n\n'
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return httpx.Response(502, content=b"<html>Bad Gateway</html>")

    started = time.monotonic()
    with SubqClient("http://subq.test", timeout_s=2.0, transport=httpx.MockTransport(answer)) as subq:
        seen = []
        with pytest.raises(ApiError) as failed:
            seen.extend(subq.events("0123456789abcdef"))
    assert [event.id for event in seen] == ["5-0"]
    assert failed.value.status_code == 502 and "not an answer of the subq API" in failed.value.message
    assert opened[0] is None and set(opened[1:]) == {"5-0"} and len(opened) >= 3, opened
    assert time.monotonic() - started < 10


def test_an_answer_httpx_cannot_read_is_one_error_not_a_traceback() -> None:
    """A proxy's broken compression (`Content-Encoding: gzip` on a body that is not) raised httpx's DecodingError,
    which no handler named: the CLI showed a traceback."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"not gzip at all", headers={"content-encoding": "gzip"})

    with SubqClient("http://subq.test", token=TOKEN, transport=httpx.MockTransport(answer)) as subq:
        with pytest.raises(ApiError) as failed:
            subq.get_task("0123456789abcdef")
    assert failed.value.code == "bad_response"
    assert failed.value.message.startswith("The subq API at http://subq.test answered with what could not be read")
