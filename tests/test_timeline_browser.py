"""The web view's timeline in a real browser (Playwright driving /usr/bin/chromium, as
tests/test_web_browser.py does): bars appear and grow live while children run, each bar's start,
end and figures equal the API's, hovering or focusing a bar shows its figures, a bar links to its
task, and a tree of 1,000 children renders in under 2 s. Set WEB_SCREENSHOTS_DIR to keep the
screenshots (docs/img/web-timeline*.png were made so).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Locator, Page, expect

from coordinator import Coordinator
from coordinator.api import create_app
from tests.agents import call, reply, subtask
from tests.helpers import TOKEN, ApiServer, api_settings
from tests.test_web_browser import SCREENSHOTS, SLOW_STEP_MS, WAIT_MS, _open_tree, _run_root, _shot, _slow, browser

__all__ = ["browser"]  # the module's browser fixture, shared

# A 1,000-child tree's page, timeline included, is drawn within this: 2 s on an idle 2-core host,
# and three times that as the test's bound, which holds with both cores busy (3.1 s was seen, the best
# of two draws, with two busy loops beside the suite): a bound a loaded CI host cannot miss.
WIDE_CHILDREN = 1000
RENDER_BUDGET_S = 2.0
LOADED_MARGIN = 3


def _signed_in(browser: Browser, url: str, width: int = 1280, height: int = 900) -> Page:
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{url}/ui/login")
    page.fill("input[name=token]", TOKEN)
    page.click("form.login button[type=submit]")
    expect(page.locator("h1")).to_have_text("Roots")
    return page


@pytest.fixture
def page(browser: Browser, live_api: ApiServer) -> Iterator[Page]:
    page = _signed_in(browser, live_api.url)
    yield page
    page.context.close()


def _shot_of(element: Locator, tmp_path: Path, name: str) -> None:
    """A screenshot of one element (a whole 1,000-child page is too tall to look at)."""
    path = tmp_path / name
    element.screenshot(path=path)
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(SCREENSHOTS) / name)


def _bar_ms(page: Page, task_id: str) -> int:
    """The milliseconds a task's bar covers on the page (an open segment ends at the page's now)."""
    spans = page.eval_on_selector_all(
        f".tl-row[data-task-id='{task_id}'] rect.seg:not(.end):not(.tool)",
        "rects => rects.map(r => Number(r.dataset.endMs) - Number(r.dataset.startMs))",
    )
    return int(sum(spans))


def _assert_bars_equal_api(page: Page, node: dict[str, Any]) -> int:
    """Each task's bar: its start and end, cost and tokens, and each interval equal the API's."""
    row = page.locator(f".tl-row[data-task-id='{node['id']}']")
    times = node["times"]
    assert row.get_attribute("data-start-ms") == str(times["queued_at_ms"])
    assert row.get_attribute("data-end-ms") == ("" if times["ended_at_ms"] is None else str(times["ended_at_ms"]))
    assert row.get_attribute("data-cost-micros") == str(node["total_cost_micros"])
    assert row.get_attribute("data-tokens") == str(node["total_tokens"])
    segments = row.locator("rect.seg:not(.end):not(.tool)")
    assert segments.count() == len(times["intervals"])
    for n, interval in enumerate(times["intervals"]):
        rect = segments.nth(n)
        state = interval["state"] if interval["reason"] is None else f"wait-{interval['reason']}"
        assert rect.get_attribute("data-state") == state
        assert rect.get_attribute("data-start-ms") == str(interval["start_ms"])
        assert rect.get_attribute("data-end-ms") == str(interval["end_ms"])
    return 1 + sum(_assert_bars_equal_api(page, child) for child in node["children"])


def test_bars_appear_live_and_equal_the_apis(
    page: Page, live_api: ApiServer, live_http: httpx.Client, tmp_path: Path
) -> None:
    steps = _slow(*[call("update_todo_list", todos=f"[-] step {n}") for n in range(3)], reply("done"))
    # Review's first call waits for an approval this test gives only once the bars have appeared: the tree is
    # held open until then, whatever the host's pace ("not completed yet" is not a moment the test can miss).
    review = subtask("Review", call("run_command", command="echo reviewing"), *steps[1:])
    root = _run_root(
        live_http,
        [
            call("update_todo_list", todos="[ ] Research\n[ ] Draft <script>alert(1)</script>\n[ ] Review"),
            call("run_subagents", tasks=[subtask("Research", *steps), subtask("Draft <b>x</b>", *steps), review]),
            call("attempt_completion", result="Report ready"),
        ],
        "Prepare the Q3 report",
    )  # fmt: skip
    _open_tree(page, live_api.url, root)
    # The children's bars appear while the tree runs, and grow with the next events: no reload.
    page.wait_for_function("() => document.querySelectorAll('.tl-row').length >= 4")
    expect(page.locator(".approval")).to_have_count(1)
    assert live_http.get(f"/v1/tasks/{root}").json()["status"] != "completed"
    (approval,) = live_http.get("/v1/approvals", params={"root_id": root}).json()["approvals"]
    child = approval["task_id"]
    first_ms = _bar_ms(page, child)
    decided = live_http.post(f"/v1/approvals/{approval['id']}", json={"decision": "approve"})
    assert decided.status_code == 200, decided.text
    # In ms, not in width: a bar's width is its share of a tree that grows too.
    page.wait_for_function(
        f"""() => [...document.querySelectorAll(".tl-row[data-task-id='{child}'] rect.seg:not(.end):not(.tool)")]
                  .reduce((ms, r) => ms + Number(r.dataset.endMs) - Number(r.dataset.startMs), 0)
                  >= {first_ms} + {SLOW_STEP_MS}"""
    )
    expect(page.locator(f"#task-{root}")).to_have_attribute("data-state", "completed", timeout=WAIT_MS)
    # The timeline is redrawn by its own refresh, which may come a moment after the tree's (seen once under
    # load: a row still without its end): every bar has ended before they are compared with the API.
    page.wait_for_function(
        "() => [...document.querySelectorAll('.tl-row')].every(r => r.getAttribute('data-end-ms'))", timeout=WAIT_MS
    )
    assert page.evaluate("window.subqNoReload") is True, "the page was reloaded"
    api_tree = live_http.get(f"/v1/tasks/{root}/tree").json()
    assert _assert_bars_equal_api(page, api_tree) == 4
    # The critical path: the root and the child that closed its batch, whose end is the root's wait's end (one
    # script writes both on that child's clock; any of them, when two ended in the same ms). Not always the latest
    # end: a sibling's end taken a few ms later can run its script first, under load (seen: 747 closed, 749 not).
    ends = {c["id"]: c["times"]["ended_at_ms"] for c in api_tree["children"]}
    (waited,) = [i for i in api_tree["times"]["intervals"] if i["reason"] == "children"]
    closers = [child_id for child_id, end_ms in ends.items() if end_ms == waited["end_ms"]]
    stars = page.locator(".tl-row.critical")
    starred = [stars.nth(n).get_attribute("data-task-id") for n in range(stars.count())]
    assert len(starred) == 2 and starred[0] == root, starred
    assert starred[1] in closers, f"starred {starred[1]}, the batch's wait {waited}, ends {ends}"
    # Model text stays text: no element came from it.
    assert page.locator(".timeline script, .timeline b").count() == 0
    expect(page.locator(".tl-row", has_text="Draft <b>x</b>")).to_have_count(1)
    # Hovering a bar shows its figures; focusing one (the keyboard) does too; a bar links to its task.
    tip = page.locator(f"#tip-{child}")
    expect(tip).to_be_hidden()
    page.locator(f".tl-row[data-task-id='{child}'] .tl-bar").hover()
    expect(tip).to_be_visible()
    expect(tip).to_contain_text("wall")
    expect(tip).to_contain_text("running")
    page.mouse.move(0, 0)
    page.locator(f".tl-row[data-task-id='{child}'] a.tl-link").focus()
    expect(tip).to_be_visible()
    _shot(page, tmp_path, "web-timeline.png")
    assert page.locator(f".tl-row[data-task-id='{child}'] a.tl-link").get_attribute("href") == f"/ui/tasks/{child}"
    # On a narrow screen the rows stack: the bar keeps the whole width, nothing overflows the page.
    page.set_viewport_size({"width": 390, "height": 844})
    box = page.locator("section.timeline").bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390
    assert page.evaluate(
        "() => { const t = document.querySelector('section.timeline'); return t.scrollWidth <= t.clientWidth; }"
    )
    bar = page.locator(f".tl-row[data-task-id='{child}'] .tl-bar").bounding_box()
    assert bar is not None and bar["width"] > 300
    page.locator(f".tl-row[data-task-id='{child}'] a.tl-link").blur()
    _shot_of(page.locator("section.timeline"), tmp_path, "web-timeline-narrow.png")


@pytest.fixture
def wide_api(idle_coordinator: Coordinator) -> Iterator[tuple[Coordinator, ApiServer]]:
    """An API over a queue no worker takes, which may delegate 1,000 children at once."""
    coord = Coordinator(api_settings(idle_coordinator.settings, max_fanout=WIDE_CHILDREN))
    with ApiServer(create_app(coordinator=coord)) as server:
        yield coord, server
    coord.close()


@pytest.mark.alone  # a bound in ms against the outside: run with no other test beside it
def test_a_1000_child_tree_renders_within_its_bound(
    browser: Browser, wide_api: tuple[Coordinator, ApiServer], tmp_path: Path
) -> None:
    coord, server = wide_api
    root = coord.create_task("a wide fan-out")
    children = coord.delegate(
        root.id, [{"description": f"part {n}", "message": "do it"} for n in range(WIDE_CHILDREN)]
    ).child_ids
    for n, child in enumerate(children):  # most ended, a few failed, the rest still queued
        if n % 10:
            coord.store.runs.finish_task(child, "failed" if n % 97 == 0 else "completed", summary="done")
    page = _signed_in(browser, server.url)
    try:
        # Drawn twice, the best counted: the first load also compiles the templates, and a loaded CI host
        # (the suite runs two test processes and their worker fleets on two cores) can stall either.
        took: list[tuple[float, Any]] = []
        for _ in range(2):
            started = time.monotonic()
            page.goto(f"{server.url}/ui/tasks/{root.id}")
            expect(page.locator(".tl-group")).to_have_count(1)
            drawn_s = time.monotonic() - started
            timing = page.evaluate(
                """() => { const n = performance.getEntriesByType('navigation')[0];
                           return {server_ms: Math.round(n.responseStart - n.requestStart),
                                   dom_ms: Math.round(n.domContentLoadedEventEnd - n.responseEnd)}; }"""
            )
            took.append((drawn_s, timing))
        print(f"1,000-child tree drawn in {[f'{s:.2f} s {t}' for s, t in took]}")
        assert min(s for s, _ in took) < RENDER_BUDGET_S * LOADED_MARGIN, f"the page took {took}"
        group = page.locator(".tl-group")
        shown = page.locator("section.timeline > ol.tl-rows > li.tl-row").count()  # the root and the latest
        assert group.get_attribute("data-count") == str(WIDE_CHILDREN + 1 - shown)
        _shot_of(page.locator("section.timeline"), tmp_path, "web-timeline-wide.png")
        # Below, the tree folds the same children into one table (a row each, linking to its page).
        folded = page.locator(".folded-children")
        assert folded.get_attribute("data-count") == group.get_attribute("data-count")
        expect(folded.locator("tbody tr")).to_have_count(int(group.get_attribute("data-count") or 0))
        # The group opens on demand, with every sibling's bar, and stays open through the live updates.
        group.locator("summary").click()
        total = page.locator(".tl-row").count()
        assert total == WIDE_CHILDREN + 1
        refreshes = int(page.locator("#tree").get_attribute("data-refreshes") or 0)
        coord.store.runs.finish_task(children[0], "completed", summary="late")  # an event on the tree's stream
        page.wait_for_function(f"() => Number(document.getElementById('tree').dataset.refreshes) > {refreshes}")
        expect(page.locator(".tl-group details")).to_have_attribute("open", "")
    finally:
        page.context.close()
