"""A tree's caller metadata (issue 40, point 1): given on every face that creates a tree, kept on every task
of the tree (children inherit it), returned, exported, and a filter of the history.

Malformed metadata is refused on every face, each in the same words (coordinator/inputs.py's check), with
nothing written: the service, the HTTP API (422 naming `metadata.<key>`), both Python clients (before
sending), `subq run --meta` (one line, exit 1) and `subq.submit` (its `{"error": ...}` result). Real
Redis, a real API server and real `celery worker` processes throughout.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery

from coordinator import Coordinator, Settings, TaskRecord, TaskStatus, ValidationError
from coordinator.api import create_app
from coordinator.client import AsyncSubqClient, SubqClient
from coordinator.local.fleet import WorkerFleet
from tests.agents import agent, call, reply, subtask
from tests.helpers import REQUEST_TIMEOUT_S, TOKEN, ApiServer, Transport, api_settings, script, state, usage_step
from tests.test_bad_input import NO_TREE
from tests.test_cli import cli

WAIT_S = 90
RESULT_TIMEOUT_S = 30
META = {"customer": "acme", "ticket": "T-1234"}

# (case, metadata, field, words of the message): each refused on every face, in the service's words.
BAD_METADATA: list[tuple[str, Any, str, str]] = [
    ("too many keys", {f"k{n}": "v" for n in range(17)}, "metadata", "metadata has 17 keys; the limit is 16"),
    ("value too long", {"customer": "x" * 257}, "metadata.customer", "metadata.customer is 257 characters"),
    ("value not a string", {"customer": 42}, "metadata.customer", "metadata.customer must be a string, not int"),
    ("bad key", {"bad key": "v"}, "metadata.bad key", "the key 'bad key' is not 1 to 64 characters"),
    ("key too long", {"k" * 65: "v"}, f"metadata.{'k' * 64}…", "is not 1 to 64 characters"),
    ("empty value", {"customer": ""}, "metadata.customer", "metadata.customer is 0 characters"),
    ("control character", {"customer": "acme\x1b[2J"}, "metadata.customer", "non-printable character '\\x1b'"),
    ("bidi override", {"customer": "acme\u202e"}, "metadata.customer", "non-printable character '\\u202e'"),
    ("variation selector", {"customer": "acme\ufe00"}, "metadata.customer", "non-printable character '\\ufe00'"),
    ("not an object", ["customer=acme"], "metadata", "metadata must be an object of string keys and values"),
]  # fmt: skip
CASES = [case[1:] for case in BAD_METADATA]
IDS = [case[0] for case in BAD_METADATA]


@pytest.fixture(scope="module")
def idle(settings: Settings) -> Iterator[Coordinator]:
    """A coordinator (with an API server below) on keys and a queue of its own that no worker reads."""
    coord = Coordinator(api_settings(settings, key_prefix="subqmeta", queue="subq-meta-idle"))
    yield coord
    for key in [*coord.client.scan_iter("subqmeta:*"), "subq-meta-idle"]:
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


def _subtree(coord: Coordinator, task_id: str) -> list[TaskRecord]:
    record = coord.get_task(task_id)
    return [record, *(r for child in record.child_ids for r in _subtree(coord, child))]


# -- refused on every face, nothing written ---------------------------------------------------


@pytest.mark.parametrize(("metadata", "field", "message"), CASES, ids=IDS)
def test_the_service_refuses_bad_metadata_and_writes_nothing(
    idle: Coordinator, metadata: Any, field: str, message: str
) -> None:
    before = state(idle, NO_TREE)
    for create in (
        lambda: idle.create_task("p", metadata=metadata),
        lambda: idle.create_task("p", run=True, idempotency_key="meta-key", metadata=metadata),
        lambda: idle.submit("p", subtasks=[{"description": "d", "message": "m"}], metadata=metadata),
    ):
        with pytest.raises(ValidationError) as refused:
            create()
        assert (refused.value.field, refused.value.code) == (field, "invalid_input")
        assert message in refused.value.message
    assert state(idle, NO_TREE) == before, "refused metadata changed Redis or published"


@pytest.mark.parametrize(("metadata", "field", "message"), CASES, ids=IDS)
def test_the_api_answers_bad_metadata_with_a_422_naming_it(
    idle: Coordinator, idle_url: str, metadata: Any, field: str, message: str
) -> None:
    before = state(idle, NO_TREE)
    with httpx.Client(
        timeout=REQUEST_TIMEOUT_S, base_url=idle_url, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as http:
        answer = http.post("/v1/tasks", json={"prompt": "p", "metadata": metadata})
    assert answer.status_code == 422, answer.text
    body = answer.json()
    assert (body["code"], body["field"]) == ("invalid_input", field), body
    assert message in body["message"]
    assert state(idle, NO_TREE) == before


@pytest.mark.parametrize(("metadata", "field", "message"), CASES, ids=IDS)
def test_both_clients_refuse_bad_metadata_before_sending(
    idle: Coordinator, metadata: Any, field: str, message: str
) -> None:
    sent: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    with SubqClient("http://subq.invalid", token=TOKEN, transport=httpx.MockTransport(record)) as subq:
        with pytest.raises(ValidationError) as refused:
            subq.create_task("p", metadata=metadata)
    assert (refused.value.field, message in refused.value.message) == (field, True), refused.value.message

    async def create_async() -> None:
        async with AsyncSubqClient("http://subq.invalid", token=TOKEN, transport=httpx.MockTransport(record)) as subq:
            await subq.create_task("p", metadata=metadata)

    with pytest.raises(ValidationError) as refused:
        asyncio.run(create_async())
    assert (refused.value.field, message in refused.value.message) == (field, True), refused.value.message
    assert sent == [], "a refused create sent a request"


@pytest.mark.parametrize(("metadata", "field", "message"), CASES, ids=IDS)
def test_subq_submit_returns_the_error_for_bad_metadata_and_writes_nothing(
    idle: Coordinator, metadata: Any, field: str, message: str
) -> None:
    from workers.submit import submit

    before = state(idle, NO_TREE)
    for kwargs in (
        {"prompt": "p", "metadata": metadata},
        {"prompt": "p", "run": False, "subtasks": [{"description": "d", "message": "m"}], "metadata": metadata},
    ):
        result = submit(idle, (), kwargs)
        assert json.loads(json.dumps(result)) == result
        assert set(result) == {"error"}, result
        assert (result["error"]["code"], result["error"]["field"]) == ("invalid_input", field), result
        assert message in result["error"]["message"]
    assert state(idle, NO_TREE) == before, "a refused submission changed Redis or published"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["run", "p", "--meta", "customer"], "subq: --meta 'customer' is not KEY=VALUE (e.g. customer=acme)\n"),
        (["run", "p", "--meta", "bad key=acme"], "subq: meta: the key 'bad key' is not 1 to 64 characters of A-Z a-z 0-9 _ . -\n"),
        (["run", "p", "--meta", "customer="], "subq: meta.customer is 0 characters; a value is 1 to 256\n"),
        (["run", "p", "--meta", "a=1", "--meta", "a=2"], "subq: --meta names the key 'a' twice\n"),
        (["run", "p", *[arg for n in range(17) for arg in ("--meta", f"k{n}=v")]], "subq: meta has 17 keys; the limit is 16\n"),
        (["history", "--meta", "customer"], "subq: --meta 'customer' is not KEY=VALUE (e.g. customer=acme)\n"),
        (["history", "--meta", f"customer={'x' * 257}"], "subq: meta.customer is 257 characters; a value is 1 to 256\n"),
    ],
    ids=["no =", "bad key", "empty value", "key twice", "too many", "history no =", "history too long"],
)  # fmt: skip
def test_subq_meta_refuses_bad_pairs_in_one_line(idle: Coordinator, args: list[str], line: str) -> None:
    before = state(idle, NO_TREE)
    env = {
        "SUBQ_REDIS_URL": idle.settings.redis_url or "",
        "SUBQ_KEY_PREFIX": "subqmeta",
        "SUBQ_QUEUE": "subq-meta-idle",
    }
    done = cli(*args, env=env)
    assert (done.returncode, done.stderr, done.stdout) == (1, line, "")
    assert state(idle, NO_TREE) == before


# -- kept, inherited, returned, exported, filtered -------------------------------------------


def test_an_api_tree_carries_its_metadata_on_every_task_and_the_history_filters_by_it(
    live_url: str, coordinator: Coordinator, tmp_path: Path
) -> None:
    with httpx.Client(
        timeout=REQUEST_TIMEOUT_S, base_url=live_url, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as http:
        created = http.post("/v1/tasks", json={"prompt": "Q3 report", "metadata": META})
        assert created.status_code == 201, created.text
        root = created.json()
        assert root["metadata"] == META
        other = http.post("/v1/tasks", json={"prompt": "other", "metadata": {"customer": "acme", "ticket": "T-9"}})
        assert other.status_code == 201, other.text
        # Children delegated through the API inherit the root's metadata, and so does a grandchild an agent made.
        nested = agent(call("new_task", **subtask("grandchild", reply("deep done"))), reply("child done"))
        subtasks = [
            {"description": "plain", "message": script(usage_step())},
            {"description": "nested", "message": nested},
        ]
        assert http.post(f"/v1/tasks/{root['id']}/subtasks", json={"subtasks": subtasks}).status_code == 202
        done = coordinator.wait(root["id"], WAIT_S)
        assert done.status == TaskStatus.ACTIVE and not done.awaiting_ids, done
        tasks = _subtree(coordinator, root["id"])
        assert len(tasks) == 4 and {t.depth for t in tasks} == {0, 1, 2}
        assert all(t.metadata == META for t in tasks), [(t.id, t.metadata) for t in tasks]
        for task in tasks:
            assert http.get(f"/v1/tasks/{task.id}").json()["metadata"] == META
        tree = http.get(f"/v1/tasks/{root['id']}/tree").json()
        assert tree["metadata"] == META and tree["children"][1]["children"][0]["metadata"] == META

        # Several meta.* filters AND together: the other tree shares the customer, not the ticket.
        both = http.get("/v1/tasks", params={"meta.customer": "acme", "meta.ticket": "T-1234", "limit": 500}).json()
        assert {item["id"] for item in both["items"]} == {t.id for t in tasks}
        assert all(item["metadata"] == META for item in both["items"])
        customer = http.get("/v1/tasks", params={"meta.customer": "acme", "limit": 500}).json()
        assert {t.id for t in tasks} | {other.json()["id"]} <= {item["id"] for item in customer["items"]}
        roots = http.get("/v1/tasks", params={"meta.ticket": "T-1234", "root_id": root["id"]}).json()
        assert len(roots["items"]) == 4
        none = http.get("/v1/tasks", params={"meta.ticket": "T-0000"}).json()
        assert none == {"items": [], "next_cursor": None}
        # A bad filter names itself; an unknown parameter is still refused, naming what the history takes.
        bad = http.get("/v1/tasks", params={"meta.bad key": "x"})
        assert bad.status_code == 422 and bad.json()["field"] == "meta.bad key", bad.text
        long = http.get("/v1/tasks", params={"meta.customer": "x" * 257})
        assert long.status_code == 422 and long.json()["field"] == "meta.customer", long.text
        twice = http.get("/v1/tasks?meta.customer=a&meta.customer=b")
        assert twice.status_code == 422 and twice.json()["message"] == "meta names the key 'customer' twice"
        typo = http.get("/v1/tasks", params={"metadata.customer": "acme"})
        assert typo.status_code == 422 and "meta.<key>" in typo.json()["message"], typo.text
        elsewhere = http.get(f"/v1/tasks/{root['id']}/tree", params={"meta.customer": "acme"})
        assert elsewhere.status_code == 422 and elsewhere.json()["field"] == "meta.customer"

    # The export writes it with every task's history item.
    coordinator.export_tree(root["id"], tmp_path)
    for task in tasks:
        assert json.loads((tmp_path / task.id / "history_item.json").read_text())["metadata"] == META


def test_both_clients_tag_an_agent_tree_and_find_it(live_url: str, coordinator: Coordinator) -> None:
    tags = {"job.id": "job-7", "customer": "Ünïcode & <b>co</b>"}
    root_script = agent(
        call("run_subagents", tasks=[subtask("A", reply("A done")), subtask("B", reply("B done"))]),
        call("attempt_completion", result="both done"),
    )
    with SubqClient(live_url, token=TOKEN) as subq:
        root = subq.create_task(root_script, todos="[ ] A\n[ ] B", profile="offline", run=True, metadata=tags)
        assert root.metadata == tags
        done = subq.wait(root.id, WAIT_S)
        assert done.status == TaskStatus.COMPLETED, done.error
        assert [c.metadata for c in coordinator.get_children(root.id)] == [tags, tags]
        found, _ = subq.list_tasks(metadata={"job.id": "job-7"}, limit=500)
        assert {item.id for item in found} == {root.id, *done.child_ids}

    async def find() -> set[str]:
        async with AsyncSubqClient(live_url, token=TOKEN) as subq:
            again = await subq.create_task("caller-owned", metadata={"job.id": "job-8"})
            assert (await subq.get_task(again.id)).metadata == {"job.id": "job-8"}
            items, _ = await subq.list_tasks(metadata={"job.id": "job-8"})
            return {item.id for item in items}

    assert len(asyncio.run(find())) == 1


def test_subq_submit_by_name_tags_the_root_and_its_subtasks(settings: Settings, coordinator: Coordinator) -> None:
    producer = Celery("any-producer", broker=settings.redis_url, backend=settings.redis_url)
    tags = {"ticket": "CEL-1"}
    try:
        sent = producer.send_task(
            "subq.submit",
            kwargs={
                "prompt": "Q3", "run": False, "metadata": tags,
                "subtasks": [{"description": "one", "message": script(usage_step())}],
            },
            queue=settings.queue,
        )  # fmt: skip
        result = sent.get(timeout=RESULT_TIMEOUT_S)
        sent.forget()
        assert set(result) == {"task_id", "batch_id"}, result
        bad = producer.send_task(
            "subq.submit", kwargs={"prompt": "Q3", "metadata": {"ticket": 7}}, queue=settings.queue
        )
        refused = bad.get(timeout=RESULT_TIMEOUT_S)
        bad.forget()
        assert refused["error"]["field"] == "metadata.ticket", refused
    finally:
        producer.close()
    parent = coordinator.wait(result["task_id"], WAIT_S)
    assert parent.metadata == tags
    assert [c.metadata for c in coordinator.get_children(parent.id)] == [tags]
    found, _ = coordinator.list_tasks(metadata=tags)
    assert {item.id for item in found} == {parent.id, *parent.child_ids}


def test_subq_run_meta_tags_the_tree_and_status_tree_and_history_show_it(
    transport: Transport, settings: Settings, coordinator: Coordinator
) -> None:
    env = transport.env(settings)
    ticket = f"T-{transport.name}"
    started = cli("run", agent(reply("done")), "--meta", "customer=acme", "--meta", f"ticket={ticket}", env=env)
    assert started.returncode == 0, started.stderr
    task_id = started.stdout.strip()
    assert coordinator.wait(task_id, WAIT_S).metadata == {"customer": "acme", "ticket": ticket}

    status = cli("status", task_id, env=env)
    assert status.returncode == 0 and f"  metadata: customer=acme, ticket={ticket}\n" in status.stdout
    tree = cli("tree", task_id, env=env)
    assert tree.stdout.splitlines()[1] == f"    metadata: customer=acme, ticket={ticket}", tree.stdout
    history = cli("history", "--meta", f"ticket={ticket}", "--meta", "customer=acme", "--json", env=env)
    items = json.loads(history.stdout)["items"]
    assert [(item["id"], item["metadata"]["ticket"]) for item in items] == [(task_id, ticket)]
    assert json.loads(cli("history", "--meta", "ticket=none-such", "--json", env=env).stdout)["items"] == []
