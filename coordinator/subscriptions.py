"""Where a tree's events go, as a caller gives it with the root (docs/webhooks.md).

    webhooks:    [{url, secret?, events?}]          signed HTTP POSTs (Standard Webhooks)
    on_complete: "myapp.tasks.tree_done" | {task, queue?}   a Celery task sent by name with the record

The shapes are light (pydantic and the standard library), so the Python client
checks them before it sends anything, in the words the API answers with.

The safe-target rule is the server's (`subscriptions()`, at creation; the
deliverer, coordinator/outbound.py, at each connect): an HTTP subscription's host
must resolve to public addresses only (not loopback, private, link-local, shared,
multicast, reserved, nor a cloud's metadata address, 169.254.169.254), unless
`SUBQ_WEBHOOK_ALLOW` names the host or a network holding the address.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import ipaddress
import json
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    WithJsonSchema,
    field_serializer,
    field_validator,
)

from coordinator.errors import ValidationError
from coordinator.networks import blocked_address, own_addresses_lately
from coordinator.text import lone_surrogate

__all__ = [
    "CALLBACK_HOOK",
    "DEFAULT_CALLBACK_QUEUE",
    "DEFAULT_EVENTS",
    "EVENT_PATTERNS",
    "MAX_SECRET_CHARS",
    "MAX_URL_CHARS",
    "MAX_WEBHOOKS",
    "CeleryCallback",
    "OnComplete",
    "UnsafeTarget",
    "Webhook",
    "Webhooks",
    "check_targets",
    "check_webhook_events",
    "check_webhook_secret",
    "check_webhook_url",
    "resolve_safe",
    "shown_target",
    "subscriptions",
]

# A root's own subscriptions: a service and a person or two, not a fan-out of its own; each one is a
# delivery per event, so the count bounds how much one end writes.
MAX_WEBHOOKS = 5
# Longer than any real endpoint with a path and a token in its query; a URL is not where data goes.
MAX_URL_CHARS = 2048
# Standard Webhooks secrets are `whsec_` and the base64 of 24 to 64 random bytes (about 92 characters).
MAX_SECRET_CHARS = 100
SECRET_BYTES = (24, 64)
# Every event a subscription may name; `x.*` names every event of its family, `*` every event.
EVENT_TYPES = (
    "task.completed",
    "task.failed",
    "task.cancelled",
    "child.completed",
    "child.failed",
    "child.cancelled",
    "approval.requested",
    "approval.decided",
    "budget.warning",
)
EVENT_PATTERNS = frozenset({*EVENT_TYPES, "*", "task.*", "child.*", "approval.*", "budget.*"})
# The root's own events; a child's ends only when asked (`child.*`): a wide fan-out would be a delivery a child.
DEFAULT_EVENTS = ("task.*", "approval.*", "budget.*")
# Celery's own default queue: the one a plain `@app.task` is consumed from.
DEFAULT_CALLBACK_QUEUE = "celery"
# The subscription number of a root's `on_complete` in its hooks hash (its webhooks are 0 to 4).
CALLBACK_HOOK = "c"
# How long a submit waits for its webhooks' host names to resolve, all of them together (`check_targets`): a name
# not answered by then is accepted as one that does not resolve yet.
CREATE_RESOLVE_WAIT_S = 2.0
# The most lookups at once, each on a daemon thread of its own (a process's exit waits on none): past it a name is
# taken as not resolving yet at once, so no backlog builds behind names whose DNS never answers.
MAX_CREATE_LOOKUPS = 16
_lookups = threading.BoundedSemaphore(MAX_CREATE_LOOKUPS)
# The first part of a task name an on_complete may not name: subq's tasks (subq.*) and Celery's (celery.*).
RESERVED_TASK_PREFIXES = frozenset({"subq", "celery"})
_TASK_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,199}")
_QUEUE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
# A host name as DNS spells it (its IDNA form): labels of letters, digits, `-` and `_`, dot-separated.
HOST_NAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")


def check_webhook_url(url: str) -> str:
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"is {len(url)} characters; the limit is {MAX_URL_CHARS}")
    if (where := lone_surrogate(url)) is not None:  # no request line can carry it, nor a JSON answer show it
        raise ValueError(f"holds a lone surrogate {where}, which is no character")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (a bad port raises here)
    except ValueError:
        raise ValueError("is not a URL") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("must name a host")
    if problem := _host_name_problem(parts.hostname):
        raise ValueError(problem)
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry a user or password (sign with `secret`)")
    if parts.fragment:
        raise ValueError("must not have a #fragment")
    return url


def _host_name_problem(host: str) -> str | None:
    """Why `host` is no name the resolver can be asked (`socket.getaddrinfo` encodes it as IDNA, and raises
    UnicodeError, not OSError, for an empty label, one over 63 characters, ...); None when it is one."""
    try:
        ascii_name = host.encode("idna").decode("ascii")
    except UnicodeError as exc:
        reason = str(exc.__cause__ or exc.__context__ or exc)
        return f"names no valid host ({host!r}: {reason})"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if not HOST_NAME_RE.match(ascii_name):
        # A space, a NUL, `!`: no such name is ever published, so it would only fail for a day of retries.
        return f"names no valid host ({host!r}: a host name is letters, digits, '-' and '_', between dots)"
    return None


def check_webhook_secret(secret: SecretStr) -> SecretStr:
    text = secret.get_secret_value()
    if len(text) > MAX_SECRET_CHARS:
        raise ValueError(f"is {len(text)} characters; the limit is {MAX_SECRET_CHARS}")
    try:
        raw = base64.b64decode(text.removeprefix("whsec_"), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if not SECRET_BYTES[0] <= len(raw) <= SECRET_BYTES[1]:
        # The value itself is never in the message: it is a secret even when malformed.
        raise ValueError(
            f"must be `whsec_` and the base64 of {SECRET_BYTES[0]} to {SECRET_BYTES[1]} random bytes "
            '(Standard Webhooks: `"whsec_" + base64(os.urandom(32))`)'
        )
    return secret


def check_webhook_events(events: list[str]) -> list[str]:
    for n, name in enumerate(events):
        if name not in EVENT_PATTERNS:
            raise ValueError(f"{n}: {name[:64]!r} is no event; one of {', '.join(sorted(EVENT_PATTERNS))}")
    return list(dict.fromkeys(events))


class Webhook(BaseModel):
    """One HTTP subscription: every event it names is POSTed to `url`, signed with `secret` when given."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: Annotated[str, AfterValidator(check_webhook_url)] = Field(
        description="http(s) URL that receives the events (no loopback, private or metadata address)",
        json_schema_extra={"maxLength": MAX_URL_CHARS},
    )
    secret: Annotated[SecretStr, AfterValidator(check_webhook_secret)] | None = Field(
        default=None,
        description="Standard Webhooks signing secret (`whsec_...`), write-only: never returned nor logged",
        json_schema_extra={"writeOnly": True, "maxLength": MAX_SECRET_CHARS},
    )
    events: Annotated[list[str], AfterValidator(check_webhook_events)] = Field(
        default_factory=lambda: list(DEFAULT_EVENTS),
        min_length=1,
        max_length=len(EVENT_PATTERNS),
        description="Event types or families (`task.*`, `child.*`, `approval.*`, `budget.*`, `*`)",
    )

    @field_serializer("secret")
    def _sent(self, secret: SecretStr | None) -> str | None:
        # A dump is for sending it on: the clients send the body they read with this model
        # (coordinator/client/calls.py), and a process's settings pass a key's webhooks to its children as
        # JSON; a masked secret would sign nothing. A repr or a log line keeps it masked.
        return None if secret is None else secret.get_secret_value()


Webhooks = Annotated[
    list[Webhook] | None,
    Field(max_length=MAX_WEBHOOKS, description="Where the tree's events are POSTed (docs/webhooks.md)"),
]


class CeleryCallback(BaseModel):
    """A Celery task sent by name, with the finished root's record (JSON) as its one argument."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: str = Field(pattern=f"^{_TASK_NAME_RE.pattern}$", description="The task's registered name")
    queue: str = Field(default=DEFAULT_CALLBACK_QUEUE, pattern=f"^{_QUEUE_RE.pattern}$", description="Its queue")

    @field_validator("task")
    @classmethod
    def _not_ours(cls, task: str) -> str:
        # A caller with `submit` names any task: never subq's own (a callback must not drive another tree's
        # run or purge dead letters) nor Celery's built-ins (chord_unlock, backend_cleanup).
        if task.split(".", 1)[0] in RESERVED_TASK_PREFIXES:
            raise ValueError(f"{task!r} is a task of subq's or Celery's own; name a task of your application")
        return task


def _callback(value: Any) -> Any:
    return {"task": value} if isinstance(value, str) else value


OnComplete = Annotated[
    CeleryCallback | None,
    BeforeValidator(_callback),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": f"^{_TASK_NAME_RE.pattern}$"},
                {
                    "type": "object",
                    "properties": {"task": {"type": "string"}, "queue": {"type": "string"}},
                    "required": ["task"],
                    "additionalProperties": False,
                },
                {"type": "null"},
            ],
            "description": "A Celery task sent by name when the root ends, with its record (docs/celery-contract.md)",
        }
    ),
]


# -- the safe-target rule (the server's) -------------------------------------------------------------


class UnsafeTarget(Exception):
    """A webhook's host resolves to an address no webhook may reach (or to none)."""


def _allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address, allow: Sequence[str]) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for entry in allow:
        try:
            if address in ipaddress.ip_network(entry.strip("[]"), strict=False):
                return True
        except ValueError:
            continue  # a host name: matched by name, not here
    # The sandbox's ranges and the host's own addresses (coordinator/networks.py): `is_global` alone read the NAT64,
    # 6to4 and IPv4-compatible forms of a private address (64:ff9b::a00:1 is 10.0.0.1 behind DNS64) as global.
    # `is_global` after them: documentation ranges and the rest of what IANA holds back.
    if blocked_address(address, own_addresses_lately()):
        return False
    return address.is_global and not address.is_multicast


def _host_allowed(host: str, allow: Sequence[str]) -> bool:
    return host.lower().rstrip(".") in {entry.lower().rstrip(".") for entry in allow}


def resolve_safe(host: str, port: int, allow: Sequence[str]) -> str:
    """The address to connect to for `host`: every address it resolves to must be allowed; UnsafeTarget if not."""
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    if literal is not None:
        if _allowed(literal, allow):
            return str(literal)
        raise UnsafeTarget(f"{literal} is a loopback, private, link-local, metadata or this host's own address")
    if problem := _host_name_problem(host):  # a subscription stored before its URL's host was checked at creation
        raise UnsafeTarget(problem)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise UnsafeTarget(f"{host} does not resolve ({exc.strerror or exc})") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    if _host_allowed(host, allow):
        return addresses[0]
    for text in addresses:
        if not _allowed(ipaddress.ip_address(text.split("%")[0]), allow):
            # (Not which address: a caller with `submit` would read a private name's answer in the refusal.)
            raise UnsafeTarget(
                f"{host} resolves to a loopback, private, link-local, metadata or this host's own address"
            )
    return addresses[0]


def _target_problem(url: str, allow: Sequence[str]) -> str | None:
    """Why a webhook may not reach `url`'s host (None: it may, or it does not resolve yet)."""
    parts = urlsplit(url)
    try:
        resolve_safe(parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80), allow)
    except UnsafeTarget as exc:
        return None if "does not resolve" in str(exc) else str(exc)
    return None


def _is_literal(url: str) -> bool:
    """Whether the URL's host is an address written as such, in any form the resolver reads without DNS: the
    short and numeric IPv4 forms too (`127.1`, `2130706433`, `0x7f.1`)."""
    host = (urlsplit(url).hostname or "").strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:
            socket.inet_aton(host)
        except OSError:
            return False
    return True


def _look_up(url: str, allow: Sequence[str]) -> concurrent.futures.Future[str | None] | None:
    """`_target_problem` of `url` on a thread of its own; None when MAX_CREATE_LOOKUPS are in flight."""
    if not _lookups.acquire(blocking=False):
        return None
    future: concurrent.futures.Future[str | None] = concurrent.futures.Future()

    def look() -> None:
        try:
            future.set_result(_target_problem(url, allow))
        except Exception as exc:
            future.set_exception(exc)
        finally:
            _lookups.release()

    threading.Thread(target=look, name="subq-webhook-dns", daemon=True).start()
    return future


def check_targets(urls: Mapping[str, str], allow: Sequence[str]) -> None:
    """At creation: a URL (by the field that names it) whose host is, or resolves to, an address no webhook may reach
    is a 422 naming its field.

    A host that does not resolve yet is accepted: each attempt checks again, and a name may be the receiver's own
    to publish later (its attempts retry meanwhile). So is a name whose DNS has not answered within
    `CREATE_RESOLVE_WAIT_S` (the request's names looked up together), or one that finds MAX_CREATE_LOOKUPS lookups in
    flight: a caller whose names' servers never answer held an API thread for the resolver's whole timeout per name,
    and forty such requests held every thread the API has. An address written as such is checked here and now,
    never left to the wait."""
    names = {field: url for field, url in urls.items() if not _is_literal(url)}
    for field, url in urls.items():
        if field not in names:
            _refuse(field, _target_problem(url, allow))
    pending = {field: future for field, url in names.items() if (future := _look_up(url, allow)) is not None}
    deadline = time.monotonic() + CREATE_RESOLVE_WAIT_S
    for field, future in pending.items():
        try:
            problem = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            continue  # not answered yet: as a name that does not resolve yet
        _refuse(field, problem)


def _refuse(field: str, problem: str | None) -> None:
    if problem is not None:
        raise ValidationError(
            f"{field}: {problem}; a webhook goes to public addresses only (SUBQ_WEBHOOK_ALLOW names exceptions)",
            field=field,
        )


def subscriptions(
    webhooks: Sequence[Webhook] | None,
    on_complete: CeleryCallback | None,
    allow: Sequence[str],
    sinks: Sequence[Any] = (),
    key_webhooks: Sequence[Webhook] = (),
) -> dict[str, tuple[str, str]]:
    """A root's subscriptions as the hooks hash keeps them: number -> (event patterns, target JSON).

    The caller's webhooks (0 to 4) are checked here, before anything is written; its Celery callback is
    `c`; the operator's SUBQ_NOTIFY sinks (`n0`, ...: each with a url, format, secret and events) and the
    creating API key's webhooks (`k0`, ...) are the operator's own and checked at each connect only."""
    targets: dict[str, tuple[str, str]] = {}
    check_targets({f"webhooks.{n}.url": hook.url for n, hook in enumerate(webhooks or ())}, allow)
    for n, hook in enumerate(webhooks or ()):
        secret = hook.secret.get_secret_value() if hook.secret is not None else ""
        target = {"kind": "webhook", "url": hook.url, "secret": secret, "format": "json"}
        targets[str(n)] = (" ".join(hook.events), json.dumps(target))
    if on_complete is not None:
        target = {"kind": "celery", "task": on_complete.task, "queue": on_complete.queue}
        targets[CALLBACK_HOOK] = ("task.*", json.dumps(target))
    for n, sink in enumerate(sinks):
        secret = sink.secret.get_secret_value() if sink.secret is not None else ""
        target = {"kind": "webhook", "url": sink.url, "secret": secret, "format": sink.format}
        targets[f"n{n}"] = (" ".join(sink.events), json.dumps(target))
    for n, hook in enumerate(key_webhooks):
        secret = hook.secret.get_secret_value() if hook.secret is not None else ""
        target = {"kind": "webhook", "url": hook.url, "secret": secret, "format": "json"}
        targets[f"k{n}"] = (" ".join(hook.events), json.dumps(target))
    return targets


def shown_target(hook: str, target: Mapping[str, Any]) -> str:
    """Subscription `hook`'s target as a read shows it, never a secret: `celery:<task>@<queue>`; the tree's own
    webhook's URL without its query nor the user and password before its host (either may carry a token); an
    operator's sink (`n0`, ...) or the creating key's webhook (`k0`, ...) by its number and its scheme and host
    alone, as `notify:n0 https://host` or `key:k0 https://host`. Those are the operator's, and their path may be
    the credential (a Slack incoming webhook's is): a tree's readers, any tenant's, must not learn it."""
    if target.get("kind") == "celery":
        return f"celery:{target.get('task')}@{target.get('queue')}"
    parts = urlsplit(str(target.get("url") or ""))
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address, bracketed again
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    if hook[:1] in ("n", "k"):
        return f"{'notify' if hook[0] == 'n' else 'key'}:{hook} {urlunsplit((parts.scheme, host, '', '', ''))}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
