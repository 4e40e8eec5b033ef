"""Provider health per model, and true counts (issue 42, point 5).

One endpoint (a host and port) serves many models: OpenAI's, OpenRouter's, a LiteLLM proxy's, an
Ollama server's. The fleet keeps one view of the host (refused or dropped connections, timeouts) and
one per model there (what the provider answered of it: 429, 5xx, 529), so a fallback to another model
on the same endpoint is sent while the first model is down. And a task's `transient_errors` and its
`wait_out` lines' attempt numbers go on across the parks of its run, as they did not: a run woken after a
park counted from 1 again, and the record had no `transient_errors` at all.

Each test talks to `tests/model_server.py` servers on loopback through pydantic-ai's OpenAI model, as
a hosted endpoint would be; the acceptance and the killed server run on real `celery worker` processes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.celery_app import make_app
from coordinator.endpoints import HOST, MODEL, EndpointState
from coordinator.settings import Price, Profile
from tests.conftest import dedicated_fleet
from tests.helpers import eventually
from tests.model_server import USAGE, ModelServer, Turn, call
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child

PRIMARY_MODEL, BACKUP_MODEL = "primary-model", "backup-model"
# Prices in USD per million tokens: the primary's and the backup's differ, so a cost says which answered.
PRIMARY_PRICE = Price(input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))
BACKUP_PRICE = Price(input_per_mtok=Decimal("0.5"), output_per_mtok=Decimal(2))
# Two turns: a tool call, then the answer (each response has USAGE).
TURNS = [Turn(calls=[call("update_todo_list", todos="[-] look")]), Turn(text="all done")]
# The acceptance: a fallback on the same endpoint completes the task within this.
SAME_ENDPOINT_WITHIN_S = 10.0
# A wait just past what a run sleeps inside itself (5 s): each failure gives the worker back.
PARKING_RETRY_AFTER_MS = 5200


def micros(price: Price, responses: int) -> int:
    prompt, completion = USAGE
    return int(responses * (prompt * price.input_per_mtok + completion * price.output_per_mtok))


def profile(server: ModelServer, model: str, **fields: object) -> Profile:
    return Profile.model_validate(
        {"model": f"openai:{model}", "base_url": server.base_url, "api_key": server.key, **fields}
    )


def same_endpoint(server: ModelServer) -> dict[str, Profile]:
    """A primary model and its fallback, another model of the same host and port."""
    return {
        "main": profile(server, PRIMARY_MODEL, price=PRIMARY_PRICE, fallback_profiles=["backup"]),
        "backup": profile(server, BACKUP_MODEL, price=BACKUP_PRICE),
    }


@pytest.fixture
def server() -> Iterator[ModelServer]:
    with ModelServer(TURNS) as started:
        yield started


def in_process(settings: Settings, profiles: dict[str, Profile], prefix: str) -> Settings:
    """Settings of a run made in this process: a queue no worker reads, keys no session reconciler serves."""
    return settings.model_copy(
        update={
            "queue": "subq-nobody",
            "key_prefix": f"subqhealth{prefix}",
            "profiles": {**settings.profiles, **profiles},
        }
    )


def wait_out_attempts(coord: Coordinator, task_id: str) -> list[int]:
    """The attempt numbers of the task's `wait_out` UI lines, in order."""
    lines = [m["text"] for m in coord.messages(task_id) if m.get("say") == "wait_out"]
    return [int(found.group(1)) for line in lines if (found := re.search(r"waiting it out \(attempt (\d+)\)$", line))]


# -- the acceptance: a fallback on the same endpoint ----------------------------------------------


def test_a_fallback_to_another_model_of_the_same_endpoint_completes_the_task_priced_there(
    settings: Settings, server: ModelServer, tmp_path: Path
) -> None:
    """The primary model answers 503 always; the backup, another model of the same host and port, completes
    the task within 10 s (with the default backoff), priced at the backup. The endpoint's host stays up for
    the fleet, only the primary model is down, and a task sent after that goes straight to the backup."""
    server.fail(503, model=PRIMARY_MODEL)  # for good
    with dedicated_fleet(
        settings, tmp_path, 1, queue="subq-same-endpoint", key_prefix="subqsameendpoint",
        profiles={**settings.profiles, **same_endpoint(server)}, model_backoff_base_s=0.5, model_backoff_max_s=10,
    ) as (coord, _fleet):  # fmt: skip
        task = coord.create_task("Look and report.", profile="main", run=True)
        done = coord.wait(task.id, timeout_s=SAME_ENDPOINT_WITHIN_S * 3)

        assert done.status == TaskStatus.COMPLETED and done.summary == "all done", done.error
        assert done.finished_at is not None and done.finished_at - done.created_at < SAME_ENDPOINT_WITHIN_S
        assert done.cost_micros == done.total_cost_micros == micros(BACKUP_PRICE, 2), "priced at the backup"
        assert done.cost_source == f"profile price (fallback: profile 'backup', openai:{BACKUP_MODEL})"
        answered = server.answered()
        assert [s.model for s in answered] == [BACKUP_MODEL] * 2
        assert {s.model for s in server.seen if s.status == 503} == {PRIMARY_MODEL}
        # Its failed requests before the fallback were waited out and sent again: each counted, none billed.
        assert done.transient_errors == wait_out_attempts(coord, task.id)[-1] == 2, coord.messages(task.id)

        endpoint = f"127.0.0.1:{server.port}"
        views = coord.store.endpoints
        assert views.state(endpoint) == {}, "the host answered every request: it is up"
        assert int(views.state(endpoint, f"openai:{PRIMARY_MODEL}")["failures"]) >= 3, "the primary model is down"
        assert views.state(endpoint, f"openai:{BACKUP_MODEL}") == {}

        failed_before = server.statuses().count(503)
        second = coord.wait(coord.create_task("Again.", profile="main", run=True).id, timeout_s=SAME_ENDPOINT_WITHIN_S)
        assert second.status == TaskStatus.COMPLETED, second.error
        assert second.cost_micros == micros(BACKUP_PRICE, 2) and second.transient_errors == 0
        # The fleet knows the model down: its requests go straight on, but for one probe once its wait is over.
        assert server.statuses().count(503) - failed_before <= 1


# -- the two views of an endpoint (real Redis) ----------------------------------------------------


def test_a_models_outage_is_not_its_hosts_and_a_hosts_is_every_models(idle_coordinator: Coordinator) -> None:
    store = idle_coordinator.store.endpoints
    endpoint = f"10.0.0.2:{time.time_ns() % 60000}"
    model_a, model_b = "openai:model-a", "openai:model-b"
    backoff: dict[str, Any] = {"base_ms": 2000, "cap_ms": 4000, "jitter": 0.0, "asked_ms": None, "keep_ms": 60_000}

    def gate(model: str, token: str = "run-a") -> EndpointState:
        return store.gate(endpoint, model, token, 10_000, 1000)

    marked = store.failed(endpoint, model_a, "HTTP 503 server_error: overloaded", **backoff)
    assert (marked.failures, marked.view) == (1, MODEL)
    assert gate(model_a).view == MODEL and gate(model_a).wait_ms > 0, "the model waits"
    assert gate(model_a).error == "HTTP 503 server_error: overloaded"
    assert gate(model_b) == EndpointState(0, 0, "", ""), "another model of the same host is sent at once"
    assert store.state(endpoint) == {}, "the host is up"

    host = store.failed(endpoint, "", "ModelConnectionError: Connection error.", **{**backoff, "asked_ms": 6000})
    assert host.view == HOST
    held = gate(model_b)
    assert (held.view, held.error) == (HOST, "ModelConnectionError: Connection error."), (
        "a host's outage is every model's"
    )
    assert held.wait_ms > 4000 and gate(model_a).view == HOST, "the longer wait answers"

    parked_a = idle_coordinator.create_task("waits for model a")
    parked_host = idle_coordinator.create_task("waits for the host")
    store.park(endpoint, model_a, parked_a.id, f"provider-wait:{parked_a.id}", time.time() + 3600, 1, 60)
    store.park(endpoint, "", parked_host.id, f"provider-wait:{parked_host.id}", time.time() + 3600, 1, 60)
    # Model b answers: the host is back (and b), model a is still down, and only the host's waiters wake.
    assert store.recovered(endpoint, model_b) == [parked_host.id]
    assert store.state(endpoint) == {} and gate(model_a).view == MODEL and gate(model_b).wait_ms == 0
    assert store.recovered(endpoint, model_a) == [parked_a.id] and gate(model_a) == EndpointState(0, 0, "", "")
    idle_coordinator.store.convergence.remove_timers([f"provider-wait:{t.id}" for t in (parked_a, parked_host)])


def test_a_park_drops_from_its_views_list_the_tasks_whose_wake_time_passed(idle_coordinator: Coordinator) -> None:
    """A view's parked list keeps the tasks still waiting, not every task that parked there in a long outage:
    one whose wake time has passed (its timer is due, so a recovery has nothing to bring forward for it) leaves
    the list at the next park, and one still waiting stays."""
    store = idle_coordinator.store.endpoints
    endpoint = f"10.0.0.4:{time.time_ns() % 60000}"
    parked_key = idle_coordinator.store.keys.endpoint_parked(endpoint, "")
    woken, waiting, late = (idle_coordinator.create_task(f"parked {n}") for n in range(3))
    timers = [f"provider-wait:{t.id}" for t in (woken, waiting, late)]
    try:
        assert store.park(endpoint, "", woken.id, timers[0], time.time() - 1, 1, 60)
        assert store.park(endpoint, "", waiting.id, timers[1], time.time() + 3600, 1, 60)
        assert idle_coordinator.client.zrange(parked_key, 0, -1) == [waiting.id], "the past wake left at this park"
        assert store.park(endpoint, "", late.id, timers[2], time.time() + 1800, 1, 60)
        assert idle_coordinator.client.zrange(parked_key, 0, -1) == [late.id, waiting.id]
        assert 0 < idle_coordinator.client.ttl(parked_key) <= 60
        woken_timer = idle_coordinator.client.zscore(idle_coordinator.store.keys.timers(), timers[0])
        assert woken_timer is not None and woken_timer < time.time(), "its timer, due, still serves it"
        store.failed(endpoint, "", "ModelConnectionError: Connection error.", base_ms=100, cap_ms=100, jitter=0.0,
                     asked_ms=None, keep_ms=60_000)  # fmt: skip
        assert sorted(store.recovered(endpoint)) == sorted([waiting.id, late.id])
    finally:
        idle_coordinator.store.convergence.remove_timers(timers)


def test_a_probe_is_taken_only_by_a_run_that_sends(idle_coordinator: Coordinator) -> None:
    """With the host's wait over and its model's not, no run becomes the host's probe: a probe's lease held
    by a run that waits would hold every other model of the host back for the lease."""
    store = idle_coordinator.store.endpoints
    endpoint = f"10.0.0.3:{time.time_ns() % 60000}"
    quick = {"base_ms": 100, "cap_ms": 100, "jitter": 0.0, "asked_ms": None, "keep_ms": 60_000}
    store.failed(endpoint, "", "ModelConnectionError: Connection error.", **quick)
    store.failed(endpoint, "openai:slow", "HTTP 429 rate_limit_exceeded: slow down", **{**quick, "asked_ms": 30_000})
    time.sleep(0.15)  # the host's wait is over
    waiting = store.gate(endpoint, "openai:slow", "run-a", 10_000, 1000)
    assert waiting.view == MODEL and waiting.wait_ms > 20_000
    assert "probe" not in store.state(endpoint), "it does not send, so it holds no probe"
    probe = store.gate(endpoint, "openai:other", "run-b", 10_000, 1000)
    assert (probe.wait_ms, probe.view) == (0, HOST), "another model's request probes the host"
    assert store.state(endpoint)["probe"] == "run-b"


# -- true counts across parks -------------------------------------------------------------------


def test_a_retry_after_of_years_marks_the_model_down_for_an_hour_at_most(
    settings: Settings, server: ModelServer
) -> None:
    """`Retry-After: 1000000000` (31 years) marked the model down for the whole fleet that long: no request went to
    it again, so no answer could clear the view, and every task of it failed at once. An hour at most, then one
    probe asks again."""
    from coordinator.endpoints import MAX_ASKED_WAIT_S

    local = in_process(settings, {"main": profile(server, PRIMARY_MODEL, model_wait_out_s=120)}, "years")
    coord = Coordinator(local)
    coord.client.delete("subq-nobody")
    server.fail(429, times=1, headers={"Retry-After": "1000000000"})
    task = coord.create_task("Look and report.", profile="main", run=True)
    before_ms = time.time() * 1000
    # A wait past the profile's wait-out time fails the task at once, as before; what changes is the fleet's view.
    assert run_child(build_runtime(local, make_app(local)), task.id).status == "failed"
    view = coord.store.endpoints.state(f"127.0.0.1:{server.port}", f"openai:{PRIMARY_MODEL}")
    down_for_s = (float(view["down_until_ms"]) - before_ms) / 1000
    assert MAX_ASKED_WAIT_S - 60 < down_for_s <= MAX_ASKED_WAIT_S + 60, view


def test_a_timeout_the_provider_answered_marks_its_model_not_its_host(settings: Settings, server: ModelServer) -> None:
    """An HTTP 408 (OpenRouter's when one upstream model timed out) is an answer of the host: it marked the host down,
    and every model there waited, a fallback on the same host too."""
    local = in_process(settings, {"main": profile(server, PRIMARY_MODEL, model_wait_out_s=1)}, "timeout")
    coord = Coordinator(local)
    coord.client.delete("subq-nobody")
    server.fail(408, model=PRIMARY_MODEL)  # for good
    task = coord.create_task("Look and report.", profile="main", run=True)
    assert run_child(build_runtime(local, make_app(local)), task.id).status == "failed"
    endpoint = f"127.0.0.1:{server.port}"
    assert coord.store.endpoints.state(endpoint) == {}, "the host answered: it is up"
    assert int(coord.store.endpoints.state(endpoint, f"openai:{PRIMARY_MODEL}")["failures"]) >= 1, "its model is down"


def test_transient_errors_and_attempt_numbers_go_on_across_parks(settings: Settings, server: ModelServer) -> None:
    """Each failure asks for a wait longer than a run sleeps inside itself, so the run gives its worker back
    after each; the woken runs go on counting: the record's `transient_errors` is the 503s the provider sent,
    and the `wait_out` lines number the attempts 1, 2, 3, not 1, 1, 1."""
    local = in_process(
        settings, {"main": profile(server, PRIMARY_MODEL, price=PRIMARY_PRICE, model_wait_out_s=120)}, "parks"
    )
    coord = Coordinator(local)
    coord.client.delete("subq-nobody")
    failures = 3
    server.fail(503, times=failures, headers={"retry-after-ms": str(PARKING_RETRY_AFTER_MS)})
    task = coord.create_task("Look and report.", profile="main", run=True)
    runtime = build_runtime(local, make_app(local))

    for park in range(1, failures + 1):
        parked = run_child(runtime, task.id)
        assert parked.status == "queued", f"park {park}: the run gave its worker back"
        assert coord.get_task(task.id).transient_errors == park
        assert wait_out_attempts(coord, task.id) == list(range(1, park + 1))
        time.sleep(PARKING_RETRY_AFTER_MS / 1000 + 0.1)  # its timer's time (the reconciler would publish it)
    done = run_child(runtime, task.id)

    assert done.status == "completed" and done.summary == "all done"
    record = coord.get_task(task.id)
    assert server.statuses() == [503] * failures + [200, 200]
    assert record.transient_errors == failures == server.statuses().count(503)
    assert wait_out_attempts(coord, task.id) == [1, 2, 3]
    assert coord.store.records.task_field(task.id, "provider_attempts") is None, "the request was answered"
    assert record.cost_micros == micros(PRIMARY_PRICE, 2) and record.retries == 0
    coord.client.delete("subq-nobody")
    coord.store.convergence.remove_timers([f"provider-wait:{task.id}"])
    coord.close()


def test_a_model_server_killed_and_restarted_under_a_running_task(settings: Settings, tmp_path: Path) -> None:
    """As with a real llama.cpp server: the server goes away under a running task (refused connections: its
    host is down) for long enough that the run parks, and comes back on the same port. The task completes,
    and its record's count and its `wait_out` lines agree, numbered 1..N across the parks."""
    first = ModelServer(TURNS, killed_after=1).start()  # killed just after it answered the first request
    port = first.port
    local = Profile.model_validate(
        {"model": "openai:local", "base_url": first.base_url, "api_key": first.key, "model_wait_out_s": 120}
    )
    with dedicated_fleet(
        settings, tmp_path, 1, queue="subq-restart-server", key_prefix="subqrestartserver",
        profiles={**settings.profiles, "local": local}, model_backoff_base_s=1.0, model_backoff_max_s=3.0,
    ) as (coord, _fleet):  # fmt: skip
        task = coord.create_task("Look and report.", profile="local", run=True)
        eventually(lambda: len(first.seen) >= 1, "the task's first request reached the server", timeout_s=30)
        runs_before = int(coord.store.records.task_field(task.id, "run_seq") or 0)
        eventually(
            lambda: int(coord.store.records.task_field(task.id, "run_seq") or 0) > runs_before,
            "the run gave its worker back and was woken again", timeout_s=60,
        )  # fmt: skip
        endpoint = f"127.0.0.1:{port}"
        assert int(coord.store.endpoints.state(endpoint).get("failures", 0)) >= 1, "refused connections: the host"
        assert coord.store.endpoints.state(endpoint, "openai:local") == {}, "nothing was said of the model"
        with ModelServer(TURNS, port=port) as again:
            done = coord.wait(task.id, timeout_s=60)
            assert done.status == TaskStatus.COMPLETED, done.error
            assert again.answered(), "the restarted server answered it"
        attempts = wait_out_attempts(coord, task.id)
        assert len(attempts) >= 2 and attempts == list(range(1, len(attempts) + 1)), attempts
        assert done.transient_errors == len(attempts), "the record counts what the UI shows"
        assert coord.store.endpoints.state(endpoint) == {}, "back: the host's view is clear"
