"""A tree's metadata in the web view, in a real browser (Playwright driving /usr/bin/chromium): the roots
page's metadata filter lists only the tree tagged with it, with its tags; the tree's page shows them under
its top task; markup in a tag is text. Set WEB_SCREENSHOTS_DIR to keep the screenshots.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from playwright.sync_api import Browser, Dialog, expect

from coordinator import Coordinator
from tests.helpers import ApiServer
from tests.test_timeline_browser import _signed_in
from tests.test_web_browser import _shot
from tests.test_web_browser import browser as browser  # the module's browser fixture, used here too

HOSTILE = "<img src=x onerror=alert(1)>"


def test_the_roots_page_filters_by_metadata_and_the_tree_shows_it(
    browser: Browser, live: Coordinator, live_api: ApiServer, tmp_path: Path
) -> None:
    customer = f"acme-{uuid.uuid4().hex[:8]}"  # this test's own: the history holds other tests' trees
    tagged = live.create_task(
        "Prepare the Q3 report for acme",
        todos="[ ] Collect the figures",
        metadata={"customer": customer, "ticket": "T-1234", "note": HOSTILE},
    )
    live.create_task("Another customer's report", metadata={"customer": f"{customer}-other", "ticket": "T-1234"})
    live.create_task("Same customer, untagged ticket", metadata={"customer": customer.upper()})

    dialogs: list[str] = []

    def seen(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page = _signed_in(browser, live_api.url, height=700)
    page.on("dialog", seen)
    try:
        page.fill("form.filters input[name=meta]", f"customer={customer}")
        page.click("form.filters button[type=submit]")
        rows = page.locator("table.roots tbody tr")
        expect(rows).to_have_count(1)
        assert rows.first.get_attribute("data-task-id") == tagged.id
        # The filter stays in its field, as the API's `meta.customer`, and each tag is one pill.
        expect(page.locator("form.filters input[name=meta]")).to_have_value(f"customer={customer}")
        assert f"meta=customer%3D{customer}" in page.url
        tags = rows.first.locator("td.tags .tag")
        assert tags.all_inner_texts() == [f"customer={customer}", f"note={HOSTILE}", "ticket=T-1234"]
        assert rows.first.locator("td.tags img").count() == 0
        _shot(page, tmp_path, "web-metadata-filter.png")

        # A filter that is not key=value is the page's error, naming it.
        page.fill("form.filters input[name=meta]", "customer")
        page.click("form.filters button[type=submit]")
        error = page.locator("p.error")
        expect(error).to_have_text("meta 'customer' is not KEY=VALUE (e.g. customer=acme)")
        assert error.get_attribute("data-field") == "meta"

        page.goto(f"{live_api.url}/ui/tasks/{tagged.id}")
        shown = page.locator(f"#task-{tagged.id} [data-field=metadata]")
        expect(shown).to_be_visible()
        assert shown.locator(".tag").all_inner_texts() == [f"customer {customer}", f"note {HOSTILE}", "ticket T-1234"]
        assert shown.locator("img").count() == 0
        page.wait_for_timeout(300)  # an onerror handler would have fired by now
        assert dialogs == []
        _shot(page, tmp_path, "web-metadata-tree.png")
    finally:
        page.context.close()
