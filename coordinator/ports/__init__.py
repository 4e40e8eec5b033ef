"""A run's ports: each worker concern a small object with its own narrow interface to the store, handed to
the run (coordinator/runs.py) that the worker holds. A worker reaches shared state only through them.

    run.provider     provider.py     its model's endpoints: the gate, failures, answers, parks
    run.limits       limits.py       the fleet's rate limits and tool slots, and the waits they make
    run.journal      journal.py      each tool call kept as it returns; its price
    run.compaction   compaction.py   compaction records kept beside the journal
    run.plan         plan.py         the orchestration tools: the todo list, a delegation
    run.approvals    approvals.py    calls parked for a person's decision, and the decisions

Each is handed `Steps` (steps.py): the part of the run it may touch, never the run's life.
"""

from coordinator.ports.approvals import Answers, ApprovalPort
from coordinator.ports.compaction import CompactionPort
from coordinator.ports.journal import KeptCalls, ToolJournal
from coordinator.ports.limits import LimitsPort
from coordinator.ports.plan import PlanPort
from coordinator.ports.provider import ProviderPort
from coordinator.ports.steps import Ended, HandBack, LeaseLost, Released, RunStopped, Steps, StepState

__all__ = [
    "Answers",
    "ApprovalPort",
    "CompactionPort",
    "Ended",
    "HandBack",
    "KeptCalls",
    "LeaseLost",
    "LimitsPort",
    "PlanPort",
    "ProviderPort",
    "Released",
    "RunStopped",
    "StepState",
    "Steps",
    "ToolJournal",
]
