"""Flower sees every subq task by name, with readable arguments and live progress, behind basic auth.

Flower is a real process (`subq flower`, which execs `celery -A workers.flower
flower`) on the test Redis; everything is read through Flower's own HTTP API.
"""

from __future__ import annotations

import json
import pickle
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from celery import Celery

from coordinator import Coordinator, Settings
from coordinator.celery_app import describe_kwargs
from coordinator.local.ports import free_port
from coordinator.local.up import Service
from tests import helpers
from tests.agents import USAGE, agent, reply
from tests.helpers import script, usage_step

# Sends per path in the no-prompt test: the acceptance figure.
SENDS_PER_PATH = 50
# A model response slow enough to abort the run while it waits for it.
SLOW_MS = 20_000

USER, PASSWORD = "flower-test", uuid.uuid4().hex
# Flower connects its event consumer a few seconds after it listens; a loaded
# 2-core machine can take far longer.
SEEN_TIMEOUT_S = 90.0
T = TypeVar("T")
# Long enough to observe the running child between its two model responses.
THINKING_MS = 3000


@pytest.fixture(scope="module")
def flower_url(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    env = {
        "SUBQ_REDIS_URL": settings.redis_url or "", "SUBQ_KEY_PREFIX": settings.key_prefix,
        "SUBQ_QUEUE": settings.queue, "SUBQ_FLOWER_USER": USER, "SUBQ_FLOWER_PASSWORD": PASSWORD,
    }  # fmt: skip
    argv = [sys.executable, "-m", "coordinator", "flower", "--port", str(port)]
    log = tmp_path_factory.mktemp("flower") / "flower.log"
    with Service("Flower", argv, {**_base_env(), **env}, log) as flower:
        flower.wait_listening("127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("SUBQ_", "FLOWER_"))}


def flower_get(url: str, path: str, auth: tuple[str, str] | None = (USER, PASSWORD)) -> httpx.Response:
    return httpx.get(f"{url}{path}", auth=auth, timeout=10)


def eventually(probe: Callable[[], T | None], what: str) -> T:
    return helpers.eventually(probe, f"Flower show {what}", SEEN_TIMEOUT_S)


def tasks_named(url: str, name: str) -> dict[str, dict[str, Any]]:
    response = flower_get(url, f"/api/tasks?taskname={name}")
    assert response.status_code == 200, response.text
    found: dict[str, dict[str, Any]] = response.json()
    return found


@pytest.fixture(scope="module")
def listening(flower_url: str, coordinator_for_module: Coordinator, settings: Settings) -> str:
    """Flower's event consumer is connected: a submission sent now shows up (before, it might be missed)."""
    marker = f"SECRET-{uuid.uuid4().hex}"

    def seen() -> dict[str, Any] | None:
        coordinator_for_module.app.send_task(
            "subq.submit", kwargs={"prompt": marker, "profile": "nope"}, queue=settings.queue
        )
        time.sleep(0.5)
        # A task shows its arguments once a worker has received it (sent events carry none).
        return next((t for t in tasks_named(flower_url, "subq.submit").values() if t["kwargs"]), None)

    submitted = eventually(seen, "a subq.submit task")
    assert marker not in str(submitted)
    assert submitted["kwargs"].startswith(f"prompt=<{len(marker)} chars>")
    return flower_url


@pytest.fixture(scope="module")
def coordinator_for_module(settings: Settings, workers: Any) -> Iterator[Coordinator]:
    coord = Coordinator(settings)
    yield coord
    coord.close()


def test_a_delegation_is_visible_by_name_with_ids_and_live_progress(
    listening: str, coordinator_for_module: Coordinator
) -> None:
    coord, url = coordinator_for_module, listening
    secret = f"SECRET-{uuid.uuid4().hex}"
    parent = coord.create_task(f"Q3 report {secret}", todos="[ ] Collect figures\n[ ] Summarise feedback")
    items = coord.get_todos(parent.id)
    slow = script(
        {"tool_calls": [{"name": "update_todo_list", "args": {"todos": "[-] count"}}], "usage": USAGE},
        {"reply": "counted", "usage": USAGE, "latency_ms": THINKING_MS},
        text=f"Collect the figures {secret}",
    )
    batch = coord.delegate(parent.id, [
        {"description": "Collect figures", "message": slow, "todo_id": items[0].id},
        {"description": "Summarise feedback", "message": script(usage_step(), text=secret)},
    ])  # fmt: skip
    collect, summarise = batch.child_ids

    # While the slow child thinks about its second response, Flower shows its progress event.
    running = eventually(
        lambda: (
            (info := flower_get(url, f"/api/task/info/{collect}")).status_code == 200
            and info.json()["state"] == "PROGRESS"
            and info.json()
        ),
        "the child's task-progress event",
    )
    assert running["name"] == "subq.run_task"
    coord.wait(parent.id, 60)

    def ended() -> dict[str, dict[str, Any]] | None:
        runs = tasks_named(url, "subq.run_task")
        done = {k: v for k, v in runs.items() if k in batch.child_ids and v["state"] == "SUCCESS"}
        return done if len(done) == 2 else None

    runs = eventually(ended, "both children succeeded")
    assert runs[collect]["args"] == (
        f"task={collect} parent={parent.id} todo={items[0].id} tenant=default priority=3 desc='Collect figures'"
    )
    assert runs[summarise]["args"].startswith(f"task={summarise} parent={parent.id} todo={items[1].id} ")
    for shown in runs.values():
        assert secret not in f"{shown['args']} {shown['kwargs']}", "Flower shows a prompt or a message"


def test_an_agent_root_shows_no_prompt_text(listening: str, coordinator_for_module: Coordinator) -> None:
    secret = f"SECRET-{uuid.uuid4().hex}"
    root = coordinator_for_module.create_task(agent(reply("done"), text=f"Plan {secret}"), run=True)
    coordinator_for_module.wait(root.id, 60)
    # Its task-sent event (the caller's, no arguments) can show before the worker's, which carry them.
    shown = eventually(
        lambda: (run := tasks_named(listening, "subq.run_task").get(root.id)) and run["state"] == "SUCCESS" and run,
        "the root's run, ended",
    )
    assert shown["args"].startswith(f"task={root.id} parent=-")
    assert secret not in shown["args"]


def test_flower_refuses_requests_without_the_credentials(flower_url: str) -> None:
    for path in ("/api/tasks", "/api/workers", "/"):
        assert flower_get(flower_url, path, auth=None).status_code == 401
    assert flower_get(flower_url, "/api/tasks", auth=(USER, "wrong")).status_code == 401
    assert flower_get(flower_url, "/api/tasks").status_code == 200


def test_flowers_pages_refuse_to_be_framed(flower_url: str) -> None:
    """Its buttons revoke, terminate and abort (a subtree's stop): a page that framed them over a browser keeping
    the login could have an operator click one. Flower sends neither header; subq's install() adds both."""
    for path, auth in (("/", (USER, PASSWORD)), ("/api/tasks", (USER, PASSWORD)), ("/", None)):
        answer = flower_get(flower_url, path, auth=auth)
        assert answer.headers.get("X-Frame-Options") == "DENY", (path, dict(answer.headers))
        assert answer.headers.get("Content-Security-Policy") == "frame-ancestors 'none'", path


def test_metrics_and_healthcheck_need_the_credentials_too(flower_url: str) -> None:
    """Flower serves both without its login; subq's install() puts them behind it (workers/flower_setup.py)."""
    for path in ("/metrics", "/healthcheck"):
        for auth in (None, (USER, "wrong"), ("someone", PASSWORD)):
            refused = flower_get(flower_url, path, auth=auth)
            assert refused.status_code == 401, (path, auth, refused.text)
            assert refused.headers["WWW-Authenticate"] == 'Basic realm="flower"'
            assert "flower_" not in refused.text
    metrics = flower_get(flower_url, "/metrics")
    assert metrics.status_code == 200 and "flower_events_total" in metrics.text, metrics.text[:500]
    health = flower_get(flower_url, "/healthcheck")
    assert health.status_code == 200 and health.text == "OK"


def test_every_flower_page_asks_for_the_login(flower_url: str) -> None:
    """Each route Flower serves, read without credentials, is refused: a route Flower adds open fails here."""
    import flower.urls
    from tornado.web import RequestHandler

    open_routes = {r"/login/?", r"/logout", r"/static/(.*)", r".*"}  # the login itself, static files, the 404 page
    checked = []
    for route in flower.urls.handlers:
        pattern, handler = (
            (route.regex.pattern.rstrip("$"), route.handler_class) if hasattr(route, "regex") else route[:2]
        )
        if pattern in open_routes or handler.get is RequestHandler.get:  # a POST-only route: GET is a 405 for anyone
            continue
        path = pattern.replace("(.+)", "x").replace("(.*)", "x")
        answer = flower_get(flower_url, path, auth=None)
        assert answer.status_code == 401, (path, answer.status_code, answer.text[:200])
        checked.append(path)
    assert {"/metrics", "/healthcheck", "/api/tasks", "/"} <= set(checked), checked


def test_flower_refuses_to_start_open(settings: Settings, tmp_path: Path) -> None:
    """In this process (the check is the command's words; a start of its own cost 1.2 s of CPU): it refuses
    before it would exec Flower, which the in-process runner would fail on."""
    from tests.test_cli import cli

    proc = cli("flower", "--port", str(free_port()), env={"SUBQ_REDIS_URL": settings.redis_url or ""})
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "subq: Flower needs basic auth: pass --password (or set SUBQ_FLOWER_PASSWORD), or --no-auth to run it open"
    )


def plain_client(settings: Settings) -> Celery:
    """A producer that imports nothing from subq and sends its own task-sent events, with Python's repr of the kwargs."""
    client = Celery(broker=settings.redis_url, backend=settings.redis_url, set_as_current=False)
    client.conf.update(task_serializer="json", task_send_sent_event=True)
    return client


def test_no_path_shows_a_prompt(
    listening: str, settings: Settings, live_http: httpx.Client, coordinator_for_module: Coordinator
) -> None:
    """50 sends through Flower's send-task, 50 plain send_task calls, 50 API runs: no prompt text in Flower."""
    url, secret = listening, f"SECRET-{uuid.uuid4().hex}"
    sent: dict[str, str] = {}  # Celery id -> path
    summaries: dict[str, str] = {}  # Celery id of a submission -> what Flower must show
    with httpx.Client(auth=(USER, PASSWORD), timeout=30) as flower, plain_client(settings) as client:
        for n in range(SENDS_PER_PATH):  # a burst through each path, then one poll of Flower
            kwargs = {"prompt": f"{secret} flower {n}", "todos": f"[ ] {secret}", "run": False}
            response = flower.post(f"{url}/api/task/send-task/subq.submit", json={"kwargs": kwargs})
            assert response.status_code == 200, response.text
            sent[response.json()["task-id"]] = "flower"
            summaries[response.json()["task-id"]] = describe_kwargs(kwargs)
            kwargs = {"prompt": f"{secret} plain send_task {n}", "todos": f"[ ] {secret}", "run": False}
            plain_id = client.send_task("subq.submit", kwargs=kwargs, queue=settings.queue).id
            sent[plain_id], summaries[plain_id] = "send_task", describe_kwargs(kwargs)
            body = {"prompt": agent(reply("done"), text=f"{secret} {n}"), "run": True}
            created = live_http.post("/v1/tasks", json=body)
            assert created.status_code == 201, created.text
            sent[created.json()["id"]] = "api"

    def all_done() -> dict[str, dict[str, Any]] | None:
        shown = flower_get(url, "/api/tasks").json()
        done = {k: shown[k] for k in sent if k in shown and shown[k]["state"] == "SUCCESS"}
        return done if len(done) == len(sent) else None

    shown = eventually(all_done, f"all {len(sent)} tasks succeeded")
    assert secret not in flower_get(url, "/api/tasks").text, "Flower's task list shows a prompt"
    for task_id, path in sent.items():
        info = flower_get(url, f"/api/task/info/{task_id}")
        assert secret not in info.text, f"Flower shows a prompt sent through {path}"
        if path == "api":
            assert shown[task_id]["args"].startswith(f"task={task_id} parent=- "), shown[task_id]
        else:  # the worker's summary, whichever event arrived last
            assert shown[task_id]["kwargs"] == summaries[task_id], shown[task_id]


def test_a_queued_task_shows_no_arguments(listening: str, settings: Settings) -> None:
    """A sent event alone (no worker has received the task yet) never puts a prompt on screen."""
    secret = f"SECRET-{uuid.uuid4().hex}"
    with plain_client(settings) as client:
        client.connection_for_write().default_channel.client.delete("subq-flower-nobody")
        task_id = client.send_task("subq.submit", kwargs={"prompt": secret}, queue="subq-flower-nobody").id
    shown = eventually(lambda: flower_get(listening, "/api/tasks").json().get(task_id), "the queued task")
    assert shown["state"] == "PENDING"
    assert shown["name"] == "subq.submit"
    assert secret not in flower_get(listening, f"/api/task/info/{task_id}").text


def test_a_batchs_queued_children_show_from_its_one_sent_message(listening: str, settings: Settings) -> None:
    """A parallel batch's task-sent events are published as one message: Flower shows every child queued."""
    queue, secret = f"subq-flower-batch-{uuid.uuid4().hex[:8]}", f"SECRET-{uuid.uuid4().hex}"
    # A queue no worker consumes and keys of its own (no reconciler publishes them again).
    coord = Coordinator(settings.model_copy(update={"queue": queue, "key_prefix": "subqflowerbatch"}))
    try:
        parent = coord.create_task("a parent", todos="[ ] a\n[ ] b\n[ ] c")
        batch = coord.delegate(
            parent.id, [{"description": d, "message": script(usage_step(), text=secret)} for d in "abc"]
        )

        def queued() -> dict[str, dict[str, Any]] | None:
            shown = {k: v for k, v in tasks_named(listening, "subq.run_task").items() if k in batch.child_ids}
            return shown if len(shown) == len(batch.child_ids) else None

        shown = eventually(queued, "the batch's queued children")
        for child_id, task in shown.items():
            assert (task["state"], task["name"], task["root_id"]) == ("PENDING", "subq.run_task", child_id)
            assert task["sent"] and task["received"] is None
            assert task["args"] is None, "a sent event's arguments are dropped (workers/flower_setup.py)"
        assert secret not in flower_get(listening, "/api/tasks").text
    finally:
        coord.client.delete(queue)
        coord.close()


def test_results_and_abort_answer(listening: str, coordinator_for_module: Coordinator) -> None:
    url, coord = listening, coordinator_for_module
    with httpx.Client(auth=(USER, PASSWORD), timeout=30) as flower:
        # subq.submit stores its Celery result: Flower shows it.
        submitted = flower.post(f"{url}/api/task/send-task/subq.submit", json={"kwargs": {"prompt": "p", "run": False}})
        assert submitted.status_code == 200, submitted.text
        submit_id = submitted.json()["task-id"]
        result = eventually(
            lambda: (r := flower.get(f"{url}/api/task/result/{submit_id}").json())["state"] == "SUCCESS" and r,
            "the submission's result",
        )
        root_id = result["result"]["task_id"]
        assert coord.get_task(root_id).prompt == "p"

        # A run stores no Celery result: Flower's answer is its task's record.
        done = coord.create_task(agent(reply("all done"), text="Plan"), run=True)
        coord.wait(done.id, 60)
        answer = flower.get(f"{url}/api/task/result/{done.id}")
        assert answer.status_code == 200, answer.text
        record = coord.get_task(done.id)
        assert answer.json() == {
            "task-id": done.id, "state": "SUCCESS",
            "result": {"task_id": done.id, "status": "completed", "summary": record.summary, "output": None,
                       "error": None, "tokens": record.total_tokens, "cost_micros": record.total_cost_micros},
        }  # fmt: skip
        assert record.summary

        # A typed task's result carries its validated data.
        data = {"open": 3}
        step = {"tool_calls": [{"name": "attempt_completion", "args": {"result": "counted", "data": data}}]}
        schema = {"type": "object", "properties": {"open": {"type": "integer"}}, "required": ["open"]}
        typed = coord.create_task(agent(step, text="Count"), run=True, output_schema=schema)
        coord.wait(typed.id, 60)
        assert flower.get(f"{url}/api/task/result/{typed.id}").json()["result"]["output"] == data

        # Abort of a run cancels its task's subtree.
        slow = coord.create_task(
            agent({"reply": "never", "usage": USAGE, "latency_ms": SLOW_MS}, text="Think slowly"), run=True
        )
        eventually(lambda: flower.get(f"{url}/api/task/result/{slow.id}").json()["state"] == "STARTED", "a run")
        aborted = flower.post(f"{url}/api/task/abort/{slow.id}")
        assert aborted.status_code == 200, aborted.text
        assert coord.wait(slow.id, 30).status == "cancelled"
        assert coord.get_task(slow.id).error == "cancelled: aborted in Flower"
        revoked = flower.get(f"{url}/api/task/result/{slow.id}").json()
        assert (revoked["state"], revoked["result"]["status"]) == ("SUCCESS", "cancelled")
        assert revoked["result"]["error"] == "cancelled: aborted in Flower"

        # Abort of anything else changes nothing: the submission's result stays.
        assert flower.post(f"{url}/api/task/abort/{submit_id}").status_code == 200
        assert flower.get(f"{url}/api/task/result/{submit_id}").json()["result"] == {"task_id": root_id}


def test_subqs_own_publish_carries_the_summary(settings: Settings, redis_client: Any) -> None:
    """For any other monitor of the event stream: subq's app never publishes a prompt in its reprs."""
    queue, secret = f"subq-flower-reprs-{uuid.uuid4().hex[:8]}", f"SECRET-{uuid.uuid4().hex}"
    coord = Coordinator(settings)
    try:
        coord.app.send_task("subq.submit", args=[secret], kwargs={"prompt": secret, "run": False}, queue=queue)
    finally:
        coord.close()
    message = json.loads(redis_client.lpop(queue))
    headers = message["headers"]
    assert headers["argsrepr"] == "<1 positional argument(s): refused>"
    assert headers["kwargsrepr"] == f"prompt=<{len(secret)} chars> run=False"


def test_the_event_state_drops_sent_arguments_in_either_order_and_pickles() -> None:
    """A late sent event cannot overwrite the worker's summary; Flower's --persistent can save the state."""
    from workers.flower_setup import RedactedEventsState

    secret, summary = f"SECRET-{uuid.uuid4().hex}", "prompt=<40 chars>"
    received = {"type": "task-received", "uuid": "t1", "name": "subq.submit", "args": "", "kwargs": summary}
    sent = {"type": "task-sent", "uuid": "t1", "name": "subq.submit", "args": "()", "kwargs": repr({"prompt": secret})}
    other = {**sent, "uuid": "t2", "name": "billing.charge", "kwargs": "{'amount': 3}"}
    state = RedactedEventsState()
    for event in (received, sent, other):  # the sent event arrives late
        state.event(
            {**event, "hostname": "w0@host", "timestamp": time.time(), "local_received": time.time(), "clock": 1}
        )
    assert state.tasks["t1"].kwargs == summary
    assert state.tasks["t2"].kwargs == "{'amount': 3}"  # not subq's: left as sent
    restored = pickle.loads(pickle.dumps(state))
    assert isinstance(restored, RedactedEventsState) and restored.tasks["t1"].kwargs == summary
