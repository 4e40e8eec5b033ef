"""The key names (coordinator/store/keys.py): each builder against the module's table, and the exact names that
Lua scripts, running deployments and their data depend on (pure logic: no Redis)."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from coordinator.store import keys as keys_module
from coordinator.store.keys import DEFAULT_PREFIX, Keys

# A table row whose key a builder makes from another's argument: `rate(f"tool:{glob}")`.
BUILT_BY_ANOTHER = {"X:rate:tool:X"}
# Methods of Keys that build no key: SCAN patterns, and the root a tree's key names.
NOT_BUILDERS = {"all_pattern", "trees_pattern", "root_of_kept"}


def _shape(name: str) -> str:
    """A key as a shape: each `{hash tag}` is `{X}`, each `<placeholder>` (the prefix too) `X`."""
    return re.sub(r"<[^>]*>", "X", re.sub(r"\{[^}]*\}", "{X}", name))


def _builders() -> dict[str, int]:
    """Every key builder of Keys, by name, with how many arguments it takes."""
    keys = Keys("X")
    return {
        name: len(inspect.signature(getattr(keys, name)).parameters)
        for name in dir(Keys)
        if not name.startswith("_") and callable(getattr(Keys, name)) and name not in NOT_BUILDERS
    }


def test_every_key_of_the_table_has_a_builder_and_every_builder_a_row() -> None:
    table = {_shape(name) for name in re.findall(r"^\| `([^`]+)`", keys_module.__doc__ or "", re.M)}
    keys = Keys("X")
    built = {getattr(keys, name)(*["X"] * arity) for name, arity in _builders().items()}
    built |= {keys.endpoint("X"), keys.endpoint_parked("X")}  # a host's view, without a model
    assert built - table == set(), "a builder the table does not list"
    assert table - built == BUILT_BY_ANOTHER, "a row of the table no builder makes"


@pytest.mark.parametrize(
    ("built", "name"),
    [
        (lambda k: k.task("r1", "t2"), "p:{r1}:task:t2"),
        (lambda k: k.ui_messages("r1", "t2"), "p:{r1}:ui:t2"),
        (lambda k: k.running_children("r1", "t2"), "p:{r1}:running:t2"),
        (lambda k: k.batch_lines("r1", "b2"), "p:{r1}:batch-lines:b2"),
        (lambda k: k.tree_tasks("r1"), "p:{r1}:tasks"),
        (lambda k: k.last_start("r1"), "p:{r1}:last-start"),
        (lambda k: k.outbox("r1"), "p:{r1}:outbox"),
        (lambda k: k.outbox_pending(), "p:outbox"),
        (lambda k: k.all_tasks(), "p:tasks"),
        (lambda k: k.latency_histogram(), "p:metrics:model-latency"),
        (lambda k: k.leader(), "p:reconciler"),
        (lambda k: k.rate("tool:fs.*"), "p:rate:tool:fs.*"),
        (lambda k: k.web_session("h"), "p:web-session:h"),
        (lambda k: k.tenant_spend("acme"), "p:tenant:{acme}:spend"),
        (lambda k: k.fair_capacity(), "p:fair:capacity"),
        (lambda k: k.endpoint("h:1"), "p:endpoint:{h:1}"),
        (lambda k: k.endpoint_parked("h:1", "m"), "p:endpoint-parked:{h:1}:model:m"),
        (lambda k: k.all_pattern(), "p:*"),
        (lambda k: k.trees_pattern(), "p:{*}:*"),
    ],
)
def test_names_are_exactly_as_stored(built: object, name: str) -> None:
    assert callable(built) and built(Keys("p")) == name


def test_keys_are_a_frozen_value_of_their_prefix() -> None:
    assert Keys() == Keys(DEFAULT_PREFIX) and hash(Keys("a")) == hash(Keys("a")) and Keys("a") != Keys("b")
    assert [f.name for f in dataclasses.fields(Keys)] == ["prefix"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Keys().prefix = "other"  # type: ignore[misc]


def test_a_name_cut_where_its_ids_go_is_the_name_again_with_the_ids_put_back() -> None:
    """`cut`: what start_run, fair_take and read_claimed build a key from, as the script joins it with the ids
    it finds as it runs (store/fair.py's fair_args, store/outbox.py's claimed_names)."""
    keys = Keys("p")
    assert keys_module.cut(keys.task, 2) == ["p:{", "}:task:", ""]
    head, middle, tail = keys_module.cut(keys.task, 2)
    assert head + "r1" + middle + "t1" + tail == keys.task("r1", "t1")
    for build in (keys.outbox, keys.hooks, keys.tenant_running, keys.tenant_parked, keys.tenant_queued):
        head, tail = keys_module.cut(build)
        assert head + "x" + tail == build("x")


ROOT = "0123456789abcdef"


@pytest.mark.parametrize(
    ("key", "root"),
    [
        (f"p:{{{ROOT}}}:task:{ROOT}-0123456789ab", ROOT),
        (f"p:{{{ROOT}}}:batch-lines:{ROOT}-b0123456789ab", ROOT),
        (f"p:{{{ROOT}}}:events", ROOT),
        (f"p:{{{ROOT}}}:lease:{ROOT}", None),  # a run's lease lapses with its worker's heartbeat: never kept
        ("p:tenant:{acme}:spend", None),
        ("p:endpoint:{h:1}", None),
        ("p:{not-a-root}:task:x", None),
        (f"q:{{{ROOT}}}:task:{ROOT}", None),  # another deployment's
        (f"p:{{{ROOT}}}", None),
    ],
)
def test_the_root_of_a_key_the_keeper_keeps(key: str, root: str | None) -> None:
    assert Keys("p").root_of_kept(key) == root


def test_a_prefixs_glob_characters_match_only_themselves() -> None:
    assert Keys("a*b[1]?").trees_pattern() == "a\\*b\\[1\\]\\?:{*}:*"
