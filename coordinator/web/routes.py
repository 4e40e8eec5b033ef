"""The web view's routes under /ui: pages rendered on the server, a fragment, events, actions.

    GET  /ui/                          the roots: history with filters by status, text, date; paged
    GET  /ui/tasks/{id}                a tree: every task, its plan, figures, approvals; live
    GET  /ui/tasks/{id}/fragment       the same tree as an HTML fragment (what the page swaps in)
    GET  /ui/tasks/{id}/events         the tree's event stream (SSE), as GET /v1/tasks/{id}/events
    GET  /ui/tasks/{id}/conversation   a task's UI messages and model conversation
    POST /ui/actions/tasks/{id}/cancel        {reason}: cancel a subtree
    POST /ui/actions/tasks/{id}/retry         {failed?}: retry a failed task (with failed: its tree's failed tasks)
    POST /ui/actions/tasks/{id}/deliveries/{delivery}/redeliver   {}: send an outbound event again (scope operate)
    POST /ui/actions/approvals/{id}           {decision, feedback?}: approve or deny
    GET|POST /ui/login, POST /ui/logout

Pages answer errors as HTML pages with the API's status for the error; actions
answer JSON in the API's one error shape, which the page shows as it is.
Every page, fragment, stream and action is the signed-in key's (coordinator/web/auth.py),
checked by the API's own `Gate`: a tree the key may not read is a 404, and a
page offers only the actions the key's scopes allow (no Approve without `decide`; Cancel and
Retry only where the key may write the tree).
Handlers are plain `def`s where they call the Coordinator (synchronous Redis),
so they run in FastAPI's thread pool, as the API's do.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping
from functools import partial
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode, urlsplit

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sse_starlette import EventSourceResponse

from coordinator.access import Principal, Scope
from coordinator.api.auth import Gate, actor_of, too_many_attempts
from coordinator.api.control import DeliveryId
from coordinator.api.errors import UNAUTHORIZED, HttpError, status_of
from coordinator.api.events import KEEPALIVE_S, STREAM_ID_PATTERN, StreamThreads, check_event_id, tree_events
from coordinator.api.limits import RateLimiter, client_address
from coordinator.api.routes import TaskId
from coordinator.api.schemas import CancelInput, DecisionInput, ErrorBody
from coordinator.audit import Actor
from coordinator.errors import SubqError, ValidationError
from coordinator.inputs import RetryInput, visible_text
from coordinator.models import Approval, Delivery, Retried, TaskRecord, TaskStatus, format_usd
from coordinator.service import Coordinator
from coordinator.settings import Settings
from coordinator.tree import duration
from coordinator.web.auth import COOKIE, WebAuth
from coordinator.web.views import call_text, data_text, find_roots, parse_root_filter, read_tree

__all__ = ["WEB_PATH", "install_web"]

WEB_PATH = "/ui"
_HERE = Path(str(files("coordinator.web")))
# Conversations are shown whole; a model message longer than this is cut with a note,
# so one huge tool result cannot make the page unusable.
MAX_PART_CHARS = 20_000
# How a tree's event stream ends when its session was signed out, or its key revoked, while it was open.
SESSION_ENDED = ErrorBody(
    code=UNAUTHORIZED,
    message="The web session this stream was opened with has ended (signed out, or its key revoked or changed): "
    "sign in again at /ui/login",
    field=COOKIE,
)


def _templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=_HERE / "templates")
    templates.env.filters["usd"] = format_usd
    templates.env.filters["tokens"] = lambda n: f"{n:,}"
    templates.env.filters["when"] = _when
    templates.env.filters["call"] = call_text
    templates.env.filters["duration"] = duration
    templates.env.filters["data"] = data_text
    # Every value a page writes, through `visible_text` before autoescape: a prompt, a plan item or a model's
    # words with a bidi override or a zero-width character read as something other than they are.
    templates.env.finalize = _shown
    templates.env.globals["ui"] = WEB_PATH
    templates.env.globals["statuses"] = [s.value for s in TaskStatus]
    return templates


def _shown(value: object) -> object:
    """A page's value as it may be shown (text as `visible_text` writes it); markup and numbers as they are."""
    return visible_text(value) if type(value) is str else value


def _when(ts: float | None) -> str:
    if not ts:
        return ""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def install_web(app: FastAPI, coord: Coordinator, settings: Settings, auth_attempts: RateLimiter) -> None:
    """Serve the web view on `app` under /ui, behind SUBQ_API_TOKEN (see coordinator/web/auth.py).

    `auth_attempts` counts sign-ins per client address, shared with the API's wrong bearer tokens.
    """
    app.mount(f"{WEB_PATH}/static", StaticFiles(directory=_HERE / "static"), name="subq-static")
    web = _Web(coord, WebAuth(settings, coord), auth_attempts)
    router = APIRouter(prefix=WEB_PATH, include_in_schema=False)
    _page_routes(router, web)
    _live_routes(router, web)
    _action_routes(router, web)
    _sign_in_routes(router, web)
    app.include_router(router)


class _Web:
    """What every route of the web view shares: the Coordinator, the sign-in, the templates, the API's Gate."""

    def __init__(self, coord: Coordinator, auth: WebAuth, auth_attempts: RateLimiter) -> None:
        self.coord = coord
        self.auth = auth
        self.auth_attempts = auth_attempts
        self.templates = _templates()
        self.threads = StreamThreads()
        self.gate = Gate(coord, via="web")

    def page(
        self,
        request: Request,
        name: str,
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        key: Principal | None = None,
        **context: Any,
    ) -> HTMLResponse:
        context |= {"auth_on": not self.auth.disabled, "key": key, "can": _abilities(key)}
        return self.templates.TemplateResponse(request, name, context, status_code=status_code, headers=headers)

    def error_page(self, request: Request, exc: SubqError, key: Principal | None = None) -> HTMLResponse:
        return self.page(request, "error.html", status_of(exc), key=key, error=exc)

    def to_login(self, request: Request) -> RedirectResponse:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"{WEB_PATH}/login?{urlencode({'next': target})}", status_code=303)

    def signed_in_page(self, request: Request, name: str, gather: Callable[[Principal], dict[str, Any]]) -> Response:
        """The page `name` for the session's key, with what `gather` reads for it: a redirect to sign in
        without a session, and the error page (with the API's status) for an error `gather` raises."""
        key = self.auth.principal(request)
        if key is None:
            return self.to_login(request)
        try:
            context = gather(key)
        except SubqError as exc:
            return self.error_page(request, exc, key)
        return self.page(request, name, key=key, **context)

    def still_reads(self, request: Request, owner: str) -> bool:
        """Whether the request's session still names a key that may read a tree created by `owner`: a tree's
        event stream asks on each pass of its read loop, so a session signed out or revoked meanwhile is sent
        nothing more (one Redis read of the session a pass, about once a second while the tree is quiet)."""
        key = self.auth.principal(request)
        return key is not None and key.may_read(owner)

    def signed_in(self, request: Request) -> Principal:
        """For fragments, streams and actions: the session's key, or a JSON 401 on record (pages redirect).

        A refusal counts against the address's sign-in attempts, as a missing bearer token does: past
        the limit it is a 429, not recorded, so a flood of cookie-less requests cannot fill the log."""
        key = self.auth.principal(request)
        if key is None:
            address = client_address(request.scope)
            if wait_s := self.auth_attempts.wait_s(address):
                raise too_many_attempts(self.auth_attempts, wait_s)
            self.auth_attempts.take(address)
            target = f"{request.method} {request.url.path}"
            self.coord.record(Actor("", address, "web"), "refused", target, reason="not_signed_in")
            raise HttpError(401, UNAUTHORIZED, "Not signed in to the web view: sign in at /ui/login", field=COOKIE)
        return key

    async def sign_in(self, request: Request) -> Response:
        """POST /ui/login: the form's token checked (every attempt counted), the session cookie set, on record."""
        form = _form(await request.body())
        target = _local(form.get("next", ""))
        if not _same_origin(request):
            return self.page(request, "login.html", 403, next=target, refusal=CROSS_SITE_REFUSAL)
        if self.auth.disabled:
            return RedirectResponse(target, status_code=303)
        # Every attempt counts, the right token too: a guesser gets 10 a minute, not 10 wrong ones.
        if wait_s := self.auth_attempts.take(client_address(request.scope)):
            refusal = too_many_attempts(self.auth_attempts, wait_s)
            return self.page(request, "login.html", 429, next=target, refusal=refusal.message, headers=refusal.headers)
        address = client_address(request.scope)
        key = await anyio.to_thread.run_sync(self.auth.key_of_token, form.get("token", ""))
        if key is None:
            refused = Actor("", address, "web")
            await anyio.to_thread.run_sync(
                lambda: self.coord.record(refused, "refused", "POST /ui/login", reason="wrong_sign_in")
            )
            return self.page(
                request,
                "login.html",
                401,
                next=target,
                refusal="That is not the server's token, nor the token of any API key.",
            )
        response = RedirectResponse(target, status_code=303)
        await anyio.to_thread.run_sync(self.auth.sign_in, request, response, key)
        actor = Actor(key.name, address, "web")
        await anyio.to_thread.run_sync(lambda: self.coord.record(actor, "sign_in", "/ui"))
        return response


async def _json_body(content_type: Annotated[str, Header()] = "") -> None:
    """The actions' guard: a cross-site HTML form can only send form or text bodies; JSON needs a CORS preflight."""
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise HttpError(415, "unsupported_media_type", "Send the action as application/json", field="Content-Type")


def _page_routes(router: APIRouter, web: _Web) -> None:
    """The pages: without a session a redirect to sign in, an error as an HTML page with the API's status."""
    coord, gate = web.coord, web.gate

    @router.get("", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse(f"{WEB_PATH}/", status_code=307)

    @router.get("/", response_class=HTMLResponse)
    def roots(request: Request) -> Response:
        key = web.auth.principal(request)
        if key is None:
            return web.to_login(request)
        try:
            wanted = parse_root_filter(request.query_params)
            found = find_roots(coord, wanted, owner=gate.history_owner(request, key))
        except SubqError as exc:
            return web.error_page(request, exc, key)
        next_query = urlencode(wanted.query(found.next_cursor)) if found.next_cursor is not None else None
        # An operator sees each tenant's running, waiting and spend against its quotas (docs/tenants.md).
        tenants = coord.tenants() if key.has(Scope.OPERATE) else None
        return web.page(
            request, "roots.html", key=key, wanted=wanted, found=found, next_query=next_query, tenants=tenants
        )

    @router.get("/tasks/{task_id}", response_class=HTMLResponse)
    def tree_page(request: Request, task_id: TaskId) -> Response:
        def gather(key: Principal) -> dict[str, Any]:
            _no_query(request)
            owner = gate.read_tree(request, key, task_id)
            return {"tree": read_tree(coord, task_id), "task_id": task_id, "owner": owner}

        return web.signed_in_page(request, "tree.html", gather)

    @router.get("/tasks/{task_id}/conversation", response_class=HTMLResponse)
    def conversation(request: Request, task_id: TaskId) -> Response:
        def gather(key: Principal) -> dict[str, Any]:
            _no_query(request)
            gate.read_tree(request, key, task_id)
            return {
                "task": coord.get_task(task_id),
                "ui_messages": coord.messages(task_id, "ui"),
                "model_messages": [_readable(m) for m in coord.messages(task_id, "api")],
            }

        return web.signed_in_page(request, "conversation.html", gather)


def _live_routes(router: APIRouter, web: _Web) -> None:
    """What a tree's page fetches to stay live (its fragment, its event stream): a JSON 401 without a session."""
    coord, gate = web.coord, web.gate

    @router.get("/tasks/{task_id}/fragment", response_class=HTMLResponse)
    def tree_fragment(request: Request, task_id: TaskId, key: Principal = Depends(web.signed_in)) -> Response:
        _no_query(request)
        owner = gate.read_tree(request, key, task_id)
        return web.page(request, "tree_fragment.html", key=key, tree=read_tree(coord, task_id), owner=owner)

    @router.get("/tasks/{task_id}/events")
    async def events(
        request: Request,
        task_id: TaskId,
        last_event_id: Annotated[str | None, Header(pattern=STREAM_ID_PATTERN)] = None,
        key: Principal = Depends(web.signed_in),
    ) -> EventSourceResponse:
        _no_query(request)
        check_event_id(last_event_id)
        owner = await web.threads.run(gate.read_tree, request, key, task_id)
        await web.threads.run(coord.settled, task_id)  # an unknown id is a plain 404, not a broken stream
        still_allowed = partial(web.still_reads, request, owner)
        stream = tree_events(coord, web.threads, task_id, last_event_id or "0-0", still_allowed, SESSION_ENDED)
        return EventSourceResponse(stream, ping=KEEPALIVE_S)


def _action_routes(router: APIRouter, web: _Web) -> None:
    """The actions a page's buttons send: JSON in, the API's JSON (or its one error shape) out."""
    coord, gate = web.coord, web.gate

    @router.post("/actions/tasks/{task_id}/cancel", dependencies=[Depends(_json_body)])
    def cancel(
        request: Request, task_id: TaskId, body: CancelInput, key: Principal = Depends(web.signed_in)
    ) -> TaskRecord:
        owner = gate.write_tree(request, key, task_id, others=Scope.OPERATE)
        return gate.as_read_by(key, owner, coord.cancel(task_id, body.reason, actor=actor_of(request, key, "web")))

    @router.post("/actions/tasks/{task_id}/retry", dependencies=[Depends(_json_body)])
    def retry(
        request: Request, task_id: TaskId, body: RetryInput | None = None, key: Principal = Depends(web.signed_in)
    ) -> Retried:
        owner = gate.write_tree(request, key, task_id, others=Scope.OPERATE)
        failed = body.failed if body is not None else False
        done = coord.retry(task_id, failed=failed, actor=actor_of(request, key, "web"))
        return gate.as_read_by(key, owner, done)

    @router.post("/actions/tasks/{task_id}/deliveries/{delivery_id}/redeliver", dependencies=[Depends(_json_body)])
    def redeliver(
        request: Request, task_id: TaskId, delivery_id: DeliveryId, key: Principal = Depends(web.signed_in)
    ) -> Delivery:
        return gate.redeliver(request, key, task_id, delivery_id)

    @router.post("/actions/approvals/{approval_id}", dependencies=[Depends(_json_body)])
    def decide(
        request: Request, approval_id: str, body: DecisionInput, key: Principal = Depends(web.signed_in)
    ) -> Approval:
        gate.need(request, key, Scope.DECIDE)
        return coord.decide(approval_id, body.decision, body.feedback, actor=actor_of(request, key, "web"))


def _sign_in_routes(router: APIRouter, web: _Web) -> None:
    """Signing in with a token (the server's or an API key's) and out."""

    @router.get("/login", response_class=HTMLResponse)
    def login_form(request: Request, next: str = "") -> HTMLResponse:
        return web.page(request, "login.html", next=_local(next), refusal="")

    @router.post("/login", response_class=HTMLResponse)
    async def login(request: Request) -> Response:
        return await web.sign_in(request)

    @router.post("/logout")
    def logout(request: Request) -> Response:
        if not _same_origin(request):
            return web.page(request, "login.html", 403, next="", refusal=CROSS_SITE_REFUSAL)
        response = RedirectResponse(f"{WEB_PATH}/login", status_code=303)
        key = web.auth.sign_out(request, response)
        if key is not None and not web.auth.disabled:
            web.coord.record(actor_of(request, key, "web"), "sign_out", "/ui")
        return response


# A sign-in or sign-out another site's page sent: the browser would sign its user in to the other site's key
# (whose trees the user then reads and acts on as their own), or out.
CROSS_SITE_REFUSAL = "Signing in or out is done from this server's own page: another site's form was refused."


def _same_origin(request: Request) -> bool:
    """Whether a form post came from this server's own page: the browser's `Sec-Fetch-Site`, else its `Origin`
    against the request's `Host` (scheme aside: TLS may end at a proxy). A client that sends neither is no
    browser another site drives."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    return origin is None or urlsplit(origin).netloc.lower() == request.headers.get("host", "").lower()


def _abilities(key: Principal | None) -> dict[str, bool]:
    """What the page offers the signed-in key (the actions check again on the server)."""
    return {
        "decide": key is not None and key.has(Scope.DECIDE),
        "operate": key is not None and key.has(Scope.OPERATE),
        "submit": key is not None and key.has(Scope.SUBMIT),
    }


def _no_query(request: Request) -> None:
    """These pages take no query parameters: a stray one is a typo, refused as the API refuses it."""
    for name in request.query_params:
        raise ValidationError(f"{name}: unknown query parameter (this page takes none)", field=name)


def _local(target: str) -> str:
    """A place in the web view to go after signing in; anything else (another site) goes home."""
    if target.startswith(f"{WEB_PATH}/") and not target.startswith("//") and "\\" not in target:
        return target
    return f"{WEB_PATH}/"


def _form(body: bytes) -> Mapping[str, str]:
    # parse_qs, not FastAPI's Form(): that would need python-multipart for one field.
    return {name: values[0] for name, values in parse_qs(body.decode("utf-8", "replace")).items()}


def _readable(message: dict[str, Any]) -> dict[str, Any]:
    """A model message (pydantic-ai's JSON) as kind + parts of (part kind, text) for the page."""
    parts = []
    for part in message.get("parts", []):
        kind = str(part.get("part_kind", "part"))
        if "content" in part:
            content = part["content"]
            text = content if isinstance(content, str) else json.dumps(content, indent=1)
        elif "args" in part:
            args = part["args"]
            text = f"{part.get('tool_name', '')}({args if isinstance(args, str) else json.dumps(args)})"
        else:
            text = json.dumps(part)
        if kind == "tool-return":
            text = f"{part.get('tool_name', '')} → {text}"
        if len(text) > MAX_PART_CHARS:
            text = text[:MAX_PART_CHARS] + f"\n… ({len(text) - MAX_PART_CHARS} more characters)"
        parts.append({"kind": kind, "text": text})
    return {"kind": str(message.get("kind", "")), "parts": parts}
