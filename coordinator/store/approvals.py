"""Approvals: a tool call that waits for a human decision, and the decision, taken once."""

from __future__ import annotations

import json
import time
from typing import Any

from redis.client import Pipeline

from coordinator.errors import NotFoundError
from coordinator.ids import root_of
from coordinator.models import Approval
from coordinator.replies import Decided
from coordinator.store.base import (
    EVENTS_MAXLEN,
    Part,
    _encode_record,
    _str_map,
    _strs,
    outbox_keys,
    translate_redis_errors,
)
from coordinator.store.fields import APPROVAL_OPTIONAL_FIELDS, ApprovalField
from coordinator.store.protocol import Decide, SaveApproval

__all__ = ["MAX_EVENT_ARGS_CHARS", "ApprovalStore"]

# A tool call's arguments in an `approval.requested` event, as JSON text: enough to decide from a phone;
# the whole call is in the web view the event links to.
MAX_EVENT_ARGS_CHARS = 2000


class ApprovalStore(Part):
    """Approval records, the fleet-wide pending list, and deciding one atomically."""

    @translate_redis_errors
    def save_approval(self, approval: Approval, token: str = "") -> str:
        """The approval, on the pending list, and its `approval.requested` event in the tree's outbox, in one
        step (save_approval.lua): a waiting approval is never without its notice (docs/webhooks.md), and the
        same approval saved again (a call sent again after its reply was lost) sends it once ('before'). 'ended',
        with nothing written, when its task has ended (stopped since its run's last step); 'fenced' when the run
        of lease `token` no longer holds the lease ('' for a save no run makes: not checked); else 'saved'."""
        arguments = json.dumps(approval.args, ensure_ascii=False)
        if len(arguments) > MAX_EVENT_ARGS_CHARS:
            arguments = arguments[: MAX_EVENT_ARGS_CHARS - 1] + "…"
        fields = {
            "approval_id": approval.id, "tool": approval.tool, "arguments": arguments,
            "deadline": approval.deadline, "todo": approval.todo_content,
        }  # fmt: skip
        return self.scripts(
            SaveApproval(
                approval=self.keys.approval(approval.root_id, approval.id), pending=self.keys.approvals(),
                task=self.keys.task(approval.root_id, approval.task_id),
                lease=self.keys.lease(approval.root_id, approval.task_id),
                outbox=outbox_keys(self.keys, approval.root_id), approval_id=approval.id,
                created_at=approval.created_at, retention_s=self.retention_s, task_id=approval.task_id,
                event_fields=json.dumps(fields), token=token,
                record=[str(part) for pair in _encode_record(approval.model_dump()).items() for part in pair],
            )
        )  # fmt: skip

    @translate_redis_errors
    def get_approval(self, approval_id: str) -> Approval:
        raw = _str_map(self.client.hgetall(self.keys.approval(root_of(approval_id), approval_id)))
        if not raw:
            raise NotFoundError(f"Unknown approval: {approval_id}", field="approval_id")
        data: dict[str, Any] = {**raw, ApprovalField.ARGS: json.loads(raw[ApprovalField.ARGS])}
        for name in APPROVAL_OPTIONAL_FIELDS:
            data[name] = data.get(name) or None
        return Approval.model_validate(data)

    @translate_redis_errors
    def pending_approval_ids(self) -> list[str]:
        return _strs(self.client.zrange(self.keys.approvals(), 0, -1))

    @translate_redis_errors
    def forget_lapsed(self, approval_id: str) -> bool:
        """Take an approval whose record lapsed with its tree off the fleet's pending index, where nothing else
        would (a decision needs the record); whether it was there. Left alone while the record exists."""
        record, pending = self.keys.approval(root_of(approval_id), approval_id), self.keys.approvals()

        def forget(pipe: Pipeline) -> bool:
            if pipe.exists(record):
                return False
            pipe.multi()
            pipe.zrem(pending, approval_id)
            return bool(pipe.execute()[0])

        return self.core.transaction([record], forget)

    @translate_redis_errors
    def decide(
        self,
        approval_id: str,
        status: str,
        feedback: str,
        decided_by: str = "",
        *,
        grace_s: float,
        withdraw: bool = False,
    ) -> Decided:
        """Decide a pending approval once, naming who decided (decide.lua): 'resume' when the decision ended its
        task's wait and the caller publishes the resume (claimed for the park's first approval, `reason_id`),
        'ok' when decided otherwise, 'stopped' when its task had ended (the call expired instead), or its status
        when it was not pending. A decision that ends the wait puts the task on the due list, to look at in
        `grace_s`.
        `withdraw`: the expiry of a call whose run stopped before it asked for all its calls, which ends no
        task's wait ('ok')."""
        root, now = root_of(approval_id), time.time()
        return self.scripts(
            Decide(
                approval=self.keys.approval(root, approval_id), pending=self.keys.approvals(),
                events=self.keys.events(root), approval_id=approval_id, status=status, feedback=feedback,
                now=now, events_maxlen=EVENTS_MAXLEN, task_prefix=self.keys.task(root, ""),
                approval_prefix=self.keys.approval(root, ""), decided_by=decided_by,
                outbox=outbox_keys(self.keys, root), retention_s=self.retention_s, due=self.keys.due(),
                lease_prefix=self.keys.lease(root, ""), look_at=now + grace_s, withdraw="1" if withdraw else None,
            )
        )  # fmt: skip
