"""What a hostile `output_schema` cannot make subq do: fetch a URL, run for minutes, hang on a regex.

A schema comes from whoever creates a task and its data from a model: both are untrusted. These
tests give coordinator/output_schema.py the schemas a reviewer used against it (a reference to a
listener on loopback, a chain of `anyOf`s that doubles at each step, a pattern that backtracks
without end) and check each is refused or evaluated at once, by CPU time (time.process_time, not
the wall clock: other tests share this machine) against bounds far above what the work takes
and far below what the attack took (tens of seconds each before the fix).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from coordinator.errors import ValidationError
from coordinator.output_schema import (
    MAX_OUTPUT_STEPS,
    MAX_SCHEMA_EXPANSION,
    check_schema,
    output_errors,
    schema_problem,
)
from tests.test_typed_results import COUNT, INVALID, INVALID_ERRORS, VALID

T = TypeVar("T")

# What "at once" means in CPU seconds: each case below takes a few milliseconds; before the fix
# each took 25 s or more (or never returned).
AT_ONCE_CPU_S = 0.5


def cpu_seconds(work: Callable[[], T]) -> tuple[T, float]:
    start = time.process_time()
    result = work()
    return result, time.process_time() - start


# -- 1. nothing is fetched ------------------------------------------------------------------------


class Listener:
    """A TCP listener on loopback that accepts and counts connections (and answers none)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"


@pytest.fixture
def listener() -> Iterator[Listener]:
    found = Listener()
    found.thread.start()
    yield found
    found.stopping.set()
    found.thread.join()
    found.sock.close()


def test_a_listener_counts_a_connection(listener: Listener) -> None:
    """The counter below counts: one connection made by hand is seen."""
    socket.create_connection(("127.0.0.1", listener.port), timeout=5).close()
    deadline = time.monotonic() + 10
    while listener.connections == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener.connections == 1


def test_no_reference_keyword_reaches_outside_the_schema(listener: Listener) -> None:
    remote = {
        "$ref": {"$ref": listener.url("ref")},
        "$dynamicRef": {"$dynamicRef": listener.url("dynamic")},
        "$recursiveRef": {
            "$schema": "https://json-schema.org/draft/2019-09/schema",
            "$recursiveRef": listener.url("recursive"),
        },
    }
    for keyword, schema in remote.items():
        with pytest.raises(ValidationError) as refused:
            check_schema(schema)
        assert refused.value.message == (
            f"output_schema.{keyword}: only local references ('#/...') are allowed, not {schema[keyword]!r}"
        )
        # The validator itself, given the schema unchecked (as a stored schema would reach a worker):
        # the reference fails as the schema's own error, and nothing is fetched. (Draft 2019-09's
        # `$recursiveRef` always names its own document, whatever its value: a loop.)
        errors = output_errors(schema, "x")
        assert len(errors) == 1 and errors[0].startswith("data: the schema"), errors
    assert listener.connections == 0


def test_a_reference_rebased_by_an_id_onto_a_host_is_not_fetched(listener: Listener) -> None:
    """`#/$defs/a` reads as local, but under `$id: other.json` it names a document on the listener's host."""
    schema = {
        "$id": listener.url("s/root.json"),
        "allOf": [{"$id": "other.json", "$ref": "#/$defs/a"}],
        "$defs": {"a": {"type": "string"}},
    }
    problem = schema_problem(schema)  # refused before anything resolves it: a nested $id is no resource here
    assert problem is not None and problem[0] == ["allOf", 0, "$id"], problem
    assert output_errors(schema, "x")[0].startswith("data: the schema cannot be applied: ")
    assert listener.connections == 0


def test_data_that_looks_like_a_reference_is_data() -> None:
    """`const` and `enum` hold values, not schemas: a `$ref` key inside one is a property of the value."""
    schema = {"properties": {"link": {"const": {"$ref": "http://x/y"}}, "kind": {"enum": [{"$ref": "z"}]}}}
    assert schema_problem(schema) is None
    assert output_errors(schema, {"link": {"$ref": "http://x/y"}, "kind": {"$ref": "z"}}) == []
    assert output_errors(schema, {"link": {"$ref": "http://x/z"}}) == ["data.link: {'$ref': 'http://x/y'} was expected"]


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"x": {"type": "integer"}}, "properties": {"d": {"$ref": "#/%24defs/x"}}},
        {"$defs": {"a b": {"type": "integer"}}, "properties": {"d": {"$ref": "#/$defs/a%20b"}}},
        {"$defs": {"a/b": {"type": "integer"}}, "properties": {"d": {"$ref": "#/$defs/a~1b"}}},
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"A": {"$id": "#A", "type": "integer"}},
            "properties": {"d": {"$ref": "#A"}},
        },
        {"$defs": {"A": {"$anchor": "A", "type": "integer"}}, "properties": {"d": {"$ref": "#A"}}},
    ],
    ids=["percent-encoded", "percent-encoded space", "escaped slash", "draft-7 plain-name id", "anchor"],
)
def test_every_local_way_to_name_a_place_resolves(schema: dict[str, Any]) -> None:
    assert schema_problem(schema) is None
    assert output_errors(schema, {"d": 1}) == []
    assert output_errors(schema, {"d": "x"}) == ["data.d: 'x' is not of type 'integer'"]


def test_a_pointer_to_a_missing_place_is_still_refused() -> None:
    with pytest.raises(ValidationError) as refused:
        check_schema({"$defs": {"x": {}}, "properties": {"d": {"$ref": "#/%24defs/y"}}})
    assert refused.value.message == "output_schema.properties.d.$ref: '#/%24defs/y' names nothing in the schema"


# -- 2. the work a schema can cause is bounded ------------------------------------------------------


def _doubling_chain(links: int) -> dict[str, Any]:
    """`a{i}` is anyOf two references to `a{i+1}`: 2**links paths to the last, in under 2 KB."""
    defs: dict[str, Any] = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}] * 2} for i in range(links)}
    defs[f"a{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


# A tree: each node names its children by a reference back to the root.
TREE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["name"],
}


def test_a_schema_that_doubles_at_each_reference_is_refused_at_once() -> None:
    with pytest.raises(ValidationError) as refused:
        check_schema(_doubling_chain(16))
    assert refused.value.message == (
        "output_schema.$defs.a4: expands to 16381 subschemas through its references and combinators "
        f"(each counted once for every path to it); the limit is {MAX_SCHEMA_EXPANSION}"
    )
    start = time.process_time()
    assert schema_problem(_doubling_chain(16)) is not None
    assert time.process_time() - start < AT_ONCE_CPU_S


def test_recursive_and_reused_schemas_pass() -> None:
    assert schema_problem(TREE) is None
    assert schema_problem(COUNT) is None
    assert schema_problem(_doubling_chain(8)) is None  # 2**8 paths: within the bound
    tree = {"name": "root", "children": [{"name": "a", "children": [{"name": "b"}]}, {"name": "c"}]}
    assert output_errors(TREE, tree) == []
    assert output_errors(TREE, {"name": "root", "children": [{"children": []}]}) == [
        "data.children.0: 'name' is a required property"
    ]
    assert output_errors(COUNT, INVALID) == INVALID_ERRORS
    assert output_errors(COUNT, VALID) == []


def test_data_that_doubles_the_work_at_each_level_is_cut_off() -> None:
    """Two alternatives, both recursing into the same child: nested data fails both at every level (2**60)."""
    branch = {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}
    schema = {"anyOf": [branch, {**branch, "minProperties": 1}]}
    assert schema_problem(schema) is None  # each subschema counted once: the cycle is the data's
    data: Any = {}
    for _ in range(60):
        data = {"c": data}
    errors, cpu_s = cpu_seconds(lambda: output_errors(schema, data))
    assert errors == [f"data: validating it against the schema takes more than {MAX_OUTPUT_STEPS} steps"]
    assert cpu_s < 60  # MAX_OUTPUT_STEPS steps: seconds (about 5 alone), not the age of the universe


# -- 3. regular expressions run in linear time -----------------------------------------------------


def test_a_catastrophic_pattern_is_evaluated_at_once() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(a+)+$"}}}
    assert schema_problem(schema) is None
    errors, cpu_s = cpu_seconds(lambda: output_errors(schema, {"x": "a" * 30 + "!"}))
    assert errors == ["data.x: 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!' does not match '^(a+)+$'"]
    assert cpu_s < AT_ONCE_CPU_S
    assert output_errors(schema, {"x": "a" * 30}) == []


def test_catastrophic_property_patterns_are_evaluated_at_once() -> None:
    key = "a" * 28 + "!"
    named = {"patternProperties": {"^(a|a)*$": {"type": "integer"}}, "additionalProperties": False}
    assert schema_problem(named) is None
    errors, cpu_s = cpu_seconds(lambda: output_errors(named, {key: 1, "aaa": "x"}))
    assert errors == [
        f"data: '{key}' does not match any of the regexes: '^(a|a)*$'",
        "data.aaa: 'x' is not of type 'integer'",
    ]
    assert cpu_s < AT_ONCE_CPU_S


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"properties": {"x": {"pattern": "(?=a)"}}},
            "output_schema.properties.x.pattern: '(?=a)' is not a 'regex'",
        ),
        (
            {"$schema": "http://json-schema.org/draft-04/schema#", "patternProperties": {"(a)\\1": {}}},
            "output_schema.patternProperties.(a)\\1: '(a)\\\\1' is not a regular expression RE2 accepts: ",
        ),
        (
            {"properties": {"x": {"patternProperties": {"^a": {}}}}, "unevaluatedProperties": False},
            "output_schema.properties.x.patternProperties: cannot be combined with unevaluatedProperties",
        ),
    ],
    ids=["lookahead", "backreference (draft 4)", "unevaluatedProperties"],
)
def test_a_pattern_re2_cannot_run_is_refused_naming_its_path(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        check_schema(schema)
    assert refused.value.message.startswith(message), refused.value.message


def _patterns(count: int, unit: str) -> dict[str, Any]:
    """An object schema of `count` string properties, each with a distinct pattern ending in `unit`."""
    return {
        "type": "object",
        "properties": {f"p{n}": {"type": "string", "pattern": f"p{n}{unit}"} for n in range(count)},
    }


def test_a_schema_whose_patterns_compile_to_too_much_is_refused_before_it_compiles_them_all() -> None:
    """RE2 compiled any pattern under its 8 MiB default: a 32 KiB schema of a hundred `.{1000}` runs took seconds
    of the API's CPU to accept and kept hundreds of MB a schema in the process's cache. A schema's patterns now
    compile to at most MAX_SCHEMA_REGEX_INSTRUCTIONS in all, counted as they compile: past it nothing more is."""
    from coordinator.output_schema import _regex

    compiled_before = _regex.cache_info().misses
    flood = _patterns(90, ".{1000}" * 6)  # each about 48,000 instructions
    with pytest.raises(ValidationError) as refused:
        check_schema(flood)
    assert refused.value.message == (
        "output_schema: its regular expressions (pattern, patternProperties) compile to more than 100,000 RE2 "
        "instructions in all"
    )
    assert _regex.cache_info().misses - compiled_before <= 3, "it stopped compiling once the budget was spent"
    too_big = {"properties": {"x": {"pattern": ".{1000}" * 8}}}
    with pytest.raises(ValidationError, match=r"output_schema.properties.x.pattern: .* is not a 'regex'"):
        check_schema(too_big)
    many_small = _patterns(300, "-[A-Z]{3}-\\d{1,6}$")  # 300 real patterns, the same one repeated too
    many_small["properties"]["again"] = {"type": "string", "pattern": "p0-[A-Z]{3}-\\d{1,6}$"}
    assert schema_problem(many_small) is None
    assert output_errors(many_small, {"p7": "p7-ABC-123", "again": "p0-XYZ-1"}) == []


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"properties": {"a": {"$ref": "#/properties/a"}}},
            "output_schema.properties.a: its references lead back to themselves without reading into the data",
        ),
        (
            {
                "properties": {"a": {"$ref": "#/$defs/x"}},
                "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"allOf": [{"$ref": "#/$defs/x"}]}},
            },
            "output_schema.$defs.y.allOf.0: its references lead back to themselves without reading into the data",
        ),
        (
            {
                "properties": {"n": {"$ref": "#/$defs/n"}},
                "$defs": {"n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}},
            },
            "output_schema.$defs.n.anyOf.1: its references lead back to themselves without reading into the data",
        ),
        (
            {"properties": {"a": {"$id": "urn:i", "properties": {"b": {"$ref": "#/$defs/n"}}}}, "$defs": {"n": {}}},
            "output_schema.properties.a.$id: a subschema's $id ('urn:i') makes it a resource of its own",
        ),
    ],
    ids=["itself", "through allOf", "through anyOf", "a nested $id"],
)
def test_a_schema_no_data_can_be_validated_against_is_refused_before_any_run(
    schema: dict[str, Any], message: str
) -> None:
    """Each passed the checks (the empty probes never reached the loop, and a nested `$id` moved where its
    references resolve), and every output with the property then failed, until the task's retries were spent."""
    with pytest.raises(ValidationError) as refused:
        check_schema(schema)
    assert refused.value.message.startswith(message), refused.value.message


def test_recursive_schemas_that_read_deeper_at_each_turn_stay_accepted() -> None:
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}
    linked = {"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"type": "null"}, {
        "$ref": "#/$defs/node"}]}}}}, "$ref": "#/$defs/node"}  # fmt: skip
    named = {"$schema": "http://json-schema.org/draft-07/schema#", "properties": {"a": {"$ref": "#foo"}},
             "definitions": {"f": {"$id": "#foo", "type": "integer"}}}  # fmt: skip
    for schema in (tree, linked, named):
        assert schema_problem(schema) is None, schema
    assert output_errors(linked, {"next": {"next": None}}) == []
    assert output_errors(named, {"a": "x"}) == ["data.a: 'x' is not of type 'integer'"]
