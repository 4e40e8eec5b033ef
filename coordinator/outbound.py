"""Outbound events: a tree's subscriptions, the safe-target rule, and the deliverer (docs/webhooks.md).

An event (a root's end, a child's when asked, ...) is written into the tree's
outbox by the very Lua step that makes the state change (`outbox_add.lua`, from
finish_task, stop_tasks): the two commit together, so no crash between them can
lose one. Delivery is off the hot path: every worker process runs a
`Deliverer` in a thread of its own (workers/outbound.py) that claims due
deliveries from `<p>:outbox` with a lease (`claim_deliveries.lua`), makes one
attempt each in a bounded pool of threads, and settles it
(`settle_delivery.lua`): delivered (2xx), retrying at its next time (capped,
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

import http.client
import json
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, urlsplit

from coordinator.errors import NotFoundError
from coordinator.inputs import one_line
from coordinator.models import Settled
from coordinator.subscriptions import UnsafeTarget, resolve_safe

if TYPE_CHECKING:
    from coordinator.service import Coordinator

__all__ = ["MAX_RESULT_CHARS", "Deliverer", "payload", "slack_line"]

log = logging.getLogger(__name__)

# An end's `result` in a payload: enough to read; the whole record is one GET away.
MAX_RESULT_CHARS = 4000
# A claim outlives an attempt's timeout by this much, so a live attempt is never taken twice.
CLAIM_MARGIN_S = 30.0
# How often an idle deliverer looks for due deliveries: an approval reaches its sink within a second or two.
POLL_S = 0.25
USER_AGENT = "subq-webhooks"
# What of an answer's body is read: a receiver's answer is its status; a longer body closes the connection.
MAX_ANSWER_BYTES = 64 * 1024
# An idle keep-alive connection is reused this long: under the usual servers' keep-alive timeout (5 s), so
# a receiver seldom closes one under an attempt (an attempt on a closed one is made again on a new one).
KEEP_IDLE_S = 4.0


def payload(entry: Mapping[str, Any], record: Mapping[str, Any], api_url: str | None = None) -> dict[str, Any]:
    """An event's body: its id, type and time, the tree and task, the metadata, and an end's outcome and figures.

    `record` is the task's record as GET /v1/tasks/{id} returns it; the event's own status (an end's) is
    its type's, whatever the record says now (a retry may have moved it on since)."""
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
            tokens_in=record.get("total_tokens_in"),
            tokens_out=record.get("total_tokens_out"),
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
    # Slack's mrkdwn reads these three as markup (a link, a mention); escaped, a model's text stays text.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


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


class Claimed:
    """A claimed delivery with what its attempt needs, read for a whole claim at once (`Deliverer.read`):
    its entry (None once its tree expired), its subscription's (patterns, target) (None when gone) and
    its task's record as GET /v1/tasks/{id} returns it (None when the task expired)."""

    def __init__(
        self,
        root_id: str,
        delivery_id: str,
        entry: dict[str, Any] | None,
        found: tuple[str, dict[str, Any]] | None,
        record: dict[str, Any] | None,
    ) -> None:
        self.root_id, self.delivery_id, self.entry, self.found, self.record = (
            root_id, delivery_id, entry, found, record
        )  # fmt: skip


class Connections:
    """Keep-alive HTTP connections, each to one checked address, one attempt on a connection at a time.

    An attempt takes an idle connection to the very address it checked, or opens one (the socket goes to
    that address; the Host header, TLS's SNI and the certificate's check use the host's name), and gives
    it back once the answer is read whole. The standard library's client: an attempt with httpx took 6
    times the CPU of one with `http.client` (docs/benchmarks.md), CPU the runs of a busy worker need.
    """

    def __init__(self, most_idle: int) -> None:
        self.most_idle = most_idle
        self._idle: dict[tuple[str, str, int, str], list[tuple[http.client.HTTPConnection, float]]] = {}
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None

    def post(
        self, url: SplitResult, address: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, str]:
        """POST `body` to `url` at `address`: (status, '') on an answer, (0, the failure's line) on none."""
        host = url.hostname or ""
        port = url.port or (443 if url.scheme == "https" else 80)
        key = (url.scheme, host, port, address)
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        reused = self._take(key)
        conn = reused or self._open(url.scheme, host, port, address, timeout_s)
        while True:
            phase = "Connect"
            try:
                if conn.sock is None:
                    conn.connect()
                phase = "Write"
                conn.request("POST", path, body=body, headers=dict(headers))
                phase = "Read"
                answer = conn.getresponse()
                answer.read(MAX_ANSWER_BYTES)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if reused is not None and isinstance(exc, (ConnectionResetError, BrokenPipeError)):
                    # An idle connection the receiver closed meanwhile (RemoteDisconnected is a reset):
                    # once more, on a new one. Any other failure is the attempt's.
                    reused = None
                    conn = self._open(url.scheme, host, port, address, timeout_s)
                    continue
                return 0, one_line(_failure(phase, exc))
            if answer.will_close or not answer.isclosed():  # closing, or an answer longer than we read
                conn.close()
            else:
                self._give_back(key, conn)
            return answer.status, ""

    def _open(self, scheme: str, host: str, port: int, address: str, timeout_s: float) -> http.client.HTTPConnection:
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            return _PinnedTLS(host, port, address, timeout_s, self._tls)
        return _Pinned(host, port, address, timeout_s)

    def _take(self, key: tuple[str, str, int, str]) -> http.client.HTTPConnection | None:
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                conn, since = idle.pop()
                if now - since < KEEP_IDLE_S:
                    return conn
                conn.close()
        return None

    def _give_back(self, key: tuple[str, str, int, str], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.most_idle:
                idle.append((conn, time.monotonic()))
                return
        conn.close()


class _Pinned(http.client.HTTPConnection):
    """A connection named for its host whose socket goes to one checked address (no DNS rebinding)."""

    def __init__(self, host: str, port: int, address: str, timeout_s: float) -> None:
        super().__init__(host, port, timeout=timeout_s)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _PinnedTLS(http.client.HTTPSConnection):
    """As `_Pinned`, over TLS: the certificate is checked against the host's name."""

    def __init__(self, host: str, port: int, address: str, timeout_s: float, tls: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=timeout_s, context=tls)
        self.address, self.tls = address, tls

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = self.tls.wrap_socket(sock, server_hostname=self.host)


def _failure(phase: str, exc: BaseException) -> str:
    """An attempt that got no answer, in the words a reader of `last` knows: ConnectError, ReadTimeout, ..."""
    if isinstance(exc, TimeoutError):
        return f"{phase}Timeout: {exc or 'timed out'}"
    if isinstance(exc, http.client.HTTPException) and not isinstance(exc, OSError):
        return f"RemoteProtocolError: {type(exc).__name__}: {exc}"
    return f"{phase}Error: {exc}"


class Deliverer:
    """Claims due deliveries and makes one attempt each, at most `SUBQ_WEBHOOK_CONCURRENCY` at once.

    One per worker process, in a loop thread of its own (`run_forever`), whose `step()` works in batches
    (docs/benchmarks.md: each round trip and thread wake-up is CPU a busy worker's runs need): in one
    round trip it records the outcomes of the attempts that ended since the last step and claims as
    many due deliveries as there are free slots (`settle_and_claim`); in two more it reads what their
    attempts need (entries and targets, then records); it hands each attempt to the pool, whose threads
    make only the POST or the Celery send. An attempt's outcome is recorded at the next step: until
    then its delivery stays claimed, and a worker dying in between has it sent again (at least once;
    the receiver drops a repeat by its webhook-id). The loop wakes when idle for `idle_wait_s()`, or
    early once half the slots are free. As the reconciler, the worker builds it with its Coordinator
    and it works with the plane alone: the outbox and records parts of the store and the settings;
    `send_task(name, args, task_id, queue)` sends a Celery callback.
    """

    def __init__(self, coord: Coordinator, send_task: Callable[[str, list[Any], str, str], None]) -> None:
        plane = coord.plane
        self.outbox, self.records, self.settings, self.send_task = (
            plane.store.outbox, plane.store.records, plane.settings, send_task
        )  # fmt: skip
        self.slots = plane.settings.webhook_concurrency
        self._busy = 0
        self._ended: list[Settled] = []  # attempts made, not yet recorded
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # How long an idle loop waits before it looks again: a worker paces it by its fleet's size
        # (workers/outbound.py), so a fleet of any size looks about every POLL_S.
        self.idle_wait_s: Callable[[], float] = lambda: POLL_S
        self._pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="subq-delivery")
        self._connections = Connections(self.slots)

    # -- the loop ----------------------------------------------------------------------

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            claimed = 0
            try:
                claimed = self.step()
            except Exception:  # Redis down: log it and look again
                log.exception("subq deliveries: a claim failed")
            # A claim took every free slot or every due delivery: the next step waits for half the slots to
            # free (an attempt's end wakes it), at most POLL_S; an idle loop waits as `idle_wait_s` says.
            self._wake.wait(POLL_S if claimed else self.idle_wait_s())
            self._wake.clear()

    def step(self) -> int:
        """Record the attempts that ended, claim due deliveries for the free slots and start their
        attempts; how many were claimed."""
        with self._lock:
            ended, self._ended = self._ended, []
            free = self.slots - self._busy
        lease_ms = int((self.settings.webhook_timeout_s + CLAIM_MARGIN_S) * 1000)
        try:
            claimed = self.outbox.settle_and_claim(ended, free, lease_ms)
        except Exception:
            with self._lock:  # Redis away: recorded at the next step (their claims hold meanwhile)
                self._ended[:0] = ended
            raise
        if not claimed:
            return 0
        # A read that fails (Redis away) leaves the claims to lapse: the deliveries are due again then.
        items = self.read(claimed)
        with self._lock:
            self._busy += len(items)
        for item in items:
            self._pool.submit(self._one, item)
        return len(claimed)

    def idle(self) -> bool:
        """No attempt in flight and none waiting to be recorded."""
        with self._lock:
            return self._busy == 0 and not self._ended

    def read(self, claimed: list[tuple[str, str]]) -> list[Claimed]:
        """What the claimed deliveries' attempts need: their entries and targets, then their records (with
        their children's ids only for a Celery callback, which sends the whole record)."""
        found = self.outbox.claimed(claimed)
        tasks: dict[str, bool] = {}
        for entry, target in found:
            if entry is not None:
                whole = target is not None and target[1].get("kind") == "celery"
                tasks[str(entry["task_id"])] = tasks.get(str(entry["task_id"]), False) or whole
        records = self._records([t for t, whole in tasks.items() if not whole], whole=False)
        records |= self._records([t for t, whole in tasks.items() if whole], whole=True)
        return [
            Claimed(root_id, delivery_id, entry, target, records.get(str(entry["task_id"])) if entry else None)
            for (root_id, delivery_id), (entry, target) in zip(claimed, found, strict=True)
        ]

    def _records(self, task_ids: list[str], *, whole: bool) -> dict[str, dict[str, Any]]:
        """The tasks' records as GET /v1/tasks/{id} returns them; a task that expired is left out."""
        if not task_ids:
            return {}
        try:
            found = self.records.get_records(task_ids, whole=whole)
            return {task_id: r.model_dump(mode="json") for task_id, r in zip(task_ids, found, strict=True)}
        except NotFoundError:  # a task of the claim has expired: read them one by one
            out: dict[str, dict[str, Any]] = {}
            for task_id in task_ids:
                try:
                    out[task_id] = self.records.get_records([task_id], whole=whole)[0].model_dump(mode="json")
                except NotFoundError:
                    pass
            return out

    def _one(self, item: Claimed) -> None:
        try:
            outcome = self.attempt(item)
        except Exception:  # a fault of ours: the claim lapses and the delivery is due again
            log.exception("subq deliveries: %s failed", item.delivery_id)
            outcome = None
        with self._lock:
            self._busy -= 1
            if outcome is not None:
                self._ended.append(outcome)
            half_free = self.slots - self._busy >= (self.slots + 1) // 2
        if half_free:
            self._wake.set()

    # -- one attempt -------------------------------------------------------------------

    def attempt(self, item: Claimed) -> Settled | None:
        """One attempt of a claimed delivery: the outcome to record (None: nothing to record)."""
        root_id, delivery_id, entry = item.root_id, item.delivery_id, item.entry
        if entry is None or entry.get("state") in ("delivered", "gone", "given_up"):
            self.outbox.forget(root_id, delivery_id)  # settled by an earlier claim that outlived its lease
            return None
        if item.found is None or not item.found[0]:
            # Its subscription answered 410 since (or its tree expired): nothing more is sent to it.
            return Settled(root_id, delivery_id, "gone", last="the subscription has ended")
        target, record = item.found[1], item.record
        if record is None:
            return Settled(root_id, delivery_id, "given_up", last="the task has expired")
        body = payload(entry, record, self.settings.api_url)
        if target.get("kind") == "celery":
            attempt = self._send_celery(target, record, delivery_id)
        else:
            attempt = self._post(target, body)
        if attempt.state == "retrying":
            return self._retry(root_id, delivery_id, entry, attempt.last)
        if attempt.state != "delivered":
            log.warning("subq deliveries: %s %s: %s", delivery_id, attempt.state, attempt.last)
        return Settled(root_id, delivery_id, attempt.state, last=attempt.last)

    def _retry(self, root_id: str, delivery_id: str, entry: Mapping[str, Any], last: str) -> Settled:
        settings = self.settings
        attempts = int(entry.get("attempts") or 0) + 1
        delay_s = min(settings.webhook_retry_max_s, settings.webhook_retry_base_s * 2 ** min(attempts - 1, 30))
        delay_s *= random.uniform(0.5, 1.0)
        since = float(entry.get("since") or entry["ts"])
        if time.time() + delay_s - since > settings.webhook_retry_for_s:
            log.warning("subq deliveries: %s given up after %d attempts: %s", delivery_id, attempts, last)
            return Settled(root_id, delivery_id, "given_up", last=last)
        return Settled(root_id, delivery_id, "retrying", last=last, next_at=time.time() + delay_s)

    def _send_celery(self, target: Mapping[str, Any], record: Mapping[str, Any], delivery_id: str) -> Attempt:
        try:
            self.send_task(str(target["task"]), [dict(record)], f"subq-{delivery_id}", str(target["queue"]))
        except Exception as exc:  # the broker is away: try again later
            return Attempt("retrying", one_line(f"send failed: {type(exc).__name__}: {exc}"))
        return Attempt("delivered", f"sent to queue {target['queue']}")

    def _post(self, target: Mapping[str, Any], body: Mapping[str, Any]) -> Attempt:
        from standardwebhooks.webhooks import Webhook as Signer

        url = urlsplit(str(target["url"]))
        host = url.hostname or ""
        try:
            address = resolve_safe(
                host, url.port or (443 if url.scheme == "https" else 80), self.settings.webhook_allow
            )
        except UnsafeTarget as exc:
            return Attempt("retrying", one_line(f"refused: {exc}"))
        sent = {"text": slack_line(body)} if target.get("format") == "slack" else body
        data = json.dumps(sent, separators=(",", ":"), ensure_ascii=False)
        now = datetime.now(UTC)
        headers = {
            "host": url.netloc,
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            "webhook-id": str(body["id"]),
            "webhook-timestamp": str(int(now.timestamp())),
        }
        if target.get("secret"):
            headers["webhook-signature"] = Signer(str(target["secret"])).sign(str(body["id"]), now, data)
        status, failure = self._connections.post(url, address, data.encode(), headers, self.settings.webhook_timeout_s)
        if not status:
            return Attempt("retrying", failure)
        line = f"HTTP {status}"
        if 200 <= status < 300:
            return Attempt("delivered", line)
        if status == 410:
            return Attempt("gone", line)
        return Attempt("retrying", line)
