"""Where the local stack (`subq up`, `subq api`, `subq flower`) listens by default.

A module of plain constants, so `subq --help` can show them without importing
`coordinator.local.up` (and through it Celery and redis-py).
"""

from __future__ import annotations

__all__ = ["DEFAULT_API_PORT", "DEFAULT_FLOWER_PORT", "DEFAULT_FLOWER_USER", "DEFAULT_HOST"]

DEFAULT_HOST = "127.0.0.1"  # local only unless asked: the stack prints its credentials
DEFAULT_API_PORT = 8000
DEFAULT_FLOWER_PORT = 5555
DEFAULT_FLOWER_USER = "subq"
