"""A real provider over real HTTP: a local OpenAI-compatible chat-completions server.

The server (started by the test, on loopback) answers the first request with a
tool call and usage, the second with the final text; the run goes through
pydantic-ai's OpenAI model, the orchestration tools, and subq's usage and cost
recording, exactly as against a hosted endpoint.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.celery_app import make_app
from coordinator.settings import Price, Profile, load_settings
from tests.model_server import ModelServer, Turn
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child

REPLIES: list[dict[str, Any]] = [
    {
        "message": {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "update_todo_list", "arguments": json.dumps({"todos": "[-] read the data"})},
                }
            ],
        },
        "finish_reason": "tool_calls",
        "usage": {"prompt_tokens": 1200, "completion_tokens": 80, "prompt_tokens_details": {"cached_tokens": 200}},
    },
    {
        "message": {"role": "assistant", "content": "The data says 42."},
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 1500, "completion_tokens": 40},
    },
]
# USD per million tokens: uncached input 2, cached input 0.5, output 8.
PRICE = Price(input_per_mtok=2, output_per_mtok=8, cache_read_per_mtok="0.5")  # type: ignore[arg-type]
# (1000 * 2 + 200 * 0.5 + 80 * 8) + (1500 * 2 + 40 * 8) micro-USD
EXPECTED_COST_MICROS = 2740 + 3320


S = TypeVar("S", bound=ThreadingHTTPServer)


class JsonHandler(BaseHTTPRequestHandler):
    """A handler that answers JSON and logs nothing (the two test servers below)."""

    def reply_json(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        return None


class ChatServer(ThreadingHTTPServer):
    requests_seen: list[dict[str, Any]]


class Handler(JsonHandler):
    server: ChatServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions" or self.headers.get("Authorization") != "Bearer local-test-key":
            self.send_error(404)
            return
        self.server.requests_seen.append(body)
        reply = REPLIES[len(self.server.requests_seen) - 1]
        usage = {
            **reply["usage"],
            "total_tokens": reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"],
        }
        payload = json.dumps({
            "id": f"chatcmpl-{len(self.server.requests_seen)}", "object": "chat.completion", "created": 0,
            "model": body["model"], "usage": usage,
            "choices": [{"index": 0, "message": reply["message"], "finish_reason": reply["finish_reason"]}],
        }).encode()  # fmt: skip
        self.reply_json(200, payload)


@contextmanager
def serving(server: S) -> Iterator[S]:
    """The server answering on a thread of its own until the block ends."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def chat_server() -> Iterator[ChatServer]:
    server = ChatServer(("127.0.0.1", 0), Handler)
    server.requests_seen = []
    with serving(server):
        yield server


def test_a_tool_calling_agent_against_an_openai_compatible_endpoint(
    settings: Settings, chat_server: ChatServer
) -> None:
    host, port = chat_server.server_address[:2]
    profile = Profile(
        model="openai:local-model", base_url=f"http://{host!s}:{port}/v1", api_key="local-test-key", price=PRICE
    )  # type: ignore[arg-type]
    local = settings.model_copy(update={"queue": "subq-nobody", "profiles": {"local": profile}})
    coord = Coordinator(local)
    task = coord.create_task("Read the data and report.", profile="local", run=True)

    result = run_child(build_runtime(local, make_app(local)), task.id)

    assert result.status == "completed" and result.summary == "The data says 42."
    record = coord.get_task(task.id)
    assert (record.requests, record.tokens_in, record.tokens_out, record.cache_reads) == (2, 2700, 120, 200)
    assert record.cost_micros == record.total_cost_micros == EXPECTED_COST_MICROS
    assert record.cost_source == "profile price"
    assert [t.content for t in coord.get_todos(task.id)] == ["read the data"]
    assert len(chat_server.requests_seen) == 2
    second = chat_server.requests_seen[1]["messages"]
    tool_reply = next(m for m in second if m["role"] == "tool")
    assert tool_reply["tool_call_id"] == "call_1" and "Todo list updated" in tool_reply["content"]
    tools = {t["function"]["name"] for t in chat_server.requests_seen[0]["tools"]}
    assert {"update_todo_list", "new_task", "run_subagents", "attempt_completion"} <= tools
    assert record.status == TaskStatus.COMPLETED
    coord.close()


# -- a failing server: one attempt per subq retry, one clear line, keys from the standard variable --


class FailingServer(ThreadingHTTPServer):
    attempts: int
    status: int
    error: dict[str, Any]


class FailingHandler(JsonHandler):
    server: FailingServer

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Authorization") != "Bearer key-from-the-environment":
            self.send_error(401)
            return
        self.server.attempts += 1
        payload = json.dumps({"error": self.server.error}).encode()
        self.reply_json(self.server.status, payload)


@pytest.fixture
def failing_server() -> Iterator[FailingServer]:
    server = FailingServer(("127.0.0.1", 0), FailingHandler)
    server.attempts = 0
    with serving(server):
        yield server


# Where each error line says the request went: the profile, the model and the endpoint, never the key.
WHERE = "profile 'local', model openai:local-model, endpoint 127.0.0.1:{port}"
SERVER_ERROR = {"message": "The server had an error while processing your request.", "type": "server_error"}
BAD_REQUEST = {"message": "Invalid 'messages': empty\n  array.", "type": "invalid_request_error", "code": None}


@pytest.mark.parametrize(
    ("status", "error", "attempts", "line", "error_class"),
    [
        (500, SERVER_ERROR, None, f"HTTP 500 server_error: {SERVER_ERROR['message']} ({WHERE}); gave up after {{waited}} s (model_wait_out_s=1)", "ModelServerError"),
        (400, BAD_REQUEST, 1, f"HTTP 400 invalid_request_error: Invalid 'messages': empty array. ({WHERE})", None),
    ],
    ids=["transient-500", "refused-400"],
)  # fmt: skip
def test_a_failing_request_is_sent_once_per_subq_attempt_and_fails_with_one_line(
    settings: Settings, failing_server: FailingServer, monkeypatch: pytest.MonkeyPatch,
    status: int, error: dict[str, Any], attempts: int | None, line: str, error_class: str | None,
) -> None:  # fmt: skip
    failing_server.status, failing_server.error = status, error
    host, port = failing_server.server_address[:2]
    # No api_key in the profile: the key comes from OPENAI_API_KEY, as the SDK users know it.
    monkeypatch.setenv("OPENAI_API_KEY", "key-from-the-environment")
    # Its provider is waited for a second (retried with backoff from the tests' 0.05 s), then the run fails.
    profile = Profile(
        model="openai:local-model", base_url=f"http://{host!s}:{port}/v1", price=PRICE, model_wait_out_s=1
    )
    local = load_settings(**{
        **settings.model_dump(exclude={"openai_api_key", "anthropic_api_key"}),
        "queue": "subq-nobody", "profiles": {"local": profile},
    })  # fmt: skip
    coord = Coordinator(local)
    task = coord.create_task("Read the data and report.", profile="local", run=True)

    result = run_child(build_runtime(local, make_app(local)), task.id)

    if attempts is None:
        assert failing_server.attempts >= 3, "subq did not retry a transient error"
    else:
        assert failing_server.attempts == attempts, "the SDK retried on its own, or subq retried a refusal"
    record = coord.get_task(task.id)
    assert result.status == record.status == TaskStatus.FAILED
    # The seconds it waited are its own clock's, to a tenth: some, and under the wait-out when the next
    # (jittered) wait would have ended past it, which is then not started; more on a loaded host.
    expected = re.escape(line.format(port=port, waited="WAITED")).replace("WAITED", r"(\d+\.\d)")
    said = re.fullmatch(expected, record.error or "")
    assert said is not None, record.error
    assert all(float(waited) > 0 for waited in said.groups()) and "\n" not in record.error
    assert json.loads(record.error_detail) == error, "the provider's error body (as its SDK gives it) is kept"
    if error_class is not None:
        assert record.error_class == error_class
    counted = int(coord.store.records.task_field(task.id, "transient_errors") or 0)
    assert counted == failing_server.attempts - 1, "each subq retry is counted once"
    coord.close()


def test_a_profile_without_a_key_and_no_standard_variable_is_refused_naming_both(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator import ProfileError
    from workers.runtime.providers import build_model

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    local = load_settings(**{
        **settings.model_dump(exclude={"openai_api_key", "anthropic_api_key"}),
        "profiles": {"claude": Profile(model="anthropic:claude-sonnet-4-5")},
    })  # fmt: skip
    with pytest.raises(ProfileError, match=r"needs an api_key \(in the profile, or in ANTHROPIC_API_KEY\)"):
        build_model(local.profile("claude"), name="claude")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-from-env")
    keyed = load_settings(**{**local.model_dump(exclude={"openai_api_key", "anthropic_api_key"})})
    assert keyed.profile("claude").api_key is not None
    assert keyed.profile("claude").api_key.get_secret_value() == "sk-ant-from-env"
    assert keyed.profiles["claude"].api_key is None, "the configured profile itself is unchanged"


def test_a_tool_call_id_from_the_model_cannot_hide_a_requests_cost(settings: Settings) -> None:
    """A priced call's spend is keyed by the call's id, which the model names, among the task's request keys (a
    space-separated list). An id "x 1:2" put there the key of the run's own second request, whose cost was then
    never counted: not on the task, its parents, or any budget."""
    price = Price(input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))
    priced_call = {"name": "add_numbers", "arguments": {"a": 1, "b": 2}, "id": "x 1:2"}
    with ModelServer([Turn(calls=[priced_call]), Turn(text="3")]) as server:
        profile = Profile.model_validate({
            "model": "openai:test-model", "base_url": server.base_url, "api_key": server.key, "price": price,
            "tools": ["tests.tool_kit:add_numbers"], "tool_prices": {"add_*": "0.25"},
        })  # fmt: skip
        local = settings.model_copy(
            update={"queue": "subq-nobody", "key_prefix": "subqcallid", "profiles": {**settings.profiles, "p": profile}}
        )
        coord = Coordinator(local)
        task = coord.create_task("Add one and two.", profile="p", run=True)

        assert run_child(build_runtime(local, make_app(local)), task.id).status == "completed"

        answered = [seen.usage for seen in server.seen if seen.status == 200]
        each = [
            int(tokens_in * price.input_per_mtok + tokens_out * price.output_per_mtok)
            for tokens_in, tokens_out in answered
        ]
        done = coord.get_task(task.id)
        assert len(each) == 2 and done.requests == 2, "both of the run's requests are counted"
        assert done.cost_micros == sum(each) + 250_000, "each request's cost and the call's price"
        coord.client.delete("subq-nobody")
        coord.close()
