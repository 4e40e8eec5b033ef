"""Outbound events (issue 40): a tree's end reaches its webhook, signed, once per event id, surviving a
killed worker; a webhook to a private address is refused; bad subscriptions are refused on every face; a
delivery whose stored data makes no attempt is given up at once, its batch going on; a host name that is
not ASCII is sent as IDNA.

Real Redis, real `celery worker` processes (a fleet of their own, with `SUBQ_WEBHOOK_ALLOW=127.0.0.1`
and a short backoff) and a real HTTP receiver on 127.0.0.1 (tests/webhook_kit.py).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook as Verifier

from coordinator import Coordinator, Settings, ValidationError
from coordinator.api import create_app
from coordinator.local.fleet import WorkerFleet
from coordinator.outbound import Deliverer
from coordinator.settings import NotifySink
from coordinator.subscriptions import Webhook, shown_target
from tests.conftest import dedicated_fleet
from tests.helpers import TOKEN, ApiServer, api_settings, eventually, step_until
from tests.test_webhooks_connections import RawReceiver
from tests.webhook_kit import Receiver

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
PREFIX = "subqwh"
QUEUE = "subq-wh"
FLEET: dict[str, Any] = dict(
    key_prefix=PREFIX, queue=QUEUE, webhook_allow=["127.0.0.1"], webhook_retry_base_s=0.3,
    webhook_retry_max_s=1.5, webhook_timeout_s=3.0,
)  # fmt: skip
WAIT_S = 60


def _clean(coord: Coordinator, prefix: str) -> None:
    for key in coord.client.scan_iter(f"{prefix}:*"):
        coord.client.delete(key)


# The tests that kill their workers or bound the retries start fleets of their own, on keys and a
# queue of their own, so that the module's fleet never takes their deliveries.
OWN_PREFIX = "subqwhown"
OWN_FLEET: dict[str, Any] = {**FLEET, "key_prefix": OWN_PREFIX, "queue": "subq-wh-own"}


@pytest.fixture(scope="module")
def module_fleet(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Coordinator, WorkerFleet]]:
    """One worker process for the tests that neither kill nor reconfigure it (a start is 2.5 s of CPU: issue 43)."""
    with dedicated_fleet(settings, tmp_path_factory.mktemp("wh-workers"), 1, **FLEET) as (coord, workers):
        yield coord, workers


@pytest.fixture
def fleet(module_fleet: tuple[Coordinator, WorkerFleet]) -> Iterator[tuple[Coordinator, WorkerFleet]]:
    yield module_fleet
    _clean(module_fleet[0], PREFIX)


def _verified(got: Any) -> dict[str, Any]:
    return dict(Verifier(SECRET).verify(got.body, got.headers))


def test_a_roots_end_reaches_its_webhook_once_signed_with_the_records_figures(
    fleet: tuple[Coordinator, WorkerFleet],
) -> None:
    coord, _ = fleet
    with Receiver() as receiver:
        root = coord.create_task(
            "Say hello.", run=True, metadata={"customer": "acme"},
            webhooks=[{"url": receiver.url, "secret": SECRET}],
        )  # fmt: skip
        done = coord.wait(root.id, timeout_s=WAIT_S)
        got = eventually(lambda: receiver.of_type("task.completed"), "task.completed delivered", timeout_s=WAIT_S)
        time.sleep(2.0)  # a second copy would come within the backoff
        assert len(receiver.of_type("task.completed")) == 1 == len(receiver.got)
        event = _verified(got[0])
        record = coord.get_task(root.id)
        assert got[0].headers["webhook-id"] == event["id"]
        assert event["type"] == "task.completed" and done.status.value == "completed"
        data = event["data"]
        assert data["task_id"] == data["tree_id"] == root.id
        assert data["metadata"] == {"customer": "acme"}
        assert data["total_cost_micros"] == record.total_cost_micros and data["output"] == record.output
        assert data["status"] == "completed" and data["result"] == record.summary
        # The receiver's answer is recorded at the deliverer's next step, a moment after the receiver saw it.
        eventually(
            lambda: (
                [(d["type"], d["state"], d["attempts"]) for d in coord.store.outbox.deliveries(root.id)]
                == [("task.completed", "delivered", 1)]
            ),
            "the delivery recorded as delivered once",
        )
        # The secret is write-only: nowhere in what a read returns.
        assert SECRET not in coord.get_task(root.id).model_dump_json()


def test_a_cancel_sends_task_cancelled_and_children_only_when_asked(fleet: tuple[Coordinator, WorkerFleet]) -> None:
    coord, _ = fleet
    with Receiver() as everything, Receiver() as root_only:
        root = coord.create_task("Plan.", webhooks=[{"url": everything.url, "events": ["*"]}, {"url": root_only.url}])
        coord.delegate(root.id, [{"description": "a", "message": "Wait."}])
        coord.cancel(root.id, "no longer needed")
        eventually(lambda: everything.of_type("task.cancelled"), "task.cancelled", timeout_s=WAIT_S)
        # The child ends one way or the other (cancelled, or done before the cancel reached it): its end is sent.
        eventually(
            lambda: [g for g in everything.got if g.json["type"].startswith("child.")],
            "a child's end",
            timeout_s=WAIT_S,
        )
        eventually(lambda: root_only.of_type("task.cancelled"), "task.cancelled", timeout_s=WAIT_S)
        time.sleep(1.0)
        assert [g.json["type"] for g in root_only.got] == ["task.cancelled"]
        assert "webhook-signature" not in root_only.got[0].headers  # no secret, no signature
        assert everything.of_type("task.cancelled")[0].json["data"]["error"]


# How long the receiver refuses every connection, the worker that would deliver killed meanwhile (issue 40).
REFUSED_S = 30.0


def test_a_delivery_survives_a_refusing_receiver_and_a_killed_worker(settings: Settings, tmp_path: Path) -> None:
    receiver = Receiver(start=False)  # nobody listens: every connection is refused
    back_at = time.monotonic() + REFUSED_S
    with dedicated_fleet(settings, tmp_path / "first", 1, **OWN_FLEET) as (coord, workers):
        root = coord.create_task("Plan.", webhooks=[{"url": receiver.url, "secret": SECRET}])
        coord.cancel(root.id, "done with it")

        def tried() -> bool:
            entries = coord.store.outbox.deliveries(root.id)
            return bool(entries) and entries[0]["attempts"] >= 2

        eventually(tried, "two refused attempts", timeout_s=WAIT_S)
        entry = coord.store.outbox.deliveries(root.id)[0]
        assert entry["state"] == "retrying" and "ConnectError" in entry["last"]
        for proc in workers.procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(max(0.0, back_at - time.monotonic()))
    receiver.start()
    try:
        with dedicated_fleet(settings, tmp_path / "second", 1, **OWN_FLEET) as (coord, _):
            got = eventually(lambda: receiver.of_type("task.cancelled"), "delivered after restart", timeout_s=WAIT_S)
            time.sleep(2.0)
            assert len(receiver.got) == 1
            assert got[0].headers["webhook-id"] == entry["event_id"] == _verified(got[0])["id"]
            eventually(lambda: coord.store.outbox.deliveries(root.id)[0]["state"] == "delivered", "it recorded")
            _clean(coord, OWN_PREFIX)
    finally:
        receiver.stop()


# -- refused at creation ------------------------------------------------------------------------------

PRIVATE = [
    "http://127.0.0.1/hook",
    "http://10.0.0.1/hook",
    "http://169.254.169.254/latest/meta-data",
    "http://[::1]/hook",
    "http://localhost:8080/hook",  # a name that resolves to 127.0.0.1
    # Forms Python's `is_global` reads as global, each carrying a private IPv4 address: NAT64 (10.0.0.1 behind DNS64),
    # IPv4-compatible, 6to4; and site-local. Each was accepted (coordinator/networks.py).
    "http://[64:ff9b::a00:1]/hook",
    "http://[::a00:1]/hook",
    "http://[2002:a00:1::1]/hook",
    "http://[fec0::1]/hook",
]


@pytest.fixture(scope="module")
def idle(settings: Settings) -> Iterator[Coordinator]:
    """A coordinator with no webhook allowed past the public internet, on keys no worker reads."""
    coord = Coordinator(api_settings(settings, key_prefix="subqwhidle", queue="subq-wh-idle"))
    yield coord
    _clean(coord, "subqwhidle")
    coord.close()


def _nothing_written(coord: Coordinator) -> bool:
    return not list(coord.client.scan_iter("subqwhidle:*"))


@pytest.mark.parametrize("url", PRIVATE)
def test_a_private_target_is_refused_with_422_unless_allowed(idle: Coordinator, url: str) -> None:
    with pytest.raises(ValidationError) as refused:
        idle.create_task("x", webhooks=[{"url": url}])
    assert refused.value.field == "webhooks.0.url" and "public addresses only" in str(refused.value)
    assert "127.0.0.1" not in str(refused.value) or "127.0.0.1" in url, "the refusal never says what a name resolved to"
    assert _nothing_written(idle)
    with ApiServer(create_app(coordinator=idle)) as server, server.client({"authorization": f"Bearer {TOKEN}"}) as http:
        answer = http.post("/v1/tasks", json={"prompt": "x", "webhooks": [{"url": url}]})
        assert answer.status_code == 422 and "webhooks.0.url" in answer.text, answer.text
    assert _nothing_written(idle)
    allowed = Coordinator(
        idle.settings.model_copy(
            update={
                "webhook_allow": [
                    *("127.0.0.0/8", "10.0.0.0/8", "169.254.0.0/16", "::1", "localhost"),
                    *("64:ff9b::/96", "::/96", "2002::/16", "fec0::/10"),
                ]
            }
        )
    )
    try:
        assert allowed.create_task("x", webhooks=[{"url": url}]).id
    finally:
        allowed.close()
        _clean(idle, "subqwhidle")


def test_names_whose_dns_never_answers_hold_a_submit_for_the_wait_alone(
    idle: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five webhooks on names whose name servers drop every query: each lookup held the API's thread for the
    resolver's whole timeout, one after the other, and forty such submits held every thread the API has. A
    request's names are now looked up together, for CREATE_RESOLVE_WAIT_S at most, then taken as names that do
    not resolve yet; an address written as such is still checked at once, however busy the lookups are."""
    import socket
    import threading

    from coordinator.subscriptions import CREATE_RESOLVE_WAIT_S, MAX_CREATE_LOOKUPS

    real, release = socket.getaddrinfo, threading.Event()

    def hanging(host: object, *args: Any, **kwargs: Any) -> Any:
        if str(host).endswith(".hang.example"):
            release.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    hooks = [{"url": f"https://x{n}.hang.example/in"} for n in range(5)]
    try:
        started = time.monotonic()
        root = idle.create_task("x", webhooks=hooks)
        took_s = time.monotonic() - started
        # Against the outside: five lookups of 60 s each, one after the other, before.
        assert took_s < 30, took_s
        assert took_s >= CREATE_RESOLVE_WAIT_S * 0.9, "it waited for the names, not past them"
        assert root.id
        # The lookups still hang: an address is checked now, in any form the resolver reads without DNS.
        for address in ("10.0.0.1", "127.1", "2130706433", "0x7f.1"):
            with pytest.raises(ValidationError) as refused:
                idle.create_task("x", webhooks=[*hooks[:4], {"url": f"http://{address}/in"}])
            assert refused.value.field == "webhooks.4.url", address
        # With MAX_CREATE_LOOKUPS in flight, a name is taken as not resolving yet at once: no backlog behind them.
        free = MAX_CREATE_LOOKUPS - len(hooks)  # the first submit's five still hang
        while free > 0:
            more = [{"url": f"https://y{free}-{n}.hang.example/in"} for n in range(min(len(hooks), free))]
            idle.create_task("x", webhooks=more)
            free -= len(more)
        started = time.monotonic()
        assert idle.create_task("x", webhooks=[{"url": "https://z.hang.example/in"}]).id
        assert time.monotonic() - started < CREATE_RESOLVE_WAIT_S * 0.9, "it did not wait behind the hanging ones"
    finally:
        release.set()
        _clean(idle, "subqwhidle")


BAD = [
    ("not a list", {"url": "https://example.com"}, "webhooks", "valid list"),
    ("not http", [{"url": "ftp://example.com/x"}], "webhooks.0.url", "http:// or https://"),
    ("empty label", [{"url": "https://hooks..example.com/x"}], "webhooks.0.url", "names no valid host"),
    ("long label", [{"url": f"https://{'a' * 64}.example.com/x"}], "webhooks.0.url", "label empty or too long"),
    ("space in host", [{"url": "http://exa mple.com/in"}], "webhooks.0.url", "a host name is letters, digits"),
    ("bang in host", [{"url": "http://a_b!.example/in"}], "webhooks.0.url", "a host name is letters, digits"),
    ("no url", [{"secret": SECRET}], "webhooks.0.url", "Field required"),
    ("oversize secret", [{"url": "https://example.com", "secret": "whsec_" + "A" * 200}], "webhooks.0.secret",
     "the limit is 100"),
    ("bad secret", [{"url": "https://example.com", "secret": "hunter2"}], "webhooks.0.secret", "whsec_"),
    ("unknown event", [{"url": "https://example.com", "events": ["task.done"]}], "webhooks.0.events", "no event"),
    ("unknown field", [{"url": "https://example.com", "hmac": "x"}], "webhooks.0.hmac", "Extra inputs"),
    ("too many", [{"url": f"https://example.com/{n}"} for n in range(6)], "webhooks", "at most 5"),
]  # fmt: skip


@pytest.mark.parametrize(("given", "field", "words"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_a_malformed_subscription_is_refused_on_every_face(
    idle: Coordinator, given: Any, field: str, words: str
) -> None:
    from coordinator.client import SubqClient

    with pytest.raises(ValidationError) as refused:
        idle.create_task("x", webhooks=given)
    assert refused.value.field == field and words in str(refused.value), str(refused.value)
    assert "hunter2" not in str(refused.value) and "AAAA" not in str(refused.value)
    with ApiServer(create_app(coordinator=idle)) as server:
        with server.client({"authorization": f"Bearer {TOKEN}"}) as http:
            answer = http.post("/v1/tasks", json={"prompt": "x", "webhooks": given})
            assert answer.status_code == 422 and field in answer.text and words in answer.text, answer.text
        with SubqClient(server.url, token=TOKEN) as client, pytest.raises(ValidationError) as refused:
            client.create_task("x", webhooks=given)
        assert refused.value.field == field
    assert _nothing_written(idle)


@pytest.mark.parametrize("task", ["not a task name", "subq.submit", "subq.run_task", "celery.chord_unlock"])
def test_a_bad_on_complete_is_refused(idle: Coordinator, task: str) -> None:
    """A task name, never one of subq's own tasks or Celery's built-ins (a `submit` key names any task)."""
    with pytest.raises(ValidationError) as refused:
        idle.create_task("x", on_complete=task)
    assert refused.value.field == "on_complete.task" and _nothing_written(idle)
    if "." in task:
        assert "is a task of subq's or Celery's own" in str(refused.value)


def test_deliveries_are_visible_and_an_operator_redelivers_on_record(
    fleet: tuple[Coordinator, WorkerFleet],
) -> None:
    from tests.test_cli import cli

    coord, _ = fleet
    api = Coordinator(api_settings(coord.settings))
    with Receiver() as receiver, ApiServer(create_app(coordinator=api)) as server:
        root = coord.create_task("Plan.", webhooks=[{"url": receiver.url + "?token=abc", "secret": SECRET}])
        coord.cancel(root.id, "enough")
        eventually(lambda: receiver.of_type("task.cancelled"), "task.cancelled", timeout_s=WAIT_S)
        with server.client({"authorization": f"Bearer {TOKEN}"}) as http:
            listed = eventually(
                lambda: [d for d in http.get(f"/v1/tasks/{root.id}/deliveries").json()["deliveries"]
                         if d["state"] == "delivered"],
                "the delivery settled",
            )  # fmt: skip
            answer = http.get(f"/v1/tasks/{root.id}/deliveries")
            assert SECRET not in answer.text and "token=abc" not in answer.text
            (delivery,) = listed
            assert delivery["target"] == receiver.url and delivery["attempts"] == 1
            assert delivery["last"] == "HTTP 204" and delivery["type"] == "task.cancelled"
            again = http.post(f"/v1/tasks/{root.id}/deliveries/{delivery['id']}/redeliver")
            assert again.status_code == 200 and again.json()["state"] == "pending", again.text
            got = eventually(lambda: receiver.got[1:], "the redelivery")
            assert got[0].headers["webhook-id"] == receiver.got[0].headers["webhook-id"]
            assert _verified(got[0])["id"] == delivery["event_id"]
            audit = http.get("/v1/audit").json()["entries"]
            assert any(e["action"] == "redeliver" and e["target"] == delivery["id"] for e in audit)
            metrics = http.get("/metrics").text
            assert 'subq_webhook_deliveries_total{event="task.cancelled",outcome="delivered"}' in metrics
            assert "subq_webhook_oldest_pending_seconds" in metrics
            unknown = http.post(f"/v1/tasks/{root.id}/deliveries/evt_{root.id}_99.0/redeliver")
            assert unknown.status_code == 404, unknown.text
        with httpx.Client(base_url=server.url, timeout=30) as browser:
            page = browser.post(
                "/ui/login", data={"token": TOKEN, "next": f"/ui/tasks/{root.id}"}, follow_redirects=True
            )
            assert page.status_code == 200 and "Deliveries (1)" in page.text
            assert f'id="delivery-{delivery["id"]}"' in page.text
            assert receiver.url in page.text and "token=abc" not in page.text and SECRET not in page.text
        env = {"SUBQ_REDIS_URL": coord.settings.redis_url or "", "SUBQ_KEY_PREFIX": PREFIX, "SUBQ_QUEUE": QUEUE}
        shown = cli("deliveries", root.id, env=env)
        assert shown.returncode == 0 and delivery["id"] in shown.stdout and "task.cancelled" in shown.stdout
        assert SECRET not in shown.stdout and "token=abc" not in shown.stdout
    api.close()


def test_an_api_keys_webhooks_get_every_tree_it_creates(fleet: tuple[Coordinator, WorkerFleet]) -> None:
    from coordinator.access import ApiKeySpec, parse_keys, token_sha256
    from coordinator.subscriptions import Webhook

    coord, _ = fleet
    with Receiver() as receiver:
        hook = Webhook(url=receiver.url, secret=SECRET, events=["task.*"])
        keys = {"svc": ApiKeySpec(token_sha256=token_sha256("svc-token"), scopes=["submit", "read"], webhooks=[hook])}
        api = Coordinator(api_settings(coord.settings, api_keys=keys))
        with (
            ApiServer(create_app(coordinator=api)) as server,
            server.client({"authorization": "Bearer svc-token"}) as http,
        ):
            made = http.post("/v1/tasks", json={"prompt": "Plan."})
            assert made.status_code == 201, made.text
            root_id = made.json()["id"]
            assert http.post(f"/v1/tasks/{root_id}/cancel", json={"reason": "done"}).status_code == 200
            got = eventually(lambda: receiver.of_type("task.cancelled"), "the key's webhook told", timeout_s=WAIT_S)
            assert _verified(got[0])["data"]["task_id"] == root_id
            assert SECRET not in http.get(f"/v1/tasks/{root_id}/deliveries").text
        api.close()
    with pytest.raises(ValueError, match=r"key 'svc': webhooks.0.url: .*http:// or https://"):
        parse_keys({"svc": {"token_sha256": "a" * 64, "scopes": ["submit"], "webhooks": [{"url": "ftp://x"}]}})
    with pytest.raises(ValueError, match=r"key 'svc': webhooks.0.url: .*names no valid host"):
        parse_keys({"svc": {"token_sha256": "a" * 64, "scopes": ["submit"], "webhooks": [{"url": "https://.x.io"}]}})


def test_a_410_ends_the_subscription_and_a_dead_receiver_is_given_up_in_bounded_time(
    settings: Settings, tmp_path: Path
) -> None:
    bounded = {**OWN_FLEET, "webhook_retry_for_s": 2.0}
    with (
        dedicated_fleet(settings, tmp_path / "w", 1, **bounded) as (coord, _),
        Receiver(status=410) as gone,
    ):
        dead = Receiver(start=False)
        root = coord.create_task(
            "Plan.", webhooks=[{"url": gone.url, "events": ["*"]}, {"url": dead.url, "events": ["task.*"]}]
        )
        coord.delegate(root.id, [{"description": "a", "message": "Wait."}])

        def states() -> dict[str, str]:
            return {d.target + " " + d.type: d.state for d in coord.deliveries(root.id)}

        # The first event to reach the 410 receiver ends its subscription: no later event is written for it.
        eventually(lambda: "gone" in states().values(), "a delivery answered 410", timeout_s=WAIT_S)
        coord.cancel(root.id, "enough")
        eventually(
            lambda: [d for d in coord.deliveries(root.id) if d.target == dead.url and d.state == "given_up"],
            "the dead receiver given up", timeout_s=WAIT_S,
        )  # fmt: skip
        to_gone = [d for d in coord.deliveries(root.id) if d.target == gone.url]
        assert len(gone.got) == 1 and [d.state for d in to_gone] == ["gone"]
        given_up = next(d for d in coord.deliveries(root.id) if d.target == dead.url)
        assert given_up.attempts >= 2 and "ConnectError" in given_up.last and given_up.type == "task.cancelled"
        counts = coord.delivery_counts()
        assert counts[("task.cancelled", "given_up")] >= 1 and counts[("task.cancelled", "retrying")] >= 1
        assert any(outcome == "gone" for _, outcome in counts)
        # The receiver is mended: an operator's redeliver sends it (it was settled `gone` again, unsent), and opens
        # the subscription again for the tree's later events.
        gone.status = 204
        (ended,) = to_gone
        coord.redeliver(root.id, ended.id)
        eventually(
            lambda: next(d for d in coord.deliveries(root.id) if d.id == ended.id).state == "delivered",
            "the redelivery delivered", timeout_s=WAIT_S,
        )  # fmt: skip
        assert len(gone.got) == 2
        hooks = coord.client.hgetall(coord.store.keys.hooks(root.id))
        hook = ended.id.rpartition(".")[2]  # `<event id>.<subscription>`
        assert hooks[f"h:{hook}"] == "*" and f"g:{hook}" not in hooks, hooks
        _clean(coord, OWN_PREFIX)


# -- stored data that makes no attempt: given up at once, its batch going on ----------------------------

STORED = "subqwhstored"
LEASE_MS = 60_000


@pytest.fixture
def stored(settings: Settings) -> Iterator[Coordinator]:
    """A coordinator on keys and a queue no worker reads: its deliverer is stepped by the test, in its thread."""
    coord = Coordinator(
        settings.model_copy(update={"queue": "subq-wh-stored", "key_prefix": STORED, "webhook_allow": ["127.0.0.1"]})
    )
    yield coord
    _clean(coord, STORED)
    coord.close()


def test_a_cancels_root_end_comes_after_every_childs_end_in_the_listing_and_the_claims(stored: Coordinator) -> None:
    """A root with twelve children, cancelled: the root's `task.cancelled` was the tree's first event, listed
    and claimed before any child's end (a receiver that tallies the tree at its end had none of it), and the
    listing put `_10`-`_13` before `_2`."""
    coord = stored
    root = coord.create_task("Plan.", webhooks=[{"url": "http://127.0.0.1:9/hook", "events": ["*"]}])
    children = coord.delegate(root.id, [{"description": f"c{i}", "message": "Wait."} for i in range(12)]).child_ids
    coord.cancel(root.id, "no longer needed")
    listed = coord.store.outbox.deliveries(root.id)
    assert [d["task_id"] for d in listed][-1] == root.id and {d["task_id"] for d in listed[:-1]} == set(children)
    numbers = [int(d["event_id"].rpartition("_")[2]) for d in listed]
    assert numbers == sorted(numbers), "oldest event first, by its number"
    claims = [m.split(" ")[1] for m in coord.client.zrange(coord.store.keys.outbox_pending(), 0, -1)]
    mine = [c for c in claims if c.startswith(f"evt_{root.id}_")]
    assert mine[-1] == listed[-1]["id"], "the root's end is claimed after its children's"
    statuses = [e["task_id"] for _, e in coord.store.events.read_events(root.id) if e.get("type") == "task_status"]
    assert statuses[-1] == root.id, "on the tree's stream too"


# An entry as no script writes it: not JSON, JSON that is no object, an object that names no subscription.
UNDECODABLE = {"not JSON": "{not json", "an array": "[1, 2]", "no hook": json.dumps({"task_id": "x", "attempts": 0})}


@pytest.mark.parametrize("stored_entry", list(UNDECODABLE.values()), ids=list(UNDECODABLE))
def test_an_entry_that_does_not_decode_is_given_up_at_once_and_its_batch_goes_on(
    stored: Coordinator, stored_entry: str
) -> None:
    """read_claimed.lua decoded each claimed entry itself: one that did not decode failed the whole step, the
    batch's deliveries were left claimed and unattempted, and the entry sank every batch it was claimed in,
    at each lease. It is given up, once, and still listed."""
    coord, outbox = stored, stored.store.outbox
    hooks = [{"url": "http://127.0.0.1:9/hook", "events": ["*"]}]
    broken, fine = (coord.create_task("Say hello.", webhooks=hooks) for _ in range(2))
    for root in (broken, fine):
        outbox.add_event(root.id, root.id, "task.completed", {})
    (entry,) = outbox.deliveries(broken.id)
    coord.client.hset(coord.store.keys.outbox(broken.id), entry["id"], stored_entry)
    assert coord.deliveries(broken.id) == [], "left out of the listing until given up (it failed the task's page)"
    deliverer = Deliverer(coord, lambda *_: None)
    try:
        assert deliverer.step() == 2, "both claimed, by a step that does not fail"
        (given_up,) = [outcome for outcome in deliverer._ended if outcome.root_id == broken.id]
        step_until(deliverer, lambda: [d["attempts"] for d in outbox.deliveries(fine.id)] == [1])
        assert [(d["state"], d["last"].partition(":")[0]) for d in outbox.deliveries(fine.id)] == [
            ("retrying", "ConnectError")
        ], "the rest of its batch attempted"
        ((state, attempts, last),) = [(d["state"], d["attempts"], d["last"]) for d in outbox.deliveries(broken.id)]
        assert (state, attempts) == ("given_up", 1) and last.startswith("its entry does not decode: "), last
        assert [(d.id, d.state) for d in coord.deliveries(broken.id)] == [(entry["id"], "given_up")]
        assert coord.client.zscore(coord.store.keys.outbox_pending(), f"{broken.id} {entry['id']}") is None
        outbox.settle_and_claim([given_up], 0, LEASE_MS)  # the step sent again, its reply lost
        assert [d["attempts"] for d in outbox.deliveries(broken.id)] == [1], "given up once"
        assert outbox.counts()[("unknown", "given_up")] == 1
    finally:
        deliverer._connections.close()


def test_a_callbacks_record_that_does_not_decode_gives_up_that_callback_alone(stored: Coordinator) -> None:
    """A Celery callback reads its task's whole record after the claim: one that did not decode (here its
    output_schema) failed the whole step, every delivery of the batch left claimed and unattempted."""
    coord, outbox = stored, stored.store.outbox
    sent: list[tuple[Any, ...]] = []
    hooks = [{"url": "http://127.0.0.1:9/hook"}]
    broken, fine = (coord.create_task("Say hello.", webhooks=hooks, on_complete="myapp.done") for _ in range(2))
    for root in (broken, fine):
        outbox.add_event(root.id, root.id, "task.completed", {})
    coord.client.hset(coord.store.keys.task(broken.id, broken.id), "output_schema", "{not json")
    deliverer = Deliverer(coord, lambda *args: sent.append(args))

    def outcomes() -> dict[tuple[str, str], tuple[str, str]]:
        return {
            (root.id, d["hook"]): (d["state"], d["last"])
            for root in (broken, fine)
            for d in outbox.deliveries(root.id)
            if d["attempts"]
        }

    try:
        assert deliverer.step() == 4, "all four claimed, by a step that does not fail"
        step_until(deliverer, lambda: len(outcomes()) == 4)
        found = outcomes()
        state, last = found[(broken.id, "c")]
        assert state == "given_up" and last.startswith("its stored data does not decode: CorruptError: "), last
        assert "output_schema is not JSON" in last
        assert found[(fine.id, "c")] == ("delivered", "sent to queue celery")
        assert [found[(root.id, "0")][0] for root in (broken, fine)] == ["retrying", "retrying"]
        (callback,) = [d for d in outbox.deliveries(fine.id) if d["hook"] == "c"]
        assert [(name, task_id) for name, _, task_id, _ in sent] == [("myapp.done", f"subq-{callback['id']}")]
    finally:
        deliverer._connections.close()


# An entry that decodes but makes no payload: without its time, fields that are no object, without its type.
NO_PAYLOAD = {
    "no ts": ({"ts": None}, "KeyError: 'ts'"),
    "fields not an object": ({"fields": [1, 2]}, "TypeError: "),
    "no type": ({"type": None}, "KeyError: 'type'"),
}


@pytest.mark.parametrize(("change", "why"), list(NO_PAYLOAD.values()), ids=list(NO_PAYLOAD))
def test_an_entry_that_makes_no_payload_is_given_up_not_claimed_for_ever(
    stored: Coordinator, change: dict[str, Any], why: str
) -> None:
    """An entry that decodes but lacks what the payload reads made `_begin` raise: the step logged it and left
    its claim to lapse, so it was claimed again at every lease and never given up."""
    coord, outbox = stored, stored.store.outbox
    root = coord.create_task("Say hello.", webhooks=[{"url": "http://127.0.0.1:9/hook", "events": ["*"]}])
    outbox.add_event(root.id, root.id, "task.completed", {})
    (entry,) = outbox.deliveries(root.id)
    changed = {**entry, "attempts": 2, **change}
    coord.client.hset(
        coord.store.keys.outbox(root.id), entry["id"], json.dumps({k: v for k, v in changed.items() if v is not None})
    )
    deliverer = Deliverer(coord, lambda *_: None)
    try:
        assert deliverer.step() == 1
        deliverer.step()
        ((state, attempts, last),) = [(d["state"], d["attempts"], d["last"]) for d in outbox.deliveries(root.id)]
        assert state == "given_up", (state, attempts, last)
        assert attempts == 3, "recorded against the attempts its claim read"
        assert last.startswith(f"its stored data makes no attempt: {why}"), last
        assert coord.client.zscore(coord.store.keys.outbox_pending(), f"{root.id} {entry['id']}") is None
        assert deliverer._busy == 0 and [d.state for d in coord.deliveries(root.id)] == ["given_up"]
    finally:
        deliverer._connections.close()


def test_a_webhook_on_an_internationalised_host_is_delivered_with_its_idna_host_header(
    stored: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL on an internationalised host name is accepted at creation; the deliverer sent its Host header as
    the raw Unicode netloc, which its own check refused before sending: every attempt failed, until given up."""
    coord = stored
    receiver = RawReceiver()
    try:
        root = coord.create_task("Say hello.", webhooks=[{"url": f"http://bücher.example:{receiver.port}/in"}])
        coord.store.outbox.add_event(root.id, root.id, "task.completed", {})
        # Its DNS answers with the receiver's address (a public one in life; no DNS is reachable from the tests).
        monkeypatch.setattr("coordinator.outbound.resolve_safe", lambda *_: "127.0.0.1")
        deliverer = Deliverer(coord, lambda *_: None)
        try:
            step_until(deliverer, lambda: coord.store.outbox.deliveries(root.id)[0]["attempts"] > 0)
        finally:
            deliverer._connections.close()
        ((state, last),) = [(d["state"], d["last"]) for d in coord.store.outbox.deliveries(root.id)]
        assert (state, last) == ("delivered", "HTTP 204"), (state, last)
        (head,) = receiver.requests
        assert f"host: xn--bcher-kva.example:{receiver.port}".encode() in head.split(b"\r\n"), head
    finally:
        receiver.stop()


@pytest.mark.parametrize(
    ("hook", "url", "shown"),
    [
        ("0", "https://hooks.example.com/in/T1?token=abc", "https://hooks.example.com/in/T1"),
        ("1", "https://user:pass@hooks.example.com:8443/in", "https://hooks.example.com:8443/in"),
        ("2", "http://[2001:db8::1]:8080/in?x=1", "http://[2001:db8::1]:8080/in"),
        ("n0", "https://hooks.slack.com/services/T0/B0/secret-path", "notify:n0 https://hooks.slack.com"),
        ("k1", "https://user:pass@ops.example.com/hook/secret", "key:k1 https://ops.example.com"),
    ],
)
def test_a_subscriptions_target_is_shown_without_its_secrets(hook: str, url: str, shown: str) -> None:
    assert shown_target(hook, {"kind": "webhook", "url": url, "secret": "whsec_x", "format": "json"}) == shown


def test_a_tenant_listing_its_deliveries_sees_the_operators_sink_by_its_host_alone(settings: Settings) -> None:
    """An operator's SUBQ_NOTIFY sink is written into every new tree's subscriptions, and a Slack incoming
    webhook's path is its credential: a tenant's `read` key listing its own tree's deliveries was shown the URL
    whole, and could post to the operator's channel. So was the creating key's webhook's path."""
    sink = "https://hooks.slack.com/services/T0OPERATOR/B0SECRET/xoxSECRETtoken123"
    coord = Coordinator(
        settings.model_copy(update={"key_prefix": "subqsinks", "notify": [NotifySink(url=sink, format="slack")]})
    )
    try:
        root = coord.create_task(
            "a tenant's tree", tenant="a", key_webhooks=[Webhook(url="https://ops.example.com/hook/K3Y")]
        )
        assert coord.store.outbox.add_event(root.id, root.id, "approval.requested", {"approval_id": "x"}) == 2
        shown = sorted(d.target for d in coord.deliveries(root.id))
        assert shown == ["key:k0 https://ops.example.com", "notify:n0 https://hooks.slack.com"], shown
    finally:
        _clean(coord, "subqsinks")
        coord.close()
