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

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from coordinator.errors import NotFoundError
from coordinator.inputs import one_line
from coordinator.subscriptions import UnsafeTarget, resolve_safe

if TYPE_CHECKING:
    import httpx

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


class Deliverer:
    """Claims due deliveries and makes one attempt each, at most `SUBQ_WEBHOOK_CONCURRENCY` at once.

    One per worker process; `step()` claims as many as there are free slots and hands each to the
    pool; `run_forever` steps until stopped. As the reconciler, the worker builds it with its
    Coordinator and it works with the plane alone: the outbox and records parts of the store and the
    settings; `send_task(name, args, task_id, queue)` sends a Celery callback.
    """

    def __init__(self, coord: Coordinator, send_task: Callable[[str, list[Any], str, str], None]) -> None:
        plane = coord.plane
        self.outbox, self.records, self.settings, self.send_task = (
            plane.store.outbox, plane.store.records, plane.settings, send_task
        )  # fmt: skip
        self.slots = plane.settings.webhook_concurrency
        self._busy = 0
        self._lock = threading.Lock()
        # How long an idle loop waits before it looks again: a worker paces it by its fleet's size
        # (workers/outbound.py), so a fleet of any size looks about every POLL_S.
        self.idle_wait_s: Callable[[], float] = lambda: POLL_S
        self._pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="subq-delivery")
        self._client: httpx.Client | None = None

    # -- the loop ----------------------------------------------------------------------

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                claimed = self.step()
            except Exception:  # Redis down: log it and look again
                log.exception("subq deliveries: a claim failed")
                claimed = 0
            if not claimed:
                stop.wait(self.idle_wait_s())

    def step(self) -> int:
        """Claim due deliveries for the free slots and start their attempts; how many were claimed."""
        with self._lock:
            free = self.slots - self._busy
        lease_ms = int((self.settings.webhook_timeout_s + CLAIM_MARGIN_S) * 1000)
        claimed = self.outbox.claim(free, lease_ms)
        for root_id, delivery_id in claimed:
            with self._lock:
                self._busy += 1
            self._pool.submit(self._one, root_id, delivery_id)
        return len(claimed)

    def idle(self) -> bool:
        with self._lock:
            return self._busy == 0

    def _one(self, root_id: str, delivery_id: str) -> None:
        try:
            self.deliver(root_id, delivery_id)
        except Exception:  # Redis down mid-attempt: the claim lapses and the delivery is due again
            log.exception("subq deliveries: %s failed", delivery_id)
        finally:
            with self._lock:
                self._busy -= 1

    # -- one attempt -------------------------------------------------------------------

    def deliver(self, root_id: str, delivery_id: str) -> str:
        """One attempt of a claimed delivery, settled; the delivery's state after it."""
        entry = self.outbox.delivery(root_id, delivery_id)
        if entry is None or entry.get("state") in ("delivered", "gone", "given_up"):
            self.outbox.forget(root_id, delivery_id)  # settled by an earlier claim that outlived its lease
            return str(entry["state"]) if entry else ""
        found = self.outbox.target(root_id, str(entry["hook"]))
        if found is None or not found[0]:
            # Its subscription answered 410 since (or its tree expired): nothing more is sent to it.
            return self.outbox.settle(root_id, delivery_id, "gone", last="the subscription has ended")
        target = found[1]
        try:
            record = self.records.get_task(str(entry["task_id"])).model_dump(mode="json")
        except NotFoundError:
            return self.outbox.settle(root_id, delivery_id, "given_up", last="the task has expired")
        body = payload(entry, record, self.settings.api_url)
        if target.get("kind") == "celery":
            attempt = self._send_celery(target, record, delivery_id)
        else:
            attempt = self._post(target, body)
        if attempt.state == "retrying":
            return self._retry(root_id, delivery_id, entry, attempt.last)
        if attempt.state != "delivered":
            log.warning("subq deliveries: %s %s: %s", delivery_id, attempt.state, attempt.last)
        return self.outbox.settle(root_id, delivery_id, attempt.state, last=attempt.last)

    def _retry(self, root_id: str, delivery_id: str, entry: Mapping[str, Any], last: str) -> str:
        settings = self.settings
        attempts = int(entry.get("attempts") or 0) + 1
        delay_s = min(settings.webhook_retry_max_s, settings.webhook_retry_base_s * 2 ** min(attempts - 1, 30))
        delay_s *= random.uniform(0.5, 1.0)
        since = float(entry.get("since") or entry["ts"])
        if time.time() + delay_s - since > settings.webhook_retry_for_s:
            log.warning("subq deliveries: %s given up after %d attempts: %s", delivery_id, attempts, last)
            return self.outbox.settle(root_id, delivery_id, "given_up", last=last)
        return self.outbox.settle(root_id, delivery_id, "retrying", next_at=time.time() + delay_s, last=last)

    def _send_celery(self, target: Mapping[str, Any], record: Mapping[str, Any], delivery_id: str) -> Attempt:
        try:
            self.send_task(str(target["task"]), [dict(record)], f"subq-{delivery_id}", str(target["queue"]))
        except Exception as exc:  # the broker is away: try again later
            return Attempt("retrying", one_line(f"send failed: {type(exc).__name__}: {exc}"))
        return Attempt("delivered", f"sent to queue {target['queue']}")

    def _post(self, target: Mapping[str, Any], body: Mapping[str, Any]) -> Attempt:
        import httpx
        from standardwebhooks.webhooks import Webhook as Signer

        url = str(target["url"])
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            address = resolve_safe(host, port, self.settings.webhook_allow)
        except UnsafeTarget as exc:
            return Attempt("retrying", one_line(f"refused: {exc}"))
        shown = f"[{address}]" if ":" in address else address
        direct = urlunsplit((parts.scheme, f"{shown}:{port}", parts.path or "/", parts.query, ""))
        sent = {"text": slack_line(body)} if target.get("format") == "slack" else body
        data = json.dumps(sent, separators=(",", ":"), ensure_ascii=False)
        now = datetime.now(UTC)
        headers = {
            "host": parts.netloc,
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            "webhook-id": str(body["id"]),
            "webhook-timestamp": str(int(now.timestamp())),
        }
        if target.get("secret"):
            headers["webhook-signature"] = Signer(str(target["secret"])).sign(str(body["id"]), now, data)
        if self._client is None:
            self._client = httpx.Client(follow_redirects=False, trust_env=False)
        try:
            answer = self._client.post(
                direct, content=data.encode(), headers=headers, timeout=self.settings.webhook_timeout_s,
                extensions={"sni_hostname": host},
            )  # fmt: skip
        except httpx.HTTPError as exc:
            return Attempt("retrying", one_line(f"{type(exc).__name__}: {exc}"))
        line = f"HTTP {answer.status_code}"
        if 200 <= answer.status_code < 300:
            return Attempt("delivered", line)
        if answer.status_code == 410:
            return Attempt("gone", line)
        return Attempt("retrying", line)
