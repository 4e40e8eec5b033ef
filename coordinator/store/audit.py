"""The audit log in Redis: a stream of entries, newest first when read, and refusals counted by reason."""

from __future__ import annotations

import time
import uuid
from typing import cast

import pydantic

from coordinator.audit import AUDIT_MAX_ENTRIES, REFUSALS_LOGGED_PER_MIN, Action, Actor, AuditEntry, check_before
from coordinator.errors import CorruptError
from coordinator.store.base import RESEND_MARK_S, Part, _str_map, translate_redis_errors
from coordinator.store.protocol import AuditAdd

__all__ = ["AuditLog"]


class AuditLog(Part):
    """`store.audit`: add an entry, read a page newest first, count refusals (`<p>:audit`, `<p>:metrics:refused`)."""

    @translate_redis_errors
    def add(self, actor: Actor, action: Action, target: str, *, reason: str = "", detail: str = "") -> None:
        """Append one entry; trim what is past the retention and the cap, and count a refusal, in one step
        (audit_add.lua), once: sent again after its reply was lost, the entry finds its own mark."""
        now = time.time()
        fields = {
            "ts": repr(now),
            "actor": actor.name,
            "action": action,
            "target": target,
            "address": actor.address,
            "via": actor.via,
            "reason": reason,
            "detail": detail,
        }
        who = actor.name or f"address {actor.address}"  # a caller no key names counts by its address
        self.scripts(
            AuditAdd(
                stream=self.keys.audit(), refused=self.keys.refused(),
                mark=self.keys.audit_mark(uuid.uuid4().hex), window=self.keys.audit_refusals(who, int(now // 60)), mark_s=RESEND_MARK_S, max_entries=AUDIT_MAX_ENTRIES,
                oldest_kept=f"{int((now - self.retention_s) * 1000)}-0", reason=reason,
                logged_per_min=REFUSALS_LOGGED_PER_MIN, fields=list(fields.items()),
            )
        )  # fmt: skip

    @translate_redis_errors
    def page(self, limit: int, before: str | None = None) -> tuple[list[AuditEntry], str | None]:
        """Up to `limit` entries newest first, older than the entry `before`; and the next page's cursor or None."""
        check_before(before)
        if before is not None and _id_value(before) == (0, 0):
            return [], None  # nothing is older than the first id (and Redis refuses the range `(0-0`)
        high = f"({before}" if before is not None else "+"
        oldest_kept_ms = int((time.time() - self.retention_s) * 1000)
        raw = cast(
            list[tuple[str, dict[str, str]]],
            # One more than asked: whether an older page exists, without a second read.
            self.client.xrevrange(self.keys.audit(), max=high, min=f"{oldest_kept_ms}-0", count=limit + 1),
        )
        entries = []
        for entry_id, fields in raw:
            try:
                entries.append(AuditEntry.model_validate({**_str_map(fields), "id": entry_id}))
            except pydantic.ValidationError:
                raise CorruptError(f"Audit entry {entry_id} is corrupt") from None
        return entries[:limit], (entries[limit - 1].id if len(entries) > limit else None)

    @translate_redis_errors
    def refused_counts(self) -> dict[str, int]:
        """Refused requests (401/403) counted by reason, fleet-wide, since the log began."""
        return {reason: int(count) for reason, count in _str_map(self.client.hgetall(self.keys.refused())).items()}


def _id_value(value: str) -> tuple[int, int]:
    ms, _, seq = value.partition("-")
    return int(ms), int(seq)
