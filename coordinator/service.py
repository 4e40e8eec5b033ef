"""The Coordinator: create tasks, delegate, update todos, query and wait.

The one service every interface (Python API, CLI, HTTP) goes through. Every
operation validates all of its input first and raises the project's own error
naming the field; only then does it commit, in one atomic step, and only after
the commit does it publish work.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import pydantic
import redis
from celery import Celery

from coordinator import dispatch, ids, writeback
from coordinator import todos as todo_lists
from coordinator.celery_app import make_app
from coordinator.errors import CorruptError, NotFoundError, StateError, ValidationError, WaitTimeout
from coordinator.export import export_tree
from coordinator.keys import Keys
from coordinator.models import (
    Approval,
    Batch,
    DelegationMode,
    HistoryItem,
    LiveState,
    SubtaskSpec,
    TaskRecord,
    TaskStatus,
    TodoItem,
    format_usd,
    usd_to_micros,
)
from coordinator.settings import Settings, load_settings
from coordinator.store import Store

__all__ = ["Coordinator"]

# How long one blocking read of the tree's event stream lasts inside wait();
# short enough to notice a deadline, long enough not to spin.
WAIT_SLICE_MS = 1000
MAX_PROMPT_CHARS = 200_000
MAX_REASON_CHARS = 2000
# History pages: enough for a screen, bounded so one call stays cheap.
DEFAULT_PAGE = 50
MAX_PAGE = 500


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
            client = redis.Redis.from_url(self.settings.require_redis_url(), decode_responses=True)
        self.client = client
        self.store = Store(client, Keys(self.settings.key_prefix), self.settings.result_retention_s)
        self._app = app

    @property
    def app(self) -> Celery:
        """The Celery app used to publish work, built on first use."""
        if self._app is None:
            self._app = make_app(self.settings)
        return self._app

    # -- tasks -------------------------------------------------------------------------

    def create_task(
        self,
        prompt: str,
        todos: str | Sequence[object] | None = None,
        profile: str | None = None,
        run: bool = False,
        budget_usd: Decimal | float | str | None = None,
    ) -> TaskRecord:
        """Create a root task.

        With `run=False` the caller owns it and delegates through this API; with
        `run=True` it starts as an agent on the fleet (its model plans, delegates
        and completes), and `wait()` returns when it has ended.
        """
        prompt = _text(prompt, "prompt", MAX_PROMPT_CHARS)
        if not isinstance(run, bool):
            raise ValidationError("run must be true or false", field="run")
        profile_name = profile or self.settings.default_profile
        self.settings.profile(profile_name)
        budget_micros = _budget_micros(budget_usd, "budget_usd")
        items = todo_lists.parse_update(todos) if todos is not None else []
        now = time.time()
        root_id = ids.new_root_id()
        record = TaskRecord(
            id=root_id,
            root_id=root_id,
            status=TaskStatus.ACTIVE,
            prompt=prompt,
            profile=profile_name,
            runner="agent" if run else "caller",
            budget_micros=budget_micros,
            number=self.store.next_numbers(1),
            created_at=now,
            updated_at=now,
        )
        self.store.create_root(record, items)
        if run:
            dispatch.publish_run(self.app, record)
        return record

    def get_task(self, task_id: str) -> TaskRecord:
        return self.store.get_task(task_id)

    def get_todos(self, task_id: str) -> list[TodoItem]:
        """The task's todo list; linked items show their child's subtree figures live."""
        return self.store.get_todos(task_id, live=True)

    def get_children(self, task_id: str) -> list[TaskRecord]:
        return self.store.get_children(task_id)

    def get_batch(self, batch_id: str) -> Batch:
        return self.store.get_batch(batch_id)

    def messages(self, task_id: str, kind: str = "ui") -> list[dict[str, Any]]:
        """The task's messages, oldest first: `ui` (UI messages) or `api` (the model conversation)."""
        if kind == "ui":
            return self.store.ui_messages(task_id)
        if kind == "api":
            self.store.task_fields(task_id)
            return [_decode_entry(entry, task_id, n) for n, entry in enumerate(self.store.conversation(task_id))]
        raise ValidationError(f"kind must be 'ui' or 'api', not {kind!r}", field="kind")

    def export_tree(self, task_id: str, directory: Path | str) -> list[Path]:
        """Write the task's subtree as folders (see coordinator/export.py); returns the files."""
        return export_tree(self, task_id, Path(directory))

    def history_item(self, task_id: str) -> HistoryItem:
        return HistoryItem.of(self.store.get_task(task_id))

    def list_tasks(
        self,
        *,
        status: str | None = None,
        root_id: str | None = None,
        limit: int = DEFAULT_PAGE,
        cursor: int = 0,
    ) -> tuple[list[HistoryItem], int | None]:
        """Tasks by recency (newest first) with their figures; returns (page, next cursor or None)."""
        if status is not None and status not in {s.value for s in TaskStatus}:
            allowed = ", ".join(s.value for s in TaskStatus)
            raise ValidationError(f"status must be one of {allowed}, not {status!r}", field="status")
        if not 1 <= limit <= MAX_PAGE:
            raise ValidationError(f"limit must be between 1 and {MAX_PAGE}", field="limit")
        if cursor < 0:
            raise ValidationError("cursor must not be negative", field="cursor")
        if root_id is not None:
            ids.root_of(root_id)
        items: list[HistoryItem] = []
        offset = cursor
        while len(items) < limit:
            page = self.store.recent_task_ids(root_id=root_id, offset=offset, count=MAX_PAGE)
            if not page:
                return items, None
            for n, task_id in enumerate(page, start=offset):
                try:
                    record = self.store.get_task(task_id)
                except NotFoundError:  # expired since it was indexed
                    continue
                if status is None or record.status.value == status:
                    items.append(HistoryItem.of(record))
                    if len(items) == limit:
                        return items, n + 1
            offset += len(page)
        return items, offset

    def update_todos(self, task_id: str, update: str | Sequence[object]) -> list[TodoItem]:
        """Replace the task's todo list; links and figures of existing items survive."""
        parsed = todo_lists.parse_update(update)  # a bad update is refused before any read
        return self.store.update_todos(task_id, lambda _record, old: todo_lists.merge(old, parsed))

    # -- delegation --------------------------------------------------------------------

    def delegate(
        self,
        parent_id: str,
        specs: Sequence[SubtaskSpec | dict[str, Any]],
        mode: DelegationMode | str = "parallel",
    ) -> Batch:
        """Delegate subtasks to children: all validated, committed atomically, then published."""
        batch, children = self.commit_delegation(parent_id, specs, mode)
        self.publish(batch, children)
        return batch

    def publish(self, batch: Batch, children: list[TaskRecord]) -> None:
        """Publish a committed batch's work, once (a second call finds it published)."""
        if self.store.claim_batch(batch.id, "published"):
            if batch.mode == "sequential":
                self.store.claim(children[0].id, "published")  # later steps are claimed as they start
            dispatch.publish_batch(self.app, batch, children)

    def commit_delegation(
        self,
        parent_id: str,
        specs: Sequence[SubtaskSpec | dict[str, Any]],
        mode: DelegationMode | str = "parallel",
        tool_call_id: str = "",
    ) -> tuple[Batch, list[TaskRecord]]:
        """Validate and commit a delegation in one atomic step, without publishing it.

        An agent parent commits from its delegation tool, persists its conversation,
        and only then publishes, so no child can finish before the parent's state is saved.
        """
        if mode not in ("parallel", "sequential"):
            raise ValidationError(f"mode must be 'parallel' or 'sequential', not {mode!r}", field="mode")
        checked = self.check_specs(specs)
        root_id = ids.root_of(parent_id)
        child_ids = [ids.new_child_id(root_id) for _ in checked]
        batch_id = ids.new_batch_id(root_id)

        def plan(parent: TaskRecord, items: list[TodoItem]) -> tuple[Batch, list[TaskRecord], list[TodoItem]]:
            if parent.status != TaskStatus.ACTIVE:
                raise StateError(
                    f"Task {parent.id} is {parent.status.value}, not active: it cannot delegate now",
                    field="parent_id",
                )
            if parent.depth >= self.settings.max_depth:
                raise StateError(
                    f"Task {parent.id} is at depth {parent.depth}; SUBQ_MAX_DEPTH={self.settings.max_depth} "
                    "allows no deeper subtasks",
                    field="parent_id",
                )
            remaining = self._budget_left(parent)
            for index, spec in enumerate(checked):
                wanted = _budget_micros(spec.budget_usd, f"specs.{index}.budget_usd")
                if remaining is not None and wanted > remaining:
                    raise ValidationError(
                        f"specs.{index}.budget_usd: {format_usd(wanted)} exceeds what remains of the parent's "
                        f"budget ({format_usd(remaining)})",
                        field=f"specs.{index}.budget_usd",
                    )
            new_items, links = todo_lists.link_children(
                items, [(cid, spec.todo_id, spec.description) for cid, spec in zip(child_ids, checked, strict=True)]
            )
            now = time.time()
            children = [
                TaskRecord(
                    id=cid,
                    parent_id=parent.id,
                    root_id=parent.root_id,
                    depth=parent.depth + 1,
                    status=TaskStatus.ACTIVE,
                    prompt=spec.message,
                    description=spec.description,
                    profile=spec.profile or parent.profile,
                    todo_id=todo_id,
                    batch_id=batch_id,
                    runner="agent",
                    budget_micros=_budget_micros(spec.budget_usd, "budget_usd"),
                    created_at=now,
                    updated_at=now,
                )
                for cid, spec, todo_id in zip(child_ids, checked, links, strict=True)
            ]
            batch = Batch(
                id=batch_id,
                parent_id=parent.id,
                root_id=parent.root_id,
                mode="parallel" if mode == "parallel" else "sequential",
                child_ids=child_ids,
                tool_call_id=tool_call_id,
                created_at=now,
            )
            return batch, children, new_items

        batch, children = self.store.commit_delegation(parent_id, plan)
        for child in children:
            self.store.set_live(child, "queued")
        first = self.store.next_numbers(len(children))
        self.store.set_numbers({c.id: first + n for n, c in enumerate(children)})
        return batch, [c.model_copy(update={"number": first + n}) for n, c in enumerate(children)]

    def _budget_left(self, parent: TaskRecord) -> int | None:
        """What remains of the tightest budget over the parent (its own or an ancestor's), if any."""
        chain = [parent, *self.store.get_records(parent.ancestors)] if parent.ancestors else [parent]
        left = [t.budget_micros - t.total_cost_micros for t in chain if t.budget_micros > 0]
        return max(0, min(left)) if left else None

    # -- control -----------------------------------------------------------------------

    def cancel(self, task_id: str, reason: str) -> TaskRecord:
        """Cancel a task and its whole subtree; its parent hears why, with what had finished.

        Queued children never start (the stop is persisted in their records, which a
        run checks before it starts, and their Celery tasks are revoked); running ones
        stop at their next step, abandoning an in-flight model call; nothing is
        recorded after the stop. Results that had finished are kept.
        """
        reason = _text(reason, "reason", MAX_REASON_CHARS)
        record = self.store.get_task(task_id)
        if record.status.terminal:
            raise StateError(
                f"Task {task_id} has already ended ({record.status.value}); only a task that has not ended "
                "can be cancelled",
                field="task_id",
            )
        self.stop_subtree(
            record,
            top_status="cancelled",
            top_error=f"cancelled: {reason}",
            top_class="Cancelled",
            error=f"cancelled with {task_id}: {reason}",
        )
        return self.store.get_task(task_id)

    def stop_budget(self, holder_id: str) -> None:
        """The subtree of `holder_id` has spent its budget: stop it, reporting the figures."""
        holder = self.store.get_task(holder_id)
        children = self.store.get_records(holder.child_ids)
        spent = ", ".join(f"{c.description or c.id} {format_usd(c.total_cost_micros)}" for c in children)
        self.stop_subtree(
            holder,
            top_status="failed",
            top_error=(
                f"budget of {format_usd(holder.budget_micros)} exhausted: the subtree spent "
                f"{format_usd(holder.total_cost_micros)} (own {format_usd(holder.cost_micros)}"
                + (f"; children: {spent}" if spent else "")
                + ")"
            ),
            top_class="BudgetExhausted",
            error=f"stopped: the budget of {holder_id} is exhausted",
        )

    def stop_subtree(self, top: TaskRecord, *, top_status: str, top_error: str, top_class: str, error: str) -> None:
        ids = self.store.subtree_ids(top.id)
        stopped = self.store.stop_tasks(
            ids, top_status=top_status, status="cancelled", top_error=top_error, error=error,
            top_class=top_class, error_class="Cancelled",
        )  # fmt: skip
        if not stopped:
            return
        self.app.control.revoke(stopped)  # queued ones never start (the persisted status covers restarts)
        records = self.store.get_records(stopped)
        for approval_id in self.store.pending_approval_ids():
            if approval_id.startswith(top.root_id) and self.store.get_approval(approval_id).task_id in stopped:
                self.store.decide(approval_id, "expired", "the task was stopped")
        # Close every batch a stopped task waited on, deepest first, then the top's own
        # place in its parent's batch, so each parent hears what had finished.
        for record in reversed(records):
            if record.waiting_batch_id:
                writeback.settle(self, record.waiting_batch_id)
        stopped_top = self.store.get_task(top.id)
        if stopped_top.status.terminal:
            writeback.settle_child(self, stopped_top)

    def snapshot(self, root_id: str) -> dict[str, LiveState]:
        """The live state of every task of the tree (queued, running, waiting_approval, ended)."""
        record = self.store.get_task(root_id)
        if record.id != record.root_id:
            raise ValidationError(f"{root_id} is not a root task (its root is {record.root_id})", field="root_id")
        live = self.store.live(root_id)
        out: dict[str, LiveState] = {}
        for task in self.store.get_records(self.store.tree_task_ids(root_id)):
            state = live.get(task.id, {})
            ended = task.status.value if task.status.terminal else None
            out[task.id] = LiveState.model_validate({
                "task_id": task.id, "parent_id": task.parent_id, "depth": task.depth,
                "state": ended or state.get("state") or ("delegated" if task.status == TaskStatus.DELEGATED else "queued"),
                "ts": float(state.get("ts") or task.updated_at), "tool": state.get("tool"), "text": state.get("text"),
                "requests": task.requests, "cost_micros": task.total_cost_micros,
            })  # fmt: skip
        return out

    def list_approvals(self, root_id: str | None = None) -> list[Approval]:
        """Tool calls waiting for a decision, oldest first (of one tree, or all)."""
        if root_id is not None:
            self.store.get_task(root_id)
        out = []
        for approval_id in self.store.pending_approval_ids():
            if root_id is None or approval_id.startswith(root_id):
                try:
                    out.append(self.store.get_approval(approval_id))
                except NotFoundError:  # expired with its tree
                    continue
        return out

    def decide(self, approval_id: str, decision: str, feedback: str | None = None) -> Approval:
        """Approve or deny a pending tool call; only that task resumes, its siblings go on."""
        if decision not in ("approve", "deny"):
            raise ValidationError(f"decision must be 'approve' or 'deny', not {decision!r}", field="decision")
        if feedback is not None and not isinstance(feedback, str):
            raise ValidationError("feedback must be a string", field="feedback")
        approval = self.store.get_approval(approval_id)
        status = "approved" if decision == "approve" else "denied"
        return self._decide(approval, status, feedback or "")

    def _decide(self, approval: Approval, status: str, feedback: str) -> Approval:
        outcome = self.store.decide(approval.id, status, feedback)
        if outcome != "ok":
            raise StateError(f"Approval {approval.id} was already {outcome}", field="approval_id")
        task = self.store.get_task(approval.task_id)
        waiting = json.loads(self.store.task_field(task.id, "waiting_approval_ids") or "[]")
        still = [a for a in waiting if a != approval.id and self.store.get_approval(a).status == "pending"]
        if not still and not task.status.terminal and self.store.claim_resume(task.id, approval.id):
            dispatch.publish_run(self.app, task, self.store.next_resume(task.id))
        return self.store.get_approval(approval.id)

    def expire_approval(self, approval_id: str) -> bool:
        """Deny an approval whose deadline has passed; False when it was decided or is not due."""
        approval = self.store.get_approval(approval_id)
        if approval.status != "pending" or time.time() < approval.deadline:
            return False
        try:
            self._decide(approval, "expired", f"no decision within {self.settings.approval_timeout_s}s")
        except StateError:
            return False
        return True

    def check_specs(self, specs: Sequence[SubtaskSpec | dict[str, Any]]) -> list[SubtaskSpec]:
        if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
            raise ValidationError("specs must be a list of subtask specs", field="specs")
        if not specs:
            raise ValidationError("specs is empty: a delegation needs at least one subtask", field="specs")
        if len(specs) > self.settings.max_fanout:
            raise ValidationError(
                f"{len(specs)} subtasks exceed SUBQ_MAX_FANOUT={self.settings.max_fanout}", field="specs"
            )
        checked: list[SubtaskSpec] = []
        for index, spec in enumerate(specs):
            try:
                parsed = spec if isinstance(spec, SubtaskSpec) else SubtaskSpec.model_validate(spec)
            except pydantic.ValidationError as exc:
                err = exc.errors()[0]
                path = ".".join(str(p) for p in ("specs", index, *err["loc"]))
                raise ValidationError(f"{path}: {err['msg']}", field=path) from None
            if parsed.profile is not None:
                try:
                    self.settings.profile(parsed.profile)
                except ValidationError as exc:
                    raise type(exc)(exc.message, field=f"specs.{index}.profile") from None
            checked.append(parsed)
        return checked

    # -- waiting -----------------------------------------------------------------------

    def wait(self, task_id: str, timeout_s: float) -> TaskRecord:
        """Block until the task has settled; return its record.

        An agent task (started with `run=True`, or any child) settles when it is
        completed, failed or cancelled; a caller-owned task when it is no longer
        `delegated` (its children have reported back).
        """
        if timeout_s < 0:
            raise ValidationError("timeout_s must not be negative", field="timeout_s")
        deadline = time.monotonic() + timeout_s
        root_id = ids.root_of(task_id)
        while True:
            # Read the stream position before the status, so an event between the
            # two wakes the blocking read below instead of being missed.
            last_id = self.store.last_event_id(root_id)
            status, runner = self.store.status_of(task_id)
            if TaskStatus(status).terminal or (runner == "caller" and status != TaskStatus.DELEGATED):
                return self.store.get_task(task_id)
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                record = self.store.get_task(task_id)
                raise WaitTimeout(
                    f"Task {task_id} is still {record.status.value} after {timeout_s:g}s "
                    f"({len(record.awaiting_ids)} of {len(record.child_ids)} children outstanding)"
                )
            self.store.wait_for_event(root_id, last_id, min(WAIT_SLICE_MS, remaining_ms))

    def close(self) -> None:
        self.client.close()


def _budget_micros(value: object, field: str) -> int:
    """A budget in USD as integer micro-USD (0: none); a positive number or an error naming the field."""
    if value is None:
        return 0
    try:
        usd = (
            Decimal(str(value))
            if isinstance(value, (int, float, str, Decimal)) and not isinstance(value, bool)
            else None
        )
    except InvalidOperation:
        usd = None
    if usd is None or not usd.is_finite() or usd <= 0:
        raise ValidationError(f"{field} must be a positive number of US dollars, not {value!r}", field=field)
    micros = usd_to_micros(usd)
    if micros < 1:
        raise ValidationError(f"{field} must be at least one micro-dollar (0.000001)", field=field)
    return micros


def _decode_entry(entry: str, task_id: str, index: int) -> dict[str, Any]:
    try:
        value = json.loads(entry)
    except json.JSONDecodeError:
        raise CorruptError(f"Conversation message {index} of task {task_id} is corrupt") from None
    if not isinstance(value, dict):
        raise CorruptError(f"Conversation message {index} of task {task_id} is corrupt")
    return value


def _text(value: object, field: str, max_chars: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{field} must be a non-empty string", field=field)
    if len(value) > max_chars:
        raise ValidationError(f"{field} is {len(value)} characters; the limit is {max_chars}", field=field)
    return value
