"""Who may do what: scoped API keys, the caller they name, and what a caller may touch.

A key is a name, the SHA-256 of its token (the token itself is never stored) and
its scopes. Keys come from SUBQ_API_KEYS (JSON) and SUBQ_API_KEYS_FILE (TOML or
JSON), both `{"<name>": {"token_sha256": "<hex>", "scopes": [...], "tenant"?: "<tenant>"}}`; the legacy
SUBQ_API_TOKEN is the key `admin` with every scope. A key's `tenant` (coordinator/tenants.py) is whom
the trees it creates run for: several keys may name one; a key that names none is its own tenant.

| scope      | allows                                                                     |
|------------|----------------------------------------------------------------------------|
| `submit`   | create trees; delegate, update todos and cancel in the trees it created    |
| `read`     | read the trees it created                                                  |
| `read_all` | read every tree                                                            |
| `decide`   | approve and deny any tool call (and list every waiting one)                |
| `operate`  | cancel any tree; list and purge dead letters; read the audit log           |
| `admin`    | everything                                                                 |

A tree belongs to the key that created it (its records' `owner`). A tree a
caller may not read is answered as if it did not exist (404), so its existence
does not leak; a missing scope is a 403 that names the scope.

`KeyRing` answers "whose token is this?" per request. The file is taken up
without a restart (coordinator/config_file.py): each lookup stats it (one `stat`, no read) and reads it again
only when its modification time, size or inode changed. A file that no longer
parses revokes every key it held until it parses again (fail closed: a botched
edit must not keep a revoked key alive); the error is logged once per change.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from pydantic import ValidationError as PydanticError

from coordinator.config_file import ReloadingFile, read_table
from coordinator.subscriptions import MAX_WEBHOOKS, Webhook
from coordinator.tenants import TENANT_NAME_PATTERN

__all__ = [
    "ADMIN_KEY",
    "OPEN",
    "ApiKey",
    "ApiKeySpec",
    "KeyRing",
    "Principal",
    "Scope",
    "parse_keys",
    "read_keys_file",
    "token_sha256",
]

logger = logging.getLogger("coordinator.access")

# The name SUBQ_API_TOKEN signs in as: a deployment that had one token keeps working.
ADMIN_KEY = "admin"
# A key's name lands in the audit log, on every record it creates and in the web view:
# short, printable, no separators that would need quoting anywhere.
KEY_NAME_PATTERN = re.compile(r"\A[A-Za-z0-9_.@-]{1,64}\Z")
_HEX64 = re.compile(r"\A[0-9a-fA-F]{64}\Z")


class Scope(StrEnum):
    SUBMIT = "submit"
    READ = "read"
    READ_ALL = "read_all"
    DECIDE = "decide"
    OPERATE = "operate"
    ADMIN = "admin"


def token_sha256(token: str) -> str:
    """The hex SHA-256 of a token, as a key's `token_sha256` holds it."""
    return hashlib.sha256(token.encode()).hexdigest()


class ApiKeySpec(BaseModel):
    """A key as SUBQ_API_KEYS holds it (checked by `parse_keys` first, with messages naming the key)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_sha256: str
    scopes: list[Scope]
    webhooks: list[Webhook] = Field(default_factory=list, max_length=MAX_WEBHOOKS)
    tenant: str | None = None


@dataclass(frozen=True)
class ApiKey:
    """One key as configured: its name, its token's SHA-256 (lower-case hex), its scopes, and the webhooks
    every tree it creates sends its events to (docs/webhooks.md): a service configures them once."""

    name: str
    token_sha256: str
    scopes: frozenset[Scope]
    webhooks: tuple[Webhook, ...] = ()
    tenant: str | None = None  # whom its trees run for; None: the key's own name

    def as_setting(self) -> ApiKeySpec:
        """The key as the Settings class holds it (and SUBQ_API_KEYS writes it)."""
        return ApiKeySpec(
            token_sha256=self.token_sha256, scopes=sorted(self.scopes), webhooks=list(self.webhooks), tenant=self.tenant
        )

    def principal(self) -> Principal:
        """The caller this key names."""
        return Principal(self.name, self.scopes, self.webhooks, self.tenant or self.name)


@dataclass(frozen=True)
class Principal:
    """The caller of one request: a key's name and its scopes."""

    name: str
    scopes: frozenset[Scope]
    webhooks: tuple[Webhook, ...] = ()  # the key's own subscriptions, for every tree it creates
    # The tenant its trees run for (the key's `tenant`, else its name); None: SUBQ_DEFAULT_TENANT (open access).
    tenant: str | None = None

    def has(self, scope: Scope) -> bool:
        return Scope.ADMIN in self.scopes or scope in self.scopes

    def has_any(self, *scopes: Scope) -> bool:
        return any(self.has(scope) for scope in scopes)

    def may_read(self, owner: str) -> bool:
        """Whether this caller may read a tree created by `owner`."""
        return self.has(Scope.READ_ALL) or (self.has(Scope.READ) and owner == self.name)

    def owns(self, owner: str) -> bool:
        return owner == self.name

    @property
    def scope_names(self) -> list[str]:
        return sorted(self.scopes)


# The caller when SUBQ_API_AUTH_DISABLED=true: everything is open, as the setting says.
OPEN = Principal("anonymous", frozenset(Scope))


def parse_keys(data: object, where: str = "") -> dict[str, ApiKey]:
    """Keys from their configured form; a ValueError of one line naming `where` and the key otherwise."""
    lead = f"{where}: " if where else ""
    if not isinstance(data, Mapping):
        raise ValueError(f'{lead}must be a table of keys, {{"<name>": {{"token_sha256": ..., "scopes": [...]}}}}')
    keys: dict[str, ApiKey] = {}
    for name, spec in data.items():
        keys[str(name)] = _parse_key(str(name), spec, where)
    by_hash: dict[str, str] = {}
    for key in keys.values():
        if key.token_sha256 in by_hash:
            raise ValueError(
                f"{lead}keys {by_hash[key.token_sha256]!r} and {key.name!r} have the same token_sha256 "
                "(give each key a token of its own)"
            )
        by_hash[key.token_sha256] = key.name
    return keys


def _parse_key(name: str, spec: object, where: str) -> ApiKey:
    """One key from its configured form; each check below raises a ValueError naming the key (`at`) and the field."""
    at = f"{where}: key {name!r}" if where else f"key {name!r}"
    if not KEY_NAME_PATTERN.match(name):
        raise ValueError(f"{at}: a name is 1 to 64 letters, digits, '_', '.', '@' or '-'")
    if isinstance(spec, ApiKey):
        return spec
    fields = _key_fields(spec, at)
    return ApiKey(
        name,
        _key_digest(fields["token_sha256"], at),
        _key_scopes(fields["scopes"], at),
        # Arguments are checked left to right: a key's first fault is the one named, the tenant's before the webhooks'.
        tenant=_key_tenant(fields.get("tenant"), at),
        webhooks=_key_webhooks(fields.get("webhooks"), at),
    )


_KEY_FIELDS = ("token_sha256", "scopes", "webhooks", "tenant")
_REQUIRED_KEY_FIELDS = ("token_sha256", "scopes")


def _key_fields(spec: object, at: str) -> Mapping[str, Any]:
    """A key's table (an ApiKeySpec as its fields), with no unknown field and every required one."""
    if isinstance(spec, ApiKeySpec):
        given = {"tenant": spec.tenant} if spec.tenant is not None else {}
        spec = {**spec.model_dump(mode="json", exclude={"webhooks", "tenant"}), "webhooks": spec.webhooks, **given}
    if not isinstance(spec, Mapping):
        raise ValueError(f'{at}: must be a table {{"token_sha256": "<hex>", "scopes": [...]}}')
    unknown = sorted(set(map(str, spec)) - set(_KEY_FIELDS))
    if unknown:
        raise ValueError(f"{at}: unknown field {unknown[0]!r} (a key has token_sha256, scopes, webhooks and tenant)")
    for field in _REQUIRED_KEY_FIELDS:
        if field not in spec:
            raise ValueError(f"{at}: missing field {field!r}")
    return spec


def _key_digest(digest: object, at: str) -> str:
    """A key's `token_sha256`, lower-case."""
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise ValueError(
            f"{at}: token_sha256 must be the token's SHA-256 as 64 hex digits "
            '(e.g. printf %s "$TOKEN" | sha256sum), not the token itself'
        )
    return digest.lower()


def _key_scopes(scopes: object, at: str) -> frozenset[Scope]:
    """A key's `scopes`: a non-empty list of scope names."""
    if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) for s in scopes):
        raise ValueError(f"{at}: scopes must be a non-empty list of {', '.join(Scope)}")
    for scope in scopes:
        if scope not in Scope.__members__.values():
            raise ValueError(f"{at}: unknown scope {scope!r} (one of {', '.join(Scope)})")
    return frozenset(Scope(s) for s in scopes)


def _key_tenant(tenant: object, at: str) -> str | None:
    """A key's `tenant` (None: the key is its own tenant)."""
    if tenant is None:
        return None
    if not isinstance(tenant, str) or not TENANT_NAME_PATTERN.match(tenant):
        raise ValueError(f"{at}: tenant: 1 to 64 letters, digits, '_', '.', '@' or '-', not {str(tenant)[:80]!r}")
    return tenant


_WEBHOOKS = TypeAdapter(list[Webhook])


def _key_webhooks(given: object, at: str) -> tuple[Webhook, ...]:
    """A key's `webhooks` ([{url, secret?, events?}], at most 5), or a ValueError naming the key and the field."""
    if given is None:
        return ()
    try:
        hooks = _WEBHOOKS.validate_python(given)
    except PydanticError as exc:
        error = exc.errors()[0]
        where = ".".join(["webhooks", *(str(part) for part in error["loc"])])
        raise ValueError(f"{at}: {where}: {error['msg']}") from None
    if len(hooks) > MAX_WEBHOOKS:
        raise ValueError(f"{at}: webhooks: at most {MAX_WEBHOOKS}")
    return tuple(hooks)


def read_keys_file(path: Path) -> dict[str, ApiKey]:
    """The keys of a TOML (`.toml`) or JSON file; a ValueError naming the file and the key otherwise."""
    where = f"SUBQ_API_KEYS_FILE: {path}"
    return parse_keys(read_table(path, where, wrapper="keys"), where)  # `[keys.<name>]` tables read as well


def check_distinct(
    inline: Mapping[str, ApiKey | ApiKeySpec], from_file: Mapping[str, ApiKey], legacy_token: str | None
) -> None:
    """No name and no token twice across SUBQ_API_KEYS, the file and SUBQ_API_TOKEN: a token names one key."""
    for name in from_file:
        if name in inline:
            raise ValueError(f"SUBQ_API_KEYS_FILE: key {name!r} is also in SUBQ_API_KEYS (name each key once)")
    by_hash = {key.token_sha256.lower(): name for name, key in inline.items()}
    for name, file_key in from_file.items():
        if file_key.token_sha256 in by_hash:
            raise ValueError(
                f"SUBQ_API_KEYS_FILE: key {name!r} has the token_sha256 of key {by_hash[file_key.token_sha256]!r} "
                "of SUBQ_API_KEYS (give each key a token of its own)"
            )
        by_hash[file_key.token_sha256] = name
    if legacy_token is None:
        return
    for source, names in (("SUBQ_API_KEYS", inline), ("SUBQ_API_KEYS_FILE", from_file)):
        if ADMIN_KEY in names:
            raise ValueError(
                f"{source}: key {ADMIN_KEY!r} is the name SUBQ_API_TOKEN signs in as; give the key another name"
            )
    if token_sha256(legacy_token) in by_hash:
        source = "SUBQ_API_KEYS_FILE" if by_hash[token_sha256(legacy_token)] in from_file else "SUBQ_API_KEYS"
        raise ValueError(
            f"{source}: key {by_hash[token_sha256(legacy_token)]!r} has the token of SUBQ_API_TOKEN "
            "(give each key a token of its own)"
        )


class KeyRing:
    """Every key of a deployment, looked up by token; the keys file is read again when it changes."""

    def __init__(self, inline: Mapping[str, ApiKey], file: Path | None, legacy_token: str | None) -> None:
        self._inline = dict(inline)
        self._legacy_token = legacy_token or None
        self._legacy = ApiKey(ADMIN_KEY, token_sha256(legacy_token), frozenset(Scope)) if legacy_token else None
        self._file: ReloadingFile[dict[str, ApiKey]] | None = None
        if file is not None:
            self._file = ReloadingFile(
                file,
                self._read,
                initial={},
                broken={},  # fail closed: a botched edit must not keep a revoked key alive
                logger=logger,
                broken_means="every key of that file is refused until it is fixed",
            )

    @property
    def empty(self) -> bool:
        return not self._inline and self._file is None and self._legacy is None

    def keys(self) -> dict[str, ApiKey]:
        """Every key now valid: the legacy token's, SUBQ_API_KEYS', and the file's as it is now."""
        out = dict(self._inline)
        if self._legacy is not None:
            out[ADMIN_KEY] = self._legacy
        if self._file is not None:
            for name, key in self._file.current().items():
                out.setdefault(name, key)  # a name also given inline stays the inline key
        return out

    def find(self, token: str) -> ApiKey | None:
        """The key whose token this is, or None.

        Compared by SHA-256: the digest of a wrong guess tells nothing about the right
        token, so a lookup by digest leaks nothing a timing could use.
        """
        digest = token_sha256(token)
        for key in self.keys().values():
            if key.token_sha256 == digest:
                return key
        return None

    def named(self, name: str) -> ApiKey | None:
        return self.keys().get(name)

    def _read(self, path: Path) -> dict[str, ApiKey]:
        keys = read_keys_file(path)
        check_distinct(self._inline, keys, self._legacy_token)
        return keys
