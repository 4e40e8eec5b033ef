"""The Plane: the parts of the control plane a room works with, and nothing else.

A room (delegation, control, approvals, budgets, admission, writeback) takes a
`Plane` instead of the whole `Coordinator`: the store it reads and writes
through, the settings it checks against, and the Celery app it publishes work
with. The Coordinator builds one (`coord.plane`) and hands it to its rooms; the
rooms never call back into the service, so no room imports `coordinator.service`
and the service and its rooms form no import loop.

The app is built on first use, as the Coordinator's always was: a plane that
only reads never builds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from coordinator.celery_app import make_app
from coordinator.tenants import TenantBook, Tenants

if TYPE_CHECKING:
    from celery import Celery

    from coordinator.settings import Settings
    from coordinator.store import Store

__all__ = ["Plane"]


@dataclass(frozen=True)
class Plane:
    """The store, the settings and the publishing Celery app of one deployment (one Redis, one key prefix)."""

    store: Store
    settings: Settings
    # The app to publish with, when the builder was given one; otherwise one is made on first use.
    given_app: Celery | None = field(default=None, repr=False)

    @cached_property
    def app(self) -> Celery:
        """The Celery app used to publish work, built on first use."""
        return self.given_app if self.given_app is not None else make_app(self.settings)

    @cached_property
    def tenant_book(self) -> TenantBook:
        """SUBQ_TENANTS over SUBQ_TENANTS_FILE, the file read again whenever it changes (coordinator/tenants.py)."""
        settings = self.settings
        has_default = "*" in settings.tenants
        return TenantBook(settings.tenants_inline(), settings.tenants_file, has_default, settings.tenants_at_start())

    @property
    def tenants(self) -> Tenants:
        """The tenants table now: each tenant's shares, priority cap and quotas."""
        return self.tenant_book.current()
