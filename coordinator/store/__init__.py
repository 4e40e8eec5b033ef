"""The Redis store: every read and write of subq state, for one key prefix.

Each read-modify-write of shared state is atomic: the delegation commit and
todo updates are WATCH/MULTI transactions (validation runs on the watched
state, so a concurrent change retries it); usage roll-up, the write-back of
children, closing a batch, admission and status transitions are Lua scripts
from `lua/`, loaded once and registered once per client. Redis errors become
`StoreError` in one place. `Store` is one object made of one mixin per concern:

| module          | concern                                                                   |
|-----------------|---------------------------------------------------------------------------|
| `keys.py`       | every Redis key (its docstring lists them with types and lifetimes)       |
| `fields.py`     | every field name of the task, batch, approval and histogram hashes        |
| `base.py`       | shared plumbing: error translation, casts, scripts, record encode/decode, |
|                 | the WATCH/MULTI transaction helper, the todo-list and history writes      |
| `records.py`    | task records and their reads: fields, children, todos, messages, history  |
| `delegation.py` | todo updates, the delegation commit, batches, write-back, subtree stops   |
| `runs.py`       | a run's state: deliveries, leases, claims, usage, budgets, admission,     |
|                 | rate limits, the terminal status                                          |
| `approvals.py`  | approvals and their once-only decision                                    |
| `convergence.py`| the due list, timers, run-lease renewal and heartbeats, the reconciler's  |
|                 | leader lease, repair counts                                               |
| `events.py`     | a tree's event stream and live status                                     |
| `metrics.py`    | the model-latency histogram, and the whole-prefix snapshot for tests      |
| `deadletters.py`| the dead-letter list: messages no worker could decode or validate        |
| `lua/*.lua`     | the atomic steps, each documenting its KEYS and ARGV                      |
"""

from __future__ import annotations

from coordinator.store.approvals import ApprovalStore
from coordinator.store.base import EVENTS_MAXLEN, translate_redis_errors
from coordinator.store.convergence import ConvergenceStore
from coordinator.store.deadletters import DeadLetterStore
from coordinator.store.delegation import DelegationStore
from coordinator.store.events import EventStore
from coordinator.store.keys import Keys
from coordinator.store.metrics import LATENCY_BUCKETS_MS, FleetGauges, MetricStore
from coordinator.store.records import RecordStore
from coordinator.store.runs import RunStore

__all__ = ["EVENTS_MAXLEN", "LATENCY_BUCKETS_MS", "FleetGauges", "Keys", "Store", "translate_redis_errors"]


class Store(
    RunStore, DelegationStore, ApprovalStore, ConvergenceStore, EventStore, MetricStore, RecordStore, DeadLetterStore
):
    """subq state in Redis, for one key prefix: `Store(client, keys, retention_s)`.

    Every method of the concern mixins above, on one object (`coord.store`);
    `RunStore` builds on `RecordStore`, the others only on `StoreBase`.
    """
