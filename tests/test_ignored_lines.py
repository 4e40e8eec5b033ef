"""Lines that look like plan items but do not match the todo grammar are reported to whoever sent them.

The grammar is unchanged (docs/architecture.md, "Todo lists"); `* [ ] x`, `1. [ ] x`,
`[] x` and the like are named with their line number and the line to write instead:
in the agent's tool result, in the API's answer, and on the CLI's stderr.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator import Coordinator, TaskStatus, TodoError
from coordinator.todos import LINE_RE, IgnoredLine, ignored_lines, parse_markdown, parse_update
from tests.agents import agent, call, reply
from tests.helpers import Transport, state
from tests.test_bad_input import NO_TREE
from tests.test_cli import cli

PLAN = "# Q3 report\n* [ ] Collect figures\n[ ] Summarise\n1. [ ] Review\n[] Publish\n- [x] Kick-off\n2) [X] Archive\n"
IGNORED = [
    IgnoredLine(line=2, text="* [ ] Collect figures", suggestion="[ ] Collect figures"),
    IgnoredLine(line=4, text="1. [ ] Review", suggestion="[ ] Review"),
    IgnoredLine(line=5, text="[] Publish", suggestion="[ ] Publish"),
    IgnoredLine(line=7, text="2) [X] Archive", suggestion="[x] Archive"),
]
WAIT_S = 60


def test_each_near_miss_is_named_with_its_line_and_the_line_to_write() -> None:
    assert ignored_lines(PLAN) == IGNORED
    assert [i.content for i in parse_update(PLAN)] == ["Summarise", "Kick-off"]  # the grammar is unchanged
    assert str(IGNORED[0]) == "line 2: '* [ ] Collect figures' is not a todo item; write '[ ] Collect figures'"


@pytest.mark.parametrize(
    ("line", "suggestion"),
    [
        ("+ [ ] x", "[ ] x"), ("3. [-] x", "[-] x"), ("[x]x", "[x] x"), ("[?] x", "[ ] x"), ("+ [ ]", "[ ] <what to do>"),
        ("- [ ]", "[ ] <what to do>"), ("*  [  x  ]  x", "[x] x"), ("[\t] x", "[ ] x"), ("[~]x", "[-] x"),
    ],
)  # fmt: skip
def test_more_near_misses(line: str, suggestion: str) -> None:
    assert ignored_lines(line) == [IgnoredLine(line=1, text=line.strip(), suggestion=suggestion)]


@pytest.mark.parametrize(
    "text",
    ["prose", "see [link](url)", "[1] a footnote", "[TODO] a tag", "- [ ] fine", "[x] done", '[{"content": "json"}]'],
)
def test_lines_that_are_items_or_plainly_not_are_not_reported(text: str) -> None:
    assert ignored_lines(text) == []


@given(st.text(alphabet=" \t-*+.)1[]xX~?ab", max_size=12))
def test_no_line_the_grammar_reads_is_reported_and_every_suggestion_is_read(line: str) -> None:
    reported = ignored_lines(line)
    if LINE_RE.match(line.strip()):
        assert reported == []
    for ignored in reported:
        assert len(parse_markdown(ignored.suggestion)) == 1


def test_a_plan_of_near_misses_only_is_refused_naming_them() -> None:
    with pytest.raises(TodoError) as caught:
        parse_update("* [ ] a\n1. [ ] b\n[] c\n+ [ ] d")
    assert str(caught.value) == (
        "The todo update has no items: line 1: '* [ ] a' is not a todo item; write '[ ] a'; "
        "line 2: '1. [ ] b' is not a todo item; write '[ ] b'; line 3: '[] c' is not a todo item; write '[ ] c'; "
        "and 1 more (the list was left unchanged)"
    )


def test_a_long_line_of_spaces_is_read_once() -> None:
    """No backtracking over a run of spaces: 200k of them are read in well under a second."""
    import time

    started = time.perf_counter()
    assert ignored_lines("* [" + " " * 200_000 + "y\n[" + " " * 200_000 + "]") != []
    assert time.perf_counter() - started < 0.5


# -- the senders: an agent's tool result, the API's answer, the CLI ------------------------


def test_the_agent_is_told_in_its_tool_result(coordinator: Coordinator) -> None:
    root = coordinator.create_task(agent(call("update_todo_list", todos=PLAN), reply("planned")), run=True)
    assert coordinator.wait(root.id, WAIT_S).status == TaskStatus.COMPLETED
    results = [
        str(part["content"])
        for message in coordinator.messages(root.id, kind="api")
        for part in message["parts"]
        if part.get("part_kind") == "tool-return"
    ]
    assert len(results) == 1
    for ignored in IGNORED:
        assert f"\nNot read as an item: {ignored}" in results[0]


def test_the_api_answers_with_the_ignored_lines(live_http: httpx.Client) -> None:
    created = live_http.post("/v1/tasks", json={"prompt": "p", "todos": PLAN})
    assert created.status_code == 201, created.text
    assert [IgnoredLine.model_validate(i) for i in created.json()["ignored_todo_lines"]] == IGNORED
    task_id = created.json()["id"]
    updated = live_http.put(f"/v1/tasks/{task_id}/todos", json={"todos": "[ ] one\n1. [ ] two"})
    assert updated.status_code == 200, updated.text
    assert updated.json()["ignored_lines"] == [{"line": 2, "text": "1. [ ] two", "suggestion": "[ ] two"}]
    clean = live_http.put(f"/v1/tasks/{task_id}/todos", json={"todos": [{"content": "json"}]})
    assert clean.json()["ignored_lines"] == []


def test_the_cli_warns_on_stderr_over_redis_and_the_api(idle_coordinator: Coordinator, transport: Transport) -> None:
    env = transport.env(idle_coordinator.settings)
    run = cli("run", "p", "--todos", "-", env=env, stdin=PLAN)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [f"subq: warning: --todos {ignored}" for ignored in IGNORED]
    assert [i.content for i in idle_coordinator.get_todos(run.stdout.strip())] == ["Summarise", "Kick-off"]
    before = state(idle_coordinator, NO_TREE)
    refused = cli("run", "p", "--todos", "-", env=env, stdin="* [ ] a\n")
    assert refused.returncode == 1 and refused.stderr == (
        "subq: The todo update has no items: line 1: '* [ ] a' is not a todo item; write '[ ] a' "
        "(the list was left unchanged)\n"
    )
    assert state(idle_coordinator, NO_TREE) == before
