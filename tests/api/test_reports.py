"""Weekly report: fps vs the week before, switch changes of that week, HTML with local plotly.js;
listed and served at /v1/reports, built on demand, bad weeks are 4xx."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest

from analytics.queries import iso_week_of


@pytest.fixture
def fleet(store):
    from analytics.simulate import simulate_fleet

    return simulate_fleet(store, weeks=2, workers=4, sessions_per_day=10, session_median_s=15, seed=4)


def test_report_of_this_week_shows_fps_and_switch_changes(client, admin, fleet, settings):
    week = iso_week_of(datetime.now(UTC))
    client.put("/v1/switches/fused_allreduce", headers=admin,
               json={"value": False, "scope": "release=v1.0", "who": "alice", "why": "August leak"})
    r = client.post(f"/v1/reports/{week}", headers=admin)
    assert r.status_code == 200, r.text
    data = client.get(f"/v1/reports/{week}.json").json()
    assert data["iso_week"] == week
    assert [(c["name"], c["new_value"], c["actor"]) for c in data["switch_changes"]] == [
        ("fused_allreduce", False, "alice")]
    assert data["fps"]["this_week"]["sessions"] > 0 and data["fps"]["week_before"]["sessions"] > 0
    html = client.get(f"/v1/reports/{week}.html").text
    assert '<script src="plotly.min.js">' in html and "August leak" in html and html.count("plotly-graph-div") >= 4
    assert (settings.reports_dir / "plotly.min.js").stat().st_size > 1_000_000
    listed = client.get("/v1/reports").json()["reports"]
    assert [x["iso_week"] for x in listed] == [week]
    assert client.get("/v1/reports/plotly.min.js").status_code == 200


def test_report_json_is_valid_for_an_empty_week(store, tmp_path):
    from api.report import build_weekly_report

    html_path, json_path = build_weekly_report(store, "2026-W01", tmp_path)
    data = orjson.loads(json_path.read_bytes())
    assert data["fps"]["this_week"] is None and data["regressions"] == [] and html_path.exists()


@pytest.mark.parametrize("path,status", [
    ("/v1/reports/2026-W99.json", 422), ("/v1/reports/last-week.html", 422), ("/v1/reports/2031-W05.html", 404),
    ("/v1/reports/2021-W53.json", 422),
])
def test_bad_or_missing_weeks(client, path, status):
    assert client.get(path).status_code == status


def test_building_needs_admin(client):
    assert client.post("/v1/reports/2026-W01").status_code == 401
    assert client.post("/v1/reports/2026-W60", headers={"Authorization": "Bearer test-admin-token"}).status_code == 422
