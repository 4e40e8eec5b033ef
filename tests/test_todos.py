"""Tests of the todo-list grammar, ids and stored form (coordinator/todos.py).

Merging and linking are tests/test_todo_links.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import time
from collections import defaultdict

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coordinator import todos
from coordinator.errors import CorruptError, TodoError
from coordinator.models import TodoItem, TodoStatus
from coordinator.todos import (
    from_json,
    normalise,
    parse_json_items,
    parse_markdown,
    parse_update,
    render_markdown,
    to_json,
    todo_id,
)

PENDING, IN_PROGRESS, COMPLETED = TodoStatus.PENDING, TodoStatus.IN_PROGRESS, TodoStatus.COMPLETED
EXAMPLES = settings(max_examples=200, deadline=None)

# Contents as the grammar can carry them: one line, trimmed, showing something, UTF-8.
contents = (
    st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), min_size=1, max_size=20)
    .map(todos.clean_content)
    .filter(todos.visible)
)
# A small alphabet so that generated lists often hold duplicates.
short_contents = st.sampled_from(["a", "b", "c", "a  b", "fix tests"])
statuses = st.sampled_from(list(TodoStatus))


def item(
    content: str,
    status: TodoStatus = PENDING,
    occurrence: int = 0,
    subtask_id: str | None = None,
    tokens: int = 0,
    cost_micros: int = 0,
    prior: tuple[str, ...] = (),
    prior_tokens: int = 0,
    prior_cost_micros: int = 0,
) -> TodoItem:
    """An item with the id the grammar gives it, built without going through the parser."""
    return TodoItem(
        id=todo_id(content, occurrence),
        content=content,
        status=status,
        subtask_id=subtask_id,
        tokens=tokens,
        cost_micros=cost_micros,
        prior_subtask_ids=prior,
        prior_tokens=prior_tokens,
        prior_cost_micros=prior_cost_micros,
    )


def ids_for(texts: list[str]) -> list[str]:
    """The ids a list of these contents should get, numbered by occurrence."""
    seen: dict[str, int] = defaultdict(int)
    ids: list[str] = []
    for text in texts:
        ids.append(todo_id(text, seen[normalise(text)]))
        seen[normalise(text)] += 1
    return ids


# --- normalise and ids -------------------------------------------------------------


def test_normalise_collapses_whitespace_and_keeps_case() -> None:
    assert normalise("  Fix \t the\n  Tests ") == "Fix the Tests"


def test_todo_id_is_twelve_hex_of_sha256_over_content_and_occurrence() -> None:
    expected = hashlib.sha256(b"write docs\x001").hexdigest()[:12]
    assert todo_id("  write   docs ", 1) == expected
    assert todo_id("write docs", 0) != expected


@EXAMPLES
@given(st.lists(st.tuples(contents, statuses, statuses), min_size=1, max_size=8))
def test_ids_are_stable_across_status_changes(
    rows: list[tuple[str, TodoStatus, TodoStatus]],
) -> None:
    before = [item(content, first) for content, first, _ in rows]
    after = [item(content, second) for content, _, second in rows]
    parsed_before = parse_markdown(render_markdown(before))
    parsed_after = parse_markdown(render_markdown(after))
    assert [x.id for x in parsed_before] == [x.id for x in parsed_after]


@EXAMPLES
@given(st.lists(short_contents, min_size=1, max_size=12))
def test_duplicates_get_distinct_ids(texts: list[str]) -> None:
    parsed = parse_markdown("\n".join(f"[ ] {text}" for text in texts))
    assert len({x.id for x in parsed}) == len(texts)
    assert [x.id for x in parsed] == ids_for(texts)


def test_ids_ignore_whitespace_but_not_case() -> None:
    first, second, third = parse_markdown("[ ] Fix  tests\n[x] Fix tests\n[ ] fix tests")
    assert first.id != second.id  # same normalised content: occurrence 0 and 1
    assert second.id == todo_id("Fix tests", 1)
    assert third.id == todo_id("fix tests", 0)


# --- markdown ----------------------------------------------------------------------


def test_markdown_marks_and_bullets() -> None:
    text = "- [ ] one\n-[x] two\n[X] three\n  - [-] four\n[~] five\n[ x ] six"
    parsed = parse_markdown(text)
    assert [(x.content, x.status) for x in parsed] == [
        ("one", PENDING),
        ("two", COMPLETED),
        ("three", COMPLETED),
        ("four", IN_PROGRESS),
        ("five", IN_PROGRESS),
        ("six", COMPLETED),
    ]


def test_markdown_ignores_lines_that_do_not_match() -> None:
    text = "\n".join(
        [
            "# Plan",
            "[] no mark",
            "[ ]no space",
            "[y] bad mark",
            "* [ ] star bullet",
            "1. [ ] numbered",
            "[ ]   ",
            "prose",
            "[ ] kept",
        ]
    )
    assert [x.content for x in parse_markdown(text)] == ["kept"]


def test_markdown_accepts_crlf_and_trims_content() -> None:
    parsed = parse_markdown("[ ]   first  \r\n[x] second\r\n\r\n")
    assert [(x.content, x.status) for x in parsed] == [("first", PENDING), ("second", COMPLETED)]


def test_markdown_ends_a_line_at_a_lone_cr_too() -> None:
    """A producer that joins lines with CR alone: its plan was one item, `Collect [ ] Summarise`, and nobody was
    told. Each line is an item now; a line break inside an item's text (U+2028) is still its text."""
    parsed = parse_markdown("[ ] Collect figures\r[-] Summarise\r\r[x] Send\u2028it")
    assert [(x.content, x.status) for x in parsed] == [
        ("Collect figures", PENDING),
        ("Summarise", IN_PROGRESS),
        ("Send\u2028it", COMPLETED),
    ]
    assert [line.line for line in todos.ignored_lines("[ ] ok\r* [ ] starred")] == [2]


@pytest.mark.parametrize("unseen", ["\ufeff", "\u200b", "\u200b\ufeff ", " \u2060"])
def test_markdown_reads_a_line_behind_a_byte_order_mark_or_a_zero_width_space(unseen: str) -> None:
    """A file a Windows editor saved starts with a byte-order mark; a pasted line may hold a zero-width space. Not
    whitespace to `str.strip`, either hid the line's box: the item was dropped, and nobody was told."""
    parsed = parse_markdown(f"{unseen}[ ] first{unseen}\n{unseen}[x] second")
    assert [(x.content, x.status) for x in parsed] == [("first", PENDING), ("second", COMPLETED)]
    assert parse_update(f"{unseen}[ ] first") == parse_update("[ ] first"), "the same item, the same id"


def test_an_item_of_a_character_this_python_does_not_know_yet_counts_as_visible() -> None:
    """A newer emoji (U+1FA77, Unicode 15: unassigned to this Python's 14) may show: the item stands."""
    assert [item.content for item in parse_update("[ ] \U0001fa77")] == ["\U0001fa77"]


@pytest.mark.parametrize("content", ["\u202e", "\u202e\u200b", "\u200d\u2066", "\u3164\u3164", "\ufe0f\u034f"])
def test_an_item_with_no_visible_text_is_refused_in_either_form(content: str) -> None:
    """A bidi override or a zero-width character alone made an item no one could read (a whole list of one, put
    in place of the plan); the JSON form's blank content was refused already, and now so is this."""
    with pytest.raises(TodoError, match=r"line 2 is an item with no visible text .*the list was left unchanged"):
        parse_markdown(f"[ ] kept\n[ ] {content}")
    with pytest.raises(TodoError, match=r"Todo item 1 has no visible content") as refused:
        parse_update([{"content": "kept"}, {"content": content}])
    assert refused.value.field == "todos.1.content"


@pytest.mark.parametrize(
    ("update", "cause"),
    [
        ('[{"content": "a"}', "Expecting ',' delimiter: line 1 column 18 (char 17)"),
        ('{"content": "a"}', "it is an object"),
        ('["a", ]', "Expecting value"),
        ("[" * 5000 + "]" * 4999, "nested too deep"),
    ],
)
def test_an_update_that_starts_as_json_but_does_not_parse_says_why(update: str, cause: str) -> None:
    """It was read as markdown with no items, and refused for that alone: the cause, a JSON error, went unsaid."""
    with pytest.raises(TodoError, match="it reads as the JSON form but is not a JSON list: ") as refused:
        parse_update(update)
    assert cause in refused.value.message and refused.value.message.endswith("(the list was left unchanged)")


def test_render_writes_canonical_marks_one_per_line() -> None:
    items = [item("a"), item("b", IN_PROGRESS), item("c", COMPLETED)]
    assert render_markdown(items) == "[ ] a\n[-] b\n[x] c"


@EXAMPLES
@given(st.lists(st.tuples(contents, statuses), min_size=1, max_size=10))
@example([("a\u2028b\x85c  d", PENDING), ("- [x] nested", COMPLETED)])
def test_parse_render_round_trip(rows: list[tuple[str, TodoStatus]]) -> None:
    items = [TodoItem(id="x", content=content, status=status) for content, status in rows]
    rendered = render_markdown(items)
    parsed = parse_markdown(rendered)
    assert [(x.content, x.status) for x in parsed] == rows
    assert render_markdown(parsed) == rendered


@pytest.mark.parametrize("update", ["", "   \n", "just prose\r\nno boxes", "[]", " [ ] "])
def test_update_with_no_item_is_rejected(update: str) -> None:
    with pytest.raises(TodoError) as caught:
        parse_update(update)
    assert caught.value.field == "todos"
    assert "has no items" in caught.value.message
    assert "left unchanged" in caught.value.message


# --- JSON form ---------------------------------------------------------------------


def test_json_form_list_and_text() -> None:
    rows: list[object] = [
        {"content": " write  docs ", "status": "in_progress"},
        {"content": "ship"},
        {"content": "write docs", "status": "completed"},
    ]
    expected = [("write  docs", IN_PROGRESS), ("ship", PENDING), ("write docs", COMPLETED)]
    for parsed in (parse_json_items(rows), parse_json_items(json.dumps(rows)), parse_update(rows)):
        assert [(x.content, x.status) for x in parsed] == expected
        assert parsed[0].id == todo_id("write docs", 0)
        assert parsed[2].id == todo_id("write docs", 1)


def test_json_content_line_breaks_become_spaces() -> None:
    (parsed,) = parse_json_items([{"content": "first line\r\n  second\n"}])
    assert parsed.content == "first line second"
    assert parse_markdown(render_markdown([parsed])) == [parsed]


def test_json_content_lone_surrogate_is_replaced_so_it_can_be_stored() -> None:
    (parsed,) = parse_update('[{"content": "a\\ud800b"}]')
    assert parsed.content == "a?b"
    to_json([parsed]).encode("utf-8")


@pytest.mark.parametrize(
    ("update", "message", "field"),
    [
        (
            [{"content": "a"}, {"content": "b"}, {"status": "pending"}],
            "Todo item 2 has no content",
            "todos.2.content",
        ),
        ([{"content": "a"}, {"content": " \n "}], "Todo item 1 has no content", "todos.1.content"),
        ([{"content": None}], "Todo item 0 has no content", "todos.0.content"),
        ([{"content": 7}], "Todo item 0 content must be text, got a number", "todos.0.content"),
        (
            [{"content": "a", "status": "done"}],
            "Todo item 0 has an invalid status 'done' (expected pending, in_progress or completed)",
            "todos.0.status",
        ),
        (
            [{"content": "a"}, {"content": "b", "status": 1}],
            "Todo item 1 has an invalid status 1",
            "todos.1.status",
        ),
        (
            [{"content": "a"}, {"content": "b", "owner": "me"}],
            "Todo item 1 has unknown key(s) 'owner' (expected content, status)",
            "todos.1.owner",
        ),
        ([{"content": "a"}, "b"], "Todo item 1 must be an object", "todos.1"),
        ([{"content": "a"}, None], "Todo item 1 must be an object", "todos.1"),
        ([], "The todo update has no items", "todos"),
    ],
)
def test_json_errors_name_the_item(update: list[object], message: str, field: str) -> None:
    with pytest.raises(TodoError) as caught:
        parse_json_items(update)
    assert caught.value.message.startswith(message)
    assert caught.value.field == field
    # The same list sent as text is reported the same way.
    with pytest.raises(TodoError) as caught_text:
        parse_update(json.dumps(update))
    assert (caught_text.value.message, caught_text.value.field) == (caught.value.message, field)


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ('{"content": "a"}', "The todo update must be a list of items, got an object"),
        ("[{", "The todo update is not valid JSON"),
        ("null", "The todo update must be a list of items, got null"),
    ],
)
def test_json_text_that_is_not_a_list(update: str, message: str) -> None:
    with pytest.raises(TodoError) as caught:
        parse_json_items(update)
    assert caught.value.message.startswith(message)
    assert caught.value.field == "todos"


def test_parse_update_routes_each_form() -> None:
    # Starts with "[" but is not JSON: markdown.
    assert [x.content for x in parse_update("[ ] a\n[x] b")] == ["a", "b"]
    assert [x.content for x in parse_update('  [{"content": "j"}]  ')] == ["j"]
    # A JSON list of non-objects goes to the JSON form and fails there.
    with pytest.raises(TodoError, match="Todo item 0 must be an object"):
        parse_update("[1, 2]")


def test_parse_update_accepts_a_tuple_as_the_json_form() -> None:
    assert [x.content for x in parse_update(({"content": "t"},))] == ["t"]


@pytest.mark.parametrize("update", [None, 42, {"content": "a"}, b"[ ] a", bytearray(b"[]")])
def test_parse_update_rejects_other_types(update: object) -> None:
    with pytest.raises(TodoError) as caught:
        parse_update(update)  # type: ignore[arg-type]
    assert caught.value.message.startswith("The todo update must be markdown text or a list")
    assert caught.value.field == "todos"


def test_parsing_does_not_mutate_the_json_input() -> None:
    rows: list[object] = [{"content": "  a\nb ", "status": "completed"}, {"content": "c"}]
    before = copy.deepcopy(rows)
    parse_update(rows)
    assert rows == before


# --- stored form -------------------------------------------------------------------


stored_rows = st.lists(
    st.tuples(
        contents,
        statuses,
        st.none() | st.text(max_size=5),
        st.integers(0, 10**12),
        st.lists(st.text(max_size=5), max_size=3).map(tuple),
    ),
    max_size=6,
)


@EXAMPLES
@given(stored_rows)
def test_json_store_round_trip(rows: list[tuple[str, TodoStatus, str | None, int, tuple[str, ...]]]) -> None:
    items = [
        TodoItem(
            id=todo_id(c, n),
            content=c,
            status=s,
            subtask_id=sub,
            tokens=t,
            cost_micros=t,
            prior_subtask_ids=prior,
            prior_tokens=t // 2,
            prior_cost_micros=t // 3,
        )
        for n, (c, s, sub, t, prior) in enumerate(rows)
    ]
    text = to_json(items)
    assert from_json(text) == items
    assert from_json(text.encode()) == items  # as Redis returns it without decoding
    assert todos.from_hash(todos.to_hash(items)) == items
    keys = {"id", "content", "status", "subtask_id", "tokens", "cost_micros"}
    keys |= {"prior_subtask_ids", "prior_tokens", "prior_cost_micros"}
    assert all(set(raw) == keys for raw in json.loads(text))


def test_stored_items_without_prior_figures_read_as_no_earlier_child() -> None:
    # Written before items had prior figures.
    (old,) = from_json('[{"id": "1", "content": "a", "subtask_id": "c1", "tokens": 3, "cost_micros": 4}]')
    assert (old.prior_subtask_ids, old.prior_tokens, old.prior_cost_micros) == ((), 0, 0)
    assert (old.subtask_id, old.tokens, old.cost_micros) == ("c1", 3, 4)


def test_an_empty_prior_list_that_lua_wrote_as_an_object_reads_as_empty() -> None:
    # Lua cjson encodes an empty array as {}, so a script that decodes and re-encodes an item writes that.
    (item,) = from_json('[{"id": "1", "content": "a", "prior_subtask_ids": {}}]')
    assert item.prior_subtask_ids == ()
    with pytest.raises(CorruptError) as caught:
        from_json('[{"id": "1", "content": "a", "prior_subtask_ids": {"c1": 1}}]')
    assert caught.value.field == "todos.0.prior_subtask_ids"


@pytest.mark.parametrize("text", ["{}", "[]", " {} "])
def test_from_json_empty_forms(text: str) -> None:
    assert from_json(text) == []


@pytest.mark.parametrize(
    ("text", "message", "field"),
    [
        ("", "The stored todo list is not valid JSON", "todos"),
        (b"\xff[]", "The stored todo list is not valid JSON", "todos"),
        ('{"a": 1}', "The stored todo list is an object, not an array", "todos"),
        ('"x"', "The stored todo list is a string, not an array", "todos"),
        ("null", "The stored todo list is null, not an array", "todos"),
        (
            '[{"id": "1", "content": "a"}, {"content": "b"}]',
            "The stored todo item 1 is corrupt: todos.1.id",
            "todos.1.id",
        ),
        (
            '[{"id": "1", "content": "a", "tokens": -1}]',
            "The stored todo item 0 is corrupt: todos.0.tokens",
            "todos.0.tokens",
        ),
        (
            '[{"id": "1", "content": "a", "x": 1}]',
            "The stored todo item 0 is corrupt: todos.0.x",
            "todos.0.x",
        ),
        ("[1]", "The stored todo item 0 is corrupt: todos.0", "todos.0"),
    ],
)
def test_from_json_corrupt_is_a_store_error(text: str | bytes, message: str, field: str) -> None:
    with pytest.raises(CorruptError) as caught:
        from_json(text)
    assert caught.value.message.startswith(message)
    assert caught.value.field == field


# -- linear time on long runs (a plan is untrusted input: an API body of up to 1 MiB) ------------

BODY_LIMIT_CHARS = 1 << 20
# CPU time, which other processes' load does not stretch (a wall-clock bound could fail on a busy host).
LINEAR_BUDGET_CPU_S = 1.0


def _old_clean(content: str) -> str:
    """The substitution the cleaning replaced (quadratic on a run of spaces with no line break after it)."""
    return re.sub(r"\s*[\r\n]+\s*", " ", content).strip()


# The todo grammar as upstream writes it; LINE_RE reads the same lines in linear time.
UPSTREAM_LINE_RE = re.compile(r"^(?:-\s*)?\[\s*([ xX\-~])\s*\]\s+(.+)$")


@given(st.text(alphabet=" \t\x0b\u00a0\u2028-[]xX~?ab", max_size=16))
def test_the_item_grammar_reads_every_line_as_upstream_does(line: str) -> None:
    upstream, ours = UPSTREAM_LINE_RE.match(line), todos.LINE_RE.match(line)
    assert (upstream is None) == (ours is None)
    if upstream and ours:
        # A box of spaces: upstream's mark is one of them, ours is none; both are "pending".
        assert (ours.group(1) or " ", ours.group(2)) == (upstream.group(1), upstream.group(2))


@pytest.mark.parametrize("line", ["[ ] a", "[  ] a", "[ x ] a", "[\t ] a", "[ \t-] a", "- [~]  a", "-[X] a"])
def test_the_item_grammar_examples(line: str) -> None:
    upstream, ours = UPSTREAM_LINE_RE.match(line), todos.LINE_RE.match(line)
    assert upstream and ours and (ours.group(1) or " ", ours.group(2)) == upstream.groups()


@pytest.mark.parametrize("line", ["[] a", "[\t] a", "[x x] a", "[ ]a", "* [ ] a", "[ ]"])
def test_lines_that_are_not_items_for_either(line: str) -> None:
    assert UPSTREAM_LINE_RE.match(line) is None and todos.LINE_RE.match(line) is None


@given(st.text(alphabet=" \t\r\n\x0b\x0c\u00a0\u2028ab-[]x", max_size=40))
def test_cleaning_an_item_keeps_its_meaning(content: str) -> None:
    assert todos.clean_content(content) == _old_clean(content)


@pytest.mark.parametrize(
    "text",
    [
        "[ ] a" + " " * BODY_LIMIT_CHARS + "b",
        "[ ]" + " " * BODY_LIMIT_CHARS + "x",
        "-" + " " * BODY_LIMIT_CHARS + "[ ] x",
        "[" + " " * BODY_LIMIT_CHARS,
        "[ ] x" + " \n" * (BODY_LIMIT_CHARS // 2),
        "[ ] x\r" + "\t" * BODY_LIMIT_CHARS + "\r\ny",
        "[[[[" * (BODY_LIMIT_CHARS // 4),
        "[" + " " * BODY_LIMIT_CHARS + "x",
        "- [" + " \t" * (BODY_LIMIT_CHARS // 2) + "x] y",
    ],
    ids=[
        "spaces inside",
        "spaces after the box",
        "spaces after the dash",
        "open box",
        "blank lines",
        "tabs",
        "brackets",
        "spaces before a mark",
        "spaces and tabs in the box",
    ],
)
def test_parsing_is_linear_in_a_long_run(text: str) -> None:
    started_cpu_s = time.process_time()
    try:
        todos.parse_update(text)
    except TodoError:
        pass  # refusing is fine; taking long is not
    assert time.process_time() - started_cpu_s < LINEAR_BUDGET_CPU_S
