"""A provider that misbehaves, over real HTTP: outages ridden out, Retry-After honoured, fallbacks,
and errors that say where (issue 33).

Each test talks to `tests/model_server.py` servers on loopback through pydantic-ai's OpenAI model,
as a hosted endpoint would be. Times are measured on the outside: the requests the servers
recorded, not a timer around the test. The outage test runs a real `celery worker` process
(concurrency 2), as its point is a worker slot given back and used by another profile's task.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.celery_app import make_app
from coordinator.endpoints import EndpointState
from coordinator.settings import Price, Profile
from tests import helpers
from tests.conftest import dedicated_fleet
from tests.helpers import eventually
from tests.model_server import USAGE, ModelServer, Turn, call, free_port
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child

# A run's start and end around a model's wait-out, on a loaded host (the wait-out's default is 600 s).
RUN_START_AND_END_S = 30

# The figures of issue 33's acceptance: a 40 s outage, four tasks in flight, a worker of two slots.
OUTAGE_S = 40.0
TASKS_IN_FLIGHT = 4
WORKER_SLOTS = 2
# Prices in USD per million tokens: the primary's and the backup's differ, so a cost says which answered.
PRIMARY_PRICE = Price(input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))
BACKUP_PRICE = Price(input_per_mtok=Decimal("0.5"), output_per_mtok=Decimal(2))
# Two models one endpoint serves (the views of the fleet's gate tests).
MODEL_A, MODEL_B = "openai:model-a", "openai:model-b"
# Two turns: a tool call, then the answer (each response has USAGE).
TURNS = [Turn(calls=[call("update_todo_list", todos="[-] look")]), Turn(text="all done")]


def micros(price: Price, responses: int) -> int:
    prompt, completion = USAGE
    return int(responses * (prompt * price.input_per_mtok + completion * price.output_per_mtok))


def profile(server_url: str, key: str, **fields: object) -> Profile:
    return Profile.model_validate({"model": "openai:test-model", "base_url": server_url, "api_key": key, **fields})


@pytest.fixture
def primary() -> Iterator[ModelServer]:
    with ModelServer(TURNS) as server:
        yield server


@pytest.fixture
def backup() -> Iterator[ModelServer]:
    with ModelServer(TURNS) as server:
        yield server


def in_process(settings: Settings, profiles: dict[str, Profile], prefix: str) -> Settings:
    """Settings of a run made in this process: a queue no worker reads, keys no session reconciler serves."""
    return settings.model_copy(
        update={
            "queue": "subq-nobody",
            "key_prefix": f"subqprov{prefix}",
            "profiles": {**settings.profiles, **profiles},
        }
    )


# -- 5. errors that say where -----------------------------------------------------------------


def test_a_connection_failure_names_the_profile_model_and_port_and_fails_within_its_wait_out_time(
    settings: Settings,
) -> None:
    port = free_port()  # nothing listens there
    local = in_process(
        settings, {"nowhere": profile(f"http://127.0.0.1:{port}/v1", "sk-secret-key", model_wait_out_s=3)}, "where"
    )
    coord = Coordinator(local)
    task = coord.create_task("Say hello.", profile="nowhere", run=True)

    result = run_child(build_runtime(local, make_app(local)), task.id)

    record = coord.get_task(task.id)
    assert result.status == record.status == TaskStatus.FAILED
    assert record.error_class == "ModelConnectionError"
    error = record.error or ""
    assert f"endpoint 127.0.0.1:{port}" in error and "model openai:test-model" in error and "'nowhere'" in error
    assert "sk-secret-key" not in error and "Connection error" in error
    assert "gave up after" in error and "model_wait_out_s=3" in error
    # Within seconds: its wait-out time, counted from the first failure, plus a run's start and end; a bound
    # that a host beside two busy loops keeps (15.7 s was seen against 13), far below the default's 600 s.
    assert record.finished_at is not None and record.finished_at - record.created_at < 3 + RUN_START_AND_END_S
    assert int(coord.store.records.task_field(task.id, "transient_errors") or 0) >= 2, "it was sent again"
    waits = [m["text"] for m in coord.messages(task.id) if m.get("say") == "wait_out"]
    assert waits and all(f"endpoint 127.0.0.1:{port}" in line and "waiting it out (attempt" in line for line in waits)
    coord.close()


# -- 3. Retry-After honoured ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "value", "least_gap_s"), [("Retry-After", "4", 4.0), ("retry-after-ms", "2500", 2.5)]
)
def test_the_wait_a_429_asks_for_is_honoured_and_the_task_completes(
    settings: Settings, primary: ModelServer, header: str, value: str, least_gap_s: float
) -> None:
    local = in_process(settings, {"main": profile(primary.base_url, primary.key, price=PRIMARY_PRICE)}, "429")
    coord = Coordinator(local)
    primary.fail(429, times=1, headers={header: value})
    task = coord.create_task("Look and report.", profile="main", run=True)

    result = run_child(build_runtime(local, make_app(local)), task.id)

    assert result.status == "completed" and result.summary == "all done"
    seen = primary.seen
    assert [s.status for s in seen] == [429, 200, 200]
    gap_s = seen[1].at_s - seen[0].at_s
    assert gap_s >= least_gap_s, f"the next request came {gap_s:.2f} s after the 429, which asked for {value} {header}"
    record = coord.get_task(task.id)
    assert record.cost_micros == micros(PRIMARY_PRICE, 2), "only the answered requests cost"
    assert record.times is not None and record.times.wait_by_reason_ms.get("provider", 0) >= least_gap_s * 1000 * 0.9
    assert coord.store.endpoints.state(f"127.0.0.1:{primary.port}") == {}, "a success clears the fleet's view"
    coord.close()


# -- 4. fallbacks -----------------------------------------------------------------------------


@pytest.mark.parametrize("status", [503, 404, 401])
def test_a_request_the_provider_keeps_failing_or_refuses_goes_to_the_fallback_priced_there(
    settings: Settings, primary: ModelServer, backup: ModelServer, status: int
) -> None:
    profiles = {
        "main": profile(primary.base_url, primary.key, price=PRIMARY_PRICE, fallback_profiles=["backup"]),
        "backup": profile(backup.base_url, backup.key, price=BACKUP_PRICE),
    }
    local = in_process(settings, profiles, f"fb{status}")
    coord = Coordinator(local)
    primary.fail(status)  # for good
    task = coord.create_task("Look and report.", profile="main", run=True)

    result = run_child(build_runtime(local, make_app(local)), task.id)

    assert result.status == "completed" and result.summary == "all done"
    assert len(backup.answered()) == 2 and primary.answered() == []
    record = coord.get_task(task.id)
    assert record.requests == 2
    assert record.cost_micros == record.total_cost_micros == micros(BACKUP_PRICE, 2), "priced at the backup's price"
    assert record.cost_source == "profile price (fallback: profile 'backup', openai:test-model)"
    fallbacks = [m for m in coord.messages(task.id) if m.get("say") == "fallback"]
    assert len(fallbacks) == 2 and "'backup'" in fallbacks[0]["text"]
    if status == 503:  # it kept failing: a few tries, then the fleet's view sends requests straight on
        # At least the one that failed, and at most the fallback threshold's three plus one sent as the
        # endpoint went down (the fleet's view then sends the rest straight on): 0 or 5+ fails this.
        assert 1 <= primary.statuses().count(503) <= 4
    else:  # a refusal goes on at once
        assert primary.statuses().count(status) == 2
    coord.close()


def test_a_refused_model_waits_for_its_fallback_to_come_back(
    settings: Settings, primary: ModelServer, backup: ModelServer
) -> None:
    profiles = {
        "main": profile(primary.base_url, primary.key, price=PRIMARY_PRICE, fallback_profiles=["backup"]),
        "backup": profile(backup.base_url, backup.key, price=BACKUP_PRICE),
    }
    local = in_process(settings, profiles, "fbwait")
    coord = Coordinator(local)
    primary.fail(401)  # for good
    backup.fail(503, times=4)  # past the fallback threshold: every profile of the chain fails at once

    result = run_child(build_runtime(local, make_app(local)), coord.create_task("Look.", profile="main", run=True).id)

    assert result.status == "completed", result.error
    assert backup.statuses() == [503] * 4 + [200, 200]
    assert result.cost_micros == micros(BACKUP_PRICE, 2)
    coord.close()


def test_a_refusal_the_fallbacks_share_fails_the_task_naming_the_last_profile(
    settings: Settings, primary: ModelServer, backup: ModelServer
) -> None:
    profiles = {
        "main": profile(primary.base_url, primary.key, fallback_profiles=["backup"]),
        "backup": profile(backup.base_url, backup.key),
    }
    local = in_process(settings, profiles, "fbboth")
    coord = Coordinator(local)
    primary.fail(404)
    backup.fail(400)
    task = coord.create_task("Look and report.", profile="main", run=True)

    result = run_child(build_runtime(local, make_app(local)), task.id)

    record = coord.get_task(task.id)
    assert result.status == record.status == TaskStatus.FAILED
    assert (record.error or "").startswith("HTTP 400 invalid_request_error")
    assert f"profile 'backup', model openai:test-model, endpoint 127.0.0.1:{backup.port}" in (record.error or "")
    coord.close()


# -- 3. an outage ridden out, its worker slots given back -------------------------------------


def test_an_outage_is_waited_out_without_holding_the_worker(
    settings: Settings, primary: ModelServer, backup: ModelServer, tmp_path: Path
) -> None:
    """Four tasks wait out a 40 s outage of their provider; meanwhile a task of another profile runs on the
    same worker process, of two slots, and completes during the outage. The fleet probes the endpoint one
    request at a time instead of each run hammering it."""
    profiles = {
        "flaky": profile(primary.base_url, primary.key, price=PRIMARY_PRICE),
        "steady": profile(backup.base_url, backup.key, price=BACKUP_PRICE),
    }
    with dedicated_fleet(
        settings, tmp_path, 1, queue="subq-outage", key_prefix="subqoutage", worker_concurrency=WORKER_SLOTS,
        profiles={**settings.profiles, **profiles},
    ) as (coord, _fleet):  # fmt: skip
        primary.fail(503, for_s=OUTAGE_S)
        outage_ends = time.time() + OUTAGE_S
        flaky = [coord.create_task(f"Flaky task {i}.", profile="flaky", run=True) for i in range(TASKS_IN_FLIGHT)]
        # Every flaky task has given its worker slot back (both slots were taken by the first two).
        # Every flaky task is seen waiting for its provider (the two it started with gave their slots back).
        seen_waiting: set[str] = set()

        def all_seen_waiting() -> bool:
            seen_waiting.update(t.id for t in flaky if _live_state(coord, t.id) == "waiting_provider")
            return len(seen_waiting) == TASKS_IN_FLIGHT

        eventually(all_seen_waiting, "every flaky task waiting for its provider", timeout_s=OUTAGE_S / 2)
        steady = coord.create_task("Steady task.", profile="steady", run=True)
        done = coord.wait(steady.id, timeout_s=OUTAGE_S)
        assert done.status == TaskStatus.COMPLETED, done.error
        assert done.finished_at is not None and done.finished_at < outage_ends, "it ran during the outage"

        ended = [coord.wait(t.id, timeout_s=OUTAGE_S * 3) for t in flaky]

        assert [t.status for t in ended] == [TaskStatus.COMPLETED] * TASKS_IN_FLIGHT, [t.error for t in ended]
        first_answer = min(s.wall_s for s in primary.answered())
        assert first_answer >= outage_ends - 1, "nothing was answered during the outage"
        for task in ended:
            assert task.cost_micros == micros(PRIMARY_PRICE, 2), "the failed requests cost nothing"
            assert task.times is not None and task.times.wait_by_reason_ms.get("provider", 0) > 0
        # The fleet probed the endpoint one request at a time: once its backoff has grown (from the 8th failure,
        # at least 3.2 s with the tests' 0.05 s base), never two failed requests close together, whichever
        # tasks sent them; four tasks retrying each on its own would send about four times as many.
        failed_at = [s.at_s for s in primary.seen if s.status == 503]
        gaps = [b - a for a, b in itertools.pairwise(failed_at[7:])]
        assert gaps and min(gaps) >= 1.0, f"requests hammered the endpoint: gaps {gaps}"
        assert len(failed_at) < 30, f"{len(failed_at)} failed requests in a {OUTAGE_S:g} s outage"


def _live_state(coord: Coordinator, task_id: str) -> str | None:
    live = coord.snapshot(task_id).get(task_id)
    return None if live is None else live.state


# -- the fleet's one view of an endpoint (real Redis) -------------------------------------------


def test_an_endpoint_is_down_for_the_whole_fleet_and_one_probe_decides_when_it_is_back(
    idle_coordinator: Coordinator,
) -> None:
    store = idle_coordinator.store.endpoints

    def gate(*args: object) -> EndpointState:
        return store.gate(*args)  # type: ignore[arg-type]

    def mark(*args: object, **kwargs: object) -> EndpointState:
        return store.failed(*args, **kwargs)  # type: ignore[arg-type]

    endpoint = f"10.0.0.1:{time.time_ns() % 60000}"
    # Waits of a second or two: a loaded host takes tens of milliseconds between two steps of this test, and
    # a wait that ran out between them would read as "up" (seen with a 50 ms base under two busy cores).
    backoff: dict[str, Any] = {"base_ms": 1000, "cap_ms": 2000, "jitter": 0.0, "asked_ms": None, "keep_ms": 60_000}
    assert gate(endpoint, MODEL_A, "run-a", 10_000, 1000) == EndpointState(0, 0, "", ""), (
        "an endpoint nobody saw fail is up"
    )

    first = mark(endpoint, "", "HTTP 503 server_error: down", **backoff)
    assert (first.failures, 500 <= first.wait_ms <= 1000) == (1, True), first
    # The requests in flight as it went down fail too: they do not count again, nor shorten the wait.
    again = mark(endpoint, "", "HTTP 503 server_error: down", **backoff)
    assert again.failures == 1 and again.wait_ms <= first.wait_ms
    waiting = gate(endpoint, MODEL_A, "run-b", 10_000, 1000)
    assert waiting.wait_ms > 0 and waiting.error == "HTTP 503 server_error: down", "every run waits, none sends"

    time.sleep(first.wait_ms / 1000 + 0.02)
    assert gate(endpoint, MODEL_A, "run-a", 10_000, 1000).wait_ms == 0, "the first to ask once it is due probes"
    held = gate(endpoint, MODEL_A, "run-b", 10_000, 1000)
    assert 0 < held.wait_ms <= 1000, "the others wait for the probe's answer"
    assert gate(endpoint, MODEL_A, "run-a", 10_000, 1000).wait_ms == 0, "the probe may send again"
    probe_failed = mark(endpoint, "", "HTTP 503 server_error: still down", **backoff)
    assert probe_failed.failures == 2 and probe_failed.wait_ms >= 1000, "a failed probe backs off further"

    for _ in range(6):  # the backoff is capped
        time.sleep(gate(endpoint, MODEL_A, "run-a", 10_000, 1000).wait_ms / 1000 + 0.01)
        gate(endpoint, MODEL_A, "run-a", 10_000, 1000)
        capped = mark(endpoint, "", "HTTP 503 server_error: still down", **backoff)
    assert capped.failures == 8 and capped.wait_ms <= 2000
    asked = mark(endpoint, "", "HTTP 429", **{**backoff, "asked_ms": 4000})
    assert asked.wait_ms >= 4000, "a Retry-After longer than the backoff is honoured"

    parked = idle_coordinator.create_task("parked while its provider is down")
    timer = f"provider-wait:{parked.id}"
    store.park(endpoint, "", parked.id, timer, time.time() + 3600, 1234, 60)
    assert store.wait_since_ms(parked.id) == 1234, "its first wait is kept on the task, across runs"
    assert timer not in idle_coordinator.store.convergence.due_timers(100)
    woken = store.recovered(endpoint, MODEL_A)
    assert woken == [parked.id] and store.state(endpoint) == {}, "a success clears it, and finds who waits"
    store.wake_now([f"provider-wait:{task_id}" for task_id in woken])
    assert timer in idle_coordinator.store.convergence.due_timers(100), "woken now, not at its timer's time"
    assert store.recovered(endpoint, MODEL_A) == [], "once"
    idle_coordinator.store.convergence.remove_timers([timer])


@pytest.mark.parametrize(
    ("profiles", "error"),
    [
        (
            {"main": {"fallback_profiles": ["nope"]}},
            "SUBQ_PROFILES: profile 'main': fallback_profiles names 'nope', which is not a profile (known: main, offline)",
        ),
        (
            {"main": {"fallback_profiles": ["b"]}, "b": {"fallback_profiles": ["c"]}, "c": {"fallback_profiles": ["main"]}},
            "SUBQ_PROFILES: profile 'main': fallback_profiles go round in a cycle (main -> b -> c -> main)",
        ),
        ({"main": {"fallback_profiles": ["main"]}}, "profile 'main': fallback_profiles go round in a cycle (main -> main)"),
        ({"main": {"model_wait_out_s": -1}}, "SUBQ_PROFILES (main.model_wait_out_s): Input should be greater than or equal to 0"),
        # Its deprecated name is still read, and named as written.
        ({"main": {"model_retry_for_s": -1}}, "SUBQ_PROFILES (main.model_retry_for_s): Input should be greater than or equal to 0"),
    ],
    ids=["unknown", "cycle", "itself", "negative", "negative-deprecated-name"],
)  # fmt: skip
def test_a_bad_fallback_or_wait_out_time_is_one_line_naming_the_profile_and_field(
    profiles: dict[str, object], error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert error in helpers.profiles_refused(profiles, monkeypatch)


def test_a_chain_lists_each_fallback_after_its_profile_once(tmp_path: Path) -> None:
    file = tmp_path / "profiles.toml"
    file.write_text(
        '[profiles.main]\nfallback_profiles = ["b", "c"]\n[profiles.b]\nfallback_profiles = ["c"]\n[profiles.c]\n'
    )
    from coordinator.settings import load_settings

    loaded = load_settings(profiles_file=file)
    assert loaded.fallback_chain("main") == ["main", "b", "c"] and loaded.fallback_chain("c") == ["c"]
    file.write_text('[profiles.main]\nfallback_profiles = ["gone"]\n')
    from coordinator import ConfigError

    with pytest.raises(
        ConfigError, match=rf"SUBQ_PROFILES_FILE: {file}: profile 'main': fallback_profiles names 'gone'"
    ):
        load_settings(profiles_file=file)


# -- a parked run: saved, its worker given back, woken, and stopped while it waits ----------------


@pytest.mark.parametrize("then", ["wake", "cancel"])
def test_a_long_wait_parks_the_run_on_a_timer_and_the_task_goes_on_or_stops_from_there(
    settings: Settings, primary: ModelServer, then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator import dispatch, endpoints

    local = in_process(settings, {"main": profile(primary.base_url, primary.key, model_wait_out_s=120)}, f"park{then}")
    coord = Coordinator(local)
    coord.client.delete("subq-nobody")
    # Longer than a run waits inside itself: the run gives its worker back at once.
    primary.fail(503, times=1, headers={"Retry-After": "30"})
    task = coord.create_task("Look and report.", profile="main", run=True)
    runtime = build_runtime(local, make_app(local))

    parked = run_child(runtime, task.id)

    assert parked.status == "queued", "to Celery the run is queued again, with a delay"
    timer = endpoints.timer(task.id)
    due_at = coord.client.zscore(coord.store.keys.timers(), timer)
    assert due_at is not None and 25 < due_at - time.time() <= 30, "woken when the endpoint may be tried"
    assert task.id not in coord.store.convergence.watched(), "no lost run for the reconciler to publish"
    assert not coord.store.convergence.triage([task.id])[0].leased, "the worker is given back"
    assert _live_state(coord, task.id) == "waiting_provider"
    record = coord.get_task(task.id)
    assert record.status == TaskStatus.ACTIVE and record.timeline is not None
    assert record.timeline.m[-1][1] == "wait:provider" and record.waiting_for == "provider"
    assert coord.store.endpoints.wait_since_ms(task.id) is not None
    assert len(coord.messages(task.id, kind="api")) == 1, "its request is kept for the run that goes on"
    queued_before = coord.client.llen("subq-nobody")

    if then == "cancel":
        coord.cancel(task.id, "not needed any more")
        endpoints.wake(coord.plane, task.id)  # its timer comes due
        assert coord.client.llen("subq-nobody") == queued_before, "a stopped task is not run again"
        assert coord.get_task(task.id).status == TaskStatus.CANCELLED
    else:
        # Another run's probe finds the endpoint back: the parked run's timer comes due now, not in 30 s.
        endpoints.recovered(coord.plane, f"127.0.0.1:{primary.port}", "openai:test-model")
        assert timer in coord.store.convergence.due_timers(1000)
        # The run the wake publishes may start and say `running` at once: `queued` must be said before it is sent,
        # or it lands on top of `running` (the live status read at the publish is kept, and the publish made).
        publish, live_at_publish = dispatch.publish_restart, []

        def publish_restart(*args: Any, **kwargs: Any) -> Any:
            live_at_publish.append(_live_state(coord, task.id))
            return publish(*args, **kwargs)

        monkeypatch.setattr(dispatch, "publish_restart", publish_restart)
        endpoints.wake(coord.plane, task.id)  # the reconciler serves it
        assert live_at_publish == ["queued"]
        assert coord.client.llen("subq-nobody") == queued_before + 1, "its run is published again"
        assert task.id in coord.store.convergence.watched(), "watched again, should that message be lost"
        done = run_child(runtime, task.id)  # the worker that takes the message
        assert done.status == "completed" and done.summary == "all done"
        assert [s.status for s in primary.seen] == [503, 200, 200]
        assert coord.store.endpoints.wait_since_ms(task.id) is None, "its wait is over"
        record = coord.get_task(task.id)
        assert record.requests == 2 and record.times is not None and record.waiting_for is None
        assert record.times.wait_by_reason_ms.get("provider", 0) > 0
    coord.client.delete("subq-nobody")
    coord.store.convergence.remove_timers([timer])
    coord.close()
