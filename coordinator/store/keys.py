"""Every Redis key subq uses, built in this one module.

All keys of one task tree carry the root id as a hash tag, `{<root_id>}`, so a
whole tree lives in one cluster slot and multi-key Lua stays legal. The prefix
(default `subq`, setting `SUBQ_KEY_PREFIX`) lets two deployments share a Redis.

| key                                   | type   | holds                                              | lifetime |
|---------------------------------------|--------|----------------------------------------------------|----------|
| `<p>:{root}:task:<id>`                | hash   | the task record: place in tree, status, own usage, | retention, refreshed on every write |
|                                       |        | subtree totals, summary, error, timestamps,        |          |
|                                       |        | `usage_keys`: the request keys already recorded,   |          |
|                                       |        | `timeline` (bounded marks) and `tool_calls` (the   |          |
|                                       |        | newest 100): where its time went (timeline.py)     |          |
| `<p>:{root}:children:<id>`            | list   | child ids in creation order                        | retention |
| `<p>:{root}:awaiting:<id>`            | set    | children the task still waits on (in flight)       | deleted when empty |
| `<p>:{root}:todos:<id>`               | hash   | item id -> item JSON, and `order`: the ids in order | retention (write-backs leave it to the close) |
| `<p>:{root}:ui:<id>`                  | list   | UI messages, one JSON object each                  | retention |
| `<p>:{root}:conversation:<id>`        | list   | the model conversation, one message JSON an entry  | retention |
| `<p>:{root}:lease:<id>`               | string | the token of the run now executing the task        | the heartbeat lapse, renewed |
| `<p>:{root}:tool-results:<id>`        | hash   | tool call id -> its result (JSON), written the     | retention |
|                                       |        | moment the call returned: a run resumed after its  |          |
|                                       |        | worker died replays it instead of calling again;   |          |
|                                       |        | '' for a call answered without running (denied,    |          |
|                                       |        | interrupted: a resume answers it uncounted);       |          |
|                                       |        | `started:<call id>` -> 1 as a call a human         |          |
|                                       |        | approved starts (a resume must not rerun it;       |          |
|                                       |        | mark_tool_started, while the run holds the lease)  |          |
| `<p>:{root}:compactions:<id>`         | list   | the task's compaction records, oldest first (JSON: | retention |
|                                       |        | which journal messages the model no longer reads   |          |
|                                       |        | whole, the summary, tokens before and after),      |          |
|                                       |        | written while its run holds the lease; the journal |          |
|                                       |        | stays whole (docs/context.md)                      |          |
| `<p>:{root}:tasks`                    | zset   | every task id of the tree, scored by creation time | retention |
| `<p>:{root}:live`                     | hash   | task id -> live status JSON (state, tool, cost)    | retention |
| `<p>:{root}:running`                  | set    | tasks of the tree holding a run slot (in flight)   | emptied as runs end |
| `<p>:{root}:running:<parent>`         | set    | children of one parent holding a run slot          | emptied as runs end |
| `<p>:{root}:admission`                | list   | tasks waiting for a run slot, in order (in flight) | emptied as slots free |
| `<p>:{root}:last-start`               | string | when the tree's last run started (stagger)         | retention |
| `<p>:{root}:approval:<approval_id>`   | hash   | a tool call awaiting a decision, and the decision  | retention |
| `<p>:{root}:batch:<batch_id>`         | hash   | one delegation: parent, mode, children, result     | retention |
| `<p>:{root}:batch-lines:<batch_id>`   | hash   | child id -> its line of the combined result, set   | retention, |
|                                       |        | once as the child is written back (HSETNX: a child | from the   |
|                                       |        | with a line is applied, and never again); `~batch` | delegation |
|                                       |        | -> the batch id, written with the delegation       | and close  |
| `<p>:{root}:events`                   | stream | the tree's events (status changes, batch done)     | capped length, retention |
| `<p>:{root}:events:<task_id>`         | channel| no key: a pub/sub channel. An empty message each   | nothing is |
|                                       |        | time the task may have settled (ended, stopped, or | stored     |
|                                       |        | its children's batch closed), from the same script |            |
|                                       |        | that wrote it; `Coordinator.wait` listens on it    |            |
| `<p>:{root}:hooks`                    | hash   | the tree's event subscriptions (coordinator/       | retention  |
|                                       |        | outbound.py): `h:<n>` -> its event patterns, `s:<n>`|            |
|                                       |        | -> its target JSON (a URL and its write-only secret,|            |
|                                       |        | or a Celery task and queue); `~root`, `~tree_cap`, |            |
|                                       |        | `~cap`, `~seq` (the last event number), `~dropped` |            |
|                                       |        | (events past a cap); absent without subscriptions  |            |
| `<p>:{root}:outbox`                   | hash   | delivery id (`<event id>.<n>`) -> its state JSON   | retention, |
|                                       |        | (event, type, task, attempts, next time, last      | at most    |
|                                       |        | answer), written in the step that causes the event | SUBQ_WEBHOOK_TREE_CAP |
| `<p>:roots`                           | zset   | root ids scored by creation time (history index)   | pruned to retention |
| `<p>:tasks`                           | zset   | every task id scored by creation time (history)    | pruned to retention |
| `<p>:task-number`                     | string | the last task number given (history numbering)     | permanent |
| `<p>:metrics:model-latency`           | hash   | model request latency histogram (buckets, count)   | permanent |
| `<p>:approvals`                       | zset   | pending approval ids scored by creation time       | removed when decided |
| `<p>:rate:<provider>`                 | zset   | start times of the provider's requests, last 60 s  | a minute |
| `<p>:rate:tool:<glob>`                | zset   | start times of the calls of a tool glob, last 60 s | a minute |
| `<p>:rate:audit-refusals:<who>:<min>` | string | the refusals of a key (or, for none, an address)   | 2 minutes |
|                                       |        | put on the audit log in that minute (audit_add)    |          |
| `<p>:tool-slots:<glob>`               | zset   | the calls of a tool glob running now, scored by    | a call's |
|                                       |        | when each one's lease ends (a dead worker's lapse) | lease    |
| `<p>:endpoint:{<host:port>}`          | hash   | a provider endpoint's host as the fleet sees it    | deleted when a request |
|                                       |        | (coordinator/endpoints.py): refused or dropped     | to it is answered; an  |
|                                       |        | connections, timeouts. `failures` in a row,        | hour after its last    |
|                                       |        | `down_until_ms`, the `probe` run's token and its   | failure                |
|                                       |        | `probe_until_ms`, the last `error` line            |          |
| `<p>:endpoint:{<host:port>}:model:<model>` | hash | one model of that endpoint as the fleet sees it: | deleted when the model |
|                                       |        | what its provider said of it (429, 5xx, 529, a     | answers; an hour after |
|                                       |        | Retry-After); the same fields. Hash-tagged by the  | its last failure       |
|                                       |        | endpoint, so its gate reads both in one script     |          |
| `<p>:endpoint-parked:{<host:port>}`   | zset   | tasks whose runs gave their worker back to wait    | deleted when the host |
|                                       |        | for the host, scored by when they wake; a task     | is back; an hour |
|                                       |        | whose wake time passed leaves it at the next park  |          |
| `<p>:endpoint-parked:{<host:port>}:model:<model>` | zset | the same, waiting for that model         | deleted when the model is back; an hour |
| `<p>:endpoint-recovered:{<host:port>}:<32 hex>` | string | the tasks one recovery took off those | 120 s |
|                                       |        | lists, for the same call sent again                |          |
| `<p>:idempotency:<sha256 of the key>`| string | the root id a create call with that key made       | retention |
| `<p>:web-session:<sha256 of the id>`  | string | a web sign-in: the fingerprint of the API token it | the session's age |
|                                       |        | was made with (a changed token revokes it)         | (a day); deleted at sign-out |
| `<p>:due`                             | zset   | tasks a message should move on, scored by when the | removed when the task's run ends |
|                                       |        | reconciler looks at them if none has (convergence) |          |
| `<p>:outbox`                          | zset   | every tree's deliveries not yet settled (`<root>   | removed when delivered |
|                                       |        | <delivery id>`), scored by when they are due (ms); | or given up; at most   |
|                                       |        | a claim moves the score to its lease's end         | SUBQ_WEBHOOK_OUTBOX_CAP |
| `<p>:timers`                          | zset   | delayed actions (`<kind>:<id>`) scored by due time | removed when done |
| `<p>:stops`                           | string | how many stops have been made (each `stop_tasks`   | permanent |
|                                       |        | that stopped a task adds one): the stop watches'   |          |
|                                       |        | one read a poll while nothing is stopped           |          |
| `<p>:reconciler`                      | string | the worker that leads the reconciler now           | a few ticks, renewed |
| `<p>:keeper`                          | hash   | the leader's walk over the trees' keys (coordinator| permanent |
|                                       |        | /keeper.py): `cursor` (SCAN's; 0 between passes)   |          |
|                                       |        | and `next_pass_at` (epoch s): a new leader goes on |          |
| `<p>:workers`                         | zset   | worker processes scored by their last heartbeat    | pruned after a day |
| `<p>:reserved`                        | zset   | tasks whose run message a live worker holds (taken | each entry a heartbeat |
|                                       |        | off the queue, maybe not started), scored by when  | lapse, pruned by beats |
|                                       |        | the entry lapses (each beat of its process renews) |          |
| `<p>:metrics:repairs`                 | hash   | repairs the reconciler made, counted by reason     | permanent |
| `<p>:dead-letters`                    | list   | messages no worker could decode or validate, one   | capped: the newest 10,000 |
|                                       |        | JSON object each, newest first (ts, queue, reason, |          |
|                                       |        | task, id, the raw message cut to 64 KiB)           |          |
| `<p>:dead-letter-marks`               | zset   | the digest of each message on the dead-letter list | as the list: the newest  |
|                                       |        | (its delivery tag, task id and body; else its raw  | 10,000                   |
|                                       |        | text), scored in the order kept: kept once         |          |
| `<p>:audit`                           | stream | the audit log: every decision, control action,     | retention (trimmed by id |
|                                       |        | sign-in and refused request, one entry each (who,  | at each write), and at   |
|                                       |        | what, target, when, from where; coordinator/audit) | most the newest 100,000  |
| `<p>:audit-mark:<32 hex>`             | string | an audit entry's own mark, which its write sent    | 120 s    |
|                                       |        | again after a lost reply finds (audit_add.lua)     |          |
| `<p>:fair-heal-mark:<32 hex>`         | string | a fair-share pass's answer (the runs it freed and  | 120 s    |
|                                       |        | started), which the same call sent again after a   |          |
|                                       |        | lost reply answers (fair_heal.lua)                 |          |
| `<p>:metrics:webhooks`                | hash   | delivery attempts by `<event type> <outcome>`      | permanent |
| `<p>:metrics:refused`                 | hash   | refused requests (401/403) counted by reason       | permanent |

A tree's "retention" counts from the key's last write, and holds while the tree is in flight (an agent's root
not ended, a caller's delegated): the reconciler's leader gives each key of such a tree its retention again before
it lapses (`trees_pattern`, coordinator/keeper.py), a run's lease excepted (`SHORT_LIVED`).

Per-tenant keys (coordinator/tenants.py) are not under a tree's hash tag: each is tagged by its
tenant, `<p>:tenant:{<tenant>}:...`, so one tenant's keys share a slot (the quota check reads them
in one script) and a tree's step that counts spend names one key of another slot, as the due list
is.

| key                                   | type   | holds                                              | lifetime |
|---------------------------------------|--------|----------------------------------------------------|----------|
| `<p>:tenant:{<t>}:submits`            | zset   | the roots the tenant created in the last minute,   | a minute after its |
|                                       |        | scored by when (ms); a root id counts once, so a   | last submit        |
|                                       |        | retried submit of the same root counts nothing     |          |
| `<p>:tenant:{<t>}:roots`              | zset   | the tenant's roots now running, scored by creation | a day after its last |
|                                       |        | (ms); an ended root is taken out by the next check | change |
| `<p>:tenant:{<t>}:spend`              | hash   | micro-USD its trees spent, by hour (`<epoch hour>` | 25 hours after its  |
|                                       |        | -> micros). Hours older than 24 are deleted as     | last spend          |
|                                       |        | each spend is counted                              |          |
| `<p>:tenant:{<t>}:spent`              | zset   | `<task id>:<request key>` of each cost counted     | 25 hours after its  |
|                                       |        | into `spend`, scored by when (ms): a request is    | last spend          |
|                                       |        | counted once however often its step is repeated    |          |
| `<p>:tenants`                         | zset   | every tenant that created a root, scored by its    | pruned to retention |
|                                       |        | last submit (s): the tenants view lists them       |          |
| `<p>:tenant:{<t>}:running`            | set    | the tenant's runs holding a fleet slot (fair       | emptied as runs end; |
|                                       |        | shares, coordinator/admission.py): started, or     | retention after its  |
|                                       |        | given a slot and published                         | last change          |
| `<p>:tenant:{<t>}:parked`             | zset   | its runs waiting for a slot, holding no worker,    | emptied as slots free; |
|                                       |        | scored by -priority * 1e13 + arrival ms, or one    | retention             |
|                                       |        | past the last of its priority if that sorts later  |                       |
|                                       |        | (fair_admit.lua: the order of parking holds)       |                       |
| `<p>:tenant:{<t>}:queued`             | zset   | its runs published and not yet taken by a worker,  | as messages arrive, or |
|                                       |        | scored by publish ms: demand in the broker's queue | FAIR_QUEUED_S after   |
| `<p>:fair:wanting`                    | zset   | tenants with runs parked or queued, scored by      | a tenant leaves when  |
|                                       |        | (running + 1) / weight, `inf` at its max_running   | it wants nothing      |
| `<p>:fair:holding`                    | hash   | task id -> tenant, every run holding a fleet slot  | emptied as runs end   |
| `<p>:fair:policies`                   | hash   | tenant (or `*`) -> `weight max_running`, as the    | rewritten each beat   |
|                                       |        | workers' tenants table says                        |          |
| `<p>:fair:capacity`                   | string | the sum of the live workers' concurrency           | 3 heartbeat lapses    |
| `<p>:worker-slots`                    | hash   | worker process -> its concurrency                  | a process gone is dropped at the next beat |
| `<p>:libraries`                       | hash   | the scripts' function library (Redis 7: store/     | removed, with its      |
|                                       |        | library.py) -> the epoch second a process last     | library, by the first  |
|                                       |        | noted it (at its load, then daily)                 | load a week after its last note |
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.ids import ROOT_ID_PATTERN

__all__ = ["DEFAULT_PREFIX", "Keys", "cut", "glob_escaped"]

DEFAULT_PREFIX = "subq"
# A root id (coordinator/ids.py): what a tree's hash tag holds.
TREE_ROOT = re.compile(ROOT_ID_PATTERN)
# The kinds of a tree's keys that live less than its retention on purpose: never kept for the tree
# (coordinator/keeper.py). A run's lease lapses with its worker's heartbeat, which is how a dead worker's run is found.
SHORT_LIVED = frozenset({"lease"})
# Where `cut` cuts a key's name: no id, tenant or prefix holds it.
CUT_MARK = "\0"


def glob_escaped(text: str) -> str:
    """`text` matched as itself in a SCAN pattern (Redis's glob: `*`, `?`, `[`, `]` and the backslash escaped)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def cut(name: Callable[..., str], holes: int = 1) -> list[str]:
    """A key builder's name cut where its `holes` ids go (`cut(keys.task, 2)`: the head, the middle and the
    tail around the root and task ids): the parts a Lua script joins with the ids of the keys it finds only
    as it runs (start_run and fair_take a tenant's, read_claimed a claimed delivery's)."""
    return name(*[CUT_MARK] * holes).split(CUT_MARK)


# -- the shapes of a key: each builds a key builder of `Keys` from the key's own part ----------------
# A shape's function set in the class body is a method like any `def` (`keys.task(root_id, task_id)`
# binds `self`, and mypy checks each call's arguments): each key is one line that says its shape,
# where 58 methods of two lines each said it again.


def _in_tree(kind: str) -> Callable[[Keys, str, str], str]:
    """`<p>:{<root>}:<kind>:<id>`: a key of one task (or batch, approval, parent) of a tree."""

    def key(self: Keys, root_id: str, member_id: str) -> str:
        return f"{self.prefix}:{{{root_id}}}:{kind}:{member_id}"

    return key


def _of_tree(kind: str) -> Callable[[Keys, str], str]:
    """`<p>:{<root>}:<kind>`: a key of a whole tree."""

    def key(self: Keys, root_id: str) -> str:
        return f"{self.prefix}:{{{root_id}}}:{kind}"

    return key


def _of_tenant(kind: str) -> Callable[[Keys, str], str]:
    """`<p>:tenant:{<tenant>}:<kind>`: a key of one tenant (hash-tagged by the tenant)."""

    def key(self: Keys, tenant: str) -> str:
        return f"{self.prefix}:tenant:{{{tenant}}}:{kind}"

    return key


def _fleet(kind: str) -> Callable[[Keys], str]:
    """`<p>:<kind>`: one key of the whole deployment."""

    def key(self: Keys) -> str:
        return f"{self.prefix}:{kind}"

    return key


def _fleet_member(kind: str) -> Callable[[Keys, str], str]:
    """`<p>:<kind>:<name>`: a key of the deployment, one per name (a provider, a tool glob, a hash)."""

    def key(self: Keys, name: str) -> str:
        return f"{self.prefix}:{kind}:{name}"

    return key


@dataclass(frozen=True)
class Keys:
    """Every key name of one deployment (its prefix): `keys.task(root_id, task_id)` and the rest, each a key
    of the module's table, built by the shape its right-hand side names."""

    prefix: str = DEFAULT_PREFIX

    # A tree's keys, hash-tagged by its root: one task's (or parent's, approval's, batch's), ...
    task = _in_tree("task")
    children = _in_tree("children")
    awaiting = _in_tree("awaiting")
    todos = _in_tree("todos")
    ui_messages = _in_tree("ui")
    conversation = _in_tree("conversation")
    tool_results = _in_tree("tool-results")
    compactions = _in_tree("compactions")
    lease = _in_tree("lease")
    running_children = _in_tree("running")
    approval = _in_tree("approval")
    batch = _in_tree("batch")
    batch_lines = _in_tree("batch-lines")
    # ... and the whole tree's.
    tree_tasks = _of_tree("tasks")
    live = _of_tree("live")
    running = _of_tree("running")
    admission = _of_tree("admission")
    last_start = _of_tree("last-start")
    events = _of_tree("events")
    hooks = _of_tree("hooks")
    outbox = _of_tree("outbox")

    # The deployment's keys.
    outbox_pending = _fleet("outbox")
    webhook_counts = _fleet("metrics:webhooks")
    roots = _fleet("roots")
    all_tasks = _fleet("tasks")
    latency_histogram = _fleet("metrics:model-latency")
    approvals = _fleet("approvals")
    rate = _fleet_member("rate")
    tool_slots = _fleet_member("tool-slots")
    task_number = _fleet("task-number")
    idempotency = _fleet_member("idempotency")
    web_session = _fleet_member("web-session")
    due = _fleet("due")
    timers = _fleet("timers")
    stops = _fleet("stops")
    leader = _fleet("reconciler")
    keeper = _fleet("keeper")
    workers = _fleet("workers")
    reserved = _fleet("reserved")
    repairs = _fleet("metrics:repairs")
    dead_letters = _fleet("dead-letters")
    dead_letter_marks = _fleet("dead-letter-marks")
    audit = _fleet("audit")
    audit_mark = _fleet_member("audit-mark")
    fair_heal_mark = _fleet_member("fair-heal-mark")
    refused = _fleet("metrics:refused")
    tenants = _fleet("tenants")
    fair_wanting = _fleet("fair:wanting")
    fair_holding = _fleet("fair:holding")
    fair_policies = _fleet("fair:policies")
    fair_capacity = _fleet("fair:capacity")
    worker_slots = _fleet("worker-slots")
    libraries = _fleet("libraries")

    # A tenant's keys, hash-tagged by the tenant.
    tenant_submits = _of_tenant("submits")
    tenant_roots = _of_tenant("roots")
    tenant_spend = _of_tenant("spend")
    tenant_spent = _of_tenant("spent")
    tenant_running = _of_tenant("running")
    tenant_parked = _of_tenant("parked")
    tenant_queued = _of_tenant("queued")

    def endpoint(self, endpoint: str, model: str = "") -> str:
        """The fleet's view of `endpoint`'s host, or of one `model` it serves (hash-tagged by the endpoint)."""
        return f"{self.prefix}:endpoint:{{{endpoint}}}" + (f":model:{model}" if model else "")

    def endpoint_parked(self, endpoint: str, model: str = "") -> str:
        """The tasks parked on that view of `endpoint` (its host's, or one `model`'s)."""
        return f"{self.prefix}:endpoint-parked:{{{endpoint}}}" + (f":model:{model}" if model else "")

    def endpoint_recovered(self, endpoint: str, call: str) -> str:
        """One recovery's answer, kept for the same call sent again (hash-tagged by the endpoint)."""
        return f"{self.prefix}:endpoint-recovered:{{{endpoint}}}:{call}"

    def audit_refusals(self, who: str, minute: int) -> str:
        """`<p>:rate:audit-refusals:<who>:<min>`: the refusals of a key (or an address) logged in that minute."""
        return self.rate(f"audit-refusals:{who}:{minute}")

    def settled(self, root_id: str, task_id: str) -> str:
        """The channel (pub/sub, no key) on which a task's settling is announced: its tree's stream's name and
        its id. hashes.lua's `wake_waiters` builds the same name from the stream key it is handed."""
        return f"{self.events(root_id)}:{task_id}"

    def all_pattern(self) -> str:
        """A SCAN pattern matching every key of this prefix (tests, cleanup)."""
        return f"{self.prefix}:*"

    def trees_pattern(self) -> str:
        """A SCAN pattern matching every key of every tree (`<p>:{<root>}:...`), and no key of the fleet's or a
        tenant's: the prefix's own glob characters are escaped."""
        return f"{glob_escaped(self.prefix)}:{{*}}:*"

    def root_of_kept(self, key: str) -> str | None:
        """The root id of a tree's key that lives the tree's retention; None for a key that is not a tree's, or one
        of a kind that lives less on purpose (`SHORT_LIVED`: a run's lease lapses with its worker's heartbeat)."""
        head = f"{self.prefix}:{{"
        root, closed, rest = key.removeprefix(head).partition("}:")
        kept = (
            key.startswith(head) and closed and TREE_ROOT.fullmatch(root) and rest.partition(":")[0] not in SHORT_LIVED
        )
        return root if kept else None
