"""The operator's operations, defined once: what the Coordinator and the HTTP client both answer.

    Operations   create, read (a task, its plan, its tree, its messages, the history, the live
                 state, the runs that may still record spend), cancel, retry, approvals and their decision, dead letters, the audit log, a tree's
                 deliveries of outbound events and a redeliver; then close

`Coordinator` (on Redis) and `coordinator.client.SubqClient` (over the HTTP
API) each satisfy it, with the same models and the same errors: the client reads
an input with its operation's model (coordinator/inputs.py), the one the API
reads the request with, so a malformed one is refused before anything is sent. So a caller such as the `subq` command holds one
`Operations` whichever way it reaches the system, and prints the same lines.
The type checker holds both to it (`coordinator/cli/backend.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from coordinator.audit import AuditEntry
    from coordinator.deadletters import DeadLetter
    from coordinator.models import (
        Approval,
        Delivery,
        FinishingRuns,
        HistoryItem,
        LiveState,
        Retried,
        TaskRecord,
        TodoItem,
    )
    from coordinator.tenants import TenantState
    from coordinator.tree import TreeNode

__all__ = ["Operations"]


class Operations(Protocol):
    """The operations every face of subq offers an operator (docs/api.md lists them as routes)."""

    def create_task(
        self,
        prompt: str,
        todos: str | Sequence[Any] | None = None,
        profile: str | None = None,
        run: bool = False,
        budget_usd: Decimal | float | str | None = None,
        idempotency_key: str | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
        priority: int | None = None,
    ) -> TaskRecord: ...
    def get_task(self, task_id: str, /) -> TaskRecord: ...
    def get_todos(self, task_id: str, /) -> list[TodoItem]: ...
    def tree(self, task_id: str, /) -> TreeNode: ...
    def messages(self, task_id: str, kind: Literal["ui", "api"], /) -> list[dict[str, Any]]: ...
    def list_tasks(
        self,
        *,
        status: str | None = None,
        root_id: str | None = None,
        limit: int = ...,
        cursor: int = 0,
        metadata: Mapping[str, str] | None = None,
        tenant: str | None = None,
    ) -> tuple[list[HistoryItem], int | None]: ...
    def snapshot(self, root_id: str, /) -> dict[str, LiveState]: ...
    def finishing_runs(self, task_id: str, /, *, among: Sequence[str] | None = None) -> FinishingRuns: ...
    def deliveries(self, task_id: str, /) -> list[Delivery]: ...
    def redeliver(self, task_id: str, delivery_id: str, /) -> Delivery: ...
    def cancel(self, task_id: str, reason: str, /) -> TaskRecord: ...
    def retry(self, task_id: str, /, *, failed: bool = False) -> Retried: ...
    def list_approvals(self, root_id: str | None = None, /) -> list[Approval]: ...
    def decide(
        self, approval_id: str, decision: Literal["approve", "deny"], feedback: str | None = None, /
    ) -> Approval: ...
    def dead_letters(self, limit: int = ..., /) -> list[DeadLetter]: ...
    def count_dead_letters(self) -> int: ...
    def tenants(self) -> list[TenantState]: ...
    def purge_dead_letters(self) -> int: ...
    def audit(self, limit: int = ..., before: str | None = None, /) -> tuple[list[AuditEntry], str | None]: ...
    def close(self) -> None: ...
