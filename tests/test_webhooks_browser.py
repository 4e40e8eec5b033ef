"""A tree's deliveries in the web view, in a real browser (Playwright driving /usr/bin/chromium): an operator's
Redeliver button sends the event again, with the same webhook-id, after a confirmation; a key without `operate`
sees no button, and a POST of its own is refused. Set WEB_SCREENSHOTS_DIR to keep the screenshots.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Dialog, expect

from coordinator import Coordinator, Settings
from coordinator.access import ApiKeySpec, Scope, token_sha256
from coordinator.api import create_app
from coordinator.local.fleet import WorkerFleet
from tests.conftest import dedicated_fleet
from tests.helpers import ApiServer, api_settings, eventually
from tests.test_timeline_browser import _signed_in
from tests.test_web_browser import _shot
from tests.test_web_browser import browser as browser  # the module's browser fixture, used here too
from tests.test_webhooks import FLEET, PREFIX, SECRET, WAIT_S, _clean
from tests.webhook_kit import Receiver

READER = "reader-token-for-the-deliveries-panel-0123"


@pytest.fixture
def fleet(settings: Settings, tmp_path: Path) -> Iterator[tuple[Coordinator, WorkerFleet]]:
    with dedicated_fleet(settings, tmp_path / "workers", 1, **FLEET) as (coord, workers):
        yield coord, workers
        _clean(coord, PREFIX)


def test_an_operator_redelivers_from_the_tree_page_and_a_reader_cannot(
    browser: Browser, fleet: tuple[Coordinator, WorkerFleet], tmp_path: Path
) -> None:
    coord, _ = fleet
    keys = {"reader": ApiKeySpec(token_sha256=token_sha256(READER), scopes=[Scope.READ_ALL])}
    api = Coordinator(api_settings(coord.settings, api_keys=keys))
    dialogs: list[str] = []

    def confirm(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    with Receiver() as receiver, ApiServer(create_app(coordinator=api)) as server:
        root = coord.create_task("Plan.", webhooks=[{"url": receiver.url, "secret": SECRET}])
        coord.cancel(root.id, "enough")
        first = eventually(lambda: receiver.of_type("task.cancelled"), "task.cancelled", timeout_s=WAIT_S)
        (delivery,) = eventually(
            lambda: [d for d in coord.deliveries(root.id) if d.state == "delivered"] or None, "the delivery settled"
        )
        page = _signed_in(browser, server.url, height=800)
        page.on("dialog", confirm)
        try:
            page.goto(f"{server.url}/ui/tasks/{root.id}")
            row = page.locator(f'[id="delivery-{delivery.id}"]')  # the id has a dot: not a #selector
            expect(row).to_have_attribute("data-state", "delivered")
            _shot(page, tmp_path, "web-deliveries.png")
            row.locator("button[data-action=redeliver]").click()
            again = eventually(lambda: receiver.got[1:] or None, "the redelivery", timeout_s=WAIT_S)
            assert again[0].headers["webhook-id"] == first[0].headers["webhook-id"]
            assert dialogs == [f"Send task.cancelled ({delivery.id}) again now, with the same webhook-id?"]
            # The page shows the delivery as the action left it (sent again: pending, its attempts from 0), and
            # once it was delivered again, a reload shows that with its one attempt.
            expect(row).to_have_attribute("data-state", "pending")
            eventually(
                lambda: [d for d in coord.deliveries(root.id) if d.state == "delivered"] or None, "delivered again"
            )
            page.reload()
            expect(row).to_have_attribute("data-state", "delivered")
            expect(row.locator("td.num")).to_have_text("1")
            _shot(page, tmp_path, "web-deliveries-redelivered.png")
        finally:
            page.context.close()
        # A reader sees the panel, not the button, and the action refuses it (scope operate).
        reader = browser.new_context()
        reader_page = reader.new_page()
        try:
            reader_page.goto(f"{server.url}/ui/login")
            reader_page.fill("input[name=token]", READER)
            reader_page.click("form.login button[type=submit]")
            reader_page.goto(f"{server.url}/ui/tasks/{root.id}")
            expect(reader_page.locator(f'[id="delivery-{delivery.id}"]')).to_be_visible()
            assert reader_page.locator("button[data-action=redeliver]").count() == 0
            refused = reader_page.evaluate(
                """async (url) => (await fetch(url, {method: "POST", credentials: "same-origin",
                    headers: {"Content-Type": "application/json"}, body: "{}"})).status""",
                f"{server.url}/ui/actions/tasks/{root.id}/deliveries/{delivery.id}/redeliver",
            )
            assert refused == 403
        finally:
            reader.close()
        assert len(receiver.got) == 2, "the reader's POST sent nothing"
    api.close()
