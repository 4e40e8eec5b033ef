"""Approvals told where they are decided (issue 40): a child waiting for a decision sends `approval.requested`
to the root's webhook and to the operator's SUBQ_NOTIFY sink (`format = "slack"`: one line with the web
view's link) within 2 s, from the same MULTI that parks it; the decision sends `approval.decided` with
`decided_by`.

Real Redis, real `celery worker` processes and real HTTP receivers on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from standardwebhooks.webhooks import Webhook as Verifier

from coordinator import Actor, Coordinator, Settings
from coordinator.local.fleet import WorkerFleet
from coordinator.outbound import slack_line
from coordinator.settings import NotifySink
from tests.agents import agent, call, reply
from tests.conftest import dedicated_fleet
from tests.helpers import HostLag, eventually
from tests.test_webhooks import FLEET, PREFIX, SECRET, WAIT_S, _clean
from tests.webhook_kit import Receiver

API_URL = "https://subq.example.com"


@pytest.fixture
def receivers() -> Iterator[tuple[Receiver, Receiver]]:
    with Receiver(status=200) as slack, Receiver() as service:
        yield slack, service


@pytest.fixture
def fleet(
    settings: Settings, tmp_path: Path, receivers: tuple[Receiver, Receiver]
) -> Iterator[tuple[Coordinator, WorkerFleet]]:
    slack, _ = receivers
    sinks = [NotifySink(url=slack.url, format="slack")]
    with dedicated_fleet(settings, tmp_path / "w", 1, **FLEET, notify=sinks, api_url=API_URL) as (coord, workers):
        yield coord, workers
        _clean(coord, PREFIX)


def test_an_approval_reaches_the_slack_sink_within_2_s_and_its_decision_names_who(
    fleet: tuple[Coordinator, WorkerFleet], receivers: tuple[Receiver, Receiver]
) -> None:
    coord, _ = fleet
    slack, service = receivers
    root = coord.create_task(
        "Plan.", metadata={"ticket": "T-9"}, webhooks=[{"url": service.url, "secret": SECRET, "events": ["approval.*"]}]
    )
    batch = coord.delegate(
        root.id, [{"description": "tidy", "message": agent(call("run_command", command="echo tidy"), reply("tidied"))}]
    )
    child_id = batch.child_ids[0]
    with HostLag() as lag:  # the deliverer's poll and the receiver's thread wake late alike on a loaded host
        waiting = eventually(lambda: coord.list_approvals(root.id), "the child waits for a decision", timeout_s=WAIT_S)
        told = eventually(lambda: slack.got, "the slack sink told", timeout_s=WAIT_S)[0]
    approval = waiting[0]
    heard_in_s = told.at - approval.created_at
    assert heard_in_s < lag.bound_s(2.0), (
        f"the sink heard of it in {heard_in_s:.2f} s, host late by {lag.worst_s:.2f} s"
    )
    link = f"{API_URL}/ui/tasks/{child_id}"
    assert told.json == {
        "text": f'subq: approval waiting: run_command {{"command": "echo tidy"}} (task {child_id}) <{link}|open in subq>'
    }
    got = eventually(lambda: service.of_type("approval.requested"), "approval.requested", timeout_s=WAIT_S)
    event = Verifier(SECRET).verify(got[0].body, got[0].headers)
    data = event["data"]
    assert (data["approval_id"], data["tool"], data["task_id"]) == (approval.id, "run_command", child_id)
    assert data["arguments"] == '{"command": "echo tidy"}' and data["link"] == link
    assert data["metadata"] == {"ticket": "T-9"} and data["tree_id"] == root.id

    coord.decide(approval.id, "approve", actor=Actor("alice", via="api"))
    decided = eventually(lambda: service.of_type("approval.decided"), "approval.decided", timeout_s=WAIT_S)
    assert decided[0].json["data"]["decided_by"] == "alice" and decided[0].json["data"]["status"] == "approved"
    eventually(lambda: len(slack.got) >= 2, "the slack sink told of the decision", timeout_s=WAIT_S)
    assert slack.got[1].json["text"].startswith("subq: approval approved by alice: run_command")
    coord.wait(root.id, timeout_s=WAIT_S)
    # The root's end is no approval: neither subscription asked for it.
    assert not service.of_type("task.completed") and len(slack.got) == 2


def test_a_slack_line_shows_a_bidi_override_and_markup_as_text() -> None:
    """Slack renders what it is sent: a right-to-left override would show a tool call's file name reversed to
    the approver, and `<...>` would be a link or a mention."""
    body = {
        "type": "approval.requested",
        "data": {"tool": "run_command", "arguments": '{"cmd": "rm -rf ~/\u202etxt.exe <!channel>"}', "task_id": "t1"},
    }
    line = slack_line(body)
    assert "\u202e" not in line and "\\u202e" in line and "&lt;!channel&gt;" in line, line
