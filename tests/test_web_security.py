"""A hostile model against the web view, in a real browser: its text never acts in the operator's page.

A subagent's words come from its model, and a model can be steered by what it
reads. Here every field a model, a task or a user chooses carries script
payloads for every context (attribute breakout with `"` and `'`, `</script>`,
`javascript:` URLs, event handlers, SVG, a full-page overlay that approves on
the first mouse move): the prompt, plan items, subtask descriptions, model
replies, tool arguments, errors and approval feedback, and the query strings
of the pages. A real tree runs (Redis, `celery worker` processes, the offline
model); Chromium opens every page with them, on first render and while they
arrive live, moves the mouse over the whole page and tabs through it. Nothing
may act: no dialog opens, no request leaves the page except the view's own
reads, no approval changes, and every page sends the CSP.

Finding of c440522 this guards: tool arguments broke out of the Approve
button's attribute and approved their own call when the page loaded.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, Dialog, Page, Request, Response, expect

from coordinator import Coordinator, Settings
from coordinator.api import create_app
from coordinator.models import Approval
from coordinator.web.views import call_text
from tests.agents import call, reply, subtask
from tests.helpers import TOKEN, ApiServer, api_settings
from tests.test_security import KEY_TOKENS, keys_setting, park_approval
from tests.test_web_browser import WAIT_MS, _shot, browser  # noqa: F401 - the module's one Chromium

_APPROVE = (
    "fetch('/ui/actions/approvals/'+document.querySelector('[data-approval-id]').dataset.approvalId,"
    "{method:'POST',headers:{'Content-Type':'application/json'},body:'{\\x22decision\\x22:\\x22approve\\x22}'})"
)
PAYLOADS = [
    f'" autofocus onfocus="{_APPROVE}" x="',
    "' autofocus onfocus='alert(1)' x='",
    '"><img src=/pwned-img onerror=alert(2)>',
    "</script><script>alert(3)</script>",
    '<svg onload=alert(4)><a href="javascript:alert(5)">open</a></svg>',
    "javascript:alert(6)",
    f'<div style="position:fixed;inset:0;z-index:9" onmousemove="{_APPROVE}">',
    "{{ 7*7 }} ${7*7} <!--",
]
HOSTILE = " ".join(PAYLOADS)
# Part of every field, so each shows where a person would look.
SHORT = "<b onmouseover=alert(7)>x</b>\"'><svg/onload=alert(8)>"
# The payloads without the long ones, for fields of at most 500 characters (a subtask's description).
MEDIUM = " ".join(payload for payload in PAYLOADS if "fetch" not in payload)
# A grid of points the mouse visits on each screenful (an overlay or a hover handler is met by any).
MOUSE_COLUMNS, MOUSE_ROWS = 6, 4
TABS = 15
# Screenfuls poked on a long page: every payload shows within the first few of each page.
MAX_SCREENS = 2
# The ticking child's steps: about ten seconds of events, long enough to be seen on a loaded host.
TICKS, TICK_MS = 10, 1000


@dataclass
class Watch:
    """What a page did by itself: dialogs it opened, requests it made, CSP violations it hit."""

    dialogs: list[str] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    visited: set[str] = field(default_factory=set)  # the test's own navigations
    documents: list[Response] = field(default_factory=list)

    def check(self, page: Page, origin: str) -> None:
        assert self.dialogs == [], f"a dialog opened: {self.dialogs}"
        for method, url in self.requests:
            if url in self.visited:
                continue
            parts = urlsplit(url)
            assert f"{parts.scheme}://{parts.netloc}" == origin, f"a request left the page: {url}"
            assert method == "GET", f"the page sent {method} {url}"
            assert "pwned" not in url and "/actions/" not in parts.path, url
        for response in self.documents:
            csp = response.headers.get("content-security-policy", "")
            assert "script-src 'self';" in csp and "frame-ancestors 'none'" in csp, (response.url, csp)
        violations = page.evaluate("window.__cspViolations || []")
        assert violations == [], f"something tried to run: {violations}"


@pytest.fixture
def context(browser: Browser, live_api: ApiServer) -> Iterator[BrowserContext]:  # noqa: F811
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    # Counted before any page script runs: a blocked inline handler or script shows here.
    context.add_init_script(
        "window.__cspViolations = [];"
        "document.addEventListener('securitypolicyviolation', e => window.__cspViolations.push(e.violatedDirective));"
    )
    yield context
    context.close()


def _watched(context: BrowserContext) -> tuple[Page, Watch]:
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    watch = Watch()

    def on_dialog(dialog: Dialog) -> None:
        watch.dialogs.append(dialog.message)
        dialog.dismiss()

    def on_request(request: Request) -> None:
        if "/ui/login" not in request.url:  # the test's own sign-in
            watch.requests.append((request.method, request.url))

    def on_response(response: Response) -> None:
        if response.request.resource_type == "document":
            watch.documents.append(response)

    page.on("dialog", on_dialog)
    page.on("request", on_request)
    page.on("response", on_response)
    return page, watch


def _sign_in(page: Page, url: str) -> None:
    page.goto(f"{url}/ui/login")
    page.fill("input[name=token]", TOKEN)
    page.click("form.login button[type=submit]")
    expect(page.locator("h1")).to_have_text("Roots")


def _poke(page: Page) -> None:
    """What an operator's hands do without deciding anything: move over everything, tab through it."""
    height = int(page.evaluate("document.documentElement.scrollHeight"))
    for top in range(0, min(height, MAX_SCREENS * 800), 800):
        page.evaluate(f"window.scrollTo(0, {top})")
        for row in range(MOUSE_ROWS):
            for col in range(MOUSE_COLUMNS):
                page.mouse.move(20 + col * 1240 / MOUSE_COLUMNS, 20 + row * 860 / MOUSE_ROWS)
    page.evaluate("window.scrollTo(0, 0)")
    for _ in range(TABS):
        page.keyboard.press("Tab")
    page.wait_for_timeout(300)  # a handler that fired has had time to send its request


def _approvals(http: httpx.Client, root: str) -> list[dict[str, Any]]:
    approvals: list[dict[str, Any]] = http.get("/v1/approvals", params={"root_id": root}).json()["approvals"]
    return approvals


def test_hostile_text_in_every_field_never_acts(
    context: BrowserContext, live_api: ApiServer, live_http: httpx.Client
) -> None:
    url = live_api.url
    # The hostile text as one quoted argument: a command line that parses (run_command refuses one that
    # does not before anyone is asked), so the call waits for a decision with every payload in it.
    command = f"echo {shlex.quote(HOSTILE)}"
    risky = subtask(f"Deploy {SHORT} {MEDIUM}", call("run_command", command=command), reply(f"deployed {HOSTILE}"))
    chatty = subtask(f"Summarise {SHORT} {MEDIUM}", reply(f"Summary {HOSTILE}"))
    failing = subtask(f"Break {SHORT} {MEDIUM}", {"fail": f"refused {SHORT} {HOSTILE}"})
    # A child that keeps the tree's stream busy for a while: the page swaps fragments in, with
    # the hostile approval on it, while the approval waits.
    ticks = [{**call("update_todo_list", todos=f"[-] tick {n} {SHORT}"), "latency_ms": TICK_MS} for n in range(TICKS)]
    ticker = subtask(f"Tick {SHORT}", *ticks, reply(f"ticked {HOSTILE}"))
    plan = "\n".join(f"[ ] {name} {SHORT} {HOSTILE}" for name in ("Deploy", "Summarise", "Break", "Tick"))
    # A root the test drives (run: false): it waits on its children, so its page stays live until
    # the last one ends, and the approval keeps it waiting until the test decides.
    response = live_http.post("/v1/tasks", json={"prompt": f"Release {SHORT} {HOSTILE}", "todos": plan})
    assert response.status_code == 201, response.text
    root = response.json()["id"]
    delegated = live_http.post(f"/v1/tasks/{root}/subtasks", json={"subtasks": [risky, chatty, failing, ticker]})
    assert delegated.status_code == 202, delegated.text

    live_page, live_watch = _watched(context)
    _sign_in(live_page, url)
    live_watch.visited.add(f"{url}/ui/tasks/{root}")
    live_page.goto(f"{url}/ui/tasks/{root}")
    deadline = time.monotonic() + WAIT_MS / 1000
    while not _approvals(live_http, root):
        assert time.monotonic() < deadline, live_http.get(f"/v1/tasks/{root}/tree").json()
        time.sleep(0.2)
    expect(live_page.locator(".approval")).to_have_count(1, timeout=WAIT_MS)
    # Live: the fragment is swapped in (innerHTML) again while the hostile approval is on the page.
    shown_at = int(live_page.locator("#tree").get_attribute("data-refreshes") or 0)
    live_page.wait_for_function(
        f"() => Number(document.getElementById('tree').dataset.refreshes || 0) > {shown_at}"
        " && document.querySelectorAll('.approval').length === 1"
    )
    _poke(live_page)
    live_watch.check(live_page, url)

    # First render: a fresh page on the same waiting tree.
    first_page, first_watch = _watched(context)
    first_watch.visited.add(f"{url}/ui/tasks/{root}")
    first_page.goto(f"{url}/ui/tasks/{root}")
    expect(first_page.locator(".approval")).to_have_count(1, timeout=WAIT_MS)
    _poke(first_page)
    first_watch.check(first_page, url)
    [waiting] = _approvals(live_http, root)
    assert waiting["status"] == "pending"

    # The box and the confirmation show the exact call; dismissing it sends nothing.
    exact = call_text(Approval.model_validate(waiting))
    expect(first_page.locator(f"#call-{waiting['id']}")).to_have_text(exact)
    first_watch.dialogs.clear()
    first_page.locator(f"button.approve[data-approval-id='{waiting['id']}']").click()  # the watch dismisses it
    first_page.wait_for_timeout(300)
    assert first_watch.dialogs == [f"Approve {exact}?"]
    first_watch.dialogs.clear()
    assert _approvals(live_http, root)[0]["status"] == "pending"

    # Denied through the API with hostile feedback; the tree runs to its end, the open page following it.
    denied = live_http.post(
        f"/v1/approvals/{waiting['id']}", json={"decision": "deny", "feedback": f"no {SHORT} {HOSTILE}"}
    )
    assert denied.status_code == 200, denied.text
    # Its children end (one denied and done, one done, one failed); the open page follows them.
    expect(live_page.locator("#live")).to_have_attribute("data-state", "ended", timeout=WAIT_MS)
    live_watch.check(live_page, url)
    tree = live_http.get(f"/v1/tasks/{root}/tree").json()
    assert sorted(child["status"] for child in tree["children"]) == ["completed", "completed", "completed", "failed"]
    for child in tree["children"]:
        expect(live_page.locator(f"#task-{child['id']}")).to_have_attribute("data-state", child["status"])

    # Every other page with the same text: the tree again, each conversation, the roots, an error, sign-in.
    pages = [f"/ui/tasks/{root}", f"/ui/tasks/{root}/conversation"]
    pages += [f"/ui/tasks/{child['id']}/conversation" for child in tree["children"]]
    pages += [f"/ui/?q={quote('Release')}", f"/ui/?since={quote(HOSTILE)}", f"/ui/?status={quote(SHORT)}"]
    for path in pages:
        page, watch = _watched(context)
        watch.visited.add(f"{url}{path}")
        page.goto(f"{url}{path}")
        _poke(page)
        watch.check(page, url)
        page.close()
    anonymous = context.browser
    assert anonymous is not None
    fresh = anonymous.new_context()
    try:
        page = fresh.new_page()
        watch = Watch()
        page.on("dialog", lambda dialog: (watch.dialogs.append(dialog.message), dialog.dismiss()))
        response = page.goto(f"{url}/ui/login?next={quote('/ui/' + HOSTILE)}")
        assert response is not None and "frame-ancestors 'none'" in response.headers["content-security-policy"]
        _poke(page)
        assert watch.dialogs == []
    finally:
        fresh.close()


def test_the_policy_stops_markup_that_slipped_through(context: BrowserContext, live_api: ApiServer) -> None:
    """The second wall: even markup put into the page by other means cannot run inline code."""
    page, _ = _watched(context)
    _sign_in(page, live_api.url)
    page.evaluate(
        """document.body.insertAdjacentHTML('beforeend',
             '<img src=/static-missing onerror="window.__ran = 1"><div onclick="window.__ran = 2">x</div>');
           const s = document.createElement('script'); s.textContent = 'window.__ran = 3';
           document.body.appendChild(s);"""
    )
    page.wait_for_timeout(500)
    assert page.evaluate("window.__ran") is None
    assert page.evaluate("window.__cspViolations"), "the policy reported nothing it blocked"


# -- the signed-in key's scopes in a real browser -------------------------------------------------

KEYS_PREFIX = "subqwebkeys"


def test_the_page_offers_only_what_the_signed_in_keys_scopes_allow(
    browser: Browser,  # noqa: F811
    settings: Settings,
    tmp_path: Path,
) -> None:
    """A read_all key sees the waiting call but no Approve; a decide key approves it, and it is on record."""
    coord = Coordinator(api_settings(settings, key_prefix=KEYS_PREFIX, queue="subq-webkeys-idle"))
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(
        json.dumps({n: s.model_dump(mode="json") for n, s in keys_setting(["viewer", "carol"]).items()})
    )
    try:
        root = coord.create_task("Deploy the release", todos="[-] Run the deploy", run=False, owner="alice").id
        approval = park_approval(coord, root)
        app = create_app(coord.settings.model_copy(update={"api_keys_file": keys_file}), coordinator=coord)
        with ApiServer(app) as api:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.set_default_timeout(WAIT_MS)
            dialogs: list[str] = []

            def accept(dialog: Dialog) -> None:
                dialogs.append(dialog.message)
                dialog.accept()

            page.on("dialog", accept)
            for name in ("viewer", "carol"):
                page.goto(f"{api.url}/ui/login")
                page.fill("input[name=token]", KEY_TOKENS[name])
                page.click("form.login button[type=submit]")
                expect(page.locator("h1")).to_have_text("Roots")
                expect(page.locator(".signed-in")).to_contain_text(f"Signed in as {name}")
                page.goto(f"{api.url}/ui/tasks/{root}")
                box = page.locator(f"#approval-{approval.id}")
                expect(box).to_be_visible()
                _shot(page, tmp_path, f"web-keys-{name}.png")
                if name == "viewer":
                    expect(box.locator("button")).to_have_count(0)
                    expect(box.locator(".no-decide")).to_be_visible()
                    expect(page.locator("button[data-action=cancel]")).to_have_count(0)
                    page.click("form.logout button")
                    expect(page.locator("h1")).to_have_text("Sign in")
                    continue
                box.locator("button[data-action=approve]").click()
                expect(page.locator(f"#approval-{approval.id}")).to_have_count(0)
            context.close()
        assert dialogs == [f"Approve {call_text(approval)}?"]
        decided = coord.store.approvals.get_approval(approval.id)
        assert (decided.status, decided.decided_by) == ("approved", "carol")
        entries, _ = coord.audit(50)
        done = [(e.actor, e.action, e.via) for e in entries if e.action in ("approve", "sign_in", "sign_out")]
        assert done == [("carol", "approve", "web"), ("carol", "sign_in", "web"), ("viewer", "sign_out", "web"),
                        ("viewer", "sign_in", "web")]  # fmt: skip
    finally:
        for key in coord.client.scan_iter(f"{KEYS_PREFIX}:*"):
            coord.client.delete(key)
        coord.close()
