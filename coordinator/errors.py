"""The errors subq raises, all under one base.

    SubqError                      every error subq raises on purpose
    ├── ConfigError                a setting is invalid (names the SUBQ_ variable)
    ├── ValidationError            input is malformed (names the field path)
    │   ├── TodoError              a todo update parses to nothing or has a bad item
    │   ├── ProfileError           an unknown or unusable model profile
    │   └── ScriptError            an offline-model script is malformed
    ├── NotFoundError              an id names no task or batch (or one the caller may not read)
    ├── ForbiddenError             the caller's API key lacks the scope this needs (names it)
    ├── StateError                 the task is not in a state that allows this
    ├── ConflictError              shared state kept changing under a transaction
    ├── QuotaExceeded              a tenant's quota refuses a new root (names the tenant, the quota, the reset)
    ├── WaitTimeout                wait() gave up before the task settled
    ├── StoreError                 Redis is unreachable or refused a command (retried)
    │   ├── BrokerError            the broker refused or dropped a publish (retried)
    │   └── CorruptError           a stored entry cannot be read (not retried)
    └── FleetError                 local worker processes did not start

ScriptError (an offline-model script is malformed) is a ValidationError too.

Redis and Celery exceptions are translated into these in one place each
(`store.translate_redis_errors`), so a caller never sees a raw traceback for a
bad input: they see what was wrong and where.
"""

from __future__ import annotations

__all__ = [
    "BrokerError",
    "ConfigError",
    "ConflictError",
    "CorruptError",
    "FencedError",
    "FleetError",
    "ForbiddenError",
    "NotFoundError",
    "ProfileError",
    "QuotaExceeded",
    "ScriptError",
    "StateError",
    "StoreError",
    "SubqError",
    "TodoError",
    "ValidationError",
    "WaitTimeout",
]


class SubqError(Exception):
    """Base of every error subq raises on purpose.

    `field` is the dotted path of the offending input where there is one
    (`specs.2.message`, `SUBQ_MAX_FANOUT`), so API and CLI layers can show it.
    """

    code = "subq_error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message


class ConfigError(SubqError):
    code = "invalid_setting"


class ValidationError(SubqError):
    code = "invalid_input"


class TodoError(ValidationError):
    code = "invalid_todos"


class ProfileError(ValidationError):
    code = "invalid_profile"


class NotFoundError(SubqError):
    code = "not_found"


class ForbiddenError(SubqError):
    code = "forbidden"


class StateError(SubqError):
    code = "wrong_state"


class ConflictError(SubqError):
    code = "conflict"


class FencedError(StateError):
    """A run's write refused because the run no longer holds its task's lease: it stalled past the lease's lapse,
    and a newer run of the task may own it now. The run stops without writing (`LeaseLost`)."""

    @classmethod
    def of(cls, task_id: str) -> FencedError:
        return cls(f"The run of task {task_id} no longer holds its lease", field="task_id")


class QuotaExceeded(SubqError):
    """A tenant's quota (coordinator/quotas.py) refuses a new root: HTTP 429 with Retry-After, the same text on
    every face. `retry_after_s` is when the quota resets (a running root's end: a guess, see the message)."""

    code = "quota_exceeded"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        tenant: str = "",
        quota: str = "",
        retry_after_s: int = 0,
    ) -> None:
        super().__init__(message, field=field)
        self.tenant = tenant
        self.quota = quota or (field or "")
        self.retry_after_s = retry_after_s


class WaitTimeout(SubqError):
    code = "timeout"


class StoreError(SubqError):
    code = "store_error"


class BrokerError(StoreError):
    code = "broker_error"


class CorruptError(StoreError):
    code = "corrupt_entry"


class ScriptError(ValidationError):
    code = "invalid_script"


class FleetError(SubqError):
    code = "fleet_error"
