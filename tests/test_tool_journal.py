"""The tool-call journal: a call's result is kept the moment it returns, and a resumed run replays it.

A real worker runs one response that calls four tools at once; it is SIGKILLed
after the quick side-effecting call returned, while the three slow ones still run.
A second worker resumes the task (the reconciler publishes it again once the
dead worker's lease lapses). The tools leave marks in a folder outside the run,
so the test counts each effect from outside.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from coordinator import Coordinator, Profile, Settings, TaskRecord, TaskStatus
from coordinator.local.fleet import WorkerFleet
from coordinator.local.ports import free_port
from coordinator.models import Approval
from tests.agents import agent, calls, reply
from workers.runtime.profile_tools import INTERRUPTED

JOURNALED = Profile(
    tools=["tests.tool_kit:leave_mark", "tests.tool_kit:journal_kit", "tests.tool_kit:refresh"],
    idempotent_tools=["refresh"],
)
# A tool name the model makes up (no profile has it).
MADE_UP = "zz_made_up_tool"
# The fault suite's clock: a dead worker's lease lapses in 3 s, the reconciler looks every 0.5 s.
FAST_CLOCK = {"heartbeat_lapse_s": 3, "reconcile_interval_s": 0.5, "reconcile_grace_s": 3, "queue": "subq-journal"}


@pytest.fixture
def marks(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "marks"
    folder.mkdir()
    os.environ["TOOL_KIT_MARKS"] = str(folder)  # the workers inherit it
    try:
        yield folder
    finally:
        del os.environ["TOOL_KIT_MARKS"]


def _count(marks: Path, label: str) -> int:
    return len(list(marks.glob(f"{label}.*")))


@contextmanager
def crashing_worker(
    settings: Settings, tmp_path: Path, metrics_port: int | None = None, **profiles: Profile
) -> Iterator[tuple[Coordinator, Callable[[], None]]]:
    """A worker with these profiles on a database of its own, and a function that SIGKILLs it and
    starts a second, which resumes its runs once the first one's leases lapse (each serving /metrics on
    `metrics_port`, when given: the second once the first is dead)."""
    assert settings.redis_url
    own = settings.model_copy(
        update={
            **FAST_CLOCK, "profiles": profiles, "redis_url": settings.redis_url.rsplit("/", 1)[0] + "/9",
            "worker_metrics_port": metrics_port, "worker_metrics_host": "127.0.0.1",
        }
    )  # fmt: skip
    coord = Coordinator(own)
    coord.client.flushdb()
    fleets = [WorkerFleet(own, 1, tmp_path / "victim", name="victim")]

    def kill_and_resume() -> None:
        os.kill(fleets[0].procs[0].pid, signal.SIGKILL)
        fleets[0].procs[0].wait(timeout=30)
        fleets.append(WorkerFleet(own, 1, tmp_path / "rescuer", name="rescuer"))
        fleets[-1].wait_ready()

    try:
        fleets[0].wait_ready()
        yield coord, kill_and_resume
    finally:
        for fleet in fleets:
            fleet.stop()
        coord.close()


def test_a_resumed_run_replays_what_returned_and_reruns_only_the_idempotent(
    settings: Settings, marks: Path, tmp_path: Path
) -> None:
    port = free_port()
    with crashing_worker(settings, tmp_path, port, journaled=JOURNALED) as (coord, kill_and_resume):
        task = coord.create_task(
            agent(
                calls(
                    ("leave_mark", {"label": "quick"}),
                    # A tool the task does not have: answered at once, kept, and replayed on resume.
                    (MADE_UP, {}),
                    ("slow_mark", {"label": "slow", "seconds": 30}),
                    # Long enough that both still run when the worker is killed, on a loaded host too.
                    ("settle", {"label": "idem", "seconds": 10}),
                    ("refresh", {"label": "declared", "seconds": 10}),
                ),
                reply("all four handled"),
            ),
            profile="journaled",
            run=True,
        )
        journal = coord.store.keys.tool_results(task.root_id, task.id)
        deadline = time.monotonic() + 60
        while not (_count(marks, "quick") and coord.client.hlen(journal) >= 2) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _count(marks, "quick") == 1 and coord.client.hlen(journal) == 2, "the quick call returned and was kept"
        assert _count(marks, "slow") == _count(marks, "idem") == _count(marks, "declared") == 0, "the slow calls run"
        kill_and_resume()
        done = coord.wait(task.id, 90)
        assert done.status == TaskStatus.COMPLETED, done
        assert _count(marks, "quick") == 1, "the call that returned ran once: its result was replayed"
        assert _count(marks, "slow") == 0, "the cut-off call that is not idempotent never ran again"
        assert _count(marks, "idem") == 1, "the cut-off idempotent call ran once more, to its end"
        assert _count(marks, "declared") == 1, "so did the one its profile declares idempotent"
        says = [(m["say"], m["text"]) for m in coord.messages(task.id) if m.get("type") == "say"]
        assert ("tool_replayed", 'leave_mark({"label": "quick"})') in says
        assert ("tool_interrupted", 'slow_mark({"label": "slow", "seconds": 30.0})') in says
        results = {
            part["tool_name"]: part["content"]
            for message in coord.store.records.conversation(task.id)
            for part in json.loads(message).get("parts", [])
            if part.get("part_kind") == "tool-return"
        }
        assert results.pop(MADE_UP).startswith(f"not run: {MADE_UP} is not a tool of this task")
        assert results == {
            "leave_mark": "marked quick", "slow_mark": INTERRUPTED, "settle": "settled idem", "refresh": "refreshed declared"
        }  # fmt: skip
        # The rescuer counted the replays by tool: the made-up name as "(unknown)", never a series of its own.
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'subq_tool_calls_total{outcome="replayed",tool="leave_mark"} 1.0' in scraped, scraped
        assert 'subq_tool_calls_total{outcome="replayed",tool="(unknown)"} 1.0' in scraped, scraped
        assert MADE_UP not in scraped


def _approve_both(coord: Coordinator, root_id: str) -> list[Approval]:
    """Wait for the tree's two calls to ask a person (on a loaded host, their run takes a while), and approve both."""
    deadline = time.monotonic() + 60
    while len(coord.list_approvals(root_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    approvals = coord.list_approvals(root_id)
    for approval in approvals:
        coord.decide(approval.id, "approve")
    return approvals


def _journal(coord: Coordinator, task: TaskRecord) -> str:
    return coord.store.keys.tool_results(task.root_id, task.id)


def _started(coord: Coordinator, task: TaskRecord, at_least: int) -> list[str]:
    """The task's calls marked started, once `at_least` are (a wait of its own: on a loaded host the approvals
    may have taken most of the first call), or as they are after 60 s."""
    deadline = time.monotonic() + 60
    while True:
        started = sorted(f for f in coord.client.hkeys(_journal(coord, task)) if f.startswith("started:"))
        if len(started) >= at_least or time.monotonic() >= deadline:
            return started
        time.sleep(0.02)


def test_an_approved_call_cut_off_while_it_ran_is_not_run_again_unless_idempotent(
    settings: Settings, marks: Path, tmp_path: Path
) -> None:
    """A human's approval is leave to run a call once: cut off mid-run, it is interrupted on resume
    (an idempotent one runs once more), and no one is asked again."""
    guarded = JOURNALED.model_copy(update={"approval_tools": ["slow_mark", "settle"]})
    with crashing_worker(settings, tmp_path, guarded=guarded) as (coord, kill_and_resume):
        task = coord.create_task(
            agent(
                # Long enough that both still run when the worker is killed, on a loaded host too.
                calls(("slow_mark", {"label": "slow", "seconds": 30}), ("settle", {"label": "idem", "seconds": 15})),
                reply("both handled"),
            ),
            profile="guarded",
            run=True,
        )
        assert sorted(a.tool for a in _approve_both(coord, task.root_id)) == ["settle", "slow_mark"]
        # Each call's start is written as it starts, so wait for both, not for any two entries.
        assert len(_started(coord, task, 2)) == 2, sorted(coord.client.hkeys(_journal(coord, task)))
        assert _count(marks, "slow") == _count(marks, "idem") == 0, "both approved calls are still running"
        kill_and_resume()
        done = coord.wait(task.id, 90)
        assert done.status == TaskStatus.COMPLETED, done
        assert _count(marks, "slow") == 0, "the approved call that is not idempotent never ran again"
        assert _count(marks, "idem") == 1, "the approved idempotent call ran once more, to its end"
        says = [(m["say"], m["text"]) for m in coord.messages(task.id) if m.get("type") == "say"]
        assert ("tool_interrupted", 'slow_mark({"label": "slow", "seconds": 30.0})') in says
        assert [kind for kind, _ in says].count("approval_request") == 2, "no one was asked again"
        assert coord.list_approvals(task.root_id) == []


def test_an_approved_call_still_waiting_for_its_slot_when_its_worker_died_runs_on_resume(
    settings: Settings, marks: Path, tmp_path: Path
) -> None:
    """Two approved calls, one at a time (`max_tool_calls_at_once` 1): the second waits for the first's slot. Its
    journal said it had started, as it was marked before the wait: the resume answered it "interrupted", and the
    action a person approved was never carried out. A call is marked started once it holds its slot."""
    one_at_a_time = JOURNALED.model_copy(update={"approval_tools": ["slow_mark"], "max_tool_calls_at_once": 1})
    with crashing_worker(settings, tmp_path, guarded=one_at_a_time) as (coord, kill_and_resume):
        task = coord.create_task(
            agent(
                calls(
                    ("slow_mark", {"label": "first", "seconds": 30}), ("slow_mark", {"label": "queued", "seconds": 1})
                ),
                reply("both handled"),
            ),
            profile="guarded",
            run=True,
        )
        _approve_both(coord, task.root_id)
        assert _started(coord, task, 1), "the first call started"
        time.sleep(0.5)  # a second mark, written before the wait, would be there by now
        started = _started(coord, task, 1)
        assert len(started) == 1, ("only the call that holds the slot started", started)
        assert _count(marks, "first") == _count(marks, "queued") == 0
        kill_and_resume()
        done = coord.wait(task.id, 90)
        assert done.status == TaskStatus.COMPLETED, done
        assert _count(marks, "first") == 0, "the call cut off while it ran did not run again"
        assert _count(marks, "queued") == 1, "the call that had not started ran on resume, once"
        says = [(m["say"], m["text"]) for m in coord.messages(task.id) if m.get("type") == "say"]
        assert [kind for kind, _ in says].count("tool_interrupted") == 1, says
