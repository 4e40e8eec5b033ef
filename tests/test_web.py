"""The web view over HTTP (no browser): sign-in, the roots page's filters and paging, refusals.

Against a real uvicorn server and a real Redis, with a coordinator of its own
(keys under a prefix of its own, a queue no worker consumes), so the history
holds exactly the roots made here and a refused request can be checked to have
changed nothing. The browser tests are in test_web_browser.py.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator

import httpx
import pytest

from coordinator import Coordinator, Settings
from coordinator.api import create_app
from coordinator.models import RunWrites, ToolCallDone
from coordinator.web.auth import COOKIE
from tests.agents import reply, subtask
from tests.helpers import REQUEST_TIMEOUT_S, TOKEN, ApiServer, api_settings, state
from tests.test_unlinked_spend import finish, spend

PROMPTS = ["Write the Q3 report", "Fix the login bug", "Write the release notes", "Plan the offsite", "Audit costs"]


@pytest.fixture(scope="module")
def web_coord(settings: Settings) -> Iterator[Coordinator]:
    coord = Coordinator(api_settings(settings, key_prefix="subqweb", queue="subq-web-idle"))
    yield coord
    coord.client.delete("subq-web-idle")
    for key in coord.client.scan_iter("subqweb:*"):
        coord.client.delete(key)
    coord.close()


@pytest.fixture(scope="module")
def roots(web_coord: Coordinator) -> dict[str, str]:
    """Five roots, oldest first: two delegated, one cancelled, the rest active. prompt -> id."""
    made = {prompt: web_coord.create_task(prompt, todos="[ ] one\n[ ] two", run=False).id for prompt in PROMPTS}
    for prompt in ("Fix the login bug", "Plan the offsite"):
        web_coord.delegate(made[prompt], [{"description": "part", "message": "do the part"}])
    web_coord.cancel(made["Audit costs"], "not needed")
    return made


@pytest.fixture(scope="module")
def server(web_coord: Coordinator) -> Iterator[ApiServer]:
    with ApiServer(create_app(coordinator=web_coord)) as api:
        yield api


@pytest.fixture(scope="module")
def browser_http(server: ApiServer) -> Iterator[httpx.Client]:
    """A client signed in through the login form, as a browser is: it holds the session cookie."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/ui/login", data={"token": TOKEN, "next": "/ui/"})
        assert response.status_code == 303 and response.headers["location"] == "/ui/"
        yield http


def _ids_on(page: str) -> list[str]:
    return re.findall(r'<tr data-task-id="([^"]+)">', page)


def _error_of(page: str) -> tuple[str, str, str]:
    found = re.search(r'class="error" role="alert" data-code="([^"]*)" data-field="([^"]*)">([^<]*)<', page)
    assert found, page
    code, field, message = found.groups()
    return code, field, message


# -- sign-in -------------------------------------------------------------------------------


def test_pages_need_the_token(server: ApiServer, roots: dict[str, str]) -> None:
    root = roots["Write the Q3 report"]
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        assert anon.get("/ui").headers["location"] == "/ui/"
        page = anon.get(f"/ui/tasks/{root}")
        assert page.status_code == 303 and page.headers["location"] == f"/ui/login?next=%2Fui%2Ftasks%2F{root}"
        for path in (f"/ui/tasks/{root}/fragment", f"/ui/tasks/{root}/events"):
            refused = anon.get(path)
            assert refused.status_code == 401 and refused.json()["code"] == "unauthorized"
        refused = anon.post(f"/ui/actions/tasks/{root}/cancel", json={"reason": "x"})
        assert refused.status_code == 401
        wrong = anon.post("/ui/login", data={"token": "not-the-token", "next": "/ui/"})
        assert wrong.status_code == 401 and "not the server" in wrong.text and COOKIE not in anon.cookies
        # After signing in the page answers; the cookie is not the token itself.
        signed = anon.post("/ui/login", data={"token": TOKEN, "next": f"/ui/tasks/{root}"}, follow_redirects=True)
        assert signed.status_code == 200 and f'id="task-{root}"' in signed.text
        assert TOKEN not in anon.cookies[COOKIE]
        cookie_header = signed.history[0].headers["set-cookie"].lower()
        assert "httponly" in cookie_header and "samesite=strict" in cookie_header
        # A `next` pointing off the site goes to the roots page instead.
        elsewhere = anon.post("/ui/login", data={"token": TOKEN, "next": "https://evil.example/"})
        assert elsewhere.headers["location"] == "/ui/"


@pytest.mark.parametrize(
    "headers",
    [{"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"}, {"Origin": "https://evil.example"},
     {"Origin": "null"}],
    ids=["cross-site", "same-site", "other origin", "null origin"],
)  # fmt: skip
def test_another_sites_form_cannot_sign_a_browser_in_or_out(
    server: ApiServer, web_coord: Coordinator, headers: dict[str, str]
) -> None:
    """Login CSRF: another site's page posted its own key's token to /ui/login, and the browser was signed in as
    that key (its trees read and acted on as the user's own); a post to /ui/logout signed the user out."""
    sessions = lambda: len(list(web_coord.client.scan_iter("subqweb:web-session:*")))  # noqa: E731
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        before = sessions()
        refused = anon.post("/ui/login", data={"token": TOKEN, "next": "/ui/"}, headers=headers)
        assert refused.status_code == 403 and "form was refused" in refused.text
        assert COOKIE not in anon.cookies and sessions() == before, "no session made"
        own = {"Sec-Fetch-Site": "same-origin", "Origin": server.url}
        assert anon.post("/ui/login", data={"token": TOKEN, "next": "/ui/"}, headers=own).status_code == 303
        assert anon.post("/ui/logout", headers=headers).status_code == 403
        assert anon.get("/ui/").status_code == 200, "still signed in"
        assert anon.post("/ui/logout", headers=own).status_code == 303


# -- the roots page ------------------------------------------------------------------------


def test_roots_page_lists_roots_newest_first_and_pages(browser_http: httpx.Client, roots: dict[str, str]) -> None:
    newest_first = list(reversed(roots.values()))
    page = browser_http.get("/ui/")
    assert page.status_code == 200 and _ids_on(page.text) == newest_first
    # Children are not roots: the delegated roots' children never show up.
    seen, url = [], "/ui/?limit=2"
    while url:
        page = browser_http.get(url)
        assert page.status_code == 200
        seen += _ids_on(page.text)
        older = re.search(r'<a rel="next" href="([^"]+)"', page.text)
        url = older.group(1).replace("&amp;", "&") if older else ""
    assert seen == newest_first


def test_roots_page_filters(browser_http: httpx.Client, roots: dict[str, str]) -> None:
    def ids(**params: str) -> set[str]:
        page = browser_http.get("/ui/", params=params)
        assert page.status_code == 200, page.text
        return set(_ids_on(page.text))

    assert ids(status="delegated") == {roots["Fix the login bug"], roots["Plan the offsite"]}
    assert ids(status="cancelled") == {roots["Audit costs"]}
    assert ids(q="WRITE") == {roots["Write the Q3 report"], roots["Write the release notes"]}
    assert ids(q="write", status="active") == {roots["Write the Q3 report"], roots["Write the release notes"]}
    today = dt.datetime.now(dt.UTC).date()
    assert ids(since=today.isoformat(), until=today.isoformat()) == set(roots.values())
    assert ids(until=(today - dt.timedelta(days=1)).isoformat()) == set()
    assert ids(since=(today + dt.timedelta(days=1)).isoformat()) == set()


@pytest.mark.parametrize(
    ("query", "field", "message"),
    [
        ({"status": "finished"}, "status", "status must be one of active, delegated"),
        ({"since": "22/11/2026"}, "since", "since must be a date as YYYY-MM-DD"),
        ({"until": "tomorrow"}, "until", "until must be a date"),
        # The day after the last one Python counts to has no start: a 500.
        ({"until": "9999-12-31"}, "until", "until must be a date up to 9999-12-30"),
        ({"limit": "²"}, "limit", "limit must be a whole number"),
        ({"since": "2026-11-22", "until": "2026-11-01"}, "since", "is after until"),
        ({"cursor": "-1"}, "cursor", "cursor must be a whole number"),
        ({"cursor": "9" * 30}, "cursor", "cursor must be a whole number"),
        ({"limit": "0"}, "limit", "limit must be a whole number from 1"),
        ({"limit": "many"}, "limit", "limit must be a whole number"),
        ({"q": "x" * 201}, "q", "at most 200 characters"),
        ({"staus": "failed"}, "staus", "unknown query parameter"),
    ],
)
def test_a_bad_filter_is_a_clear_error_and_changes_nothing(
    browser_http: httpx.Client,
    web_coord: Coordinator,
    roots: dict[str, str],
    query: dict[str, str],
    field: str,
    message: str,
) -> None:
    before = state(web_coord)
    page = browser_http.get("/ui/", params=query)
    assert page.status_code == 422 and page.headers["content-type"].startswith("text/html")
    code, got_field, got_message = _error_of(page.text)
    assert (code, got_field) == ("invalid_input", field) and message in got_message.replace("&#39;", "'")
    assert "Traceback" not in page.text
    assert state(web_coord) == before


# -- refusals of the tree pages and actions ------------------------------------------------


def test_tree_pages_refuse_unknown_ids_and_parameters(browser_http: httpx.Client, roots: dict[str, str]) -> None:
    unknown = "0123456789abcdef"
    page = browser_http.get(f"/ui/tasks/{unknown}")
    assert page.status_code == 404 and _error_of(page.text)[0] == "not_found"
    page = browser_http.get(f"/ui/tasks/{unknown}/conversation")
    assert page.status_code == 404
    page = browser_http.get(f"/ui/tasks/{roots['Plan the offsite']}", params={"x": "1"})
    assert page.status_code == 422 and _error_of(page.text)[1] == "x"
    assert browser_http.get(f"/ui/tasks/{unknown}/fragment").status_code == 404
    assert browser_http.get(f"/ui/tasks/{unknown}/events").status_code == 404


def test_refused_actions_answer_the_apis_error_and_change_nothing(
    browser_http: httpx.Client, web_coord: Coordinator, roots: dict[str, str]
) -> None:
    ended, live = roots["Audit costs"], roots["Plan the offsite"]
    cases = [
        (f"/ui/actions/tasks/{ended}/cancel", {"json": {"reason": "again"}}, 409, "wrong_state"),
        (f"/ui/actions/tasks/{live}/cancel", {"json": {"reason": ""}}, 422, "invalid_input"),
        (f"/ui/actions/tasks/{live}/cancel", {"content": '{"reason": "x"}'}, 415, "unsupported_media_type"),
        (f"/ui/actions/tasks/{live}/cancel", {"data": {"reason": "x"}}, 415, "unsupported_media_type"),
        (f"/ui/actions/approvals/{live}-a000000000000", {"json": {"decision": "approve"}}, 404, "not_found"),
        (f"/ui/actions/approvals/{live}-a000000000000", {"json": {"decision": "maybe"}}, 422, "invalid_input"),
    ]
    for path, request, status, code in cases:
        before = state(web_coord, ended, live)
        response = browser_http.post(path, **request)  # type: ignore[arg-type]
        assert response.status_code == status, (path, response.text)
        assert response.json()["code"] == code
        assert state(web_coord, ended, live) == before, path


def test_the_tree_page_shows_plan_children_and_figures(browser_http: httpx.Client, roots: dict[str, str]) -> None:
    root = roots["Fix the login bug"]
    page = browser_http.get(f"/ui/tasks/{root}")
    assert page.status_code == 200
    (child,) = re.findall(rf'<section class="task" id="task-({root}-[0-9a-f]{{12}})"', page.text)
    # The first plan item links to the child, one click away (an anchor to its section).
    assert f'href="#task-{child}"' in page.text
    assert 'data-events-url="/ui/tasks/' in page.text and "/static/subq.js" in page.text
    assert browser_http.get(f"/ui/tasks/{child}/conversation").status_code == 200


# Characters that hide or reorder text: a right-to-left override, a zero-width space, a terminal's escape.
HIDING = "\u202e", "\u200b", "\x1b"


def test_text_that_hides_or_reorders_itself_shows_as_escapes_on_every_page(
    browser_http: httpx.Client, web_coord: Coordinator
) -> None:
    """Only the call text went through `visible_text`: a prompt, a plan item or a child's description with a
    bidi override read, in the page, as something other than it was."""
    said = "Pay \u202egnp.exe\u200b now\x1b[2J"
    root = web_coord.create_task(said, todos=f"[ ] {said}", run=False).id
    web_coord.delegate(root, [{"description": said, "message": "do it"}])
    child = web_coord.tree(root).children[0].id
    for path in (f"/ui/tasks/{root}", f"/ui/tasks/{child}/conversation", "/ui/?q=Pay"):
        page = browser_http.get(path)
        assert page.status_code == 200, (path, page.text)
        assert not any(ch in page.text for ch in HIDING), path
        assert "Pay \\u202egnp.exe\\u200b now\\x1b[2J" in page.text, path


def test_unlinked_spend_is_its_own_line_and_the_rows_add_up(browser_http: httpx.Client, settings: Settings) -> None:
    # The tree of tests/test_unlinked_spend.py: child c1's row is rewritten away, so its spend has no row.
    # Keys of its own, so the roots tests above see only their five roots whatever the order.
    web_coord = Coordinator(api_settings(settings, key_prefix="subqweb2", queue="subq-web-idle"))
    with ApiServer(create_app(coordinator=web_coord)) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        assert http.post("/ui/login", data={"token": TOKEN}).status_code == 303
        _check_unlinked_page(web_coord, http)
        # Text from tasks is escaped: a prompt cannot inject markup or script into the page.
        hostile = web_coord.create_task(
            "<script>alert('x')</script> <b>bold</b>", todos="[ ] <img src=x onerror=alert(1)>"
        )
        for path in ("/ui/", f"/ui/tasks/{hostile.id}"):
            page = http.get(path).text
            assert "<script>alert" not in page and "<b>bold" not in page and "<img src=x" not in page
            assert "&lt;script&gt;alert(" in page or "&lt;img src=x" in page
    for key in web_coord.client.scan_iter("subqweb2:*"):
        web_coord.client.delete(key)
    web_coord.close()


def _check_unlinked_page(web_coord: Coordinator, browser_http: httpx.Client) -> None:
    parent = web_coord.create_task("Unlinked spend on the page", todos="[ ] A\n[ ] B", budget_usd="0.004")
    a, b = web_coord.get_todos(parent.id)
    batch = web_coord.delegate(
        parent.id, [subtask("A", reply("a"), todo_id=a.id), subtask("B", reply("b"), todo_id=b.id)]
    )
    c1, c2 = batch.child_ids
    web_coord.update_todos(parent.id, "[ ] B")
    spend(web_coord, c1, 700, 7000)
    spend(web_coord, c2, 300, 3000)
    finish(web_coord, c1, batch.id)
    finish(web_coord, c2, batch.id)

    page = browser_http.get(f"/ui/tasks/{parent.id}").text
    top = page[page.index(f'id="task-{parent.id}"') : page.index(f'id="task-{c1}"')]
    unlinked = re.search(r'<tr class="unlinked">(.*?)</tr>', top, re.S)
    assert unlinked, top
    assert 'data-tokens="7000">7,000<' in unlinked.group(1) and 'data-micros="700">$0.000700<' in unlinked.group(1)
    (row,) = re.findall(r'<tr class="todo [^"]*" data-todo-id="[^"]*" data-subtask-id="([^"]*)">(.*?)</tr>', top, re.S)
    assert row[0] == c2 and 'data-micros="300">$0.000300<' in row[1]
    assert 'data-field="total-cost"><span class="usd" data-micros="1000">$0.001000</span>' in top
    # Budget spent against its cap: $0.001000 of $0.004000.
    assert 'data-spent-micros="1000" data-cap-micros="4000"' in top and "25.0%" in top


def test_with_auth_disabled_the_view_is_open(settings: Settings, web_coord: Coordinator) -> None:
    open_settings = settings.model_copy(update={"api_auth_disabled": True, "key_prefix": "subqweb"})
    with (
        ApiServer(create_app(open_settings, coordinator=web_coord)) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as anon,
    ):
        page = anon.get("/ui/")
        assert page.status_code == 200 and "<h1>Roots</h1>" in page.text and "Sign out" not in page.text


def test_a_tasks_tool_calls_show_by_tool_with_how_they_ended(
    web_coord: Coordinator, browser_http: httpx.Client
) -> None:
    root = web_coord.create_task("Use some tools")
    store = web_coord.store
    store.client.set(store.keys.lease(root.root_id, root.id), "a-run", ex=60)  # as a run holding the task's lease
    for call in [
        ToolCallDone("c1", "git_log", "ok", '"log"', 340),
        ToolCallDone("c2", "git_log", "ok", '"log"', 120),
        ToolCallDone("c3", "git_push", "denied"),
        ToolCallDone("c4", "<b>hostile</b>", "error", '"Error: x"', 5),
    ]:
        assert store.runs.record_tool_call(root, "a-run", RunWrites(), call).leased
    assert web_coord.get_task(root.id).tool_use["git_log"].calls == 2
    page = browser_http.get(f"/ui/tasks/{root.id}/fragment").text
    rows = re.findall(r'<tr data-tool="([^"]*)"><td><code>([^<]*)</code></td><td class="num">(\d+)</td>\s*'
                      r"<td>([^<]*)</td>\s*<td class=\"num\">([^<]*)</td>", page)  # fmt: skip
    assert rows == [
        ("&lt;b&gt;hostile&lt;/b&gt;", "&lt;b&gt;hostile&lt;/b&gt;", "1", "error 1", "0.01 s"),
        ("git_log", "git_log", "2", "ok 2", "0.46 s"),
        ("git_push", "git_push", "1", "denied 1", "0.00 s"),
    ]
    lines = web_coord.tree(root.id)
    assert lines.tool_use["git_push"].outcomes == {"denied": 1}
