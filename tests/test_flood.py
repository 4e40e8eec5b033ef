"""A flood of the open routes leaves the API serving; the health cache reads once; broker pools never wait for good.

The incident: 40 concurrent GET /healthz (each a Redis ping and a broadcast
worker ping through Celery's shared broker pool, on the shared thread pool)
deadlocked the broker pool and took every API thread with it, so every /v1
route and /ui page timed out until a restart (coordinator/api/ops.py). These
tests run a real API server over real Redis and real workers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import redis

from coordinator import Coordinator, Settings
from coordinator.api import create_app
from coordinator.api.ops import SingleFlight
from coordinator.celery_app import BrokerPoolExhausted, make_app
from coordinator.local.fleet import WorkerFleet
from tests.helpers import TOKEN, ApiServer, api_settings

# The routes anyone may call without a token.
OPEN_ROUTES = ["/healthz", "/livez", "/readyz", "/metrics", "/openapi.json", "/docs", "/ui/login"]
# Concurrent requests per route: three times the 40 threads of the shared pool that hung (40
# concurrent pings were enough to hang every one of them).
FLOOD_REQUESTS = 120
# A flood request that has no answer by then hung: the test fails on it.
FLOOD_TIMEOUT_S = 20.0
# What a flooded open route may answer: served, Redis down, or rate limited.
FLOOD_STATUSES = {200, 503, 429}
# An authenticated read must not be starved by the flood of another kind of request (starved, it hung
# for the flood's whole length). Milliseconds on an idle host; 1.3 s was seen with both cores held busy.
V1_ANSWER_S = 5.0
# High enough that the per-address limit of the open routes never answers for the
# handlers: these tests flood the handlers themselves.
UNLIMITED_PER_MIN = 10**9


@pytest.fixture(scope="module")
def flood_api(settings: Settings, workers: WorkerFleet) -> Iterator[ApiServer]:
    coord = Coordinator(api_settings(settings, api_open_requests_per_min=UNLIMITED_PER_MIN))
    with ApiServer(create_app(coordinator=coord)) as server:
        yield server
    coord.close()


async def _flood(url: str, path: str) -> tuple[Counter[int], float]:
    """FLOOD_REQUESTS concurrent GETs of `path`: (the count of each status, the slowest answer in s)."""
    limits = httpx.Limits(max_connections=FLOOD_REQUESTS, max_keepalive_connections=FLOOD_REQUESTS)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=FLOOD_TIMEOUT_S) as http:

        async def one() -> tuple[int, float]:
            started = time.monotonic()
            response = await http.get(path)
            return response.status_code, time.monotonic() - started

        answers = await asyncio.gather(*(one() for _ in range(FLOOD_REQUESTS)))
    return Counter(status for status, _ in answers), max(seconds for _, seconds in answers)


def flood(url: str, path: str) -> tuple[Counter[int], float]:
    """`_flood` in a process of its own (see the test): the client must not share the server's GIL."""
    return asyncio.run(_flood(url, path))


def _timed_get(http: httpx.Client, path: str) -> tuple[int, float]:
    started = time.monotonic()
    response = http.get(path)
    return response.status_code, time.monotonic() - started


def test_a_flood_of_the_open_routes_leaves_the_api_serving(flood_api: ApiServer) -> None:
    # The flooding client runs in a process of its own, as a real one would: in the server's
    # process it would take the GIL from the server it floods (and the suite twice as long).
    spawn = multiprocessing.get_context("spawn")
    with (
        flood_api.client(timeout_s=FLOOD_TIMEOUT_S) as http,
        flood_api.client(headers={}) as browser,
        concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as flooder,
    ):
        signed_in = browser.post("/ui/login", data={"token": TOKEN, "next": "/ui/"})
        assert signed_in.status_code == 303, signed_in.text
        report = []
        for path in OPEN_ROUTES:
            # /v1 is read while the flood is in flight.
            flooding = flooder.submit(flood, flood_api.url, path)
            during = _timed_get(http, "/v1/tasks?limit=5")
            try:
                statuses, slowest_s = flooding.result(timeout=2 * FLOOD_TIMEOUT_S)
            except Exception as exc:
                raise AssertionError(f"the flood of {path} failed (a request hung past {FLOOD_TIMEOUT_S} s?)") from exc
            after = _timed_get(http, "/v1/tasks?limit=5")
            page = _timed_get(browser, "/ui/")
            report.append(
                f"{path}: {dict(statuses)} slowest {slowest_s:.2f}s; GET /v1/tasks during {during[1]:.2f}s, "
                f"after {after[1]:.3f}s; GET /ui/ after {page[1]:.3f}s"
            )
            assert set(statuses) <= FLOOD_STATUSES, (path, statuses)
            assert during[0] == 200 and after[0] == 200 and page[0] == 200, (path, during, after, page)
            assert after[1] < V1_ANSWER_S, f"after a flood of {path}, GET /v1/tasks took {after[1]:.2f}s"
            assert page[1] < V1_ANSWER_S, f"after a flood of {path}, GET /ui/ took {page[1]:.2f}s"
            # During the flood the server is busy answering FLOOD_REQUESTS requests on 2 cores; bounded, not hung.
            assert during[1] < FLOOD_TIMEOUT_S
        health = http.get("/healthz")
    print("\n".join(report))
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


# -- the health cache --------------------------------------------------------------


class _Reads:
    """A read that counts its calls and, until released, blocks (so callers overlap)."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def __call__(self) -> int:
        self.calls += 1
        if not self.release.wait(10):
            raise AssertionError("never released")
        return self.calls


async def _gather_gets(cache: SingleFlight[int], callers: int) -> list[int]:
    return list(await asyncio.gather(*(cache.get() for _ in range(callers))))


def test_concurrent_callers_share_one_read() -> None:
    reads = _Reads()
    cache = SingleFlight(reads, ttl_s=60, wait_s=5, name="test")

    async def scenario() -> list[int]:
        gets = asyncio.ensure_future(_gather_gets(cache, 200))
        await asyncio.sleep(0.2)  # all 200 are waiting on the one read
        reads.release.set()
        return await gets

    assert asyncio.run(scenario()) == [1] * 200
    assert reads.calls == cache.reads == 1
    assert asyncio.run(cache.get()) == 1, "within the TTL, the cached value"


def test_a_value_older_than_the_ttl_is_read_again() -> None:
    reads = _Reads()
    reads.release.set()
    # A TTL no loaded host outlasts between two calls, and its clock moved by hand past it.
    cache = SingleFlight(reads, ttl_s=30, wait_s=5, name="test")
    assert asyncio.run(cache.get()) == 1
    assert asyncio.run(cache.get()) == 1
    cache._read_at -= 31
    assert asyncio.run(cache.get()) == 2
    assert reads.calls == 2


def test_a_slow_read_does_not_hold_the_caller_and_is_shared_when_it_lands() -> None:
    reads = _Reads()
    cache = SingleFlight(reads, ttl_s=60, wait_s=0.2, name="slow")
    started = time.monotonic()
    with pytest.raises(Exception, match="slow: Redis did not answer within 0.2 s") as refused:
        asyncio.run(cache.get())
    assert time.monotonic() - started < 1
    assert refused.value.__class__.__name__ == "RefreshPending"
    with pytest.raises(Exception, match="did not answer"):
        asyncio.run(cache.get())  # joins the same read, still in flight
    assert cache.reads == 1
    reads.release.set()
    deadline = time.monotonic() + 5
    while cache.cached() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert asyncio.run(cache.get()) == 1 and reads.calls == 1


def test_a_failed_read_is_not_cached() -> None:
    outcomes: list[int | Exception] = [RuntimeError("Redis is down"), 7]

    def read() -> int:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    cache = SingleFlight(read, ttl_s=60, wait_s=5, name="test")
    with pytest.raises(RuntimeError, match="Redis is down"):
        asyncio.run(cache.get())
    assert asyncio.run(cache.get()) == 7


# -- a Redis that hangs ------------------------------------------------------------


@contextmanager
def _silent_server() -> Iterator[int]:
    """A real TCP server that accepts connections and never answers (a Redis that hangs)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def test_a_redis_that_hangs_makes_the_api_unready_quickly_and_live(settings: Settings) -> None:
    with _silent_server() as port:
        hung = Coordinator(api_settings(settings, redis_url=f"redis://127.0.0.1:{port}/0"))
        with ApiServer(create_app(coordinator=hung)) as server, server.client(headers={}) as http:
            live = _timed_get(http, "/livez")
            ready = _timed_get(http, "/readyz")
            body = http.get("/healthz").json()
        hung.close()
    assert live[0] == 200 and live[1] < V1_ANSWER_S, live
    assert ready[0] == 503 and ready[1] < 3, ready
    assert (body["status"], body["redis"]["ok"], body["workers"]["count"]) == ("down", False, 0)


# -- the broker pool ---------------------------------------------------------------


def test_a_broadcast_gives_up_on_a_full_broker_pool_instead_of_waiting_for_good(settings: Settings) -> None:
    """A revoke holds a pool connection while its producer waits for a second: with every
    connection held, kombu waited forever (the deadlock of the incident); now it fails, a BrokerError."""
    app = make_app(settings.model_copy(update={"queue": "subq-flood-nobody"}))
    app.conf.broker_pool_limit = 1
    app.pool.acquire_timeout_s = 0.3
    app.producer_pool.acquire_timeout_s = 0.3
    app.send_task("subq.flood-never-run", queue="subq-flood-nobody")  # one connection at a time: fine
    outcome: list[BaseException | None] = []
    started = time.monotonic()

    def revoke() -> None:
        try:
            app.control.revoke(["0123456789abcdef"])
            outcome.append(None)
        except BaseException as exc:  # what the waiting ended with, for the assertion below
            outcome.append(exc)

    thread = threading.Thread(target=revoke, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the revoke waits for a broker connection for good"
    assert isinstance(outcome[0], BrokerPoolExhausted), outcome
    assert "all 1 connections" in str(outcome[0]) and time.monotonic() - started < 5
    app.pool.force_close_all()
    redis.Redis.from_url(settings.require_redis_url()).delete("subq-flood-nobody")
