"""Where the time went (issue 25): each task's queued, running and waiting intervals, recorded by the
scripts that change its state, and shown by the API, the CLI (`subq tree`, `--timeline`) and the export.

The acceptance test runs real workers whose children wait on a provider's rate limit, a per-parent
run limit and an approval, and checks each recorded wait's reason and length against times taken
from outside the workers: the test's own clock for what it does (the decision, the rate window it
set up) and the tree's event stream, whose entry ids are Redis's clock, for what the workers did.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from playwright.sync_api import Browser, expect

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.api import create_app
from coordinator.store.base import _load_script
from coordinator.timeline import FOLD_MARKS, MAX_MARKS, Timeline, critical_path, times_of
from coordinator.tree import duration
from tests.agents import agent, call, reply
from tests.conftest import dedicated_fleet
from tests.helpers import ApiServer, api_settings, eventually
from tests.test_cli import cli
from tests.test_profile_tools import Tooled, tooled
from tests.test_timeline_browser import _shot_of, _signed_in
from tests.test_web_browser import browser

__all__ = ["browser", "tooled"]  # fixtures shared with their modules

# What "equal to the times measured from outside" allows (the acceptance).
WITHIN_MS = 50
# What a loaded 2-core host may put between a step's moment (taken by its process) and Redis running the
# step, or between a wake-up that is due and the step it makes: the marks are checked exactly against the
# moment each step carried (Redis's MONITOR shows its arguments), and only this bounds the rest.
LOADED_MS = 1000
# The rate window the test fills: every request before its end waits for it.
RATE_RPM = 100
RATE_FREES_AFTER_S = 2.0
# How long the test leaves the approval undecided, and how often it looks for it.
APPROVAL_HELD_S = 0.8
POLL_S = 0.005
WAIT_S = 60
# How long the tool of the span test takes a call.
TOOL_CALL_S = 0.3


# -- the stored form: hashes.lua's timeline_add, the one fold, stays bounded and exact ------------------


def test_the_lua_fold_keeps_every_mark_or_its_length_and_stays_bounded(redis_client: redis.Redis) -> None:
    """Hundreds of waits through `timeline_add` (the fold is written in Lua alone: Python only reads timelines,
    and a Python transaction's mark is this fold's, tests/test_delegation_timeline.py): the stored field keeps at
    most MAX_MARKS marks, each mark added is kept or counted folded, and the totals stay exact."""
    adder = redis_client.register_script(
        _load_script("hashes.lua").replace(
            "local reply = main(KEYS, ARGV)", "local reply = timeline_add(ARGV[1], tonumber(ARGV[2]), ARGV[3])"
        )
    )
    rng = random.Random(25)
    states = ["queued", "running", "wait:rate_limit", "running", "wait:admission", "wait:approval"]
    text, t_ms, lengths, added = "", 1_764_000_000_000, dict[str, int](), 0
    first, last = t_ms, (0, "")
    for _ in range(2 * MAX_MARKS + 37):
        state = rng.choice(states)
        got = adder(args=[text, t_ms, state])
        if state == last[1]:
            assert got is None, "the state it has already: nothing to add"
        else:
            if added:
                lengths[last[1]] = lengths.get(last[1], 0) + (t_ms - last[0])
            text, last, added = str(got), (t_ms, state), added + 1
        stored = Timeline.model_validate(text)
        assert stored.m[-1] == last and len(stored.m) <= MAX_MARKS
        assert len(stored.m) + stored.n == added, "every mark kept, or counted folded"
        t_ms += rng.randrange(0, 5000)
    assert stored.n >= FOLD_MARKS and stored.t0 == first, "folded, never unbounded"
    assert len(text) < 8 * 1024
    times = times_of(stored, now_ms=last[0])  # the open last state counts 0 ms
    totals = {"queued": times.queue_ms, "running": times.run_ms}
    totals |= {f"wait:{reason}": ms for reason, ms in times.wait_by_reason_ms.items()}
    assert {k: v for k, v in totals.items() if v} == {k: v for k, v in lengths.items() if v}
    # A mark earlier than the last (another writer's clock) is moved up to it.
    later = Timeline.model_validate(adder(args=[text, last[0] - 10, "wait:tool_limit"]))
    assert later.m[-1] == (last[0], "wait:tool_limit")
    # An outcome is the end: nothing is added after it.
    ended = adder(args=[text, t_ms, "completed"])
    assert adder(args=[ended, t_ms + 5, "running"]) is None


def test_a_timeline_reads_its_intervals_and_figures() -> None:
    marks = Timeline(
        m=[(1000, "queued"), (1500, "running"), (1700, "wait:rate_limit"), (2000, "running"), (2600, "wait:children"),
           (4000, "queued"), (4100, "running"), (4300, "completed")]
    )  # fmt: skip
    t = times_of(marks)
    assert (t.queue_ms, t.run_ms, t.wall_ms, t.runs) == (600, 1000, 3300, 2)
    assert t.wait_by_reason_ms == {"rate_limit": 300, "children": 1400} and t.wait_ms == 1700
    assert (t.started_at_ms, t.ended_at_ms, t.outcome) == (1500, 4300, "completed")
    assert [(i.state, i.reason, i.start_ms, i.end_ms) for i in t.intervals][2] == ("waiting", "rate_limit", 1700, 2000)
    # An open interval counts until now.
    running = times_of(Timeline(m=[(1000, "queued"), (1500, "running")]), now_ms=2500)
    assert (running.run_ms, running.wall_ms, running.intervals[-1].end_ms) == (1000, 1500, None)


# -- the acceptance: waits on a rate limit, a per-parent limit and an approval -----------------------


@pytest.fixture(scope="module")
def limited_fleet(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """Workers of their own: one running child per parent, and a rate limit on the offline provider."""
    with dedicated_fleet(
        settings, tmp_path_factory.mktemp("timeline-workers"), 1, worker_concurrency=4,
        key_prefix="subqtimeline", queue="subq-timeline", max_running_per_parent=1,
        provider_rpm={"offline": RATE_RPM},
    ) as (coord, _fleet):  # fmt: skip
        yield coord


def _events(coord: Coordinator, root_id: str) -> list[tuple[int, dict[str, str]]]:
    """The tree's events with the Redis time each was added at (its stream id), ms."""
    entries = coord.client.xrange(coord.store.keys.events(root_id))
    return [(int(str(entry_id).split("-")[0]), dict(fields)) for entry_id, fields in entries]


def _watch_commands(coord: Coordinator, key: str, seen: list[tuple[int, str]]) -> threading.Event:
    """Note when Redis runs each command whose text holds `key` (MONITOR: Redis's own clock), until the event
    is set."""
    stop = threading.Event()
    client = redis.Redis.from_url(coord.settings.redis_url or "", decode_responses=True)
    monitor = client.monitor()
    monitor.__enter__()  # MONITOR is on once this returns: nothing the workers do next is missed

    def watch() -> None:
        try:
            for command in monitor.listen():
                if stop.is_set():
                    break
                text = str(command.get("command", ""))
                if key in text:
                    seen.append((int(float(command["time"]) * 1000), text))
        finally:
            monitor.__exit__(None, None, None)
            client.close()

    threading.Thread(target=watch, daemon=True).start()
    return stop


def _stamped_by(seen: list[tuple[int, str]], at_ms: int, *names: str) -> int:
    """When Redis ran the script call that carried the moment `at_ms` and names every one of `names`: it
    ran no earlier than that moment, and no later than a loaded host's delay after it.

    An earlier call can carry the same number as a moment ahead that it sets (seen in CI: the first child's
    start carried when the reconciler should look at it, its start plus the 2-s reconcile interval, which fell
    on the release's moment to the ms), so the stamping call is the first that carried it and ran at or after
    it."""
    ran = [ms for ms, text in seen if "EVALSHA" in text.upper() and all(n in text for n in names)]
    carried = [ms for ms, text in seen if ms in ran and _stamps(text, at_ms)]
    assert carried, (at_ms, names, ran[:5])
    found = [ms for ms in carried if ms >= at_ms - 1]  # -1: both rounded to the ms
    assert found and found[0] - at_ms <= LOADED_MS, (at_ms, carried)
    return found[0]


def _stamps(command: str, at_ms: int) -> bool:
    """Whether one of a command's arguments is the moment `at_ms` (as epoch seconds or milliseconds)."""
    for word in command.replace("'", " ").replace('"', " ").split():
        try:
            value = float(word)
        except ValueError:
            continue
        if abs(value * 1000 - at_ms) <= 1 or abs(value - at_ms) <= 1:
            return True
    return False


def _one_wait(times_json: dict[str, object], reason: str) -> dict[str, int]:
    found = [i for i in times_json["intervals"] if i["reason"] == reason]  # type: ignore[attr-defined]
    assert len(found) == 1, (reason, times_json)
    return found[0]  # type: ignore[no-any-return]


@pytest.mark.alone  # a bound in ms against the outside: run with no other test beside it
def test_each_wait_is_recorded_with_its_reason_and_length(
    limited_fleet: Coordinator, browser: Browser, tmp_path: Path
) -> None:
    coord = limited_fleet
    root = coord.create_task("two children behind a rate limit, a run slot and an approval", todos="[ ] a\n[ ] b")
    # Fill the provider's minute so that every request waits until a moment the test knows.
    freed_at_ms = int((time.time() + RATE_FREES_AFTER_S) * 1000)
    rate_key = coord.store.keys.rate("offline")
    coord.client.delete(rate_key)
    coord.client.zadd(rate_key, {f"filler-{n}": freed_at_ms - 60_000 for n in range(RATE_RPM)})
    seen: list[tuple[int, str]] = []
    watching = _watch_commands(coord, coord.settings.key_prefix, seen)
    risky = agent(call("run_command", command="make deploy"), reply("not deployed"), text="deploy")
    a_id, b_id = coord.delegate(
        root.id, [{"description": "deploy", "message": risky}, {"description": "plain", "message": agent(reply("b"))}]
    ).child_ids

    pending = eventually(lambda: coord.list_approvals(root.id) or None, "the approval", WAIT_S, POLL_S)
    seen_ms = int(time.time() * 1000)
    time.sleep(APPROVAL_HELD_S)
    before_ms = int(time.time() * 1000)
    coord.decide(pending[0].id, "deny", "not today")
    after_ms = int(time.time() * 1000)

    def settled() -> bool | None:
        ended = all(coord.get_task(i).status.terminal for i in (a_id, b_id))
        return (ended and coord.get_task(root.id).status == TaskStatus.ACTIVE) or None

    eventually(settled, "both children ended and the batch closed", WAIT_S)
    watching.set()
    events = _events(coord, root.id)
    records = {i: coord.get_task(i) for i in (root.id, a_id, b_id)}
    times = {i: r.times.model_dump(mode="json") for i, r in records.items()}

    # The approval: from when the run parked it (the test saw it within a poll) to the decision.
    approval = _one_wait(times[a_id], "approval")
    assert seen_ms - WITHIN_MS <= approval["start_ms"] <= seen_ms + POLL_S * 1000
    assert before_ms - WITHIN_MS <= approval["end_ms"] <= after_ms + WITHIN_MS
    assert abs(approval["ms"] - (approval["end_ms"] - approval["start_ms"])) == 0
    assert approval["ms"] >= APPROVAL_HELD_S * 1000 - WITHIN_MS

    # The first child to run waited on the rate limit until the window the test filled freed.
    first = min((a_id, b_id), key=lambda i: records[i].times.started_at_ms or 0)
    other = b_id if first == a_id else a_id
    rate = _one_wait(times[first], "rate_limit")
    # From the first check of the rate key Redis saw (only the first child asks before the window frees) to
    # the check that let the request go, the first after the window freed.
    # The run marks each end as the check answers it: after Redis ran the check, by at most a loaded host's delay.
    rate_checks = [(ms, text) for ms, text in seen if rate_key in text and "EVALSHA" in text.upper()]
    assert rate_checks and 0 <= rate["start_ms"] - rate_checks[0][0] <= LOADED_MS, (rate, rate_checks[:3])
    let_go_ms, let_go = max((c for c in rate_checks if c[0] <= rate["end_ms"]), key=lambda c: c[0])
    assert 0 <= rate["end_ms"] - let_go_ms <= LOADED_MS
    # The check that let it go was the first made at or after the moment the window freed (its `now`).
    assert int(let_go.split()[5]) >= freed_at_ms, let_go
    assert all(int(text.split()[5]) < freed_at_ms for ms, text in rate_checks if ms < let_go_ms)
    running_event_ms = next(ms for ms, e in events if e.get("task_id") == first and e.get("state") == "running")
    assert running_event_ms <= rate["start_ms"]

    # The other waited for the one run slot until the first released it: its end (B), or its park (A).
    slot = _one_wait(times[other], "admission")
    released = "completed" if first == b_id else "waiting_approval"
    released_ms = next(
        ms for ms, e in events if e.get("task_id") == first and released in (e.get("status"), e.get("state"))
    )
    # Its end is the moment the first's release step stamped (a script naming the admission list and the
    # first's id, carrying that moment as an argument: Redis's MONITOR shows it), not a bound on the
    # time between two steps, which a loaded host stretches (seen: 61 ms).
    _stamped_by(seen, slot["end_ms"], coord.store.keys.admission(root.id), first)
    assert slot["end_ms"] <= released_ms + LOADED_MS
    # Its start: its run's first start (start_run.lua, the first script naming its lease), which found no slot.
    lease = coord.store.keys.lease(root.id, other)
    starts = [(ms, text) for ms, text in seen if lease in text and "EVALSHA" in text.upper()]
    assert starts and _stamps(starts[0][1], slot["start_ms"]), (slot, starts[:3])

    # The caller's root waited on its children from the commit to the batch's close.
    children = _one_wait(times[root.id], "children")
    closed_ms = next(ms for ms, e in events if e.get("type") == "batch_done")
    assert 0 <= _stamped_by(seen, children["end_ms"], root.id) <= closed_ms
    assert critical_path(list(records.values()))[0] == root.id

    # The API's record and tree carry the same intervals; the CLI's tree too, and its timeline draws them.
    with (
        ApiServer(create_app(coordinator=Coordinator(api_settings(coord.settings)))) as server,
        server.client() as http,
    ):
        for task_id in (a_id, b_id):
            body = http.get(f"/v1/tasks/{task_id}").json()
            assert body["times"]["intervals"] == times[task_id]["intervals"]
        tree = http.get(f"/v1/tasks/{root.id}/tree").json()
        assert [c["times"]["wait_by_reason_ms"] for c in tree["children"]] == [
            times[i]["wait_by_reason_ms"] for i in (a_id, b_id)
        ]
        # The web view draws each wait as a bar of its reason, from and to the same ms.
        page = _signed_in(browser, server.url)
        try:
            page.goto(f"{server.url}/ui/tasks/{root.id}")
            expect(page.locator("#live")).to_have_attribute("data-state", "ended")  # no swap from here on
            page.wait_for_function("() => Number(document.getElementById('tree').dataset.refreshes) >= 1")
            page.wait_for_load_state("networkidle")  # the refresh the stream's end asked for is in
            for task_id, reason in (
                (a_id, "approval"),
                (first, "rate_limit"),
                (other, "admission"),
                (root.id, "children"),
            ):
                wait = _one_wait(times[task_id], reason)
                rect = page.locator(f".tl-row[data-task-id='{task_id}'] rect.wait-{reason}")
                assert rect.count() == 1, (task_id, reason)
                drawn = (rect.get_attribute("data-start-ms"), rect.get_attribute("data-end-ms"))
                assert drawn == (str(wait["start_ms"]), str(wait["end_ms"]))
            page.locator(f".tl-row[data-task-id='{a_id}'] a.tl-link").focus()
            expect(page.locator(f"#tip-{a_id}")).to_contain_text(f"waiting on approval {duration(approval['ms'])}")
            page.locator(f".tl-row[data-task-id='{a_id}'] a.tl-link").blur()
            _shot_of(page.locator("section.timeline"), tmp_path, "web-timeline-waits.png")
        finally:
            page.context.close()
    env = {"SUBQ_REDIS_URL": coord.settings.redis_url or "", "SUBQ_KEY_PREFIX": coord.settings.key_prefix}
    shown = json.loads(cli("tree", root.id, "--json", env=env).stdout)
    assert [c["times"]["intervals"] for c in shown["children"]] == [times[i]["intervals"] for i in (a_id, b_id)]
    drawn = cli("tree", root.id, "--timeline", "--width", "120", env=env)
    assert drawn.returncode == 0, drawn.stderr
    lines = drawn.stdout.splitlines()

    def bar(task_id: str) -> str:
        short = task_id if task_id == root.id else "-" + task_id.rsplit("-", 1)[-1]
        row = next(line for line in lines if short in line)
        return row[42:-10]  # past the label, before the length

    assert "A" in bar(a_id) and "S" in bar(other) and "R" in bar(first) and "~" in bar(root.id), drawn.stdout
    assert all(len(line) <= 120 for line in drawn.stdout.splitlines())
    plain = cli("tree", root.id, env=env).stdout
    a_line = next(line for line in plain.splitlines() if a_id in line and "wall" in line)
    assert a_line.endswith(f", wall {duration(records[a_id].times.wall_ms)}"), a_line

    # The export carries them.
    assert cli("export", root.id, str(tmp_path / "out"), env=env).returncode == 0
    exported = json.loads((tmp_path / "out" / a_id / "timeline.json").read_text())
    assert exported["times"]["intervals"] == times[a_id]["intervals"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--timeline", "--width", "12"], "--width must be 40 to 1000"),
        (["--timeline", "--width", "wide"], "Invalid value for '--width'"),
        (["--width", "80"], "--width applies to --timeline only"),
        (["--timeline", "--json"], "pick one"),
    ],
)
def test_a_bad_timeline_argument_is_one_clear_line_and_reads_nothing(args: list[str], says: str) -> None:
    # No Redis at all: a refused argument must fail before the command connects.
    proc = cli("tree", "t-nothing", *args, env={"SUBQ_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert proc.returncode != 0 and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_tool_call_is_a_span_of_its_run(tooled: Tooled) -> None:
    """Each call of a profile's tool that ran is kept on its task's timeline, inside the run that made it."""
    coord = tooled.coord
    steps = [call("settle", label=f"t{n}", seconds=TOOL_CALL_S) for n in range(2)]
    task = coord.create_task(agent(*steps, reply("settled")), profile="fragile", run=True)
    done = coord.wait(task.id, WAIT_S)
    assert done.status == TaskStatus.COMPLETED
    spans = done.tool_calls
    assert [(s.tool, s.outcome) for s in spans] == [("settle", "ok"), ("settle", "ok")]
    running = [i for i in done.times.intervals if i.state == "running"]
    for span in spans:
        assert TOOL_CALL_S * 1000 - WITHIN_MS <= span.end_ms - span.start_ms <= TOOL_CALL_S * 1000 + 4 * WITHIN_MS
        assert any(i.start_ms <= span.start_ms and span.end_ms <= (i.end_ms or span.end_ms) for i in running), span
    assert spans[0].end_ms <= spans[1].start_ms
    tree = coord.tree(task.id)
    assert tree.tool_calls == spans


def test_a_wide_fan_out_folds_its_siblings_but_never_one_waiting_for_a_person() -> None:
    from coordinator.models import TaskRecord
    from coordinator.web.views import GROUP_AT, SIBLINGS_SHOWN, TimelineGroup, read_timeline

    def task(task_id: str, parent: str | None, end_ms: int) -> TaskRecord:
        marks = Timeline(m=[(1000, "queued"), (1100, "running"), (end_ms, "completed")])
        return TaskRecord(id=task_id, parent_id=parent, root_id="r", depth=0 if parent is None else 1,
                          status="completed", prompt="p", profile="offline", created_at=1.0, updated_at=1.0,
                          timeline=marks)  # fmt: skip

    children = [task(f"r-{n:03d}", "r", 2000 + n) for n in range(GROUP_AT + 20)]
    records = [task("r", None, 9000), *children]
    waiting = {"r-000", "r-001"}  # the two that ended first: never among the latest
    view = read_timeline(records, {}, now_ms=10_000, keep=waiting)
    (group,) = [item for item in view.items if isinstance(item, TimelineGroup)]
    shown = [item.record.id for item in view.items if not isinstance(item, TimelineGroup)]
    assert waiting <= set(shown) and "r-059" in shown  # the latest to end is the critical child
    assert len(shown) == 1 + SIBLINGS_SHOWN + len(waiting)
    assert group.count == len(children) - SIBLINGS_SHOWN - len(waiting) == len(view.folded_ids)
    assert view.critical == ["r", "r-059"]
    # Every child waiting for a person: nothing is folded (and nothing fails).
    everyone = read_timeline(records, {}, now_ms=10_000, keep={c.id for c in children})
    assert not everyone.folded_ids and len(everyone.items) == len(records)
