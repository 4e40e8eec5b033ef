"""The API and the web view against a hostile network: sessions, rate limits, headers, escaping.

Against real uvicorn servers on a real Redis (each app with its own key prefix
and its own limits), no worker needed: what is checked here is what a client
on the network can do. The browser side (payloads in every field, on first
render and live) is tests/test_web_security.py.
"""

from __future__ import annotations

import html.parser
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from coordinator import Coordinator, Settings, ids
from coordinator.api import create_app
from coordinator.api.limits import RateLimiter, is_open_route
from coordinator.api.security import STRICT_CSP, csp_with_inline_scripts
from coordinator.errors import NotFoundError
from coordinator.models import Approval
from coordinator.web.auth import COOKIE
from coordinator.web.views import MAX_CALL_CHARS, call_text
from tests.helpers import AUTH, TOKEN, ApiServer, api_settings

PREFIX = "subqsec"
# A client address behind the trusted proxy: documentation range (RFC 5737), never dialled.
FORWARDED_FOR = "203.0.113.7"


@pytest.fixture(scope="module")
def sec_coord(settings: Settings) -> Iterator[Coordinator]:
    coord = Coordinator(api_settings(settings, key_prefix=PREFIX, queue="subq-sec-idle"))
    yield coord
    for key in coord.client.scan_iter(f"{PREFIX}:*"):
        coord.client.delete(key)
    coord.close()


def _server(coord: Coordinator, **update: Any) -> ApiServer:
    return ApiServer(create_app(coord.settings.model_copy(update=update), coordinator=coord))


def _sign_in(http: httpx.Client, token: str = TOKEN, **headers: str) -> httpx.Response:
    return http.post("/ui/login", data={"token": token, "next": "/ui/"}, headers=headers)


def _sessions(coord: Coordinator) -> list[str]:
    return sorted(coord.client.scan_iter(f"{PREFIX}:web-session:*"))


# -- sessions ------------------------------------------------------------------------------


def test_each_sign_in_is_its_own_session_and_sign_out_revokes_it(sec_coord: Coordinator) -> None:
    root = sec_coord.create_task("Session test", run=False).id
    with _server(sec_coord) as api, httpx.Client(base_url=api.url) as first, httpx.Client(base_url=api.url) as second:
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
        replayed = httpx.get(f"{api.url}{fragment}", cookies={COOKIE: one})
        assert replayed.status_code == 401 and replayed.json()["code"] == "unauthorized"
        page = httpx.get(f"{api.url}/ui/tasks/{root}", cookies={COOKIE: one})
        assert page.status_code == 303 and page.headers["location"].startswith("/ui/login")
        # The other sign-in is untouched.
        assert second.get(fragment).status_code == 200
        assert len(set(_sessions(sec_coord)) - set(before)) == 1


def test_a_changed_token_revokes_every_session(sec_coord: Coordinator) -> None:
    root = sec_coord.create_task("Token change", run=False).id
    with _server(sec_coord) as api, httpx.Client(base_url=api.url) as http:
        assert _sign_in(http).status_code == 303
        cookie = http.cookies[COOKIE]
        assert http.get(f"/ui/tasks/{root}/fragment").status_code == 200
    # The same Redis, a server restarted with a new SUBQ_API_TOKEN: the session is gone.
    with _server(sec_coord, api_token=SecretStr("a-new-token-9d1e")) as api:
        refused = httpx.get(f"{api.url}/ui/tasks/{root}/fragment", cookies={COOKIE: cookie})
        assert refused.status_code == 401


def test_made_up_and_oversized_cookies_are_refused(sec_coord: Coordinator) -> None:
    root = sec_coord.create_task("Forged", run=False).id
    with _server(sec_coord) as api:
        for forged in ("x", "A" * 43, "A" * 5000, ""):
            response = httpx.get(f"{api.url}/ui/tasks/{root}/fragment", cookies={COOKIE: forged})
            assert response.status_code == 401, forged


def test_the_cookie_is_secure_when_the_deployment_says_https(sec_coord: Coordinator) -> None:
    def cookie_header(http: httpx.Client, **headers: str) -> str:
        response = _sign_in(http, **headers)
        assert response.status_code == 303
        return response.headers["set-cookie"].lower()

    with _server(sec_coord) as api, httpx.Client(base_url=api.url) as http:
        assert "secure" not in cookie_header(http)
        # Not from a proxy it trusts: the forwarded scheme is ignored.
        assert "secure" not in cookie_header(http, **{"X-Forwarded-Proto": "https"})
    with _server(sec_coord, api_https=True) as api, httpx.Client(base_url=api.url) as http:
        assert "; secure" in cookie_header(http)
        assert "max-age=" in http.get("/ui/login").headers["strict-transport-security"]
    with _server(sec_coord, api_trusted_proxies="127.0.0.1") as api, httpx.Client(base_url=api.url) as http:
        assert "; secure" in cookie_header(http, **{"X-Forwarded-Proto": "https"})
        assert "secure" not in cookie_header(http, **{"X-Forwarded-Proto": "http"})


# -- rate limits -----------------------------------------------------------------------------


def test_sign_ins_are_rate_limited_per_client_address(sec_coord: Coordinator) -> None:
    with (
        _server(sec_coord, api_auth_attempts_per_min=3, api_trusted_proxies="127.0.0.1") as api,
        httpx.Client(base_url=api.url) as http,
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
    with _server(sec_coord, api_auth_attempts_per_min=2) as api, httpx.Client(base_url=api.url) as http:
        for n in range(2):
            assert _sign_in(http, token="wrong", **{"X-Forwarded-For": f"198.51.100.{n}"}).status_code == 401
        assert _sign_in(http, **{"X-Forwarded-For": FORWARDED_FOR}).status_code == 429


def test_wrong_bearer_tokens_are_rate_limited(sec_coord: Coordinator) -> None:
    with _server(sec_coord, api_auth_attempts_per_min=3) as api:
        wrong = {"Authorization": "Bearer not-the-token"}
        with httpx.Client(base_url=api.url) as http:
            assert http.get("/v1/tasks", headers=AUTH).status_code == 200
            for _ in range(3):
                assert http.get("/v1/tasks", headers=wrong).status_code == 401
            for headers in (wrong, AUTH):  # the right token too, until the bucket refills
                limited = http.get("/v1/tasks", headers=headers)
                assert limited.status_code == 429 and limited.json()["code"] == "rate_limited"
                assert int(limited.headers["retry-after"]) >= 1
            # A missing token is no guess: it is answered 401, not counted.
            assert http.get("/v1/tasks").status_code in (401, 429)


def test_open_routes_are_rate_limited(sec_coord: Coordinator) -> None:
    with _server(sec_coord, api_open_requests_per_min=5) as api, httpx.Client(base_url=api.url) as http:
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
    with _server(sec_coord) as api, httpx.Client(base_url=api.url) as http:
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
    long = call_text(_approval(command="x" * 5000))
    assert len(long) < MAX_CALL_CHARS + 60 and long.endswith("more characters not shown)")


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
    with _server(sec_coord) as api, httpx.Client(base_url=api.url) as http:
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
    for command in (["tree", root.id], ["todos", root.id], ["status", root.id], ["history", "--root", root.id]):
        proc = cli(*command, env=env)
        assert proc.returncode == 0, (command, proc.stderr)
        assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout and "\r" not in proc.stdout, command
    tree = cli("tree", root.id, env=env).stdout
    assert "Deploy \\x1b]52;c;cm0gLXJmIC8=\\x07 now" in tree and "stopped \\x1b[2J\\x1b[Hby a model" in tree
