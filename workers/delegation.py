"""The write-back behind `subq.gather` and `subq.advance` (see coordinator/writeback.py)."""

from __future__ import annotations

from coordinator import writeback
from workers.runtime.context import Runtime

__all__ = ["settle"]


def settle(rt: Runtime, batch_id: str) -> bool:
    """Write back what has ended in the batch; True when this call closed it."""
    return writeback.settle(rt.coordinator, batch_id)
