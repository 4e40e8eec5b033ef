"""Poison messages against a real `celery worker`: each is dead-lettered, and the worker goes on.

Every kind here stopped the worker before the consumer boundary (workers/poison.py):
the process exited, and the message, restored to the queue at shutdown, stopped the
next one too; a message without an `id` made the consumer "reconnect" and read it
again, for ever; a 3-item body of the wrong shapes was lost in the pool, holding a
prefetch slot. Each is pushed straight onto the queue's Redis list, as a bad producer
would; then the one worker process must still be up, the message must be on the
dead-letter list with its reason and gone from the queue, and a normal task must complete.

The module runs one worker process of its own, on a Redis database and queue of its own.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import inspect
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection
from kombu.transport import redis as kombu_redis

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.celery_app import RUN_TASK
from coordinator.local.fleet import WorkerFleet
from tests.agents import agent, reply
from tests.conftest import dedicated_fleet
from tests.helpers import eventually
from workers.poison import DeadLetterChannel

QUEUE = "subq-poison"
# The queue of a worker that dies after a dead letter (its messages come back to QUEUE, their routing key).
CRASH_QUEUE = "subq-poison-crash"
# A queue no worker reads: a real message is published there, then copied and spoiled.
TEMPLATE_QUEUE = "subq-poison-template"
WAIT_S = 30
# kombu's Channel._brpop_read, which DeadLetterChannel._brpop_read copies with its decoding guarded.
KOMBU_BRPOP_READ_SHA256 = "c42518699709f2df90f55a048fe6346612ae5527e5c4a6819f2c0920dc62088f"


@pytest.fixture(scope="module")
def fleet(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Coordinator, WorkerFleet]]:
    assert settings.redis_url
    with dedicated_fleet(
        settings,
        tmp_path_factory.mktemp("poison"),
        1,
        # A database of its own: the fault suite (database 2) kills workers, whose unacked messages stay.
        redis_url=settings.redis_url.rsplit("/", 1)[0] + "/5",
        queue=QUEUE,
        # One thread, so one message prefetched: a poison run message left unacknowledged (held in the worker's
        # memory, workers/run_acks.py, not in kombu's unacked hash) would keep the next run from ever starting.
        worker_concurrency=1,
    ) as coord_and_fleet:
        yield coord_and_fleet


@pytest.fixture(scope="module")
def template(fleet: tuple[Coordinator, WorkerFleet]) -> dict[str, Any]:
    """A real subq.run_task message as kombu stores it, routed to the poison queue."""
    coord, _ = fleet
    coord.app.send_task(RUN_TASK, args=["0123456789abcdef"], queue=TEMPLATE_QUEUE)
    raw = coord.client.rpop(TEMPLATE_QUEUE)
    assert isinstance(raw, str)
    message: dict[str, Any] = json.loads(raw)
    message["properties"]["delivery_info"]["routing_key"] = QUEUE
    return message


def _body(value: object) -> Callable[[dict[str, Any]], None]:
    def spoil(message: dict[str, Any]) -> None:
        message["body"] = base64.b64encode(json.dumps(value).encode()).decode()

    return spoil


def _header(name: str, value: object) -> Callable[[dict[str, Any]], None]:
    def spoil(message: dict[str, Any]) -> None:
        message["headers"][name] = value

    return spoil


def _without_id(message: dict[str, Any]) -> None:
    del message["headers"]["id"]


def _not_a_message(message: dict[str, Any]) -> None:
    del message["properties"]


# (kind, how the template is spoiled or the raw entry, the reason's words, the task name kept, id kept)
POISON: list[tuple[str, Callable[[dict[str, Any]], None] | str, str, str | None, bool]] = [
    ("json-string body", _body("hello"), "the body must be Celery's [args, kwargs, embed], not a string", RUN_TASK, True),
    ("null body", _body(None), "the body must be Celery's [args, kwargs, embed], not null", RUN_TASK, True),
    ("2-list body", _body([["0123456789abcdef"], {}]), "[args, kwargs, embed], not a list of 2", RUN_TASK, True),
    ("3-letter string body", _body("abc"), "the body must be Celery's [args, kwargs, embed], not a string", RUN_TASK, True),
    ("3-list of numbers body", _body([1, 2, 3]), "not [a number, a number, a number]", RUN_TASK, True),
    ("string timelimit", _header("timelimit", "abc"), "header 'timelimit' must be [hard, soft] seconds", RUN_TASK, True),
    ("non-numeric timelimit pair", _header("timelimit", ["ten", None]), "not ['ten', None]", RUN_TASK, True),
    ("raw entry that is not JSON", "this is not json {", "the queue entry is not JSON", None, False),
    ("entry nested too deeply", "[" * 5_000, "the queue entry is not JSON", None, False),
    ("JSON entry that is not a message", _not_a_message, "the queue entry is not a kombu message", RUN_TASK, True),
    ("no id header", _without_id, "header 'id' is missing", RUN_TASK, False),
    ("unknown task name", _header("task", "subq.nope"), "unknown task name 'subq.nope'", "subq.nope", True),
]  # fmt: skip


def _entry(template: dict[str, Any], poison: Callable[[dict[str, Any]], None] | str) -> str:
    """The list entry: the raw text as given, or the template with fresh ids, spoiled."""
    if isinstance(poison, str):
        return poison
    message = copy.deepcopy(template)
    message["headers"]["id"] = message["properties"]["correlation_id"] = str(uuid.uuid4())
    message["properties"]["delivery_tag"] = str(uuid.uuid4())
    poison(message)
    return json.dumps(message)


@pytest.mark.parametrize(("kind", "poison", "reason", "task", "has_id"), POISON, ids=[p[0] for p in POISON])
def test_a_poison_message_is_dead_lettered_and_the_worker_goes_on(
    fleet: tuple[Coordinator, WorkerFleet],
    template: dict[str, Any],
    kind: str,
    poison: Callable[[dict[str, Any]], None] | str,
    reason: str,
    task: str | None,
    has_id: bool,
) -> None:
    coord, workers = fleet
    coord.purge_dead_letters()
    entry = _entry(template, poison)
    coord.client.lpush(QUEUE, entry)

    (dead,) = eventually(lambda: coord.dead_letters(10), f"the {kind} on the dead-letter list", WAIT_S, 0.05)

    assert workers.procs[0].poll() is None, "the worker process exited"
    assert reason in dead.reason
    assert (dead.queue, dead.task, dead.id is not None) == (QUEUE, task, has_id)
    assert dead.message == entry if isinstance(poison, str) else json.loads(dead.message) == json.loads(entry)
    done = coord.wait(coord.create_task(agent(reply("ok")), run=True).id, WAIT_S)
    assert (done.status, done.summary) == (TaskStatus.COMPLETED, "ok")
    assert coord.client.llen(QUEUE) == 0
    try:
        eventually(lambda: coord.client.hlen("unacked") == 0, "nothing left unacknowledged", WAIT_S, 0.05)
    except AssertionError:  # say which message is left, and what it is
        left = {tag: json.loads(raw)[0].get("headers", {}) for tag, raw in coord.client.hgetall("unacked").items()}
        raise AssertionError(f"left unacknowledged: {left}") from None
    assert coord.count_dead_letters() == 1, "dead-lettered once, and never delivered again"
    assert workers.procs[0].poll() is None


@pytest.mark.parametrize("kind", ["raw entry that is not JSON", "no id header"])
def test_a_dead_letter_redis_refuses_is_read_again_not_lost(
    fleet: tuple[Coordinator, WorkerFleet], template: dict[str, Any], kind: str
) -> None:
    """While the list cannot be written, the message goes back to the queue (the channel puts a popped
    entry back; the consumer reconnects and kombu restores what it had handed over), and is read again."""
    coord, workers = fleet
    coord.purge_dead_letters()
    key = coord.store.keys.dead_letters()
    _, poison, reason, _, _ = next(p for p in POISON if p[0] == kind)
    entry = _entry(template, poison)
    refused = workers.logs[0].read_text().count("dead-letter list could not be written")
    coord.client.set(key, "not a list: every write of a dead letter fails")
    try:
        coord.client.lpush(QUEUE, entry)
        eventually(lambda: workers.logs[0].read_text().count("dead-letter list could not be written") > refused,
                   "a refused write", WAIT_S, 0.05)  # fmt: skip
    finally:
        coord.client.delete(key)

    (dead,) = eventually(lambda: coord.dead_letters(10), "the dead letter, once Redis takes it", WAIT_S, 0.05)
    assert reason in dead.reason
    assert workers.procs[0].poll() is None
    eventually(lambda: coord.client.llen(QUEUE) == 0 and coord.client.hlen("unacked") == 0, "nothing left", WAIT_S)


def test_a_message_back_after_its_worker_died_past_its_dead_letter_is_kept_once(
    settings: Settings, fleet: tuple[Coordinator, WorkerFleet], template: dict[str, Any], tmp_path: Path
) -> None:
    """A worker that dies after the dead letter and before it acknowledged the message leaves the message in
    kombu's unacknowledged hash. kombu gives it back (the sweep a live worker makes once the visibility timeout
    has passed, made here at once), and the module's worker dead-letters it again: the list keeps it once."""
    coord, workers = fleet
    coord.purge_dead_letters()
    assert settings.redis_url and coord.settings.redis_url
    # A task no worker registers: a run message is not kombu's to give back (workers/run_acks.py).
    _, poison, reason, _, _ = next(p for p in POISON if p[0] == "unknown task name")
    entry = _entry(template, poison)  # routed to QUEUE, which the module's worker reads, when given back
    with dedicated_fleet(
        settings, tmp_path, 1, redis_url=coord.settings.redis_url, queue=CRASH_QUEUE, worker_concurrency=1,
        fault_crash_at="after-dead-letter",
    ) as (_, crashing):  # fmt: skip
        coord.client.lpush(CRASH_QUEUE, entry)
        crashing.procs[0].wait(timeout=WAIT_S)
        assert crashing.procs[0].returncode == -signal.SIGKILL, crashing.logs[0].read_text(errors="replace")[-2000:]
    (dead,) = coord.dead_letters(10)
    assert reason in dead.reason
    assert coord.client.hlen("unacked") == 1, "the message is held for a worker to take again"
    kept_once = workers.logs[0].read_text().count("kept once")

    with Connection(coord.settings.redis_url, transport_options={"visibility_timeout": 0}) as conn:
        conn.default_channel.qos.restore_visible(num=10, interval=1)
    eventually(lambda: f"id {dead.id})" in workers.logs[0].read_text(), "the message dead-lettered again", WAIT_S, 0.05)
    eventually(lambda: coord.client.llen(QUEUE) == 0 and coord.client.hlen("unacked") == 0, "nothing left", WAIT_S)
    assert [d.id for d in coord.dead_letters(10)] == [dead.id], "one entry for the message"
    assert workers.logs[0].read_text().count("kept once") == kept_once + 1
    assert workers.procs[0].poll() is None


def test_messages_a_producer_pushed_with_one_delivery_tag_are_each_listed(
    fleet: tuple[Coordinator, WorkerFleet], template: dict[str, Any]
) -> None:
    """A producer that pushes copies of one message of its own may give them all one delivery tag: each is a message
    of its own (its id and body), listed, not taken for the first one come back."""
    coord, workers = fleet
    coord.purge_dead_letters()
    _, poison, _, _, _ = next(p for p in POISON if p[0] == "unknown task name")
    entries = [json.loads(_entry(template, poison)) for _ in range(2)]
    for entry in entries:
        entry["properties"]["delivery_tag"] = "1"
        coord.client.lpush(QUEUE, json.dumps(entry))
    ids = {entry["headers"]["id"] for entry in entries}
    eventually(lambda: {d.id for d in coord.dead_letters(10)} == ids, "both on the dead-letter list", WAIT_S, 0.05)
    eventually(lambda: coord.client.llen(QUEUE) == 0 and coord.client.hlen("unacked") == 0, "nothing left", WAIT_S)
    assert workers.procs[0].poll() is None


def test_the_copied_kombu_reader_is_still_kombus() -> None:
    """DeadLetterChannel._brpop_read copies kombu's: a kombu that changed it needs the copy looked at again."""
    source = inspect.getsource(kombu_redis.Channel._brpop_read)
    assert hashlib.sha256(source.encode()).hexdigest() == KOMBU_BRPOP_READ_SHA256, source
    assert DeadLetterChannel.__bases__[-1] is kombu_redis.Channel


def test_the_coordinator_plane_does_not_load_the_worker_consumer(settings: Settings) -> None:
    """make_app names the consumer; only a worker imports it (and Celery's worker consumer with it)."""
    code = (
        "import sys\n"
        "from coordinator import Settings\n"
        "from coordinator.celery_app import make_app\n"
        f"app = make_app(Settings(redis_url={settings.redis_url!r}))\n"
        "assert app.conf.worker_consumer == 'workers.poison:PoisonSafeConsumer'\n"
        "print(sorted(m for m in sys.modules if m in ('workers.poison', 'celery.worker.consumer')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr
