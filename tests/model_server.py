"""A misbehaving OpenAI-compatible chat-completions server on 127.0.0.1, for tests.

`ModelServer` is a real HTTP server (the standard library's, in a thread of the
test process), so a real `celery worker` process reaches it over loopback as it
would a hosted provider. It is stateless about conversations: the answer to a
request is the `turns` entry at the number of assistant messages the request
carries, so any number of tasks can talk to one server at once.

    with ModelServer(turns=[Turn(calls=[call("update_todo_list", todos="[-] x")]), Turn(text="done")]) as server:
        profile = Profile(model="openai:test-model", base_url=server.base_url, api_key=server.key)
        server.fail(503, for_s=40)                               # an outage from now
        server.fail(429, times=1, headers={"Retry-After": "4"})  # the next request is rate limited
        ...
        server.seen   # every request: when it came, what it was answered, its body

A failure takes the place of the answer while it lasts (for `for_s` seconds, or
`times` requests, or both: whichever ends first); failures queue in the order
given, `status=0` closes the connection without an answer, and `status=200`
answers as usual (so `script([503, 200, 404])` scripts the next three requests).
One server serves any model name a request asks for, as a hosted endpoint or a
proxy serves many; a failure given a `model` takes the place of that model's
answers only (`server.fail(503, model="primary-model")`: the other models of the
same host and port answer as usual).

A 200 that is no usable answer, as gateways and proxies send them (`body`: bytes sent as they are, or JSON):

    server.fail(200, times=1, body={"choices": []})                         # an empty answer
    server.fail(200, times=1, body={"error": {"message": "Upstream error", "code": 502}})  # a gateway's error
    Turn(text="a long report", finish_reason="length")   # an answer the output limit cut
    Turn(text="done", usage=False)                        # an answer that reports no usage

A context window, as a hosted model has one (tests of compaction, docs/context.md):

    ModelServer(turns, max_prompt_tokens=6000, by_call_ids=True, summary="...")

- `max_prompt_tokens`: a request whose prompt counts more tokens is refused as OpenAI refuses it
  (400, code `context_length_exceeded`); every answer reports the prompt's count as its prompt
  tokens. A prompt counts `PROMPT_CHARS_PER_TOKEN` characters of its messages' and tools' JSON a token.
- `by_call_ids`: the answer is the turn after the highest `call_<n>_...` id among the request's
  assistant tool calls (the first turn when it has none), not the count of its assistant messages,
  which a compacted conversation no longer holds.
- A request that offers no tools is a summariser's: it is answered `summary`, not a turn.
"""

from __future__ import annotations

import json
import math
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from coordinator.local.ports import free_port

__all__ = ["PROMPT_CHARS_PER_TOKEN", "USAGE", "Failure", "ModelServer", "Seen", "Turn", "call", "free_port"]

# Each answer's usage, so a test can work out its price: (prompt tokens, completion tokens).
USAGE = (1000, 50)
# How a server with a window counts a prompt: characters of its messages' and tools' JSON a token (about
# what a BPE tokenizer gives for English and JSON; subq's own estimate must count more, never fewer).
PROMPT_CHARS_PER_TOKEN = 4
# What a summariser's request (one that offers no tools) is answered, and its completion tokens.
SUMMARY = "Summary: the earlier turns read data and noted it; nothing else is pending."
SUMMARY_TOKENS = 40
# An assistant tool call's id, as this server makes them: call_<turn>_<index>.
CALL_ID = re.compile(r"^call_(\d+)_\d+$")
# The placeholder key a keyless local server takes (the profile still needs one).
KEY = "model-server-key"
# Error bodies as OpenAI sends them, by status.
ERRORS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "Invalid request: the test server refuses it."),
    401: ("invalid_api_key", "Incorrect API key provided."),
    403: ("permission_denied", "You are not allowed to use this model."),
    404: ("model_not_found", "The model does not exist."),
    429: ("rate_limit_exceeded", "Rate limit reached for requests."),
    500: ("server_error", "The server had an error while processing your request."),
    502: ("server_error", "Bad gateway."),
    503: ("server_error", "The server is overloaded or not ready yet."),
}


def call(tool: str, **args: Any) -> dict[str, Any]:
    """One tool call of a turn: the tool's name and its arguments."""
    return {"name": tool, "arguments": args}


@dataclass(frozen=True)
class Turn:
    """One answer: text, or tool calls (several in one response, as real models batch them)."""

    text: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None  # None: "tool_calls" for calls, else "stop"
    usage: bool = True  # False: the answer carries no `usage` object (some servers leave it out)


@dataclass
class Failure:
    """An error answered instead of a turn, until `until` (monotonic seconds) or `times` more requests."""

    status: int
    until: float | None = None
    times: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # only the requests for this model name; None: every request
    body: bytes | None = None  # with status 200: this body is the answer (no turn is answered)


@dataclass(frozen=True)
class Seen:
    """A request the server received: when (monotonic and wall clock), what it answered, the body."""

    at_s: float
    wall_s: float
    status: int
    body: dict[str, Any]
    prompt_tokens: int = 0  # as the server counted the prompt (`prompt_tokens_of`)
    usage: tuple[int, int] = (0, 0)  # the answer's (prompt, completion) tokens; (0, 0) when not answered
    turn: bool = True  # answered with a turn (False: an error, or a 200 with a failure's `body`)

    @property
    def model(self) -> str:
        return str(self.body.get("model", ""))

    @property
    def summarising(self) -> bool:
        """A summariser's request: it offers the model no tools."""
        return not self.body.get("tools")


def prompt_tokens_of(body: dict[str, Any]) -> int:
    """The prompt's tokens as a server with a window counts them: its messages' and tools' JSON characters."""
    chars = len(json.dumps(body.get("messages", []))) + len(json.dumps(body.get("tools", [])))
    return math.ceil(chars / PROMPT_CHARS_PER_TOKEN)


class ModelServer:
    """A scriptable OpenAI-compatible server; start with `with`, or `start()` and `stop()`."""

    def __init__(
        self,
        turns: list[Turn] | None = None,
        *,
        key: str = KEY,
        latency_s: float = 0.0,
        max_prompt_tokens: int | None = None,
        by_call_ids: bool = False,
        summary: str = SUMMARY,
        port: int = 0,
        killed_after: int | None = None,
    ) -> None:
        """`port`: 0 for a free one; a given port starts a server again where one was stopped (a restart).
        `killed_after`: it stops as `stop` does once it has answered that many requests, before it reads
        another (a server killed under a running task, at a known step however slowly the test polls)."""
        self.turns = turns or [Turn(text="done")]
        self.key = key
        self.latency_s = latency_s
        self.max_prompt_tokens = max_prompt_tokens
        self.by_call_ids = by_call_ids
        self.summary = summary
        self.killed_after = killed_after
        self.seen: list[Seen] = []
        self._failures: list[Failure] = []
        self._lock = threading.Lock()
        self._http = _Http(("127.0.0.1", port), _Handler)
        self._http.model_server = self
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True, name="model-server")

    @property
    def port(self) -> int:
        return int(self._http.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ModelServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop as a killed server stops: no new connection is taken, and every open one is dropped (a client's
        kept-alive connection would otherwise go on being served by its handler's thread)."""
        self._http.shutdown()
        self._http.server_close()
        with self._lock:
            connections = list(self._http.open_connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def fail(
        self,
        status: int,
        *,
        for_s: float | None = None,
        times: int | None = None,
        headers: dict[str, str] | None = None,
        model: str | None = None,
        body: bytes | dict[str, Any] | None = None,
    ) -> None:
        """Answer `status` (0: drop the connection) for `for_s` seconds from now and/or `times` requests;
        with neither, for good (until `heal`). With `model`, only the requests for that model name; with
        `body` (bytes as they are, else JSON), that body instead of the status's error (of a 200: of a turn)."""
        until = None if for_s is None else time.monotonic() + for_s
        raw = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        with self._lock:
            self._failures.append(Failure(status, until, times, dict(headers or {}), model, raw))

    def script(self, statuses: list[int]) -> None:
        """The next requests' statuses in order, one each (200: answered as usual); then as before."""
        for status in statuses:
            self.fail(status, times=1)

    def heal(self) -> None:
        """Drop every failure still queued: the next request is answered."""
        with self._lock:
            self._failures.clear()

    @contextmanager
    def failing(self, status: int, **kwargs: Any) -> Iterator[None]:
        self.fail(status, **kwargs)
        try:
            yield
        finally:
            self.heal()

    def statuses(self) -> list[int]:
        with self._lock:
            return [s.status for s in self.seen]

    def answered(self) -> list[Seen]:
        """The requests answered with a turn (status 200)."""
        with self._lock:
            return [s for s in self.seen if s.status == 200 and s.turn]

    def _failure_now(self, model: str) -> Failure | None:
        with self._lock:
            now = time.monotonic()
            self._failures = [
                f for f in self._failures if (f.until is None or now < f.until) and (f.times is None or f.times > 0)
            ]
            failure = next((f for f in self._failures if f.model is None or f.model == model), None)
            if failure is None:
                return None
            if failure.times is not None:
                failure.times -= 1
            return None if failure.status == 200 and failure.body is None else failure

    def _record(self, status: int, body: dict[str, Any], usage: tuple[int, int] = (0, 0), *, turn: bool = True) -> None:
        with self._lock:
            self.seen.append(Seen(time.monotonic(), time.time(), status, body, prompt_tokens_of(body), usage, turn))

    def _turn_no(self, messages: list[dict[str, Any]]) -> int:
        assistant = [m for m in messages if m.get("role") == "assistant"]
        if not self.by_call_ids:
            return len(assistant)
        numbers = [
            int(found.group(1))
            for m in assistant
            for c in m.get("tool_calls") or []
            if (found := CALL_ID.match(str(c.get("id", "")))) is not None
        ]
        return max(numbers) + 1 if numbers else 0

    def _usage(self, body: dict[str, Any], completion: int) -> tuple[int, int]:
        """What an answer reports: the counted prompt where the server has a window, else the fixed USAGE."""
        return (prompt_tokens_of(body) if self.max_prompt_tokens is not None else USAGE[0]), completion

    def _answer(self, body: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, int]]:
        messages = body.get("messages", [])
        if not body.get("tools"):  # a summariser's request
            turn_no, turn = -1, Turn(text=self.summary)
            usage = self._usage(body, SUMMARY_TOKENS)
        else:
            turn_no = self._turn_no(messages)
            turn = self.turns[min(turn_no, len(self.turns) - 1)]
            usage = self._usage(body, USAGE[1])
        message: dict[str, Any] = {"role": "assistant", "content": turn.text}
        if turn.calls:
            message["tool_calls"] = [
                {
                    "id": c.get("id", f"call_{turn_no}_{index}"),  # a call may name its own id
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                }
                for index, c in enumerate(turn.calls)
            ]
        prompt, completion = usage
        finish = turn.finish_reason or ("tool_calls" if turn.calls else "stop")
        answer = {
            "id": f"chatcmpl-{len(self.seen)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", ""),
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        }  # fmt: skip
        if not turn.usage:
            del answer["usage"]
            usage = (0, 0)
        return answer, usage


class _Http(ThreadingHTTPServer):
    daemon_threads = True
    model_server: ModelServer

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self.open_connections: set[socket.socket] = set()


class _Handler(BaseHTTPRequestHandler):
    server: _Http
    protocol_version = "HTTP/1.1"

    def handle(self) -> None:
        with self.server.model_server._lock:
            self.server.open_connections.add(self.connection)
        try:
            super().handle()
        finally:
            with self.server.model_server._lock:
                self.server.open_connections.discard(self.connection)

    def do_POST(self) -> None:
        model_server = self.server.model_server
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {}
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._reply(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
            return
        if self.headers.get("Authorization") != f"Bearer {model_server.key}":
            model_server._record(401, body)
            self._reply(401, {"error": {"message": "Incorrect API key provided.", "type": "invalid_api_key"}})
            return
        failure = model_server._failure_now(str(body.get("model", "")))
        if failure is not None and failure.status == 0:
            model_server._record(0, body)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)  # no answer at all: a connection error for the client
            return
        if failure is not None and failure.body is not None:
            model_server._record(failure.status, body, turn=False)
            self._reply_raw(failure.status, failure.body, failure.headers)
            return
        if failure is not None:
            model_server._record(failure.status, body, turn=False)
            kind, message = ERRORS.get(failure.status, ("error", f"HTTP {failure.status}"))
            self._reply(failure.status, {"error": {"message": message, "type": kind, "code": kind}}, failure.headers)
            return
        limit, counted = model_server.max_prompt_tokens, prompt_tokens_of(body)
        if limit is not None and counted > limit:
            model_server._record(400, body)
            message = (
                f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
                f"{counted} tokens. Please reduce the length of the messages."
            )
            error = {"message": message, "type": "invalid_request_error", "param": "messages",
                     "code": "context_length_exceeded"}  # fmt: skip
            self._reply(400, {"error": error})
            return
        if model_server.latency_s:
            time.sleep(model_server.latency_s)
        answer, usage = model_server._answer(body)
        model_server._record(200, body, usage)
        self._reply(200, answer)
        if model_server.killed_after is not None and len(model_server.answered()) >= model_server.killed_after:
            # In this connection's own thread: the client's next request on it is not read before the stop drops it.
            model_server.stop()

    def _reply(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._reply_raw(status, json.dumps(payload).encode(), headers)

    def _reply_raw(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None
