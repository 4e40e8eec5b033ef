"""The HTTP API across a Redis failover: its event stream goes on, and it takes work again once a replica is promoted.

Real sentinels (tests/sentinel_kit.py), a real worker, and the API served by
uvicorn on the sentinels' settings. A client follows a fan-out's event stream
(the API reads it from Redis with XREAD) while the master is SIGKILLed; the
stream, held open by the API through the switch, goes on to the fan-out's `end`
without the client reconnecting. After the promotion the API answers its health
check and runs a new tree submitted over HTTP, with exact totals.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.api.app import create_app
from coordinator.client import SubqClient
from coordinator.client.sse import Event
from tests.agents import STEP_COST_MICROS, TREE_REQUESTS, agent, call, reply, tree_root
from tests.helpers import TOKEN, ApiServer, api_settings, eventually
from tests.sentinel_kit import SentinelSet, assert_each_request_once, fleet_on, sentinel_set, wait_relinked
from tests.test_faults import assert_converged

CHILDREN = 8
# Each child waits this long on its model: the fan-out is running when the master dies. Beside two busy loops, 1.5 s
# was once too short: the test's thread saw the delegation only after the whole fan-out had ended.
CHILD_LATENCY_MS = 6000
WAIT_S = 120


@pytest.fixture
def api_on_sentinel(settings: Settings, tmp_path: Path) -> Iterator[tuple[SentinelSet, Coordinator, str]]:
    # min-replicas-to-write 1, as docs/deploy.md asks: no step of the fan-out stands on the promoted master alone,
    # where a second failover (tests/test_sentinel_fleet.py) would lose it after the stream showed it.
    with sentinel_set(tmp_path / "sentinels", min_replicas_to_write=1) as kit:
        names = {"key_prefix": "subqfailoverapi", "queue": "subq-failover-api"}
        with fleet_on(kit, api_settings(settings), 1, tmp_path / "workers", **names) as (_own, coord, _fleet):
            with ApiServer(create_app(coordinator=coord)) as server:
                yield kit, coord, server.url


def test_the_event_stream_goes_on_through_a_failover_and_the_api_takes_work_after(
    api_on_sentinel: tuple[SentinelSet, Coordinator, str],
) -> None:
    kit, coord, url = api_on_sentinel
    children = [
        {"description": f"c{n}", "message": agent({**reply(f"c{n} done"), "latency_ms": CHILD_LATENCY_MS})}
        for n in range(CHILDREN)
    ]
    with SubqClient(url, token=TOKEN) as subq:
        fan_out = subq.create_task(
            agent(call("run_subagents", tasks=children), reply("all done"), text="Fan out."), run=True
        )
        events: list[Event] = []
        failure: list[BaseException] = []

        def follow() -> None:
            try:
                with subq.fork() as own:
                    events.extend(own.events(fan_out.id))
            except BaseException as exc:  # shown by the assertion below
                failure.append(exc)

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        eventually(lambda: any(e.data.get("type") == "delegated" for e in events) or None, "the delegation event")
        seen_before_kill = len(events)
        assert not any(e.event == "end" for e in events), "the fan-out ended before the master was killed"

        old = kit.kill_master()
        kit.wait_promoted(old)

        reader.join(WAIT_S)
        assert not reader.is_alive() and not failure, failure
        assert len(events) > seen_before_kill, "events came after the failover"
        assert events[-1].event == "end" and events[-1].data == {"task_id": fan_out.id, "status": "completed"}
        ended = {e.data["task_id"] for e in events if e.data.get("type") == "task_status"}
        kids = {child.id for child in coord.get_children(fan_out.id)}
        assert len(kids) == CHILDREN and kids <= ended, "every child's end was streamed, before or after the switch"

        assert eventually(lambda: subq.health().status == "ok" or None, "the API's health after the promotion")
        # Once the surviving replica follows the promoted master, the set whole again: beside two busy loops, a
        # tree created while no replica followed it yet (subq warned its write reached none) was once not found
        # by the wait right after.
        wait_relinked(kit, 1)
        tree = subq.create_task(tree_root(), run=True)
        done = subq.wait(tree.id, WAIT_S)
        assert done.status == TaskStatus.COMPLETED and done.total_cost_micros == TREE_REQUESTS * STEP_COST_MICROS

    finished = coord.get_task(fan_out.id)
    assert finished.summary == "all done" and finished.requests == 2, "the agent resumed once"
    assert_each_request_once(finished, coord.get_children(fan_out.id))
    for root in (fan_out.id, tree.id):
        assert_converged(coord, root)
