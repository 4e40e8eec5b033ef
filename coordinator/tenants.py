"""Tenants: who a tree is run for, and the policy (shares, priority cap, quotas) each one has.

A tree's tenant is its owner key's `tenant` (the keys file may give several keys one tenant),
else the key's name, else the `tenant` argument of `subq.submit` or of a tree made on Redis,
else SUBQ_DEFAULT_TENANT. Every task of the tree carries it (`TaskRecord.tenant`), with the
root's `priority` (1-5, default 3, capped at the tenant's `max_priority`).

Policies come from SUBQ_TENANTS (JSON) and SUBQ_TENANTS_FILE (TOML or JSON), both
`{"<tenant>": {...policy...}, "*": {...the policy of every tenant not listed...}}`:

| field                    | meaning                                                        | 0 means  |
|--------------------------|----------------------------------------------------------------|----------|
| `max_running`            | runs of the tenant running at once, across the whole fleet     | no cap   |
| `weight`                 | its share of the fleet against the others' (>= 1)              |          |
| `max_priority`           | the highest priority its roots may take (a higher one is cut)  |          |
| `submits_per_minute`     | roots it may create in any 60 s                                | no quota |
| `max_running_roots`      | roots of it running at once                                    | no quota |
| `max_cost_usd_per_day`   | what its trees may spend in any 24 h (stored as micro-USD)     | no quota |

A name in the file and in SUBQ_TENANTS takes SUBQ_TENANTS' policy. The file is taken up without
a restart, as the keys file is (coordinator/config_file.py): each read stats it and parses it again
only when it changed. Unlike the keys file, a file that no longer parses keeps the last table
that did (a botched edit must not lift every quota at once); the error is logged once per change.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic import ValidationError as PydanticError

from coordinator.config_file import ReloadingFile, read_table
from coordinator.errors import ValidationError
from coordinator.text import ascii_digits, digits_within

__all__ = [
    "DEFAULT_POLICY_NAME",
    "DEFAULT_PRIORITY",
    "DEFAULT_TENANT",
    "NO_FAIR_SHARES",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "TENANT_NAME_PATTERN",
    "FairShares",
    "TenantBook",
    "TenantList",
    "TenantPolicy",
    "TenantState",
    "Tenants",
    "check_priority",
    "check_tenant_name",
    "parse_tenants",
    "read_tenants_file",
]

logger = logging.getLogger("coordinator.tenants")

# The tenant of a tree no key, argument or setting names: one tenant, as before tenants existed.
DEFAULT_TENANT = "default"
# Priority 1-5 as Temporal's: 5 starts first within a tenant's share, 3 when none is given.
PRIORITY_MIN, PRIORITY_MAX, DEFAULT_PRIORITY = 1, 5, 3
# The table's entry that gives every tenant not listed its policy.
DEFAULT_POLICY_NAME = "*"
# A tenant's name is a key's name's alphabet (it often is a key's name): it lands in Redis key names
# inside a hash tag, in metrics labels and in the web view, so no braces, separators or spaces.
TENANT_NAME_PATTERN = re.compile(r"\A[A-Za-z0-9_.@-]{1,64}\Z")
_MICROS_PER_USD = Decimal(1_000_000)


class TenantPolicy(BaseModel):
    """One tenant's shares, priority cap and quotas (0: no cap, no quota)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_running: int = Field(default=0, ge=0)
    weight: int = Field(default=1, ge=1, le=1000)
    max_priority: int = Field(default=PRIORITY_MAX, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    submits_per_minute: int = Field(default=0, ge=0)
    max_running_roots: int = Field(default=0, ge=0)
    max_cost_micros_per_day: int = Field(default=0, ge=0)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        """`true` is no number of roots or submits (pydantic would read it as 1): a quota of 1 nobody meant."""
        if isinstance(value, bool):
            raise ValueError(f"give a whole number, not {str(value).lower()}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _usd_per_day(cls, data: Any) -> Any:
        """`max_cost_usd_per_day` (USD, as configured) becomes `max_cost_micros_per_day`, exactly."""
        if not isinstance(data, Mapping) or "max_cost_usd_per_day" not in data:
            return data
        if "max_cost_micros_per_day" in data:
            raise ValueError("give max_cost_usd_per_day or max_cost_micros_per_day, not both")
        given = data["max_cost_usd_per_day"]
        micros = _usd_to_micros_exactly(given)
        rest = {k: v for k, v in data.items() if k != "max_cost_usd_per_day"}
        return {**rest, "max_cost_micros_per_day": micros}

    @property
    def max_cost_usd_per_day(self) -> Decimal:
        return Decimal(self.max_cost_micros_per_day) / _MICROS_PER_USD


def _usd_to_micros_exactly(given: object) -> int:
    usd: Decimal | None = None
    if isinstance(given, (int, float, str, Decimal)) and not isinstance(given, bool):
        try:
            usd = Decimal(str(given))
        except InvalidOperation:
            usd = None
    if usd is None or not usd.is_finite() or usd < 0:
        raise ValueError(f"max_cost_usd_per_day must be a number of US dollars >= 0 (0: no quota), not {given!r}")
    micros = usd * _MICROS_PER_USD
    if micros != micros.to_integral_value():
        raise ValueError(f"max_cost_usd_per_day: {given!r} is finer than one micro-dollar (0.000001)")
    return int(micros)


class TenantState(BaseModel):
    """One tenant as `subq tenants` and GET /v1/tenants show it: what it runs and spends against its policy."""

    model_config = ConfigDict(frozen=True)

    tenant: str
    listed: bool  # named in SUBQ_TENANTS / SUBQ_TENANTS_FILE (else the `*` policy applies)
    running: int  # its tasks running on a worker now
    waiting: int  # its tasks queued: published, waiting for a worker or for admission
    roots_running: int
    submits_last_minute: int
    spent_micros_day: int  # micro-USD its trees spent in the rolling day (24 hourly buckets)
    policy: TenantPolicy


class TenantList(BaseModel):
    """GET /v1/tenants: every tenant the table names or that created a root within the retention."""

    model_config = ConfigDict(frozen=True)

    tenants: list[TenantState]


@dataclass(frozen=True)
class Tenants:
    """The tenants table as it is now: each listed tenant's policy, and the default for the rest."""

    listed: Mapping[str, TenantPolicy] = field(default_factory=dict)
    default: TenantPolicy = field(default_factory=TenantPolicy)

    def policy(self, name: str) -> TenantPolicy:
        """The listed tenant's policy, else the default policy (`"*"`)."""
        return self.listed.get(name, self.default)

    def names(self) -> list[str]:
        """The tenants the table lists by name, sorted (`"*"` is not one)."""
        return sorted(self.listed)

    @property
    def fair_shares(self) -> bool:
        """Whether admission shares slots between tenants: some policy caps `max_running` or weighs other than 1."""
        return any(p.max_running > 0 or p.weight != 1 for p in (*self.listed.values(), self.default))


def check_tenant_name(name: object, field: str = "tenant") -> str:
    """A tenant's name, or a ValidationError naming `field`."""
    if not isinstance(name, str) or not TENANT_NAME_PATTERN.match(name):
        raise ValidationError(
            f"{field}: a tenant is 1 to 64 letters, digits, '_', '.', '@' or '-', not {str(name)[:80]!r}", field=field
        )
    return name


def check_priority(value: object, field: str = "priority") -> int:
    """A priority (an integer 1 to 5; None: the default, 3), or a ValidationError naming `field`."""
    if value is None:
        return DEFAULT_PRIORITY
    if isinstance(value, str) and ascii_digits(value.strip()) and digits_within(value.strip(), len(str(PRIORITY_MAX))):
        value = int(value.strip())
    if not isinstance(value, int) or isinstance(value, bool) or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValidationError(
            f"{field} must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX} (default {DEFAULT_PRIORITY}), "
            f"not {str(value)[:40]!r}",
            field=field,
        )
    return value


def parse_tenants(data: object, where: str) -> Tenants:
    """The table from its configured form; a ValueError of one line naming `where`, the tenant and the field."""
    lead = f"{where}: " if where else ""
    if not isinstance(data, Mapping):
        raise ValueError(f'{lead}must be a table of tenants, {{"<tenant>": {{"max_running": 4, ...}}, "*": ...}}')
    listed: dict[str, TenantPolicy] = {}
    default = TenantPolicy()
    for name, spec in data.items():
        name = str(name)
        at = f"{lead}tenant {name!r}"
        if name != DEFAULT_POLICY_NAME and not TENANT_NAME_PATTERN.match(name):
            raise ValueError(f"{at}: a tenant is 1 to 64 letters, digits, '_', '.', '@' or '-' (or '*')")
        if isinstance(spec, TenantPolicy):
            policy = spec
        else:
            try:
                policy = TenantPolicy.model_validate(spec)
            except PydanticError as exc:
                error = exc.errors()[0]
                loc = ".".join(str(part) for part in error["loc"])
                message = str(error["msg"]).removeprefix("Value error, ")
                raise ValueError(f"{at}: {loc + ': ' if loc else ''}{message}") from None
        if name == DEFAULT_POLICY_NAME:
            default = policy
        else:
            listed[name] = policy
    return Tenants(listed, default)


def read_tenants_file(path: Path) -> Tenants:
    """The table of a TOML (`.toml`) or JSON file; a ValueError naming the file, the tenant and the field."""
    where = f"SUBQ_TENANTS_FILE: {path}"
    return parse_tenants(read_table(path, where, wrapper="tenants"), where)  # `[tenants.<name>]` tables read as well


def merged(inline: Tenants, from_file: Tenants, inline_has_default: bool) -> Tenants:
    """The file's table with SUBQ_TENANTS' entries over it (SUBQ_TENANTS' `"*"` too, when it gives one)."""
    return Tenants({**from_file.listed, **inline.listed}, inline.default if inline_has_default else from_file.default)


class TenantBook:
    """The tenants table of a deployment, SUBQ_TENANTS_FILE read again whenever it changes."""

    def __init__(
        self, inline: Tenants, file: Path | None, inline_has_default: bool = False, at_start: Tenants | None = None
    ) -> None:
        """`at_start`: the file's table as the process's start read it (and refused it if broken). It stands while
        the file is broken at the book's first look: the book is made on first use, maybe hours after the start,
        and a file botched meanwhile lifted every quota of the file in that process, the log saying it had not."""
        self._inline = inline
        self._inline_has_default = inline_has_default
        self._file: ReloadingFile[Tenants] | None = None
        if file is not None:
            self._file = ReloadingFile(
                file,
                self._read,
                initial=inline if at_start is None else merged(inline, at_start, inline_has_default),
                broken=None,  # the last table that parsed: a botched edit must not lift every quota at once
                logger=logger,
                broken_means="the tenants table read before stays in force until it is fixed",
            )

    def current(self) -> Tenants:
        """The table now: one `stat` of the file, parsed again only when it changed."""
        return self._inline if self._file is None else self._file.current()

    def _read(self, path: Path) -> Tenants:
        return merged(self._inline, read_tenants_file(path), self._inline_has_default)


@dataclass(frozen=True)
class FairShares:
    """What a run's start and end are told of fair shares: `on` (some tenant policy caps `max_running` or
    weighs other than 1), and this worker's concurrency, the fleet's capacity until a beat has counted it."""

    on: bool = False
    capacity: int = 1


# Fair shares off: a run's start and end read nothing of them (admission and coordinator/store/fair.py share it).
NO_FAIR_SHARES = FairShares()
