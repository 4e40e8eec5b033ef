"""Rendering task trees and todo lists as text, for the CLI."""

from __future__ import annotations

from collections.abc import Iterator

from coordinator.models import format_usd
from coordinator.tree import TreeNode

__all__ = ["MARKS", "cut", "describe", "render_tree", "unlinked_line", "walk"]

MARKS = {"pending": "[ ]", "in_progress": "[-]", "completed": "[x]"}
# Wide enough to tell tasks apart, narrow enough that a tree line fits a terminal.
DESCRIPTION_CHARS = 48
TODO_CHARS = 40


def render_tree(node: TreeNode, notes: dict[str, str] | None = None) -> list[str]:
    """An indented tree: each task with own/total figures, its todo items under it, then its children."""
    return [_task_line(node, notes), *_below(node, "", notes or {})]


def _below(node: TreeNode, prefix: str, notes: dict[str, str]) -> list[str]:
    inner = prefix + ("|   " if node.children else "    ")
    lines = [f"{inner}error: {node.error}"] if node.error else []
    width = min(max((len(i.content) for i in node.todos), default=0), TODO_CHARS)
    for item in node.todos:
        link = f"  -> {item.subtask_id}" if item.subtask_id else ""
        lines.append(
            f"{inner}{MARKS[item.status.value]} {cut(item.content, width):<{width}}  "
            f"{item.tokens:>8} tokens  {format_usd(item.cost_micros):>10}{link}"
        )
    if node.unlinked_tokens or node.unlinked_cost_micros:
        lines.append(unlinked_line(inner, node.unlinked_tokens, node.unlinked_cost_micros))
    for index, child in enumerate(node.children):
        last = index == len(node.children) - 1
        lines.append(f"{prefix}{'`-- ' if last else '|-- '}{_task_line(child, notes)}")
        lines += _below(child, prefix + ("    " if last else "|   "), notes)
    return lines


def _task_line(node: TreeNode, notes: dict[str, str] | None) -> str:
    note = f"  {notes[node.id]}" if notes and node.id in notes else ""
    return (
        f"{node.id}  {node.status.value}  {describe(node)}  "
        f"own {node.tokens} tokens {format_usd(node.cost_micros)}, "
        f"total {node.total_tokens} tokens {format_usd(node.total_cost_micros)}{note}"
    )


def unlinked_line(indent: str, tokens: int, cost_micros: int) -> str:
    """The line under a plan for its children's spend that no row carries, so the rows add up."""
    return f"{indent}    unlinked spend (no row of the plan)  {tokens:>8} tokens  {format_usd(cost_micros):>10}"


def walk(node: TreeNode) -> Iterator[TreeNode]:
    yield node
    for child in node.children:
        yield from walk(child)


def describe(node: TreeNode) -> str:
    first = (node.description.strip().splitlines() or [""])[0]
    return repr(cut(first, DESCRIPTION_CHARS))


def cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"
