"""The scripts as one function library (coordinator/store/library.py), on a real Redis 7 and the embedded 6.2.

On a server with functions a step goes by FCALL, and writes what its EVALSHA form writes; a server that
forgets the library (`FUNCTION FLUSH`, a replica promoted before the load reached it) still runs each step
once, by its text, with or without its WAIT, and the next step loads the library again; a server without
functions (6.2), a user not allowed FUNCTION or FCALL, or a library the server will not compile, keeps to
EVALSHA; a load refused for now is tried again later, by one thread. A load removes the libraries no
process noted for a week.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.celery_app import make_app
from coordinator.local.embedded_redis import local_redis
from coordinator.store import base, library
from coordinator.store.base import Command, Scripts
from coordinator.store.library import LIBRARY_KEEP_S, Library, LibraryText, definition_order, library_text, stale
from tests.agents import agent, reply
from tests.tls_kit import TLS_REDIS_SERVER
from workers.runtime.context import Runtime, build_runtime
from workers.runtime.runner import run_child

NOTED = "subqlib:libraries"


def calls_of(client: redis.Redis, *commands: str) -> dict[str, int]:
    """How often the server ran each of `commands` since its stats were reset."""
    stats = client.info("commandstats")
    return {command: int(stats.get(f"cmdstat_{command}", {}).get("calls", 0)) for command in commands}


@pytest.fixture
def redis_7(settings: Settings) -> Iterator[Settings]:
    """A Redis 7 of the test's own (Debian's, which ./scripts/test installs; the embedded one is 6.2)."""
    assert Path(TLS_REDIS_SERVER).exists(), f"{TLS_REDIS_SERVER} is missing: ./scripts/test installs it"
    with local_redis(binary=TLS_REDIS_SERVER) as url:
        yield settings.model_copy(update={"redis_url": url, "key_prefix": "subqlib", "queue": "subq-lib-nobody"})


@pytest.fixture
def client_7(redis_7: Settings) -> Iterator[redis.Redis]:
    assert redis_7.redis_url
    client = redis.Redis.from_url(redis_7.redis_url, decode_responses=True)
    yield client
    client.close()


def fleet_of(settings: Settings) -> tuple[Coordinator, Runtime]:
    return Coordinator(settings), build_runtime(settings, make_app(settings))


@pytest.fixture
def fleet_7(redis_7: Settings) -> Iterator[tuple[Coordinator, Runtime]]:
    coord, rt = fleet_of(redis_7)
    try:
        yield coord, rt
    finally:
        rt.coordinator.close()
        coord.close()


def delegated(coord: Coordinator) -> tuple[str, list[str]]:
    parent = coord.create_task("a parent", todos="[ ] x\n[ ] y\n[ ] z")
    specs = [{"description": name, "message": agent(reply(f"{name} done"))} for name in "xyz"]
    return parent.id, coord.delegate(parent.id, specs).child_ids


def written_back(coord: Coordinator, parent_id: str, children: list[str]) -> None:
    """Each child's item holds its link and its cost, and the parent's total is their sum, counted once."""
    items = coord.get_todos(parent_id)
    assert [(item.status, item.subtask_id) for item in items] == [("completed", child_id) for child_id in children]
    child_costs = [coord.get_task(child_id).cost_micros for child_id in children]
    assert [item.cost_micros for item in items] == child_costs and all(child_costs)
    assert coord.get_task(parent_id).total_cost_micros == sum(child_costs)
    assert coord.get_task(parent_id).status == TaskStatus.ACTIVE, "the batch closed and resumed its parent"


def test_the_library_defines_each_script_after_the_scripts_it_uses_and_is_named_by_its_text() -> None:
    order = definition_order({"end_run": ("outbox_add", "record_usage", "flush_run"), "flush_run": ("record_usage",)})
    assert order.index("outbox_add") < order.index("record_usage") < order.index("flush_run") < order.index("end_run")
    with pytest.raises(ValueError, match=r"in a circle: \['a', 'b'\]"):
        definition_order({"a": ("b",), "b": ("a",)})
    made = library_text("-- the prelude\n", {"a": ()}, read=lambda name: f"return '{name}'\n")
    assert made.text.startswith(
        f"#!lua name={made.name}\n-- the prelude\nlocal function a(KEYS, ARGV)\nreturn 'a.lua'\n"
    )
    assert made.functions == {"a": f"{made.name}_a"}
    wrapper = made.text.split(f"redis.register_function('{made.name}_a', function(KEYS, ARGV)\n", 1)[1]
    assert wrapper == f"{library.RESET_CACHE}local reply = a(KEYS, ARGV)\nhash_flush()\nreturn reply\nend)\n"
    # Its name is its text's (the name left out): any change of the text, the wrappers' included, renames it.
    digest = hashlib.sha1(made.text.replace(made.name, "@library@").encode()).hexdigest()[:16]
    assert made.name == f"subq_{digest}"
    assert library_text("-- another\n", {"a": ()}, read=lambda name: f"return '{name}'\n").name != made.name


def test_each_function_starts_on_an_empty_cache(client_7: redis.Redis) -> None:
    """hashes.lua's cache outlives a call in a library: a function's held write must not be sent again by the
    next call (here it would bring back a hash deleted between the two)."""
    made = library_text(base._prelude(), {"w": ()}, read=lambda _: "hash_set(KEYS[1], 'f', ARGV[1])\nreturn 1\n")
    client_7.function_load(made.text)
    client_7.fcall(made.functions["w"], 1, "a", "x")
    assert client_7.hgetall("a") == {"f": "x"}
    client_7.delete("a")
    client_7.fcall(made.functions["w"], 1, "b", "y")
    assert client_7.exists("a") == 0 and client_7.hgetall("b") == {"f": "y"}


EVENTS_THEN = """event_add(KEYS[1], 100, ARGV[1], 'type', 'first')
event_add(KEYS[1], 100, ARGV[1], 'type', 'second')
if ARGV[2] == 'fail' then
  error('failed after its events')
end
return 1
"""


def test_a_calls_events_send_the_streams_retention_once_and_at_once(client_7: redis.Redis) -> None:
    """hashes.lua's `event_add`, as a function of the library and as a script by its text: a call's two events on
    a stream send one EXPIRE, the next call sends its own (each call starts with no mark), and a call that fails
    after its events leaves the stream its retention (a refresh held to the call's end was lost with it)."""
    made = library_text(base._prelude(), {"e": ()}, read=lambda _: EVENTS_THEN)
    client_7.function_load(made.text)
    by_text = base._prelude() + library.as_function("e", EVENTS_THEN) + library.run_and_flush("e")
    client_7.config_resetstat()
    for stream in ("s1", "s2"):
        assert client_7.fcall(made.functions["e"], 1, stream, 60, "") == 1
        assert client_7.xlen(stream) == 2 and 0 < client_7.ttl(stream) <= 60
    assert calls_of(client_7, "xadd", "expire") == {"xadd": 4, "expire": 2}
    for stream, send in (("s3", lambda: client_7.fcall(made.functions["e"], 1, "s3", 60, "fail")),
                         ("s4", lambda: client_7.eval(by_text, 1, "s4", 60, "fail"))):  # fmt: skip
        with pytest.raises(redis.ResponseError, match="failed after its events"):
            send()
        assert client_7.xlen(stream) == 2 and 0 < client_7.ttl(stream) <= 60, stream


def test_a_childs_steps_go_by_fcall_on_redis_7_and_write_the_tree_back(
    fleet_7: tuple[Coordinator, Runtime],
) -> None:
    coord, rt = fleet_7
    parent_id, children = delegated(coord)
    coord.client.config_resetstat()
    for child_id in children:
        assert run_child(rt, child_id).status == "completed"
    assert calls_of(coord.client, "fcall", "evalsha", "eval") == {"fcall": 6, "evalsha": 0, "eval": 0}
    written_back(coord, parent_id, children)


def test_each_step_runs_once_when_the_server_forgot_the_library(
    redis_7: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FUNCTION FLUSH just before every FCALL is sent: each step runs once, by its text. One replica asked for,
    none there, so the end (acknowledged) goes with its WAIT (1 ms, counted short) in the same round trip."""
    own = redis_7.model_copy(update={"redis_min_replicas": 1, "redis_replica_wait_ms": 1})
    coord, rt = fleet_of(own)
    try:
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
        assert calls_of(coord.client, "fcall", "eval", "function|load") == {"fcall": 6, "eval": 6, "function|load": 6}
        assert coord.client.ping(), "the connection that read the refused FCALL and its WAIT is still in step"
        written_back(coord, parent_id, children)
    finally:
        rt.coordinator.close()
        coord.close()


def test_a_server_without_functions_keeps_to_evalsha(settings: Settings) -> None:
    """The session's server is the embedded Redis 6.2: the library is asked for once, then never again."""
    coord, rt = fleet_of(settings.model_copy(update={"key_prefix": "subqlib62"}))
    try:
        parent_id, children = delegated(coord)
        assert run_child(rt, children[0]).status == "completed"
        scripts = rt.coordinator.store.core.scripts
        assert scripts.library.function("end_run") is None and scripts.library._loaded is False
        assert coord.get_todos(parent_id)[0].subtask_id == children[0]
    finally:
        for key in coord.client.scan_iter("subqlib62:*"):
            coord.client.delete(key)
        rt.coordinator.close()
        coord.close()


@pytest.mark.parametrize(("refused", "loaded", "fcalls_refused"), [("-function", 0, 0), ("-fcall", 1, 1)])
def test_a_user_not_allowed_functions_keeps_to_evalsha(
    redis_7: Settings, client_7: redis.Redis, refused: str, loaded: int, fcalls_refused: int
) -> None:
    """A user refused FUNCTION never loads; one refused FCALL loads, is refused its first FCALL (which then runs by
    its text), and sends every later step by EVALSHA."""
    client_7.acl_setuser("steps", enabled=True, passwords=["+steps-pw"], keys=["*"], channels=["*"],
                         commands=["+@all", refused])  # fmt: skip
    server = str(redis_7.redis_url).split("@", 1)[1]
    coord, rt = fleet_of(redis_7.model_copy(update={"redis_url": f"redis://steps:steps-pw@{server}"}))
    try:
        parent_id, children = delegated(coord)
        client_7.config_resetstat()
        assert run_child(rt, children[0]).status == "completed"
        fcall = client_7.info("commandstats").get("cmdstat_fcall", {})
        assert (fcall.get("calls", 0), fcall.get("rejected_calls", 0)) == (0, fcalls_refused)
        assert len(client_7.function_list()) == loaded
        assert rt.coordinator.store.core.scripts.library._loaded is False, "EVALSHA from now on"
        assert coord.get_todos(parent_id)[0].subtask_id == children[0]
        assert coord.get_task(children[0]).status == TaskStatus.COMPLETED
    finally:
        rt.coordinator.close()
        coord.close()


def test_a_library_the_server_will_not_take_keeps_to_evalsha_without_loading_again(
    client_7: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    broken = Library(client_7, LibraryText("subq_broken", "#!lua name=subq_broken\nthis is not Lua\n", {}), NOTED)
    client_7.config_resetstat()
    assert [broken.function("end_run") for _ in range(3)] == [None, None, None]
    assert calls_of(client_7, "function|load") == {"function|load": 1}
    assert "the server refused the scripts' library (Error compiling function" in caplog.text


def test_a_load_the_server_refuses_for_now_is_tried_again_later_by_one_thread(
    client_7: redis.Redis, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory (as a replica mid-failover answers READONLY): EVALSHA meanwhile, then a load again."""
    scripts = Scripts(client_7, NOTED)
    client_7.config_set("maxmemory", 1)
    try:
        assert scripts.library.function("end_run") is None
    finally:
        client_7.config_set("maxmemory", 0)
    assert client_7.function_list() == [] and client_7.exists(NOTED) == 0, "nothing loaded or noted"
    assert "the scripts' library was not loaded (command not allowed when used memory > 'maxmemory'" in caplog.text
    assert scripts.library.function("end_run") is None, "not again before LOAD_AGAIN_S"
    monkeypatch.setattr(library, "LOAD_AGAIN_S", 0.0)
    scripts = Scripts(client_7, NOTED)
    client_7.config_resetstat()
    # Eight threads ask at once: one loads, and those that find it loading send their steps by EVALSHA.
    asked: list[str | None] = []
    threads = [threading.Thread(target=lambda: asked.append(scripts.library.function("end_run"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls_of(client_7, "function|load") == {"function|load": 1}
    assert set(asked) <= {None, f"{scripts.library.name}_end_run"} and f"{scripts.library.name}_end_run" in asked
    assert scripts.library.function("end_run") == f"{scripts.library.name}_end_run"


def test_a_load_removes_the_libraries_no_process_noted_for_a_week(
    client_7: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    now_s = int(time.time())
    noted: list[tuple[str, int | str]] = [
        ("subq_old", now_s - LIBRARY_KEEP_S - 60), ("subq_recent", now_s - 86_400), ("subq_bad", "x")
    ]  # fmt: skip
    for name, at_s in noted:
        client_7.function_load(f"#!lua name={name}\nredis.register_function('{name}_f', function() return 1 end)")
        client_7.hset(NOTED, name, at_s)
    client_7.hset(NOTED, "subq_gone", now_s - LIBRARY_KEEP_S - 60)  # noted, and removed already (by another)
    client_7.function_load("#!lua name=theirs\nredis.register_function('theirs_f', function() return 1 end)")
    scripts = Scripts(client_7, NOTED)
    assert scripts.library.function("end_run") == f"{scripts.library.name}_end_run"
    libraries = sorted(
        dict(zip(entry[::2], entry[1::2], strict=True))["library_name"] for entry in client_7.function_list()
    )
    assert libraries == sorted([scripts.library.name, "subq_recent", "theirs"])
    assert set(client_7.hgetall(NOTED)) == {scripts.library.name, "subq_recent"}
    assert int(client_7.hget(NOTED, scripts.library.name) or 0) >= now_s
    assert "not removed" not in caplog.text and "not unnoted" not in caplog.text
    # Another process of the same release: its load finds the library there, keeps it and notes it again.
    client_7.hset(NOTED, scripts.library.name, now_s - 60)
    again = Scripts(client_7, NOTED)
    assert again.library.function("start_run") == f"{scripts.library.name}_start_run"
    assert int(client_7.hget(NOTED, scripts.library.name) or 0) >= now_s


def test_stale_reads_names_and_times_as_bytes_or_text() -> None:
    now_s = 10 * LIBRARY_KEEP_S
    noted: dict[bytes | str, bytes | str] = {
        b"subq_a": b"1", "subq_b": str(now_s), b"subq_own": b"1", b"other": b"1", "subq_c": ""
    }  # fmt: skip
    assert sorted(stale(noted, now_s, "subq_own")) == ["subq_a", "subq_c"]
