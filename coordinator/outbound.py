"""Outbound events: a tree's subscriptions, the safe-target rule, and the deliverer (docs/webhooks.md).

An event (a root's end, a child's when asked, ...) is written into the tree's
outbox by the very Lua step that makes the state change (`outbox_add.lua`, from
finish_task, stop_tasks): the two commit together, so no crash between them can
lose one. Delivery is off the hot path: every worker process runs a
`Deliverer` in a thread of its own (workers/outbound.py) that claims due
deliveries from `<p>:outbox` with a lease, makes one attempt each on its own
non-blocking sockets, and settles it (`settle_and_claim.lua` settles a batch, claims
the next and reads what its attempts need, by settle_delivery's, claim_deliveries'
and read_claimed's rules): delivered (2xx), retrying at its next time (capped,
jittered backoff), gone (410: its subscription ends) or given up (past
`SUBQ_WEBHOOK_RETRY_FOR_S`). A worker killed mid-attempt leaves its claim to
lapse, and another worker takes the delivery then: at least once, with the same
`webhook-id` (the event id), which the receiver uses to drop a repeat.

Targets (coordinator/subscriptions.py's rule) are checked at creation and again
at each attempt, which connects to the very address it checked (no DNS
rebinding between the check and the connect); redirects are not followed.

A Celery callback (`on_complete`) is a subscription too: its attempt sends the
named task by name, with the root's record (JSON) as its argument and
`subq-<delivery id>` as its task id, so a redelivery is recognisable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import ipaddress
import json
import logging
import os
import queue
import random
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple, cast
from urllib.parse import SplitResult, quote, urlsplit

import h11

from coordinator.errors import CorruptError, NotFoundError
from coordinator.inputs import one_line, visible_text
from coordinator.models import ClaimedDelivery, Settled
from coordinator.settings import WEBHOOK_CLAIM_MARGIN_S
from coordinator.subscriptions import UnsafeTarget, resolve_safe

if TYPE_CHECKING:
    from standardwebhooks.webhooks import Webhook

    from coordinator.service import Coordinator

__all__ = ["MAX_RESULT_CHARS", "Deliverer", "payload", "slack_line"]

log = logging.getLogger(__name__)

# An end's `result` in a payload: enough to read; the whole record is one GET away.
MAX_RESULT_CHARS = 4000
# How often an idle deliverer looks for due deliveries: an approval reaches its sink within a second or two.
# A busy one reads its attempts' answers this often.
POLL_S = 0.25
# While attempts are in flight (or deliveries were due), a process claims again this often, or sooner once
# half its slots' attempts have ended: a claim's round trips were most of what a delivery cost at a tree's
# pace (12 ends a second a process: 3 a claim every 0.25 s cost 1.1 ms of CPU a delivery, 12 a claim every
# second 0.43 ms; docs/benchmarks.md), and an event still leaves within a second, as at the idle pace.
BUSY_TICK_S = 1.0
USER_AGENT = "subq-webhooks"
# What of an answer's body is read: a receiver's answer is its status; a longer body closes the connection.
MAX_ANSWER_BYTES = 64 * 1024
# An idle keep-alive connection is reused this long: under the usual servers' keep-alive timeout (5 s), so
# a receiver seldom closes one under an attempt (an attempt on a closed one is made again on a new one).
KEEP_IDLE_S = 4.0
# An answer's head longer than this is not a webhook receiver's answer: the attempt fails.
MAX_HEAD_BYTES = 64 * 1024
# Interim (1xx) answers one POST takes before its answer: HTTP/1.1 allows several (a 100 Continue, 103 Early
# Hints), none sends this many. Each is small and comes at once, so a receiver streaming them without end held
# the deliverer's one thread in its read (no timeout ends a read that always has data): every attempt of the
# process, every tenant's, waited on it.
MAX_INTERIM_ANSWERS = 16
# What one read of a socket takes: a receiver's whole answer, as a rule.
READ_CHUNK = 64 * 1024
# A URL's path and query are sent as given but for these: spaces, controls and non-ASCII are %-encoded.
URL_SAFE = "!#$%&'()*+,/:;=?@[]~"
# How often `Connections.post` (one POST, waited for) looks for its answer.
POST_LOOK_S = 0.01
# Threads for what would block the loop, a Celery callback's send: a slow broker holds these, never the
# attempts in flight.
HELPERS = 2
# Threads that resolve host names, apart from the helpers: a name server that never answers holds one (the
# attempts of one host share its resolution), never a Celery callback. RESOLVERS are kept; while every thread is
# busy, a name to look up starts one more, up to MAX_RESOLVERS, which leaves after RESOLVER_IDLE_S with nothing to
# do: one tree's hanging names (another tenant's, say) hold other trees' hosts back only past MAX_RESOLVERS of them.
# Each attempt waits at most its timeout for its host (`_expire_resolving`).
RESOLVERS = 8
MAX_RESOLVERS = 64
RESOLVER_IDLE_S = 30.0
# Address hosts whose check a deliverer keeps (a host's check is pure): more than any fleet's receivers.
MOST_LITERALS = 1024
# Subscriptions whose parsed URL and signer a deliverer keeps (`Target`): as many, for the same reason.
MOST_TARGETS = 1024
# How a POST that got no answer within its timeout ends its failure's line (`ReadTimeout: timed out`).
TIMED_OUT = ": timed out"


def payload(entry: Mapping[str, Any], record: Mapping[str, Any], api_url: str | None = None) -> dict[str, Any]:
    """An event's body: its id, type and time, the tree and task, the metadata, and an end's outcome and figures.

    `record` is the task's record as GET /v1/tasks/{id} returns it, or at least its EVENT_FIELDS (the
    store's outbox part); the event's own status (an end's) is its type's, whatever the record says now (a
    retry may have moved it on since). Tokens in and out are the task's own, `tokens` its subtree's (the
    record's `total_tokens`), as `cost_micros` and `total_cost_micros`."""
    event_type = str(entry["type"])
    data: dict[str, Any] = {
        "tree_id": record.get("root_id"),
        "task_id": entry["task_id"],
        "metadata": record.get("metadata") or {},
        # The task in the web view (SUBQ_API_URL: the address people reach the API at), where a person decides.
        "link": f"{api_url.rstrip('/')}/ui/tasks/{entry['task_id']}" if api_url else None,
    }
    family, _, what = event_type.partition(".")
    if family in ("task", "child"):
        summary = str(record.get("summary") or "")
        data.update(
            status=what,
            result=summary if len(summary) <= MAX_RESULT_CHARS else summary[: MAX_RESULT_CHARS - 1] + "…",
            output=record.get("output"),
            tokens_in=record.get("tokens_in"),
            tokens_out=record.get("tokens_out"),
            tokens=record.get("total_tokens"),
            total_cost_micros=record.get("total_cost_micros"),
            cost_micros=record.get("cost_micros"),
            error=record.get("error"),
            error_class=record.get("error_class"),
        )
    data.update(entry.get("fields") or {})
    stamp = datetime.fromtimestamp(float(entry["ts"]), UTC).isoformat().replace("+00:00", "Z")
    return {"id": entry["event_id"], "type": event_type, "timestamp": stamp, "data": data}


def _slack_text(text: str) -> str:
    # Slack's mrkdwn reads these three as markup (a link, a mention); escaped, a model's text stays text. A bidi
    # override or a zero-width character would make a tool call read as another: written as its escape.
    return visible_text(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_line(body: Mapping[str, Any]) -> str:
    """An event as one line of a Slack incoming-webhook message, with a link to the item in the web view."""
    data = body["data"]
    what = str(body["type"])
    if what == "approval.requested":
        text = f"approval waiting: {data.get('tool')} {one_line(str(data.get('arguments') or ''), 200)}"
    elif what == "approval.decided":
        text = f"approval {data.get('status')} by {data.get('decided_by') or 'its deadline'}: {data.get('tool')}"
    elif what == "budget.warning":
        text = f"budget {data.get('share_percent')}% spent"
    else:
        text = f"{what}: {data.get('status')}"
    line = f"subq: {_slack_text(text)} (task {data.get('task_id')})"
    return f"{line} <{data['link']}|open in subq>" if data.get("link") else line


class Attempt:
    """One attempt's outcome: the state to settle and the answer's line."""

    def __init__(self, state: str, last: str) -> None:
        self.state, self.last = state, last


class Target(NamedTuple):
    """What a subscription's attempts share, made once a process (`Deliverer._target`): its URL parsed, its
    signer (None without a secret), and whether it takes Slack's body."""

    url: SplitResult
    signer: Webhook | None
    slack: bool


class Exchange:
    """One POST on one connection, moved on by `Connections` as its socket allows: `connect` (and, over
    TLS, `handshake`) and `send` are driven as soon as the socket is ready; `read` waits for the answer,
    read at the deliverer's next tick. `token` is the caller's, handed back with the outcome."""

    __slots__ = (
        "address", "answer", "deadline", "heard", "key", "out", "post", "reused", "sock", "stage", "tls_host",
        "token", "watched",
    )  # fmt: skip

    def __init__(
        self, token: object, key: tuple[str, str, int, str], post: Post, deadline: float, tls_host: str | None
    ) -> None:
        self.token, self.key, self.deadline, self.tls_host = token, key, deadline, tls_host
        self.address, self.post = key[3], post
        self.answer = Answer(post)
        self.out = memoryview(self.answer.request)
        self.heard = False  # any byte of an answer came (a reused connection's failure before that is retried)
        self.reused = False
        self.sock: socket.socket | None = None
        self.stage = "connect"
        self.watched: selectors.BaseSelector | None = None  # the selector its socket is registered with


class Connections:
    """Keep-alive HTTP connections, each to one checked address, and the POSTs in flight on them, all moved
    on by one thread (the deliverer's loop) over non-blocking sockets: no thread is woken per attempt.

    `start()` begins a POST (on an idle connection to the very address it checked, or a new one: the
    socket goes to that address; the Host header and TLS's SNI and certificate check use the host's name);
    `drive(wait_s)` moves on the connects, TLS handshakes and sends as their sockets become ready, for at
    most `wait_s` (it returns early on `wake()`, from another thread); `collect()` reads the answers that
    came since, in one wake-up however many, and times out the late. Each returns the POSTs that ended as
    (token, status, '') on an answer or (token, 0, the failure's line) on none. A connection is kept for
    the next POST only when its answer was read whole (`Answer`, by h11: a body within MAX_ANSWER_BYTES,
    HTTP/1.1, no `Connection: close`); a POST on an idle connection the receiver closed meanwhile is made once more
    on a new one. docs/benchmarks.md: an attempt over the standard library's blocking client in a pool
    thread cost a busy worker 1 to 3.7 ms of CPU, mostly its thread's wake-ups beside the runs' threads.
    """

    def __init__(self, most_idle: int, tls: ssl.SSLContext | None = None) -> None:
        self.most_idle = most_idle
        self._idle: dict[tuple[str, str, int, str], list[tuple[socket.socket, float]]] = {}
        self._urgent = selectors.DefaultSelector()  # connecting, handshaking or sending: driven at once
        self._answers = selectors.DefaultSelector()  # waiting for an answer: read at a tick
        self._live: dict[object, Exchange] = {}
        self._tls = tls  # the system's trust, made at the first https POST (a test hands its own CA's)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._urgent.register(self._wake_r, selectors.EVENT_READ, None)

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def wake(self) -> None:
        """End a `drive()` early (any thread): a helper has work for the loop."""
        with contextlib.suppress(OSError):  # a full pipe is already a wake-up
            self._wake_w.send(b"\0")

    def start(
        self,
        token: object,
        url: SplitResult,
        address: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> list[tuple[object, int, str]]:
        """Begin a POST of `body` to `url` at `address`; what ended already (a send refused at once)."""
        host = url.hostname or ""
        port = _port(url)
        path = quote((url.path or "/") + (f"?{url.query}" if url.query else ""), safe=URL_SAFE)
        key = (url.scheme, host, port, address)
        tls_host = host if url.scheme == "https" else None
        try:
            if not _sendable(headers):
                raise h11.LocalProtocolError("a header value with a line break, or not ASCII")
            # As bytes: h11 takes them as they are (str it encodes first, a quarter of a Request's cost).
            head = [(name.encode(), value.encode()) for name, value in headers.items()]
            head.append((b"content-length", b"%d" % len(body)))
            post = Post(h11.Request(method=b"POST", target=path.encode(), headers=head), body)
            exchange = Exchange(token, key, post, time.monotonic() + timeout_s, tls_host)
        except h11.LocalProtocolError as exc:
            return [(token, 0, one_line(f"RemoteProtocolError: the request cannot be sent to {url.netloc}: {exc}"))]
        self._live[token] = exchange
        ended: list[tuple[object, int, str]] = []
        idle = self._take(key)
        if idle is not None:  # still registered for reads (`_give_back`): its exchange's now
            exchange.sock, exchange.reused, exchange.stage, exchange.watched = idle, True, "send", self._answers
            self._send(exchange, ended)
        else:
            self._connect(exchange, ended)
        return ended

    def drive(self, wait_s: float) -> list[tuple[object, int, str]]:
        """Move on the connects, handshakes and sends for at most `wait_s`, as their sockets allow; returns
        early, with what ended, once nothing is left to drive or on `wake()`."""
        ended: list[tuple[object, int, str]] = []
        until = time.monotonic() + wait_s
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return ended
            for selected, _ in self._urgent.select(left):
                exchange = selected.data
                if exchange is None:  # the wake pipe
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    return ended
                self._move(exchange, ended)
            if ended:
                return ended

    def collect(self) -> list[tuple[object, int, str]]:
        """Read the answers that came (one look at every socket waiting for one), and end the POSTs past
        their timeout."""
        ended: list[tuple[object, int, str]] = []
        for selected, _ in self._answers.select(0):
            if isinstance(selected.data, Exchange):
                self._read(selected.data, ended)
            else:  # an idle connection the receiver closed (or wrote to unasked): not used again
                self._close_idle(selected.data, cast(socket.socket, selected.fileobj))
        now = time.monotonic()
        for exchange in [e for e in self._live.values() if e.deadline <= now]:
            if exchange.answer.status:
                # Its head came and its body did not end in time: the receiver answered (a 2xx took the event),
                # the connection is not used again. Taken for a timeout, the event was sent again until given up,
                # and the host's every other delivery held back as a silent host's.
                self._end(exchange, ended, exchange.answer.status, "", keep=False)
                continue
            phase = {"connect": "Connect", "handshake": "Connect", "send": "Write"}.get(exchange.stage, "Read")
            self._end(exchange, ended, 0, f"{phase}Timeout{TIMED_OUT}", keep=False)
        return ended

    def post(
        self, url: SplitResult, address: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, str]:
        """One POST, waited for: (status, '') on an answer, (0, the failure's line) on none."""
        token = object()
        ended = self.start(token, url, address, body, headers, timeout_s)
        while True:
            for done, status, failure in ended:
                if done is token:
                    return status, failure
            ended = self.drive(POST_LOOK_S) + self.collect()

    def close(self) -> None:
        for exchange in list(self._live.values()):
            self._end(exchange, [], 0, "closed", keep=False)
        for idle in self._idle.values():
            for sock, _ in idle:
                sock.close()
        self._idle.clear()
        self._urgent.close()
        self._answers.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- one exchange's steps ----------------------------------------------------------

    def _connect(self, exchange: Exchange, ended: list[tuple[object, int, str]]) -> None:
        family = socket.AF_INET6 if ":" in exchange.address else socket.AF_INET
        exchange.stage, exchange.reused = "connect", False
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:  # out of file descriptors, say: this attempt's failure, not the loop's
            self._end(exchange, ended, 0, one_line(f"ConnectError: {exc}"), keep=False)
            return
        exchange.sock = sock
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            error = sock.connect_ex((exchange.address, exchange.key[2]))
        except OSError as exc:
            error = exc.errno or errno.EINVAL
        if error not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            self._end(exchange, ended, 0, f"ConnectError: [Errno {error}] {os.strerror(error)}", keep=False)
            return
        self._watch(exchange, self._urgent, selectors.EVENT_WRITE)

    def _move(self, exchange: Exchange, ended: list[tuple[object, int, str]]) -> None:
        if exchange.stage == "connect" and not self._connected(exchange, ended):
            return
        if exchange.stage == "handshake" and not self._shaken(exchange, ended):
            return
        if exchange.stage == "send":
            self._send(exchange, ended)

    def _connected(self, exchange: Exchange, ended: list[tuple[object, int, str]]) -> bool:
        """The connect ended: on to `send`, or to `handshake` over TLS. False when it failed (ended)."""
        sock = exchange.sock
        assert sock is not None
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            self._end(exchange, ended, 0, f"ConnectError: [Errno {error}] {os.strerror(error)}", keep=False)
            return False
        if exchange.tls_host is None:
            exchange.stage = "send"
            return True
        self._unwatch(exchange)
        if self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            exchange.sock = self._tls.wrap_socket(
                sock, server_hostname=exchange.tls_host, do_handshake_on_connect=False
            )
        except (OSError, ValueError) as exc:
            self._end(exchange, ended, 0, one_line(f"ConnectError: {exc}"), keep=False)
            return False
        exchange.stage = "handshake"
        self._watch(exchange, self._urgent, selectors.EVENT_WRITE)
        return True

    def _shaken(self, exchange: Exchange, ended: list[tuple[object, int, str]]) -> bool:
        """A step of the TLS handshake: True once it is done (on to `send`); False while it waits or when it
        failed (ended)."""
        tls = cast(ssl.SSLSocket, exchange.sock)
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            self._watch(exchange, self._urgent, selectors.EVENT_READ)
            return False
        except ssl.SSLWantWriteError:
            self._watch(exchange, self._urgent, selectors.EVENT_WRITE)
            return False
        except OSError as exc:
            self._end(exchange, ended, 0, one_line(f"ConnectError: {exc}"), keep=False)
            return False
        exchange.stage = "send"
        return True

    def _send(self, exchange: Exchange, ended: list[tuple[object, int, str]]) -> None:
        sock = exchange.sock
        assert sock is not None
        while exchange.out:
            try:
                exchange.out = exchange.out[sock.send(exchange.out) :]
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError) as exc:
                events = selectors.EVENT_READ if isinstance(exc, ssl.SSLWantReadError) else selectors.EVENT_WRITE
                self._watch(exchange, self._urgent, events)
                return
            except OSError as exc:
                if not self._again(exchange, ended):
                    self._end(exchange, ended, 0, one_line(f"WriteError: {exc}"), keep=False)
                return
        exchange.stage = "read"
        self._watch(exchange, self._answers, selectors.EVENT_READ)

    def _read(self, exchange: Exchange, ended: list[tuple[object, int, str]]) -> None:
        sock = exchange.sock
        assert sock is not None
        while True:
            try:
                data = sock.recv(READ_CHUNK)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except OSError as exc:
                if not exchange.heard and self._again(exchange, ended):
                    return
                status = exchange.answer.status  # a reset within the body of an answer whose head came: that one
                self._end(exchange, ended, status, "" if status else one_line(f"ReadError: {exc}"), keep=False)
                return
            if not data and not exchange.heard and self._again(exchange, ended):
                return  # an idle connection the receiver had closed: the POST goes again on a new one
            exchange.heard = True
            try:
                status, keep = exchange.answer.read(data)
            except h11.RemoteProtocolError as exc:  # (a body cut by a close, after a head: that head's answer)
                status = exchange.answer.status
                line = "" if status else one_line(f"RemoteProtocolError: not an HTTP answer: {exc}")
                self._end(exchange, ended, status, line, keep=False)
                return
            if status:
                self._end(exchange, ended, status, "", keep=keep)
                return
            if not data:  # closed: within the body of an answer whose head came, that answer; else none
                status = exchange.answer.status
                line = "" if status else "RemoteProtocolError: the receiver closed the connection without an answer"
                self._end(exchange, ended, status, line, keep=False)
                return
            if time.monotonic() >= exchange.deadline:
                return  # a receiver that never stops sending: `collect` ends the attempt at its timeout

    def _again(self, exchange: Exchange, ended: list[tuple[object, int, str]]) -> bool:
        """An idle connection the receiver closed meanwhile: the POST once more, on a new one. False for
        a connection of its own (the failure is the attempt's)."""
        if not exchange.reused:
            return False
        self._drop(exchange)
        exchange.answer = Answer(exchange.post)
        exchange.out = memoryview(exchange.answer.request)
        exchange.heard = False
        self._connect(exchange, ended)
        return True

    def _end(
        self, exchange: Exchange, ended: list[tuple[object, int, str]], status: int, failure: str, *, keep: bool
    ) -> None:
        self._live.pop(exchange.token, None)
        sock = exchange.sock
        if keep and sock is not None and exchange.watched is self._answers:
            self._give_back(exchange.key, sock)
            exchange.sock, exchange.watched = None, None
        else:
            self._drop(exchange)
        ended.append((exchange.token, status, failure))

    def _drop(self, exchange: Exchange) -> None:
        if exchange.sock is not None:
            self._unwatch(exchange)
            exchange.sock.close()
            exchange.sock = None

    @staticmethod
    def _watch(exchange: Exchange, selector: selectors.BaseSelector, events: int) -> None:
        assert exchange.sock is not None
        if exchange.watched is selector:
            selector.modify(exchange.sock, events, exchange)
            return
        Connections._unwatch(exchange)
        selector.register(exchange.sock, events, exchange)
        exchange.watched = selector

    @staticmethod
    def _unwatch(exchange: Exchange) -> None:
        if exchange.watched is not None and exchange.sock is not None:
            exchange.watched.unregister(exchange.sock)
        exchange.watched = None

    def _take(self, key: tuple[str, str, int, str]) -> socket.socket | None:
        now = time.monotonic()
        idle = self._idle.get(key, [])
        while idle:
            sock, since = idle.pop()
            if now - since < KEEP_IDLE_S:
                return sock
            self._answers.unregister(sock)
            sock.close()
        return None

    def _give_back(self, key: tuple[str, str, int, str], sock: socket.socket) -> None:
        """Keep a connection whose answer was read whole for the next POST to its address. It stays registered
        for reads, its data its pool's key: an idle connection the receiver closes shows at the next look
        (`collect`), and one taken again costs no system call to watch (a register and an unregister each
        POST were a third of the deliverer's system calls, each a hand-off of a busy worker's GIL)."""
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.most_idle:
            idle.append((sock, time.monotonic()))
            self._answers.modify(sock, selectors.EVENT_READ, key)
        else:
            self._answers.unregister(sock)
            sock.close()

    def _close_idle(self, key: tuple[str, str, int, str], sock: socket.socket) -> None:
        self._idle[key] = [(kept, since) for kept, since in self._idle.get(key, []) if kept is not sock]
        self._answers.unregister(sock)
        sock.close()


class Post(NamedTuple):
    """What one attempt sends: the request's head (h11's) and its body."""

    head: h11.Request
    body: bytes


def _host_header(url: SplitResult) -> str:
    """A URL's Host header, ASCII as HTTP's must be: an internationalised name as IDNA (`xn--...`, the name the
    resolver and TLS's SNI were given), an IPv6 address in brackets, and the port when the URL names one. Called
    once the host's check passed, so its name encodes (the check refuses one that does not)."""
    host = url.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    elif not host.isascii():
        host = host.encode("idna").decode("ascii")
    return host if url.port is None else f"{host}:{url.port}"


def _sendable(headers: Mapping[str, str]) -> bool:
    """Whether h11 takes these header values (ASCII, no line break)."""
    return all(value.isascii() and "\r" not in value and "\n" not in value for value in headers.values())


class Answer:
    """One POST and its answer on one connection, as HTTP/1.1 says (h11, the client's side of the exchange).

    `request` is the POST as sent. Interim (1xx) answers are skipped, MAX_INTERIM_ANSWERS at most. The connection serves the next POST
    only when the answer was read whole, its body within MAX_ANSWER_BYTES, and neither side means to close
    it; otherwise its status is taken as soon as its head is in, and the connection ends with it.
    """

    def __init__(self, post: Post) -> None:
        self._http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        sent = (self._http.send(event) for event in (post.head, h11.Data(data=post.body), h11.EndOfMessage()))
        self.request = b"".join(part for part in sent if part)
        self._status = 0
        self._body_bytes = 0
        self._interim = 0

    @property
    def status(self) -> int:
        """The answer's status once its head came (its body may still be coming), else 0."""
        return self._status

    def read(self, data: bytes) -> tuple[int, bool]:
        """Take what came (b'' when the receiver closed): (status, whether the connection serves on) once the
        answer is in, (0, False) before. h11.RemoteProtocolError for what is not an HTTP answer."""
        self._http.receive_data(data)
        while True:
            event = self._http.next_event()
            if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return 0, False
            if isinstance(event, h11.Response):
                self._status = event.status_code
                if not _may_keep(event):
                    return self._status, False
            elif isinstance(event, h11.Data):
                self._body_bytes += len(event.data)
                if self._body_bytes > MAX_ANSWER_BYTES:
                    return self._status, False
            elif isinstance(event, h11.EndOfMessage):
                keep = self._http.our_state is h11.DONE and self._http.their_state is h11.DONE and bool(data)
                return self._status, keep
            elif isinstance(event, h11.InformationalResponse):  # a 1xx: the answer is still to come
                self._interim += 1
                if self._interim > MAX_INTERIM_ANSWERS:
                    raise h11.RemoteProtocolError(f"more than {MAX_INTERIM_ANSWERS} interim (1xx) answers")


def _may_keep(response: h11.Response) -> bool:
    """Whether an answer's head lets its connection serve the next POST: HTTP/1.1, no `Connection: close`, and
    a body that ends before the connection does (a Content-Length, chunked, or none: a 204 or 304)."""
    fields = {name: value.lower() for name, value in response.headers}
    framed = b"content-length" in fields or b"chunked" in fields.get(b"transfer-encoding", b"")
    return (
        response.http_version == b"1.1"
        and b"close" not in fields.get(b"connection", b"")
        and (framed or response.status_code in (204, 304))
    )


def _attempts(entry: Mapping[str, Any]) -> int:
    """The attempts a claimed delivery had, which its outcome is recorded against (settle_delivery.lua, which
    reads what is no number as 0: so does this, rather than raise for an entry whose outcome must be recorded)."""
    try:
        return int(entry.get("attempts") or 0)
    except (TypeError, ValueError):
        return 0


def _is_celery(item: ClaimedDelivery) -> bool:
    """Whether the delivery's subscription is a Celery callback (`on_complete`)."""
    return item.found is not None and item.found[1].get("kind") == "celery"


def _port(url: SplitResult) -> int:
    """The port a URL names, or its scheme's."""
    return url.port or (443 if url.scheme == "https" else 80)


def _host_of(url: SplitResult) -> tuple[str, int]:
    """The URL's host as the deliverer keys it: its name (or address) and port (a resolution's, a hold's)."""
    return url.hostname or "", _port(url)


@dataclasses.dataclass(frozen=True)
class _Waiting:
    """An attempt waiting for its host name to resolve, until `deadline` (monotonic s): its timeout."""

    item: ClaimedDelivery
    target: Target
    body: Mapping[str, Any]
    deadline: float


class _Sent(NamedTuple):
    """A POST in flight: its delivery, and its host (host, port), which its outcome tells about."""

    item: ClaimedDelivery
    host: tuple[str, int]


class Deliverer:
    """Claims due deliveries and makes one attempt each, at most `SUBQ_WEBHOOK_CONCURRENCY` at once.

    One per worker process, in a loop thread of its own (`run_forever`) that makes the HTTP attempts too,
    over non-blocking sockets (`Connections`): each wake-up of a thread beside a busy worker's runs is CPU
    they need (docs/benchmarks.md), so the loop wakes once a tick (POLL_S) while attempts are in flight,
    whatever their number, and otherwise as `idle_wait_s()` says. Each tick's `step()` records, in one
    round trip, the outcomes of the attempts that ended since the last, claims as many due deliveries as
    there are free slots and reads what their attempts need (entries, targets and the event's fields of
    their records: `settle_and_claim`); the loop then sends them, moves on connects and sends as their
    sockets allow, and reads the answers that came at the tick's end. An attempt's outcome is recorded at the next step:
    until then its delivery stays claimed, and a worker dying in between has it sent again (at least once;
    the receiver drops a repeat by its webhook-id). Threads of their own do what would block the loop: a
    host name's resolution (RESOLVERS; the attempts of one host share one, and each waits at most its timeout)
    and a Celery callback's send (HELPERS). As the reconciler, the worker builds it with its
    Coordinator and it works with the plane alone: the outbox and records parts of the store and the
    settings; `send_task(name, args, task_id, queue)` sends a Celery callback.

    A host that answered no attempt within its timeout (a receiver that hangs, a name server that does) is
    sent one attempt a timeout's span until one is answered; its other deliveries claimed meanwhile end
    `retrying` at once, without a slot held for the span: else its backlog, due before every other tree's
    events, held the slots and every other receiver, another tenant's too, waited behind it.
    """

    def __init__(self, coord: Coordinator, send_task: Callable[[str, list[Any], str, str], None]) -> None:
        plane = coord.plane
        self.outbox, self.records, self.settings, self.send_task = (
            plane.store.outbox, plane.store.records, plane.settings, send_task
        )  # fmt: skip
        self.slots = plane.settings.webhook_concurrency
        self._busy = 0  # attempts claimed and not yet ended
        self._ended: list[Settled] = []  # attempts made, not yet recorded
        self._resolved: list[tuple[_Waiting, str, str]] = []  # resolved: each attempt, its address and refusal
        # A host name's resolution in flight, by (host, port): the attempts waiting on it. It stays while its
        # thread runs, past its attempts' deadlines too, so that later attempts of a host whose name server
        # hangs wait on the same resolution, not one thread each.
        self._resolving: dict[tuple[str, int], list[_Waiting]] = {}
        # The hosts a resolver thread is looking up now (the rest of `_resolving` waits in the queue for one).
        self._looking_up: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        # How long an idle loop waits before it looks again: a worker paces it by its fleet's size
        # (workers/outbound.py), so a fleet of any size looks about every POLL_S.
        self.idle_wait_s: Callable[[], float] = lambda: POLL_S
        self._helpers = ThreadPoolExecutor(max_workers=HELPERS, thread_name_prefix="subq-delivery")
        # (Daemon threads, started at the first name: a process's exit does not wait on a name server that hangs,
        # as it would on an executor's threads.)
        self._to_resolve: queue.SimpleQueue[tuple[tuple[str, int], SplitResult]] = queue.SimpleQueue()
        self._resolvers = 0  # resolver threads started and not left (under `_lock`)
        self._idle_resolvers = 0  # of them, those waiting for a name (under `_lock`)
        self._connections = Connections(self.slots)
        self._literals: dict[str, tuple[str, str]] = {}  # an address host's (address, refusal), checked
        # A host (host, port) whose last attempt got no answer within its timeout: when (monotonic s) the next
        # attempt may go to it (one a timeout's span, until one is answered).
        self._silent: dict[tuple[str, int], float] = {}
        self._targets: dict[tuple[str, str, str], Target] = {}  # a subscription's (url, secret, format)

    # -- the loop ----------------------------------------------------------------------

    def run_forever(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                claimed = 0
                try:
                    claimed = self.step()
                except Exception:  # Redis down: log it and look again
                    log.exception("subq deliveries: a claim failed")
                self.wait(BUSY_TICK_S if claimed or not self.idle() else self.idle_wait_s())
        finally:
            self._connections.close()

    def wait(self, span_s: float) -> None:
        """Until the next step: connects and sends move on as their sockets allow, attempts whose host a
        helper has resolved start, and the answers that came are read every POLL_S while attempts are in
        flight (one wake-up however many came). The wait ends early once half the slots' attempts have
        ended: in a burst, the next claim comes as soon as it is as large as a tick's at a tree's pace."""
        until = time.monotonic() + span_s
        while (left := until - time.monotonic()) > 0:
            with self._lock:
                looking = self._connections.in_flight or any(self._resolving.values())
            look_until = time.monotonic() + (min(left, POLL_S) if looking else left)
            while (look_s := look_until - time.monotonic()) > 0:
                self._answered(self._connections.drive(look_s))
                self._start_resolved()
            self._expire_resolving()
            self._answered(self._connections.collect())
            with self._lock:
                if len(self._ended) * 2 >= self.slots:
                    return

    def step(self) -> int:
        """Record the attempts that ended, claim due deliveries for the free slots and start their
        attempts; how many were claimed."""
        with self._lock:
            ended, self._ended = self._ended, []
            free = self.slots - self._busy
        # A claim outlives an attempt's timeout by a margin, so a live attempt is never taken twice.
        lease_ms = int((self.settings.webhook_timeout_s + WEBHOOK_CLAIM_MARGIN_S) * 1000)
        try:
            claimed = self.outbox.settle_and_claim(ended, free, lease_ms)
        except Exception:
            # Redis away: recorded at the next step (their claims hold meanwhile). Only the call raises here,
            # never its reply's decoding (a claimed delivery that does not decode comes back `refused`): once
            # the script has replied, putting them back settled each twice.
            with self._lock:
                self._ended[:0] = ended
            raise
        if not claimed:
            return 0
        # A read that fails (Redis away) leaves the claims to lapse: the deliveries are due again then.
        items = self._whole_records(claimed)
        with self._lock:
            self._busy += len(items)
        for item in items:
            try:
                self._begin(item)
            except Exception:  # a fault of ours: the claim lapses and the delivery is due again
                log.exception("subq deliveries: %s failed", item.delivery_id)
                self._done(None)
        return len(claimed)

    def idle(self) -> bool:
        """No attempt in flight and none waiting to be recorded."""
        with self._lock:
            return self._busy == 0 and not self._ended

    def _whole_records(self, claimed: list[ClaimedDelivery]) -> list[ClaimedDelivery]:
        """The claim as read with it (the event's fields of each record), but for a Celery callback, which sends
        its task's whole record, with its children's ids: that one read here (None when the task expired;
        `refused`, to be given up, when it does not decode)."""
        task_ids = [str(item.entry["task_id"]) for item in claimed if _is_celery(item)]
        if not task_ids:
            return claimed
        records = self._records(list(dict.fromkeys(task_ids)))

        def whole(item: ClaimedDelivery) -> ClaimedDelivery:
            record = records.get(str(item.entry["task_id"]))
            if isinstance(record, str):  # it does not decode: this callback alone is given up, with why
                return dataclasses.replace(item, record=None, refused=record)
            return dataclasses.replace(item, record=record)

        return [whole(item) if _is_celery(item) else item for item in claimed]

    def _records(self, task_ids: list[str]) -> dict[str, dict[str, Any] | str]:
        """The tasks' whole records as GET /v1/tasks/{id} returns them, or why one does not decode; a task that
        expired is left out."""
        if not task_ids:
            return {}
        try:
            found = self.records.get_records(task_ids, whole=True)
            return {task_id: r.model_dump(mode="json") for task_id, r in zip(task_ids, found, strict=True)}
        except (NotFoundError, CorruptError, ValueError):
            # A task of the claim has expired, or its record does not decode: read them one by one, so that it
            # fails its own delivery alone (a Redis that is away still raises: the claims lapse).
            out: dict[str, dict[str, Any] | str] = {}
            for task_id in task_ids:
                try:
                    out[task_id] = self.records.get_records([task_id], whole=True)[0].model_dump(mode="json")
                except NotFoundError:
                    pass
                except (CorruptError, ValueError) as exc:
                    out[task_id] = f"its stored data does not decode: {type(exc).__name__}: {exc}"
            return out

    def _done(self, outcome: Settled | None) -> None:
        """An attempt ended (any thread): its outcome is recorded at the next step (None: nothing to record)."""
        with self._lock:
            self._busy -= 1
            if outcome is not None:
                self._ended.append(outcome)

    # -- one attempt -------------------------------------------------------------------

    def _begin(self, item: ClaimedDelivery) -> None:
        """Start a claimed delivery's attempt: an HTTP POST on the loop's sockets (its host resolved by a
        helper unless it is an address), a Celery callback's send in a helper."""
        root_id, delivery_id, entry = item.root_id, item.delivery_id, item.entry
        if item.refused:  # its stored data does not decode: claimed again at every lease, it would never end
            # Recorded against its attempts when its entry decoded (a step sent again records it once); -1, any,
            # when not even that did (its attempts unknown, it must still end).
            self._give_up(item, item.refused, _attempts(entry) if entry else -1)
            return
        claimed = _attempts(entry)
        if item.found is None or not item.found[0]:
            # Its subscription answered 410 since (or its tree expired): nothing more is sent to it.
            self._done(Settled(root_id, delivery_id, "gone", last="the subscription has ended", attempts=claimed))
            return
        target, record = item.found[1], item.record
        if record is None:
            self._done(Settled(root_id, delivery_id, "given_up", last="the task has expired", attempts=claimed))
            return
        try:
            body = payload(entry, record, self.settings.api_url)
            prepared = None if target.get("kind") == "celery" else self._target(target)
        except Exception as exc:
            # Its stored data makes no attempt (an entry without its time, fields that are no object, a URL
            # whose port does not parse): nor will it at the next claim, so it is given up, not left to lapse.
            self._give_up(item, f"its stored data makes no attempt: {type(exc).__name__}: {exc}", claimed)
            return
        if prepared is None:
            self._helpers.submit(self._celery, item, target, record)
            return
        if silent := self._held_back(prepared.url):
            self._done(self._settled(item, Attempt("retrying", silent)))
            return
        host = prepared.url.hostname or ""
        if host not in self._literals:
            try:
                ipaddress.ip_address(host.strip("[]"))
            except ValueError:  # a name: resolved (and checked) by a resolver thread, which may wait on DNS
                self._await_host(_Waiting(item, prepared, body, time.monotonic() + self.settings.webhook_timeout_s))
                return
            # An address's check depends on it and the settings alone: made once (a bounded few a process).
            if len(self._literals) >= MOST_LITERALS:
                self._literals.clear()
            self._literals[host] = self._check(prepared.url)
        self._post(item, prepared, body, *self._literals[host])

    def _held_back(self, url: SplitResult) -> str:
        """Why no attempt goes to the URL's host now ('' when one may): it answered none within its timeout
        lately, and its one attempt of this span has gone (this one goes, and holds the next back)."""
        host = _host_of(url)
        until = self._silent.get(host)
        if until is None:
            return ""
        timeout_s = self.settings.webhook_timeout_s
        if (now := time.monotonic()) >= until:
            self._silent[host] = now + timeout_s  # this attempt is the span's one
            return ""
        return (
            f"not sent: {host[0]}:{host[1]} answered no attempt within {timeout_s:g} s lately; one attempt "
            f"a {timeout_s:g} s goes to it until one is answered"
        )

    def _heard(self, host: tuple[str, int], answered: bool) -> None:
        """An attempt to `host` ended: answered (any answer, or a refusal that took no slot's time), or not
        within its timeout, which holds the host's next attempts back for a timeout's span."""
        if answered:
            self._silent.pop(host, None)
            return
        if len(self._silent) >= MOST_TARGETS and host not in self._silent:
            self._silent.clear()
        self._silent[host] = time.monotonic() + self.settings.webhook_timeout_s

    def _give_up(self, item: ClaimedDelivery, why: str, attempts: int) -> None:
        """End a delivery whose stored data makes no attempt (at any claim): given up, `why` its last answer."""
        last = one_line(why)
        log.error("subq deliveries: %s given up: %s", item.delivery_id, last)
        self._done(Settled(item.root_id, item.delivery_id, "given_up", last=last, attempts=attempts))

    def _target(self, target: Mapping[str, Any]) -> Target:
        """The subscription's URL parsed and its signer, made at its first attempt in this process (ValueError,
        KeyError, ... when its stored data makes none)."""
        from standardwebhooks.webhooks import Webhook as Signer

        key = (str(target["url"]), str(target.get("secret") or ""), str(target.get("format") or ""))
        prepared = self._targets.get(key)
        if prepared is None:
            if len(self._targets) >= MOST_TARGETS:
                self._targets.clear()
            url = urlsplit(key[0])
            url.port  # noqa: B018  (a port that does not parse raises here, not at each attempt)
            prepared = Target(url, Signer(key[1]) if key[1] else None, key[2] == "slack")
            self._targets[key] = prepared
        return prepared

    def _check(self, url: SplitResult) -> tuple[str, str]:
        """The address to connect to for the URL's host, checked now ('' and the refusal's line if unsafe)."""
        port = _port(url)
        try:
            return resolve_safe(url.hostname or "", port, self.settings.webhook_allow), ""
        except UnsafeTarget as exc:
            return "", one_line(f"refused: {exc}")

    def _await_host(self, waiting: _Waiting) -> None:
        """Wait for the attempt's host name to resolve: on a resolution of it in flight, or on one started now."""
        url = waiting.target.url
        host = _host_of(url)
        with self._lock:
            others = self._resolving.get(host)
            self._resolving.setdefault(host, []).append(waiting)
        if others is None:
            self._to_resolve.put((host, url))  # (before the count is read: a thread leaving sees it queued)
            with self._lock:
                # (More names queued than threads idle: a burst of names while K threads sat idle started none.)
                start = self._to_resolve.qsize() > self._idle_resolvers and self._resolvers < MAX_RESOLVERS
                self._resolvers += start
            if start:
                threading.Thread(target=self._resolver, name="subq-resolve", daemon=True).start()

    def _resolver(self) -> None:
        while True:
            with self._lock:
                self._idle_resolvers += 1
            try:
                wanted = self._to_resolve.get(timeout=RESOLVER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    self._idle_resolvers -= 1
                    if self._resolvers > RESOLVERS and self._to_resolve.empty():
                        self._resolvers -= 1
                        return  # one of the extra threads, idle: it leaves
                continue
            with self._lock:
                self._idle_resolvers -= 1
            self._resolve(*wanted)

    def _resolve(self, host: tuple[str, int], url: SplitResult) -> None:
        """(A resolver thread.) Resolve and check the host, then hand the attempts waiting on it to the loop.

        Whatever the check raises is the attempts' refusal: an exception left in the thread's future, which no
        one reads, would leave their slots taken for good, and each claim of them would take another."""
        with self._lock:
            self._looking_up.add(host)
        try:
            address, refusal = self._check(url)
        except Exception as exc:
            log.exception("subq: checking webhook host %r failed", url.hostname)
            address, refusal = "", one_line(f"refused: the host's check failed: {type(exc).__name__}: {exc}")
        with self._lock:
            self._looking_up.discard(host)
            self._resolved += [(w, address, refusal) for w in self._resolving.pop(host, [])]
        self._connections.wake()

    def _expire_resolving(self) -> None:
        """End the attempts whose host has not resolved within their timeout: retrying, each, as a receiver that
        did not answer (its claim ends before its lease, so no other worker sends it meanwhile)."""
        now, expired = time.monotonic(), []
        with self._lock:
            for host, waiting in self._resolving.items():
                expired += [(w, host in self._looking_up) for w in waiting if w.deadline <= now]
                waiting[:] = [w for w in waiting if w.deadline > now]
        for w, looked_up in expired:
            # Held back as silent only when its own lookup ran out of time: one still queued behind other hosts'
            # lookups (another tree's names whose DNS never answers) says nothing of its receiver.
            if looked_up:
                self._heard(_host_of(w.target.url), answered=False)
            self._done(self._settled(w.item, Attempt("retrying", self._unresolved(w.target))))

    def _unresolved(self, target: Target) -> str:
        return f"{target.url.hostname} did not resolve within {self.settings.webhook_timeout_s:g} s"

    def _start_resolved(self) -> None:
        with self._lock:
            ready, self._resolved = self._resolved, []
        for w, address, refusal in ready:
            if (left_s := w.deadline - time.monotonic()) <= 0:  # resolved just past its time: ended as if not
                self._done(self._settled(w.item, Attempt("retrying", self._unresolved(w.target))))
                continue
            try:
                # What its timeout leaves after the resolution: the whole attempt ends within its claim's lease.
                self._post(w.item, w.target, w.body, address, refusal, left_s)
            except Exception:  # a fault of ours: the claim lapses and the delivery is due again
                log.exception("subq deliveries: %s failed", w.item.delivery_id)
                self._done(None)

    def _post(
        self,
        item: ClaimedDelivery,
        target: Target,
        body: Mapping[str, Any],
        address: str,
        refusal: str,
        timeout_s: float | None = None,
    ) -> None:
        if refusal:
            self._done(self._settled(item, Attempt("retrying", refusal)))
            return
        sent = {"text": slack_line(body)} if target.slack else body
        data = json.dumps(sent, separators=(",", ":"), ensure_ascii=False)
        now = datetime.now(UTC)
        headers = {
            "host": _host_header(target.url),
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            "webhook-id": str(body["id"]),
            "webhook-timestamp": str(int(now.timestamp())),
        }
        if target.signer is not None:
            headers["webhook-signature"] = target.signer.sign(str(body["id"]), now, data)
        timeout_s = self.settings.webhook_timeout_s if timeout_s is None else timeout_s
        token = _Sent(item, _host_of(target.url))
        self._answered(self._connections.start(token, target.url, address, data.encode(), headers, timeout_s))

    def _answered(self, ended: list[tuple[object, int, str]]) -> None:
        """POSTs that ended: their outcomes, to record at the next step."""
        for token, status, failure in ended:
            item, host = cast(_Sent, token)
            self._heard(host, answered=bool(status) or not failure.endswith(TIMED_OUT))
            if not status:
                attempt = Attempt("retrying", failure)
            elif 200 <= status < 300:
                attempt = Attempt("delivered", f"HTTP {status}")
            elif status == 410:
                attempt = Attempt("gone", f"HTTP {status}")
            else:
                attempt = Attempt("retrying", f"HTTP {status}")
            self._done(self._settled(item, attempt))

    def _settled(self, item: ClaimedDelivery, attempt: Attempt) -> Settled:
        root_id, delivery_id = item.root_id, item.delivery_id
        if attempt.state == "retrying":
            return self._retry(root_id, delivery_id, item.entry, attempt.last)
        if attempt.state != "delivered":
            log.warning("subq deliveries: %s %s: %s", delivery_id, attempt.state, attempt.last)
        return Settled(root_id, delivery_id, attempt.state, last=attempt.last, attempts=_attempts(item.entry))

    def _retry(self, root_id: str, delivery_id: str, entry: Mapping[str, Any], last: str) -> Settled:
        settings = self.settings
        claimed = _attempts(entry)
        attempts = claimed + 1
        delay_s = min(settings.webhook_retry_max_s, settings.webhook_retry_base_s * 2 ** min(attempts - 1, 30))
        delay_s *= random.uniform(0.5, 1.0)
        since = float(entry.get("since") or entry["ts"])
        if time.time() + delay_s - since > settings.webhook_retry_for_s:
            log.warning("subq deliveries: %s given up after %d attempts: %s", delivery_id, attempts, last)
            return Settled(root_id, delivery_id, "given_up", last=last, attempts=claimed)
        return Settled(root_id, delivery_id, "retrying", last=last, next_at=time.time() + delay_s, attempts=claimed)

    def _celery(self, item: ClaimedDelivery, target: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        """(A helper thread.) Send a Celery callback by name, with the root's record as its argument."""
        try:
            self.send_task(str(target["task"]), [dict(record)], f"subq-{item.delivery_id}", str(target["queue"]))
        except Exception as exc:  # the broker is away: try again later
            attempt = Attempt("retrying", one_line(f"send failed: {type(exc).__name__}: {exc}"))
        else:
            attempt = Attempt("delivered", f"sent to queue {target['queue']}")
        self._done(self._settled(item, attempt))
