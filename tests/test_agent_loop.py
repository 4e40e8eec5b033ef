"""The process's one agent event loop and its one stop watch (workers/runtime/agent_loop.py).

The loop is driven from many threads at once, as a worker's pool threads drive
it; the stop watch reads real task records on the session's Redis.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic_ai import Agent
from pydantic_ai.models.test import TestModel

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.runs import Run, RunLifecycle
from tests.helpers import HostLag, eventually, script, usage_step
from tests.test_run_scripts import monitored
from workers.runtime.agent_loop import GC_GEN0_OBJECTS, AgentLoop, PacedSelector, StopWatch, tune_gc

CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="none")


async def _where(delay_s: float) -> tuple[str, str]:
    await asyncio.sleep(delay_s)
    return threading.current_thread().name, CALLER.get()


def test_every_thread_runs_its_coroutine_on_the_one_loop_in_its_own_context() -> None:
    loop = AgentLoop()

    def call(n: int) -> tuple[str, str]:
        CALLER.set(f"thread {n}")
        return loop.run(_where(0.2))

    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(16)))
    assert time.monotonic() - started < 2.0, "the coroutines waited at the same time, not one after another"
    assert {name for name, _ in results} == {"subq-agents"}
    assert [caller for _, caller in results] == [f"thread {n}" for n in range(16)]


def test_the_loops_selector_skips_a_look_with_no_wait_made_soon_after_the_last() -> None:
    """A look with no wait (the loop has callbacks ready) within the interval of the last look finds nothing;
    past the interval, or any look that may wait, finds what is ready."""
    reader, writer = socket.socketpair()
    # An interval no loaded host outlasts between two calls, and its clock moved by hand past it.
    paced = PacedSelector(poll_every_s=30)
    try:
        paced.register(reader, selectors.EVENT_READ)
        writer.send(b"x")
        assert paced.select(0) == [], "looked within the interval of its start: skipped"
        assert [key.fileobj for key, _ in paced.select(5)] == [reader], "a look that may wait always looks"
        assert paced.select(0) == [], "and counts as the last look"
        paced._looked_at -= 31
        assert [key.fileobj for key, _ in paced.select(0)] == [reader], "past the interval a look with no wait looks"
    finally:
        paced.close()
        reader.close()
        writer.close()


def test_a_busy_loop_still_sees_its_sockets() -> None:
    """A coroutine that keeps the agents' loop busy (a callback always ready) does not keep the loop from its
    I/O: a socket made readable meanwhile is read while the coroutine still runs, not after it."""
    loop = AgentLoop()
    reader, writer = socket.socketpair()
    read = threading.Event()

    async def busy_until_read(limit_s: float) -> bool:
        asyncio.get_running_loop().add_reader(reader, read.set)
        try:
            deadline = time.monotonic() + limit_s
            while not read.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0)  # a callback ready at every turn: no look may wait
            return read.is_set()
        finally:
            asyncio.get_running_loop().remove_reader(reader)

    threading.Timer(0.1, writer.send, args=(b"x",)).start()
    try:
        assert loop.run(busy_until_read(20.0)), "the socket was not read while the loop was busy"
    finally:
        reader.close()
        writer.close()


def test_a_coroutines_exception_reaches_its_caller_and_the_loop_goes_on() -> None:
    loop = AgentLoop()

    async def fail() -> None:
        raise ValueError("the agent failed")

    with pytest.raises(ValueError, match="the agent failed"):
        loop.run(fail())
    assert loop.run(_where(0))[0] == "subq-agents"


def test_sync_tools_run_on_the_process_pool_of_threads_which_outlives_each_run() -> None:
    # pydantic-ai's default started a thread per call on the shared loop, and held the loop meanwhile.
    loop = AgentLoop()
    seen: list[tuple[str, int]] = []

    def lookup(key: str) -> str:
        """Look a key up."""
        seen.append((threading.current_thread().name, threading.get_ident()))
        return key.upper()

    agent = Agent(TestModel(call_tools=["lookup"]), tools=[lookup])
    for _ in range(5):
        assert "lookup" in loop.run(agent.run("look it up")).output
    names = {name for name, _ in seen}
    assert len(seen) == 5 and all(name.startswith("subq-tool") for name in names), names
    # Each call found the thread the one before had left idle: one thread for five runs, not five.
    assert len({ident for _, ident in seen}) == 1


def _start_runs(coord: Coordinator, count: int) -> tuple[RunLifecycle, list[Run]]:
    parent = coord.create_task("a parent of watched children", todos="\n".join(f"[ ] c{n}" for n in range(count)))
    batch = coord.delegate(parent.id, [{"description": f"c{n}", "message": script(usage_step())} for n in range(count)])
    lifecycle = RunLifecycle(coord, "test-worker")
    runs = [lifecycle.start(child_id) for child_id in batch.child_ids]
    assert all(isinstance(run, Run) for run in runs)
    return lifecycle, [run for run in runs if isinstance(run, Run)]


def test_must_stop_finds_the_cancelled_and_the_vanished_runs_in_one_read(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    lifecycle, runs = _start_runs(coord, 4)
    try:
        coord.cancel(runs[1].task_id, "stop this one")
        coord.client.delete(coord.store.keys.task(runs[3].task.root_id, runs[3].task_id))

        assert lifecycle.must_stop(runs) == [runs[1], runs[3]]
    finally:
        for run in runs:
            run.abandon()


def test_the_stop_watch_stops_a_waiting_run_soon_after_its_cancel(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    lifecycle, runs = _start_runs(coord, 3)
    watch = StopWatch(lifecycle, poll_s=0.05)
    loop = AgentLoop()

    async def wait_for_stop(run: Run) -> float:
        """When (monotonic) the run's stop was set; -1 when it never was."""
        stop = watch.watch(run)
        try:
            await asyncio.wait_for(stop, timeout=3.0)
        except TimeoutError:
            return -1.0
        finally:
            watch.forget(run)
        return time.monotonic()

    try:
        with HostLag() as lag, ThreadPoolExecutor(3) as pool:
            waits = [pool.submit(loop.run, wait_for_stop(run)) for run in runs]
            time.sleep(0.3)
            cancel_sent = time.monotonic()
            coord.cancel(runs[0].task_id, "stop it")
            cancelled_at = time.monotonic()
            stopped_at = [w.result() for w in waits]
        assert coord.get_task(runs[0].task_id).status == TaskStatus.CANCELLED
        assert stopped_at[0] >= cancel_sent, "stopped before its cancel was sent"
        # A poll every 0.05 s: soon after the cancel, by the host's lateness too (measured beside it).
        stopped_in_s = stopped_at[0] - cancelled_at
        assert stopped_in_s < lag.bound_s(0.5), (
            f"stopped {stopped_in_s:.2f} s after its cancel, host late by {lag.worst_s:.2f} s"
        )
        assert stopped_at[1:] == [-1.0, -1.0], "the runs whose tasks were not stopped went on"
    finally:
        for run in runs:
            run.abandon()


def test_the_stop_watch_stops_a_fenced_older_run_beside_the_newer_run_of_its_task(
    idle_coordinator: Coordinator,
) -> None:
    """A run that stalled past its lapse and the newer run of its task, both in one process, are watched on
    their own: the older one, fenced, has its request abandoned; the newer one goes on."""
    coord = idle_coordinator
    lifecycle, (older,) = _start_runs(coord, 1)
    coord.client.delete(coord.store.keys.lease(older.task.root_id, older.task_id))  # it stalled past its lapse
    newer = lifecycle.start(older.task_id)
    assert isinstance(newer, Run) and newer.token != older.token
    older.fenced = True  # as the heartbeat's renewal finds it
    watch = StopWatch(lifecycle, poll_s=0.05)

    async def both() -> tuple[bool, bool]:
        old_stop, new_stop = watch.watch(older), watch.watch(newer)
        watch.poll()
        await asyncio.sleep(0.05)  # a stop is set on its loop, soon after the poll
        watch.forget(older)
        watch.forget(newer)
        return old_stop.done(), new_stop.done()

    try:
        assert AgentLoop().run(both()) == (True, False)
    finally:
        older.abandon()
        newer.abandon()


def test_a_worker_collects_garbage_less_often_and_never_its_imports() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_GEN0_OBJECTS, *before[1:])
        assert gc.get_freeze_count() > 1000, "the objects made at import are frozen"
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.fixture
def own_coordinator(settings: Settings) -> Iterator[Coordinator]:
    """Keys no other test touches: the stop count of this prefix moves only here."""
    coord = Coordinator(settings.model_copy(update={"queue": "subq-nobody", "key_prefix": "subqwatch"}))
    yield coord
    coord.close()


def _watching(watch: StopWatch, loop: AgentLoop, runs: list[Run]) -> list[asyncio.Future[None]]:
    async def register(run: Run) -> asyncio.Future[None]:
        return watch.watch(run)

    return [loop.run(register(run)) for run in runs]


def _stopped(loop: AgentLoop, stops: list[asyncio.Future[None]]) -> list[bool]:
    async def look() -> list[bool]:
        await asyncio.sleep(0.01)  # the watch sets a stop through the loop's queue
        return [stop.done() for stop in stops]

    return loop.run(look())


def test_the_stop_watch_reads_one_count_a_poll_until_a_stop_moves_it(own_coordinator: Coordinator) -> None:
    coord = own_coordinator
    lifecycle, runs = _start_runs(coord, 3)
    watch, loop = StopWatch(lifecycle, poll_s=3600, full_look_s=3600), AgentLoop()  # polled by hand here
    stops = _watching(watch, loop, runs)
    keys = coord.store.keys
    watched_keys = {keys.stops(), *(keys.task(run.task.root_id, run.task_id) for run in runs)}
    assert coord.settings.redis_url
    try:
        # The watch makes its first look (every status) on the loop as the first run is watched; on a
        # loaded host that can come late, so the test waits for it rather than count its reads below.
        eventually(lambda: watch._stops_seen is not None, "the watch's first look", every_s=0.01)
        watch.poll()
        with monitored(coord.settings.redis_url) as commands:
            watch.poll()
            watch.poll()
        assert [c[0].upper() for c in commands if c[1:2] and c[1] in watched_keys] == ["GET", "GET"]

        coord.cancel(runs[1].task_id, "stop this one")
        with monitored(coord.settings.redis_url) as commands:
            watch.poll()
        statuses_read = [c[1] for c in commands if c[:1] == ["HGET"] and c[1] in watched_keys]
        assert len(statuses_read) == 3, "the count moved: every watched run's status is read"
        assert _stopped(loop, stops) == [False, True, False]
    finally:
        for run in runs:
            watch.forget(run)
            run.abandon()


def test_a_vanished_task_stops_its_run_at_the_next_full_look(own_coordinator: Coordinator) -> None:
    """Nothing counts a tree that expired: the watch still reads every status every `full_look_s`."""
    coord = own_coordinator
    lifecycle, runs = _start_runs(coord, 2)
    watch, loop = StopWatch(lifecycle, poll_s=3600, full_look_s=0.5), AgentLoop()
    stops = _watching(watch, loop, runs)
    try:
        watch.poll()
        coord.client.delete(coord.store.keys.task(runs[0].task.root_id, runs[0].task_id))
        watch.poll()
        assert _stopped(loop, stops) == [False, False], "no stop was counted and no full look is due yet"
        time.sleep(0.6)
        watch.poll()
        assert _stopped(loop, stops) == [True, False]
    finally:
        for run in runs:
            watch.forget(run)
            run.abandon()
