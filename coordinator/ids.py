"""Task and batch ids, which carry their root so every key of a tree is found in one slot.

A root id is 16 hex digits; a child id is `<root>-<12 hex>`; a batch id is
`<root>-b<12 hex>`; an approval id `<root>-a<12 hex>`. `root_of` recovers the root from any of them without a
lookup, which keeps each tree's keys under one hash tag (docs/architecture.md, Redis layout).
"""

from __future__ import annotations

import re
import secrets

from coordinator.errors import NotFoundError
from coordinator.text import shown_value

__all__ = [
    "ROOT_ID_PATTERN",
    "is_batch_id",
    "is_task_id",
    "new_batch_id",
    "new_child_id",
    "new_root_id",
    "root_of",
    "task_of_run_id",
]

_ROOT = r"[0-9a-f]{16}"
# A root id alone, as an input's pattern (the API's `root_id` query, /mcp's list_approvals): a child id there
# matched no root and answered "nothing", not an error.
ROOT_ID_PATTERN = rf"^{_ROOT}$"
TASK_ID_RE = re.compile(rf"^({_ROOT})(?:-[0-9a-f]{{12}})?\Z")
BATCH_ID_RE = re.compile(rf"^({_ROOT})-b[0-9a-f]{{12}}\Z")
APPROVAL_ID_RE = re.compile(rf"^({_ROOT})-a[0-9a-f]{{12}}\Z")
# The most of a refused id an error shows: every id subq makes is shorter.
# The Celery id of a run: the task id, then `-r<n>` (a resume), `-q<hex>` (a restart after a
# wait), `-t<n>` (a person's n-th retry of the failed task) or `-x<n>` (a run the reconciler
# published again); see coordinator/dispatch.py.
RUN_ID_RE = re.compile(rf"^({_ROOT}(?:-[0-9a-f]{{12}})?)(?:-[rqtx][0-9a-f]+)?\Z")


def new_root_id() -> str:
    return secrets.token_hex(8)


def new_child_id(root_id: str) -> str:
    return f"{root_id}-{secrets.token_hex(6)}"


def new_batch_id(root_id: str) -> str:
    return f"{root_id}-b{secrets.token_hex(6)}"


def new_approval_id(root_id: str) -> str:
    return f"{root_id}-a{secrets.token_hex(6)}"


def is_task_id(value: str) -> bool:
    return bool(TASK_ID_RE.match(value))


def is_batch_id(value: str) -> bool:
    return bool(BATCH_ID_RE.match(value))


def root_of(any_id: str, field: str = "task_id") -> str:
    """The root id inside a task, batch or approval id; an unknown shape is a NotFoundError naming `field`."""
    match = TASK_ID_RE.match(any_id) or BATCH_ID_RE.match(any_id) or APPROVAL_ID_RE.match(any_id)
    if match is None:
        raise NotFoundError(f"Unknown id: {shown_value(any_id)} is not a subq task or batch id", field=field)
    return match.group(1)


def task_of_run_id(celery_id: str) -> str | None:
    """The task id a run's Celery id names, or None for any other Celery id."""
    match = RUN_ID_RE.match(celery_id)
    return match.group(1) if match else None
