"""Every input path is linear in its size: long runs of whitespace, brackets and newlines at the size limit.

A body of the API's limit (1 MiB), a task message of the same size, an
offline-model script: each is refused or accepted within seconds, never with a
5xx, a RecursionError or minutes of CPU. (The todo grammar's own cases are in
tests/test_todos.py; a queue entry nested too deeply is dead-lettered, in
tests/test_poison.py.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from coordinator import Coordinator, ScriptError, Settings
from coordinator.api import create_app
from tests.helpers import ApiServer, api_settings, state
from tests.test_bad_input import NO_TREE
from workers.runtime.offline import final_reply, parse_script
from workers.submit import submit

LIMIT = 1 << 20
# Linear, not quadratic: a quadratic path at this size takes minutes of CPU. Measured as this process's
# CPU time (the API server runs in a thread of it), which other processes' load does not stretch:
# the wall time was well under a second on an idle 2-core host, 2.1 s with both cores held busy,
# and 5.15 s once on a CI host loaded further (a wall-clock bound there failed a linear path).
BUDGET_CPU_S = 5.0
FENCE = "```subq-script\n"

RUNS: dict[str, str] = {
    "spaces": " " * LIMIT,
    "newlines": "\n" * LIMIT,
    "tabs and returns": "\t\r\n" * (LIMIT // 3),
    "brackets": "[" * LIMIT,
    "boxes": "[ ] " * (LIMIT // 4),
    "braces": "{" * LIMIT,
    "backticks": "`" * LIMIT,
}


def within_budget(call: Callable[[], Any]) -> Any:
    started_cpu_s, started_s = time.process_time(), time.perf_counter()
    result = call()
    took_cpu_s, took_s = time.process_time() - started_cpu_s, time.perf_counter() - started_s
    assert took_cpu_s < BUDGET_CPU_S, f"took {took_cpu_s:.2f} s of CPU ({took_s:.2f} s of wall time)"
    return result


SCRIPTS = {
    # Each of these took minutes with the old multi-line pattern (an unclosed opening rescanned the rest).
    "unclosed openings": FENCE * (LIMIT // len(FENCE)),
    "opening then spaces": FENCE + " " * LIMIT,
    "opening then newlines": FENCE + "\n" * LIMIT,
    "nested too deeply": FENCE + "[" * (LIMIT - 40) + "\n```\n",
    "bare fences": "```\n" * (LIMIT // 4),
    "one long reply": FENCE + json.dumps({"steps": [{"reply": '\\"[{' * (LIMIT // 5)}]}) + "\n```\n",
    **RUNS,
}


@pytest.mark.parametrize("message", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_an_offline_script_parses_in_linear_time(message: str) -> None:
    def parse() -> None:
        try:
            parse_script(message)
        except ScriptError:
            pass  # refusing is fine; taking long, or a RecursionError, is not
        final_reply(message)

    within_budget(parse)


def test_a_script_nested_too_deeply_is_a_script_error() -> None:
    with pytest.raises(ScriptError, match="nested deeper than 64"):
        parse_script(SCRIPTS["nested too deeply"])


@pytest.fixture(scope="module")
def http(settings: Settings) -> Iterator[tuple[Coordinator, httpx.Client]]:
    coord = Coordinator(api_settings(settings, key_prefix="subqidle", queue="subq-nobody"))
    with ApiServer(create_app(coordinator=coord)) as server, server.client() as client:
        yield coord, client
    coord.close()


def _bodies() -> dict[str, bytes]:
    room = LIMIT - 100
    bodies = {f"prompt of {name}": json.dumps({"prompt": text[:room]}).encode() for name, text in RUNS.items()}
    bodies |= {
        f"todos of {name}": json.dumps({"prompt": "p", "todos": text[:room]}).encode() for name, text in RUNS.items()
    }
    bodies["todos nested too deeply"] = b'{"prompt": "p", "todos": ' + b"[" * room + b"}"
    bodies["body nested too deeply"] = b"[" * room
    bodies["whitespace around nothing"] = b" " * room
    return bodies


BODIES = _bodies()


@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
def test_an_api_body_at_the_limit_is_answered_in_linear_time(
    http: tuple[Coordinator, httpx.Client], body: bytes
) -> None:
    coord, client = http
    response = within_budget(
        lambda: client.post("/v1/tasks", content=body, headers={"content-type": "application/json"})
    )
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        assert response.json()["message"], "a refusal says why"


MESSAGES = {
    f"{field} of {name}": {"prompt": "p", "run": False, field: text}
    for field in ("todos", "subtasks", "mode")
    for name, text in RUNS.items()
}
MESSAGES["subtasks nested too deeply"] = {"prompt": "p", "run": False, "subtasks": json.loads("[" * 900 + "]" * 900)}


@pytest.mark.parametrize("kwargs", MESSAGES.values(), ids=MESSAGES.keys())
def test_a_task_message_at_the_limit_is_answered_in_linear_time(
    idle_coordinator: Coordinator, kwargs: dict[str, Any]
) -> None:
    before = state(idle_coordinator, NO_TREE)
    result = within_budget(lambda: submit(idle_coordinator, (), kwargs))
    if "error" in result:  # a refusal writes nothing
        assert result["error"]["message"] and state(idle_coordinator, NO_TREE) == before
    else:
        assert set(result) == {"task_id"}, str(result)[:300]
