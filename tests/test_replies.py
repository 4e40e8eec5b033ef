"""A script's reply is read by name: no code outside the protocol table unpacks one by position.

Each script's raw reply (a Lua table) is read by index in coordinator/store/protocol.py's `decode`
and nowhere else; what it decodes to is a named type of coordinator/replies.py (a frozen
dataclass, which cannot be unpacked) or a plain value. An AST walk over coordinator/ and workers/
finds any tuple target, or index, taken straight from a script's call.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import types
import typing
from pathlib import Path
from typing import Any, Union

import pytest

from coordinator import replies
from coordinator.store import protocol
from coordinator.store.protocol import CALLS

ROOT = Path(__file__).resolve().parent.parent
SOURCE = sorted([*ROOT.joinpath("coordinator").rglob("*.py"), *ROOT.joinpath("workers").rglob("*.py")])
# The one module that reads a raw reply by position.
PROTOCOL = "coordinator/store/protocol.py"
# The calls whose value is a script's reply (raw or decoded): `self.scripts(Call(...))`, `Call.decode(raw)`.
REPLY_CALLS = {"scripts", "decode"}


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_reply_call(node: ast.AST | None) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr in REPLY_CALLS) or (
        isinstance(func, ast.Name) and func.id in REPLY_CALLS
    )


def positional_reads(tree: ast.AST) -> list[int]:
    """The lines where a script's reply is unpacked into a tuple target, or indexed, straight from its call."""
    found: list[int] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        value: ast.AST | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            targets, value = [node.target], node.iter
        elif isinstance(node, ast.NamedExpr):
            targets, value = [node.target], node.value
        if _is_reply_call(value) and any(isinstance(t, ast.Tuple | ast.List | ast.Starred) for t in targets):
            found.append(getattr(node, "lineno", 0) or getattr(value, "lineno", 0))
        if isinstance(node, ast.Subscript) and _is_reply_call(node.value):
            found.append(node.lineno)
    return found


@pytest.mark.parametrize("path", [p for p in SOURCE if _name(p) != PROTOCOL], ids=_name)
def test_no_code_outside_the_protocol_reads_a_reply_by_position(path: Path) -> None:
    lines = positional_reads(ast.parse(path.read_text(encoding="utf-8")))
    assert lines == [], f"{_name(path)} reads a script's reply by position at lines {lines}: name it in replies.py"


def test_the_walk_finds_what_it_must() -> None:
    caught = """
a, b = self.scripts(X())
first = self.scripts(X())[0]
for x, y in Y.decode(raw): pass
(c, d) = scripts(Z())
"""
    assert sorted(positional_reads(ast.parse(caught))) == [2, 3, 4, 5]
    named = """
reply = self.scripts(X())
wait_ms = reply.wait_ms
a, b = other(X())
"""
    assert positional_reads(ast.parse(named)) == []


def _members(annotation: Any) -> list[Any]:
    """An annotation's alternatives (a union's members), each with its own arguments."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


@pytest.mark.parametrize("script", sorted(CALLS))
def test_no_script_decodes_to_a_tuple(script: str) -> None:
    """A decoded reply is a plain value, a list of them, or a named type that cannot be unpacked."""
    call = CALLS[script]
    if "decode" not in call.__dict__:
        return  # only other scripts call it
    hints = typing.get_type_hints(call.decode, vars(protocol))
    for member in _members(hints["return"]):
        origin = typing.get_origin(member) or member
        assert origin is not tuple, f"{script}.lua decodes to a tuple: name its fields in coordinator/replies.py"
        if inspect.isclass(origin):
            assert not issubclass(origin, tuple), f"{script}.lua decodes to {origin.__name__}, a tuple"


def test_every_reply_type_is_a_frozen_dataclass() -> None:
    for name in replies.__all__:
        kind = getattr(replies, name)
        if not inspect.isclass(kind):
            continue  # the view names
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen, name  # type: ignore[attr-defined]
        assert not issubclass(kind, tuple), name
