"""What the read commands print, and `subq run --follow`'s live view.

The commands import this module when they run: it loads the pydantic models
(coordinator.models, coordinator.tree), which `subq --help` does without.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import typer

from coordinator.audit import AuditEntry
from coordinator.cli.backend import watch as open_watch
from coordinator.cli.common import say
from coordinator.deadletters import DeadLetter
from coordinator.inputs import visible_text
from coordinator.models import (
    MICROS_PER_USD,
    HistoryItem,
    LiveState,
    StopHold,
    TaskRecord,
    TaskStatus,
    TodoItem,
    finishing_if_known,
    format_usd,
)
from coordinator.tenants import TenantState
from coordinator.tree import MARKS, cut, describe, metadata_line, render_tree, waiting_note, walk

if TYPE_CHECKING:
    from rich.text import Text

    from coordinator.cli.backend import Watch
    from coordinator.operations import Operations
    from coordinator.tree import TreeNode

__all__ = [
    "dead_letter_lines",
    "follow_run",
    "history_lines",
    "status_lines",
    "tenant_lines",
    "timeline_text",
    "todo_lines",
]

# Long descriptions and todo items are cut so one task stays on one line.
HISTORY_TASK_CHARS = 50
# A dead letter's reason is one line; the whole of it is in --json.
DEAD_LETTER_REASON_CHARS = 160
# A live view redraws on every event of the tree's stream and at least this often:
# a safety net, so an event trimmed from the capped stream cannot freeze the view.
FOLLOW_POLL_MS = 1000


def follow_run(coord: Operations, root_id: str) -> int:
    """A live view of the tree until the root ends; 0 if it completed, else 1.

    After a stop, the last draw waits for the stopped runs to record their late spend (`StopHold`), so the
    figures it leaves on screen are final. It redraws on every event of the tree's stream (each model
    response of any task publishes its live state there) and at least every FOLLOW_POLL_MS. On
    a terminal it is a rich table redrawn in place (coordinator/cli/live.py);
    otherwise (a pipe, a log) it prints one line per task whose live state
    changed, then the final tree.
    """
    watch = open_watch(coord, root_id)
    try:
        if sys.stdout.isatty():
            node = _follow_on_terminal(coord, root_id, watch)
        else:
            node = _follow_as_lines(coord, root_id, watch)
    except KeyboardInterrupt:
        say(f"subq: stopped following; the run goes on (subq tree {root_id})", err=True)
        return 130
    finally:
        watch.close()
    if node.status != TaskStatus.COMPLETED:
        say(f"subq: run {root_id} {node.status.value}: {node.error or 'no detail'}", err=True)
        return 1
    return 0


def _follow_on_terminal(coord: Operations, root_id: str, watch: Watch) -> TreeNode:
    from rich.console import Console
    from rich.live import Live

    from coordinator.cli.live import tree_view

    footer = visible_text(f"Ctrl-C stops following; the run goes on (subq tree {root_id}).")
    # Redrawn when the tree changes, not on a timer: auto_refresh would redraw an unchanged view.
    held = False
    with Live(console=Console(), auto_refresh=False, vertical_overflow="visible") as view:
        while True:
            node = coord.tree(root_id)
            waiting = [] if node.status.terminal else coord.list_approvals(root_id)
            live = coord.snapshot(root_id)
            ending = "" if node.status.terminal else footer
            view.update(tree_view(node, live, waiting, width=view.console.width, footer=ending), refresh=True)
            if node.status.terminal and (held or not node.status.stopped):
                return node
            held = _next_draw(coord, node, watch)


def _follow_as_lines(coord: Operations, root_id: str, watch: Watch) -> TreeNode:
    """One line per task whose status changed, then a blank line and the final tree."""
    from coordinator.cli.live import task_status

    shown: dict[str, str] = {}
    held = False
    while True:
        node = coord.tree(root_id)
        live = coord.snapshot(root_id)
        for task in walk(node):
            state = live.get(task.id)
            line = f"{task.id}  {describe(task)}  {task_status(task, state)}{_live_note(state)}"
            if shown.get(task.id) != line:
                shown[task.id] = line
                say(f"  {line}")
        if node.status.terminal and (held or not node.status.stopped):
            break
        held = _next_draw(coord, node, watch)
    typer.echo("")
    say("\n".join(render_tree(node)))
    return node


def _next_draw(coord: Operations, node: TreeNode, watch: Watch) -> bool:
    """Wait for the view's next draw. True when that draw is its last: the root ended after a stop, and its
    stopped runs have recorded their late spend (`StopHold`, asking only /finishing while it holds), so the
    figures of the tree read next are final. A retry meanwhile shows as the root running again."""
    if not node.status.terminal:
        watch.wait(FOLLOW_POLL_MS / 1000)
        return False
    hold = StopHold(math.inf)
    while hold.due() and hold.holds(finishing_if_known(coord.finishing_runs, node.id, hold.among)):
        time.sleep(hold.look_in_s())
    return True


def _live_note(state: LiveState | None) -> str:
    """A task's progress besides its status: requests so far, the tool it called last, its cost so far."""
    if state is None:
        return ""
    requests = f"{state.requests} request{'' if state.requests == 1 else 's'}"
    tool = f", tool {state.tool}" if state.tool else ""
    why = f": {state.reason}" if state.reason else ""
    waiting = f", waiting for {state.waiting_for}{why}" if state.waiting_for else ""
    return f"  ({requests}{tool}, {format_usd(state.cost_micros)}{waiting})"


def status_lines(record: TaskRecord) -> list[str]:
    """`subq status`: status, place in the tree, own and total figures, children, error."""
    waiting = waiting_note(record.waiting_for)
    lines = [f"{record.id}  {record.status.value}{waiting}  depth {record.depth}  profile {record.profile}"]
    if record.parent_id:
        lines.append(f"  parent {record.parent_id}  todo {record.todo_id or '-'}")
    if record.metadata:
        lines.append(f"  metadata: {metadata_line(record.metadata)}")
    lines += [
        f"  own:   {record.tokens} tokens  {format_usd(record.cost_micros)}",
        f"  total: {record.total_tokens} tokens  {format_usd(record.total_cost_micros)}",
        *(
            [f"  unlinked: {record.unlinked_tokens} tokens  {format_usd(record.unlinked_cost_micros)}"]
            if record.unlinked_tokens or record.unlinked_cost_micros
            else []
        ),
        f"  children: {len(record.child_ids)} ({len(record.awaiting_ids)} awaited)",
    ]
    if record.error:
        lines.append(f"  error: {record.error_class}: {record.error}")
    return lines


def todo_lines(items: Sequence[TodoItem], unlinked_tokens: int = 0, unlinked_cost_micros: int = 0) -> list[str]:
    """`subq todos`: one line per item, with its subtask's figures when it has one, then any unlinked spend."""
    lines = []
    for item in items:
        linked = f"  ({item.subtask_id}: {item.tokens} tokens, {format_usd(item.cost_micros)})"
        figures = linked if item.subtask_id else ""
        lines.append(f"{MARKS[item.status.value]} {item.content}{figures}")
    if unlinked_tokens or unlinked_cost_micros:
        lines.append(
            f"unlinked spend (no row of the plan): {unlinked_tokens} tokens, {format_usd(unlinked_cost_micros)}"
        )
    return lines


def history_lines(items: Sequence[HistoryItem]) -> list[str]:
    """`subq history`: a header and one line per task."""
    lines = [
        f"{'#':>5}  {'id':29}  {'status':9}  {'depth':>5}  "
        f"{'own cost':>10}  {'total tokens':>12}  {'total cost':>10}  task"
    ]
    for item in items:
        subtree_micros = item.subtree_cost_micros
        if subtree_micros is None:  # an older server's item
            subtree_micros = round(item.subtree_cost * MICROS_PER_USD)
        first_line = (item.task.strip().splitlines() or [""])[0]
        lines.append(
            f"{item.number:>5}  {item.id:29}  {item.status.value:9}  {item.depth:>5}  "
            f"{format_usd(item.total_cost_micros):>10}  {item.total_tokens:>12}  {format_usd(subtree_micros):>10}  "
            f"{cut(first_line, HISTORY_TASK_CHARS)}"
        )
    return lines


def _of(used: int, limit: int) -> str:
    return f"{used}/{limit}" if limit else f"{used}"


def tenant_lines(states: Sequence[TenantState]) -> list[str]:
    """`subq tenants`: a header and one line per tenant, each figure against its quota (`used/quota`; none: no
    quota), spend in US dollars; a tenant the table does not name (the `*` policy) is marked `*`."""
    lines = [f"{'tenant':24}  {'running':>7}  {'waiting':>7}  {'roots':>7}  {'submits/min':>11}  spend today"]
    for s in states:
        p = s.policy
        # A day's spend is counted only against a quota (coordinator/quotas.py `count_spend`): none, "-".
        spend = (
            f"{format_usd(s.spent_micros_day)} / {format_usd(p.max_cost_micros_per_day)}"
            if p.max_cost_micros_per_day
            else "-"
        )
        name = s.tenant if s.listed else f"{s.tenant} *"
        lines.append(
            f"{cut(name, 24):24}  {_of(s.running, p.max_running):>7}  {s.waiting:>7}  "
            f"{_of(s.roots_running, p.max_running_roots):>7}  {_of(s.submits_last_minute, p.submits_per_minute):>11}  {spend}"
        )
    return lines


def dead_letter_lines(entries: Sequence[DeadLetter]) -> list[str]:
    """`subq dead-letters`: one line each, the time (UTC), the reason, then where it came from."""
    lines = []
    for entry in entries:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.ts))
        reason = cut(" ".join(entry.reason.split()), DEAD_LETTER_REASON_CHARS)
        # Its task name and id are the broken message's own headers, anyone's words: one line each, as its reason.
        task, task_id = (" ".join((value or "-").split()) or "-" for value in (entry.task, entry.id))
        lines.append(f"{when}Z  {reason}  (queue {' '.join(entry.queue.split())}, task {task}, id {task_id})")
    return lines


def audit_lines(entries: Sequence[AuditEntry]) -> list[str]:
    """`subq audit`: one line each, the time (UTC), who, what, the target, from where; a refusal's reason."""
    lines = []
    for entry in entries:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.ts))
        why = " ".join(part for part in (entry.reason, entry.detail) if part)
        who = entry.actor or "-"
        line = f"{when}Z  {who}  {entry.action}  {entry.target}  (from {entry.address or '-'} via {entry.via})"
        lines.append(line + (f"  {cut(' '.join(why.split()), DEAD_LETTER_REASON_CHARS)}" if why else ""))
    return lines


# -- `subq tree --timeline`: the tree as bars on one time axis ------------------------------

# How each state is drawn: a character (read without colour too: a pipe, a log) and a rich style.
TIMELINE_GLYPHS = {
    "queued": (".", "grey50"),
    "running": ("#", "green"),
    "wait:children": ("~", "blue"),
    "wait:approval": ("A", "magenta"),
    "wait:admission": ("S", "yellow"),
    "wait:rate_limit": ("R", "red"),
    "wait:tool_limit": ("T", "dark_orange"),
    "wait:provider": ("P", "red3"),
    # A failed task until a person retried it (retry.lua turns its `failed` mark into this wait).
    "wait:retry": ("F", "bright_red"),
}
# A label takes at most this share of the width, and at most this many columns.
TIMELINE_LABEL_SHARE = 0.35
TIMELINE_LABEL_CHARS = 44
# The length column: `12 m 05 s` fits.
TIMELINE_LENGTH_CHARS = 10


def timeline_text(node: TreeNode, width: int, now_ms: int | None = None) -> Text:
    """The tree as one bar per task on one time axis, `width` columns wide: each column is the state
    the task was in then (TIMELINE_GLYPHS), the critical path starred, each task's wall time at the end."""
    from rich.text import Text

    from coordinator.timeline import critical_path, held_longest, times_of
    from coordinator.tree import duration

    now = int(time.time() * 1000) if now_ms is None else now_ms
    nodes = list(walk(node))
    times = {n.id: times_of(n.timeline, now) for n in nodes}
    starts = [t.queued_at_ms for t in times.values() if t.queued_at_ms is not None]
    t0 = min(starts) if starts else now
    t1 = max([now if t.ended_at_ms is None else t.ended_at_ms for t in times.values()] + [t0 + 1])
    span_ms = t1 - t0
    label_chars = min(TIMELINE_LABEL_CHARS, int(width * TIMELINE_LABEL_SHARE))
    bar_chars = max(1, width - label_chars - TIMELINE_LENGTH_CHARS - 2)
    critical = set(critical_path(nodes))
    out = Text(no_wrap=True, overflow="crop")
    end_label = duration(span_ms)
    axis = "0 s".ljust(max(0, bar_chars - len(end_label))) + end_label
    out.append(f"{'task':<{label_chars}} {axis[:bar_chars]}\n", style="bold")
    for task in nodes:
        star = "*" if task.id in critical else " "
        first_line = visible_text((task.description.strip().splitlines() or [""])[0])  # a model's: escapes as text
        # Below the top, an id's last part tells the tasks of one tree apart (they share the root's).
        shown_id = task.id if task is node else "-" + task.id.rsplit("-", 1)[-1]
        label = cut(f"{star}{'  ' * (task.depth - node.depth)}{shown_id} {first_line}", label_chars)
        out.append(f"{label:<{label_chars}} ")
        columns: list[str] = [" "] * bar_chars
        for interval in times[task.id].intervals:
            state = interval.state if interval.reason is None else f"wait:{interval.reason}"
            end_ms = interval.end_ms if interval.end_ms is not None else now
            first = int((interval.start_ms - t0) / span_ms * bar_chars)
            last = max(first + 1, round((end_ms - t0) / span_ms * bar_chars))
            for col in range(max(0, first), min(bar_chars, last)):
                columns[col] = state
        for col_state in columns:
            glyph, style = TIMELINE_GLYPHS.get(col_state, (" ", ""))
            out.append(glyph, style=style)
        ended = times[task.id].outcome
        out.append(f" {duration(times[task.id].wall_ms):>{TIMELINE_LENGTH_CHARS - 1}}", style="bold" if ended else "")
        out.append("\n")
    held = held_longest(nodes, {i: t.ended_at_ms if t.ended_at_ms is not None else now for i, t in times.items()})
    if held is not None:
        what = f"waiting: {held.interval.reason}" if held.interval.reason else held.interval.state
        out.append(f"held longest by {held.task_id}, {what}: {duration(held.interval.ms)}\n", style="bold")
    legend = " ".join(f"{glyph} {state.removeprefix('wait:')}" for state, (glyph, _) in TIMELINE_GLYPHS.items())
    out.append(f"{legend} * critical path", style="dim")
    return out
