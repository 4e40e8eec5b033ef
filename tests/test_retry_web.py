"""The web view's Retry (issue 33, point 6): in a real browser (Playwright driving /usr/bin/chromium) on a
tree a real `celery worker` ran against a provider on loopback, and offered only to a key that may write
the tree.

A failed child whose parent went on is refused from the page with why; its failed parent's "Retry with
failed children" re-opens their batch: the child runs again, the parent resumes with the new results,
and the tree completes, its figures on the page equal to the API's. Set WEB_SCREENSHOTS_DIR to keep the
screenshot.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, expect

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.api import create_app
from coordinator.celery_app import make_app
from tests.conftest import dedicated_fleet
from tests.helpers import REQUEST_TIMEOUT_S, TOKEN, ApiServer, api_settings
from tests.model_server import ModelServer, Turn, call
from tests.test_retry import KIDS, WAIT_S, in_process, micros, profile
from tests.test_security import KEY_TOKENS, _sign_in, keys_setting
from tests.test_web_browser import WAIT_MS, _accept_with, _shot
from tests.test_web_browser import browser as browser  # the module's browser fixture, used here too
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child

JSON = "application/json"


@pytest.fixture
def root_server() -> Iterator[ModelServer]:
    with ModelServer([Turn(calls=[call("run_subagents", tasks=KIDS)]), Turn(text="root done")]) as running:
        yield running


@pytest.fixture
def kid_server() -> Iterator[ModelServer]:
    with ModelServer([Turn(text="part done")]) as running:
        yield running


def test_retry_from_the_page(
    settings: Settings,
    browser: Browser,
    root_server: ModelServer,
    kid_server: ModelServer,
    tmp_path: Path,
) -> None:
    profiles = {**settings.profiles, "main": profile(root_server), "kid": profile(kid_server)}
    own = {"queue": "subq-retryweb", "key_prefix": "subqretryweb", "profiles": profiles}
    with dedicated_fleet(settings, tmp_path, 1, **own) as (coord, _fleet):
        kid_server.script([400])  # one child's request is refused
        root_server.script([200, 400])  # the root delegates, then its resumed request is refused
        root = coord.create_task("Do both parts.", profile="main", run=True, todos="[ ] part one\n[ ] part two")
        assert coord.wait(root.id, WAIT_S).status == TaskStatus.FAILED
        children = coord.get_children(root.id)
        (failed_child,) = [c for c in children if c.status == TaskStatus.FAILED]
        root_server.heal()
        kid_server.heal()

        api_coord = Coordinator(api_settings(coord.settings))
        with ApiServer(create_app(coordinator=api_coord)) as api, api.client() as http:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.set_default_timeout(WAIT_MS)
            page.goto(f"{api.url}/ui/login")
            page.fill("input[name=token]", TOKEN)
            page.click("form.login button[type=submit]")
            page.goto(f"{api.url}/ui/tasks/{root.id}")
            expect(page.locator(f"#task-{root.id}")).to_have_attribute("data-state", "failed")
            page.evaluate("window.subqNoReload = true")
            root_button = page.locator(f"#task-{root.id} > .task-head button.retry")
            child_button = page.locator(f"#task-{failed_child.id} > .task-head button.retry")
            expect(root_button).to_have_text("Retry with failed children")
            expect(child_button).to_have_text("Retry")
            assert page.locator("button.retry").count() == 2, "only the failed tasks offer it"
            _shot(page, tmp_path, "retry-before.png")

            page.once("dialog", _accept_with())
            child_button.click()
            error = page.locator("#action-error")
            expect(error).to_contain_text(f"Refused (409 wrong_state): task {failed_child.id} cannot be retried alone")
            expect(error).to_contain_text(f"retry the tree: subq retry {root.id} --failed")
            assert coord.get_task(failed_child.id).status == TaskStatus.FAILED, "the refusal changed nothing"

            page.once("dialog", _accept_with())
            root_button.click()
            expect(page.locator(f"#task-{root.id}")).to_have_attribute("data-state", "completed", timeout=WAIT_MS)
            expect(page.locator(f"#task-{failed_child.id}")).to_have_attribute("data-state", "completed")
            expect(page.locator(f"#task-{root.id} > .summary")).to_have_text("root done")
            assert page.locator("button.retry").count() == 0
            assert page.evaluate("window.subqNoReload") is True, "the page updated live, with no reload"
            _shot(page, tmp_path, "retry-after.png")

            record = http.get(f"/v1/tasks/{root.id}").json()
            total = page.locator(f"#task-{root.id} > .figures [data-field=total-cost] .usd")
            expect(total).to_have_attribute("data-micros", str(record["total_cost_micros"]))
            answered = len(root_server.answered()) + len(kid_server.answered())
            assert record["total_cost_micros"] == micros(answered) and record["retries"] == 1
            last = json.dumps(root_server.seen[-1].body)
            assert "2 of 2 completed" in last, "the root resumed with the new combined result"
            entries = http.get("/v1/audit").json()["entries"]
            assert [e["target"] for e in entries if e["action"] == "retry"] == [root.id]
            context.close()
        api_coord.close()


def test_the_retry_is_offered_only_to_a_key_that_may_write_the_tree(
    settings: Settings, root_server: ModelServer
) -> None:
    local = in_process(settings, root_server, "webkeys")
    coord = Coordinator(local)
    root_server.fail(400)
    task = coord.create_task("Look and report.", profile="main", run=True, owner="alice")
    assert run_child(build_runtime(local, make_app(local)), task.id).status == "failed"
    root_server.heal()
    app = create_app(local.model_copy(update={"api_keys": keys_setting()}), coordinator=coord)
    with ApiServer(app) as api:
        for name, offered, status in [("viewer", False, 403), ("bob", False, 404), ("alice", True, 200)]:
            with httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http:
                assert _sign_in(http, KEY_TOKENS[name]).status_code == 303
                page = http.get(f"/ui/tasks/{task.id}")
                assert page.status_code == (404 if name == "bob" else 200)
                assert ('data-action="retry"' in page.text) is offered, name
                # Alice's action has no body, as the API's may: the web's takes the same bodies.
                body: dict[str, Any] = {"json": {}} if name != "alice" else {"headers": {"Content-Type": JSON}}
                acted = http.post(f"/ui/actions/tasks/{task.id}/retry", **body)
                assert acted.status_code == status, (name, acted.text)
        # Alice's retry went through: the task runs again; the others changed nothing before it.
        assert coord.get_task(task.id).status == TaskStatus.ACTIVE and coord.get_task(task.id).retries == 1
    coord.close()
