"""A profile's MCP servers (workers/runtime/mcp_servers.py): checked at start, one per worker process, guarded.

The server is a real one nobody here wrote: mcp-server-git (the `dev` extra), on
a git repository of the test's, started through `sh` so that each start leaves
its pid in a file (tests/mcp_kit.py). The runs go through real worker processes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator import ConfigError, Coordinator, Profile, Settings, TaskStatus
from coordinator.local.fleet import settings_env
from coordinator.settings import McpServer
from tests.agents import agent, call, reply
from tests.conftest import dedicated_fleet
from tests.helpers import assert_worker_refuses, eventually
from tests.mcp_kit import START_S, server, started
from workers import observe
from workers.runtime import mcp_servers
from workers.runtime.mcp_servers import checked_tools, hinted_verdict, needs_decision_by_hint
from workers.runtime.profile_tools import check, load_profile

ROOT = Path(__file__).resolve().parent.parent
GIT_TOOLS = {"git_status", "git_log", "git_add", "git_commit", "git_reset", "git_diff", "git_show", "git_branch"}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def _repository(folder: Path) -> Path:
    """A git repository with one file committed."""
    folder.mkdir(parents=True, exist_ok=True)
    _git(folder, "init", "-q")
    _git(folder, "config", "user.email", "tests@example.invalid")
    _git(folder, "config", "user.name", "subq tests")
    (folder / "README.md").write_text("hello\n")
    _git(folder, "add", "README.md")
    _git(folder, "commit", "-q", "-m", "first commit")
    return folder


def _git_server(name: str, repo: Path, pids: Path, **extra: Any) -> McpServer:
    command, args = server(pids, repo)
    return McpServer(name=name, command=command, args=args, **{"timeout_s": START_S, **extra})


def _settings(settings: Settings, **profiles: Profile) -> Settings:
    return settings.model_copy(update={"profiles": {**settings.profiles, **profiles}})


def _commits(repo: Path) -> int:
    return int(_git(repo, "rev-list", "--count", "HEAD"))


def _results(coord: Coordinator, task_id: str) -> list[Any]:
    messages = [json.loads(m) for m in coord.store.records.conversation(task_id)]
    return [p["content"] for m in messages for p in m.get("parts", []) if p.get("part_kind") == "tool-return"]


# --- the check: in this process, as a worker's start runs it ---


def test_a_servers_tools_join_the_profile_with_their_source(settings: Settings, tmp_path: Path) -> None:
    repo = _repository(tmp_path / "repo")
    pids = tmp_path / "pids"
    plain = Profile(mcp_servers=[_git_server("git", repo, pids)])
    prefixed = Profile(mcp_servers=[_git_server("git", repo, pids, prefix="repo")], allowed_tools=["repo_git_s*"])
    own = _settings(settings, plain=plain, prefixed=prefixed)
    sources = load_profile("plain", own).sources
    assert {tool for tool, source in sources.items() if source == "mcp:git"} >= GIT_TOOLS
    assert sources["update_todo_list"] == "subq"
    assert load_profile("prefixed", own).sources == {"repo_git_status": "mcp:git", "repo_git_show": "mcp:git"}
    assert len(started(pids)) == 2, "each check started the server once (and stopped it)"
    for pid in started(pids):
        eventually(lambda pid=pid: not Path(f"/proc/{pid}").exists(), f"the checked server {pid} stopped", 15)


def test_a_servers_stderr_is_logged_as_visible_lines_not_written_to_the_workers(
    settings: Settings, tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A server's stderr (an argument a model chose, echoed in an error) went to the worker's own: an escape
    sequence reached the operator's terminal, and a line of the server's could read as a JSON record of the
    worker's. Each line is a log record now, shown through the worker's handlers (one visible line, or JSON)."""
    repo = _repository(tmp_path / "repo")
    command, args = server(tmp_path / "pids", repo)
    hostile = r"""printf '\033]0;pwned\007title\n{"level": "INFO", "message": "forged"}\n' >&2"""
    noisy = McpServer(name="git", command=command, args=["-c", f"{hostile}; {args[1]}"], timeout_s=START_S)
    caplog.set_level("INFO", logger=mcp_servers.__name__)
    assert load_profile("noisy", _settings(settings, noisy=Profile(mcp_servers=[noisy]))).sources

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("mcp server stderr: ")]

    eventually(lambda: len(lines()) >= 2, "the server's two lines were logged", 15)
    assert lines()[:2] == [
        "mcp server stderr: \x1b]0;pwned\x07title",
        'mcp server stderr: {"level": "INFO", "message": "forged"}',
    ], lines()
    assert "pwned" not in capfd.readouterr().err, "nothing of the server's reached the process's stderr as it is"
    record = next(r for r in caplog.records if "pwned" in r.getMessage())
    observe.VisibleLineFilter().filter(record)
    assert record.getMessage() == "mcp server stderr: \\x1b]0;pwned\\x07title", "the worker's handlers escape it"


def test_a_servers_stderr_that_never_ends_its_line_is_logged_in_pieces(caplog: pytest.LogCaptureFixture) -> None:
    """A line with no end (a progress bar drawn with CRs, a binary dump) was held in memory whole until one came."""
    read_fd, write_fd = os.pipe()
    caplog.set_level("INFO", logger=mcp_servers.__name__)
    relay = threading.Thread(target=mcp_servers._relay_lines, args=(os.fdopen(read_fd, "rb"),))
    relay.start()
    with os.fdopen(write_fd, "wb") as writer:
        writer.write(b"x" * (mcp_servers.MAX_STDERR_LINE_CHARS * 2 + 10) + b"\r10%\r20%\r\nlast\n")
    relay.join(10)
    said = [r.getMessage().removeprefix("mcp server stderr: ") for r in caplog.records]
    assert [len(line) for line in said[:3]] == [mcp_servers.MAX_STDERR_LINE_CHARS] * 2 + [10], said
    assert said[3:] == ["10%", "20%", "last"], said


# How long each server of the next test waits for the other's start before it gives up.
BARRIER_S = 30


def _waiting_for_each_other(pids: Path, repo: Path, timeout_s: float) -> dict[str, Profile]:
    """Two profiles, each of one server that answers only once the other server has started."""
    command, args = server(pids, repo)
    started_line, exec_line = args[1].split("; ", 1)
    wait = (
        f"for i in $(seq {BARRIER_S * 10}); do [ $(wc -l < {shlex.quote(str(pids))}) -ge 2 ] && break; sleep 0.1; done"
    )
    barrier = ["-c", f"{started_line}; {wait}; [ $(wc -l < {shlex.quote(str(pids))}) -ge 2 ] || exit 1; {exec_line}"]
    return {
        name: Profile(mcp_servers=[McpServer(name="git", command=command, args=barrier, timeout_s=timeout_s)])
        for name in ("first", "second")
    }


def test_a_workers_start_starts_every_profiles_servers_at_once(settings: Settings, tmp_path: Path) -> None:
    """Each server answers only once the other has started: listed one after another, the first would fail."""
    repo = _repository(tmp_path / "repo")
    pids = tmp_path / "pids"
    servers = _waiting_for_each_other(pids, repo, BARRIER_S + START_S)
    tools = check(_settings(settings, **servers))
    for name in servers:
        assert {tool for tool, source in tools[name].sources.items() if source == "mcp:git"} >= GIT_TOOLS
    assert len(started(pids)) == 2


def test_a_workers_start_lists_at_most_list_at_once_servers_at_a_time(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one at a time, the first of two servers that wait for each other is never answered: the bound holds."""
    monkeypatch.setattr(mcp_servers, "LIST_AT_ONCE", 1)
    servers = _waiting_for_each_other(tmp_path / "pids", _repository(tmp_path / "repo"), 2)
    with pytest.raises(ConfigError, match="did not answer initialize within 2s"):
        check(_settings(settings, **servers))


def test_the_servers_hints_decide_where_no_rule_does(tmp_path: Path) -> None:
    repo = _repository(tmp_path / "repo")
    tools = checked_tools("hints", _git_server("git", repo, tmp_path / "pids"))
    assert needs_decision_by_hint(tools["git_reset"]) is True, "destructiveHint"
    assert needs_decision_by_hint(tools["git_log"]) is False, "readOnlyHint"
    assert needs_decision_by_hint(tools["git_commit"]) is None, "neither"
    args = {"repo_path": str(repo)}
    plain = Profile()
    assert hinted_verdict(plain, "git_reset", args, tools["git_reset"]) == "ask", "destructive: asked by default"
    assert hinted_verdict(plain, "git_commit", args, tools["git_commit"]) == "allow"
    allowed = Profile(allow=["git_reset"])
    assert hinted_verdict(allowed, "git_reset", args, tools["git_reset"]) == "allow", "unless a rule allows it"
    gated = Profile(approval_tools=["git_*"])
    assert hinted_verdict(gated, "git_log", args, tools["git_log"]) == "allow", "a glob does not catch a read-only tool"
    assert hinted_verdict(gated, "git_commit", args, tools["git_commit"]) == "ask"
    named = Profile(approval_tools=["git_log"])
    assert hinted_verdict(named, "git_log", args, tools["git_log"]) == "ask", "its own name does"
    denied = Profile(approval_tools=["git_*"], deny=["git_log"])
    assert hinted_verdict(denied, "git_log", args, tools["git_log"]) == "deny"
    # A deny rule wins whatever guards the tool: no approval_tools entry, a read-only hint, an allow rule.
    only_denied = Profile(approval_tools=[], deny=["git_log", "git_commit"], allow=["git_log"])
    assert hinted_verdict(only_denied, "git_log", args, tools["git_log"]) == "deny"
    # The main argument is the schema's first string (git_commit's `repo_path`), whatever order the model wrote the
    # arguments in: given the message first, the rule matched the message, and allowed a commit to another repository.
    assert list(tools["git_commit"].parameters_json_schema["properties"])[:2] == ["repo_path", "message"]
    scoped = Profile(approval_tools=["git_commit"], allow=[f"git_commit:{repo}"])
    reordered = {"message": f"{repo} x", "repo_path": "/etc"}
    assert hinted_verdict(scoped, "git_commit", reordered, tools["git_commit"]) == "ask"
    assert (
        hinted_verdict(scoped, "git_commit", {"message": "m", "repo_path": str(repo)}, tools["git_commit"]) == "allow"
    )
    assert hinted_verdict(only_denied, "git_commit", args, tools["git_commit"]) == "deny"


def _bad_profiles(tmp_path: Path) -> dict[str, tuple[Profile, str]]:
    repo = _repository(tmp_path / "repo")
    pids = tmp_path / "pids"
    return {
        "missing": (
            Profile(mcp_servers=[McpServer(name="ghost", command="no-such-mcp-server-here")]),
            "mcp_servers entry 'ghost': cannot start 'no-such-mcp-server-here': No such file or directory",
        ),
        "mute": (
            Profile(mcp_servers=[McpServer(name="mute", command="sleep", args=["60"], timeout_s=1)]),
            "mcp_servers entry 'mute': did not answer initialize within 1s",
        ),
        "clash": (
            Profile(mcp_servers=[_git_server("git", repo, pids), _git_server("git2", repo, pids)]),
            "mcp_servers entry 'git2': its tool 'git_status' has the same name as a tool of 'mcp:git'",
        ),
        "clash_own": (
            Profile(tools=["tests.mcp_kit:kill_server"], mcp_servers=[_git_server("git", repo, pids, prefix="kill")]),
            "",  # no clash: `kill_git_status` is not `kill_server`
        ),
        "secret": (
            Profile(mcp_servers=[_git_server("git", repo, pids, env={"TOKEN": "${SUBQ_TEST_NOT_SET}"})]),
            "mcp_servers entry 'git': env TOKEN: ${SUBQ_TEST_NOT_SET} is not set in the worker's environment",
        ),
    }


@pytest.mark.parametrize("bad", ["missing", "mute", "clash", "secret"])
def test_a_bad_server_is_one_line_naming_the_profile_and_the_server(
    settings: Settings, tmp_path: Path, bad: str
) -> None:
    profile, why = _bad_profiles(tmp_path)[bad]
    with pytest.raises(ConfigError) as caught:
        load_profile(bad, _settings(settings, **{bad: profile}))
    assert str(caught.value) == f"Invalid profile {bad!r}: {why}"


def test_a_prefix_keeps_a_servers_tools_apart(settings: Settings, tmp_path: Path) -> None:
    profile, _ = _bad_profiles(tmp_path)["clash_own"]
    assert load_profile("own", _settings(settings, own=profile)).sources["kill_git_status"] == "mcp:git"


def test_a_server_with_an_unknown_key_or_two_transports_is_refused() -> None:
    with pytest.raises(ValueError, match=r"mcp server 'git': unknown key 'comand'"):
        Profile.model_validate({"mcp_servers": [{"name": "git", "command": "x", "comand": "y"}]})
    with pytest.raises(ValueError, match=r"mcp server 'git': give exactly one of command"):
        McpServer(name="git", command="x", url="https://example.invalid/mcp")
    with pytest.raises(ValueError, match=r"mcp server 'git': two servers of one profile have this name"):
        Profile(mcp_servers=[McpServer(name="git", command="x"), McpServer(name="git", command="y")])
    with pytest.raises(ValueError, match=r"mcp server 'web': headers are for an HTTP server"):
        McpServer(name="web", command="x", headers={"A": "b"})


def _subq_tools(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", "tools"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_worker_and_subq_tools_refuse_a_bad_server_with_one_line(settings: Settings, tmp_path: Path) -> None:
    own = _settings(
        settings, bad=Profile(mcp_servers=[McpServer(name="mute", command="sleep", args=["60"], timeout_s=1)])
    )
    assert_worker_refuses(
        own, tmp_path, "Invalid profile 'bad': mcp_servers entry 'mute': did not answer initialize within 1s"
    )
    # An unknown key, in the profiles as a worker reads them: one line naming the profile and the server.
    env = {
        **settings_env(settings),
        "SUBQ_PROFILES": json.dumps({"bad": {"mcp_servers": [{"name": "git", "comand": "x"}]}}),
    }
    unknown = _subq_tools(env)
    assert unknown.returncode != 0 and unknown.stderr.count("\n") == 1, unknown.stderr
    assert "(bad.mcp_servers.0)" in unknown.stderr and "mcp server 'git': unknown key 'comand'" in unknown.stderr


def test_a_bad_sandbox_entry_is_refused_naming_the_server() -> None:
    with pytest.raises(
        ValueError, match="mcp server 'git': writable and network confine a sandbox: set sandbox = true"
    ):
        McpServer(name="git", command="mcp-server-git", writable=["/srv"])
    with pytest.raises(ValueError, match="mcp server 'git': every writable folder must be an absolute path"):
        McpServer(name="git", command="mcp-server-git", sandbox=True, writable=["srv"])
    with pytest.raises(ValueError, match="mcp server 'web': sandbox, writable and network are for a stdio server"):
        McpServer(name="web", url="http://127.0.0.1:1/mcp", sandbox=True)


# --- runs on a worker process ---


class Kit:
    def __init__(self, coord: Coordinator, repo: Path, folder: Path, jail: Path | None = None) -> None:
        self.coord, self.repo, self.folder, self.jail = coord, repo, folder, jail or repo

    def pids(self, profile: str) -> Path:
        # The sandboxed server's own folder: the one it may write (the repository beside it is not).
        return self.folder / ("jail" if profile == "gitjail" else "") / f"{profile}.pids"


@pytest.fixture(scope="module")
def kit(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kit]:
    """One worker process whose profiles each have their own mcp-server-git on one repository."""
    folder = tmp_path_factory.mktemp("mcp")
    repo = _repository(folder / "repo")
    probe = Kit(None, repo, folder)  # type: ignore[arg-type]
    probe.pids("gitjail").parent.mkdir()
    # The sandboxed server's repository: outside /tmp, which the sandbox replaces with a /tmp of its own.
    jail = _repository(Path(tempfile.mkdtemp(prefix="subq-mcp-jail-", dir="/var/tmp")) / "repo")

    def git(profile: str, **extra: Any) -> McpServer:
        return _git_server("git", repo, probe.pids(profile), **extra)

    # A read needs no profile of its own: it runs on gitwrite's server (each profile's server is started
    # twice, by the worker's check and by its first run: 1.8 s of CPU a start).
    profiles = {
        "gitwrite": Profile(mcp_servers=[git("gitwrite")], approval_tools=["git_commit"]),
        "gitcount": Profile(mcp_servers=[git("gitcount")]),
        "gitkill": Profile(mcp_servers=[git("gitkill")], tools=["tests.mcp_kit:kill_server"]),
        # In the OS sandbox: it may write only its pid file's folder (the repository is read-only to it).
        "gitjail": Profile(
            mcp_servers=[
                _git_server("git", jail, probe.pids("gitjail"), sandbox=True, writable=[probe.pids("gitjail").parent])
            ]
        ),
    }
    os.environ["MCP_KIT_PIDS"] = str(probe.pids("gitkill"))  # the worker inherits it
    try:
        own = _settings(settings, **profiles)
        with dedicated_fleet(own, folder / "logs", 1, queue="subq-mcp") as (coord, _fleet):
            yield Kit(coord, repo, folder, jail)
    finally:
        del os.environ["MCP_KIT_PIDS"]
        shutil.rmtree(jail.parent, ignore_errors=True)


def test_a_subagent_calls_a_read_tool_and_gets_its_real_output(kit: Kit) -> None:
    task = kit.coord.create_task(
        agent(call("git_log", repo_path=str(kit.repo), max_count=5), reply("read the log")),
        profile="gitwrite",
        run=True,
    )
    assert kit.coord.wait(task.id, 60).status == TaskStatus.COMPLETED
    (log,) = _results(kit.coord, task.id)
    assert log.startswith("Commit history:") and "Message: first commit" in log
    assert _git(kit.repo, "rev-parse", "HEAD") in log


def test_a_write_waits_for_a_decision_while_a_sibling_goes_on_and_then_runs_once(kit: Kit) -> None:
    coord, repo = kit.coord, kit.repo
    before = _commits(repo)
    (repo / "notes.txt").write_text("a note\n")
    root = coord.create_task("Commit the notes, and tell me the status.")
    writer = agent(
        call("git_add", repo_path=str(repo), files=["notes.txt"]),
        call("git_commit", repo_path=str(repo), message="add the notes"),
        reply("committed"),
        text="Commit the notes.",
    )
    reader = agent(call("git_status", repo_path=str(repo)), reply("status read"), text="Read the status.")
    batch = coord.delegate(
        root.id,
        [
            {"description": "commit", "message": writer, "profile": "gitwrite"},
            {"description": "status", "message": reader, "profile": "gitwrite"},
        ],
    )
    writing, reading = batch.child_ids
    approvals = eventually(lambda: coord.list_approvals(root.id), "the commit waits for a decision", 60)
    (approval,) = approvals
    assert (approval.tool, approval.args) == ("git_commit", {"repo_path": str(repo), "message": "add the notes"})
    assert coord.wait(reading, 60).status == TaskStatus.COMPLETED, "the sibling went on"
    assert not coord.get_task(writing).status.terminal, "the writer still waits"
    assert _commits(repo) == before, "nothing was committed before the decision"
    coord.decide(approval.id, "approve")
    assert coord.wait(writing, 60).status == TaskStatus.COMPLETED
    assert _commits(repo) == before + 1, "the approved commit was made once"
    assert _git(repo, "log", "-1", "--format=%s").strip() == "add the notes"
    assert any(str(r).startswith("Changes committed successfully") for r in _results(coord, writing))


def test_one_server_per_worker_process_for_all_its_runs(kit: Kit) -> None:
    coord, pids = kit.coord, kit.pids("gitcount")
    checked = started(pids)
    assert len(checked) == 1, "the worker's start checked the server once"
    repo = str(kit.repo)
    script = [call("git_status", repo_path=repo), call("git_branch", repo_path=repo, branch_type="local")]
    tasks = [coord.create_task(agent(*script, reply(f"child {n}")), profile="gitcount", run=True) for n in range(50)]
    for task in tasks:
        assert coord.wait(task.id, 120).status == TaskStatus.COMPLETED
        status, branches = _results(coord, task.id)
        assert status.startswith("Repository status:") and "* " in branches, (status, branches)
    after = started(pids)
    assert len(after) == 2, f"50 runs started one server between them: {after}"
    assert Path(f"/proc/{after[-1]}").exists(), "and it is still running for the next run"


def test_a_killed_server_is_restarted_and_its_caller_gets_an_error(kit: Kit) -> None:
    coord, pids, repo = kit.coord, kit.pids("gitkill"), kit.repo
    task = coord.create_task(
        agent(
            call("git_status", repo_path=str(repo)),
            call("kill_server"),
            call("git_status", repo_path=str(repo)),
            reply("the server died under me"),
        ),
        profile="gitkill",
        run=True,
    )
    assert coord.wait(task.id, 60).status == TaskStatus.COMPLETED, "not a crashed run"
    first, killed, after = _results(coord, task.id)
    assert first.startswith("Repository status:")
    assert killed == f"killed {started(pids)[1]}"
    assert after.startswith("Error: MCP server 'git' ") and "restart" in after, after
    eventually(lambda: len(started(pids)) == 3, "the server was started again", 30)
    again = coord.create_task(agent(call("git_status", repo_path=str(repo)), reply("ok")), profile="gitkill", run=True)
    assert coord.wait(again.id, 60).status == TaskStatus.COMPLETED
    assert _results(coord, again.id)[0].startswith("Repository status:")
    assert len(started(pids)) == 3, "one restart"


def test_a_sandboxed_server_reads_but_writes_only_where_its_entry_says(kit: Kit) -> None:
    coord, repo = kit.coord, kit.jail
    before = _commits(repo)
    (repo / "jailed.txt").write_text("a change\n")
    steps = (
        call("git_log", repo_path=str(repo), max_count=1),
        call("git_add", repo_path=str(repo), files=["jailed.txt"]),
        reply("tried"),
    )
    task = coord.create_task(agent(*steps), profile="gitjail", run=True)
    assert coord.wait(task.id, 60).status == TaskStatus.COMPLETED
    log, added = _results(coord, task.id)
    assert log.startswith("Commit history:") and _git(repo, "rev-parse", "HEAD") in log, "it reads the repository"
    assert "Read-only file system" in str(added), added
    assert _git(repo, "status", "--porcelain", "jailed.txt").startswith("??"), "nothing was staged"
    assert _commits(repo) == before
    pids = started(kit.pids("gitjail"))  # the worker's start check ran it once, the run again
    assert pids and all(pid < 10 for pid in pids), "its pids are its own namespace's: it sees no worker process"
