"""The scripts as one function library (coordinator/store/library.py), on a real Redis 7 and the embedded 6.2.

On a server with functions a step goes by FCALL, and writes exactly what its EVALSHA form writes; a server
that forgets the library (`FUNCTION FLUSH`, a replica promoted before the load reached it) still runs each
step once, by its text, and the next step loads the library again; a server without functions (6.2), or a
user not allowed FUNCTION, keeps to EVALSHA. A load removes the libraries no process loaded for a week.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.celery_app import make_app
from coordinator.local.embedded_redis import local_redis
from coordinator.store import base
from coordinator.store.base import Command, Scripts
from coordinator.store.library import LIBRARY_KEEP_S, definition_order, library_text
from tests.agents import agent, reply
from workers.runtime.context import Runtime, build_runtime
from workers.runtime.runner import run_child

REDIS_7 = "/usr/bin/redis-server"  # Debian's, installed by ./scripts/test (the embedded one is 6.2)


def calls_of(client: redis.Redis, *commands: str) -> dict[str, int]:
    """How often the server ran each of `commands` since its stats were reset."""
    stats = client.info("commandstats")
    return {command: int(stats.get(f"cmdstat_{command}", {}).get("calls", 0)) for command in commands}


@pytest.fixture
def redis_7(settings: Settings) -> Iterator[Settings]:
    assert Path(REDIS_7).exists(), f"{REDIS_7} is missing: ./scripts/test installs Debian's redis-server"
    with local_redis(binary=REDIS_7) as url:
        yield settings.model_copy(update={"redis_url": url, "key_prefix": "subqlib", "queue": "subq-lib-nobody"})


@pytest.fixture
def fleet_7(redis_7: Settings) -> Iterator[tuple[Coordinator, Runtime]]:
    coord = Coordinator(redis_7)
    rt = build_runtime(redis_7, make_app(redis_7))
    try:
        yield coord, rt
    finally:
        rt.coordinator.close()
        coord.close()


def delegated(coord: Coordinator) -> tuple[str, list[str]]:
    parent = coord.create_task("a parent", todos="[ ] x\n[ ] y\n[ ] z")
    specs = [{"description": name, "message": agent(reply(f"{name} done"))} for name in "xyz"]
    return parent.id, coord.delegate(parent.id, specs).child_ids


def test_the_library_defines_each_script_after_the_scripts_it_uses() -> None:
    order = definition_order({"end_run": ("outbox_add", "record_usage", "flush_run"), "flush_run": ("record_usage",)})
    assert order.index("outbox_add") < order.index("record_usage") < order.index("flush_run") < order.index("end_run")
    with pytest.raises(ValueError, match=r"in a circle: \['a', 'b'\]"):
        definition_order({"a": ("b",), "b": ("a",)})
    text, functions = library_text("-- the prelude\n", {"a": ()}, read=lambda name: f"return '{name}'\n")
    name = functions["a"].removesuffix("_a")
    assert text.startswith(f"#!lua name={name}\n-- the prelude\nlocal function a(KEYS, ARGV)\nreturn 'a.lua'\nend\n")
    assert f"redis.register_function('{name}_a'" in text


def test_a_childs_steps_go_by_fcall_on_redis_7_and_write_the_tree_back(
    fleet_7: tuple[Coordinator, Runtime],
) -> None:
    coord, rt = fleet_7
    parent_id, children = delegated(coord)
    coord.client.config_resetstat()
    for child_id in children:
        assert run_child(rt, child_id).status == "completed"
    assert calls_of(coord.client, "fcall", "evalsha", "eval") == {"fcall": 6, "evalsha": 0, "eval": 0}
    items = coord.get_todos(parent_id)
    assert [(item.status, item.subtask_id) for item in items] == [("completed", child_id) for child_id in children]
    child_costs = [coord.get_task(child_id).cost_micros for child_id in children]
    assert [item.cost_micros for item in items] == child_costs and all(child_costs)
    assert coord.get_task(parent_id).total_cost_micros == sum(child_costs)
    assert coord.get_task(parent_id).status == TaskStatus.ACTIVE, "the batch closed and resumed its parent"


def test_each_step_runs_once_when_the_server_forgot_the_library(
    fleet_7: tuple[Coordinator, Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FUNCTION FLUSH just before every FCALL is sent: each step runs once, by its text."""
    coord, rt = fleet_7
    parent_id, children = delegated(coord)
    coord.client.config_resetstat()
    send = base.round_trip

    def forgotten(client: redis.Redis, commands: Sequence[Command], **kwargs: Any) -> list[Any]:
        if any(command[0] == "FCALL" for command in commands):
            coord.client.function_flush()
        return send(client, commands, **kwargs)

    monkeypatch.setattr(base, "round_trip", forgotten)
    for child_id in children:
        assert run_child(rt, child_id).status == "completed"
    # Each of the 6 steps: an FCALL answered "Function not found", its EVAL, and a load before the next.
    assert calls_of(coord.client, "eval", "function|load") == {"eval": 6, "function|load": 6}
    child_costs = [coord.get_task(child_id).cost_micros for child_id in children]
    assert [item.cost_micros for item in coord.get_todos(parent_id)] == child_costs
    assert coord.get_task(parent_id).total_cost_micros == sum(child_costs), "no step's usage counted twice"
    assert [coord.get_task(child_id).requests for child_id in children] == [1, 1, 1], "each request recorded once"


def test_a_server_without_functions_keeps_to_evalsha(settings: Settings) -> None:
    """The session's server is the embedded Redis 6.2: the library is asked once, then never again."""
    coord = Coordinator(settings.model_copy(update={"key_prefix": "subqlib62"}))
    rt = build_runtime(coord.settings, make_app(coord.settings))
    try:
        parent_id, children = delegated(coord)
        assert run_child(rt, children[0]).status == "completed"
        library = rt.coordinator.store.core.scripts.library
        assert library.function("end_run") is None and library._loaded is False
        assert coord.get_todos(parent_id)[0].subtask_id == children[0]
    finally:
        for key in coord.client.scan_iter("subqlib62:*"):
            coord.client.delete(key)
        rt.coordinator.close()
        coord.close()


def test_a_user_not_allowed_function_keeps_to_evalsha(redis_7: Settings) -> None:
    admin = redis.Redis.from_url(redis_7.redis_url)
    admin.acl_setuser("steps", enabled=True, passwords=["+steps-pw"], keys=["*"], channels=["*"],
                      commands=["+@all", "-function"])  # fmt: skip
    url = redis_7.redis_url.replace("redis://:", "redis://steps:").split("@")[1]
    own = redis_7.model_copy(update={"redis_url": f"redis://steps:steps-pw@{url}"})
    coord = Coordinator(own)
    rt = build_runtime(own, make_app(own))
    try:
        parent_id, children = delegated(coord)
        admin.config_resetstat()
        assert run_child(rt, children[0]).status == "completed"
        assert calls_of(admin, "fcall", "evalsha") == {"fcall": 0, "evalsha": 2}
        assert admin.function_list() == [], "nothing was loaded"
        assert coord.get_todos(parent_id)[0].subtask_id == children[0]
    finally:
        rt.coordinator.close()
        coord.close()
        admin.close()


def test_a_load_removes_the_libraries_no_process_loaded_for_a_week(redis_7: Settings) -> None:
    client = redis.Redis.from_url(redis_7.redis_url, decode_responses=True)
    noted = "subqlib:libraries"
    now_s = int(time.time())
    for name, at in [("subq_old", now_s - LIBRARY_KEEP_S - 60), ("subq_recent", now_s - 86_400), ("subq_bad", "x")]:
        client.function_load(f"#!lua name={name}\nredis.register_function('{name}_f', function() return 1 end)")
        client.hset(noted, name, at)
    client.function_load("#!lua name=theirs\nredis.register_function('theirs_f', function() return 1 end)")
    scripts = Scripts(client, libraries_key=noted)
    assert scripts.library.function("end_run") == f"{scripts.library.name}_end_run"
    libraries = sorted(library["library_name"] for library in map(_pairs, client.function_list()))
    assert libraries == sorted([scripts.library.name, "subq_recent", "theirs"])
    assert set(client.hgetall(noted)) == {scripts.library.name, "subq_recent"}
    assert int(client.hget(noted, scripts.library.name) or 0) >= now_s
    # Another process of the same release: its load finds the library there and keeps it.
    again = Scripts(client, libraries_key=noted)
    assert again.library.function("start_run") == f"{scripts.library.name}_start_run"
    client.close()


def _pairs(reply: list[object]) -> dict[object, object]:
    """FUNCTION LIST's entry as RESP2 gives it (a flat list of names and values) as a dict."""
    pairs = iter(reply)
    return dict(zip(pairs, pairs, strict=True))


def test_a_load_the_server_refuses_for_now_is_tried_again_at_the_next_step(
    redis_7: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of memory (as a replica mid-failover answers READONLY): that step goes by EVALSHA, the next loads."""
    client = redis.Redis.from_url(redis_7.redis_url, decode_responses=True)
    scripts = Scripts(client, libraries_key="subqlib:libraries")
    client.config_set("maxmemory", 1)
    try:
        assert scripts.library.function("end_run") is None
    finally:
        client.config_set("maxmemory", 0)
    assert client.function_list() == [] and client.exists("subqlib:libraries") == 0, "nothing loaded or noted"
    assert "the scripts' library was not loaded (command not allowed when used memory > 'maxmemory'" in caplog.text
    assert scripts.library.function("end_run") == f"{scripts.library.name}_end_run"
    client.close()
