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
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Annotated, Any, NoReturn
from urllib.parse import unquote

from pydantic import BeforeValidator, WithJsonSchema

from coordinator.errors import ValidationError as SubqValidationError
from coordinator.text import all_shown, ascii_digits, digits_within

if TYPE_CHECKING:
    from jsonschema.exceptions import SchemaError, ValidationError
    from referencing import Registry

__all__ = [
    "MAX_CHECK_STEPS",
    "MAX_ERRORS_SHOWN",
    "MAX_OUTPUT_BYTES",
    "MAX_OUTPUT_DEPTH",
    "MAX_OUTPUT_STEPS",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_EXPANSION",
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
# The work a schema can cause, not only its size: each subschema is counted once for every path to
# it through references and combinators (a reference back to a schema on the path counts once, so a
# tree's recursive schema passes). Real schemas, reused definitions included, stay in the hundreds;
# a 2 KB chain of `anyOf`s that doubles at each reference passes 2**16 and took minutes to check.
MAX_SCHEMA_EXPANSION = 10_000
# How many subschemas deep references may lead (the validator recurses a few frames for each).
MAX_SCHEMA_EXPANSION_DEPTH = 64
# Validation steps (one a keyword applied; a regular expression's search counts its text's bytes
# times its program's size over REGEX_UNITS_PER_STEP). A step costs up to ~20 µs of CPU (a failing
# `anyOf` under recursion, measured), so checking a schema against the empty probes stops within
# about 0.4 s on the API, and validating an output within about 5 s on a worker; a real output
# (thousands of rows of a few fields each) takes tens of thousands of steps.
MAX_CHECK_STEPS = 20_000
MAX_OUTPUT_STEPS = 250_000
# `pattern` and `patternProperties` run on RE2, which matches in time linear in the text (no
# backtracking); its worst case is the text's bytes times the program's instructions, at a few
# nanoseconds each: a thousand of those are about a step of the validator.
REGEX_UNITS_PER_STEP = 1_000
# RE2's memory for one expression (its program and its matching cache); a program bigger than this (about
# 56,000 instructions, `.{1000}` seven times) does not compile, and the schema is refused naming the pattern.
# RE2's own default (8 MiB) let one 350-byte pattern compile for 50 ms into 250 MB kept in the process's cache.
REGEX_MAX_MEM_BYTES = 1 << 20
# A schema's expressions compile to at most this many RE2 instructions in all (each distinct one counted once;
# one that fails to compile counts REGEX_FAILED_COMPILE): about 15 ms of compiling on the API. A real schema's
# pattern is tens of instructions; the cap is a dozen `.{1000}`s. Without it, a 32 KiB schema held a hundred
# patterns near RE2's limit: seconds of CPU on the API's request and hundreds of MB a schema.
MAX_SCHEMA_REGEX_INSTRUCTIONS = 100_000
REGEX_FAILED_COMPILE = 20_000
# Compiled expressions kept per process (each at most REGEX_MAX_MEM_BYTES).
REGEX_CACHE_SIZE = 64
TOO_MANY_INSTRUCTIONS = (
    f"its regular expressions (pattern, patternProperties) compile to more than {MAX_SCHEMA_REGEX_INSTRUCTIONS:,} "
    "RE2 instructions in all"
)
# A caller-owned task (run=false) has no model to hold to a schema: it never ends with data.
NO_RUN_NO_OUTPUT = (
    "output_schema applies to an agent task (run=true): a caller-owned task has no model to hold to it "
    "(give each subtask its own output_schema instead)"
)
# A result, not a data set: the object is kept on the record and handed to the parent's model, whole, in its
# line of the combined result (writeback.OUTPUT_IN_LINE_BYTES, the same number: every valid output fits).
MAX_OUTPUT_BYTES = 16 * 1024
# An output nests no deeper than this: its validation recurses once per level.
MAX_OUTPUT_DEPTH = 64
# How many of an invalid output's errors the model (and the record's error) is told, sorted by path.
MAX_ERRORS_SHOWN = 20


def compact(value: Any) -> str:
    """A JSON value as compact text (no spaces, non-ASCII kept): how a schema and an output are stored."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _path(prefix: str, parts: Iterator[Any] | Any) -> str:
    """`prefix.a.0.b`: a path as the API words one (pydantic's `subtasks.1.message`). A key that is not printable
    text on one line (a model's own, with a line break) is written as its JSON string: it cannot make a line of
    its own where an error is shown (`subq status`, the tree)."""
    return ".".join([prefix, *(_part(part) for part in parts)])


def _part(part: Any) -> str:
    text = str(part)
    return text if all_shown(text) else json.dumps(text)


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
        elif (
            isinstance(node, list)
            and ascii_digits(part)
            and digits_within(part, len(str(len(node))))
            and int(part) < len(node)
        ):
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


class _TooMuchWork(Exception):
    """Validation ran out of its steps (MAX_CHECK_STEPS, MAX_OUTPUT_STEPS)."""


class _Steps:
    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left

    def spend(self, steps: int = 1) -> None:
        self.left -= steps
        if self.left < 0:
            raise _TooMuchWork


# The steps of the validation running in this context (one thread's call of _validate).
_steps: ContextVar[_Steps | None] = ContextVar("output_schema_steps", default=None)


def _spend(steps: int = 1) -> None:
    budget = _steps.get()
    if budget is not None:
        budget.spend(steps)


class _Compiles:
    """The RE2 instructions a schema check may still compile, and the patterns it has counted."""

    __slots__ = ("counted", "left")

    def __init__(self, left: int) -> None:
        self.left = left
        self.counted: set[str] = set()


class _TooManyInstructions(Exception):
    """A schema's expressions compile to more than MAX_SCHEMA_REGEX_INSTRUCTIONS (a schema check's)."""


# The compiling budget of the schema check running in this context (schema_problem's).
_compiles: ContextVar[_Compiles | None] = ContextVar("output_schema_compiles", default=None)


def _compiled(pattern: str) -> Any:
    """`_regex(pattern)`, counted against the running schema check's budget: _TooManyInstructions once it is
    spent, before anything more is compiled."""
    budget = _compiles.get()
    if budget is None or pattern in budget.counted:
        return _regex(pattern)
    if budget.left < 0:
        raise _TooManyInstructions
    budget.counted.add(pattern)
    try:
        regex = _regex(pattern)
    except Exception:
        budget.left -= REGEX_FAILED_COMPILE
        raise
    budget.left -= regex.programsize
    if budget.left < 0:
        raise _TooManyInstructions
    return regex


@functools.lru_cache(maxsize=REGEX_CACHE_SIZE)
def _regex(pattern: str) -> Any:
    """`pattern` compiled by RE2 (linear-time matching), or re2.error; compiled once per process."""
    import re2

    options = re2.Options()
    options.max_mem = REGEX_MAX_MEM_BYTES
    options.log_errors = False  # its reason is raised; RE2 would also print it to stderr
    return re2.compile(pattern.encode("utf-8", "surrogatepass"), options)


def _search(pattern: str, text: str) -> bool:
    """Whether `pattern` matches somewhere in `text` (JSON Schema's `pattern` is unanchored), on RE2."""
    regex = _regex(pattern)
    data = text.encode("utf-8", "surrogatepass")
    _spend(1 + len(data) * regex.programsize // REGEX_UNITS_PER_STEP)
    return regex.search(data) is not None


def _regex_problem(pattern: str) -> str | None:
    try:
        _compiled(pattern)
    except _TooManyInstructions:
        raise _Refused([], TOO_MANY_INSTRUCTIONS) from None
    except Exception as exc:  # re2.error, or a pattern no UTF-8 can carry
        return f"{pattern!r} is not a regular expression RE2 accepts: {_one_line(str(exc))}"
    return None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: Mapping[str, Any], instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, additional: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """jsonschema's own, its properties matched against patternProperties on RE2 (its joins them for `re`)."""
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    named = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = {k for k in instance if k not in named and not any(_search(p, k) for p in patterns)}
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        if patterns:
            verb = "does" if len(extras) == 1 else "do"
            joined = ", ".join(repr(each) for each in sorted(extras))
            yield ValidationError(
                f"{joined} {verb} not match any of the regexes: {', '.join(map(repr, sorted(patterns)))}"
            )
        else:
            listed = ", ".join(repr(each) for each in sorted(extras, key=str))
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(f"Additional properties are not allowed ({listed} {verb} unexpected)")


# The keywords whose regular expressions RE2 evaluates instead of Python's backtracking `re`.
_ON_RE2 = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
}


def _counted(keyword: Callable[..., Any]) -> Callable[..., Any]:
    def apply(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _spend()
        return keyword(validator, value, instance, schema)

    return apply


@functools.cache
def _engine(draft: Any) -> Any:  # a jsonschema validator class (a protocol's type is no cache key for mypy)
    """`draft`'s validator with every keyword counted against the running validation's steps and the
    regular expressions on RE2; built once per draft."""
    from jsonschema import validators

    keywords = {name: _ON_RE2.get(name, function) for name, function in draft.VALIDATORS.items()}
    return validators.extend(draft, {name: _counted(function) for name, function in keywords.items()})


def _validate(draft: Any, schema: Mapping[str, Any], instance: Any, steps: int) -> list[Any]:
    """Every error of `instance` under `schema`; _TooMuchWork past `steps` steps."""
    token = _steps.set(_Steps(steps))
    try:
        return list(_engine(draft)(schema, registry=_registry()).iter_errors(instance))
    finally:
        _steps.reset(token)


class _Refused(Exception):
    """A schema found unusable: `where` inside it, and why. Each check raises it; schema_problem returns it."""

    def __init__(self, where: list[Any], reason: str) -> None:
        self.where, self.reason = where, reason


def _local_targets(schema: Mapping[str, Any], node: Mapping[str, Any]) -> Iterator[tuple[list[Any], Any]]:
    """The places (path, value) in `schema` that `node`'s local references name (those that resolve)."""
    for keyword in REFERENCE_KEYWORDS:
        ref = node.get(keyword)
        target = _target(schema, ref) if isinstance(ref, str) and ref.startswith("#") else None
        if target is not None:
            yield target


# Keywords that apply their schemas to the same value as the schema holding them (no step into the data): a
# cycle of references through these alone never ends, whatever the data.
_IN_PLACE = frozenset(
    {"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "dependencies", *REFERENCE_KEYWORDS}
)


def _check_ids(schema: Mapping[str, Any], draft: Any) -> None:
    """No subschema is a resource of its own: its `$id` (a draft-4 `id`) would be the base its references resolve
    against, where every other check here resolves them against the document, so a reference checked as sound
    pointed at nothing once validating (every output refused, the model's retries spent on it). An `$id` of a
    `#name` form only names it, as `$anchor` does."""
    keys = ("$id", "id") if draft.__name__ in ("Draft3Validator", "Draft4Validator") else ("$id",)
    for where, node in _subschemas(schema, []):
        for key in keys:
            value = node.get(key)
            if where and isinstance(value, str) and not value.startswith("#"):
                raise _Refused(
                    [*where, key],
                    f"a subschema's {key} ({value!r}) makes it a resource of its own, which is not supported: "
                    "name it with $anchor, and reference it as '#name'",
                )


def _check_cycles(schema: Mapping[str, Any]) -> None:
    """No reference leads back to its own schema through in-place keywords alone (`$ref`, `allOf`, `anyOf`, ...:
    _IN_PLACE): validating any value that reaches it never ends. A reference back through `properties` or
    `items` (a tree's schema) reads deeper into the data at each turn, and ends with it."""
    state: dict[int, int] = {}  # id of a node: 1 on the walk's path, 2 done

    def walk(node: Mapping[str, Any], where: list[Any]) -> None:
        state[id(node)] = 1
        for step_where, step in _in_place_steps(schema, node, where):
            if state.get(id(step)) == 1:
                raise _Refused(where, "its references lead back to themselves without reading into the data")
            if id(step) not in state:
                walk(step, step_where)
        state[id(node)] = 2

    for where, node in _subschemas(schema, []):
        if id(node) not in state:
            walk(node, where)


def _in_place_steps(
    schema: Mapping[str, Any], node: Mapping[str, Any], where: list[Any]
) -> Iterator[tuple[list[Any], Mapping[str, Any]]]:
    """The schemas `node` applies to its own value (with their paths): its references' targets, and its
    in-place keywords' schemas (_IN_PLACE)."""
    steps: list[tuple[list[Any], Any]] = list(_local_targets(schema, node))
    for key in _IN_PLACE & node.keys() - set(REFERENCE_KEYWORDS):
        value = node[key]
        if key in ("dependentSchemas", "dependencies") and isinstance(value, Mapping):
            steps += [([*where, key, name], child) for name, child in value.items()]
        elif isinstance(value, list):
            steps += [([*where, key, index], child) for index, child in enumerate(value)]
        else:
            steps.append(([*where, key], value))
    return ((step_where, step) for step_where, step in steps if isinstance(step, Mapping))


def _check_expansion(schema: Mapping[str, Any]) -> None:
    """Refuses `schema` where it expands past MAX_SCHEMA_EXPANSION subschemas (each counted once for every
    path to it through references and combinators, a reference back to a schema on the path once) or
    references lead deeper than MAX_SCHEMA_EXPANSION_DEPTH. Linear in the schema: each size is kept."""
    sizes: dict[int, int] = {}
    path: list[int] = []

    def size(node: Any, where: list[Any]) -> int:
        if isinstance(node, list):
            return sum(size(item, [*where, index]) for index, item in enumerate(node))
        if not isinstance(node, Mapping):
            return 0
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in path:
            return 1
        if len(path) >= MAX_SCHEMA_EXPANSION_DEPTH:
            raise _Refused(where, f"its references lead more than {MAX_SCHEMA_EXPANSION_DEPTH} subschemas deep")
        path.append(key)
        total = 1 + sum(size(child, child_where) for child_where, child in _children(node, where))
        total += sum(size(target, target_where) for target_where, target in _local_targets(schema, node))
        path.pop()
        if total > MAX_SCHEMA_EXPANSION:
            raise _Refused(
                where,
                f"expands to {total} subschemas through its references and combinators (each counted once "
                f"for every path to it); the limit is {MAX_SCHEMA_EXPANSION}",
            )
        sizes[key] = total
        return total

    size(schema, [])


def _check_document(schema: object) -> dict[str, Any]:
    """`schema` if it is a JSON object within MAX_SCHEMA_DEPTH and MAX_SCHEMA_BYTES: checked before
    anything walks it, so no later check recurses into a hostile depth or size."""
    if not isinstance(schema, dict):
        kind = "a string" if isinstance(schema, str) else type(schema).__name__
        raise _Refused([], f"must be a JSON Schema object, not {kind}")
    deep = _too_deep(schema, MAX_SCHEMA_DEPTH)
    if deep is not None:
        raise _Refused(deep, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        size = len(compact(schema).encode())
    except (TypeError, ValueError) as exc:  # a value JSON cannot carry (NaN, a non-string key, a lone surrogate)
        raise _Refused([], f"not JSON: {exc}") from None
    if size > MAX_SCHEMA_BYTES:
        raise _Refused([], f"{size} bytes as compact JSON; the limit is {MAX_SCHEMA_BYTES}")
    return schema


def _check_references(schema: Mapping[str, Any]) -> None:
    """Every reference is local and resolves: nothing outside the schema is ever fetched."""
    for where, ref in _refs(schema):
        if not isinstance(ref, str):
            continue  # the metaschema says what is wrong with it
        if not ref.startswith("#"):
            raise _Refused(where, f"only local references ('#/...') are allowed, not {ref!r}")
        if _target(schema, ref) is None:
            raise _Refused(where, f"{ref!r} names nothing in the schema")


def _draft(schema: Mapping[str, Any]) -> Any:  # a jsonschema validator class
    """The validator of the draft `$schema` names, else the newest (2020-12)."""
    from jsonschema import validators  # on use: importing the client's models loads no validator

    draft = schema.get("$schema")
    if draft is not None and not isinstance(draft, str):
        raise _Refused(["$schema"], f"must be a string naming a JSON Schema draft, not {type(draft).__name__}")
    cls = validators.validator_for(schema, default=None)
    if cls is not None:
        return cls
    if draft is not None:
        raise _Refused(["$schema"], f"{draft!r} names no JSON Schema draft this validator knows")
    return validators.Draft202012Validator


def _check_metaschema(schema: Mapping[str, Any], draft: Any) -> None:
    """`schema` is valid under its draft's metaschema; the error shown is jsonschema's best match."""
    from jsonschema import FormatChecker
    from jsonschema.exceptions import best_match

    # With the format checker: a `pattern` must be a regular expression RE2 compiles (the metaschema's
    # `format: regex`, here RE2's and not Python's `re`: RE2 is what evaluates it).
    formats = FormatChecker(())
    formats.checkers = {**draft.FORMAT_CHECKER.checkers, "regex": (_is_regex, Exception)}
    checker = draft(draft.META_SCHEMA, format_checker=formats, registry=_registry())
    error = best_match(checker.iter_errors(schema))
    budget = _compiles.get()
    if budget is not None and budget.left < 0:  # the format checker took it as a pattern that is no regex
        raise _Refused([], TOO_MANY_INSTRUCTIONS)
    if error is not None:
        raise _Refused(list(error.path), _message(error))


def _check_patterns(schema: Mapping[str, Any]) -> None:
    """Every patternProperties name compiles on RE2 (older drafts' metaschemas check none), and no
    schema combines patternProperties with unevaluatedProperties: jsonschema finds the properties
    patternProperties evaluated with Python's backtracking `re`, not RE2."""
    for where, node in _subschemas(schema, []):
        for pattern in node.get("patternProperties", {}):
            reason = _regex_problem(pattern)
            if reason is not None:
                raise _Refused([*where, "patternProperties", pattern], reason)
    if any("unevaluatedProperties" in node for _, node in _subschemas(schema, [])):
        with_patterns = next((w for w, node in _subschemas(schema, []) if "patternProperties" in node), None)
        if with_patterns is not None:
            raise _Refused([*with_patterns, "patternProperties"], "cannot be combined with unevaluatedProperties")


def _check_probes(schema: Mapping[str, Any], draft: Any) -> None:
    """Validating the empty values against `schema` ends within MAX_CHECK_STEPS: a `$ref` that leads back
    to itself without end, or a schema the validator cannot apply, is found before any run."""
    probes: tuple[object, ...] = (None, {}, [])
    for probe in probes:
        try:
            _validate(draft, schema, probe, MAX_CHECK_STEPS)
        except RecursionError:
            raise _Refused([], "its references lead back to themselves without end") from None
        except _TooMuchWork:
            raise _Refused([], f"validating even {compact(probe)} takes more than {MAX_CHECK_STEPS} steps") from None
        except Exception as exc:  # the validator could not apply it: it is no schema to hold a model to
            raise _Refused([], f"cannot be applied: {type(exc).__name__}: {_one_line(str(exc))}") from None


def schema_problem(schema: object) -> tuple[list[Any], str] | None:
    """What makes `schema` unusable as an output schema (the path inside it, the reason), or None.

    Pure and cheap (no network: a remote `$ref` is refused, never fetched), so every face runs it
    before it writes or sends anything. The checks run cheapest first; each assumes the ones before it.
    """
    budget = _compiles.set(_Compiles(MAX_SCHEMA_REGEX_INSTRUCTIONS))
    try:
        document = _check_document(schema)
        _check_references(document)
        draft = _draft(document)
        _check_ids(document, draft)
        _check_metaschema(document, draft)
        _check_patterns(document)
        _check_expansion(document)
        _check_cycles(document)  # after the expansion's depth bound: its walk recurses as deep as references lead
        _check_probes(document, draft)
    except _Refused as refused:
        return refused.where, refused.reason
    finally:
        _compiles.reset(budget)
    return None


def _is_regex(instance: object) -> bool:
    return not isinstance(instance, str) or _compiled(instance) is not None


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
        found = sorted(_validate(cls, schema, data, MAX_OUTPUT_STEPS), key=lambda e: [str(p) for p in e.path])
    except _TooMuchWork:
        return [f"{field}: validating it against the schema takes more than {MAX_OUTPUT_STEPS} steps"]
    except RecursionError:
        return [f"{field}: the schema's references lead back to themselves without end for this data"]
    except Exception as exc:  # a reference that resolves nowhere (nothing is fetched): the schema, not the data
        return [f"{field}: the schema cannot be applied: {type(exc).__name__}: {_one_line(str(exc))}"]
    shown = [f"{_path(field, e.path)}: {_message(e)}" for e in found[:MAX_ERRORS_SHOWN]]
    if len(found) > MAX_ERRORS_SHOWN:
        shown.append(f"... and {len(found) - MAX_ERRORS_SHOWN} more")
    return shown


def _hoist_definitions(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Takes `$defs` and draft-7 `definitions` out of `data`: the definitions, and each old pointer
    prefix (`#/definitions/`) mapped to its new one at the tool's root (`#/$defs/`). A map whose names
    clash with one already taken stays where it is."""
    hoisted: dict[str, Any] = {}
    moved: dict[str, str] = {}
    for key in ("$defs", "definitions"):
        defs = data.get(key)
        if isinstance(defs, dict) and all(name not in hoisted for name in defs):
            data.pop(key)
            hoisted.update(defs)
            moved[f"#/{key}/"] = "#/$defs/"
    return hoisted, moved


def _rebased_ref(ref: str, moved: Mapping[str, str]) -> str:
    """The local reference `ref` as the tool's schema resolves it: into a hoisted definition, else under
    `/properties/data`. A pointer's `$` may come percent-encoded (`#/%24defs/x`): compared decoded, as
    it resolves."""
    decoded = unquote(ref)
    for prefix, to in moved.items():
        if decoded.startswith(prefix):
            return to + decoded[len(prefix) :]
        if decoded == prefix.rstrip("/"):  # the definitions themselves
            return to.rstrip("/")
    return "#/properties/data" + ref[1:] if ref == "#" or ref.startswith("#/") else ref


def _rebase(node: Any, moved: Mapping[str, str]) -> Any:
    """A copy of `node` with every local reference rebased (_rebased_ref)."""
    if isinstance(node, list):
        return [_rebase(item, moved) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebase(v, moved) for k, v in node.items()}
    for keyword in REFERENCE_KEYWORDS:
        ref = out.get(keyword)
        if isinstance(ref, str) and ref.startswith("#"):
            out[keyword] = _rebased_ref(ref, moved)
    return out


def completion_parameters(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON Schema of `attempt_completion(result, data)`'s arguments, `data`'s being `schema`.

    `data` sits at `/properties/data` of the tool's schema, so each local `$ref` of the
    task's schema is rebased there; its `$defs` (and draft-7 `definitions`) move to the
    root, where providers' schema tools look for them (pydantic-ai's own transformers among them).
    """
    data = copy.deepcopy(dict(schema))
    hoisted, moved = _hoist_definitions(data)
    for key in ("$schema", "$id"):  # about the document, which is the tool's schema now
        data.pop(key, None)
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "result": {"type": "string", "description": "Your result in a few sentences, for a person to read."},
            "data": _rebase(data, moved),
        },
        "required": ["result", "data"],
        "additionalProperties": False,
    }
    if hoisted:
        parameters["$defs"] = _rebase(hoisted, moved)
    return parameters
