"""subq's web view: the operator's view of trees in a browser, served by `subq api` under /ui.

    routes.py     the pages, the live fragment and stream, the actions (approve, deny, cancel, retry)
    views.py      what a page shows, read through the Coordinator (roots, a tree)
    auth.py       the session cookie, signed in with SUBQ_API_TOKEN
    templates/    Jinja2 templates (server-rendered HTML)
    static/       one script and one stylesheet, shipped in the wheel (no CDN, no build step)

See docs/web.md.
"""

from __future__ import annotations

from coordinator.web.routes import WEB_PATH, install_web

__all__ = ["WEB_PATH", "install_web"]
