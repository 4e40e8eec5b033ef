"""Outbound events on the other faces (issue 40): a Celery callback named in `on_complete` reaches a plain
Celery app's task once; `subq.submit` and `subq run --webhook` subscribe a tree as the API does, and a
bad subscription is one clear error there too, with nothing written.

Real Redis, real `celery worker` processes (subq's, and a plain app's: tests/webhook_celery_app.py) and a
real HTTP receiver on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from celery import Celery
from standardwebhooks.webhooks import Webhook as Verifier

from coordinator import Coordinator, Settings
from coordinator.celery_app import describe_kwargs
from coordinator.local.fleet import WorkerFleet
from tests.conftest import dedicated_fleet
from tests.helpers import eventually, script
from tests.test_cli import cli
from tests.test_webhooks import FLEET, PREFIX, QUEUE, SECRET, WAIT_S, _clean
from tests.webhook_kit import Receiver

APP_QUEUE = "webhookapp"
APP_LIST = "webhookapp:got"


@pytest.fixture(scope="module")
def fleet(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Coordinator, WorkerFleet]]:
    with dedicated_fleet(settings, tmp_path_factory.mktemp("wh-faces"), 1, **FLEET) as (coord, workers):
        yield coord, workers
        _clean(coord, PREFIX)


@pytest.fixture(scope="module")
def plain_app(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A plain Celery app's worker, on a queue of its own, that keeps what its task is sent."""
    log = tmp_path_factory.mktemp("plain-app") / "worker.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")}
    env.update(WEBHOOK_APP_BROKER=settings.redis_url or "", WEBHOOK_APP_LIST=APP_LIST)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.webhook_celery_app", "worker", "-Q", APP_QUEUE,
             "--pool", "solo", "--loglevel", "INFO", "--without-mingle", "--without-gossip", "-n", "webhookapp@%h"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        eventually(lambda: b"ready." in log.read_bytes(), "the plain app's worker ready", timeout_s=60)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_on_complete_sends_the_named_task_of_a_plain_celery_app_the_record_once(
    fleet: tuple[Coordinator, WorkerFleet], plain_app: None
) -> None:
    coord, _ = fleet
    coord.client.delete(APP_LIST)
    root = coord.create_task(
        "Say hello.", run=True, metadata={"job": "j-1"},
        on_complete={"task": "webhookapp.tree_done", "queue": APP_QUEUE},
    )  # fmt: skip
    coord.wait(root.id, timeout_s=WAIT_S)
    eventually(lambda: coord.client.llen(APP_LIST) > 0, "the callback ran", timeout_s=WAIT_S)
    time.sleep(2.0)
    got = [json.loads(raw) for raw in coord.client.lrange(APP_LIST, 0, -1)]
    assert len(got) == 1
    record = coord.get_task(root.id)
    assert got[0]["record"]["id"] == root.id and got[0]["record"]["status"] == "completed"
    assert got[0]["record"]["metadata"] == {"job": "j-1"}
    assert got[0]["record"]["total_cost_micros"] == record.total_cost_micros
    # The callback's end is recorded at the deliverer's next step, a moment after the callback ran.
    eventually(lambda: coord.store.outbox.deliveries(root.id)[0]["state"] == "delivered", "the delivery recorded")
    (delivery,) = coord.store.outbox.deliveries(root.id)
    # The delivery's id is in the task id: a redelivery reaches the receiver with the same one.
    assert got[0]["task_id"] == f"subq-{delivery['id']}"
    coord.client.delete(APP_LIST)


def test_a_submission_with_subtasks_ends_as_its_batch_closes_and_calls_its_producer_back(
    fleet: tuple[Coordinator, WorkerFleet], plain_app: None, settings: Settings
) -> None:
    """`subq.submit` with subtasks (`run: false`, "you plan, subq runs"): nobody holds the root, and it stood
    `active` for good once its children ended: its `task.*` event and its `on_complete` were never sent. It ends
    as its batch closes, `completed` with the combined result, or `failed` when a child did not complete."""
    coord, _ = fleet
    coord.client.delete(APP_LIST)
    producer = Celery("any-producer", broker=settings.redis_url, backend=settings.redis_url)
    plans = {
        "all done": [{"description": "greet", "message": "Say hello."}, {"description": "wave", "message": "Wave."}],
        "one fails": [
            {"description": "greet", "message": "Say hello."},
            {"description": "break", "message": script({"fail": "the request is refused"})},
        ],
    }
    with Receiver() as receiver:
        try:
            sent = {
                name: producer.send_task(
                    "subq.submit",
                    kwargs={
                        "prompt": f"Plan: {name}.", "run": False, "subtasks": subtasks,
                        "webhooks": [{"url": receiver.url, "secret": SECRET}],
                        "on_complete": {"task": "webhookapp.tree_done", "queue": APP_QUEUE},
                    },
                    queue=QUEUE,
                ).get(timeout=WAIT_S)
                for name, subtasks in plans.items()
            }  # fmt: skip
        finally:
            producer.close()
        roots = {name: result["task_id"] for name, result in sent.items()}
        done = {name: coord.wait(root, timeout_s=WAIT_S) for name, root in roots.items()}
        assert done["all done"].status == "completed", done["all done"]
        assert done["all done"].summary.startswith("Subtask results (parallel, 2 of 2 completed):")
        assert done["one fails"].status == "failed" and done["one fails"].error_class == "SubtasksFailed"
        assert done["one fails"].error == "1 of 2 subtasks did not complete (the summary has each one's line)"
        ends = eventually(
            lambda: (got := receiver.of_type("task.completed") + receiver.of_type("task.failed")) and len(got) == 2 and got,
            "both ends", timeout_s=WAIT_S,
        )  # fmt: skip
        told = {Verifier(SECRET).verify(g.body, g.headers)["data"]["task_id"]: g.json["type"] for g in ends}
        assert told == {roots["all done"]: "task.completed", roots["one fails"]: "task.failed"}
        eventually(lambda: coord.client.llen(APP_LIST) >= 2, "both callbacks ran", timeout_s=WAIT_S)
        called = {
            json.loads(raw)["record"]["id"]: json.loads(raw)["record"]["status"]
            for raw in coord.client.lrange(APP_LIST, 0, -1)
        }
        assert called == {roots["all done"]: "completed", roots["one fails"]: "failed"}
    coord.client.delete(APP_LIST)


def test_subq_submit_by_name_subscribes_the_tree_and_refuses_a_bad_webhook(
    fleet: tuple[Coordinator, WorkerFleet], settings: Settings
) -> None:
    coord, _ = fleet
    producer = Celery("any-producer", broker=settings.redis_url, backend=settings.redis_url)
    with Receiver() as receiver:
        try:
            sent = producer.send_task(
                "subq.submit",
                kwargs={"prompt": "Say hello.", "webhooks": [{"url": receiver.url, "secret": SECRET}]},
                queue=QUEUE,
            )
            result = sent.get(timeout=WAIT_S)
            sent.forget()
            bad = producer.send_task(
                "subq.submit", kwargs={"prompt": "x", "webhooks": [{"url": "http://10.0.0.1/x"}]}, queue=QUEUE
            )
            refused = bad.get(timeout=WAIT_S)
            bad.forget()
        finally:
            producer.close()
        assert refused["error"]["field"] == "webhooks.0.url", refused
        got = eventually(lambda: receiver.of_type("task.completed"), "task.completed", timeout_s=WAIT_S)
        event = Verifier(SECRET).verify(got[0].body, got[0].headers)
        assert event["data"]["task_id"] == result["task_id"]


def test_flower_shows_how_many_webhooks_never_a_url_or_secret() -> None:
    shown = describe_kwargs(
        {"prompt": "p", "webhooks": [{"url": "https://hooks.example/t?token=abc", "secret": SECRET}],
         "on_complete": {"task": "myapp.done", "queue": "q"}}
    )  # fmt: skip
    assert "webhooks=<1>" in shown and "on_complete='myapp.done'" in shown
    assert "token" not in shown and "whsec" not in shown


def test_subq_run_webhook_with_its_secret_from_the_environment(
    fleet: tuple[Coordinator, WorkerFleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    coord, _ = fleet
    env = {"SUBQ_REDIS_URL": coord.settings.redis_url or "", "SUBQ_KEY_PREFIX": PREFIX, "SUBQ_QUEUE": QUEUE,
           "SUBQ_WEBHOOK_ALLOW": "127.0.0.1"}  # fmt: skip
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    with Receiver() as receiver:
        done = cli("run", "Say hello.", "--webhook", receiver.url, "--webhook-secret-env", "HOOK_SECRET", env=env)
        assert done.returncode == 0, done.stderr
        root_id = done.stdout.strip()
        got = eventually(lambda: receiver.of_type("task.completed"), "task.completed", timeout_s=WAIT_S)
        assert Verifier(SECRET).verify(got[0].body, got[0].headers)["data"]["task_id"] == root_id
    assert SECRET not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--webhook", "ftp://example.com/x"], "subq: webhooks.0.url: Value error, must be an http:// or https:// URL"),
        (["--webhook", "http://169.254.169.254/x"], "subq: webhooks.0.url: 169.254.169.254 is a loopback, private"),
        (["--webhook", "https://example.com/x", "--webhook-secret-env", "NOT_SET_ANYWHERE"],
         "subq: --webhook-secret-env: $NOT_SET_ANYWHERE is not set"),
        (["--webhook-secret-env", "HOME"], "subq: --webhook-secret-env and --webhook-event need a --webhook URL"),
        (["--webhook", "https://example.com/x", "--webhook-event", "task.done"], "subq: webhooks.0.events:"),
    ],
    ids=["not http", "metadata address", "secret unset", "no url", "bad event"],
)  # fmt: skip
def test_subq_run_refuses_a_bad_webhook_in_one_line(settings: Settings, args: list[str], words: str) -> None:
    env = {"SUBQ_REDIS_URL": settings.redis_url or "", "SUBQ_KEY_PREFIX": "subqwhcli", "SUBQ_QUEUE": "subq-nobody"}
    done = cli("run", "p", *args, env=env)
    assert done.returncode == 1 and done.stderr.startswith(words), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not list(Coordinator(settings).client.scan_iter("subqwhcli:*"))
