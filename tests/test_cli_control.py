"""The control commands as a user runs them: cancel, approvals, approve, deny, run --budget (in-process: `cli`)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from tests.agents import STEP_TOKENS, USAGE, agent, call, reply, subtask
from tests.helpers import Transport, eventually, state
from tests.test_bad_input import NO_TREE
from tests.test_cli import cli

WAIT_S = 60


@pytest.fixture
def fleet_env(settings: Settings, coordinator: Coordinator, transport: Transport) -> dict[str, str]:
    """Reaches the test workers, over Redis or through the API."""
    return transport.env(settings)


def _waiting_approval(coord: Coordinator, root_id: str) -> str:
    deadline = time.monotonic() + 30
    while not coord.list_approvals(root_id):
        assert time.monotonic() < deadline, "no approval request appeared"
        time.sleep(0.1)
    return coord.list_approvals(root_id)[0].id


def test_approve_and_deny_from_the_command_line(coordinator: Coordinator, fleet_env: dict[str, str]) -> None:
    parent = coordinator.create_task("Two risky children", todos="[ ] build\n[ ] publish")
    batch = coordinator.delegate(parent.id, [
        {"description": "build", "message": agent(call("run_command", command="make build"), reply("built"))},
        {"description": "publish", "message": agent(call("run_command", command="make publish"), reply("held"))},
    ])  # fmt: skip
    deadline = time.monotonic() + 30
    while len(coordinator.list_approvals(parent.id)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    listed = cli("approvals", "--root", parent.id, "--json", env=fleet_env)
    assert listed.returncode == 0, listed.stderr
    pending = {a["args"]["command"]: a for a in json.loads(listed.stdout)}
    assert set(pending) == {"make build", "make publish"}
    assert pending["make build"]["todo_content"] == "build"
    text = cli("approvals", "--root", parent.id, env=fleet_env).stdout
    assert 'run_command {"command": "make build"}  for todo \'build\'' in text

    ok = cli("approve", pending["make build"]["id"], env=fleet_env)
    assert ok.returncode == 0 and "Approved" in ok.stdout
    no = cli("deny", pending["make publish"]["id"], "--feedback", "not on a Friday", env=fleet_env)
    assert no.returncode == 0 and "not on a Friday" in no.stdout
    coordinator.wait(parent.id, WAIT_S)
    build, publish = (coordinator.get_task(c) for c in batch.child_ids)
    assert build.summary == "built" and publish.summary == "held"
    again = cli("approve", pending["make build"]["id"], env=fleet_env)
    assert (
        again.returncode == 1
        and again.stderr.strip() == f"subq: Approval {pending['make build']['id']} was already approved"
    )


def test_cancel_from_the_command_line(coordinator: Coordinator, fleet_env: dict[str, str]) -> None:
    parent = coordinator.create_task("A quick child and a slow one")
    quick, child = coordinator.delegate(
        parent.id,
        [
            {"description": "quick", "message": agent(reply("done"))},
            {"description": "slow", "message": agent({"reply": "x", "usage": USAGE, "latency_ms": 20_000})},
        ],
    ).child_ids
    eventually(lambda: coordinator.get_task(quick).status == TaskStatus.COMPLETED, "the quick child completed")
    out = cli("cancel", parent.id, "--reason", "wrong plan", env=fleet_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"Cancelled {parent.id} and 1 task below it that had not ended: wrong plan"
    assert coordinator.get_task(child).status == TaskStatus.CANCELLED  # only the slow one was stopped and counted
    assert coordinator.get_task(quick).status == TaskStatus.COMPLETED
    again = cli("cancel", parent.id, "--reason", "again", env=fleet_env)
    assert again.returncode == 1 and "has already ended (cancelled)" in again.stderr


def test_run_with_a_budget(coordinator: Coordinator, fleet_env: dict[str, str]) -> None:
    spender = agent(*[call("update_todo_list", todos=f"[-] step {n}") for n in range(5)], reply("done"))
    out = cli("run", spender, "--budget", "0.03", "--follow", env=fleet_env)
    assert out.returncode == 1, "the root failed: its budget ran out"
    root_id = out.stdout.splitlines()[0]
    record = coordinator.get_task(root_id)
    assert record.status == TaskStatus.FAILED and record.error_class == "BudgetExhausted"
    assert record.budget_micros == 30_000 and record.total_cost_micros == 42_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "p", "--budget", "abc"], "subq: budget_usd must be a positive number of US dollars, not 'abc'"),
        (["run", "p", "--budget", "-1"], "subq: budget_usd must be a positive number of US dollars, not '-1'"),
        (["cancel", "0123456789abcdef", "--reason", "x"], "subq: Unknown task: 0123456789abcdef"),
        (["cancel", "0123456789abcdef", "--reason", " "], "subq: reason must be a non-empty string"),
        (["approve", "0123456789abcdef-a0123456789ab"], "subq: Unknown approval: 0123456789abcdef-a0123456789ab"),
        (["deny", "junk", "--feedback", "no"], "subq: Unknown id: 'junk' is not a subq task or batch id"),
        (["approvals", "--root", "0123456789abcdef"], "subq: Unknown task: 0123456789abcdef"),
    ],
)
def test_control_commands_refuse_bad_input(
    idle_coordinator: Coordinator, settings: Settings, transport: Transport, args: list[str], message: str
) -> None:
    env = transport.env(settings.model_copy(update={"queue": "subq-nobody"}))
    before = state(idle_coordinator, NO_TREE)
    proc = cli(*args, env=env)
    assert proc.returncode == 1 and proc.stderr.strip() == message and proc.stdout == ""
    assert state(idle_coordinator, NO_TREE) == before


def test_approvals_of_a_child_id_is_refused_not_empty(settings: Settings, transport: Transport) -> None:
    """`--root` with a child's id matched no approval and said nothing waits when the CLI reached Redis itself;
    through the API it was refused. Both refuse it now, naming root_id, and change nothing."""
    idle = settings.model_copy(update={"queue": "subq-nobody"})
    coord = Coordinator(idle)
    try:
        root = coord.create_task("a root")
        (child,) = coord.delegate(root.id, [{"description": "c", "message": "m"}]).child_ids
        before = state(coord, root.id)
        proc = cli("approvals", "--root", child, env=transport.env(idle))
        assert proc.returncode == 1 and "root_id" in proc.stderr and proc.stdout == "", proc
        assert state(coord, root.id) == before
    finally:
        coord.close()


def test_redeliver_of_a_malformed_delivery_id_is_refused_alike(settings: Settings, transport: Transport) -> None:
    """On Redis a delivery id that is not UTF-8 (a lone surrogate) was a traceback from hiredis; through the API it
    was one from httpx, and ".." or "." reached another route. Each is refused as an unknown delivery, either way."""
    idle = settings.model_copy(update={"queue": "subq-nobody"})
    coord = Coordinator(idle)
    try:
        root = coord.create_task("a root")
        before = state(coord, root.id)
        for delivery_id in ("\udcff", "..", ".", "", "a/b"):
            proc = cli("redeliver", root.id, delivery_id, env=transport.env(idle))
            assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
            assert proc.stderr == f"subq: Unknown delivery {delivery_id!r} of task {root.id}\n"
        assert state(coord, root.id) == before
    finally:
        coord.close()


def test_cancel_requires_a_reason(settings: Settings) -> None:
    proc = cli("cancel", "0123456789abcdef", env={"SUBQ_REDIS_URL": settings.redis_url or ""})
    assert proc.returncode == 2 and "Missing option '--reason'" in proc.stderr


# Everything rich writes to move the cursor and colour text: the view's own characters remain.
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
COLUMNS = 72


def test_follow_on_a_terminal_fits_the_width_and_shows_the_approval_to_give(
    coordinator: Coordinator, fleet_env: dict[str, str]
) -> None:
    root = agent(
        call(
            "run_subagents",
            tasks=[
                subtask("Collect the sales figures of every region for the quarter", reply("collected")),
                subtask("Publish the report", call("run_command", command="make publish"), reply("published")),
            ],
        ),
        call("attempt_completion", result="Report ready"),
        text="Prepare the quarterly report, a description long enough to be cut on a narrow terminal.",
    )
    plan = "[ ] Collect the sales figures of every region for the quarter\n[ ] Publish the report\n"
    result: dict[str, subprocess.CompletedProcess[str]] = {}
    env = fleet_env | {"COLUMNS": str(COLUMNS)}
    follower = threading.Thread(
        target=lambda: result.update(run=cli("run", root, "--todos", "-", "--follow", env=env, stdin=plan, tty=True))
    )
    follower.start()
    approval = eventually(lambda: coordinator.list_approvals(), "the child's approval request")[0]
    # "to approve" is its live state, written as its run gives the worker back, a moment after the request.
    eventually(
        lambda: coordinator.snapshot(approval.root_id)[approval.task_id].state == "waiting_approval",
        "the child's run to give its worker back",
    )
    time.sleep(3.0)  # redraws with the request shown (the view redraws at least every second; a loaded host later)
    assert coordinator.decide(approval.id, "approve").status == "approved"
    follower.join(WAIT_S)
    run = result["run"]
    assert run.returncode == 0, run.stderr
    screen = ANSI.sub("", run.stdout)
    lines = [line.rstrip() for line in screen.splitlines()]
    assert max(len(line) for line in lines) <= COLUMNS, "a line is wider than the terminal"
    assert f"subq approve {approval.id}" in screen, "the approval's command was shown while it waited"
    assert "to approve" in screen
    root_id = run.stdout.splitlines()[0]
    final = coordinator.get_task(root_id)
    # The last frame: one status per task, each item's figures whole, the tree's total.
    last = screen[screen.rindex(f"Tree {root_id}") :]
    assert f"total {final.total_tokens} tokens, ${final.total_cost_micros / 1e6:.6f}" in last
    rows = [line for line in last.splitlines() if line.lstrip().startswith("[x] ")]
    assert len(rows) == 2
    assert re.search(rf" {STEP_TOKENS} +\$0\.021000$", rows[0]) and re.search(
        rf" {2 * STEP_TOKENS} +\$0\.042000$", rows[1]
    )
    tasks = [line for line in last.splitlines() if re.match(r"^(  )?(-[0-9a-f]{12}|[0-9a-f]{16})  ", line)]
    assert len(tasks) == 3 and all(len(re.findall(r"\bcompleted\b", line)) == 1 for line in tasks)
