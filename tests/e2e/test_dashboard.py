"""Every dashboard page loads in headless Chromium from a real uvicorn: no console errors, every
plotly chart rendered (plotly.js served locally, no network)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.api import browser
from tests.api.conftest import bare_app, make_settings
from tests.api.live import serve

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not browser.available(), reason=f"no chromium at {browser.CHROMIUM} "
                       "(Debian: apt-get install chromium; ./dev test installs it)"),
]

PAGES = ("/dashboard/", "/dashboard/releases", "/dashboard/sessions/{sid}", "/dashboard/memory",
         "/dashboard/findings", "/dashboard/switches")


@pytest.fixture(scope="module")
def site(tmp_path_factory, chdb_dir):
    from analytics.simulate import simulate_fleet
    from collector.store import open_store

    store = open_store(f"chdb://{chdb_dir}?database=t_{uuid.uuid4().hex[:12]}")
    store.migrate()
    simulate_fleet(store, weeks=2, incidents=[("august", 6)], workers=6, sessions_per_day=12, session_median_s=20,
                   seed=3)
    sid = store.query_rows("SELECT session_id FROM session_stats ORDER BY session_id LIMIT 1")[0][0]
    app = bare_app(store, make_settings(tmp_path_factory.mktemp("dash")))
    with serve(app) as base, browser.Chromium() as chromium:
        yield base, sid, chromium
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


def test_every_page_renders_every_chart_without_errors(site):
    base, sid, chromium = site
    for path in PAGES:
        url = base + path.format(sid=sid)
        res = chromium.load(url)
        assert res.errors == [], (url, res.errors)
        assert res.plotly == "object", url
        assert res.charts > 0 and res.rendered == res.charts, (url, res)


def test_plotly_js_is_served_locally(site):
    base, _, _ = site
    r = httpx.get(f"{base}/static/plotly.min.js")
    assert r.status_code == 200 and len(r.content) > 1_000_000 and b"plotly" in r.content[:2000].lower()
    page = httpx.get(f"{base}/dashboard/").text
    assert '<script src="/static/plotly.min.js">' in page and "cdn.plot.ly" not in page


def test_checker_sees_console_errors_and_missing_charts(site):
    _, _, chromium = site
    bad = ("data:text/html,<div class='plotly-graph-div'></div>"
           "<script>console.error('boom'); undefined_function();</script>")
    res = chromium.load(bad)
    assert any("boom" in e for e in res.errors) and any("undefined_function" in e for e in res.errors)
    assert res.charts == 1 and res.rendered == 0
