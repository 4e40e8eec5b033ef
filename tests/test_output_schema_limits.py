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
from coordinator.output_schema import check_schema, output_errors, schema_problem

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
    problem = schema_problem(schema)
    assert problem is not None and problem[1].startswith("cannot be applied: "), problem
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
