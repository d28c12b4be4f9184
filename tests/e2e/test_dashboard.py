"""Every dashboard page loads in headless Chromium from a real uvicorn: no console errors, every
plotly chart rendered (plotly.js served locally, no network); the FP8 saturation panels render on a
fleet whose sampled sessions include a saturating cohort, and the fleet panel's empty state too."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest

from analytics.queries import iso_week_of
from tests.api import browser
from tests.api.conftest import bare_app, make_settings
from tests.api.live import serve
from tests.collector.helpers import migrated_store

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not browser.available(), reason=f"no chromium at {browser.CHROMIUM} "
                       "(Debian: apt-get install chromium; ./dev test installs it)"),
]

PAGES = ("/dashboard/", "/dashboard/releases", "/dashboard/sessions", "/dashboard/sessions/{sid}", "/dashboard/memory",
         "/dashboard/findings", "/dashboard/switches", "/dashboard/reports", "/v1/reports/{week}.html")


@pytest.fixture(scope="module")
def site(tmp_path_factory, chdb_dir):
    from analytics.simulate import simulate_fleet
    from api.report import build_weekly_report

    store = migrated_store(chdb_dir)
    simulate_fleet(store, weeks=2, incidents=[("august", 6)], workers=6, sessions_per_day=12, session_median_s=20,
                   seed=3, fp8_drift=("august", "b200"))
    sid = store.query_rows("SELECT session_id FROM session_stats ORDER BY session_id LIMIT 1")[0][0]
    sat_sid = store.query_rows("SELECT session_id FROM session_stats GROUP BY session_id "
                               "ORDER BY max(fp8_sat_max) DESC, session_id LIMIT 1")[0][0]
    settings = make_settings(tmp_path_factory.mktemp("dash"))
    week = iso_week_of(datetime.now(UTC) - timedelta(days=7))
    build_weekly_report(store, week, settings.reports_dir)
    app = bare_app(store, settings)
    with serve(app) as base, browser.Chromium() as chromium:
        yield base, sid, week, settings.reports_dir, sat_sid, chromium
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


def test_every_page_renders_every_chart_without_errors(site):
    base, sid, week, _, _, chromium = site
    for path in PAGES:
        url = base + path.format(sid=sid, week=week)
        res = chromium.load(url)
        assert res.errors == [], (url, res.errors)
        assert res.plotly == "object", url
        assert res.charts > 0 and res.rendered == res.charts, (url, res)


def test_fp8_saturation_panels_render(site):
    base, _, _, _, sat_sid, chromium = site
    fleet = httpx.get(f"{base}/dashboard/").text
    assert 'id="fp8-saturation"' in fleet and "tolerated 1%" in fleet  # sampled sessions: the chart, not the sentence
    assert max(r["share"] for r in httpx.get(f"{base}/v1/fp8-saturation").json()["rows"]) > 0.1  # the drifting cohort
    session = httpx.get(f"{base}/dashboard/sessions/{sat_sid}").text
    assert 'id="session-fp8"' in session
    for url, html in ((f"{base}/dashboard/", fleet), (f"{base}/dashboard/sessions/{sat_sid}", session)):
        res = chromium.load(url)
        assert res.errors == [], (url, res.errors)
        assert res.charts == res.rendered == html.count('class="plotly-graph-div"'), (url, res)


def test_fp8_saturation_empty_state_renders(site):
    base, _, _, _, _, chromium = site
    url = f"{base}/dashboard/?start=2001-01-01T00:00:00Z&end=2001-02-01T00:00:00Z"
    html = httpx.get(url).text
    assert "was sampled with static FP8 scales" in html and 'id="fp8-saturation"' not in html
    res = chromium.load(url)
    assert res.errors == [] and res.charts == res.rendered > 0, res


def test_report_opens_from_disk_offline(site):
    _, _, week, reports_dir, _, chromium = site
    res = chromium.load((reports_dir / f"livestep-report-{week}.html").as_uri())
    assert res.errors == [] and res.plotly == "object"
    assert res.charts >= 4 and res.rendered == res.charts


def test_plotly_js_is_served_locally(site):
    base = site[0]
    r = httpx.get(f"{base}/static/plotly.min.js")
    assert r.status_code == 200 and len(r.content) > 1_000_000 and b"plotly" in r.content[:2000].lower()
    page = httpx.get(f"{base}/dashboard/").text
    assert '<script src="/static/plotly.min.js">' in page and "cdn.plot.ly" not in page


def test_checker_sees_console_errors_and_missing_charts(site):
    chromium = site[-1]
    bad = ("data:text/html,<div class='plotly-graph-div'></div>"
           "<script>console.error('boom'); undefined_function();</script>")
    res = chromium.load(bad, settle_s=1.0)
    assert any("boom" in e for e in res.errors) and any("undefined_function" in e for e in res.errors)
    assert res.charts == 1 and res.rendered == 0
