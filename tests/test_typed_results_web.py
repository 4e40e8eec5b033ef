"""A typed task's output in the web view, in a real browser (Playwright driving /usr/bin/chromium): the
validated object is shown as data, and markup a model put inside it never runs. Set WEB_SCREENSHOTS_DIR
to keep the screenshot.
"""

from __future__ import annotations

import json
from pathlib import Path

from playwright.sync_api import Browser, Dialog, expect

from tests.agents import call as script_call
from tests.helpers import script
from tests.test_timeline_browser import _signed_in
from tests.test_typed_results import WAIT_S, Typed
from tests.test_typed_results import typed as typed  # the module's fleet and API, used here too
from tests.test_web_browser import _shot
from tests.test_web_browser import browser as browser  # the module's browser fixture, used here too


def test_a_typed_output_is_data_on_the_page(typed: Typed, browser: Browser, tmp_path: Path) -> None:
    hostile = {"total": 2, "rows": [{"name": "<img src=x onerror=alert(1)>"}, {"name": "<script>alert(2)</script>"}]}
    prompt = script(script_call("attempt_completion", result="two rows", data=hostile), text="Count the rows.")
    root = typed.coord.create_task(prompt, profile="offline-typed", run=True)
    assert typed.coord.wait(root.id, timeout_s=WAIT_S).output == hostile

    dialogs: list[str] = []
    page = _signed_in(browser, typed.api.url, height=800)

    def seen(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", seen)  # before the page that shows the data
    page.goto(f"{typed.api.url}/ui/tasks/{root.id}")
    shown = page.locator(f"#task-{root.id} [data-field=output] pre")
    expect(shown).to_be_visible()
    # The page shows the object itself, as JSON text: what a program reads back is what a person sees.
    assert json.loads(shown.inner_text()) == hostile
    assert page.locator(f"#task-{root.id} [data-field=output] img").count() == 0
    assert page.locator(f"#task-{root.id} [data-field=output] script").count() == 0
    page.wait_for_timeout(300)  # an onerror handler would have fired by now
    assert dialogs == []
    _shot(page, tmp_path, "typed-output.png")
    page.context.close()
