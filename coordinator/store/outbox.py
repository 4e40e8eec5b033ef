"""store.outbox: a tree's event subscriptions, its outbox of deliveries, and the pending index.

- `<p>:{root}:hooks` is written with the root (`create_root`'s MULTI) and never
  read back by a face: it holds the subscriptions' secrets. Its `h:<n>` fields are
  what `outbox_add.lua` matches an event against; `s:<n>` is the target the
  deliverer reads.
- `<p>:{root}:outbox` holds each delivery's state; an event is written into it by
  the very script that makes the state change (finish_task, stop_tasks, ...), so
  the two commit together or not at all.
- `<p>:outbox` is every tree's pending deliveries by due time; a claim moves one to
  the end of its lease (`claim_deliveries.lua`) and reads what its attempt needs
  (`read_claimed.lua`), a settle takes it off or puts it back at its next time
  (`settle_delivery.lua`); the deliverer's step does the three in one call
  (`settle_and_claim.lua`).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.models import ClaimedDelivery, Settled
from coordinator.store.base import Part, _str_map, outbox_keys, translate_redis_errors
from coordinator.store.fields import INT_FIELDS, JSON_FIELDS, TaskField
from coordinator.store.keys import Keys, cut
from coordinator.store.protocol import (
    ClaimedNames,
    DeliveryOutcome,
    DeliveryTree,
    OutboxAdd,
    SettleAndClaim,
    SettleDelivery,
)
from coordinator.text import ascii_digits

# Settled: coordinator.models, named here for the store's callers.
__all__ = ["EVENT_FIELDS", "OutboxStore", "Settled", "event_record"]

# What an event's payload reads of its task's record (coordinator/outbound.py `payload`): a few fields of
# the hash, not the whole record (a decoded TaskRecord cost the deliverer about 0.25 ms of CPU a delivery
# in a 1,000-wide tree's ends, each of another task; docs/benchmarks.md). hashes.lua's EVENT_FIELDS is the same
# list, which the scripts read (outbox_add keeps them with an end's delivery, read_claimed reads the rest):
# this one decodes their values (tests/test_webhooks_batches.py holds the two equal).
EVENT_FIELDS = (
    TaskField.ROOT_ID, TaskField.METADATA, TaskField.SUMMARY, TaskField.OUTPUT, TaskField.TOKENS_IN,
    TaskField.TOKENS_OUT, TaskField.TOTAL_TOKENS, TaskField.COST_MICROS, TaskField.TOTAL_COST_MICROS,
    TaskField.ERROR, TaskField.ERROR_CLASS,
)  # fmt: skip


@functools.lru_cache(maxsize=16)  # one a deployment's prefix: cut once, not at every step
def claimed_names(keys: Keys) -> ClaimedNames:
    """How read_claimed.lua names a claimed delivery's keys: the keys module's names, cut where the ids go."""
    tree_head, outbox_tail = cut(keys.outbox)
    hooks_tail, task_middle = cut(keys.hooks)[1], cut(keys.task, 2)[1]
    return ClaimedNames(tree_head=tree_head, outbox_tail=outbox_tail, hooks_tail=hooks_tail, task_middle=task_middle)


def event_record(values: Sequence[str | None]) -> dict[str, Any] | None:
    """A task's EVENT_FIELDS (their values in that order, as read_claimed.lua reads them) decoded as the whole
    record reads them (GET /v1/tasks/{id}: records.decode_record; tests/test_webhooks_batches.py holds the
    two equal); None when the task has expired."""
    raw = dict(zip(EVENT_FIELDS, values, strict=True))
    if raw[TaskField.ROOT_ID] is None:
        return None
    fields: dict[str, Any] = {name: str(value or "") for name, value in raw.items()}
    for name, value in raw.items():
        if name in INT_FIELDS:
            fields[name] = int(value or 0)
        elif name in JSON_FIELDS:
            fields[name] = json.loads(value) if value else None
    fields[TaskField.METADATA] = fields[TaskField.METADATA] or {}  # as TaskRecord reads none
    return fields


class OutboxStore(Part):
    """Subscriptions, deliveries and their claims."""

    def hooks_mapping(
        self, root_id: str, targets: Mapping[str, tuple[str, str]], tree_cap: int, cap: int
    ) -> dict[str, str]:
        """The hooks hash of a new root: subscription n -> (event patterns, target JSON); empty for none."""
        if not targets:
            return {}
        fields = {"~root": root_id, "~tree_cap": str(tree_cap), "~cap": str(cap), "~seq": "0"}
        for n, (patterns, target) in targets.items():
            fields[f"h:{n}"], fields[f"s:{n}"] = patterns, target
        return fields

    @translate_redis_errors
    def add_event(self, root_id: str, task_id: str, event_type: str, fields: Mapping[str, Any]) -> int:
        """An event not tied to a script's step (none yet: approvals and budgets go through their own)."""
        return self.scripts(
            OutboxAdd(
                outbox=outbox_keys(self.keys, root_id), task_id=task_id, event_type=event_type, now=time.time(),
                retention_s=self.retention_s, fields=json.dumps(dict(fields)) if fields else "",
            )
        )  # fmt: skip

    @translate_redis_errors
    def delivery(self, root_id: str, delivery_id: str) -> dict[str, Any] | None:
        raw = self.client.hget(self.keys.outbox(root_id), delivery_id)
        return None if raw is None else dict(json.loads(raw))

    @translate_redis_errors
    def deliveries(self, root_id: str) -> list[dict[str, Any]]:
        """Every delivery of the tree, oldest event first. An entry as no script writes it (not JSON, or without
        what a listing reads) is left out until the deliverer gives it up: settle_delivery.lua writes it whole
        then. Listing it raw failed the task's page and `subq deliveries` meanwhile."""
        raw = _str_map(self.client.hgetall(self.keys.outbox(root_id)))
        found = [entry for entry in map(_listable, raw.values()) if entry is not None]
        return sorted(found, key=_event_order)

    @translate_redis_errors
    def target(self, root_id: str, hook: str) -> tuple[str, dict[str, Any]] | None:
        """A subscription's event patterns ('' once ended by a 410) and its target, or None when gone."""
        patterns, target = self.client.hmget(self.keys.hooks(root_id), [f"h:{hook}", f"s:{hook}"])
        if patterns is None or target is None:
            return None
        return str(patterns), dict(json.loads(target))

    @translate_redis_errors
    def dropped(self, root_id: str) -> int:
        """Events the tree's subscriptions asked for but a cap kept out of the outbox."""
        return int(self.client.hget(self.keys.hooks(root_id), "~dropped") or 0)

    @translate_redis_errors
    def settle(
        self, root_id: str, delivery_id: str, state: str, *, next_at: float = 0.0, last: str = "", attempts: int = -1
    ) -> str:
        """Record an attempt's outcome (or a redeliver: `pending`); the delivery's state after it. With
        `attempts` (its claim's), an outcome other than delivered is recorded only while the delivery has them."""
        return self.scripts(
            SettleDelivery(
                outbox=outbox_keys(self.keys, root_id), counts=self.keys.webhook_counts(), delivery_id=delivery_id, member=f"{root_id} {delivery_id}",
                state=state, next_at=next_at, last=last, now=time.time(), retention_s=self.retention_s, attempts=attempts,
            )
        )  # fmt: skip

    @translate_redis_errors
    def settle_and_claim(self, outcomes: Sequence[Settled], limit: int, lease_ms: int) -> list[ClaimedDelivery]:
        """`settle` each outcome, then `claim`, and read what the claimed deliveries' attempts need, in one
        script call (`settle_and_claim.lua`, which runs settle_delivery, claim_deliveries and read_claimed):
        the deliverer's step (coordinator/outbound.py). A claimed delivery already settled, or whose tree
        expired, is taken off the pending index there and not returned."""
        if not outcomes and limit <= 0:
            return []
        now = time.time()
        reads = self.scripts(
            SettleAndClaim(
                pending=self.keys.outbox_pending(), counts=self.keys.webhook_counts(),
                trees=[DeliveryTree(self.keys.hooks(o.root_id), self.keys.outbox(o.root_id)) for o in outcomes],
                now=now, retention_s=self.retention_s, now_ms=int(now * 1000), lease_ms=lease_ms,
                limit=max(limit, 0), names=claimed_names(self.keys),
                outcomes=[
                    DeliveryOutcome(o.delivery_id, f"{o.root_id} {o.delivery_id}", o.state, o.next_at, o.last, o.attempts)
                    for o in outcomes
                ],
            )
        )  # fmt: skip
        # The script has committed: from here nothing raises, or the deliverer would put back the outcomes it
        # settled, settled again at the next step. Each claimed delivery decodes on its own: one whose stored
        # data does not (its entry, read_claimed.lua says; a record's int field that does not parse) is returned
        # `refused`, and given up.
        targets: dict[str, dict[str, Any]] = {}  # each subscription's target decoded once a claim
        claimed = []
        for read in reads:
            root_id, _, delivery_id = read.member.partition(" ")
            if read.refused:  # its entry did not decode in the script, which says why and what its attempts read as
                held_to = {"attempts": read.attempts}  # all its outcome needs of it (settle_delivery.lua)
                claimed.append(ClaimedDelivery(root_id, delivery_id, held_to, None, None, refused=read.refused))
                continue
            entry: dict[str, Any] = {}  # kept when it decodes, even if the rest does not: its attempts
            try:
                entry = dict(json.loads(read.entry))
                found = None
                if read.patterns is not None and read.target is not None:
                    if read.target not in targets:
                        targets[read.target] = dict(json.loads(read.target))
                    found = (read.patterns, targets[read.target])
                claimed.append(ClaimedDelivery(root_id, delivery_id, entry, found, event_record(read.values)))
            except Exception as exc:  # any decode error: this delivery alone is given up
                refused = f"its stored data does not decode: {type(exc).__name__}: {exc}"
                claimed.append(ClaimedDelivery(root_id, delivery_id, entry, None, None, refused=refused))
        return claimed

    @translate_redis_errors
    def counts(self) -> dict[tuple[str, str], int]:
        """Attempts made by every process, by (event type, outcome): the metrics' counter."""
        raw = _str_map(self.client.hgetall(self.keys.webhook_counts()))
        return {(name.partition(" ")[0], name.partition(" ")[2]): int(n) for name, n in raw.items()}

    @translate_redis_errors
    def pending_count(self) -> int:
        return int(self.client.zcard(self.keys.outbox_pending()))

    @translate_redis_errors
    def oldest_due_s(self) -> float:
        """How long the most overdue pending delivery has waited past its time (0 for none); claimed ones count."""
        first = self.client.zrange(self.keys.outbox_pending(), 0, 0, withscores=True)
        if not first:
            return 0.0
        return max(0.0, time.time() - float(first[0][1]) / 1000)


# What a delivery's listing reads of an entry (coordinator.service.deliveries).
LISTED_FIELDS = ("id", "event_id", "type", "task_id", "state", "ts", "hook")


def _event_order(entry: Mapping[str, Any]) -> tuple[float, int, str]:
    """A delivery's place in its tree's listing: its event's time, then the event's number in the tree
    (`evt_<root>_<n>`), then its subscription. By the id's text, the tenth event of a step came before its second."""
    number = str(entry.get("event_id") or "").rpartition("_")[2]
    return (
        float(entry.get("ts") or 0),
        int(number) if ascii_digits(number) and len(number) < 19 else 0,
        str(entry.get("id")),
    )


def _listable(stored: str) -> dict[str, Any] | None:
    """A stored entry as a listing reads it; None for one no script wrote (the deliverer gives it up)."""
    try:
        entry = json.loads(stored)
    except ValueError:
        return None
    if not isinstance(entry, dict) or any(entry.get(name) is None for name in LISTED_FIELDS):
        return None
    return entry
