"""Every script's reply, typed and named: what a step said, read by field, never by position.

A `Call` of coordinator/store/protocol.py decodes its script's raw reply (a Lua table, read by index
there and nowhere else) into one of these. They are frozen dataclasses, not tuples: a
caller cannot unpack one by position (mypy refuses it, and so does Python), so a script
that grows a field breaks no call site silently. tests/test_replies.py holds the rule:
no `decode` returns a tuple, and no code outside protocol.py unpacks a script's reply.

    Stepped         flush_run, record_tool: still leased, the task's status, the topmost budget reached
    StartReply      start_run: the verdict, the delivery and run counts, a budget reached, a delay
    Ending          end_run: what the run's end did (fenced, exhausted, or ended with its figures)
    UsageRecorded   record_usage: recorded or not, the topmost budget reached
    LateSpendRecorded  record_late_spend: how many records it recorded now, the topmost budget they reached
    BatchClosed     close_batch: the parent's resume count, whether its resume must be published
    Decided         decide: what the decision did, and the park whose resume it claims when it ended the wait
    ChildSettled    settle_child: the batch's mode, then as BatchClosed
    EndpointState   endpoint_gate (and endpoint_failed, completed by its store part): the wait, the view
    FairHealed      fair_heal: the slots it freed, the parked runs to publish again
    QuotaVerdict    tenant_submit: whether a root was counted, else the quota it would break
    TransientCount  a task's transient errors counted (a store part's transaction, read by name as well)

The module sits beside models.py rather than inside store/: the rooms that read these replies
(coordinator/runs.py, coordinator/endpoints.py, the run's ports) never import the store package
(tests/test_layout.py), and the store's protocol decodes into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.models import Usage

__all__ = [
    "END_SUBMISSION",
    "HOST",
    "MODEL",
    "NO_RESUME",
    "RESUME_RUN",
    "BatchClosed",
    "ChildSettled",
    "Decided",
    "Ending",
    "EndpointState",
    "FairHealed",
    "LateSpendRecorded",
    "QuotaVerdict",
    "StartReply",
    "Stepped",
    "TransientCount",
    "UsageRecorded",
]

# The views of an endpoint an `EndpointState` names (`view`): its host's, or the model's (coordinator/endpoints.py).
HOST = "host"
MODEL = "model"
# What the closer of a batch sends for its parent (`resume` of a close's reply): nothing (a caller's parent),
# the parent's resumed run (an agent's), or the end of a submission's root (`writeback.end_submission`).
NO_RESUME, RESUME_RUN, END_SUBMISSION = 0, 1, 2


@dataclass(frozen=True)
class Stepped:
    """A run's step (flush_run, record_tool): still leased, the task's status, the topmost budget reached, and
    whether its usage records were refused (its task had ended: the run records them by record_late_spend)."""

    leased: bool
    status: str
    exhausted: str | None
    refused_spend: bool = False


@dataclass(frozen=True)
class StartReply:
    """start_run's reply: the verdict and what it brings (the caller reads the record and the conversation
    in the same transaction, `Scripts.then_read`)."""

    verdict: str
    deliveries: int = 0
    run_seq: int = 0
    exhausted: str | None = None
    delay_ms: int = 0
    parked_for: str = ""  # 'park': why its tenant's slot was refused ('max_running', 'share', 'fleet', 'order')
    admitted: tuple[str, ...] = ()  # 'park': the parked run given the slot instead (the caller publishes it)


@dataclass(frozen=True)
class Ending:
    """What a run's end did (end_run): `kind` 'ended', 'fenced' (nothing written) or 'exhausted' (`holder`'s budget)."""

    kind: str
    holder: str | None = None
    status: str = ""
    summary: str = ""
    error: str = ""
    error_class: str = ""
    usage: Usage = field(default_factory=Usage)
    cost_micros: int = 0
    closed: bool = False
    resumes: int = 0
    resume: int = NO_RESUME
    batch_mode: str = ""
    admitted: list[str] = field(default_factory=list)  # waiting tasks given the freed slot: publish their runs
    refused_spend: bool = False  # its task had ended before: the run's usage records were not written


@dataclass(frozen=True)
class UsageRecorded:
    """record_usage's reply: `recorded` 1, 0 (recorded before: once per request key) or -1 (the task has ended);
    `exhausted` the topmost task whose budget the subtree reached, or None."""

    recorded: int
    exhausted: str | None = None


@dataclass(frozen=True)
class LateSpendRecorded:
    """record_late_spend's reply: how many of its records were recorded now (one recorded before is not counted
    again), and the topmost task whose budget its subtree has reached once they were, or None (none was
    recorded now, or none is reached)."""

    recorded: int
    exhausted: str | None = None


@dataclass(frozen=True)
class BatchClosed:
    """close_batch's reply: the parent's resume count when this call closed the batch (else 0), and what the
    caller sends for the parent (NO_RESUME, RESUME_RUN, END_SUBMISSION)."""

    resumes: int
    resume: int


@dataclass(frozen=True)
class Decided:
    """decide's reply: 'resume' (the decision ended its task's wait: its caller publishes the resume, claimed for
    `reason_id`, the first approval of the park it ended), 'ok', 'stopped' (its task had ended: the call expired,
    the decision refused), 'late', or the approval's status when it was not pending ('missing')."""

    outcome: str
    reason_id: str = ""


@dataclass(frozen=True)
class ChildSettled:
    """settle_child's reply: the batch's mode ('' for an unknown batch; a sequential one is left to the caller),
    then as `BatchClosed`."""

    mode: str
    resumes: int
    resume: int


@dataclass(frozen=True)
class EndpointState:
    """What the fleet knows of a model's endpoint: the ms to wait before sending (0: send now), the failures
    in a row, the last error line ('' while it is up), and the view they are of: `HOST`, `MODEL`, or ''
    while both are up (when sending, the view whose probe this request is). endpoint_gate.lua's reply, and
    endpoint_failed.lua's (the wait and the failures) completed with the error and the view it marked."""

    wait_ms: int
    failures: int
    error: str = ""
    view: str = ""


@dataclass(frozen=True)
class TransientCount:
    """A task's transient errors once more were counted: in all (`transient_errors` on its record), and the
    failed attempts of the request now in flight (both kept on the task across parks)."""

    total: int
    attempts: int


@dataclass(frozen=True)
class FairHealed:
    """fair_heal's reply: the runs whose fleet slot it freed (their task gone, ended or delegated), and the parked
    runs whose restart the caller publishes (given a free slot, or released while fair shares are off)."""

    freed: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class QuotaVerdict:
    """tenant_submit's reply: whether the root was counted, else the quota it would break (coordinator/quotas.py)."""

    accepted: bool
    quota: str = ""  # submits_per_minute | max_running_roots | max_cost_usd_per_day
    used: int = 0  # submits in the last minute, roots running, or micro-USD spent in the rolling day
    limit: int = 0
    retry_after_ms: int = 0  # when it resets; 0: not known (a running root must end)
