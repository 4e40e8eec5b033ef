"""Approvals: a tool call that waits for a human decision, and the decision, taken once."""

from __future__ import annotations

import json
import time
from typing import Any

from coordinator.errors import NotFoundError
from coordinator.ids import root_of
from coordinator.models import Approval
from coordinator.store.base import (
    EVENTS_MAXLEN,
    Part,
    _encode_record,
    _str_map,
    _strs,
    translate_redis_errors,
)
from coordinator.store.fields import APPROVAL_OPTIONAL_FIELDS, ApprovalField
from coordinator.store.protocol import Decide

__all__ = ["ApprovalStore"]


class ApprovalStore(Part):
    """Approval records, the fleet-wide pending list, and deciding one atomically."""

    @translate_redis_errors
    def save_approval(self, approval: Approval) -> None:
        key = self.keys.approval(approval.root_id, approval.id)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=_encode_record(approval.model_dump()))
            pipe.expire(key, self.retention_s)
            pipe.zadd(self.keys.approvals(), {approval.id: approval.created_at})
            pipe.execute()

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
    def decide(self, approval_id: str, status: str, feedback: str, decided_by: str = "") -> str:
        """Decide a pending approval once, naming who decided; 'ok', or its status when it was not pending."""
        root = root_of(approval_id)
        return self.scripts(
            Decide(
                approval=self.keys.approval(root, approval_id), pending=self.keys.approvals(),
                events=self.keys.events(root), approval_id=approval_id, status=status, feedback=feedback,
                now=time.time(), events_maxlen=EVENTS_MAXLEN, task_prefix=self.keys.task(root, ""),
                approval_prefix=self.keys.approval(root, ""), decided_by=decided_by,
            )
        )  # fmt: skip
