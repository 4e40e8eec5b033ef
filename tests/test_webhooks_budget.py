"""A tree nearing its budget says so (issue 40): one `budget.warning` when its spend crosses
SUBQ_BUDGET_WARN_AT (0.8) of the budget, written by the step that records the spend, once per
threshold, before the tree's end; only to subscriptions that ask for `budget.*`, and to the operator's
SUBQ_NOTIFY sinks.

Real Redis; the step itself on a tree no worker runs (the store's `record_usage`, the very script a
run's steps call), and whole trees on real `celery worker` processes with real HTTP receivers on
127.0.0.1 (tests/webhook_kit.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook as Verifier

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.models import Usage
from coordinator.replies import UsageRecorded
from coordinator.settings import NotifySink
from tests.agents import STEP_COST_MICROS, agent, call, reply
from tests.conftest import dedicated_fleet
from tests.helpers import eventually
from tests.test_webhooks import FLEET, PREFIX, SECRET, WAIT_S, _clean
from tests.webhook_kit import Got, Receiver

IDLE_PREFIX = "subqwhbudget"
HOOK = "http://127.0.0.1:9/hook"  # never called: no worker reads these keys


def _seq(event_id: str) -> int:
    """An event's number in its tree (`evt_<root>_<n>`): the order the tree's steps wrote them."""
    return int(event_id.rsplit("_", 1)[1])


# -- the step itself ------------------------------------------------------------------------------


@pytest.fixture
def idle(settings: Settings) -> Iterator[Coordinator]:
    coord = Coordinator(
        settings.model_copy(
            update={"key_prefix": IDLE_PREFIX, "queue": "subq-wh-budget-idle", "webhook_allow": ["127.0.0.1"]}
        )
    )
    yield coord
    _clean(coord, IDLE_PREFIX)
    coord.close()


def _spend(coord: Coordinator, task_id: str, key: str, cost_micros: int) -> tuple[int, str | None]:
    return coord.store.runs.record_usage(task_id, key, Usage(tokens_in=10), cost_micros, "test")


def _warnings(coord: Coordinator, root_id: str) -> list[dict[str, Any]]:
    return [d for d in coord.store.outbox.deliveries(root_id) if d["type"] == "budget.warning"]


def test_the_step_that_crosses_the_share_writes_one_warning_per_threshold(idle: Coordinator) -> None:
    root = idle.create_task(
        "Plan.", budget_usd="0.10",
        webhooks=[{"url": HOOK}, {"url": HOOK, "events": ["task.*"]}, {"url": HOOK, "events": ["budget.warning"]}],
    )  # fmt: skip
    (child,) = idle.delegate(root.id, [{"description": "spender", "message": "Spend."}]).child_ids
    assert _spend(idle, child, "r:1", 70_000) == UsageRecorded(1, None)
    assert _warnings(idle, root.id) == [], "70 % crosses nothing"
    assert _spend(idle, child, "r:2", 15_000) == UsageRecorded(
        1, None
    )  # 85 %: the child's step crosses the root's 80 %
    warned = _warnings(idle, root.id)
    # One delivery to each subscription that asks for budget.* (the default, and by name), none to task.*.
    assert sorted(d["hook"] for d in warned) == ["0", "2"] and len({d["event_id"] for d in warned}) == 1
    assert warned[0]["task_id"] == root.id, "the warning is the budgeted task's, whoever spent"
    assert warned[0]["fields"] == {
        "budget_micros": 100_000, "total_cost_micros": 85_000, "share": 0.8, "share_percent": 80,
    }  # fmt: skip
    assert idle.client.hget(idle.store.keys.task(root.id, root.id), "budget_warned") == "0.8"

    # The same request again, another below the budget, another past it: no second warning.
    assert _spend(idle, child, "r:2", 15_000) == UsageRecorded(0, None)
    assert _spend(idle, child, "r:3", 10_000) == UsageRecorded(1, None)
    assert _spend(idle, child, "r:4", 10_000) == UsageRecorded(1, root.id)
    assert len(_warnings(idle, root.id)) == 2
    # A lower threshold later (another SUBQ_BUDGET_WARN_AT) is another threshold: a tree that has passed it
    # crossed it before and is not warned; one whose step crosses it is, once.
    idle.store.runs.budget_warn_at = 0.5
    try:
        other = idle.create_task("Plan.", budget_usd="0.10", webhooks=[{"url": HOOK}])
        _spend(idle, other.id, "r:1", 60_000)
        assert idle.client.hget(idle.store.keys.task(other.id, other.id), "budget_warned") == "0.5"
        idle.store.runs.budget_warn_at = 0.8
        _spend(idle, other.id, "r:2", 25_000)
        assert idle.client.hget(idle.store.keys.task(other.id, other.id), "budget_warned") == "0.5 0.8"
        assert [d["fields"]["share"] for d in _warnings(idle, other.id)] == [0.5, 0.8]
    finally:
        idle.store.runs.budget_warn_at = 0.8


def test_a_jump_past_the_share_and_the_budget_warns_once_and_each_budget_of_the_chain_its_own(
    idle: Coordinator,
) -> None:
    root = idle.create_task("Plan.", budget_usd="0.10", webhooks=[{"url": HOOK}])
    (child,) = idle.delegate(root.id, [{"description": "c", "message": "m", "budget_usd": 0.02}]).child_ids
    # 25,000 of the child's 20,000: past its 80 % and its 100 % in one step; 25 % of the root's.
    assert _spend(idle, child, "r:1", 25_000) == UsageRecorded(1, child)
    warned = _warnings(idle, root.id)
    assert [(d["task_id"], d["fields"]["total_cost_micros"]) for d in warned] == [(child, 25_000)]
    assert _spend(idle, child, "r:2", 60_000) == UsageRecorded(1, child)  # 85,000: the root's 80 % now
    assert [(d["task_id"], d["fields"]["budget_micros"]) for d in _warnings(idle, root.id)] == [
        (child, 20_000),
        (root.id, 100_000),
    ]


def test_a_tree_without_a_budget_or_without_subscriptions_writes_nothing_of_it(idle: Coordinator) -> None:
    plain = idle.create_task("Plan.", webhooks=[{"url": HOOK}])
    _spend(idle, plain.id, "r:1", 10_000_000)
    assert idle.store.outbox.deliveries(plain.id) == []
    assert idle.client.hget(idle.store.keys.task(plain.id, plain.id), "budget_warned") is None
    quiet = idle.create_task("Plan.", budget_usd="0.10")
    assert _spend(idle, quiet.id, "r:1", 90_000) == UsageRecorded(1, None)
    assert not idle.client.exists(idle.store.keys.outbox(quiet.id), idle.store.keys.hooks(quiet.id))


# -- whole trees on a fleet -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def sinks() -> Iterator[tuple[Receiver, Receiver]]:
    with Receiver() as json_sink, Receiver(status=200) as slack_sink:
        yield json_sink, slack_sink


@pytest.fixture(scope="module")
def fleet(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory, sinks: tuple[Receiver, Receiver]
) -> Iterator[Coordinator]:
    json_sink, slack_sink = sinks
    notify = [
        NotifySink(url=json_sink.url, secret=SECRET),
        NotifySink(url=slack_sink.url, format="slack"),
    ]
    logs = tmp_path_factory.mktemp("budget-workers")
    with dedicated_fleet(settings, logs, 1, **FLEET, notify=notify) as (coord, _workers):
        yield coord
        _clean(coord, PREFIX)


def _of_tree(receiver: Receiver, root_id: str) -> list[Got]:
    return [got for got in list(receiver.got) if "data" in got.json and got.json["data"]["tree_id"] == root_id]


def test_a_tree_with_a_budget_gets_one_warning_at_80_percent_then_its_end(
    fleet: Coordinator, sinks: tuple[Receiver, Receiver]
) -> None:
    coord = fleet
    json_sink, slack_sink = sinks
    # Four requests of 21,000 micro-USD against 100,000: the fourth takes the spend from 63 % to 84 %.
    steps = [call("update_todo_list", todos=f"[-] step {n}") for n in range(3)]
    with Receiver() as service, Receiver() as ends_only:
        root = coord.create_task(
            agent(*steps, reply("spent most of it")), run=True, budget_usd="0.10", metadata={"job": "j-7"},
            webhooks=[{"url": service.url, "secret": SECRET}, {"url": ends_only.url, "events": ["task.*"]}],
        )  # fmt: skip
        done = coord.wait(root.id, timeout_s=WAIT_S)
        assert done.status == TaskStatus.COMPLETED and done.total_cost_micros == 4 * STEP_COST_MICROS
        eventually(lambda: service.of_type("task.completed"), "the end delivered", timeout_s=WAIT_S)
        eventually(lambda: ends_only.of_type("task.completed"), "the end delivered", timeout_s=WAIT_S)
        eventually(lambda: _of_tree(json_sink, root.id), "the operator's sink warned", timeout_s=WAIT_S)
        eventually(lambda: slack_sink.got, "the slack sink warned", timeout_s=WAIT_S)
        time.sleep(2.0)  # a second copy would come within the backoff
        assert sorted(got.json["type"] for got in service.got) == ["budget.warning", "task.completed"]
        warning, end = service.of_type("budget.warning")[0], service.of_type("task.completed")[0]
        event = Verifier(SECRET).verify(warning.body, warning.headers)
        assert warning.headers["webhook-id"] == event["id"]
        assert _seq(event["id"]) < _seq(end.json["id"]), "the warning was written before the end"
        record = coord.get_task(root.id)
        data = event["data"]
        assert (data["tree_id"], data["task_id"], data["metadata"]) == (root.id, root.id, {"job": "j-7"})
        assert data["budget_micros"] == record.budget_micros == 100_000
        assert data["total_cost_micros"] == record.total_cost_micros == 84_000
        assert (data["share"], data["share_percent"]) == (0.8, 80)
        # A subscription that asks for task.* only gets no warning.
        assert [got.json["type"] for got in ends_only.got] == ["task.completed"]
        # The operator's sinks get budget events (and no end): the signed payload, and Slack's line.
        (sunk,) = _of_tree(json_sink, root.id)
        assert Verifier(SECRET).verify(sunk.body, sunk.headers)["id"] == event["id"]
        assert [got.json["text"] for got in slack_sink.got if root.id in got.json["text"]] == [
            f"subq: budget 80% spent (task {root.id})"
        ]
        delivered = ["budget.warning", "budget.warning", "budget.warning", "task.completed", "task.completed"]
        eventually(  # each answer is recorded at the deliverer's next step, a moment after its receiver saw it
            lambda: (
                sorted(d["type"] for d in coord.store.outbox.deliveries(root.id) if d["state"] == "delivered")
                == delivered
            ),
            "every delivery recorded as delivered",
        )


def test_a_jump_past_80_and_100_percent_in_one_step_warns_once_then_stops(
    fleet: Coordinator, sinks: tuple[Receiver, Receiver]
) -> None:
    coord = fleet
    steps = [call("update_todo_list", todos=f"[-] step {n}") for n in range(3)]
    with Receiver() as service:
        # One request of 21,000 against 20,000: past 80 % and 100 % at once.
        root = coord.create_task(
            agent(*steps, reply("never reached")), run=True, budget_usd="0.02", webhooks=[{"url": service.url}]
        )
        done = coord.wait(root.id, timeout_s=WAIT_S)
        assert done.status == TaskStatus.FAILED and done.error_class == "BudgetExhausted"
        eventually(lambda: service.of_type("task.failed"), "the budget stop delivered", timeout_s=WAIT_S)
        time.sleep(2.0)
        assert sorted(got.json["type"] for got in service.got) == ["budget.warning", "task.failed"]
        warning, end = service.of_type("budget.warning")[0].json, service.of_type("task.failed")[0].json
        assert _seq(warning["id"]) < _seq(end["id"]), "the warning, then the budget stop"
        assert warning["data"]["total_cost_micros"] == STEP_COST_MICROS == coord.get_task(root.id).total_cost_micros
        assert warning["data"]["budget_micros"] == 20_000
