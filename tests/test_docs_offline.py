"""`/docs` and `/redoc` work without internet: every script, style and icon comes from the API itself.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so `/docs` was blank on a
host without internet (issue 12). A real uvicorn server answers here; each page's
`src`/`href` is checked to stay on that server, and each asset is fetched from it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from coordinator import Coordinator, Settings
from coordinator.api import create_app
from coordinator.api.app import DOCS_ASSETS_URL
from tests.helpers import ApiServer, api_settings

# Every URL a page makes the browser load: script src, stylesheet and icon href, and url(...) in inline styles.
ASSET_REF = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|url\(\s*["']?([^"')]+)""")
# Swagger UI's bundle is about 1.4 MB and ReDoc's about 1 MB: a stub or an error page is far smaller.
MIN_SCRIPT_BYTES = 100_000


@pytest.fixture(scope="module")
def docs_api(settings: Settings) -> Iterator[ApiServer]:
    coord = Coordinator(api_settings(settings, key_prefix="subqdocs", queue="subq-docs-idle"))
    try:
        with ApiServer(create_app(coordinator=coord)) as server:
            yield server
    finally:
        coord.close()


def _assets(page_url: str, html: str) -> list[str]:
    refs = [a or b for a, b in ASSET_REF.findall(html)]
    return [urljoin(page_url, ref) for ref in refs if not ref.startswith(("#", "data:"))]


@pytest.mark.parametrize(("page", "script"), [("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")])
def test_docs_page_loads_every_asset_from_the_api(docs_api: ApiServer, page: str, script: str) -> None:
    # No Authorization header: the docs are open, like /openapi.json.
    with httpx.Client(base_url=docs_api.url, timeout=30) as http:
        response = http.get(page)
        assert response.status_code == 200, response.text
        page_url = f"{docs_api.url}{page}"
        assets = _assets(page_url, response.text)
        assert f"{docs_api.url}{DOCS_ASSETS_URL}/{script}" in assets, assets
        here = urlsplit(docs_api.url).netloc
        foreign = [url for url in assets if urlsplit(url).netloc != here]
        assert not foreign, f"{page} loads from outside the API: {foreign}"
        for url in assets:
            asset = http.get(url)
            assert asset.status_code == 200, f"{url}: {asset.status_code}"
            if url.endswith(".js"):
                assert len(asset.content) > MIN_SCRIPT_BYTES, (url, len(asset.content))
        if page == "/docs":  # no badge from Swagger's online validator either
            assert '"validatorUrl": null' in response.text
        # The page points the UI at the API's own schema, which the same server serves.
        assert "/openapi.json" in response.text
        assert http.get("/openapi.json").json()["info"]["title"] == "subq"
