"""With read tokens on, a browser signs in on /login and every dashboard page and the weekly report
open in headless Chromium (real uvicorn, network off); the session cookie is HttpOnly, SameSite=Strict,
signed and expiring, grants reading only, and ends with its token; a trusted proxy's identity header
works only where configured; /docs and /redoc render with no network (assets served locally)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest

from analytics.queries import iso_week_of
from api.browser_auth import COOKIE, issue_cookie
from tests.api import browser
from tests.api.conftest import ADMIN, make_settings, real_app
from tests.api.live import serve
from tests.collector.helpers import migrated_store

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not browser.available(), reason=f"no chromium at {browser.CHROMIUM} "
                       "(Debian: apt-get install chromium; ./dev test installs it)"),
]

READ = "test-read-token-1234"
PAGES = ("/dashboard/", "/dashboard/releases", "/dashboard/sessions", "/dashboard/memory", "/dashboard/findings",
         "/dashboard/switches", "/dashboard/reports", "/v1/reports/{week}.html")
SIGN_IN = f"document.getElementById('token').value = {READ!r}; document.forms[0].submit()"


@pytest.fixture(scope="module")
def site(tmp_path_factory, chdb_dir):
    from analytics.simulate import simulate_fleet
    from api.report import build_weekly_report

    store = migrated_store(chdb_dir)
    simulate_fleet(store, weeks=1.2, incidents=[("august", 3)], workers=3, sessions_per_day=6, session_median_s=10,
                   seed=5)
    settings = make_settings(tmp_path_factory.mktemp("auth"), read_tokens=[READ])
    week = iso_week_of(datetime.now(UTC) - timedelta(days=7))
    build_weekly_report(store, week, settings.reports_dir)
    app = real_app(store, settings)
    with serve(app) as base, browser.Chromium() as chromium:
        yield base, week, app, settings, chromium
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


@pytest.fixture
def fresh_browser():
    with browser.Chromium() as chromium:  # no cookies yet
        yield chromium


def test_a_browser_without_a_session_is_sent_to_login(site, fresh_browser):
    base = site[0]
    res = fresh_browser.load(f"{base}/dashboard/releases?gpu_kind=h100")
    assert res.href == f"{base}/login?next=%2Fdashboard%2Freleases%3Fgpu_kind%3Dh100"
    assert res.title == "livestep: sign in" and res.errors == []


def test_sign_in_then_every_page_and_the_report_render(site, fresh_browser):
    base, week, *_ = site
    res = fresh_browser.load(f"{base}/dashboard/memory", actions=[SIGN_IN])
    assert res.href == f"{base}/dashboard/memory" and res.errors == []
    assert res.charts > 0 and res.rendered == res.charts
    for path in PAGES:  # the cookie rides along, plotly.js included
        url = base + path.format(week=week)
        res = fresh_browser.load(url)
        assert res.href == url and res.errors == [], (url, res.errors)
        assert res.plotly == "object" and res.charts > 0 and res.rendered == res.charts, (url, res)


def test_a_wrong_token_gets_the_form_again(site, fresh_browser):
    base = site[0]
    wrong = "document.getElementById('token').value = 'not-a-token'; document.forms[0].submit()"
    res = fresh_browser.load(f"{base}/login?next=/dashboard/", actions=[wrong],
                             wait_for="document.querySelector('.error') && document.querySelector('.error').textContent")
    assert res.href == f"{base}/login" and "may not read" in res.probe
    assert any("401" in e for e in res.errors)  # the browser saw the 401
    assert fresh_browser.load(f"{base}/dashboard/").title == "livestep: sign in"  # and no session


def _sign_in(base: str, token: str = READ, next_url: str = "/dashboard/") -> httpx.Response:
    return httpx.post(f"{base}/login", data={"token": token, "next": next_url})


def test_the_cookie_is_httponly_strict_and_reads_only(site):
    base, _, app, settings, _ = site
    r = _sign_in(base)
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/"
    attrs = [a.strip().lower() for a in r.headers["set-cookie"].split(";")]
    assert attrs[0].startswith(f"{COOKIE}=") and "httponly" in attrs and "samesite=strict" in attrs
    assert "path=/" in attrs and f"max-age={settings.session_ttl_s}" in attrs
    jar = {COOKIE: r.cookies[COOKIE]}
    assert httpx.get(f"{base}/v1/sessions", cookies=jar).status_code == 200
    assert httpx.get(f"{base}/v1/sessions").status_code == 401  # an API client without either: 401, not a redirect
    page = httpx.get(f"{base}/dashboard/", headers={"Accept": "text/html"})
    assert page.status_code == 303 and page.headers["location"] == "/login?next=%2Fdashboard%2F"
    put = httpx.put(f"{base}/v1/switches/fused_allreduce", cookies=jar, json={"value": False, "who": "t", "why": "t"})
    assert put.status_code == 401  # a browser session never writes
    tampered = jar[COOKIE][:-2] + ("AA" if not jar[COOKIE].endswith("AA") else "BB")
    assert httpx.get(f"{base}/v1/sessions", cookies={COOKIE: tampered}).status_code == 401
    expired = issue_cookie(settings, READ, now=datetime.now(UTC).timestamp() - settings.session_ttl_s - 1)
    assert httpx.get(f"{base}/v1/sessions", cookies={COOKIE: expired}).status_code == 401
    assert _sign_in(base, ADMIN).status_code == 303  # admin tokens read too
    assert _sign_in(base, "nope").status_code == 401
    app.state.settings = settings.model_copy(update={"read_tokens": ["another-read-token-99"]})
    try:  # the token is no longer configured: its cookies end
        assert httpx.get(f"{base}/v1/sessions", cookies=jar).status_code == 401
    finally:
        app.state.settings = settings


def test_logout_drops_the_cookie(site):
    base = site[0]
    r = httpx.get(f"{base}/logout")
    assert r.status_code == 303 and r.headers["location"] == "/login"
    attrs = [a.strip().lower() for a in r.headers["set-cookie"].split(";")]
    assert attrs[0] == f'{COOKIE}=""' and "max-age=0" in attrs and "httponly" in attrs


def test_a_malformed_form_is_a_4xx(site):
    base = site[0]
    assert httpx.post(f"{base}/login", content="&".join(f"f{i}=x" for i in range(20))).status_code == 400
    assert httpx.post(f"{base}/login", content=b"token=%ff%fe&next=%00").status_code == 401
    assert httpx.post(f"{base}/login", content=b"x" * 20000).status_code == 413


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "/\\evil.example", "dashboard"])
def test_next_never_leaves_the_site(site, target):
    assert _sign_in(site[0], next_url=target).headers["location"] == "/dashboard/"


def test_a_trusted_proxy_header_only_where_configured(site):
    base, _, app, settings, _ = site
    who = {"X-Auth-Request-User": "ada@example.com"}
    assert httpx.get(f"{base}/v1/sessions", headers=who).status_code == 401  # off by default
    app.state.settings = settings.model_copy(update={"trusted_proxy_header": "X-Auth-Request-User"})
    try:
        assert httpx.get(f"{base}/v1/sessions", headers=who).status_code == 200  # from loopback: a trusted proxy
        assert httpx.get(f"{base}/v1/sessions").status_code == 401
        app.state.settings = settings.model_copy(update={"trusted_proxy_header": "X-Auth-Request-User",
                                                          "trusted_proxies": ["10.1.0.0/16"]})
        assert httpx.get(f"{base}/v1/sessions", headers=who).status_code == 401  # not from the proxy's address
    finally:
        app.state.settings = settings


SWAGGER_READY = "document.querySelectorAll('.opblock').length"
REDOC_READY = "document.querySelectorAll('[data-section-id^=\"operation/\"]').length"


def test_docs_render_with_the_network_off(site):
    base, *_, chromium = site
    swagger = chromium.load(f"{base}/docs", wait_for=SWAGGER_READY)
    assert swagger.errors == [] and swagger.probe > 10, swagger
    redoc = chromium.load(f"{base}/redoc", wait_for=REDOC_READY)
    assert redoc.errors == [], redoc  # its vendor's logo (cdn.redoc.ly) is not asked for (api/openapi_docs.py)
    assert redoc.probe > 10, redoc
    authorize = chromium.load(f"{base}/docs", wait_for="document.querySelectorAll('.btn.authorize').length")
    assert authorize.probe == 1, authorize  # Swagger's Authorize button: the HTTPBearer scheme is declared
    for path in ("/docs", "/redoc"):
        assert "cdn." not in httpx.get(f"{base}{path}").text


def test_the_network_is_really_off(site):
    chromium = site[-1]
    page = ("data:text/html,<script src='https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js'>"
            "</script><script>if (typeof SwaggerUIBundle === 'undefined') console.error('no swagger')</script>")
    res = chromium.load(page, settle_s=1.0)
    assert any("no swagger" in e for e in res.errors)
