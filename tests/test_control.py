"""Control of running trees: cancel, budgets, approvals, transient errors, live status.

Real Redis, real worker processes; the figures are counts of scripted requests
(tests/agents.py: 21000 micro-USD each).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator import Coordinator, NotFoundError, Settings, StateError, TaskRecord, TaskStatus, ValidationError
from coordinator.celery_app import make_app
from tests.agents import STEP_COST_MICROS, USAGE, agent, call, reply
from tests.conftest import dedicated_fleet
from tests.helpers import HostLag, eventually, most_at_once, state
from tests.test_bad_input import NO_TREE
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child

WAIT_S = 60


def _until(check: Callable[[], bool], timeout_s: float = 20, what: str = "condition") -> None:
    eventually(check, what, timeout_s, every_s=0.05)


def _slow(text: str, latency_ms: int = 15_000) -> str:
    return agent({"reply": text, "usage": USAGE, "latency_ms": latency_ms})


def test_cancel_a_root_stops_its_running_children_and_keeps_what_finished(coordinator: Coordinator) -> None:
    root = coordinator.create_task("Three children", todos="[ ] a\n[ ] b\n[ ] c")
    batch = coordinator.delegate(
        root.id,
        [
            {"description": "quick", "message": agent(reply("quick done"))},
            {"description": "slow one", "message": _slow("never")},
            {"description": "slow two", "message": _slow("never")},
        ],
    )
    quick, slow1, slow2 = batch.child_ids
    _until(lambda: coordinator.get_task(quick).status == TaskStatus.COMPLETED, what="the quick child")
    _until(
        lambda: all(coordinator.snapshot(root.id)[s].state == "running" for s in (slow1, slow2)),
        what="the slow children to wait on their model",
    )

    with HostLag() as lag:
        cancelled_at = time.monotonic()
        coordinator.cancel(root.id, "operator stop")
        _until(lambda: coordinator.store.runs.in_flight(root.id)["leases"] == 0, timeout_s=30, what="the runs to stop")
        stopped_in_s = time.monotonic() - cancelled_at

    # 1 s is the promise (a stop watch poll is 0.25 s), 2 s with the polls around it on an idle host, plus what
    # the host's load delayed everything by.
    assert stopped_in_s < lag.bound_s(2.0), f"stopped in {stopped_in_s:.2f} s, the host late by {lag.worst_s:.2f} s"
    done = coordinator.wait(root.id, 5)
    assert done.status == TaskStatus.CANCELLED and done.error == "cancelled: operator stop"
    for slow in (slow1, slow2):
        record = coordinator.get_task(slow)
        assert record.status == TaskStatus.CANCELLED and "operator stop" in record.error
        assert (record.requests, record.cost_micros) == (0, 0), "no usage after the cancel"
    kept = coordinator.get_task(quick)
    assert kept.status == TaskStatus.COMPLETED and kept.cost_micros == STEP_COST_MICROS
    assert done.total_cost_micros == STEP_COST_MICROS
    _until(lambda: any(m["say"] == "subtask_result" for m in coordinator.messages(root.id)), 5, "the notice")
    notice = next(m["text"] for m in coordinator.messages(root.id) if m["say"] == "subtask_result")
    assert notice.startswith("Stopped: Cancelled: cancelled: operator stop")
    assert "[completed] quick" in notice and "quick done" in notice and "[cancelled] slow one" in notice
    time.sleep(0.5)  # anything still unwinding would show here
    assert coordinator.store.runs.in_flight(root.id) == {
        "running": 0,
        "admission": 0,
        "awaiting": 0,
        "leases": 0,
        "watched": 0,
    }
    assert coordinator.get_task(slow1).requests == 0


def test_a_cancelled_child_resumes_its_agent_parent_once_with_the_notice(coordinator: Coordinator) -> None:
    root = coordinator.create_task(
        agent(
            call("run_subagents", tasks=[
                {"description": "fast", "message": agent(reply("fast done"))},
                {"description": "stuck", "message": _slow("never")},
            ]),
            reply("noted the cancel"),
        ),
        run=True,
    )  # fmt: skip
    _until(lambda: len(coordinator.get_task(root.id).child_ids) == 2, what="the fan-out")
    fast, stuck = coordinator.get_task(root.id).child_ids
    _until(lambda: coordinator.snapshot(root.id)[stuck].state == "running", what="the stuck child to start")
    coordinator.cancel(stuck, "taking too long")
    done = coordinator.wait(root.id, WAIT_S)
    assert done.status == TaskStatus.COMPLETED and done.summary == "noted the cancel"
    assert coordinator.store.records.task_field(root.id, "resumes") == "1"
    result = next(m["text"] for m in coordinator.messages(root.id) if m["say"] == "subtask_result")
    assert "[completed] fast" in result and "[cancelled] stuck" in result and "taking too long" in result


def test_a_queued_child_that_was_cancelled_never_starts(idle_coordinator: Coordinator) -> None:
    parent = idle_coordinator.create_task("p")
    (child,) = idle_coordinator.delegate(parent.id, [{"description": "c", "message": agent(reply("x"))}]).child_ids
    idle_coordinator.cancel(parent.id, "changed my mind")
    rt = build_runtime(idle_coordinator.settings, make_app(idle_coordinator.settings))
    result = run_child(rt, child)  # the queued message arrives after the cancel (or after a restart)
    assert result.status == "cancelled"
    record = idle_coordinator.get_task(child)
    assert record.requests == 0 and idle_coordinator.store.records.task_field(child, "run_seq") is None


def test_cancel_bad_input_changes_nothing(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    parent = coord.create_task("p")
    coord.cancel(parent.id, "first")
    cases: list[tuple[Callable[[], object], type[Exception], str, str]] = [
        (lambda: coord.cancel("0123456789abcdef", "x"), NotFoundError, "Unknown task: 0123456789abcdef", "task_id"),
        (lambda: coord.cancel("nope", "x"), NotFoundError, "is not a subq task", "task_id"),
        (lambda: coord.cancel(parent.id, "again"), StateError, "has already ended (cancelled)", "task_id"),
        (
            lambda: coord.cancel(coord.create_task("q").id, "  "),
            ValidationError,
            "reason must be a non-empty",
            "reason",
        ),
    ]
    for call_, error, message, field in cases:
        before = state(coord, parent.id)
        with pytest.raises(error) as caught:
            call_()
        assert message in str(caught.value) and getattr(caught.value, "field", None) == field
        if error is not ValidationError:  # (the last case creates its own task first)
            assert state(coord, parent.id) == before


def test_a_budget_stops_the_tree_within_one_request(coordinator: Coordinator) -> None:
    budget_micros = 50_000
    spender = agent(*[call("update_todo_list", todos=f"[-] step {n}") for n in range(4)], reply("spent it all"))
    root = coordinator.create_task("Budgeted", todos="[ ] spend", budget_usd="0.05")
    (child,) = coordinator.delegate(root.id, [{"description": "spender", "message": spender}]).child_ids
    done = coordinator.wait(root.id, WAIT_S)

    assert done.status == TaskStatus.FAILED and done.error_class == "BudgetExhausted"
    assert budget_micros <= done.total_cost_micros <= budget_micros + STEP_COST_MICROS
    assert "budget of $0.050000 exhausted: the subtree spent $0.063000" in done.error
    assert "spender $0.063000" in done.error
    spent = coordinator.get_task(child)
    assert spent.status == TaskStatus.CANCELLED and spent.requests == 3
    time.sleep(0.5)
    assert coordinator.get_task(child).requests == 3, "no request started after the stop"


def test_a_child_budget_stops_only_that_child_and_its_parent_hears_why(coordinator: Coordinator) -> None:
    spender = agent(*[call("update_todo_list", todos=f"[-] step {n}") for n in range(4)], reply("done"))
    parent = coordinator.create_task("Two children", todos="[ ] capped\n[ ] free")
    batch = coordinator.delegate(
        parent.id,
        [
            {"description": "capped", "message": spender, "budget_usd": 0.03},
            {"description": "free", "message": agent(reply("free done"))},
        ],
    )
    done = coordinator.wait(parent.id, WAIT_S)
    capped = coordinator.get_task(batch.child_ids[0])
    assert capped.status == TaskStatus.FAILED and capped.error_class == "BudgetExhausted"
    assert capped.total_cost_micros == 2 * STEP_COST_MICROS  # the request that crossed 0.03 was the last
    assert done.status == TaskStatus.ACTIVE, "the caller-owned parent was resumed"
    text = coordinator.messages(parent.id)[-1]["text"]
    assert "[failed] capped" in text and "BudgetExhausted: budget of $0.030000 exhausted" in text
    assert "[completed] free" in text
    item = coordinator.get_todos(parent.id)[0]
    assert item.subtask_id == capped.id and item.cost_micros == 2 * STEP_COST_MICROS


@pytest.mark.parametrize("budget", [0, -1, "abc", "nan", True, 0.0000001])
def test_a_bad_budget_is_refused(idle_coordinator: Coordinator, budget: object) -> None:
    before = state(idle_coordinator, NO_TREE)
    with pytest.raises(ValidationError) as caught:
        idle_coordinator.create_task("x", budget_usd=budget)  # type: ignore[arg-type]
    assert caught.value.field == "budget_usd"
    assert "budget_usd must be" in str(caught.value)
    assert state(idle_coordinator, NO_TREE) == before, "no root was created"


def test_a_child_budget_cannot_exceed_what_remains(idle_coordinator: Coordinator) -> None:
    parent = idle_coordinator.create_task("p", budget_usd=0.05)
    before = state(idle_coordinator, parent.id)
    with pytest.raises(ValidationError) as caught:
        idle_coordinator.delegate(parent.id, [{"description": "c", "message": "m", "budget_usd": 0.06}])
    assert caught.value.field == "subtasks.0.budget_usd"
    assert "$0.060000 exceeds what remains of the parent's budget ($0.050000)" in str(caught.value)
    assert state(idle_coordinator, parent.id) == before


def _wait_for_approval(coord: Coordinator, root_id: str) -> str:
    _until(lambda: len(coord.list_approvals(root_id)) == 1, what="an approval request")
    return coord.list_approvals(root_id)[0].id


def test_an_approval_holds_one_child_while_its_sibling_completes(coordinator: Coordinator) -> None:
    config = coordinator.settings.profile(None).run_command
    assert config is not None, "the test settings' offline profile runs commands (tests/conftest.py)"
    build = config.cwd / "build"
    build.mkdir(exist_ok=True)
    (build / "out.o").write_text("stale")
    parent = coordinator.create_task("Two children", todos="[ ] clean the build\n[ ] write notes")
    risky = agent(call("run_command", command="rm -rf build"), reply("cleaned"))
    batch = coordinator.delegate(
        parent.id,
        [{"description": "clean", "message": risky}, {"description": "notes", "message": agent(reply("noted"))}],
    )
    approval_id = _wait_for_approval(coordinator, parent.id)
    approval = coordinator.list_approvals(parent.id)[0]
    assert (approval.task_id, approval.tool, approval.args) == (
        batch.child_ids[0],
        "run_command",
        {"command": "rm -rf build"},
    )
    assert approval.todo_content == "clean the build"
    _until(lambda: coordinator.get_task(batch.child_ids[1]).status == TaskStatus.COMPLETED, what="the sibling")
    # The approval is saved before the run gives its worker back, so the live state can lag it a moment.
    _until(
        lambda: coordinator.snapshot(parent.id)[batch.child_ids[0]].state == "waiting_approval",
        what="the held child's run to give its worker back",
    )
    assert coordinator.get_task(parent.id).status == TaskStatus.DELEGATED
    assert build.exists(), "nothing ran before the decision"

    decided = coordinator.decide(approval_id, "approve")

    assert decided.status == "approved"
    done = coordinator.wait(parent.id, WAIT_S)
    clean = coordinator.get_task(batch.child_ids[0])
    assert clean.status == TaskStatus.COMPLETED and clean.summary == "cleaned"
    said = [(m["say"], m["text"]) for m in coordinator.messages(clean.id) if m.get("say", "").startswith("command")]
    assert said == [("command", "rm -rf build"), ("command_result", "exit 0")], "it ran, in the profile's cwd"
    assert not build.exists()
    assert done.status == TaskStatus.ACTIVE and coordinator.list_approvals(parent.id) == []
    with pytest.raises(StateError, match="was already approved"):
        coordinator.decide(approval_id, "deny")


def test_a_denied_call_returns_the_feedback_to_the_model(coordinator: Coordinator) -> None:
    parent = coordinator.create_task("One child")
    risky = agent(call("run_command", command="git push --force"), reply("did not push"))
    (child,) = coordinator.delegate(parent.id, [{"description": "push", "message": risky}]).child_ids
    approval_id = _wait_for_approval(coordinator, parent.id)
    coordinator.decide(approval_id, "deny", feedback="never force-push; open a PR instead")
    coordinator.wait(parent.id, WAIT_S)
    record = coordinator.get_task(child)
    assert record.status == TaskStatus.COMPLETED and record.summary == "did not push"
    returns = [p["content"] for m in coordinator.messages(child, kind="api") for p in m["parts"]
               if p.get("part_kind") == "tool-return"]  # fmt: skip
    assert any("never force-push; open a PR instead" in str(r) for r in returns)
    assert not any(m.get("say", "").startswith("command") for m in coordinator.messages(child)), "nothing ran"


def test_an_unanswered_approval_times_out_as_a_denial(idle_coordinator: Coordinator) -> None:
    settings = idle_coordinator.settings.model_copy(update={"approval_timeout_s": 1})
    coord = Coordinator(settings)
    rt = build_runtime(settings, make_app(settings))
    task = coord.create_task(agent(call("run_command", command="make deploy"), reply("gave up")), run=True)
    assert run_child(rt, task.id).status == "waiting_approval"
    (approval,) = coord.list_approvals(task.id)
    assert not coord.expire_approval(approval.id), "not due yet"
    time.sleep(1.1)
    assert coord.expire_approval(approval.id)
    assert coord.store.approvals.get_approval(approval.id).status == "expired"
    assert run_child(rt, task.id).status == "completed"  # the resume the expiry published
    returns = [p["content"] for m in coord.messages(task.id, kind="api") for p in m["parts"]
               if p.get("part_kind") == "tool-return"]  # fmt: skip
    assert any("no decision within 1s" in str(r) for r in returns)


def test_an_approval_after_its_deadline_is_refused_and_the_call_times_out(idle_coordinator: Coordinator) -> None:
    """Before the reconciler served the expiry's timer (up to a tick, or while no worker ran), an approval made
    after the deadline stood, and the resumed run ran the command a person was too late to allow. Now it is
    refused (409 over the API), the call expires then, and the run goes on without it. A late denial stands."""
    settings = idle_coordinator.settings.model_copy(update={"approval_timeout_s": 1})
    coord = Coordinator(settings)
    rt = build_runtime(settings, make_app(settings))
    late = coord.create_task(agent(call("run_command", command="touch deployed"), reply("done")), run=True)
    denied = coord.create_task(agent(call("run_command", command="touch released"), reply("done")), run=True)
    assert {run_child(rt, t.id).status for t in (late, denied)} == {"waiting_approval"}
    (approval,), (other,) = coord.list_approvals(late.id), coord.list_approvals(denied.id)
    time.sleep(max(0.0, approval.deadline - time.time()) + 0.1)  # due, and no reconciler has served its timer

    with pytest.raises(StateError, match=rf"Approval {approval.id} expired at .*: the call was denied as timed out"):
        coord.decide(approval.id, "approve")
    assert coord.store.approvals.get_approval(approval.id).status == "expired"
    assert coord.decide(other.id, "deny", "not today").status == "denied", "a late denial is what an expiry does"

    for task in (late, denied):
        assert run_child(rt, task.id).status == "completed"  # the resume the expiry (or the denial) published
        said = [m.get("text", "") for m in coord.messages(task.id) if m.get("say") == "command"]
        assert said == [], f"no command ran: {said}"


def test_a_cancel_that_reaches_a_task_after_its_run_ended_it_says_so(
    idle_coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel read the task as not ended, then stopped its subtree, which leaves an ended task as it is: a run
    that ended it between the two made the cancel answer 200 with the record, and `subq cancel` said "Cancelled"
    of a task that had completed. It is a 409 now, and the task keeps its outcome."""
    coord = idle_coordinator
    rt = build_runtime(coord.settings, make_app(coord.settings))
    task = coord.create_task(agent(reply("done before the cancel")), run=True)
    running = coord.get_task(task.id)
    assert run_child(rt, task.id).status == "completed"
    reads = coord.store.records.get_task
    first = [True]

    def as_read_before_it_ended(task_id: str) -> TaskRecord:
        if first[0] and task_id == task.id:
            first[0] = False
            return running
        return reads(task_id)

    monkeypatch.setattr(coord.store.records, "get_task", as_read_before_it_ended)
    with pytest.raises(StateError, match=f"Task {task.id} ended \\(completed\\) before the cancel reached it"):
        coord.cancel(task.id, "too late")
    monkeypatch.undo()
    assert coord.get_task(task.id).status == TaskStatus.COMPLETED and coord.get_task(task.id).error == ""


def test_a_task_that_waits_on_approvals_more_times_than_its_delivery_limit_completes(
    idle_coordinator: Coordinator,
) -> None:
    """A park on approvals freed the lease without resetting the task's delivery count, which counts runs lost
    with their worker: the fourth resume of a task that never lost one failed it as `WorkerLost` ("lost with its
    worker 3 times"). A park is not a loss, as a hand-back, a provider's wait and a delegation are not."""
    coord = idle_coordinator
    rt = build_runtime(coord.settings, make_app(coord.settings))
    asks = coord.settings.max_deliveries + 2
    calls = [call("run_command", command=f"echo step {n}") for n in range(asks)]
    task = coord.create_task(agent(*calls, reply("all steps done")), run=True)
    for _ in range(asks):
        assert run_child(rt, task.id).status == "waiting_approval"
        (approval,) = coord.list_approvals(task.id)
        coord.decide(approval.id, "approve")
    done = run_child(rt, task.id)
    assert (done.status, done.summary) == ("completed", "all steps done"), done


def test_approval_bad_input_changes_nothing(idle_coordinator: Coordinator) -> None:
    coord = idle_coordinator
    mine = coord.create_task("a tree of this test")
    bad: list[tuple[Callable[[], object], type[Exception], str, str]] = [
        (lambda: coord.decide("0123456789abcdef-a0123456789ab", "approve"), NotFoundError, "Unknown approval", "approval_id"),
        (lambda: coord.decide("garbage", "approve"), NotFoundError, "is not a subq", "approval_id"),
        (lambda: coord.decide("0123456789abcdef-a0123456789ab", "maybe"), ValidationError, "decision must be", "decision"),
        (lambda: coord.list_approvals("0123456789abcdef"), NotFoundError, "Unknown task", "root_id"),
        (lambda: coord.snapshot("0123456789abcdef"), NotFoundError, "Unknown task", "task_id"),
    ]  # fmt: skip
    for call_, error, message, field in bad:
        before = state(coord, mine.id)
        with pytest.raises(error) as caught:
            call_()
        assert message in str(caught.value) and getattr(caught.value, "field", None) == field
        assert state(coord, mine.id) == before


def test_transient_model_errors_are_waited_out_and_counted(coordinator: Coordinator) -> None:
    flaky = agent({"reply": "got through", "usage": USAGE, "transient": {"kind": "rate_limit", "times": 2}})
    hopeless = agent({"reply": "never", "usage": USAGE, "transient": {"kind": "server", "times": 50}})
    parent = coordinator.create_task("p")
    batch = coordinator.delegate(
        parent.id, [{"description": "flaky", "message": flaky}, {"description": "hopeless", "message": hopeless}]
    )
    coordinator.wait(parent.id, WAIT_S)
    ok, bad = (coordinator.get_task(c) for c in batch.child_ids)
    assert ok.status == TaskStatus.COMPLETED and ok.cost_micros == STEP_COST_MICROS
    assert coordinator.store.records.task_field(ok.id, "transient_errors") == "2"
    assert bad.status == TaskStatus.FAILED and bad.error_class == "ModelServerError"
    # Sent again until its profile's model_wait_out_s was spent, each attempt counted; the last error is the run's.
    assert int(coordinator.store.records.task_field(bad.id, "transient_errors") or 0) >= 3
    assert "gave up after" in (bad.error or "") and "model_wait_out_s=" in (bad.error or "")


def test_the_provider_rate_limit_is_shared_through_redis(idle_coordinator: Coordinator) -> None:
    store = idle_coordinator.store
    provider = f"test-{time.time_ns()}"
    assert [store.runs.wait_for_rate(provider, 3) for _ in range(3)] == [0, 0, 0]
    wait_ms = store.runs.wait_for_rate(provider, 3)
    assert 0 < wait_ms <= 60_000


def test_a_tool_slot_taken_again_by_its_call_is_not_freed_by_the_earlier_take(idle_coordinator: Coordinator) -> None:
    # A new run of a task runs a cut-off call again while the thread of the first take may still run: when that
    # thread returns, its free must not let a third call in beside the second.
    store = idle_coordinator.store
    pattern = f"slot-{time.time_ns()}"
    slots = store.keys.tool_slots(pattern)
    first = store.runs.take_tool_slot(pattern, 1, 60, "task:call")
    again = store.runs.take_tool_slot(pattern, 1, 60, "task:call")
    assert first and again and again != first
    assert store.runs.free_tool_slot(pattern, "task:call", first) is False
    assert store.client.zscore(slots, "task:call") == again
    assert store.runs.take_tool_slot(pattern, 1, 60, "other:call") == 0, "the slot is the second take's still"
    assert store.runs.free_tool_slot(pattern, "task:call", again) is True
    assert store.runs.take_tool_slot(pattern, 1, 60, "other:call") > 0


def test_a_short_tool_slot_take_keeps_a_longer_held_slot_of_the_same_glob(idle_coordinator: Coordinator) -> None:
    # Tools of one glob may have different timeouts: a short take after a long one must not make the glob's set
    # lapse (and with it the long call's slot) before the long lease ends, or a third call gets in over the limit.
    store = idle_coordinator.store
    pattern = f"slot-{time.time_ns()}"
    slots = store.keys.tool_slots(pattern)
    assert store.runs.take_tool_slot(pattern, 2, 600, "long:call") > 0
    assert store.runs.take_tool_slot(pattern, 2, 1, "short:call") > 0
    assert store.client.pttl(slots) > 500_000, "the set outlives the long lease's holder, not the short one's"
    assert store.runs.take_tool_slot(pattern, 2, 60, "third:call") == 0


def test_live_status_is_streamed_and_snapshotted(coordinator: Coordinator) -> None:
    parent = coordinator.create_task("p")
    batch = coordinator.delegate(
        parent.id,
        [{"description": "talker", "message": agent(call("update_todo_list", todos="[-] talking"), reply("said it"))}],
    )
    coordinator.wait(parent.id, WAIT_S)
    (child,) = batch.child_ids
    live = coordinator.snapshot(parent.id)
    assert live[child].state == "completed" and live[child].cost_micros == 2 * STEP_COST_MICROS
    assert live[child].requests == 2 and live[parent.id].state in ("queued", "running", "delegated")
    states = [f["state"] for _, f in coordinator.store.events.read_events(parent.root_id) if f.get("type") == "live"
              and f.get("task_id") == child]  # fmt: skip
    assert states[0] == "queued" and "running" in states
    tools = [f for _, f in coordinator.store.events.read_events(parent.root_id) if f.get("task_id") == child]
    assert tools, "the child's changes are on the tree's stream"
    stream_len = coordinator.client.xlen(coordinator.store.keys.events(parent.root_id))
    assert stream_len <= 10_000 + 100  # bounded (MAXLEN ~)


def test_snapshot_refuses_a_non_root(idle_coordinator: Coordinator) -> None:
    parent = idle_coordinator.create_task("p")
    (child,) = idle_coordinator.delegate(parent.id, [{"description": "c", "message": "m"}]).child_ids
    with pytest.raises(ValidationError, match="is not a root task"):
        idle_coordinator.snapshot(child)


@pytest.fixture(scope="module")
def limited(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """A fleet with 32 slots whose admission control lets 5 children of one parent run at once."""
    log_dir = tmp_path_factory.mktemp("limited")
    with dedicated_fleet(settings, log_dir, 2, queue="subq-limited", max_running_per_parent=5) as (coord, _):
        yield coord


def test_a_per_parent_limit_holds_under_a_fan_out_of_twenty(limited: Coordinator) -> None:
    parent = limited.create_task("Twenty children", todos="\n".join(f"[ ] item {n}" for n in range(20)))
    batch = limited.delegate(
        parent.id, [{"description": f"c{n}", "message": _slow(f"c{n} done", latency_ms=400)} for n in range(20)]
    )
    assert limited.wait(parent.id, WAIT_S).status == TaskStatus.ACTIVE
    # Never more than five, and five at once, by the order of the tree's event stream (a poll of the
    # live states can miss the moment five ran on a loaded host).
    assert most_at_once(limited, parent.id, set(batch.child_ids)) == 5
    todos = limited.get_todos(parent.id)
    assert all(t.cost_micros == STEP_COST_MICROS for t in todos)
    empty = {"running": 0, "admission": 0, "awaiting": 0, "leases": 0, "watched": 0}
    _until(lambda: limited.store.runs.in_flight(parent.id) == empty, timeout_s=10, what="the in-flight state to empty")


def test_a_stagger_spaces_the_starts_and_every_child_runs(settings: Settings, tmp_path: Path) -> None:
    """With SUBQ_START_STAGGER_MS a delayed child's start comes back at the start it reserved, and runs; before,
    its own reservation delayed it again at every return, and the tree waited for good."""
    with dedicated_fleet(settings, tmp_path, 1, queue="subq-stagger", start_stagger_ms=300) as (coord, _):
        parent = coord.create_task("Three spaced children", todos="[ ] a\n[ ] b\n[ ] c")
        batch = coord.delegate(parent.id, [{"description": d, "message": agent(reply(f"{d} done"))} for d in "abc"])
        assert coord.wait(parent.id, WAIT_S).status == TaskStatus.ACTIVE, "every child ran and reported back"
        children = [coord.get_task(c) for c in batch.child_ids]
        assert [c.status for c in children] == [TaskStatus.COMPLETED] * 3
        run_seqs = [coord.store.records.task_field(c.id, "run_seq") for c in children]
        assert run_seqs == ["1", "1", "1"], "each ran once: a delayed start runs nothing"


def test_cancelling_a_throttled_fan_out_leaves_nothing_in_flight(limited: Coordinator) -> None:
    parent = limited.create_task("Twenty slow children")
    batch = limited.delegate(
        parent.id, [{"description": f"c{n}", "message": _slow("never", latency_ms=5000)} for n in range(20)]
    )
    _until(lambda: limited.store.runs.in_flight(parent.id)["admission"] > 0, what="children queued for a slot")
    limited.cancel(parent.id, "too many")
    empty = {"running": 0, "admission": 0, "awaiting": 0, "leases": 0, "watched": 0}
    _until(lambda: limited.store.runs.in_flight(parent.id) == empty, timeout_s=10, what="the in-flight state to empty")
    assert all(limited.get_task(c).status == TaskStatus.CANCELLED for c in batch.child_ids)
    assert sum(limited.get_task(c).requests for c in batch.child_ids) == 0
