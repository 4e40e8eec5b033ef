"""The Redis store: every read and write of subq state, for one key prefix.

Each read-modify-write of shared state is atomic: the delegation commit and
todo updates are WATCH/MULTI transactions (validation runs on the watched
state, so a concurrent change retries it); usage roll-up, the write-back of
children, closing a batch, admission and status transitions are Lua scripts
from `lua/`, loaded once and registered once per client. Redis errors become
`StoreError` in one place.

`Store` is a set of named parts, built once on one shared core (`StoreCore`:
the client, the keys, the retention and the registered scripts) and handed to
the rooms through the plane; every call names its part, as
`plane.store.records.get_task(task_id)`. No part inherits another: a part that
reads through another is handed it (`RunStore(core, records)`).

| part                 | class              | module           | concern                                                   |
|----------------------|--------------------|------------------|-----------------------------------------------------------|
| `store.records`      | `RecordStore`      | `records.py`     | task records and their reads: fields, children, todos,    |
|                      |                    |                  | messages, conversation, history numbers and indexes       |
| `store.runs`         | `RunStore`         | `runs.py`        | a run's state: deliveries, leases, claims, usage,         |
|                      |                    |                  | budgets, admission, rate limits, the terminal status      |
|                      |                    |                  | (reads through `store.records`)                           |
| `store.batches`      | `DelegationStore`  | `delegation.py`  | todo updates, the delegation commit, batches, write-back, |
|                      |                    |                  | subtree stops                                             |
| `store.approvals`    | `ApprovalStore`    | `approvals.py`   | approvals and their once-only decision                    |
| `store.convergence`  | `ConvergenceStore` | `convergence.py` | the due list, timers, run-lease renewal and heartbeats,   |
|                      |                    |                  | the reconciler's leader lease, repair counts              |
| `store.events`       | `EventStore`       | `events.py`      | a tree's event stream and live status                     |
| `store.metrics`      | `MetricStore`      | `metrics.py`     | the model-latency histogram, the fleet's gauges, and the  |
|                      |                    |                  | whole-prefix snapshot for tests                           |
| `store.dead_letters` | `DeadLetterStore`  | `deadletters.py` | the dead-letter list: messages no worker could decode or  |
|                      |                    |                  | validate                                                  |
| `store.sessions`     | `WebSessions`      | `sessions.py`    | the web view's sign-in sessions                           |
| `store.endpoints`    | `EndpointStore`    | `endpoints.py`   | provider endpoints as the fleet sees them: down or up,    |
|                      |                    |                  | the one probe, the runs parked on each                    |
| `store.audit`        | `AuditLog`         | `audit.py`       | the audit log and the count of refused requests by reason |
| `store.retries`      | `RetryStore`       | `retries.py`     | failed tasks made to run again, and batches re-opened     |
| `store.compaction`   | `CompactionStore`  | `compaction.py`  | a task's compaction records, beside its journal           |
| `store.outbox`       | `OutboxStore`      | `outbox.py`      | a tree's event subscriptions, its deliveries, the pending |
|                      |                    |                  | index and its claims (coordinator/outbound.py delivers)   |
| `store.quotas`       | `QuotaStore`       | `quotas.py`      | tenants' quotas: submits, running roots, rolling-day spend|
| `store.fair`         | `FairStore`        | `fair.py`        | fair shares between tenants: fleet slots, parked and      |
|                      |                    |                  | announced runs, capacity, policies (coordinator/admission)|

and the modules the parts share:

| module     | what                                                                             |
|------------|----------------------------------------------------------------------------------|
| `keys.py`  | every Redis key (its docstring lists them with types and lifetimes)              |
| `fields.py`| every field name of the task, batch, approval and histogram hashes               |
| `base.py`  | shared plumbing: error translation, casts, `Scripts`, `StoreCore` (the client,   |
|            | keys, retention and scripts; the WATCH/MULTI transaction helper, the todo-list   |
|            | and history writes), `Part`, record encode/decode                                |
| `protocol.py`| the step protocol: each script's KEYS, ARGV (typed) and reply, declared once;  |
|            | `Scripts` registers, packs and types every call from it                          |
| `lua/*.lua`| the atomic steps; each header says its KEYS, ARGV and reply as protocol.py does  |
"""

from __future__ import annotations

import redis

from coordinator.store.approvals import ApprovalStore
from coordinator.store.audit import AuditLog
from coordinator.store.base import EVENTS_MAXLEN, ReplicaWait, StoreCore, translate_redis_errors
from coordinator.store.compaction import CompactionStore
from coordinator.store.convergence import ConvergenceStore
from coordinator.store.deadletters import DeadLetterStore
from coordinator.store.delegation import DelegationStore
from coordinator.store.endpoints import EndpointStore
from coordinator.store.events import EventStore
from coordinator.store.fair import FairStore
from coordinator.store.keys import Keys
from coordinator.store.metrics import LATENCY_BUCKETS_MS, FleetGauges, MetricStore
from coordinator.store.outbox import OutboxStore
from coordinator.store.quotas import QuotaStore
from coordinator.store.records import RecordStore
from coordinator.store.retries import RetryStore
from coordinator.store.runs import RunStore
from coordinator.store.sessions import WebSessions

__all__ = [
    "EVENTS_MAXLEN",
    "LATENCY_BUCKETS_MS",
    "FleetGauges",
    "Keys",
    "ReplicaWait",
    "Store",
    "translate_redis_errors",
]


class Store:
    """subq state in Redis, for one key prefix: `Store(client, keys, retention_s, budget_warn_at=...)`.

    A plain object of named parts (the table above), each built once on one core;
    `client`, `keys` and `retention_s` are the core's, for tests and tools that read Redis
    beside the store. With `replicas`, each step a caller sees waits for that many replicas
    (`base.ReplicaWait`, SUBQ_REDIS_MIN_REPLICAS). `budget_warn_at` (SUBQ_BUDGET_WARN_AT) is
    the runs part's: the share of a budget whose crossing sends `budget.warning`.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        retention_s: int,
        *,
        budget_warn_at: float,
        replicas: ReplicaWait | None = None,
    ) -> None:
        self.core = core = StoreCore(client, keys, retention_s, replicas)
        self.client = client
        self.keys = keys
        self.retention_s = retention_s
        self.records = RecordStore(core)
        self.runs = RunStore(core, self.records, budget_warn_at)
        self.batches = DelegationStore(core, self.records)
        self.approvals = ApprovalStore(core)
        self.convergence = ConvergenceStore(core)
        self.events = EventStore(core)
        self.metrics = MetricStore(core)
        self.dead_letters = DeadLetterStore(core)
        self.sessions = WebSessions(core)
        self.endpoints = EndpointStore(core)
        self.audit = AuditLog(core)
        self.retries = RetryStore(core)
        self.compaction = CompactionStore(core)
        self.outbox = OutboxStore(core)
        self.quotas = QuotaStore(core)
        self.fair = FairStore(core)
