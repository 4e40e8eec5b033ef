"""A compacted run on the web view's timeline, in a real browser (Playwright driving /usr/bin/chromium): a
violet tick on its bar at each moment its run compacted, as many as its record's `times.compactions_ms`, and
its tip counting them. Set WEB_SCREENSHOTS_DIR to keep the screenshot.
"""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Browser, expect

from coordinator import Coordinator, TaskStatus
from coordinator.api import create_app
from tests.helpers import ApiServer, api_settings
from tests.test_compaction import LONG_SCRIPT, Fleet
from tests.test_compaction import fleet as fleet  # the module's fleet, used here too
from tests.test_timeline_browser import _signed_in
from tests.test_web_browser import _shot
from tests.test_web_browser import browser as browser  # the module's browser fixture, used here too
from workers.runtime.script import script_message


def test_a_compacted_run_shows_its_compactions_on_the_timeline(fleet: Fleet, browser: Browser, tmp_path: Path) -> None:
    coord = fleet.coord
    task = coord.create_task(script_message("Read the chunks.", LONG_SCRIPT), profile="offline-small", run=True)
    done = coord.wait(task.id, 120)
    assert done.status == TaskStatus.COMPLETED, done.error
    compacted_ms = done.times.compactions_ms if done.times else []
    assert compacted_ms, "the long script compacted"

    api_coord = Coordinator(api_settings(coord.settings))
    try:
        with ApiServer(create_app(coordinator=api_coord)) as api:
            page = _signed_in(browser, api.url, height=700)
            page.goto(f"{api.url}/ui/tasks/{task.id}")
            row = page.locator(f'#timeline .tl-row[data-task-id="{task.id}"]')
            expect(row).to_have_attribute("data-state", "completed")
            ticks = row.locator("rect.seg.compacted")
            assert [int(ticks.nth(i).get_attribute("data-compacted-ms") or 0) for i in range(ticks.count())] == (
                compacted_ms
            )
            times = len(compacted_ms)
            tip = row.locator(".tl-tip")
            assert f"context compacted {times} time{'' if times == 1 else 's'}" in (tip.text_content() or "")
            expect(page.locator("#timeline .tl-legend")).to_contain_text("context compacted")
            row.locator(".tl-link").hover()
            _shot(page, tmp_path, "timeline-compacted.png")
            page.context.close()
    finally:
        api_coord.close()
