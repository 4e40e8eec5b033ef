"""Which row of a plan a child's cost shows on: across a rewrite (`merge`) and a delegation (`link_children`).

A row's figures are its link (`subtask_id`), what it shows (`tokens`,
`cost_micros`) and what earlier children on the same row spent (`prior_*`).
They belong to one row at a time and are never zeroed, copied or mixed with
another row's: a rewrite moves them onto a row of the new list, or hands them
back as orphans, which the store keeps as the parent's unlinked spend. Every
rule, with examples: docs/todo-links.md.

Pure functions: they return new lists and never change their arguments.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict, deque
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from coordinator.errors import TodoError
from coordinator.models import TodoItem, TodoStatus
from coordinator.text import shown_value
from coordinator.todos import clean_content, normalise, todo_id, with_ids

__all__ = ["Merged", "link_children", "merge"]


@dataclass(frozen=True, slots=True)
class Merged:
    """A rewrite's outcome: the new list, and the old rows whose figures found no row in it.

    Each orphan is the old row as it was. Its `tokens` and `cost_micros` (which
    include its prior figures) belong in the parent's unlinked spend; its child,
    if not written back yet, is now linked to no row, so its totals go there too
    when it is.
    """

    items: list[TodoItem]
    orphans: list[TodoItem]


def merge(old: Sequence[TodoItem], new: Sequence[TodoItem]) -> Merged:
    """`new`, with ids recomputed and each old row's figures on one new row, or orphaned.

    A new row keeps its own content and status. The figures of an old row go to
    the new row found by the first rule that applies:

    1. the new row that names the same `subtask_id`;
    2. a new row with the same normalised content, copies in order. When the
       new list has fewer copies of a line than the old one, the old copies
       that carry figures are continued first, so an unlinked copy never takes
       a linked copy's place;
    3. for an old row that carries figures and matched nothing (reworded or
       dropped), a free new row: one with no figures that matched no old row
       (a new or reworded line), else one that continues an unlinked old row.
       Among those, the first at or after the old row's index, else the last
       before it. Old rows are placed in list order.

    An old row that carries figures and finds no row is an orphan.
    """
    fresh = with_ids([(item.content, item.status) for item in new])
    fresh = [f.model_copy(update=_figures(n)) if _carries(n) else f for f, n in zip(fresh, new, strict=True)]
    source = _continued_rows(old, fresh)
    orphans = _place_vanished(old, fresh, source)
    items = [f if i is None else f.model_copy(update=_figures(old[i])) for f, i in zip(fresh, source, strict=True)]
    return Merged(items, orphans)


def link_children(
    items: Sequence[TodoItem],
    children: Sequence[tuple[str, str | None, str]],
    awaiting: Collection[str] = (),
) -> tuple[list[TodoItem], list[str]]:
    """Link each `(child_id, todo_id or None, description)` to one item, in order.

    An explicit `todo_id` wins, even on a row linked to an earlier child (a retry
    of that plan item): the row's figures so far become its prior figures and
    its earlier child joins `prior_subtask_ids`, so the row still shows them. A
    row whose current child is in `awaiting` (the parent's children not yet
    written back) is refused: two children in flight on one row would mix.
    Otherwise the first unlinked in-progress item, then the first unlinked
    pending one; with none left, `[-] <description>` is appended. Returns the
    new list and, per child, the id of its item.
    """
    result = list(items)
    # Explicit ids are claimed first, so an automatic pick for an earlier spec
    # never takes the item a later spec names (which would then be rejected).
    explicit = _named_rows(result, children, frozenset(awaiting))
    claimed = set(explicit.values())
    linked: list[str] = []
    # Built once, so linking n children to n rows is linear, not a scan of the list per child.
    free = _free_rows(result)
    occurrences = Counter(normalise(item.content) for item in result)
    for n, (child_id, _wanted, description) in enumerate(children):
        index = explicit.get(n)
        if index is None:
            index = _auto_pick(free, claimed)
        if index is None:
            index = _append_row(result, occurrences, n, description)
        claimed.add(index)
        result[index] = _relinked(result[index], child_id)
        linked.append(result[index].id)
    return result, linked


def _named_rows(
    items: Sequence[TodoItem], children: Sequence[tuple[str, str | None, str]], in_flight: Collection[str]
) -> dict[int, int]:
    """Per child that names a `todo_id`, the index of its row: refused (naming `subtasks.N.todo_id`) for an
    unknown id, one named by two children, or a row whose current child has not been written back."""
    index_of: dict[str, int] = {}
    for position, item in enumerate(items):
        index_of.setdefault(item.id, position)
    explicit: dict[int, int] = {}
    named: set[int] = set()
    for n, (_child_id, wanted, _description) in enumerate(children):
        if wanted is None:
            continue
        index = index_of.get(wanted)
        field = f"subtasks.{n}.todo_id"
        if index is None:
            raise TodoError(f"Unknown todo_id {shown_value(wanted)}", field=field)
        if index in named:
            raise TodoError(f"todo_id {shown_value(wanted)} is used by two subtasks", field=field)
        current = items[index].subtask_id
        if current is not None and current in in_flight:
            raise TodoError(
                f"todo_id {wanted!r} is linked to child {current}, which has not finished: "
                "name this item again once it has",
                field=field,
            )
        explicit[n] = index
        named.add(index)
    return explicit


def _append_row(result: list[TodoItem], occurrences: Counter[str], n: int, description: str) -> int:
    """Appends `[-] <description>` for child `n`, which found no row, and returns its index.

    `occurrences` counts each normalised line, so a repeated description gets the next copy's id."""
    content = clean_content(description)
    if not content:
        raise TodoError(f"Subtask {n} has no description to add as a todo item", field=f"subtasks.{n}.description")
    key = normalise(content)
    result.append(TodoItem(id=todo_id(content, occurrences[key]), content=content, status=TodoStatus.IN_PROGRESS))
    occurrences[key] += 1
    return len(result) - 1


def _continued_rows(old: Sequence[TodoItem], fresh: Sequence[TodoItem]) -> list[int | None]:
    """Rules 1 and 2: per new row, the index of the old row it continues, if any."""
    source = _continued_by_link(old, fresh)
    given = {i for i in source if i is not None}
    for i, j in _continued_by_content(old, fresh, given):
        source[j] = i
    return source


def _continued_by_link(old: Sequence[TodoItem], fresh: Sequence[TodoItem]) -> list[int | None]:
    """Rule 1: per new row, the old row that names the same child (the first such, each taken once)."""
    source: list[int | None] = [None] * len(fresh)
    given: set[int] = set()
    row_of_child: dict[str, int] = {}
    for i, item in enumerate(old):
        if item.subtask_id is not None:
            row_of_child.setdefault(item.subtask_id, i)
    for j, item in enumerate(fresh):
        found = None if item.subtask_id is None else row_of_child.get(item.subtask_id)
        if found is not None and found not in given:
            source[j] = found
            given.add(found)
    return source


def _continued_by_content(
    old: Sequence[TodoItem], fresh: Sequence[TodoItem], given: Collection[int]
) -> Iterator[tuple[int, int]]:
    """Rule 2: (old row, new row) pairs of the same normalised line, copies in order (_kept_copies), among
    the old rows not `given` by rule 1."""
    old_copies: dict[str, list[int]] = defaultdict(list)
    for i, item in enumerate(old):
        if i not in given:
            old_copies[normalise(item.content)].append(i)
    new_copies: dict[str, list[int]] = defaultdict(list)
    for j, item in enumerate(fresh):
        # A new row with figures of its own (it names its child) is matched by its
        # link alone: another row's figures on it would mix two children's costs.
        if not _carries(item):
            new_copies[normalise(item.content)].append(j)
    for key, copies in new_copies.items():
        yield from zip(_kept_copies(old, old_copies.get(key, []), len(copies)), copies, strict=False)


def _place_vanished(old: Sequence[TodoItem], fresh: Sequence[TodoItem], source: list[int | None]) -> list[TodoItem]:
    """Rule 3: each old row with figures that no new row continues takes a free row (set in `source`).

    Returns the rows that found none, the orphans.
    """
    continued = {i for i in source if i is not None}
    # Free rows of each kind, in index order; a row leaves its list once taken.
    unmatched = [j for j, item in enumerate(fresh) if source[j] is None and not _carries(item)]
    plain = [j for j, i in enumerate(source) if i is not None and not _carries(old[i]) and not _carries(fresh[j])]
    orphans: list[TodoItem] = []
    for i, item in enumerate(old):
        if i in continued or not _carries(item):
            continue
        row = _take_free(unmatched, i)
        if row is None:
            row = _take_free(plain, i)
        if row is None:
            orphans.append(item)
        else:
            source[row] = i
    return orphans


def _relinked(item: TodoItem, child_id: str) -> TodoItem:
    """The row linked to `child_id`, keeping everything earlier children spent on it.

    What the row shows becomes its prior figures, and the new child has spent
    nothing yet, so the row shows the same figures until the child is written
    back (prior + the child's totals). A completed item named again is being
    redone, so it goes back to in progress like any linked item.
    """
    earlier = item.prior_subtask_ids if item.subtask_id is None else (*item.prior_subtask_ids, item.subtask_id)
    return item.model_copy(
        update={
            "subtask_id": child_id,
            "prior_subtask_ids": earlier,
            "prior_tokens": item.tokens,
            "prior_cost_micros": item.cost_micros,
            "status": TodoStatus.IN_PROGRESS,
        }
    )


def _figures(item: TodoItem) -> dict[str, object]:
    """What children wrote onto a row, which moves as one whole with its link."""
    return {
        "subtask_id": item.subtask_id,
        "tokens": item.tokens,
        "cost_micros": item.cost_micros,
        "prior_subtask_ids": item.prior_subtask_ids,
        "prior_tokens": item.prior_tokens,
        "prior_cost_micros": item.prior_cost_micros,
    }


def _carries(item: TodoItem) -> bool:
    """Whether a row holds figures that a rewrite must keep (a link, or spend)."""
    return item.subtask_id is not None or any(
        (item.tokens, item.cost_micros, item.prior_subtask_ids, item.prior_tokens, item.prior_cost_micros)
    )


def _kept_copies(old: Sequence[TodoItem], copies: list[int], room: int) -> list[int]:
    """The old copies of one line that the new list's `room` copies continue, in list order.

    With room for all, every copy (the k-th old copy goes on the k-th new one).
    Otherwise the copies that carry figures come first (the earliest, if even
    they do not all fit), then unlinked ones: which copy the agent deleted is
    unknown, and an unlinked copy has nothing to keep.
    """
    if len(copies) <= room:
        return copies
    carrying = [i for i in copies if _carries(old[i])]
    if len(carrying) >= room:
        return carrying[:room]
    plain = [i for i in copies if not _carries(old[i])]
    return sorted(carrying + plain[: room - len(carrying)])


def _take_free(rows: list[int], index: int) -> int | None:
    """The first of the sorted `rows` at or after `index`, else the last before it; removed from `rows`."""
    if not rows:
        return None
    at = bisect.bisect_left(rows, index)
    return rows.pop(at if at < len(rows) else -1)


# The rows a child without a `todo_id` takes, in this order of preference.
AUTO_PICK_ORDER = (TodoStatus.IN_PROGRESS, TodoStatus.PENDING)


def _free_rows(items: Sequence[TodoItem]) -> dict[TodoStatus, deque[int]]:
    """The unlinked rows of each status an automatic pick takes, in list order."""
    free: dict[TodoStatus, deque[int]] = {status: deque() for status in AUTO_PICK_ORDER}
    for index, item in enumerate(items):
        if item.subtask_id is None and item.status in free:
            free[item.status].append(index)
    return free


def _auto_pick(free: dict[TodoStatus, deque[int]], claimed: set[int]) -> int | None:
    """The first free unlinked in-progress item, else the first free unlinked pending one (taken from `free`)."""
    for status in AUTO_PICK_ORDER:
        rows = free[status]
        while rows:
            index = rows.popleft()
            if index not in claimed:
                return index
    return None
