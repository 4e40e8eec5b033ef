"""The Coordinator: the one service every face (Python, CLI, HTTP API, `subq.submit`) goes through.

It holds the settings, the store (it is the one module that builds one) and the
Celery app used to publish work, and hands the three to its rooms as one `Plane`
(`coord.plane`, coordinator/plane.py): a room takes the parts it works with,
never the Coordinator, so no room imports this module. Tasks, queries, waiting
and `submit` (create a root, then hand it to delegation) live here; the other
operations are thin calls into their rooms:

    delegation.py   check, commit, publish a delegation; a submission's checks and its delegation
    control.py      cancel a subtree, stop one, the live snapshot
    retry.py        run failed tasks again (alone, or every failed task of a tree)
    approvals.py    park, decide, expire tool approvals
    budgets.py      budgets in micro-USD, what remains, the stop when spent
    admission.py    run slots, start stagger, provider rate limits (used by runs.py)
    writeback.py    the one write-back entry point (used by runs.py and control.py)
    runs.py         the run-lifecycle seam the worker drives a run through (built with the Coordinator)

Every operation validates all of its input first and raises the project's own
error naming the field; only then does it commit, in one atomic step, and only
after the commit does it publish work.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from coordinator import (
    admission,
    approvals,
    budgets,
    control,
    delegation,
    dispatch,
    faults,
    ids,
    quotas,
    todo_links,
    tracing,
)
from coordinator import audit as audit_log
from coordinator import retry as retry_room
from coordinator import todos as todo_lists
from coordinator.audit import LOCAL, Action, Actor, AuditEntry
from coordinator.deadletters import DeadLetter, message_digest
from coordinator.errors import (
    BrokerError,
    CorruptError,
    NotFoundError,
    QuotaExceeded,
    SubqError,
    ValidationError,
    WaitTimeout,
)
from coordinator.export import export_tree
from coordinator.inputs import (
    DEFAULT_PAGE,
    MAX_PAGE,
    MAX_PROMPT_CHARS,
    check_dead_letter_limit,
    check_delivery_id,
    check_finishing_among,
    check_history_query,
    check_metadata,
    check_subscriptions,
    check_wait_timeout,
    profile_asked,
    text_field,
)
from coordinator.inputs import idempotency_key as check_idempotency_key
from coordinator.models import (
    Approval,
    Batch,
    DelegationMode,
    Delivery,
    FinishingRuns,
    HistoryItem,
    LiveState,
    Retried,
    StopHold,
    SubtaskSpec,
    TaskRecord,
    TaskStatus,
    TodoItem,
)
from coordinator.output_schema import NO_RUN_NO_OUTPUT, check_schema
from coordinator.plane import Plane
from coordinator.redis_clients import redis_client
from coordinator.settings import Settings, load_settings
from coordinator.store import LATENCY_BUCKETS_MS, FleetGauges, Keys, ReplicaWait, Store
from coordinator.store.fields import TaskField
from coordinator.subscriptions import CeleryCallback, Webhook, shown_target, subscriptions
from coordinator.tenants import TenantPolicy, TenantState, check_priority, check_tenant_name
from coordinator.tree import TreeNode, build_tree

__all__ = ["DEFAULT_PAGE", "MAX_PAGE", "Coordinator"]

# How long wait() listens for its task's settling before it reads the status anyway: a wake-up lost
# with a dropped connection, or a settle that announced nothing, costs at most this.
WAIT_SLICE_MS = 1000


def replica_wait(settings: Settings) -> ReplicaWait | None:
    """The WAIT a step a caller sees ends with (SUBQ_REDIS_MIN_REPLICAS), or None: no WAIT at all."""
    replicas = settings.min_replicas()
    return ReplicaWait(replicas, settings.redis_replica_wait_ms) if replicas > 0 else None


class Coordinator:
    """subq's control plane for one deployment (one Redis, one key prefix)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        client: redis.Redis | None = None,
        app: Celery | None = None,
    ) -> None:
        self.settings = settings or load_settings()
        if client is None:
            client = redis_client(self.settings)
        self.client = client
        self.store = Store(
            client,
            Keys(self.settings.key_prefix),
            self.settings.result_retention_s,
            budget_warn_at=self.settings.budget_warn_at,
            replicas=replica_wait(self.settings),
        )
        self.sessions = self.store.sessions  # the web view's sign-ins: only its auth reads them
        # What the rooms are handed: the store, the settings and the publishing app, not the Coordinator.
        self.plane = Plane(self.store, self.settings, app)
        tracing.setup(self.settings)  # a no-op unless SUBQ_TRACES_EXPORTER is set

    @property
    def app(self) -> Celery:
        """The Celery app used to publish work, built on first use."""
        return self.plane.app

    # -- tasks -------------------------------------------------------------------------

    @tracing.traced("subq.submit")
    def create_task(
        self,
        prompt: str,
        todos: str | Sequence[object] | None = None,
        profile: str | None = None,
        run: bool = False,
        budget_usd: Decimal | float | str | None = None,
        idempotency_key: str | None = None,
        *,
        owner: str = "",
        output_schema: dict[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        webhooks: Sequence[Webhook | Mapping[str, Any]] | None = None,
        on_complete: CeleryCallback | Mapping[str, Any] | str | None = None,
        key_webhooks: Sequence[Webhook] = (),
        tenant: str | None = None,
        priority: int | None = None,
    ) -> TaskRecord:
        """Create a root task.

        With `run=False` the caller owns it and delegates through this API; with
        `run=True` it starts as an agent on the fleet (its model plans, delegates
        and completes), and `wait()` returns when it has ended. With an
        `idempotency_key`, a second call with the same key returns the first root.
        `owner` is the API key whose caller creates it (docs/security.md): the tree is theirs.
        With an `output_schema` (a JSON Schema object; coordinator/output_schema.py bounds it), an agent
        task ends with `attempt_completion(result, data)`, `data` held to it, and the validated object is
        its record's `output`; a bad schema is refused (ValidationError naming the path) and nothing is written.
        `metadata` is the caller's tags for the tree (a job id, a customer: coordinator/inputs.py bounds them):
        every task of the tree carries them, and `list_tasks(metadata=...)` finds the tree by them.
        `webhooks` (`[{url, secret?, events?}]`) and `on_complete` (a Celery task's name, or `{task, queue}`)
        are where the tree's events go (docs/webhooks.md): a URL that may not be reached is refused
        (ValidationError naming it) and nothing is written; a secret is never returned. `key_webhooks` are
        the creating API key's own (the keys file's `webhooks`): every tree the key creates sends there too.
        `tenant` is whom the tree runs for (the creating key's tenant; None: SUBQ_DEFAULT_TENANT) and `priority`
        its 1-5 (None: 3), cut to the tenant's `max_priority` (coordinator/tenants.py). A root over a quota of
        its tenant is refused with QuotaExceeded (coordinator/quotas.py) and nothing is written.
        """
        return self.create_task_once(
            prompt, todos, profile, run, budget_usd, idempotency_key, owner=owner, output_schema=output_schema,
            metadata=metadata, webhooks=webhooks, on_complete=on_complete, key_webhooks=key_webhooks,
            tenant=tenant, priority=priority,
        )[0]  # fmt: skip

    def _count_root(self, tenant: str, root_id: str, policy: TenantPolicy, claim: str) -> None:
        """Count the new root against its tenant's quotas; refused (QuotaExceeded), nothing is counted or written,
        and the idempotency key this call `claim`ed for it (if any) is given back."""
        try:
            quotas.check_root(self.plane, tenant, root_id, policy)
        except QuotaExceeded:
            if claim:
                self.store.records.release_idempotency(claim, root_id, self.store.keys.tenant_submits(tenant))
            raise

    def create_task_once(
        self,
        prompt: str,
        todos: str | Sequence[object] | None = None,
        profile: str | None = None,
        run: bool = False,
        budget_usd: Decimal | float | str | None = None,
        idempotency_key: str | None = None,
        *,
        owner: str = "",
        output_schema: dict[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        webhooks: Sequence[Webhook | Mapping[str, Any]] | None = None,
        on_complete: CeleryCallback | Mapping[str, Any] | str | None = None,
        key_webhooks: Sequence[Webhook] = (),
        tenant: str | None = None,
        priority: int | None = None,
        ends_with_batch: bool = False,
    ) -> tuple[TaskRecord, bool]:
        """`create_task`, and whether this call created the root (False: the key's first call did). With
        `ends_with_batch` (a submission's root), the root ends as its batch closes (`writeback.end_submission`)."""
        prompt = text_field(prompt, "prompt", MAX_PROMPT_CHARS)
        tenant_name = check_tenant_name(tenant) if tenant is not None else self.settings.default_tenant
        policy = self.plane.tenants.policy(tenant_name)
        wanted_priority = min(check_priority(priority), policy.max_priority)
        tags = check_metadata(metadata) if metadata is not None else {}
        hooks, callback = check_subscriptions(webhooks, on_complete)
        targets = subscriptions(hooks, callback, self.settings.webhook_allow, self.settings.notify, key_webhooks)
        if not isinstance(run, bool):
            raise ValidationError("run must be true or false", field="run")
        if output_schema is not None:
            check_schema(output_schema)
            if not run:
                raise ValidationError(NO_RUN_NO_OUTPUT, field="output_schema")
        profile_name = profile_asked(profile) or self.settings.default_profile
        self.settings.profile(profile_name)
        budget_micros = budgets.to_micros(budget_usd, "budget_usd")
        items = todo_lists.parse_update(todos) if todos is not None else []
        root_id = fresh_id = ids.new_root_id()
        claim = ""
        if idempotency_key is not None:
            # The key names its root before the root exists: a retry after a crash in
            # between creates that same root, and a concurrent duplicate finds it.
            key = check_idempotency_key(idempotency_key)
            # Each API key has its own idempotency keys: another key's same string must not
            # answer with (and so reveal) a tree it may not read.
            claim = f"{owner}\n{key}" if owner else key
            root_id = self.store.records.claim_idempotency(claim, root_id)
            if self.store.records.task_exists(root_id):
                return self.store.records.get_task(root_id), False
        self._count_root(tenant_name, root_id, policy, claim if root_id == fresh_id else "")
        now = time.time()
        record = TaskRecord(
            id=root_id,
            root_id=root_id,
            status=TaskStatus.ACTIVE,
            prompt=prompt,
            profile=profile_name,
            runner="agent" if run else "caller",
            budget_micros=budget_micros,
            owner=owner,
            output_schema=output_schema,
            metadata=tags,
            tenant=tenant_name,
            priority=wanted_priority,
            number=self.store.records.next_numbers(1),
            created_at=now,
            updated_at=now,
        )
        if run:  # first: a run whose message is lost is published again by the reconciler
            self.store.convergence.watch([root_id], self.settings.reconcile_grace_s)
        settings = self.settings
        hooks_hash = self.store.outbox.hooks_mapping(
            root_id, targets, settings.webhook_tree_cap, settings.webhook_outbox_cap
        )
        extra = {TaskField.ENDS_WITH_BATCH: "1"} if ends_with_batch else None
        if not self.store.records.create_root(record, items, hooks_hash, extra):
            return self.store.records.get_task(root_id), False
        if run:
            admission.announce(self.plane, record.tenant, [root_id])  # its tenant's demand (fair shares)
            dispatch.publish_run(self.app, record)
        return record, True

    def get_task(self, task_id: str) -> TaskRecord:
        return self.store.records.get_task(task_id)

    def get_todos(self, task_id: str) -> list[TodoItem]:
        """The task's todo list; linked items show their child's subtree figures live."""
        return self.store.records.get_todos(task_id, live=True)

    def owner_of(self, task_id: str) -> str:
        """The API key that created the task's tree ('' for none), in one small read; NotFoundError if no task."""
        return self.store.records.owner_of(task_id)

    def _owned_by(self, task_id: str, owner: str) -> bool:
        try:
            return self.owner_of(task_id) == owner
        except NotFoundError:
            return False

    def get_children(self, task_id: str) -> list[TaskRecord]:
        return self.store.records.get_children(task_id)

    def tree(self, task_id: str) -> TreeNode:
        """The task and its whole subtree, each with its plan and figures (GET /v1/tasks/{id}/tree)."""
        return build_tree(self, task_id)

    def get_batch(self, batch_id: str) -> Batch:
        return self.store.batches.get_batch(batch_id)

    def messages(self, task_id: str, kind: str = "ui") -> list[dict[str, Any]]:
        """The task's messages, oldest first: `ui` (UI messages) or `api` (the model conversation)."""
        if kind == "ui":
            return self.store.records.ui_messages(task_id)
        if kind == "api":
            self.store.records.task_fields(task_id)
            return [
                _decode_entry(entry, task_id, n) for n, entry in enumerate(self.store.records.conversation(task_id))
            ]
        raise ValidationError(f"kind must be 'ui' or 'api', not {kind!r}", field="kind")

    def export_tree(self, task_id: str, directory: Path | str) -> list[Path]:
        """Write the task's subtree as folders (see coordinator/export.py); returns the files."""
        return export_tree(self, task_id, Path(directory))

    def history_item(self, task_id: str) -> HistoryItem:
        return HistoryItem.of(self.store.records.get_task(task_id))

    def list_tasks(
        self,
        *,
        status: str | None = None,
        root_id: str | None = None,
        limit: int = DEFAULT_PAGE,
        cursor: int = 0,
        owner: str | None = None,
        metadata: Mapping[str, str] | None = None,
        tenant: str | None = None,
    ) -> tuple[list[HistoryItem], int | None]:
        """Tasks by recency (newest first) with their figures; returns (page, next cursor or None).

        With `owner`, only the tasks of the trees that key created (a `read` key's history). With
        `metadata`, only the tasks whose tree carries every one of those key/value pairs. Like a status,
        it filters the scan of the history index: a page of a rare tag reads every record until it fills."""
        check_history_query(status, root_id, limit, cursor, metadata)
        if tenant is not None:
            check_tenant_name(tenant)
        if root_id is not None and owner is not None and not self._owned_by(root_id, owner):
            # Another key's tree (or none): the same empty page at once. Filtered record by record, its every
            # record was read first, which told its size by the time taken (and cost the server as much).
            return [], None
        wanted = dict(metadata or {}).items()
        items: list[HistoryItem] = []
        offset = cursor
        while len(items) < limit:
            page = self.store.records.recent_task_ids(root_id=root_id, offset=offset, count=MAX_PAGE)
            if not page:
                return items, None
            for n, task_id in enumerate(page, start=offset):
                try:
                    record = self.store.records.get_task(task_id)
                except NotFoundError:  # expired since it was indexed
                    continue
                if (
                    (status is None or record.status.value == status)
                    and (owner is None or record.owner == owner)
                    and wanted <= record.metadata.items()
                    and (tenant is None or record.tenant == tenant)
                ):
                    items.append(HistoryItem.of(record))
                    if len(items) == limit:
                        return items, n + 1
            offset += len(page)
        return items, offset

    def update_todos(self, task_id: str, update: str | Sequence[object], *, token: str = "") -> list[TodoItem]:
        """Replace the task's todo list; links and figures of existing items survive. A run's own update passes
        its lease's `token`: `FencedError`, nothing written, once another run of the task holds the lease."""
        parsed = todo_lists.parse_update(update)  # a bad update is refused before any read
        return self.store.batches.update_todos(task_id, lambda _record, old: todo_links.merge(old, parsed), token=token)

    # -- delegation (coordinator/delegation.py) ---------------------------------------

    def delegate(
        self,
        task_id: str,
        subtasks: Sequence[SubtaskSpec | dict[str, Any]],
        mode: DelegationMode | str = "parallel",
    ) -> Batch:
        """Delegate subtasks to children of `task_id`: all validated, committed atomically, then published."""
        return delegation.delegate(self.plane, task_id, subtasks, mode)

    @tracing.traced("subq.submit")
    def submit(
        self,
        prompt: str,
        *,
        subtasks: Sequence[SubtaskSpec | dict[str, Any]],
        todos: str | Sequence[object] | None = None,
        profile: str | None = None,
        mode: DelegationMode | str = "parallel",
        budget_usd: Decimal | float | str | None = None,
        idempotency_key: str | None = None,
        output_schema: dict[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        webhooks: Sequence[Webhook | Mapping[str, Any]] | None = None,
        on_complete: CeleryCallback | Mapping[str, Any] | str | None = None,
        tenant: str | None = None,
        priority: int | None = None,
    ) -> delegation.Submission:
        """Create a caller-owned root and delegate `subtasks` to it in one operation (`subq.submit`).

        Or refuse and write nothing: every check `delegate` makes on a fresh root runs
        first (`delegation.check_submission`). Only Redis or the broker can then fail;
        the root is then ended visibly (`failed`, with the reason) rather than left
        waiting, and the error is returned beside it, so the caller can name the root
        it created. With an `idempotency_key`, a repeated submission returns what the
        first made: its root and batch (or delegates now, if the first died before it could).
        The root's `metadata`, checked with the rest first, is every child's.
        """
        if metadata is not None:
            check_metadata(metadata)
        if output_schema is not None:  # with the rest, before the root exists
            check_schema(output_schema)
            raise ValidationError(NO_RUN_NO_OUTPUT, field="output_schema")
        checked_mode, checked = delegation.check_submission(self.plane, subtasks, mode, todos, budget_usd)
        parent, created = self.create_task_once(
            prompt, todos=todos, profile=profile, run=False, budget_usd=budget_usd, idempotency_key=idempotency_key,
            output_schema=output_schema, metadata=metadata, webhooks=webhooks, on_complete=on_complete,
            tenant=tenant, priority=priority, ends_with_batch=True,
        )  # fmt: skip
        return delegation.submit_to(self.plane, parent, created, checked, checked_mode)

    # -- control (coordinator/control.py, approvals.py) ---------------------------------

    def cancel(self, task_id: str, reason: str, *, actor: Actor = LOCAL) -> TaskRecord:
        """Cancel a task and its whole subtree; its parent hears why, with what had finished.

        Queued children never start (the stop is persisted in their records, which a
        run checks before it starts, and their Celery tasks are revoked); running ones
        stop at their next step, abandoning an in-flight model call; nothing is
        recorded after the stop. Results that had finished are kept. The cancel is on
        record as `actor`'s (the audit log).
        """
        record = control.cancel(self.plane, task_id, reason)
        self.record(actor, "cancel", task_id, detail=reason)
        return record

    def retry(self, task_id: str, *, failed: bool = False, actor: Actor = LOCAL) -> Retried:
        """Run a failed task again from its kept conversation and tool journal (coordinator/retry.py).

        Its spend stays counted and the new spend adds to it; its finished tool calls are not run
        again. With `failed`, every failed task of its subtree, children before parents: a parent
        whose failed children's batch is re-opened resumes with their new results. A task that is
        not failed, failed on its budget, or whose parent already went on with its result is refused
        (StateError, naming why), and nothing changes. The retry is on record as `actor`'s.
        """
        if not isinstance(failed, bool):
            raise ValidationError("failed must be true or false", field="failed")
        done = retry_room.retry(self.plane, task_id, failed=failed)
        self.record(actor, "retry", task_id, detail=f"retried {', '.join(done.retried + done.reopened)}")
        return done

    # -- outbound events (docs/webhooks.md) --------------------------------------------

    def deliveries(self, task_id: str) -> list[Delivery]:
        """Every delivery of the task's tree, oldest event first: where each goes (never a secret), its
        state, its attempts, the next one's time and the last answer."""
        root_id = ids.root_of(task_id)
        self.store.records.task_fields(task_id)  # NotFoundError for an unknown task
        targets: dict[str, str] = {}
        found = []
        for entry in self.store.outbox.deliveries(root_id):
            hook = str(entry["hook"])
            if hook not in targets:
                target = self.store.outbox.target(root_id, hook)
                targets[hook] = shown_target(hook, target[1]) if target else ""
            found.append(
                Delivery(
                    id=entry["id"], event_id=entry["event_id"], type=entry["type"], task_id=entry["task_id"],
                    target=targets[hook], state=entry["state"], attempts=int(entry.get("attempts") or 0),
                    created_at=float(entry["ts"]), next_at=entry.get("next_at"), last=str(entry.get("last") or ""),
                    last_at=entry.get("last_at"),
                )
            )  # fmt: skip
        return found

    def tenants(self) -> list[TenantState]:
        """Every tenant the tenants table names or that created a root within the retention: its running and
        waiting tasks, roots running, submits in the last minute and spend in the rolling day, with its policy."""
        return quotas.states(self.plane)

    def delivery_counts(self) -> dict[tuple[str, str], int]:
        """Delivery attempts of every process by (event type, outcome): the metrics' counter."""
        return self.store.outbox.counts()

    def oldest_delivery_wait_s(self) -> float:
        """How long the most overdue pending delivery has waited past its time (0 for none)."""
        return self.store.outbox.oldest_due_s()

    def redeliver(self, task_id: str, delivery_id: str, *, actor: Actor = LOCAL) -> Delivery:
        """Send a delivery of the task's tree again now, whatever its state (a receiver that lost it, one
        given up on): its attempts start again from 0 and its bounded time from now. On record as `actor`'s."""
        root_id = ids.root_of(task_id)
        # Its shape before Redis is asked, as the client checks it (a lone surrogate was a traceback in hiredis).
        check_delivery_id(task_id, delivery_id)
        self.store.records.task_fields(task_id)  # NotFoundError for an unknown task
        if self.store.outbox.delivery(root_id, delivery_id) is None:
            raise NotFoundError(f"Unknown delivery {delivery_id!r} of task {task_id}", field="delivery_id")
        self.store.outbox.settle(root_id, delivery_id, "pending")
        self.record(actor, "redeliver", delivery_id, detail=f"of {root_id}")
        return next(d for d in self.deliveries(root_id) if d.id == delivery_id)

    def snapshot(self, task_id: str) -> dict[str, LiveState]:
        """The live state of every task of the tree rooted at `task_id`."""
        return control.snapshot(self.plane, task_id)

    def list_approvals(self, root_id: str | None = None) -> list[Approval]:
        """Tool calls waiting for a decision, oldest first (of one tree, or all)."""
        return approvals.list_pending(self.plane, root_id)

    def decide(self, approval_id: str, decision: str, feedback: str | None = None, *, actor: Actor = LOCAL) -> Approval:
        """Approve or deny a pending tool call; only that task resumes, its siblings go on.

        The approval carries `decided_by` (the actor's name), and the decision is on record."""
        ids.root_of(approval_id, field="approval_id")
        try:
            decided = approvals.decide(self.plane, approval_id, decision, feedback, decided_by=actor.name)
        except BrokerError:
            # The broker refused the resume's publish after the decision's step: the decision stands (that step
            # put the task on the due list, and the reconciler publishes it), so it is on record all the same. Only
            # this caller's own: a late approval's publish is its expiry's, which is nobody's decision. (A read that
            # fails here leaves the broker's error the one told.)
            with contextlib.suppress(SubqError):
                decided = self.store.approvals.get_approval(approval_id)
                if decided.status in ("approved", "denied") and decided.decided_by == actor.name:
                    self._record_decision(actor, decided, feedback)
            raise
        self._record_decision(actor, decided, feedback)
        return decided

    def _record_decision(self, actor: Actor, decided: Approval, feedback: str | None) -> None:
        self.record(actor, "approve" if decided.status == "approved" else "deny", decided.id, detail=feedback or "")

    def expire_approval(self, approval_id: str) -> bool:
        """Deny an approval whose deadline has passed; False when it was decided or is not due."""
        return approvals.expire(self.plane, approval_id)

    # -- the tree's events and fleet figures (the API's stream and /metrics, the CLI) ----

    def last_event_id(self, root_id: str) -> str:
        return self.store.events.last_event_id(root_id)

    def read_events(
        self, root_id: str, after_id: str = "0-0", *, block_ms: int | None = None, count: int = 500
    ) -> list[tuple[str, dict[str, str]]]:
        """Entries of the tree's event stream after `after_id` (blocking up to block_ms if none)."""
        return self.store.events.read_events(root_id, after_id, block_ms=block_ms, count=count)

    def settled(self, task_id: str) -> tuple[bool, str]:
        """(whether the task has settled, its status): an agent task once it ended, a caller's once not delegated."""
        status, runner = self.store.records.status_of(task_id)
        done = TaskStatus(status).terminal or (runner == "caller" and status != TaskStatus.DELEGATED)
        return done, status

    def finishing(self, task_ids: Sequence[str]) -> list[str]:
        """Those of `task_ids` whose run may still record spend (it holds its lease, or has spend a stop refused
        to record yet): a stopped tree's figures grow until none is left (its runs' late spend)."""
        return self.store.records.finishing(task_ids, self.settings.heartbeat_lapse_s)

    def finishing_runs(self, task_id: str, /, *, among: Sequence[str] | None = None) -> FinishingRuns:
        """The tasks of the task's subtree whose runs may still record spend (GET /v1/tasks/{id}/finishing): a
        waiter holds a stopped task's answer until none is left (`StopHold`). `among`, a waiter's last look
        (`StopHold.among`): only those tasks are looked at again, the subtree not walked (a stopped task starts no
        new run); each must be a task of `task_id`'s tree (ValidationError)."""
        if among is not None:
            check_finishing_among(task_id, among)
            found = self.finishing(among) if among else []
        else:
            self.store.records.status_of(task_id)  # an unknown task is refused (NotFoundError), not an empty answer
            found = self.finishing(self.subtree_ids(task_id))
        return FinishingRuns(task_id=task_id, task_ids=found, lapse_s=self.settings.heartbeat_lapse_s)

    def subtree_ids(self, task_id: str) -> list[str]:
        """The task and all its descendants, top first."""
        return self.store.records.subtree_ids(task_id)

    def recent_records(self, count: int) -> list[TaskRecord]:
        """The `count` most recent tasks of the history index that still exist, newest first."""
        task_ids = self.store.records.recent_task_ids(root_id=None, offset=0, count=count)
        try:
            return self.store.records.get_records(task_ids)  # one round trip, the usual case
        except NotFoundError:  # one expired since it was indexed: read them one by one
            found = []
            for task_id in task_ids:
                try:
                    found.extend(self.store.records.get_records([task_id]))
                except NotFoundError:
                    continue
            return found

    def latency_histogram(self) -> dict[str, float]:
        """{'le_<ms>': cumulative count, 'count': n, 'sum_ms': total} of model request latency, fleet-wide.

        Every standard bucket is present (0 before any request), and any other bound found in Redis too.
        """
        return {**{f"le_{ms}": 0.0 for ms in LATENCY_BUCKETS_MS}, **self.store.metrics.latency_histogram()}

    def queue_depth(self) -> int:
        """Celery messages waiting in subq's queue (LLEN, as Celery's own tools report it)."""
        return self.store.metrics.queue_depth(self.settings.queue)

    def fleet_gauges(self) -> FleetGauges:
        """Queue depth, runs in flight, approvals waiting and dead letters: one round trip (GET /metrics)."""
        return self.store.metrics.fleet_gauges(self.settings.queue)

    def replica_shortfalls(self) -> int:
        """Steps of this process whose WAIT heard from fewer replicas than SUBQ_REDIS_MIN_REPLICAS (they stand)."""
        return self.store.core.replica_shortfalls.count

    def repairs(self) -> dict[str, int]:
        """Repairs the reconciler has made, by reason (coordinator/reconciler.py)."""
        return self.store.convergence.repairs()

    def workers_since(self, since_s: float) -> list[str]:
        """Worker processes whose heartbeat is at `since_s` or later (the health check's one read)."""
        return self.store.convergence.workers_since(since_s)

    # -- dead letters: messages no worker could decode or validate (workers/poison.py) --

    def record_dead_letter(self, entry: DeadLetter, digest: str | None = None) -> bool:
        """Keep a message the worker's consumer took off a queue and could not run (capped list); False when
        the same message (`digest`: `message_digest` of what it is, by default of the text kept) is on the list
        already: it came back after its worker died before acknowledging it."""
        kept = self.store.dead_letters.add_dead_letter(entry, digest or message_digest(entry.message))
        faults.crash_point(self.settings, "after-dead-letter")  # the caller acknowledges the message next
        return kept

    def dead_letters(self, limit: int = DEFAULT_PAGE) -> list[DeadLetter]:
        """The newest `limit` dead letters, newest first."""
        check_dead_letter_limit(limit)
        return self.store.dead_letters.dead_letters(limit)

    def count_dead_letters(self) -> int:
        return self.store.dead_letters.count_dead_letters()

    def purge_dead_letters(self, *, actor: Actor = LOCAL) -> int:
        """Delete every dead letter; returns how many there were. On record as `actor`'s."""
        purged = self.store.dead_letters.purge_dead_letters()
        self.record(actor, "purge_dead_letters", "dead-letters", detail=f"{purged} purged")
        return purged

    # -- the audit log (coordinator/audit.py) --------------------------------------------

    def record(self, actor: Actor, action: Action, target: str, *, reason: str = "", detail: str = "") -> None:
        """Put one step on the audit log: who (`actor`), what, on which target (a face's one call per step)."""
        audit_log.record(self.store.audit, actor, action, target, reason=reason, detail=detail)

    def audit(self, limit: int = DEFAULT_PAGE, before: str | None = None) -> tuple[list[AuditEntry], str | None]:
        """The audit log newest first, `limit` entries older than `before`; and the next page's cursor or None."""
        check_dead_letter_limit(limit)
        return self.store.audit.page(limit, before)

    def refused_counts(self) -> dict[str, int]:
        """Refused requests (401/403) by reason, fleet-wide (GET /metrics)."""
        return self.store.audit.refused_counts()

    # -- waiting -----------------------------------------------------------------------

    def wait(self, task_id: str, timeout_s: float) -> TaskRecord:
        """Block until the task has settled; return its record.

        An agent task (started with `run=True`, or any child) settles when it is
        completed, failed or cancelled; a caller-owned task when it is no longer
        `delegated` (its children have reported back). After a stop it returns once
        the stopped runs have recorded their late spend (`StopHold`, for
        at most a heartbeat lapse and within `timeout_s`), so the record's figures
        are final.
        """
        check_wait_timeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        hold: StopHold | None = None  # once settled after a stop
        with self.store.events.settle_watch(task_id) as watch:
            while True:
                done, status = self.settled(task_id)
                if done:
                    if TaskStatus(status).stopped:
                        hold = hold or StopHold(deadline)
                        if hold.due() and hold.holds(self.finishing_runs(task_id, among=hold.among)):
                            time.sleep(hold.look_in_s())
                            continue
                    return self.store.records.get_task(task_id)
                hold = None  # retried meanwhile: it runs again
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    record = self.store.records.get_task(task_id)
                    raise WaitTimeout(
                        f"Task {task_id} is still {record.status.value} after {timeout_s:g}s "
                        f"({len(record.awaiting_ids)} of {len(record.child_ids)} children outstanding)"
                    )
                watch.wait(min(remaining_s, WAIT_SLICE_MS / 1000))

    def close(self) -> None:
        self.client.close()


def _decode_entry(entry: str, task_id: str, index: int) -> dict[str, Any]:
    try:
        value = json.loads(entry)
    except json.JSONDecodeError:
        raise CorruptError(f"Conversation message {index} of task {task_id} is corrupt") from None
    if not isinstance(value, dict):
        raise CorruptError(f"Conversation message {index} of task {task_id} is corrupt")
    return value
