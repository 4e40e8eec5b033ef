"""The web view in a real browser: Playwright driving the system's Chromium (/usr/bin/chromium).

Trees run for real (the session's Redis and `celery worker` processes, the
offline model playing scripts); the page is the one `subq api` serves. Each
test checks what an operator sees and does: costs of plan items appearing
live while children run, with no reload; an approval approved (and one denied
with feedback) from the page, the children going on; a cancel from the page
stopping a subtree; the numbers on the page equal to the API's.

Chromium comes from the OS packages (`./scripts/test` installs it when it is
missing); Playwright only drives it and never downloads a browser. One browser serves the whole file.
Set WEB_SCREENSHOTS_DIR to keep the screenshots (docs/img/ was made so).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Dialog, Page, expect, sync_playwright

from coordinator import Coordinator
from coordinator.models import format_usd
from tests.agents import call, reply, subtask
from tests.helpers import TOKEN, ApiServer, eventually, script

CHROMIUM = "/usr/bin/chromium"
# Debian's Chromium, headless, as root in a container with no network: no sandbox, no GPU,
# and none of the background connections (updates, sync, QUIC) that would be refused here.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Long enough for a loaded CI host to run a small tree; each wait ends as soon as it holds.
WAIT_MS = 90_000
# Playwright's `expect` keeps its own 5-s default, which `page.set_default_timeout` does not change: on a
# host with both cores busy a cancel took longer than that to reach the page (a root still `delegated` after
# 5 s, its sibling's run not yet stopped). Every browser test imports this module, so all of them wait as
# long as a page action does; an expectation that holds returns at once, one that never holds fails later.
expect.set_options(timeout=WAIT_MS)
# A child's step takes this long, so the page can be seen changing while children run.
SLOW_STEP_MS = 700
SCREENSHOTS = os.environ.get("WEB_SCREENSHOTS_DIR", "")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: install Debian's chromium (./scripts/test does)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, live_api: ApiServer) -> Iterator[Page]:
    """A fresh browser context, signed in through the login form."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{live_api.url}/ui/")
    expect(page).to_have_url(f"{live_api.url}/ui/login?next=%2Fui%2F")
    page.fill("input[name=token]", TOKEN)
    page.click("form.login button[type=submit]")
    expect(page.locator("h1")).to_have_text("Roots")
    yield page
    context.close()


def _run_root(http: httpx.Client, steps: list[dict[str, Any]], text: str) -> str:
    response = http.post("/v1/tasks", json={"prompt": script(*steps, text=text), "run": True})
    assert response.status_code == 201, response.text
    root_id: str = response.json()["id"]
    return root_id


def _slow(*steps: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**step, "latency_ms": SLOW_STEP_MS} for step in steps]


def _open_tree(page: Page, url: str, task_id: str) -> None:
    page.goto(f"{url}/ui/tasks/{task_id}")
    expect(page.locator(f"#task-{task_id}")).to_be_visible()
    # A mark on the window: it survives every live update and would vanish with a reload.
    page.evaluate("window.subqNoReload = true")


def _shot(page: Page, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    page.screenshot(path=path, full_page=True)
    assert path.stat().st_size > 10_000
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(SCREENSHOTS) / name)


def _item_costs(page: Page, task_id: str) -> list[int]:
    cells = page.locator(f"#task-{task_id} > table.todos [data-field=item-cost] .usd")
    return [int(cells.nth(n).get_attribute("data-micros") or "-1") for n in range(cells.count())]


def _assert_page_equals_api(page: Page, node: dict[str, Any]) -> int:
    """Every figure of `node`'s subtree on the page equals the API's tree; returns how many tasks were checked."""
    section = page.locator(f"#task-{node['id']}")

    def shown(field: str, scope: Any = section) -> tuple[str, str]:
        cell = scope.locator(f":scope > [data-field={field}], :scope > tbody > tr > [data-field={field}]").first
        inner = cell.locator("[data-micros], [data-tokens]").first
        return (inner.get_attribute("data-micros") or inner.get_attribute("data-tokens") or "", inner.inner_text())

    figures = section.locator(":scope > table.figures")
    assert shown("own-tokens", figures) == (str(node["tokens"]), f"{node['tokens']:,}")
    assert shown("own-cost", figures) == (str(node["cost_micros"]), format_usd(node["cost_micros"]))
    assert shown("total-tokens", figures) == (str(node["total_tokens"]), f"{node['total_tokens']:,}")
    assert shown("total-cost", figures) == (str(node["total_cost_micros"]), format_usd(node["total_cost_micros"]))
    rows = section.locator(":scope > table.todos > tbody > tr.todo")
    assert rows.count() == len(node["todos"])
    for n, item in enumerate(node["todos"]):
        row = rows.nth(n)
        assert row.get_attribute("data-todo-id") == item["id"]
        assert row.get_attribute("data-subtask-id") == (item["subtask_id"] or "")
        tokens = row.locator("[data-field=item-tokens] [data-tokens]")
        cost = row.locator("[data-field=item-cost] [data-micros]")
        assert (tokens.get_attribute("data-tokens"), tokens.inner_text()) == (
            str(item["tokens"]),
            f"{item['tokens']:,}",
        )
        assert (cost.get_attribute("data-micros"), cost.inner_text()) == (
            str(item["cost_micros"]),
            format_usd(item["cost_micros"]),
        )
    unlinked = section.locator(":scope > table.todos tr.unlinked")
    assert unlinked.count() == (1 if node["unlinked_cost_micros"] or node["unlinked_tokens"] else 0)
    state = section.get_attribute("data-state")
    assert state == node["status"], (node["id"], state, node["status"])
    return 1 + sum(_assert_page_equals_api(page, child) for child in node["children"])


def test_costs_appear_live_and_equal_the_apis(
    page: Page, live_api: ApiServer, live_http: httpx.Client, tmp_path: Path
) -> None:
    worker_steps = _slow(*[call("update_todo_list", todos=f"[-] step {n}") for n in range(3)], reply("done"))
    nested = subtask("Draft", call("new_task", **subtask("Draft: figures", *worker_steps)), reply("drafted"))
    # Review's first call waits for an approval this test gives only once the page has shown a cost: the tree
    # is held open until then, whatever the host's pace (a loaded host once saw it end before the page's
    # first update, and "not completed yet" was a moment the test could miss).
    review = subtask("Review", call("run_command", command="echo reviewing"), *worker_steps)
    root = _run_root(
        live_http,
        [
            call("update_todo_list", todos="[ ] Research\n[ ] Draft\n[ ] Review"),
            call("run_subagents", tasks=[subtask("Research", *worker_steps), nested, review]),
            call("update_todo_list", todos="[x] Research\n[x] Draft\n[x] Review"),
            call("attempt_completion", result="Report ready"),
        ],
        "Prepare the Q3 report",
    )
    _open_tree(page, live_api.url, root)
    # An item's cost shows while the tree still runs, with no reload.
    page.wait_for_function(
        f"""() => [...document.querySelectorAll('#task-{root} > table.todos [data-field=item-cost] .usd')]
                  .some(cell => Number(cell.dataset.micros) > 0)"""
    )
    first_seen = _item_costs(page, root)
    assert max(first_seen) > 0
    assert live_http.get(f"/v1/tasks/{root}").json()["status"] != "completed"
    expect(page.locator(".approval")).to_have_count(1)  # Review's run may start after the cost showed
    waiting = live_http.get("/v1/approvals", params={"root_id": root}).json()["approvals"]
    assert [approval["args"]["command"] for approval in waiting] == ["echo reviewing"], waiting
    decided = live_http.post(f"/v1/approvals/{waiting[0]['id']}", json={"decision": "approve"})
    assert decided.status_code == 200, decided.text
    # Then the tree runs to its end, the page following it.
    expect(page.locator(f"#task-{root}")).to_have_attribute("data-state", "completed", timeout=WAIT_MS)
    expect(page.locator("#live")).to_have_attribute("data-state", "ended")
    assert page.evaluate("window.subqNoReload") is True, "the page was reloaded"
    # Followed, not reloaded: at least one refresh in place brought the later costs (how many depends on the
    # host's pace: events that come during a fetch are folded into one more).
    assert int(page.locator("#tree").get_attribute("data-refreshes") or 0) >= 1
    final = _item_costs(page, root)
    assert all(cost > 0 for cost in final) and sum(final) > sum(first_seen)
    api_tree = live_http.get(f"/v1/tasks/{root}/tree").json()
    assert _assert_page_equals_api(page, api_tree) == 5
    assert page.locator(f"#task-{root} > table.todos tr.t-completed").count() == 3
    # A plan item's child is one click away.
    draft_child = api_tree["todos"][1]["subtask_id"]
    page.locator(f"#task-{root} > table.todos a.child-link").nth(1).click()
    expect(page).to_have_url(f"{live_api.url}/ui/tasks/{root}#task-{draft_child}")
    page.evaluate("window.scrollTo(0, 0)")
    _shot(page, tmp_path, "web-tree.png")
    # The child's conversation and UI messages are readable.
    page.locator(f"#task-{draft_child} a.convo").first.click()
    expect(page.locator("ol.ui-messages li.msg").first).to_be_visible()
    expect(page.locator("ol.model-messages")).to_contain_text("new_task")
    expect(page.locator("ol.model-messages")).to_contain_text("drafted")


def _accept_with(text: str | None = None) -> Any:
    def answer(dialog: Dialog) -> None:
        if text is None:
            dialog.accept()
        else:
            dialog.accept(text)

    return answer


def test_approvals_from_the_page(
    page: Page, live_api: ApiServer, live_http: httpx.Client, live: Coordinator, tmp_path: Path
) -> None:
    deploy = subtask("Deploy", call("run_command", command="echo deploying 2.0"), reply("deployed"))
    migrate = subtask("Migrate", call("run_command", command="rm -rf /var/db"), reply("migrated another way"))
    root = _run_root(
        live_http,
        [
            call("update_todo_list", todos="[ ] Deploy\n[ ] Migrate"),
            call("run_subagents", tasks=[deploy, migrate]),
            call("attempt_completion", result="Released"),
        ],
        "Release 2.0",
    )
    _open_tree(page, live_api.url, root)
    boxes = page.locator(".approval")
    expect(boxes).to_have_count(2)  # both arrive live, with no reload
    approvals = {
        a["args"]["command"]: a for a in live_http.get("/v1/approvals", params={"root_id": root}).json()["approvals"]
    }
    _shot(page, tmp_path, "web-approval.png")

    # A refusal by the server is shown as the server said it: a cancel with an empty reason.
    page.once("dialog", _accept_with(""))
    page.locator(f"#task-{root} > .task-head button.cancel").click()
    expect(page.locator("#action-error")).to_contain_text(
        "Refused (422 invalid_input): reason must be a non-empty string"
    )
    assert live_http.get(f"/v1/tasks/{root}").json()["status"] != "cancelled"

    # A dismissed confirmation sends nothing.
    deny_id = approvals["rm -rf /var/db"]["id"]
    page.fill(f"#feedback-{deny_id}", "Never delete the database; migrate it with the tool")
    page.once("dialog", lambda dialog: dialog.dismiss())
    page.locator(f"button.deny[data-approval-id='{deny_id}']").click()
    assert len(live_http.get("/v1/approvals", params={"root_id": root}).json()["approvals"]) == 2

    approve_id = approvals["echo deploying 2.0"]["id"]
    page.once("dialog", _accept_with())
    page.locator(f"button.approve[data-approval-id='{approve_id}']").click()
    expect(page.locator(f"#approval-{approve_id}")).to_have_count(0)
    # The typed feedback survived the live update that removed the other box.
    expect(page.locator(f"#feedback-{deny_id}")).to_have_value("Never delete the database; migrate it with the tool")
    page.once("dialog", _accept_with())
    page.locator(f"button.deny[data-approval-id='{deny_id}']").click()

    # Both children go on and complete; so does the root.
    expect(page.locator(f"#task-{root}")).to_have_attribute("data-state", "completed", timeout=WAIT_MS)
    deploy_id, migrate_id = approvals["echo deploying 2.0"]["task_id"], approvals["rm -rf /var/db"]["task_id"]
    for child in (deploy_id, migrate_id):
        assert live_http.get(f"/v1/tasks/{child}").json()["status"] == "completed"
        expect(page.locator(f"#task-{child}")).to_have_attribute("data-state", "completed")
    recorded = live.messages(deploy_id, "ui")
    said = [(m.get("say"), m.get("text")) for m in recorded if m.get("say", "").startswith("command")]
    assert said == [("command", "echo deploying 2.0"), ("command_result", "exit 0\ndeploying 2.0\n")], "it ran"
    conversation = str(live.messages(migrate_id, "api"))
    assert "Never delete the database; migrate it with the tool" in conversation
    assert page.evaluate("window.subqNoReload") is True


def test_cancel_from_the_page_stops_a_subtree(
    page: Page, live: Coordinator, live_api: ApiServer, live_http: httpx.Client
) -> None:
    long_steps = _slow(*[call("update_todo_list", todos=f"[-] step {n}") for n in range(40)], reply("done"))
    branch = subtask("Branch", call("new_task", **subtask("Leaf", *long_steps)), reply("branch done"))
    root = _run_root(
        live_http,
        [
            call("update_todo_list", todos="[ ] Branch\n[ ] Sibling"),
            call("run_subagents", tasks=[branch, subtask("Sibling", *long_steps)]),
            call("attempt_completion", result="never reached"),
        ],
        "Two long jobs",
    )
    _open_tree(page, live_api.url, root)

    def tree() -> dict[str, Any]:
        return dict(live_http.get(f"/v1/tasks/{root}/tree").json())

    deadline = time.monotonic() + WAIT_MS / 1000
    while len((current := tree())["children"]) < 2 or not current["children"][0]["children"]:
        assert time.monotonic() < deadline, "the tree did not grow"
        time.sleep(0.1)
    branch_id = current["children"][0]["id"]
    leaf_id = current["children"][0]["children"][0]["id"]
    sibling_id = current["children"][1]["id"]
    expect(page.locator(f"#task-{leaf_id}")).to_have_attribute("data-state", "running")

    page.once("dialog", _accept_with("stop the branch from the page"))
    page.locator(f"#task-{branch_id} > .task-head button.cancel").click()
    expect(page.locator(f"#task-{leaf_id}")).to_have_attribute("data-state", "cancelled")
    expect(page.locator(f"#task-{branch_id}")).to_have_attribute("data-state", "cancelled")
    for task_id in (branch_id, leaf_id):
        record = live_http.get(f"/v1/tasks/{task_id}").json()
        assert record["status"] == "cancelled" and "stop the branch from the page" in record["error"]
    # The sibling is outside the cancelled subtree: it still runs.
    assert live_http.get(f"/v1/tasks/{sibling_id}").json()["status"] not in ("cancelled", "failed")
    # A response the leaf's run had in hand as the stop landed is recorded after it (late spend): read its cost
    # once the run has let go.
    eventually(lambda: not live.finishing([leaf_id]), "the leaf's stopped run to let go")
    spent = live_http.get(f"/v1/tasks/{leaf_id}").json()["cost_micros"]

    page.once("dialog", _accept_with("stop everything"))
    page.locator(f"#task-{root} > .task-head button.cancel").click()
    expect(page.locator(f"#task-{root}")).to_have_attribute("data-state", "cancelled")
    expect(page.locator(f"#task-{sibling_id}")).to_have_attribute("data-state", "cancelled")
    expect(page.locator("#live")).to_have_attribute("data-state", "ended")
    # The figures are final once the stream has ended: the refresh its end asked for shows them.
    final_tokens = live_http.get(f"/v1/tasks/{root}").json()["total_tokens"]
    total = page.locator(f"#task-{root} > table.figures [data-field=total-tokens] [data-tokens]").first
    expect(total).to_have_attribute("data-tokens", str(final_tokens))
    # Nothing was recorded on the stopped leaf after its stop, and the page shows what the API shows.
    time.sleep(2 * SLOW_STEP_MS / 1000)
    assert live_http.get(f"/v1/tasks/{leaf_id}").json()["cost_micros"] == spent
    assert page.locator("button.cancel").count() == 0
    _assert_page_equals_api(page, tree())
