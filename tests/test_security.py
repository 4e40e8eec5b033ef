"""The API and the web view against a hostile network: sessions, rate limits, headers, escaping.

Against real uvicorn servers on a real Redis (each app with its own key prefix
and its own limits), no worker needed: what is checked here is what a client
on the network can do. The browser side (payloads in every field, on first
render and live) is tests/test_web_security.py.
"""

from __future__ import annotations

import html.parser
import io
import json
import re
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from rich.console import Console

from coordinator import Coordinator, Settings, budgets, ids, visible_text
from coordinator.access import ApiKeySpec, Scope, token_sha256
from coordinator.api.limits import RateLimiter, is_open_route
from coordinator.api.security import STRICT_CSP, csp_with_inline_scripts
from coordinator.audit import Actor
from coordinator.cli.live import tree_view
from coordinator.errors import ConfigError, ForbiddenError, NotFoundError, ValidationError
from coordinator.models import Approval, TaskRecord, Usage
from coordinator.settings import load_settings
from coordinator.web.auth import COOKIE
from coordinator.web.views import MAX_CALL_CHARS, call_text
from tests.helpers import AUTH, REQUEST_TIMEOUT_S, TOKEN, api_coordinator, api_server

PREFIX = "subqsec"
# A client address behind the trusted proxy: documentation range (RFC 5737), never dialled.
FORWARDED_FOR = "203.0.113.7"


@pytest.fixture(scope="module")
def sec_coord(settings: Settings) -> Iterator[Coordinator]:
    with api_coordinator(settings, PREFIX, "subq-sec-idle") as coord:
        yield coord


_server = api_server


def _sign_in(http: httpx.Client, token: str = TOKEN, **headers: str) -> httpx.Response:
    return http.post("/ui/login", data={"token": token, "next": "/ui/"}, headers=headers)


def _sessions(coord: Coordinator) -> list[str]:
    return sorted(coord.client.scan_iter(f"{PREFIX}:web-session:*"))


# -- sessions ------------------------------------------------------------------------------


def test_each_sign_in_is_its_own_session_and_sign_out_revokes_it(sec_coord: Coordinator) -> None:
    root = sec_coord.create_task("Session test", run=False).id
    with (
        _server(sec_coord) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as first,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as second,
    ):
        before = _sessions(sec_coord)
        assert _sign_in(first).status_code == 303 and _sign_in(second).status_code == 303
        one, two = first.cookies[COOKIE], second.cookies[COOKIE]
        assert one != two and len(one) >= 40
        # Redis holds a hash of each id, never the id (nor the token).
        stored = set(_sessions(sec_coord)) - set(before)
        assert len(stored) == 2 and not any(one in key or two in key for key in stored)
        assert all(sec_coord.client.get(key) not in (TOKEN, one, two) for key in stored)
        fragment = f"/ui/tasks/{root}/fragment"
        assert first.get(fragment).status_code == 200 and second.get(fragment).status_code == 200
        # Signing out revokes the server's session: the old cookie, replayed, is refused.
        assert first.post("/ui/logout").status_code == 303
        replayed = httpx.get(f"{api.url}{fragment}", cookies={COOKIE: one}, timeout=REQUEST_TIMEOUT_S)
        assert replayed.status_code == 401 and replayed.json()["code"] == "unauthorized"
        page = httpx.get(f"{api.url}/ui/tasks/{root}", cookies={COOKIE: one}, timeout=REQUEST_TIMEOUT_S)
        assert page.status_code == 303 and page.headers["location"].startswith("/ui/login")
        # The other sign-in is untouched.
        assert second.get(fragment).status_code == 200
        assert len(set(_sessions(sec_coord)) - set(before)) == 1


def test_a_changed_token_revokes_every_session(sec_coord: Coordinator) -> None:
    root = sec_coord.create_task("Token change", run=False).id
    with _server(sec_coord) as api, httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http:
        assert _sign_in(http).status_code == 303
        cookie = http.cookies[COOKIE]
        assert http.get(f"/ui/tasks/{root}/fragment").status_code == 200
    # The same Redis, a server restarted with a new SUBQ_API_TOKEN: the session is gone.
    with _server(sec_coord, api_token=SecretStr("a-new-token-9d1e")) as api:
        refused = httpx.get(f"{api.url}/ui/tasks/{root}/fragment", cookies={COOKIE: cookie}, timeout=REQUEST_TIMEOUT_S)
        assert refused.status_code == 401


def test_made_up_and_oversized_cookies_are_refused(sec_coord: Coordinator) -> None:
    root = sec_coord.create_task("Forged", run=False).id
    with _server(sec_coord) as api:
        for forged in ("x", "A" * 43, "A" * 5000, ""):
            response = httpx.get(
                f"{api.url}/ui/tasks/{root}/fragment", cookies={COOKIE: forged}, timeout=REQUEST_TIMEOUT_S
            )
            assert response.status_code == 401, forged


def test_the_cookie_is_secure_when_the_deployment_says_https(sec_coord: Coordinator) -> None:
    def cookie_header(http: httpx.Client, **headers: str) -> str:
        response = _sign_in(http, **headers)
        assert response.status_code == 303
        return response.headers["set-cookie"].lower()

    with _server(sec_coord) as api, httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http:
        assert "secure" not in cookie_header(http)
        # Not from a proxy it trusts: the forwarded scheme is ignored.
        assert "secure" not in cookie_header(http, **{"X-Forwarded-Proto": "https"})
    with _server(sec_coord, api_https=True) as api, httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http:
        assert "; secure" in cookie_header(http)
        assert "max-age=" in http.get("/ui/login").headers["strict-transport-security"]
    with (
        _server(sec_coord, api_trusted_proxies="127.0.0.1") as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
    ):
        assert "; secure" in cookie_header(http, **{"X-Forwarded-Proto": "https"})
        assert "secure" not in cookie_header(http, **{"X-Forwarded-Proto": "http"})


# -- rate limits -----------------------------------------------------------------------------


def test_sign_ins_are_rate_limited_per_client_address(sec_coord: Coordinator) -> None:
    with (
        _server(sec_coord, api_auth_attempts_per_min=3, api_trusted_proxies="127.0.0.1") as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
    ):
        for _ in range(3):
            assert _sign_in(http, token="wrong").status_code == 401
        before = _sessions(sec_coord)
        # Past the limit even the right token is refused, with a clear 429, and no session is made.
        limited = _sign_in(http)
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert "Too many wrong tokens or sign-ins from this address" in limited.text
        assert "SUBQ_API_AUTH_ATTEMPTS_PER_MIN=3" in limited.text
        assert COOKIE not in http.cookies and _sessions(sec_coord) == before
        # Another client address (through the trusted proxy) has its own count.
        assert _sign_in(http, **{"X-Forwarded-For": FORWARDED_FOR}).status_code == 303
    # From a peer that is not a trusted proxy, X-Forwarded-For changes nothing.
    with (
        _server(sec_coord, api_auth_attempts_per_min=2) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
    ):
        for n in range(2):
            assert _sign_in(http, token="wrong", **{"X-Forwarded-For": f"198.51.100.{n}"}).status_code == 401
        assert _sign_in(http, **{"X-Forwarded-For": FORWARDED_FOR}).status_code == 429


def test_wrong_bearer_tokens_are_rate_limited(sec_coord: Coordinator) -> None:
    with _server(sec_coord, api_auth_attempts_per_min=3) as api:
        wrong = {"Authorization": "Bearer not-the-token"}
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http:
            assert http.get("/v1/tasks", headers=AUTH).status_code == 200
            for _ in range(3):
                assert http.get("/v1/tasks", headers=wrong).status_code == 401
            for headers in (wrong, AUTH):  # the right token too, until the bucket refills
                limited = http.get("/v1/tasks", headers=headers)
                assert limited.status_code == 429 and limited.json()["code"] == "rate_limited"
                assert int(limited.headers["retry-after"]) >= 1
            # A missing token counts as a wrong one: each refusal is on the audit log, so a flood of
            # token-less requests is bounded as guesses are.
            assert http.get("/v1/tasks").status_code == 429


def test_open_routes_are_rate_limited(sec_coord: Coordinator) -> None:
    with (
        _server(sec_coord, api_open_requests_per_min=5) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
    ):
        codes = [http.get("/openapi.json").status_code for _ in range(7)]
        assert codes[:5] == [200] * 5 and codes[5:] == [429, 429]
        limited = http.get("/ui/login")
        assert limited.status_code == 429 and limited.json()["code"] == "rate_limited"
        assert "SUBQ_API_OPEN_REQUESTS_PER_MIN=5" in limited.json()["message"]
        # The token's routes are not counted against the open ones.
        assert http.get("/v1/tasks", headers=AUTH).status_code == 200


def test_the_rate_limiter_refills_and_forgets() -> None:
    limiter = RateLimiter(per_min=60, max_clients=2)
    assert [limiter.take("a", now_s=0) for _ in range(60)] == [0.0] * 60
    assert limiter.take("a", now_s=0) == pytest.approx(1.0)  # one a second comes back
    assert limiter.wait_s("a", now_s=0.5) == pytest.approx(0.5)
    assert limiter.take("a", now_s=1.0) == 0.0
    limiter.take("b", now_s=1.0)
    limiter.take("c", now_s=1.0)  # three addresses, room for two: "a" is forgotten
    assert limiter.wait_s("a", now_s=1.0) == 0.0


@pytest.mark.parametrize(
    ("path", "is_open"),
    [
        ("/healthz", True),
        ("/metrics", True),
        ("/docs", True),
        ("/ui/login", True),
        ("/ui/static/subq.js", True),
        ("/v1/tasks", False),
        ("/v1", False),
        ("/ui/", False),
        ("/ui/tasks/x/fragment", False),
    ],
)
def test_which_routes_count_as_open(path: str, is_open: bool) -> None:
    assert is_open_route(path) is is_open


# -- headers ---------------------------------------------------------------------------------


def test_every_response_carries_the_security_headers(sec_coord: Coordinator) -> None:
    root = sec_coord.create_task("Headers", run=False).id
    with _server(sec_coord) as api, httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http:
        assert _sign_in(http).status_code == 303
        paths = [
            "/ui/",
            "/ui/login",
            f"/ui/tasks/{root}",
            f"/ui/tasks/{root}/fragment",
            f"/ui/tasks/{root}/conversation",
            "/ui/tasks/nope",
            "/ui/static/subq.js",
            "/healthz",
            "/metrics",
            "/openapi.json",
            "/docs",
            "/redoc",
        ]
        for path in paths:
            response = http.get(path, headers=AUTH if path.startswith("/v1") else None)
            headers = response.headers
            csp = headers["content-security-policy"]
            script_src = re.search(r"script-src ([^;]*)", csp)
            assert script_src and "unsafe-inline" not in script_src.group(1), (path, csp)
            assert "frame-ancestors 'none'" in csp, path
            assert headers["x-content-type-options"] == "nosniff", path
            assert headers["referrer-policy"] == "same-origin", path
            assert headers["x-frame-options"] == "DENY", path
            if path.startswith("/ui/") and "static" not in path:
                assert headers["cache-control"] == "no-store", path
                assert csp == STRICT_CSP, path
        api_response = http.get("/v1/tasks", headers=AUTH)
        assert api_response.headers["content-security-policy"] == STRICT_CSP


def test_the_docs_pages_allow_only_their_own_inline_script() -> None:
    page = b"<script src='/a.js'></script><script>\nconst ui = 1;\n</script>"
    csp = csp_with_inline_scripts(page)
    assert "'sha256-" in csp and "unsafe-inline'; img-src" in csp  # inline styles only (ReDoc)
    assert csp_with_inline_scripts(page.replace(b"1", b"2")) != csp


# -- escaping ----------------------------------------------------------------------------------


def _approval(**args: Any) -> Approval:
    return Approval.model_validate(
        {
            "id": "a1",
            "root_id": "r",
            "task_id": "r",
            "tool": "run_command",
            "args": args,
            "tool_call_id": "c1",
            "created_at": 0,
            "deadline": 1,
        }
    )


def test_a_call_reads_as_exactly_what_it_is() -> None:
    assert call_text(_approval(command="make deploy")) == 'run_command(command="make deploy")'
    # A quote, a new line or an attempt to end the call early stays inside its JSON string.
    sneaky = call_text(_approval(command='ls")\n\nApprove run_command(command="ls'))
    assert sneaky == 'run_command(command="ls\\")\\n\\nApprove run_command(command=\\"ls")'
    # Characters that reorder or hide text are shown as escapes.
    assert (
        call_text(_approval(command="echo \u202eplh.exe\u200b")) == 'run_command(command="echo \\u202eplh.exe\\u200b")'
    )
    assert call_text(_approval(path="café", n=3)) == 'run_command(path="café", n=3)'
    # Printable characters drawn as nothing: 256 variation selectors, one per byte, carry any bytes after a URL
    # that reads as the URL alone; a Hangul filler reads as a space.
    hidden = "".join(chr(0xFE00 + b) if b < 16 else chr(0xE0100 + b - 16) for b in b"AWS_KEY=abc")
    smuggled = call_text(_approval(url=f"https://example.com/{hidden}", path="/tmp/\u3164x"))
    assert smuggled.startswith('run_command(url="https://example.com/\\U000e0131\\U000e0147'), smuggled
    assert smuggled.endswith('path="/tmp/\\u3164x")'), smuggled
    long = call_text(_approval(command="x" * 5000))
    assert len(long) < MAX_CALL_CHARS + 60 and long.endswith("more characters not shown)")
    # An MCP tool takes any argument names its model sends: a name that is no identifier is written as JSON too.
    named = call_text(_approval(**{'path="/tmp/scratch")\n\nand after it: run_command(note': "x", "path": "/etc"}))
    assert named == 'run_command("path=\\"/tmp/scratch\\")\\n\\nand after it: run_command(note"="x", path="/etc")'


def test_every_character_unicode_draws_as_nothing_is_shown_as_its_escape() -> None:
    """Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties), each range: none reaches a page, a terminal or
    a Slack line as itself, whether Python counts it printable (a variation selector) or not (a bidi mark)."""
    ignorable = [
        (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F),
        (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
        (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
    ]  # fmt: skip
    for first, last in ignorable:
        for code in range(first, last + 1):
            assert visible_text(chr(code)) == ascii(chr(code))[1:-1], hex(code)
    assert visible_text("café ✓ 日本語 👍🏽 e\u0301") == "café ✓ 日本語 👍🏽 e\u0301", "what shows stays as it is"


class _Markup(html.parser.HTMLParser):
    """Every element and attribute of a page, as a browser's parser would see them."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attributes: list[tuple[str, str]] = []
        self.call_texts: list[str] = []
        self.svg_classes: list[str] = []  # the timeline draws its bars as SVG; any other SVG came from text
        self._in_call = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag == "svg":
            self.svg_classes.append(dict(attrs).get("class") or "")
        self.attributes += [(name, value or "") for name, value in attrs]
        self._in_call = tag == "pre" and ("class", "call") in attrs

    def handle_data(self, data: str) -> None:
        if self._in_call:
            self.call_texts.append(data)

    def handle_endtag(self, tag: str) -> None:
        self._in_call = False


PAYLOAD = (
    "\" autofocus onfocus=alert(1) x=\" ' onmouseover=alert(2) y=' "
    "<img src=x onerror=alert(3)></script><script>alert(4)</script><svg onload=alert(5)> javascript:alert(6)"
)


def test_a_hostile_approval_renders_as_text(sec_coord: Coordinator) -> None:
    """The finding of c440522: tool arguments broke out of the Approve button's attribute."""
    root = sec_coord.create_task(PAYLOAD, todos=f"[ ] {PAYLOAD}", run=False)
    approval = Approval(  # as a worker parks a risky call
        id=ids.new_approval_id(root.id),
        task_id=root.id,
        root_id=root.id,
        tool="run_command",
        args={"command": PAYLOAD},
        tool_call_id="call-1",
        todo_content=PAYLOAD,
        created_at=time.time(),
        deadline=time.time() + 600,
    )
    sec_coord.store.approvals.save_approval(approval)
    with _server(sec_coord) as api, httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http:
        assert _sign_in(http).status_code == 303
        for path in (f"/ui/tasks/{root.id}", f"/ui/tasks/{root.id}/fragment", f"/ui/tasks/{root.id}/conversation"):
            page = http.get(path)
            assert page.status_code == 200
            markup = _Markup()
            markup.feed(page.text)
            assert markup.tags.count("script") == (1 if path.endswith(root.id) else 0), path  # subq.js alone
            assert "img" not in markup.tags and set(markup.svg_classes) <= {"tl-bar", "tl-swatch"}, path
            handlers = [name for name, _ in markup.attributes if name.startswith("on") or name == "autofocus"]
            assert handlers == [], (path, handlers)
            assert not any(value.lower().startswith("javascript:") for _, value in markup.attributes), path
            if path.endswith("fragment"):
                assert markup.call_texts == [call_text(approval)]
        assert sec_coord.store.approvals.get_approval(approval.id).status == "pending"


def test_an_id_with_a_trailing_new_line_is_no_id() -> None:
    """`$` matches before a final new line: an id pattern ends with `\\Z`, so `<id>\\n` is not an id."""
    root = ids.new_root_id()
    child = ids.new_child_id(root)
    assert ids.is_task_id(child) and not ids.is_task_id(f"{child}\n") and not ids.is_task_id(f"{root}\n")
    with pytest.raises(NotFoundError, match="not a subq task"):
        ids.root_of(f"{child}\n")


def test_a_models_terminal_escapes_are_text_in_the_cli(sec_coord: Coordinator) -> None:
    """A plan item or an error with ESC sequences (clear the screen, write the clipboard) prints as text."""
    from tests.test_cli import cli

    clear, clipboard = "\x1b[2J\x1b[H", "\x1b]52;c;cm0gLXJmIC8=\x07"
    root = sec_coord.create_task(f"Release {clear}", todos=f"[ ] Deploy {clipboard} now\r[x] done", run=False)
    sec_coord.cancel(root.id, f"stopped {clear}by a model")
    env = {"SUBQ_REDIS_URL": str(sec_coord.settings.redis_url), "SUBQ_KEY_PREFIX": PREFIX}
    commands = (
        ["tree", root.id], ["tree", root.id, "--timeline", "--width", "120"], ["todos", root.id], ["status", root.id],
        ["history", "--root", root.id],
    )  # fmt: skip
    for command in commands:
        proc = cli(*command, env=env)
        assert proc.returncode == 0, (command, proc.stderr)
        assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout and "\r" not in proc.stdout, command
    tree = cli("tree", root.id, env=env).stdout
    assert "Deploy \\x1b]52;c;cm0gLXJmIC8=\\x07 now" in tree and "stopped \\x1b[2J\\x1b[Hby a model" in tree


def test_a_models_terminal_escapes_are_text_in_the_followed_view(sec_coord: Coordinator) -> None:
    """`subq run --follow` on a terminal draws the tree live: its descriptions, errors and plan items as text."""
    clear, clipboard = "\x1b[2J\x1b[H", "\x1b]52;c;cm0gLXJmIC8=\x07"
    root = sec_coord.create_task(f"Release {clear}", todos=f"[ ] Deploy {clipboard} now", run=False)
    sec_coord.cancel(root.id, f"stopped {clear}by a model")
    drawn = io.StringIO()
    Console(file=drawn, width=200, color_system=None).print(tree_view(sec_coord.tree(root.id), {}, [], width=200))
    assert "\x1b" not in drawn.getvalue() and "\x07" not in drawn.getvalue(), repr(drawn.getvalue())
    assert "Release \\x1b[2J" in drawn.getvalue() and "Deploy \\x1b]52;" in drawn.getvalue()


# -- scoped API keys and the audit log -------------------------------------------------------------

# Each key's token; the server holds only their SHA-256 (coordinator/access.py).
KEY_TOKENS = {
    "alice": "alice-token-7c1e",  # submit + read: her own trees
    "bob": "bob-token-02af",  # submit + read: his own trees
    "carol": "carol-token-9b44",  # decide + read_all: decides any call, reads every tree
    "ops": "ops-token-51d0",  # operate: cancels any tree, dead letters, the audit log
    "viewer": "viewer-token-e3a8",  # read_all only
}
KEY_SCOPES = {
    "alice": ["submit", "read"],
    "bob": ["submit", "read"],
    "carol": ["decide", "read_all"],
    "ops": ["operate"],
    "viewer": ["read_all"],
}


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY_TOKENS[name]}"}


def keys_setting(names: Iterable[str] = KEY_SCOPES) -> dict[str, ApiKeySpec]:
    """The keys as SUBQ_API_KEYS holds them: hashes and scopes, never a token."""
    return {
        name: ApiKeySpec(token_sha256=token_sha256(KEY_TOKENS[name]), scopes=[Scope(s) for s in KEY_SCOPES[name]])
        for name in names
    }


def park_approval(coord: Coordinator, root_id: str) -> Approval:
    """A tool call of the root waiting for a decision, as a worker parks one."""
    approval = Approval(
        id=ids.new_approval_id(root_id),
        task_id=root_id,
        root_id=root_id,
        tool="run_command",
        args={"command": "make deploy"},
        tool_call_id=f"call-{time.monotonic_ns()}",
        created_at=time.time(),
        deadline=time.time() + 600,
    )
    coord.store.approvals.save_approval(approval)
    return approval


def _audit(http: httpx.Client, name: str = "ops", **params: Any) -> list[dict[str, Any]]:
    response = http.get("/v1/audit", headers=bearer(name), params=params)
    assert response.status_code == 200, response.text
    entries: list[dict[str, Any]] = response.json()["entries"]
    return entries


def test_one_keys_flood_of_refusals_cannot_push_the_other_entries_off_the_audit_log(sec_coord: Coordinator) -> None:
    """Every 403 and refused read of an authenticated key was an entry, at any rate: a `read` key's 100,000 refused
    requests pushed every other tenant's cancels and approvals past the log's cap. Now a key's refusals are logged
    up to REFUSALS_LOGGED_PER_MIN a minute, then one entry says the rest are counted alone; they all count."""
    from coordinator.audit import REFUSALS_LOGGED_PER_MIN

    counted_before = sec_coord.refused_counts().get("missing_scope", 0)
    if time.time() % 60 > 50:  # the window is the clock's minute: the flood must fall inside one
        time.sleep(60.5 - time.time() % 60)
    flood, other = Actor("mallory", "192.0.2.9", "api"), Actor("carol", "192.0.2.7", "api")
    for n in range(REFUSALS_LOGGED_PER_MIN + 20):
        sec_coord.record(flood, "refused", f"POST /v1/tasks#{n}", reason="missing_scope", detail="needs scope 'submit'")
    sec_coord.record(other, "refused", "POST /v1/tasks", reason="missing_scope", detail="needs scope 'submit'")
    sec_coord.record(flood, "cancel", "t-kept", detail="a step of its own is always logged")
    entries, _ = sec_coord.audit(limit=500)
    floods = [e for e in entries if e.actor == "mallory" and e.action == "refused"]
    assert len(floods) == REFUSALS_LOGGED_PER_MIN + 1, len(floods)
    assert floods[0].detail.startswith(f"more than {REFUSALS_LOGGED_PER_MIN} refusals this minute")
    assert floods[0].target == f"POST /v1/tasks#{REFUSALS_LOGGED_PER_MIN}"
    assert [e.actor for e in entries[:2]] == ["mallory", "carol"] and entries[0].action == "cancel"
    assert sec_coord.refused_counts()["missing_scope"] == counted_before + REFUSALS_LOGGED_PER_MIN + 21


def test_a_history_filtered_by_another_keys_root_reads_none_of_its_records(
    sec_coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page is empty either way, but it was made by reading each record of the tree, then dropping it on its
    owner: the time taken told a `read` key how big another key's tree was, and let it make the server read it."""
    root = sec_coord.create_task("Alice's tree", owner="alice").id
    sec_coord.delegate(root, [{"description": f"part {n}", "message": "m"} for n in range(5)])
    read: list[str] = []
    get_task = sec_coord.store.records.get_task

    def counted(task_id: str) -> TaskRecord:
        read.append(task_id)
        return get_task(task_id)

    monkeypatch.setattr(sec_coord.store.records, "get_task", counted)
    assert sec_coord.list_tasks(root_id=root, owner="bob") == ([], None)
    assert sec_coord.list_tasks(root_id=ids.new_root_id(), owner="bob") == ([], None)
    assert read == []
    items, _ = sec_coord.list_tasks(root_id=root, owner="alice")
    assert len(items) == 6 and len(read) == 6, "its own key's history reads them"


@pytest.mark.parametrize("face", ["api", "web"])
def test_an_operate_keys_redelivery_answers_where_the_delivery_stands_not_where_it_goes(
    sec_coord: Coordinator, face: str
) -> None:
    """`operate` changes any tree and reads none: a redelivery of another key's tree answered the delivery whole,
    its target URL's path and the receiver's last answer among it. Now it answers its state and attempts, over
    the API and from the web view's button alike (the web's answered it whole after the API's was mended)."""
    root = sec_coord.create_task(
        "Bob's tree", owner="bob", webhooks=[{"url": "https://bob-receiver.invalid/hooks/B0B-S3CRET"}]
    )
    assert sec_coord.store.outbox.add_event(root.id, root.id, "budget.warning", {"share": 0.8}) == 1
    (delivery,) = sec_coord.deliveries(root.id)
    sec_coord.store.outbox.settle(root.id, delivery.id, "retrying", last="HTTP 503 Bob's receiver says no")
    with _server(sec_coord, api_keys=keys_setting()) as api, api.client() as http:
        if face == "api":
            url = f"/v1/tasks/{root.id}/deliveries/{delivery.id}/redeliver"
            assert http.post(url, headers=bearer("alice")).status_code == 403, "submit and read: not another's tree"
            answer = http.post(url, headers=bearer("ops"))
        else:
            url = f"/ui/actions/tasks/{root.id}/deliveries/{delivery.id}/redeliver"
            assert _sign_in(http, KEY_TOKENS["ops"]).status_code == 303
            answer = http.post(url, json={})
        assert answer.status_code == 200, answer.text
        assert (answer.json()["id"], answer.json()["state"], answer.json()["target"], answer.json()["last"]) == (
            delivery.id,
            "pending",
            "",
            "",
        )
        assert "B0B-S3CRET" not in answer.text and "Bob's receiver" not in answer.text
    (again,) = sec_coord.deliveries(root.id)
    assert again.target == "https://bob-receiver.invalid/hooks/B0B-S3CRET", "the tree's own readers still see it"


def test_scoped_keys_over_http(sec_coord: Coordinator) -> None:
    """The acceptance of issue 32, point 3 and 4, over real HTTP against a real Redis."""
    with (
        _server(sec_coord, api_keys=keys_setting()) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
    ):
        created = http.post("/v1/tasks", headers=bearer("alice"), json={"prompt": "Alice's tree", "todos": "[ ] a"})
        assert created.status_code == 201 and created.json()["owner"] == "alice"
        root = created.json()["id"]
        assert http.get(f"/v1/tasks/{root}", headers=bearer("alice")).status_code == 200

        # Another key of the same scopes: the tree does not exist for it, word for word as an unknown id.
        unknown = ids.new_root_id()
        for path in (f"/v1/tasks/{root}", f"/v1/tasks/{root}/todos", f"/v1/tasks/{root}/tree"):
            hidden = http.get(path, headers=bearer("bob"))
            missing = http.get(path.replace(root, unknown), headers=bearer("bob"))
            assert hidden.status_code == 404, path
            assert hidden.json() == {**missing.json(), "message": missing.json()["message"].replace(unknown, root)}
        for method, path, body in (
            ("GET", f"/v1/tasks/{root}/messages", None),
            ("GET", f"/v1/tasks/{root}/snapshot", None),
            ("GET", f"/v1/tasks/{root}/finishing", None),
            ("GET", f"/v1/tasks/{root}/events", None),
            ("PUT", f"/v1/tasks/{root}/todos", {"todos": "[ ] b"}),
            ("POST", f"/v1/tasks/{root}/subtasks", {"subtasks": [{"description": "d", "message": "m"}]}),
            ("POST", f"/v1/tasks/{root}/cancel", {"reason": "bob's"}),
        ):
            assert http.request(method, path, headers=bearer("bob"), json=body).status_code == 404, path
        assert sec_coord.get_task(root).status.value == "active", "bob changed nothing"
        bob_history = http.get("/v1/tasks", headers=bearer("bob"), params={"root_id": root}).json()
        assert bob_history["items"] == []
        alice_history = http.get("/v1/tasks", headers=bearer("alice"), params={"root_id": root}).json()
        assert [item["id"] for item in alice_history["items"]] == [root]

        # Alice may not decide a call of her own tree: a 403 that names the scope.
        approval = park_approval(sec_coord, root)
        assert [a["id"] for a in http.get("/v1/approvals", headers=bearer("alice")).json()["approvals"]] == [
            approval.id
        ]
        assert http.get("/v1/approvals", headers=bearer("bob")).json()["approvals"] == []
        refused = http.post(f"/v1/approvals/{approval.id}", headers=bearer("alice"), json={"decision": "approve"})
        assert refused.status_code == 403 and refused.json()["code"] == "forbidden"
        assert "'decide'" in refused.json()["message"] and "alice" in refused.json()["message"]
        assert sec_coord.store.approvals.get_approval(approval.id).status == "pending"

        # A decide + read_all key decides it; the approval names who did.
        decided = http.post(f"/v1/approvals/{approval.id}", headers=bearer("carol"), json={"decision": "approve"})
        assert decided.status_code == 200 and decided.json()["decided_by"] == "carol"
        assert sec_coord.store.approvals.get_approval(approval.id).decided_by == "carol"
        assert http.get(f"/v1/tasks/{root}", headers=bearer("carol")).status_code == 200

        # ... and the audit log lists it, newest first, with who, what, which target and from where.
        assert http.get("/v1/audit", headers=bearer("alice")).status_code == 403
        assert http.get("/v1/audit", headers=bearer("carol")).status_code == 403
        entries = _audit(http)
        approve = next(e for e in entries if e["action"] == "approve")
        assert (approve["actor"], approve["target"], approve["address"], approve["via"]) == (
            "carol",
            approval.id,
            "127.0.0.1",
            "api",
        )
        refusal = next(
            e for e in entries if e["actor"] == "alice" and e["target"] == f"POST /v1/approvals/{approval.id}"
        )
        assert (refusal["action"], refusal["reason"]) == ("refused", "missing_scope")
        assert "'decide'" in refusal["detail"]
        assert [e["id"] for e in entries] == sorted((e["id"] for e in entries), key=_entry_order, reverse=True)

        # Cancel: not with read_all alone, and any tree with operate (on record as the key's).
        assert http.post(f"/v1/tasks/{root}/cancel", headers=bearer("viewer"), json={"reason": "x"}).status_code == 403
        other = http.post(
            "/v1/tasks", headers=bearer("bob"), json={"prompt": "Bob's tree", "metadata": {"deal": "Foo Corp"}}
        ).json()["id"]
        cancelled = http.post(f"/v1/tasks/{other}/cancel", headers=bearer("ops"), json={"reason": "ops stops it"})
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        # operate changes any tree and reads none: the answer says where the tree stands, not what it holds.
        assert (cancelled.json()["id"], cancelled.json()["prompt"], cancelled.json()["metadata"]) == (other, "", {})
        cancel = _audit(http)[0]
        assert (cancel["actor"], cancel["action"], cancel["target"], cancel["detail"]) == (
            "ops",
            "cancel",
            other,
            "ops stops it",
        )
        assert http.get(f"/v1/tasks/{other}", headers=bearer("ops")).status_code == 403, "its reads are refused"
        failed = http.post("/v1/tasks", headers=bearer("bob"), json={"prompt": "Bob's secret plan"}).json()["id"]
        sec_coord.store.runs.finish_task(failed, "failed", error="Bob's secret error", error_class="RuntimeError")
        sec_coord.client.hset(sec_coord.store.keys.task(failed, failed), "runner", "agent")
        retried = http.post(f"/v1/tasks/{failed}/retry", headers=bearer("ops"), json={})
        assert retried.status_code == 200 and retried.json()["retried"] == [failed], retried.text
        assert "Bob's secret" not in retried.text and retried.json()["task"]["status"] != "failed"
        assert sec_coord.get_task(failed).prompt == "Bob's secret plan", "the record itself is unchanged"
        # Nor through a refusal: a budget's error names its children, which the refusal no longer repeats.
        spent = http.post(
            "/v1/tasks", headers=bearer("bob"), json={"prompt": "Bob's budgeted", "budget_usd": "0.01"}
        ).json()["id"]
        (child,) = sec_coord.delegate(spent, [{"description": "Bob's secret child", "message": "m"}]).child_ids
        sec_coord.client.hset(sec_coord.store.keys.task(spent, spent), "runner", "agent")
        sec_coord.store.runs.record_usage(child, "1:1", Usage(tokens_in=5), 20_000, "test")
        budgets.stop(sec_coord.plane, spent)
        assert "Bob's secret child" in sec_coord.get_task(spent).error
        refused = http.post(f"/v1/tasks/{spent}/retry", headers=bearer("ops"), json={})
        assert refused.status_code == 409 and "failed on its budget" in refused.text, refused.text
        assert "Bob's secret" not in refused.text
        # Dead letters: operate only.
        assert http.get("/v1/dead-letters", headers=bearer("carol")).status_code == 403
        assert http.delete("/v1/dead-letters", headers=bearer("ops")).status_code == 200
        assert _audit(http)[0]["action"] == "purge_dead_letters"

        # The legacy token is the key `admin`: everything, on every tree.
        assert http.get(f"/v1/tasks/{root}", headers=AUTH).status_code == 200
        assert http.put(f"/v1/tasks/{root}/todos", headers=AUTH, json={"todos": "[ ] z"}).status_code == 200
        assert http.get("/v1/audit", headers=AUTH).status_code == 200
        by_admin = http.post(f"/v1/tasks/{root}/cancel", headers=AUTH, json={"reason": "admin"})
        assert by_admin.status_code == 200 and by_admin.json()["prompt"] == "Alice's tree", "a key that reads, reads"
        assert _audit(http)[0]["actor"] == "admin"

        # Refusals are counted by reason, fleet-wide.
        assert http.get("/v1/tasks", headers={"Authorization": "Bearer nobody's"}).status_code == 401
        metrics = _metric_values(http.get("/metrics").text, "subq_refused_requests_total")
        assert metrics.get("missing_scope", 0) >= 5 and metrics.get("invalid_token", 0) >= 1
        invalid = next(e for e in _audit(http) if e["reason"] == "invalid_token")
        assert (invalid["actor"], invalid["target"]) == ("", "GET /v1/tasks")


def test_a_write_probe_of_another_keys_tree_is_on_record_and_a_lapsed_trees_call_stays_hidden(
    sec_coord: Coordinator,
) -> None:
    with (
        _server(sec_coord, api_keys=keys_setting()) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
    ):
        alices = http.post("/v1/tasks", headers=bearer("alice"), json={"prompt": "Alice's"}).json()["id"]
        probes = (
            ("PUT", f"/v1/tasks/{alices}/todos", {"todos": "[ ] b"}),
            ("POST", f"/v1/tasks/{alices}/subtasks", {"subtasks": [{"description": "d", "message": "m"}]}),
            ("POST", f"/v1/tasks/{alices}/cancel", {"reason": "bob's"}),
            ("POST", f"/v1/tasks/{alices}/retry", {}),
        )
        for method, path, body in probes:
            assert http.request(method, path, headers=bearer("bob"), json=body).status_code == 404, path
        hidden = {e["target"] for e in _audit(http, limit=50) if e["actor"] == "bob" and e["reason"] == "not_found"}
        assert {f"{method} {path}" for method, path, _ in probes} <= hidden, "each probe is on record, as a read's"

        # A tree whose root's record lapsed while a child's call still waits: its call is no key's but read_all's,
        # and its id reaches no other key (the list had failed for every `read` key, naming that root).
        bobs = http.post("/v1/tasks", headers=bearer("bob"), json={"prompt": "Bob's"}).json()["id"]
        mine, lapsed = park_approval(sec_coord, bobs), park_approval(sec_coord, alices)
        sec_coord.client.delete(sec_coord.store.keys.task(alices, alices))
        listed = http.get("/v1/approvals", headers=bearer("bob"))
        assert listed.status_code == 200 and alices not in listed.text, listed.text
        assert mine.id in {a["id"] for a in listed.json()["approvals"]}
        assert lapsed.id in {a["id"] for a in http.get("/v1/approvals", headers=bearer("carol")).json()["approvals"]}


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def _metric_values(text: str, name: str) -> dict[str, float]:
    return {
        match.group(1): float(match.group(2))
        for match in re.finditer(rf'^{name}{{reason="([a-z_]+)"}} ([0-9.e+]+)$', text, re.MULTILINE)
    }


def test_the_audit_log_pages_newest_first_and_keeps_only_the_retention(sec_coord: Coordinator) -> None:
    coord = Coordinator(
        sec_coord.settings.model_copy(update={"key_prefix": f"{PREFIX}-audit"}), client=sec_coord.client
    )
    try:
        # An entry older than the retention (task history's), left by a write long ago: never listed.
        coord.client.xadd(
            coord.store.keys.audit(), {"ts": "1", "actor": "x", "action": "cancel", "target": "old"}, id="1000-0"
        )
        actor = Actor("pager", "192.0.2.1", "api")
        for n in range(5):
            coord.record(actor, "cancel", f"task-{n}")
        first, cursor = coord.audit(2)
        assert [e.target for e in first] == ["task-4", "task-3"] and cursor == first[-1].id
        second, cursor = coord.audit(2, cursor)
        assert [e.target for e in second] == ["task-2", "task-1"]
        last, cursor = coord.audit(2, cursor)
        assert [e.target for e in last] == ["task-0"] and cursor is None
        assert all(e.actor == "pager" and e.address == "192.0.2.1" for e in first + second + last)
        with pytest.raises(ValidationError, match="before must be an entry id"):
            coord.audit(2, "not-an-id")
        with pytest.raises(ValidationError, match="before must be an entry id"):
            coord.audit(2, f"{2**64}-0")  # past a stream id's 64 bits
        assert coord.audit(2, "00-0") == ([], None)  # nothing is older than the first id (the fuzzer's find)
    finally:
        for key in coord.client.scan_iter(f"{PREFIX}-audit:*"):
            coord.client.delete(key)


def test_the_keys_file_is_taken_up_without_a_restart(sec_coord: Coordinator, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.toml"

    def write(names: Iterable[str], extra: str = "") -> None:
        lines = []
        for name in names:
            scopes = ", ".join(f'"{s}"' for s in KEY_SCOPES[name])
            lines += [f"[{name}]", f'token_sha256 = "{token_sha256(KEY_TOKENS[name])}"', f"scopes = [{scopes}]", ""]
        keys_file.write_text("\n".join(lines) + extra)

    write(["alice", "viewer"])
    with (
        _server(sec_coord, api_keys_file=keys_file) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
    ):
        assert http.get("/v1/tasks", headers=bearer("alice")).status_code == 200
        assert http.get("/v1/tasks", headers=bearer("bob")).status_code == 401
        # Revoked by editing the file: the next request is refused.
        write(["viewer", "bob"])
        assert http.get("/v1/tasks", headers=bearer("alice")).status_code == 401
        assert http.get("/v1/tasks", headers=bearer("bob")).status_code == 200
        # A file broken by an edit refuses every key it held (fail closed); the legacy token still works.
        write(["viewer", "bob"], extra='[bob]\nscopes = "all"\n')
        assert http.get("/v1/tasks", headers=bearer("bob")).status_code == 401
        assert http.get("/v1/tasks", headers=bearer("viewer")).status_code == 401
        assert http.get("/v1/tasks", headers=AUTH).status_code == 200
        write(["viewer"])
        assert http.get("/v1/tasks", headers=bearer("viewer")).status_code == 200


# -- a key revoked while a request that lasts is open: event streams, /mcp's wait_task ------------------

# How a stream ends when its key, or its web session, stops allowing it (coordinator/api/events.py).
KEY_REVOKED = {
    "code": "unauthorized",
    "message": "The API key this stream was opened with was revoked, or may no longer read this tree: the stream ends",
    "field": "Authorization",
}
SESSION_ENDED = {
    "code": "unauthorized",
    "message": "The web session this stream was opened with has ended (signed out, or its key revoked or changed): "
    "sign in again at /ui/login",
    "field": COOKIE,
}


def _write_keys(keys_file: Path, scopes: dict[str, list[str]]) -> None:
    """A JSON keys file holding each named key of KEY_TOKENS with the scopes given."""
    keys = {name: {"token_sha256": token_sha256(KEY_TOKENS[name]), "scopes": given} for name, given in scopes.items()}
    keys_file.write_text(json.dumps(keys))


def _waiting_tree(coord: Coordinator, owner: str) -> str:
    """A root of `owner` with a child nobody runs (this module's queue has no worker): its stream stays open."""
    root = coord.create_task("Followed while its key is revoked", run=False, owner=owner).id
    coord.delegate(root, [{"description": "waits", "message": "Nobody runs this."}])
    return root


def _follow(url: str, first_entry: threading.Event, **client: Any) -> list[dict[str, Any]]:
    """Every event of the stream at `url` until the server ends it; `first_entry` is set at the first `id:`."""
    from tests.test_api import iter_sse

    events: list[dict[str, Any]] = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, **client) as http, http.stream("GET", url) as response:
        assert response.status_code == 200, response.read()
        for event in iter_sse(response):
            events.append(event)
            if event["id"]:
                first_entry.set()
    return events


def _assert_cut_off(events: list[dict[str, Any]], revoked_after: str, ended_with: dict[str, Any]) -> None:
    """The stream sent nothing written after the revocation, and ended with the error that says why."""
    sent = [event["id"] for event in events if event["id"]]
    assert sent, events
    late = [entry for entry in sent if _entry_order(entry) > _entry_order(revoked_after)]
    assert not late, f"events written after the revocation reached the revoked caller: {late}"
    assert events[-1] == {"id": None, "event": "error", "data": ended_with}


@pytest.mark.parametrize(
    ("revoke", "refused"),
    [pytest.param({}, 401, id="key-removed"), pytest.param({"alice": ["submit"]}, 403, id="read-dropped")],
)
def test_an_open_event_stream_ends_when_its_key_is_revoked(
    sec_coord: Coordinator, tmp_path: Path, revoke: dict[str, list[str]], refused: int
) -> None:
    keys_file = tmp_path / "keys.json"
    _write_keys(keys_file, {"alice": KEY_SCOPES["alice"]})
    root = _waiting_tree(sec_coord, owner="alice")
    first_entry = threading.Event()
    with (
        _server(sec_coord, api_keys_file=keys_file) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
        ThreadPoolExecutor(1) as pool,
    ):
        stream = pool.submit(_follow, f"{api.url}/v1/tasks/{root}/events", first_entry, headers=bearer("alice"))
        assert first_entry.wait(REQUEST_TIMEOUT_S), stream.result()
        _write_keys(keys_file, revoke)
        revoked_after = sec_coord.last_event_id(root)
        assert http.get(f"/v1/tasks/{root}", headers=bearer("alice")).status_code == refused
        sec_coord.cancel(root, "written after the key was revoked")  # events the revoked key must not get
        events = stream.result(timeout=REQUEST_TIMEOUT_S)
    _assert_cut_off(events, revoked_after, KEY_REVOKED)


def test_an_open_web_event_stream_ends_when_its_session_is_signed_out(sec_coord: Coordinator) -> None:
    root = _waiting_tree(sec_coord, owner="alice")
    first_entry = threading.Event()
    with (
        _server(sec_coord, api_keys=keys_setting(["alice"])) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
        ThreadPoolExecutor(1) as pool,
    ):
        assert _sign_in(http, KEY_TOKENS["alice"]).status_code == 303
        cookie = http.cookies[COOKIE]
        url = f"{api.url}/ui/tasks/{root}/events"
        stream = pool.submit(_follow, url, first_entry, cookies={COOKIE: cookie})
        assert first_entry.wait(REQUEST_TIMEOUT_S), stream.result()
        assert http.post("/ui/logout").status_code == 303
        revoked_after = sec_coord.last_event_id(root)
        fragment = httpx.get(f"{api.url}/ui/tasks/{root}/fragment", cookies={COOKIE: cookie}, timeout=REQUEST_TIMEOUT_S)
        assert fragment.status_code == 401
        sec_coord.cancel(root, "written after the session was signed out")
        events = stream.result(timeout=REQUEST_TIMEOUT_S)
    _assert_cut_off(events, revoked_after, SESSION_ENDED)


def test_wait_task_over_mcp_ends_when_its_key_is_revoked(sec_coord: Coordinator, tmp_path: Path) -> None:
    import anyio
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    keys_file = tmp_path / "keys.json"
    _write_keys(keys_file, {"alice": KEY_SCOPES["alice"]})
    root = _waiting_tree(sec_coord, owner="alice")

    async def main(url: str) -> Any:
        waiting = anyio.Event()

        async def progress(_done: float, _total: float | None, _message: str | None) -> None:
            waiting.set()  # told at once: the wait is under way, its key checked at the start

        result: Any = None

        async def wait() -> None:
            nonlocal result
            args = {"task_id": root, "timeout_s": 60}
            result = await client.call_tool("wait_task", args, progress_callback=progress)

        async with (
            httpx2.AsyncClient(headers=bearer("alice"), timeout=httpx2.Timeout(REQUEST_TIMEOUT_S)) as http,
            Client(streamable_http_client(f"{url}/mcp", http_client=http)) as client,
            anyio.create_task_group() as group,
        ):
            await client.list_tools()  # the client checks a result against the tools it listed: once, now
            group.start_soon(wait)
            with anyio.fail_after(REQUEST_TIMEOUT_S):
                await waiting.wait()
            _write_keys(keys_file, {})
            # The tree settles after the revocation: the old wait went on and answered with its end.
            await anyio.to_thread.run_sync(lambda: sec_coord.cancel(root, "settled after the key was revoked"))
        return result

    with _server(sec_coord, api_keys_file=keys_file) as api:
        started = time.monotonic()
        result = anyio.run(main, api.url)
    assert result.is_error, result.structured_content
    assert result.structured_content == {
        "code": "unauthorized",
        "message": "The API key 'alice' was revoked, or given a new token, while this call ran",
        "field": "Authorization",
    }
    assert time.monotonic() - started < 30  # ended by the revocation, not by its 60-s timeout


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "Invalid setting SUBQ_API_KEYS: not valid JSON"),
        (
            '{"ci": {"token_sha256": "a-token-not-its-hash", "scopes": ["read"]}}',
            "Invalid setting SUBQ_API_KEYS: key 'ci': token_sha256 must be the token's SHA-256 as 64 hex digits",
        ),
        (
            '{"ci": {"token_sha256": "' + "a" * 64 + '", "scopes": ["read", "delete"]}}',
            "Invalid setting SUBQ_API_KEYS: key 'ci': unknown scope 'delete' (one of submit, read, read_all, "
            "decide, operate, admin)",
        ),
        ('{"ci": {"scopes": ["read"]}}', "Invalid setting SUBQ_API_KEYS: key 'ci': missing field 'token_sha256'"),
        (
            '{"ci": {"token_sha256": "' + "b" * 64 + '"}}',
            "Invalid setting SUBQ_API_KEYS: key 'ci': missing field 'scopes'",
        ),
        (
            '{"a": {"token_sha256": "' + "c" * 64 + '", "scopes": ["read"]}, '
            '"b": {"token_sha256": "' + "C" * 64 + '", "scopes": ["submit"]}}',
            "Invalid setting SUBQ_API_KEYS: keys 'a' and 'b' have the same token_sha256",
        ),
    ],
)
def test_malformed_keys_are_refused_at_start_naming_the_key(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv("SUBQ_API_KEYS", value)
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert refused.value.field == "SUBQ_API_KEYS"


def test_a_malformed_keys_file_stops_the_start_in_one_line(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text('[deploy]\ntoken_sha256 = "' + "d" * 64 + '"\nscopes = ["submit", "root"]\n')
    env = {"SUBQ_API_KEYS_FILE": str(keys_file), "SUBQ_REDIS_URL": "redis://127.0.0.1:1/0"}
    from tests.test_cli import cli  # the command's words, without a process of its own (1.2 s of CPU)

    proc = cli("api", env=env)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"subq: Invalid setting SUBQ_API_KEYS_FILE: {keys_file}: key 'deploy': unknown scope 'root' "
        "(one of submit, read, read_all, decide, operate, admin)"
    ], proc.stderr
    # The key named as the legacy token signs in is refused too: the audit log must name one key.
    keys_file.write_text('[admin]\ntoken_sha256 = "' + "e" * 64 + '"\nscopes = ["read"]\n')
    with pytest.raises(ConfigError, match="key 'admin' is the name SUBQ_API_TOKEN signs in as"):
        load_settings(api_keys_file=keys_file, api_token="t")
    # One token names one key, across the setting, the file and SUBQ_API_TOKEN.
    keys_file.write_text(f'[ci]\ntoken_sha256 = "{token_sha256(KEY_TOKENS["alice"])}"\nscopes = ["read"]\n')
    with pytest.raises(ConfigError, match="key 'ci' has the token_sha256 of key 'alice' of SUBQ_API_KEYS"):
        load_settings(api_keys_file=keys_file, api_keys=keys_setting(["alice"]))
    with pytest.raises(ConfigError, match="SUBQ_API_KEYS_FILE: key 'ci' has the token of SUBQ_API_TOKEN"):
        load_settings(api_keys_file=keys_file, api_token=KEY_TOKENS["alice"])
    with pytest.raises(ConfigError, match="SUBQ_API_KEYS_FILE: key 'alice' is also in SUBQ_API_KEYS"):
        keys_file.write_text(f'[alice]\ntoken_sha256 = "{"f" * 64}"\nscopes = ["read"]\n')
        load_settings(api_keys_file=keys_file, api_keys=keys_setting(["alice"]))


def test_the_web_view_offers_only_what_the_keys_scopes_allow(sec_coord: Coordinator, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({n: s.model_dump(mode="json") for n, s in keys_setting().items()}))
    root = sec_coord.create_task("Viewed tree", run=False, owner="alice").id
    approval = park_approval(sec_coord, root)
    with _server(sec_coord, api_keys_file=keys_file) as api:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as viewer:
            assert _sign_in(viewer, KEY_TOKENS["viewer"]).status_code == 303
            page = viewer.get(f"/ui/tasks/{root}")
            assert page.status_code == 200 and "Signed in as <strong>viewer</strong>" in page.text
            assert 'data-action="approve"' not in page.text and 'data-action="cancel"' not in page.text
            assert "A key with the scope <code>decide</code> approves or denies this call." in page.text
            # The action checks again on the server: a 403 naming the scope, nothing decided.
            refused = viewer.post(f"/ui/actions/approvals/{approval.id}", json={"decision": "approve"})
            assert refused.status_code == 403 and "'decide'" in refused.json()["message"]
            assert sec_coord.store.approvals.get_approval(approval.id).status == "pending"
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as bob:
            assert _sign_in(bob, KEY_TOKENS["bob"]).status_code == 303
            assert bob.get(f"/ui/tasks/{root}").status_code == 404
            assert bob.get(f"/ui/tasks/{root}/fragment").status_code == 404
            assert root not in bob.get("/ui/").text
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as alice:
            assert _sign_in(alice, KEY_TOKENS["alice"]).status_code == 303
            page = alice.get(f"/ui/tasks/{root}")
            assert 'data-action="cancel"' in page.text and 'data-action="approve"' not in page.text
            assert root in alice.get("/ui/").text
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as carol:
            assert _sign_in(carol, KEY_TOKENS["carol"]).status_code == 303
            assert 'data-action="approve"' in carol.get(f"/ui/tasks/{root}/fragment").text
            decided = carol.post(f"/ui/actions/approvals/{approval.id}", json={"decision": "deny", "feedback": "no"})
            assert decided.status_code == 200 and decided.json()["decided_by"] == "carol"
            # Revoking the key in the file ends its session at the next request.
            keys_file.write_text(json.dumps({n: s.model_dump(mode="json") for n, s in keys_setting(["ops"]).items()}))
            assert carol.get(f"/ui/tasks/{root}/fragment").status_code == 401
        entries, _ = sec_coord.audit(50)
        sign_ins = [(e.actor, e.via) for e in entries if e.action == "sign_in"]
        assert ("carol", "web") in sign_ins and ("viewer", "web") in sign_ins
        deny = next(e for e in entries if e.action == "deny")
        assert (deny.actor, deny.via, deny.target, deny.detail) == ("carol", "web", approval.id, "no")
        assert any(e.reason == "missing_scope" and e.actor == "viewer" and e.via == "web" for e in entries)
        assert any(e.reason == "not_signed_in" for e in entries)


def test_subq_audit_lists_the_log_through_redis_and_through_the_api(sec_coord: Coordinator) -> None:
    from tests.test_cli import cli

    for n in range(4):
        sec_coord.record(Actor("earlier", "192.0.2.9", "api"), "cancel", f"earlier-{n}")
    root = sec_coord.create_task("Audited", run=False).id
    sec_coord.cancel(root, "stopped from Python")  # straight on Redis: on record as `local`
    env = {"SUBQ_REDIS_URL": str(sec_coord.settings.redis_url), "SUBQ_KEY_PREFIX": PREFIX}
    proc = cli("audit", "--limit", "1", env=env)
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stdout.splitlines()
    assert re.fullmatch(
        rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\dZ  local  cancel  {root}  \(from - via local\)  stopped from Python", line
    ), line
    assert proc.stderr.startswith("(older: subq audit --before ")
    with _server(sec_coord, api_keys=keys_setting()) as api:
        as_ops = {"SUBQ_API_URL": api.url, "SUBQ_API_TOKEN": KEY_TOKENS["ops"]}
        page = json.loads(cli("audit", "--limit", "3", "--json", env=as_ops).stdout)
        assert page["entries"][0]["target"] == root and page["next_before"] == page["entries"][-1]["id"]
        older = json.loads(cli("audit", "--limit", "3", "--before", page["next_before"], "--json", env=as_ops).stdout)
        assert not {e["id"] for e in older["entries"]} & {e["id"] for e in page["entries"]}
        # A key without `operate` is refused in one line that names the scope.
        as_alice = {"SUBQ_API_URL": api.url, "SUBQ_API_TOKEN": KEY_TOKENS["alice"]}
        refused = cli("audit", env=as_alice)
        assert refused.returncode != 0 and refused.stdout == ""
        assert refused.stderr.strip().splitlines() == [
            "subq: The API key 'alice' lacks the scope this needs: needs scope 'operate'"
        ]


def test_subq_up_hands_the_keys_to_the_api_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`subq up` starts its API with the environment of its settings: the keys arrive as they were given."""
    from coordinator.local.fleet import settings_env

    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(f'[ops]\ntoken_sha256 = "{token_sha256(KEY_TOKENS["ops"])}"\nscopes = ["operate"]\n')
    given = load_settings(redis_url="redis://127.0.0.1:1/0", api_keys=keys_setting(["alice"]), api_keys_file=keys_file)
    for name, value in settings_env(given).items():
        if name.startswith("SUBQ_"):
            monkeypatch.setenv(name, value)
    started = load_settings()
    assert started.api_keys == given.api_keys and started.api_keys_file == keys_file


def test_refusals_on_record_are_bounded(sec_coord: Coordinator) -> None:
    """A caller chooses a refused request's path and how many it sends: neither can fill the log."""
    root = sec_coord.create_task("Bounded", run=False).id
    with (
        _server(sec_coord, api_auth_attempts_per_min=3) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
    ):
        long_path = "/v1/tasks/" + "x" * 5000
        assert http.get(long_path).status_code == 401
        [entry] = sec_coord.audit(1)[0]
        assert (entry.reason, entry.actor) == ("missing_token", "") and len(entry.target) < 400
        assert entry.target.startswith(f"GET {long_path[:100]}") and entry.target.endswith("…")
        # Cookie-less web requests count as sign-in attempts: past the limit a 429, not on record.
        fragment = f"/ui/tasks/{root}/fragment"
        codes = [http.get(fragment).status_code for _ in range(3)]
        assert codes == [401, 401, 429]
        newest = sec_coord.audit(3)[0]
        assert [e.reason for e in newest] == ["not_signed_in", "not_signed_in", "missing_token"]


def test_the_python_client_takes_a_key_as_it_takes_the_token(sec_coord: Coordinator) -> None:
    from coordinator.client import SubqClient

    with _server(sec_coord, api_keys=keys_setting()) as api:
        with SubqClient(api.url, token=KEY_TOKENS["alice"]) as alice, SubqClient(api.url, KEY_TOKENS["bob"]) as bob:
            root = alice.create_task("Alice's by the client")
            assert root.owner == "alice" and alice.get_task(root.id).id == root.id
            with pytest.raises(NotFoundError, match=f"Unknown task: {root.id}"):
                bob.get_task(root.id)
            approval = park_approval(sec_coord, root.id)
            with pytest.raises(ForbiddenError, match="needs scope 'decide'"):
                alice.decide(approval.id, "approve")
            with pytest.raises(ForbiddenError, match="needs scope 'operate'"):
                alice.audit()
        with SubqClient(api.url, token=KEY_TOKENS["carol"]) as carol, SubqClient(api.url, KEY_TOKENS["ops"]) as ops:
            assert carol.decide(approval.id, "deny", "not today").decided_by == "carol"
            entries, _ = ops.audit(limit=1)
            assert (entries[0].actor, entries[0].action, entries[0].target) == ("carol", "deny", approval.id)
