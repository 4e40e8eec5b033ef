"""Who calls the /v1 endpoints, and what they may touch: bearer keys, scopes, tree ownership.

A request names its caller with `Authorization: Bearer <token>`: the token of a
key of SUBQ_API_KEYS or SUBQ_API_KEYS_FILE, or SUBQ_API_TOKEN (the key `admin`,
every scope); coordinator/access.py has the scopes and how the keys file is
taken up without a restart. Authentication is off only when
SUBQ_API_AUTH_DISABLED=true says so (the server logs a warning at start, and
every caller is `anonymous` with every scope); with no key at all and no such
setting, building the app fails with a ConfigError naming SUBQ_API_TOKEN, so a
server is never open by accident. `/livez`, `/readyz`, `/healthz`, `/metrics`,
`/openapi.json` and `/docs` stay open: they carry no task data.

`Gate` is what a route asks: `need` (a scope, or a 403 naming it), `read_tree`
(a tree the caller may not read is a 404, as if it did not exist), `write_tree`
(the caller's own tree with `submit`, or any with the scope that covers others').
Every refusal (401, 403) is on the audit log with its reason and counted.

A request that lasts (an event stream, /mcp's wait_task) asks again while it runs:
`key_now` looks its token up in the key ring as the keys are now (a `stat` of the
keys file, no Redis), so a key revoked or changed meanwhile stops being served.

Wrong and missing tokens are counted per client address (`auth_attempts`,
shared with the web view's sign-in): past SUBQ_API_AUTH_ATTEMPTS_PER_MIN the
address gets 429 for every request, the right token too, until its bucket
refills; otherwise a guesser would only have to wait for the one guess that
works, and a flood of token-less requests could fill the audit log.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Annotated, Any, NoReturn, TypeVar

import anyio.to_thread
from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Receive, Send
from starlette.types import Scope as ASGIScope

from coordinator.access import OPEN, KeyRing, Principal, Scope, parse_keys
from coordinator.api.errors import RATE_LIMITED, UNAUTHORIZED, HttpError, error_response
from coordinator.api.limits import RateLimiter, client_address, retry_after
from coordinator.audit import Actor, RefusalReason, Via
from coordinator.errors import ConfigError, ForbiddenError, NotFoundError, StoreError, SubqError
from coordinator.models import Approval, Delivery, Retried, TaskRecord
from coordinator.service import Coordinator
from coordinator.settings import GENERATE_HINT, PLACEHOLDER_SECRET, Settings

# What a change to a tree answers, shown by Gate.as_read_by.
Shown = TypeVar("Shown", TaskRecord, Retried, Delivery)

__all__ = [
    "AUTH_DISABLED_WARNING",
    "Caller",
    "Gate",
    "GuardFirst",
    "KeyRevoked",
    "actor_of",
    "bearer_auth",
    "bearer_credentials",
    "caller",
    "guarded",
    "key_now",
    "key_ring",
    "too_many_attempts",
]

logger = logging.getLogger("coordinator.api")

AUTH_DISABLED_WARNING = (
    "SUBQ_API_AUTH_DISABLED=true: the subq API accepts requests WITHOUT authentication; "
    "anyone who can reach it can create, read and delegate tasks. Set SUBQ_API_TOKEN instead outside development."
)
_CHALLENGE = {"WWW-Authenticate": "Bearer"}

Guard = Callable[..., Awaitable[Principal]]
# The routes a bearer key guards (/mcp guards its own, as it starts).
V1_PREFIX = "/v1/"


def too_many_attempts(limiter: RateLimiter, wait_s: float) -> HttpError:
    return HttpError(
        429,
        RATE_LIMITED,
        f"Too many wrong tokens or sign-ins from this address (SUBQ_API_AUTH_ATTEMPTS_PER_MIN={limiter.per_min}); "
        f"retry in {max(1, round(wait_s))} s",
        headers=retry_after(wait_s),
    )


def key_ring(settings: Settings) -> KeyRing | None:
    """The deployment's keys, or None when auth is explicitly disabled; a ConfigError when there is none."""
    if settings.api_auth_disabled:
        return None
    token = settings.api_token.get_secret_value() if settings.api_token is not None else ""
    if token == PLACEHOLDER_SECRET:
        raise ConfigError(
            f"Invalid setting SUBQ_API_TOKEN: {PLACEHOLDER_SECRET!r} is the example's placeholder, not a token; "
            f"{GENERATE_HINT}",
            field="SUBQ_API_TOKEN",
        )
    ring = KeyRing(parse_keys(settings.api_keys, "SUBQ_API_KEYS"), settings.api_keys_file, token or None)
    if ring.empty:
        raise ConfigError(
            "Invalid setting SUBQ_API_TOKEN: not set, and no SUBQ_API_KEYS or SUBQ_API_KEYS_FILE either. Set it to "
            "the bearer token clients must send (or give scoped keys), or set SUBQ_API_AUTH_DISABLED=true to run "
            "without authentication (development only)",
            field="SUBQ_API_TOKEN",
        )
    return ring


class KeyRevoked(SubqError):
    """The key a request began with was revoked, or given a new token, while the request ran."""

    code = UNAUTHORIZED


def _principal_of(ring: KeyRing, token: str) -> Principal | None:
    """The caller `token` names in the ring as it is now; None once its key is gone."""
    key = ring.find(token)
    return key.principal() if key is not None else None


def _open_access() -> Principal:
    return OPEN


def key_now(request: Request) -> Principal | None:
    """The request's caller as the keys are now (None: its key was revoked or its token changed).

    The guard names a caller once, as its request starts; a request that lasts (an event stream, /mcp's
    wait_task) asks this again while it runs. One `stat` of the keys file (read again only if it changed).
    """
    look_up = getattr(request.state, "key_now", None)
    return look_up() if callable(look_up) else None  # a request the guard never named: refused, never open


def actor_of(request: Request, key: Principal, via: Via = "api") -> Actor:
    """The caller of `request` as the audit log names it: the key, the client address, the face."""
    return Actor(key.name, client_address(request.scope), via)


def bearer_auth(settings: Settings, auth_attempts: RateLimiter, coord: Coordinator, ring: KeyRing | None) -> Guard:
    """The dependency that names the caller of a /v1 request (`request.state.principal`), or refuses it."""
    if ring is None:
        ignored = " (SUBQ_API_TOKEN is set and ignored)" if settings.api_token else ""
        logger.warning(AUTH_DISABLED_WARNING + ignored)

        async def open_access(request: Request) -> Principal:
            request.state.principal = OPEN
            request.state.key_now = _open_access
            return OPEN

        return open_access

    scheme = HTTPBearer(
        auto_error=False, description="An API key's token, or SUBQ_API_TOKEN: `Authorization: Bearer <token>`"
    )

    async def refuse(request: Request, reason: RefusalReason, message: str) -> HttpError:
        address = client_address(request.scope)
        auth_attempts.take(address)
        actor = Actor("", address, "api")
        target = f"{request.method} {request.url.path}"
        try:
            await anyio.to_thread.run_sync(lambda: coord.record(actor, "refused", target, reason=reason))
        except StoreError as exc:
            # A refusal stays a 401 while Redis is away: an anonymous caller was answered 503 with the store's
            # address in it, and learnt Redis was down before it had shown a key.
            logger.warning("subq api: the refusal of %s from %s is not audited: %s", target, address, exc)
        return HttpError(401, UNAUTHORIZED, message, field="Authorization", headers=_CHALLENGE)

    # A default, not Annotated: annotations are strings here (PEP 563), and FastAPI
    # resolves them in the module's namespace, where this closure's `scheme` is not.
    async def check(request: Request, credentials: HTTPAuthorizationCredentials | None = Security(scheme)) -> Principal:
        named = getattr(request.state, "principal", None)
        if isinstance(named, Principal):
            return named  # `GuardFirst` named the caller before FastAPI read the body
        address = client_address(request.scope)
        if wait_s := auth_attempts.wait_s(address):
            raise too_many_attempts(auth_attempts, wait_s)
        if credentials is None:
            raise await refuse(
                request,
                "missing_token",
                "Missing bearer token: send 'Authorization: Bearer <token>' (the server's SUBQ_API_TOKEN)",
            )
        # The keys file is stat'ed here (and read again only if it changed): a thread, not the event loop.
        key = await anyio.to_thread.run_sync(ring.find, credentials.credentials)
        if key is None:
            raise await refuse(request, "invalid_token", "Invalid bearer token")
        principal = key.principal()
        request.state.principal = principal
        request.state.key_now = partial(_principal_of, ring, credentials.credentials)
        return principal

    return check


def bearer_credentials(scope: ASGIScope) -> HTTPAuthorizationCredentials | None:
    """`Authorization: Bearer <token>` as FastAPI's HTTPBearer reads it; None when there is none."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            kind, _, token = value.decode("latin-1").partition(" ")
            if kind.lower() == "bearer" and token.strip():
                return HTTPAuthorizationCredentials(scheme=kind, credentials=token.strip())
    return None


async def guarded(guard: Guard, auth: bool, scope: ASGIScope, receive: Receive, send: Send) -> bool:
    """Run `guard` on a request from ASGI: True when it named the caller (`request.state.principal`); else the
    refusal is sent (401, 429) and False."""
    request = Request(scope, receive)
    try:
        await (guard(request, bearer_credentials(scope)) if auth else guard(request))
    except HttpError as exc:
        await error_response(exc.status_code, exc.code, exc.message, exc.field, exc.headers)(scope, receive, send)
        return False
    return True


class GuardFirst:
    """The /v1 routes' guard run before FastAPI reads the request: FastAPI parses a JSON body before it runs any
    dependency, so a body that is no JSON was answered 422 to a caller without a token, unaudited, uncounted
    against SUBQ_API_AUTH_ATTEMPTS_PER_MIN, and to an address locked out too. The routes' own `Depends(guard)`
    then finds the caller named (a route mounted without this middleware still guards itself)."""

    def __init__(self, app: ASGIApp, guard: Guard, auth: bool) -> None:
        self.app, self.guard, self.auth = app, guard, auth

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        guards = scope["type"] == "http" and scope["path"].startswith(V1_PREFIX)
        if guards and not await guarded(self.guard, self.auth, scope, receive, send):
            return
        await self.app(scope, receive, send)


def caller(request: Request) -> Principal:
    """The caller the guard named (every /v1 route runs the guard first)."""
    principal = getattr(request.state, "principal", None)
    if not isinstance(principal, Principal):  # a route mounted without the guard: refuse, never open
        raise HttpError(401, UNAUTHORIZED, "Not authenticated", field="Authorization", headers=_CHALLENGE)
    return principal


Caller = Annotated[Principal, Depends(caller)]


class Gate:
    """What a route asks before it acts: scopes, and whether the caller may read or change a tree."""

    def __init__(self, coord: Coordinator, via: Via = "api", record_unreadable: bool = True) -> None:
        self.coord = coord
        self.via: Via = via
        # A key asking for a tree it may not read is on record as a refusal (`not_found`): a model probing
        # ids is worth an operator's look (issue 41). /mcp records its own, naming the tool.
        self.record_unreadable = record_unreadable

    def needs(self, *scopes: Scope) -> Any:
        """`need` as a route's dependency: it runs before FastAPI's checks of the body's fields are answered, so a
        key without the scope is a 403 (on the audit log), not a 422 about a body it may not send at all. (A body
        that is no JSON at all is refused by FastAPI before any dependency: a 422 to a key that has a token.)"""

        def check(request: Request, key: Caller) -> None:
            self.need(request, key, *scopes)

        return Depends(check)

    def writes(self, others: Scope = Scope.ADMIN) -> Any:
        """`write_tree` of the path's `task_id` as a route's dependency (as `needs`: before the body's checks); it
        gives the tree's owner to a route that asks for it."""

        def check(request: Request, key: Caller, task_id: str) -> str:
            return self.write_tree(request, key, task_id, others)

        return Depends(check)

    def need(self, request: Request, key: Principal, *scopes: Scope, why: str = "") -> None:
        """Go on if `key` has one of `scopes` (admin has all); else a 403 naming them, on record."""
        if key.has_any(*scopes):
            return
        self.forbid(request, key, scopes, why)

    def forbid(self, request: Request, key: Principal, scopes: tuple[Scope, ...], why: str = "") -> NoReturn:
        """A 403 naming the scopes that would do, on record as the key's refusal."""
        names = " or ".join(f"'{s.value}'" for s in scopes)
        detail = f"needs scope {names}" + (f" ({why})" if why else "")
        target = f"{request.method} {request.url.path}"
        self.coord.record(actor_of(request, key, self.via), "refused", target, reason="missing_scope", detail=detail)
        raise ForbiddenError(f"The API key {key.name!r} lacks the scope this needs: {detail}", field="scope")

    def read_tree(self, request: Request, key: Principal, task_id: str) -> str:
        """The owner of the task's tree, if `key` may read it; a 404 as for an unknown task if not."""
        self.need(request, key, Scope.READ, Scope.READ_ALL)
        owner = self.coord.owner_of(task_id)
        self.readable_on_record(request, key, task_id, owner)
        return owner

    @staticmethod
    def still_reads(request: Request, owner: str) -> bool:
        """Whether the request's key, as the keys are now, may still read a tree created by `owner`: an event
        stream asks on each pass of its read loop, so a key revoked while it is open is sent nothing more."""
        key = key_now(request)
        return key is not None and key.may_read(owner)

    def readable_on_record(self, request: Request, key: Principal, task_id: str, owner: str) -> None:
        """`readable`, with a refused read on the audit log (unless this gate's face records its own)."""
        if self.record_unreadable and not key.may_read(owner):
            target = f"{request.method} {request.url.path}"
            detail = f"Unknown task: {task_id}"
            self.coord.record(actor_of(request, key, self.via), "refused", target, reason="not_found", detail=detail)
        self.readable(key, task_id, owner)

    @staticmethod
    def readable(key: Principal, task_id: str, owner: str) -> None:
        """A 404, as for an unknown task, unless `key` may read a tree created by `owner`."""
        if not key.may_read(owner):
            raise NotFoundError(f"Unknown task: {task_id}", field="task_id")

    def write_tree(self, request: Request, key: Principal, task_id: str, others: Scope = Scope.ADMIN) -> str:
        """Go on if `key` may change the task's tree: its own with `submit`, any with `others`; the tree's owner.

        A tree it may not read is a 404, as for an unknown task; one it may read but not change, a 403.
        """
        if others is Scope.ADMIN:
            self.need(request, key, Scope.SUBMIT)
        else:
            self.need(request, key, Scope.SUBMIT, others)
        owner = self.coord.owner_of(task_id)
        if key.has(others) or (key.has(Scope.SUBMIT) and key.owns(owner)):
            return owner
        self.readable_on_record(request, key, task_id, owner)  # a write probe of another key's tree is on record
        self.forbid(request, key, (others,), "scope 'submit' covers only the trees this key created")

    @staticmethod
    def as_read_by(key: Principal, owner: str, done: Shown) -> Shown:
        """What a change to a tree answers `key`: the whole record where it may read the tree, else the record
        without its content (`operate` changes any tree, and reads none)."""
        return done if key.may_read(owner) else done.without_content()

    def redeliver(self, request: Request, key: Principal, task_id: str, delivery_id: str) -> Delivery:
        """Send an outbound event again (scope `operate`, on the audit log), answered as `as_read_by` says: a key
        that may not read the tree gets its state and attempts, not its target nor its last answer. One for the
        API and the web view's button, whose own copy answered the delivery whole."""
        self.need(request, key, Scope.OPERATE)
        owner = self.coord.owner_of(task_id)
        done = self.coord.redeliver(task_id, delivery_id, actor=actor_of(request, key, self.via))
        return self.as_read_by(key, owner, done)

    def approvals(self, request: Request, key: Principal, root_id: str | None) -> list[Approval]:
        """The waiting calls `key` may see (of one root's tree, or all): every one with `decide` or `read_all`;
        with `read` alone, those of the trees it created (GET /v1/approvals, and /mcp's list_approvals)."""
        if key.has_any(Scope.DECIDE, Scope.READ_ALL):
            return self.coord.list_approvals(root_id)
        self.need(request, key, Scope.DECIDE, Scope.READ, Scope.READ_ALL)
        if root_id is not None:
            self.read_tree(request, key, root_id)
        owners: dict[str, str | None] = {}
        mine = []
        for approval in self.coord.list_approvals(root_id):
            if approval.root_id not in owners:
                owners[approval.root_id] = self._owner_or_none(approval.root_id)
            owner = owners[approval.root_id]
            if owner is not None and key.may_read(owner):
                mine.append(approval)
        return mine

    def _owner_or_none(self, root_id: str) -> str | None:
        """The tree's owner, or None when its root's record has lapsed (its child's call may still wait): such a
        tree is readable by no key but `read_all`'s, and its id must not reach another key in an error."""
        try:
            return self.coord.owner_of(root_id)
        except NotFoundError:
            return None

    def history_owner(self, request: Request, key: Principal) -> str | None:
        """Whose trees the caller's history shows: every tree (None) with read_all, else its own."""
        self.need(request, key, Scope.READ, Scope.READ_ALL)
        return None if key.has(Scope.READ_ALL) else key.name
