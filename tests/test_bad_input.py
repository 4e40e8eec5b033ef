"""Bad input gets a clear error naming the field, and changes nothing.

Every case checks the error text and field, that no subq key changed in
Redis, and that no Celery message was published (the coordinator publishes
to a queue no worker consumes, so its length is exact).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator import (
    ConfigError,
    Coordinator,
    NotFoundError,
    ProfileError,
    Settings,
    StateError,
    SubqError,
    TodoError,
    ValidationError,
    load_settings,
)
from coordinator.ids import root_of
from tests.helpers import script, start_worker_with, state, usage_step

ROOT = Path(__file__).resolve().parent.parent
# A root id no test uses: state(coord, NO_TREE) compares only the root and approval indexes.
NO_TREE = "0000000000000000"


def _ok(n: int = 0, **extra: Any) -> dict[str, Any]:
    return {"description": f"child {n}", "message": script(usage_step()), **extra}


def _assert_refused(
    coord: Coordinator,
    call: Callable[[], object],
    error: type[SubqError],
    message: str,
    field: str | None,
    *roots: str,
) -> None:
    """The call raises `error` naming `field`; the trees `roots` (and the root index) are unchanged."""
    before = state(coord, *roots or (NO_TREE,))
    with pytest.raises(error) as caught:
        call()
    assert message in str(caught.value)
    assert caught.value.field == field
    assert state(coord, *roots or (NO_TREE,)) == before, "a refused call changed Redis or published"


@pytest.fixture
def parent(idle_coordinator: Coordinator) -> Any:
    return idle_coordinator.create_task("A parent", todos="[ ] one\n[ ] two")


def test_unknown_parent(idle_coordinator: Coordinator) -> None:
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate("0123456789abcdef", [_ok()]),
        NotFoundError,
        "Unknown task: 0123456789abcdef",
        "task_id",
    )
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate("not-an-id", [_ok()]),
        NotFoundError,
        "'not-an-id' is not a subq task or batch id",
        "task_id",
    )


def test_parent_not_active(idle_coordinator: Coordinator, parent: Any) -> None:
    idle_coordinator.delegate(parent.id, [_ok()])  # now delegated, its child never runs
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate(parent.id, [_ok(1)]),
        StateError,
        f"Task {parent.id} is delegated, not active",
        "task_id",
        parent.id,
    )


def test_unknown_todo_id(idle_coordinator: Coordinator, parent: Any) -> None:
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate(parent.id, [_ok(0), _ok(1, todo_id="nope")]),
        TodoError,
        "Unknown todo_id 'nope'",
        "subtasks.1.todo_id",
        parent.id,
    )


def test_same_todo_id_twice(idle_coordinator: Coordinator, parent: Any) -> None:
    todo = idle_coordinator.get_todos(parent.id)[0].id
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate(parent.id, [_ok(0, todo_id=todo), _ok(1, todo_id=todo)]),
        TodoError,
        f"todo_id '{todo}' is used by two subtasks",
        "subtasks.1.todo_id",
        parent.id,
    )


def test_empty_spec_list(idle_coordinator: Coordinator, parent: Any) -> None:
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate(parent.id, []),
        ValidationError,
        "subtasks is empty",
        "subtasks",
        parent.id,
    )


def test_width_over_the_limit(idle_coordinator: Coordinator, parent: Any) -> None:
    limit = idle_coordinator.settings.max_fanout
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate(parent.id, [_ok(n) for n in range(limit + 1)]),
        ValidationError,
        f"{limit + 1} subtasks exceed SUBQ_MAX_FANOUT={limit}",
        "subtasks",
        parent.id,
    )


@pytest.mark.parametrize("message", ["", "   \n"])
def test_empty_message(idle_coordinator: Coordinator, parent: Any, message: str) -> None:
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate(parent.id, [_ok(0), {"description": "x", "message": message}]),
        ValidationError,
        "subtasks.1.message: String should have at least 1 character",
        "subtasks.1.message",
        parent.id,
    )


def test_unknown_field_and_missing_description(idle_coordinator: Coordinator, parent: Any) -> None:
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate(parent.id, [_ok(0, colour="red")]),
        ValidationError,
        "subtasks.0.colour: Extra inputs are not permitted",
        "subtasks.0.colour",
        parent.id,
    )
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate(parent.id, [{"message": "hi"}]),
        ValidationError,
        "subtasks.0.description: Field required",
        "subtasks.0.description",
        parent.id,
    )


def test_unknown_profile(idle_coordinator: Coordinator, parent: Any) -> None:
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate(parent.id, [_ok(0, profile="gpt-9")]),
        ProfileError,
        "Invalid profile: gpt-9",
        "subtasks.0.profile",
        parent.id,
    )
    before = state(idle_coordinator, NO_TREE)
    with pytest.raises(ProfileError, match="Invalid profile: gpt-9"):
        idle_coordinator.create_task("x", profile="gpt-9")
    assert state(idle_coordinator, NO_TREE) == before


def test_bad_mode(idle_coordinator: Coordinator, parent: Any) -> None:
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.delegate(parent.id, [_ok()], mode="sideways"),
        ValidationError,
        "mode must be 'parallel' or 'sequential', not 'sideways'",
        "mode",
        parent.id,
    )


def test_depth_limit(idle_coordinator: Coordinator) -> None:
    shallow = Coordinator(idle_coordinator.settings.model_copy(update={"max_depth": 0}))
    root = shallow.create_task("No subtasks allowed")
    _assert_refused(
        shallow,
        lambda: shallow.delegate(root.id, [_ok()]),
        StateError,
        "SUBQ_MAX_DEPTH=0 allows no deeper subtasks",
        "task_id",
        root.id,
    )


@pytest.mark.parametrize(
    ("update", "message", "field"),
    [
        ("just prose, no items\n", "The todo update has no items", "todos"),
        ("", "The todo update has no items", "todos"),
        ([{"content": "ok"}, {"content": "  "}], "Todo item 1 has no content", "todos.1.content"),
        ([{"content": "ok"}, {"content": "\u202e\u200b"}], "Todo item 1 has no visible content", "todos.1.content"),
        ("[ ] \u202e\u200b", "The todo update's line 1 is an item with no visible text", "todos"),
        ([{"content": "ok", "status": "done"}], "Todo item 0 has an invalid status 'done'", "todos.0.status"),
    ],
)
def test_bad_todo_update_keeps_the_list(
    idle_coordinator: Coordinator, parent: Any, update: Any, message: str, field: str
) -> None:
    old = idle_coordinator.get_todos(parent.id)
    _assert_refused(
        idle_coordinator, lambda: idle_coordinator.update_todos(parent.id, update), TodoError, message, field, parent.id
    )
    assert idle_coordinator.get_todos(parent.id) == old


def test_bad_create_task(idle_coordinator: Coordinator) -> None:
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.create_task("   "),
        ValidationError,
        "prompt must be a non-empty string",
        "prompt",
    )
    _assert_refused(
        idle_coordinator,
        lambda: idle_coordinator.create_task("ok", todos="nothing that parses"),
        TodoError,
        "The todo update has no items",
        "todos",
    )


def test_what_redis_cannot_take_is_refused_before_it_is_asked(idle_coordinator: Coordinator, parent: Any) -> None:
    """A delivery id with a lone surrogate (a command-line argument that is not UTF-8) reached the Redis client,
    whose encoder raised: a traceback. A child's id as the history's root read no task: an empty page,
    where the API refused it. Each is refused in one line now, the same words the HTTP client uses."""
    coord = idle_coordinator
    for delivery_id in ("\udcff", ".", "..", "", "a/b", f"evt_{parent.id}_1.0\n"):
        _assert_refused(
            coord, lambda d=delivery_id: coord.redeliver(parent.id, d), NotFoundError,
            f"Unknown delivery {delivery_id!r} of task {parent.id}", "delivery_id", parent.id,
        )  # fmt: skip
    (child,) = coord.delegate(parent.id, [_ok()]).child_ids
    _assert_refused(
        coord, lambda: coord.list_tasks(root_id=child), ValidationError,
        f"root_id: {child} is not a root task (its root is {parent.id})", "root_id", parent.id,
    )  # fmt: skip
    assert {item.id for item in coord.list_tasks(root_id=parent.id)[0]} == {parent.id, child}


def test_a_malformed_task_message_changes_nothing(coordinator: Coordinator) -> None:
    """A producer that sends `subq.run_task` with a bad argument gets a failed result, no state."""
    before = coordinator.store.metrics.snapshot()
    for bad in (123, "not-an-id", "0123456789abcdef"):
        result = coordinator.app.send_task("subq.run_task", args=[bad]).get(timeout=30)
        assert result["status"] == "failed"
        assert result["error_class"] in ("ValidationError", "NotFoundError")
    after = coordinator.store.metrics.snapshot()
    # Earlier tests' trees on the session's fleet may still settle meanwhile (a stopped run's last UI message, its
    # live status, the reconciler moving its watch on the shared due list, or dropping the entry of a tree whose keys
    # a test deleted): only their keys, and their tasks' entries of a shared key, may differ. Any other key new, gone
    # or changed is this message's doing.
    settling = ({_tree_of(key) for key in before} | _trees_listed(before)) - {None}
    before, after = _without_trees(before, settling), _without_trees(after, settling)
    assert {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)} == set()


def _tree_of(key: str) -> str | None:
    """The root id a tree's key carries in its hash tag (`<prefix>:{<root>}:...`), or None for a shared key."""
    tagged = re.search(r"\{([^}]+)\}", key)
    return tagged[1] if tagged else None


def _tree_of_member(member: Any) -> str | None:
    """The root id of the task a set's or sorted set's member names, or None (a worker's name, say)."""
    try:
        return root_of(str(member[0] if isinstance(member, tuple) else member))
    except NotFoundError:
        return None


def _trees_listed(snapshot: dict[str, Any]) -> set[str | None]:
    """The trees whose tasks are members of a shared set or sorted set of `snapshot` (the due list's entries)."""
    return {
        _tree_of_member(member)
        for key, (kind, value) in snapshot.items()
        if _tree_of(key) is None and kind in ("set", "zset")
        for member in value
    }


def _without_trees(snapshot: dict[str, Any], trees: set[str | None]) -> dict[str, Any]:
    """`snapshot` (Metrics.snapshot's) less the keys of `trees`, and less their tasks' members of a shared set or
    sorted set (the due list holds every tree's running tasks)."""
    kept = {}
    for key, (kind, value) in snapshot.items():
        if _tree_of(key) in trees:
            continue
        if kind in ("set", "zset"):
            value = [member for member in value if _tree_of_member(member) not in trees - {None}]
        kept[key] = (kind, value)
    return kept


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SUBQ_MAX_FANOUT": "lots"}, "Invalid setting SUBQ_MAX_FANOUT: Input should be a valid integer"),
        ({"SUBQ_MAX_DEPTH": "-1"}, "Invalid setting SUBQ_MAX_DEPTH: Input should be greater than or equal to 0"),
        ({"SUBQ_WORKER_POOL": "fibers"}, "Invalid setting SUBQ_WORKER_POOL: String should match pattern"),
        (
            {"SUBQ_VISIBILITY_TIMEOUT_S": "10", "SUBQ_TASK_TIME_LIMIT_S": "60"},
            "Invalid setting SUBQ_VISIBILITY_TIMEOUT_S: 10 must be above SUBQ_TASK_TIME_LIMIT_S (60)",
        ),
        (
            {"SUBQ_RECONCILE_INTERVAL_S": "10", "SUBQ_RESULT_RETENTION_S": "60"},
            "Invalid setting SUBQ_RECONCILE_INTERVAL_S: 10.0 must be at most an eighth of SUBQ_RESULT_RETENTION_S (60)",
        ),
        (
            {"SUBQ_RESULT_RETENTION_S": "600"},
            "Invalid setting SUBQ_WEBHOOK_RETRY_MAX_S: 600.0 plus SUBQ_WEBHOOK_TIMEOUT_S (10.0) and a claim's margin "
            "(30 s) must be under SUBQ_RESULT_RETENTION_S (600)",
        ),
        ({"SUBQ_DEFAULT_PROFILE": "nope"}, "Invalid setting SUBQ_DEFAULT_PROFILE: 'nope' is not a defined profile"),
        ({"SUBQ_PROFILES": '{"x": {"model": "bogus"}}'}, "Invalid setting SUBQ_PROFILES (x): model must be"),
        (
            {"SUBQ_NOTIFY": '[{"url": "https://hooks..example.com/x"}]'},
            "Invalid setting SUBQ_NOTIFY (0.url): names no valid host ('hooks..example.com'",
        ),
    ],
)
def test_invalid_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_profiles_file_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "profiles.toml"
    bad.write_text('[profiles.fast]\nmodel = "openai:gpt-4o-mini"\nmax_requests = 0\n')
    monkeypatch.setenv("SUBQ_PROFILES_FILE", str(bad))
    with pytest.raises(ConfigError, match=r"SUBQ_PROFILES_FILE: .*profiles.toml: fast.max_requests: Input should be"):
        load_settings()
    good = tmp_path / "good.toml"
    good.write_text('[profiles.fast]\nmodel = "openai:gpt-4o-mini"\nbase_url = "http://127.0.0.1:1/v1"\n')
    monkeypatch.setenv("SUBQ_PROFILES_FILE", str(good))
    assert load_settings().profile("fast").model == "openai:gpt-4o-mini"
    monkeypatch.setenv("SUBQ_PROFILES_FILE", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="SUBQ_PROFILES_FILE: .*missing.toml: cannot read it"):
        load_settings()


def test_worker_with_an_invalid_setting_stops_with_one_line(settings: Settings) -> None:
    proc = start_worker_with(settings, SUBQ_MAX_FANOUT="0")
    assert proc.returncode != 0
    assert "subq worker: Invalid setting SUBQ_MAX_FANOUT: Input should be greater than or equal to 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_redis_url_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="Invalid setting SUBQ_REDIS_URL: not set"):
        Coordinator(Settings())


def test_an_agents_empty_profile_reads_as_left_out() -> None:
    """A model fills an optional argument with "" as often as it leaves it out: its child runs on the parent's
    profile, where a caller of the API or Python who sends "" is refused (tests/test_api.py)."""
    from workers.runtime.tools import SubtaskInput

    assert SubtaskInput(description="d", message="m", profile="").profile is None
    assert SubtaskInput(description="d", message="m", profile="  ").profile is None
    assert SubtaskInput(description="d", message="m", profile="main").profile == "main"
