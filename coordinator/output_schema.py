"""Typed results: a task's `output_schema` (JSON Schema), checked before anything is written, and its output.

A task may carry an `output_schema` (its own, else its profile's): it then ends
with `attempt_completion(result, data)`, `data` held to the schema, and the
validated object is the record's `output` (docs/agents.md, "Typed results").
This module is the one place that says what a schema and an output may be:

- `check_schema`: a JSON object of at most MAX_SCHEMA_BYTES as compact JSON,
  nested at most MAX_SCHEMA_DEPTH deep, whose every `$ref` is local (`#...`)
  and resolves, valid under its own metaschema (the draft its `$schema`
  names, else the newest). The error names the path: `output_schema.properties.total.type: ...`.
- `output_errors`: every way an output breaks its schema, each with its path
  (`data.total: 'x' is not of type 'integer'`), and the size bound of an output.
- `completion_parameters`: the parameters of the `attempt_completion` tool a
  typed task's model is given, `data`'s being the task's schema.

Light on purpose (jsonschema and the standard library): the Python client
checks a schema with it before it sends one.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, NoReturn
from urllib.parse import unquote

from pydantic import BeforeValidator, WithJsonSchema

from coordinator.errors import ValidationError as SubqValidationError

if TYPE_CHECKING:
    from jsonschema.exceptions import SchemaError, ValidationError
    from referencing import Registry

__all__ = [
    "MAX_ERRORS_SHOWN",
    "MAX_OUTPUT_BYTES",
    "MAX_OUTPUT_DEPTH",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "NO_RUN_NO_OUTPUT",
    "OutputSchema",
    "SchemaProblem",
    "check_schema",
    "compact",
    "completion_parameters",
    "output_errors",
    "schema_problem",
    "schema_text",
]

# A schema describes a result a program reads (a few fields, a list of rows): 32 KiB of compact
# JSON is a large one. It is sent with every request of its task, so it is bounded like a prompt.
MAX_SCHEMA_BYTES = 32 * 1024
# Deeper than any real result's shape; the bound keeps a hostile schema from exhausting the
# recursive validators (jsonschema's and the provider's).
MAX_SCHEMA_DEPTH = 32
# A caller-owned task (run=false) has no model to hold to a schema: it never ends with data.
NO_RUN_NO_OUTPUT = (
    "output_schema applies to an agent task (run=true): a caller-owned task has no model to hold to it "
    "(give each subtask its own output_schema instead)"
)
# A result, not a data set: the object is kept on the record and handed to the parent's model.
MAX_OUTPUT_BYTES = 64 * 1024
# An output nests no deeper than this: its validation recurses once per level.
MAX_OUTPUT_DEPTH = 64
# How many of an invalid output's errors the model (and the record's error) is told, sorted by path.
MAX_ERRORS_SHOWN = 20


def compact(value: Any) -> str:
    """A JSON value as compact text (no spaces, non-ASCII kept): how a schema and an output are stored."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _path(prefix: str, parts: Iterator[Any] | Any) -> str:
    """`prefix.a.0.b`: a path as the API words one (pydantic's `subtasks.1.message`)."""
    return ".".join([prefix, *(str(part) for part in parts)])


def _too_deep(value: Any, limit: int) -> list[Any] | None:
    """The path of the first place `value` nests deeper than `limit` (objects and arrays), or None."""
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:
        node, where = stack.pop()
        if isinstance(node, Mapping):
            children: list[tuple[Any, Any]] = list(node.items())
        elif isinstance(node, list):
            children = list(enumerate(node))
        else:
            continue
        if len(where) >= limit:
            return where
        stack.extend((child, [*where, key]) for key, child in children)
    return None


# The keywords that name another schema by URI: each must be local (`#...`) and resolve. An unknown one is
# never fetched either way (every validator's registry refuses to retrieve), but a schema is held to
# what it can be validated against: its own document.
REFERENCE_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
# Keywords whose value is data (an instance to compare with), not a schema: nothing in them is a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose value maps names (a property's, a definition's) to schemas: a name is never a keyword.
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)


def _children(node: Mapping[str, Any], where: list[Any]) -> Iterator[tuple[list[Any], Any]]:
    """The schemas directly inside the schema `node` (with their paths): every object or array in it but
    the data of `const`, `enum`, `default` and `examples`; an array's items are schemas (`anyOf`)."""
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            found: Iterator[tuple[Any, Any]] = iter(value.items())
            yield from (([*where, key, name], child) for name, child in found if isinstance(child, Mapping | list))
        elif isinstance(value, Mapping):
            yield [*where, key], value
        elif isinstance(value, list):
            yield from (
                ([*where, key, index], item) for index, item in enumerate(value) if isinstance(item, Mapping | list)
            )


def _subschemas(node: Any, where: list[Any]) -> Iterator[tuple[list[Any], Mapping[str, Any]]]:
    """Every schema object of the document `node`, the root first, each with its path."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            yield from _subschemas(item, [*where, index])
    elif isinstance(node, Mapping):
        yield where, node
        for child_where, child in _children(node, where):
            yield from _subschemas(child, child_where)


def _refs(schema: Mapping[str, Any]) -> Iterator[tuple[list[Any], Any]]:
    """Every reference of a schema (its path, its value), in schema positions only (not in `const` data)."""
    for where, node in _subschemas(schema, []):
        for keyword in REFERENCE_KEYWORDS:
            if keyword in node:
                yield [*where, keyword], node[keyword]


def _target(schema: Mapping[str, Any], ref: str) -> tuple[list[Any], Any] | None:
    """The place (path, value) the local reference `#/a/b` (a JSON pointer, percent-encoded or not) or
    `#name` (an `$anchor`, a `$dynamicAnchor`, a draft-6/7 `$id: "#name"`, a draft-4 `id`) names, or None."""
    fragment = ref[1:]
    if not fragment:
        return [], schema
    if not fragment.startswith("/"):
        name = unquote(fragment)
        return next(
            (
                (where, node)
                for where, node in _subschemas(schema, [])
                if any(node.get(k) in (name, f"#{name}") for k in ("$anchor", "$dynamicAnchor", "$id", "id"))
            ),
            None,
        )
    node: Any = schema
    where: list[Any] = []
    for raw in fragment[1:].split("/"):  # each token percent-decoded, then unescaped (`~1` is `/`)
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node, where = node[part], [*where, part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node, where = node[int(part)], [*where, int(part)]
        else:
            return None
    return where, node


def _no_retrieval(uri: str) -> NoReturn:
    """Every validator's registry retrieves with this: a reference to anything outside the schema fails
    (a validation error of its own), and nothing, on any host, is ever fetched."""
    from referencing.exceptions import NoSuchResource

    raise NoSuchResource(uri)


@functools.cache
def _registry() -> Registry[Any]:
    from referencing import Registry

    # `retrieve` is an attrs alias (of `_retrieve`), which mypy's attrs support does not see.
    return Registry(retrieve=_no_retrieval)  # type: ignore[call-arg]


def schema_problem(schema: object) -> tuple[list[Any], str] | None:
    """What makes `schema` unusable as an output schema (the path inside it, the reason), or None.

    Pure and cheap (no network: a remote `$ref` is refused, never fetched), so every face runs it
    before it writes or sends anything.
    """
    if not isinstance(schema, dict):
        kind = "a string" if isinstance(schema, str) else type(schema).__name__
        return [], f"must be a JSON Schema object, not {kind}"
    deep = _too_deep(schema, MAX_SCHEMA_DEPTH)
    if deep is not None:
        return deep, f"nested deeper than {MAX_SCHEMA_DEPTH} levels"
    try:
        text = compact(schema)
    except (TypeError, ValueError) as exc:  # a value JSON cannot carry (NaN, a non-string key)
        return [], f"not JSON: {exc}"
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        return [], f"{size} bytes as compact JSON; the limit is {MAX_SCHEMA_BYTES}"
    for where, ref in _refs(schema):
        if not isinstance(ref, str):
            continue  # the metaschema says what is wrong with it, below
        if not ref.startswith("#"):
            return where, f"only local references ('#/...') are allowed, not {ref!r}"
        if _target(schema, ref) is None:
            return where, f"{ref!r} names nothing in the schema"
    from jsonschema import validators  # on use: importing the client's models loads no validator
    from jsonschema.exceptions import best_match

    draft = schema.get("$schema")
    if draft is not None and not isinstance(draft, str):
        return ["$schema"], f"must be a string naming a JSON Schema draft, not {type(draft).__name__}"
    cls = validators.validator_for(schema, default=None)
    if cls is None:
        if draft is not None:
            return ["$schema"], f"{draft!r} names no JSON Schema draft this validator knows"
        cls = validators.Draft202012Validator
    # With the format checker: a `pattern` must be a regular expression the validator can compile.
    checker = cls(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER, registry=_registry())
    error = best_match(checker.iter_errors(schema))
    if error is not None:
        return list(error.path), _message(error)
    probes: tuple[object, ...] = (None, {}, [])
    for probe in probes:  # a `$ref` that leads back to itself without end is found before any run
        try:
            any(True for _ in cls(schema, registry=_registry()).iter_errors(probe))
        except RecursionError:
            return [], "its references lead back to themselves without end"
        except Exception as exc:  # the validator could not apply it: it is no schema to hold a model to
            return [], f"cannot be applied: {type(exc).__name__}: {_one_line(str(exc))}"
    return None


def check_schema(schema: object, field: str = "output_schema") -> dict[str, Any]:
    """`schema` if it is a usable output schema, else subq's ValidationError naming the path of the
    problem: `output_schema.properties.total.type: 'strin' is not valid under any of the given schemas`."""
    problem = schema_problem(schema)
    if problem is not None:
        where, reason = problem
        raise SubqValidationError(f"{_path(field, where)}: {reason}", field=field)
    assert isinstance(schema, dict)
    return schema


class SchemaProblem(ValueError):
    """A model field's schema is unusable: `where` inside it, and why. pydantic reports it as a value error
    at the field, which coordinator/inputs.py words as `output_schema.properties.total.type: <reason>`."""

    def __init__(self, where: list[Any], reason: str) -> None:
        super().__init__(reason)
        self.where = ".".join(map(str, where))
        self.reason = reason


def _schema_field(value: object) -> object:
    if value is None:
        return None
    problem = schema_problem(value)
    if problem is not None:
        raise SchemaProblem(*problem)
    return value


OutputSchema = Annotated[
    dict[str, Any] | None,
    BeforeValidator(_schema_field),
    WithJsonSchema(
        {
            "anyOf": [{"type": "object"}, {"type": "null"}],
            "description": (
                "A JSON Schema (an object, at most 32 KiB, local $refs only) the task's result data is held to: "
                "it ends with attempt_completion(result, data), and `data` becomes its record's `output`"
            ),
        }
    ),
]


def _one_line(text: str) -> str:
    """`text` on one line and bounded (a message may quote the offending value whole)."""
    line = " ".join(text.split())
    return line if len(line) <= 300 else line[:299] + "…"


def _message(error: ValidationError | SchemaError) -> str:
    """jsonschema's message, on one line and bounded."""
    return _one_line(str(error.message))


def schema_text(schema: Mapping[str, Any] | None) -> str:
    """A checked schema as it is stored on a task hash (compact JSON), '' for none."""
    return "" if schema is None else compact(schema)


def output_errors(schema: Mapping[str, Any], data: Any, field: str = "data") -> list[str]:
    """Every way `data` breaks `schema` (at most MAX_ERRORS_SHOWN, by path), or the size bound; [] if valid."""
    try:
        size = len(compact(data).encode())
    except (TypeError, ValueError) as exc:
        return [f"{field}: not JSON: {exc}"]
    if size > MAX_OUTPUT_BYTES:
        return [f"{field}: {size} bytes as compact JSON; the limit is {MAX_OUTPUT_BYTES}: send a smaller result"]
    deep = _too_deep(data, MAX_OUTPUT_DEPTH)
    if deep is not None:
        return [f"{_path(field, deep)}: nested deeper than {MAX_OUTPUT_DEPTH} levels"]
    from jsonschema import validators

    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        found = sorted(cls(schema, registry=_registry()).iter_errors(data), key=lambda e: [str(p) for p in e.path])
    except RecursionError:
        return [f"{field}: the schema's references lead back to themselves without end for this data"]
    except Exception as exc:  # a reference that resolves nowhere (nothing is fetched): the schema, not the data
        return [f"{field}: the schema cannot be applied: {type(exc).__name__}: {_one_line(str(exc))}"]
    shown = [f"{_path(field, e.path)}: {_message(e)}" for e in found[:MAX_ERRORS_SHOWN]]
    if len(found) > MAX_ERRORS_SHOWN:
        shown.append(f"... and {len(found) - MAX_ERRORS_SHOWN} more")
    return shown


def completion_parameters(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON Schema of `attempt_completion(result, data)`'s arguments, `data`'s being `schema`.

    `data` sits at `/properties/data` of the tool's schema, so each local `$ref` of the
    task's schema is rebased there; its `$defs` (and draft-7 `definitions`) move to the
    root, where providers' schema tools look for them (pydantic-ai's own transformers among them).
    """
    data = copy.deepcopy(dict(schema))
    hoisted: dict[str, Any] = {}
    moved: dict[str, str] = {}
    for key in ("$defs", "definitions"):
        defs = data.get(key)
        if isinstance(defs, dict) and all(name not in hoisted for name in defs):
            data.pop(key)
            hoisted.update(defs)
            moved[f"#/{key}/"] = "#/$defs/"
    for key in ("$schema", "$id"):  # about the document, which is the tool's schema now
        data.pop(key, None)

    def rebase(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rebase(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                prefix = next((p for p in moved if ref.startswith(p)), None)
                if prefix is not None:
                    out["$ref"] = moved[prefix] + ref[len(prefix) :]
                elif ref == "#" or ref.startswith("#/"):
                    out["$ref"] = "#/properties/data" + ref[1:]
            return out
        if isinstance(node, list):
            return [rebase(item) for item in node]
        return node

    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "result": {"type": "string", "description": "Your result in a few sentences, for a person to read."},
            "data": rebase(data),
        },
        "required": ["result", "data"],
        "additionalProperties": False,
    }
    if hoisted:
        parameters["$defs"] = rebase(hoisted)
    return parameters
