"""Tests of the todo-list grammar, ids, merge and linking (coordinator/todos.py)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import time
from collections import defaultdict
from random import Random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coordinator import todos
from coordinator.errors import CorruptError, TodoError
from coordinator.models import TodoItem, TodoStatus
from coordinator.todos import (
    from_json,
    link_children,
    merge,
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

# Contents as the grammar can carry them: one line, trimmed, non-empty, UTF-8.
contents = (
    st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), min_size=1, max_size=20)
    .map(str.strip)
    .filter(bool)
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
) -> TodoItem:
    """An item with the id the grammar gives it, built without going through the parser."""
    return TodoItem(
        id=todo_id(content, occurrence),
        content=content,
        status=status,
        subtask_id=subtask_id,
        tokens=tokens,
        cost_micros=cost_micros,
    )


def ids_for(texts: list[str]) -> list[str]:
    """The ids a list of these contents should get, numbered by occurrence."""
    seen: dict[str, int] = defaultdict(int)
    ids: list[str] = []
    for text in texts:
        ids.append(todo_id(text, seen[normalise(text)]))
        seen[normalise(text)] += 1
    return ids


def figures(entry: TodoItem) -> tuple[str | None, int, int]:
    return (entry.subtask_id, entry.tokens, entry.cost_micros)


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


# --- merge -------------------------------------------------------------------------


def test_merge_keeps_figures_across_status_change() -> None:
    old = [item("a", IN_PROGRESS, subtask_id="s1", tokens=10, cost_micros=5), item("b")]
    new = parse_markdown("[x] a\n[-] b")
    old_before, new_before = list(old), list(new)
    merged = merge(old, new)
    assert (old, new) == (old_before, new_before)
    assert [(x.status, figures(x)) for x in merged] == [
        (COMPLETED, ("s1", 10, 5)),
        (IN_PROGRESS, (None, 0, 0)),
    ]
    assert [x.id for x in merged] == [old[0].id, old[1].id]


def test_merge_matches_subtask_id_first() -> None:
    old = [item("a", subtask_id="s1", tokens=1), item("b", subtask_id="s2", tokens=2)]
    # The new item names child s2 but now reads "a": s2's figures, not s1's.
    new = [TodoItem(id="stale", content="a", status=COMPLETED, subtask_id="s2")]
    (merged,) = merge(old, new)
    assert figures(merged) == ("s2", 2, 0)
    assert merged.id == todo_id("a", 0)  # recomputed, not the stale one


def test_merge_new_item_with_unknown_subtask_keeps_its_own_figures() -> None:
    old = [item("a", subtask_id="s1", tokens=1)]
    new = [TodoItem(id="x", content="a", subtask_id="s9", tokens=3)]
    assert figures(merge(old, new)[0]) == ("s9", 3, 0)


def test_merge_by_content_when_the_stored_id_is_stale() -> None:
    # Ids that do not follow the grammar (written by hand or an older version)
    # still match by normalised content, duplicates in order. The items also
    # moved, so the positional rule cannot be what matched them.
    old = [
        TodoItem(id="legacy1", content="write   docs", subtask_id="s1", tokens=4),
        TodoItem(id="legacy2", content="write docs", subtask_id="s2", tokens=5),
        item("b"),
    ]
    merged = merge(old, parse_markdown("[ ] b\n[ ] new\n[x] write docs\n[ ] write  docs"))
    assert [figures(x) for x in merged] == [(None, 0, 0), (None, 0, 0), ("s1", 4, 0), ("s2", 5, 0)]


def test_merge_duplicates_in_order_and_each_old_item_gives_once() -> None:
    old = [item("x", subtask_id="s1"), item("x", occurrence=1, subtask_id="s2")]
    merged = merge(old, parse_markdown("[ ] x\n[ ] x\n[ ] x"))
    assert [x.subtask_id for x in merged] == ["s1", "s2", None]
    merged = merge(old[:1], parse_markdown("[ ] x\n[ ] x"))
    assert [x.subtask_id for x in merged] == ["s1", None]


def test_merge_carries_a_vanished_linked_item_to_the_reworded_line() -> None:
    old = [item("a"), item("draft API", IN_PROGRESS, subtask_id="s1", tokens=9, cost_micros=3)]
    merged = merge(old, parse_markdown("[ ] a\n[-] draft the HTTP API"))
    assert figures(merged[1]) == ("s1", 9, 3)
    assert merged[1].content == "draft the HTTP API"
    assert merged[1].id == todo_id("draft the HTTP API", 0)


def test_merge_editing_the_first_of_two_duplicates_shifts_by_occurrence() -> None:
    # Ids number duplicates in order, so the remaining "x" is occurrence 0 and
    # takes the first "x"'s figures; the second one's land on nothing.
    old = [item("x", subtask_id="s1"), item("x", occurrence=1, subtask_id="s2")]
    merged = merge(old, parse_markdown("[ ] x v2\n[ ] x"))
    assert [x.subtask_id for x in merged] == [None, "s1"]


def test_merge_positional_carry_needs_a_free_unlinked_new_item() -> None:
    old = [item("a", subtask_id="s1"), item("b", subtask_id="s2")]
    # "b" moved to index 0 and matched by id; "c" at index 1 is where "b" was,
    # not where the vanished "a" was, so nothing lands on it.
    merged = merge(old, parse_markdown("[ ] b\n[ ] c"))
    assert [x.subtask_id for x in merged] == ["s2", None]
    # An unlinked old item that vanished carries nothing (it has nothing to carry).
    old = [item("a", tokens=0)]
    assert merge(old, parse_markdown("[ ] z"))[0].subtask_id is None


def test_merge_positional_carry_skips_new_items_with_their_own_link() -> None:
    old = [item("a", subtask_id="s1", tokens=1)]
    new = [TodoItem(id="x", content="z", subtask_id="s7", tokens=7)]
    assert figures(merge(old, new)[0]) == ("s7", 7, 0)


linked_row = st.tuples(short_contents, statuses, st.integers(0, 10**6))
linked_rows = st.lists(linked_row, min_size=1, max_size=8)
unique_linked_rows = st.lists(linked_row, min_size=1, max_size=8, unique_by=lambda row: normalise(row[0]))


def linked_list(rows: list[tuple[str, TodoStatus, int]]) -> list[TodoItem]:
    """Items each linked to its own child `s<n>`, with distinct figures."""
    ids = ids_for([content for content, _, _ in rows])
    return [
        TodoItem(
            id=i,
            content=content,
            status=status,
            subtask_id=f"s{n}",
            tokens=cost,
            cost_micros=cost * 2,
        )
        for n, (i, (content, status, cost)) in enumerate(zip(ids, rows, strict=True))
    ]


@EXAMPLES
@given(linked_rows, st.randoms(use_true_random=False), st.lists(statuses, min_size=8, max_size=8))
def test_merge_survives_reorder_and_status_change(
    rows: list[tuple[str, TodoStatus, int]], rng: Random, new_statuses: list[TodoStatus]
) -> None:
    old = linked_list(rows)
    shuffled = list(old)
    rng.shuffle(shuffled)
    rewritten = [x.model_copy(update={"status": s}) for x, s in zip(shuffled, new_statuses, strict=False)]
    merged = merge(old, parse_markdown(render_markdown(rewritten)))
    assert [(x.content, x.status) for x in merged] == [(x.content, x.status) for x in rewritten]

    # Duplicates are matched in order: the k-th "x" of the new list gets the
    # figures of the k-th "x" of the old list.
    def by_content(items: list[TodoItem]) -> dict[str, list[tuple[str | None, int, int]]]:
        grouped: dict[str, list[tuple[str | None, int, int]]] = defaultdict(list)
        for x in items:
            grouped[normalise(x.content)].append(figures(x))
        return grouped

    assert by_content(merged) == by_content(old)
    assert sorted(x.id for x in merged) == sorted(x.id for x in old)


@EXAMPLES
@given(unique_linked_rows, st.lists(st.booleans(), min_size=8, max_size=8))
def test_merge_survives_edits_in_place(rows: list[tuple[str, TodoStatus, int]], edits: list[bool]) -> None:
    old = linked_list(rows)
    # Edited lines get text no old line has ("#" is outside short_contents).
    new_text = [f"# {x.content} v2" if edit else x.content for x, edit in zip(old, edits, strict=False)]
    merged = merge(old, parse_markdown("\n".join(f"[x] {text}" for text in new_text)))
    assert [x.content for x in merged] == new_text
    assert [figures(x) for x in merged] == [figures(x) for x in old]


@EXAMPLES
@given(linked_rows, st.lists(short_contents, max_size=8))
def test_merge_gives_each_old_item_at_most_once(rows: list[tuple[str, TodoStatus, int]], texts: list[str]) -> None:
    old = linked_list(rows)
    before = list(old)
    merged = merge(old, [TodoItem(id="?", content=text) for text in texts])
    links = [x.subtask_id for x in merged if x.subtask_id is not None]
    assert len(links) == len(set(links))
    assert [x.id for x in merged] == ids_for(texts)
    assert old == before


# --- linking -----------------------------------------------------------------------


def plan(text: str) -> list[TodoItem]:
    return parse_markdown(text)


def test_link_prefers_in_progress_then_pending_and_skips_linked_and_completed() -> None:
    items = plan("[x] done\n[ ] p1\n[-] busy\n[-] i1\n[ ] p2")
    items[2] = items[2].model_copy(update={"subtask_id": "old", "tokens": 5})
    children = [("c1", None, "d1"), ("c2", None, "d2"), ("c3", None, "d3")]
    result, linked = link_children(items, children)
    assert linked == [items[3].id, items[1].id, items[4].id]
    assert [x.subtask_id for x in result] == [None, "c2", "old", "c1", "c3"]
    assert result[2] == items[2]
    assert all(result[k].status == IN_PROGRESS for k in (1, 3, 4))


def test_link_appends_when_no_candidate() -> None:
    items = plan("[x] write docs\n[x] b")
    children = [("c1", None, "  write\ndocs "), ("c2", None, "write docs")]
    result, linked = link_children(items, children)
    assert result[:2] == items
    assert [(x.content, x.status, x.subtask_id) for x in result[2:]] == [
        ("write docs", IN_PROGRESS, "c1"),
        ("write docs", IN_PROGRESS, "c2"),
    ]
    # Occurrences count the completed "write docs" too, so every id stays distinct.
    assert linked == [todo_id("write docs", 1), todo_id("write docs", 2)]
    assert [x.id for x in result[2:]] == linked
    assert render_markdown(result).endswith("[-] write docs\n[-] write docs")


def test_link_appended_item_needs_a_description() -> None:
    with pytest.raises(TodoError) as caught:
        link_children(plan("[x] a"), [("c1", None, "d"), ("c2", None, " \n ")])
    assert caught.value.field == "subtasks.1.description"


def test_explicit_todo_id_wins_and_is_claimed_before_automatic_picks() -> None:
    items = plan("[ ] pending\n[-] busy")
    busy = items[1].id
    # Spec 0 is automatic; without claiming spec 1's explicit id first it would
    # take "busy" and spec 1 would then collide.
    result, linked = link_children(items, [("c1", None, "d1"), ("c2", busy, "d2")])
    assert linked == [items[0].id, busy]
    assert [x.subtask_id for x in result] == ["c1", "c2"]


def test_explicit_todo_id_relinks_completed_or_linked_items_and_resets_figures() -> None:
    items = plan("[x] done\n[-] busy")
    items[1] = items[1].model_copy(update={"subtask_id": "old", "tokens": 5, "cost_micros": 9})
    result, linked = link_children(items, [("c1", items[0].id, "d1"), ("c2", items[1].id, "d2")])
    assert linked == [items[0].id, items[1].id]
    assert [(x.status, figures(x)) for x in result] == [
        (IN_PROGRESS, ("c1", 0, 0)),
        (IN_PROGRESS, ("c2", 0, 0)),
    ]
    assert [x.content for x in result] == ["done", "busy"]


def test_unknown_todo_id_is_rejected_with_its_spec_index() -> None:
    items = plan("[ ] a")
    with pytest.raises(TodoError) as caught:
        link_children(items, [("c1", None, "d"), ("c2", "abc", "d")])
    assert caught.value.message == "Unknown todo_id 'abc'"
    assert caught.value.field == "subtasks.1.todo_id"


def test_same_todo_id_twice_is_rejected_on_the_second_spec() -> None:
    items = plan("[ ] a\n[ ] b")
    before = list(items)
    target = items[1].id
    with pytest.raises(TodoError) as caught:
        link_children(items, [("c1", target, "d"), ("c2", None, "d"), ("c3", target, "d")])
    assert caught.value.message == f"todo_id '{target}' is used by two subtasks"
    assert caught.value.field == "subtasks.2.todo_id"
    assert items == before


child_plans = st.lists(st.tuples(short_contents, statuses, st.booleans()), max_size=8)


@EXAMPLES
@given(child_plans, st.integers(0, 10), st.data())
def test_link_properties(rows: list[tuple[str, TodoStatus, bool]], n_children: int, data: st.DataObject) -> None:
    ids = ids_for([content for content, _, _ in rows])
    items = [
        TodoItem(id=i, content=content, status=status, subtask_id="old" if linked else None)
        for i, (content, status, linked) in zip(ids, rows, strict=True)
    ]
    before = list(items)
    # Some children name an item explicitly (distinct ones), the rest are automatic.
    named = data.draw(st.lists(st.sampled_from(items), unique=True)) if items else []
    wanted_ids: list[str | None] = [x.id for x in named[:n_children]]
    wanted_ids += [None] * (n_children - len(wanted_ids))
    explicit = data.draw(st.permutations(wanted_ids))
    children = [(f"c{n}", wanted, f"task {n}") for n, wanted in enumerate(explicit)]

    result, linked = link_children(items, children)

    assert items == before
    assert len(set(linked)) == n_children  # never two children on one item
    for (child_id, wanted, _), linked_id in zip(children, linked, strict=True):
        target = next(x for x in result if x.id == linked_id)
        assert (target.subtask_id, target.status, target.tokens) == (child_id, IN_PROGRESS, 0)
        if wanted is not None:
            assert linked_id == wanted
    # Automatic picks take free in-progress items first, then pending, in list order.
    free = [x.id for x in items if x.subtask_id is None and x.id not in explicit]
    candidates = [i for i in free if next(x for x in items if x.id == i).status == IN_PROGRESS]
    candidates += [i for i in free if next(x for x in items if x.id == i).status == PENDING]
    automatic = [i for (_, wanted, _), i in zip(children, linked, strict=True) if wanted is None]
    picked = [i for i in automatic if i in {x.id for x in items}]
    assert picked == candidates[: len(picked)]
    appended = len(automatic) - len(picked)
    assert appended == max(0, len(automatic) - len(candidates))
    assert len(result) == len(items) + appended
    untouched = [k for k, x in enumerate(items) if x.id not in linked]
    assert all(result[k] == items[k] for k in untouched)


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
LINEAR_BUDGET_S = 1.0


def _old_clean(content: str) -> str:
    """The substitution the cleaning replaced (quadratic on a run of spaces with no line break after it)."""
    return re.sub(r"\s*[\r\n]+\s*", " ", content).strip()


@given(st.text(alphabet=" \t\r\n\x0b\x0c\u00a0\u2028ab-[]x", max_size=40))
def test_cleaning_an_item_keeps_its_meaning(content: str) -> None:
    assert todos._clean(content) == _old_clean(content)


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
    ],
    ids=[
        "spaces inside",
        "spaces after the box",
        "spaces after the dash",
        "open box",
        "blank lines",
        "tabs",
        "brackets",
    ],
)
def test_parsing_is_linear_in_a_long_run(text: str) -> None:
    started = time.perf_counter()
    try:
        todos.parse_update(text)
    except TodoError:
        pass  # refusing is fine; taking long is not
    assert time.perf_counter() - started < LINEAR_BUDGET_S
