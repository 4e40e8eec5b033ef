"""Tenants in the web view, in a real browser (Playwright driving /usr/bin/chromium): an operator key sees
each tenant's running, waiting, roots, submits and spend against its quotas above the roots, and a
tenant's link filters the roots to its trees; a key without `operate` sees no tenants. Set
WEB_SCREENSHOTS_DIR to keep the screenshots.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect

from coordinator import Coordinator, Settings
from coordinator.access import token_sha256
from coordinator.api import create_app
from coordinator.tenants import TenantPolicy
from tests.helpers import ApiServer
from tests.test_web_browser import _shot
from tests.test_web_browser import browser as browser  # the module's browser fixture, used here too

PREFIX = "subqtenantweb"
OPS, READER = "web-ops-" + "z" * 20, "web-reader-" + "z" * 20


@pytest.fixture
def server(settings: Settings, tmp_path: Path) -> Iterator[tuple[Coordinator, ApiServer]]:
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "ops": {"token_sha256": token_sha256(OPS), "scopes": ["operate", "read_all"]},
                "reader": {"token_sha256": token_sha256(READER), "scopes": ["read"], "tenant": "acme"},
            }
        )
    )
    own = settings.model_copy(
        update={
            "key_prefix": PREFIX,
            "queue": "subq-tenant-web-idle",
            "api_keys_file": keys,
            "tenants": {"acme": TenantPolicy(submits_per_minute=10, max_cost_micros_per_day=50_000)},
        }
    )
    coord = Coordinator(own)
    with ApiServer(create_app(own, coordinator=coord)) as api:
        yield coord, api
    for key in coord.client.scan_iter(f"{PREFIX}:*"):
        coord.client.delete(key)
    coord.close()


def _signed_in(browser: Browser, url: str, token: str) -> Page:
    page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
    page.set_default_timeout(30_000)
    page.goto(f"{url}/ui/login")
    page.fill("input[name=token]", token)
    page.click("form.login button[type=submit]")
    expect(page.locator("h1")).to_have_text("Roots")
    return page


def test_an_operator_sees_each_tenants_use_against_its_quotas(
    browser: Browser, server: tuple[Coordinator, ApiServer], tmp_path: Path
) -> None:
    coord, api = server
    first = coord.create_task("Acme's quarterly report", tenant="acme", priority=4)
    coord.create_task("Acme's second tree", tenant="acme")
    coord.create_task("Globex's tree", tenant="globex")
    coord.store.quotas.count_spend("acme", f"{first.id}:1:1", 30_000)

    page = _signed_in(browser, api.url, OPS)
    try:
        rows = page.locator("table.tenants tbody tr")
        expect(rows).to_have_count(2)
        acme = page.locator("table.tenants tr[data-tenant=acme]")
        cells = acme.locator("td").all_inner_texts()
        assert cells == ["acme", "0", "0", "2", "2 / 10", "$0.030000 / $0.050000"], cells
        globex = page.locator("table.tenants tr[data-tenant=globex] td").all_inner_texts()
        assert globex[0] == "globex *" and globex[3] == "1", globex
        _shot(page, tmp_path, "web-tenants.png")

        acme.locator("a").click()
        expect(page.locator("form.filters input[name=tenant]")).to_have_value("acme")
        roots = page.locator("table.roots tbody tr")
        expect(roots).to_have_count(2)
        assert set(roots.locator("td.tenant").all_inner_texts()) == {"acme"}
        # A tenant that is no name is the page's error, naming the field.
        page.fill("form.filters input[name=tenant]", "no such/tenant")
        page.click("form.filters button[type=submit]")
        error = page.locator("p.error")
        expect(error).to_contain_text("a tenant is 1 to 64 letters")
        assert error.get_attribute("data-field") == "tenant"
    finally:
        page.context.close()

    reader = _signed_in(browser, api.url, READER)
    try:
        assert reader.locator("table.tenants").count() == 0, "only an operate key sees the tenants"
    finally:
        reader.context.close()
