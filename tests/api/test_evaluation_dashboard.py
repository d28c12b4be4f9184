"""The evaluation page and the weekly report's section, from a real tiny evaluation's records: the latest
verdicts, each configuration's free-running curve drawn inside its band (the same numbers as
``GET /v1/evaluations``), the page rendered in headless Chromium without errors, and no section in a
week without evaluations."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import orjson
import pytest

from analytics.queries import iso_week_of
from collector.records import to_arrow
from tests.api import browser
from tests.api.live import serve

pytestmark = pytest.mark.usefixtures("torch_chains_only")  # tests/conftest.py


@pytest.fixture(scope="module")
def result():
    from worker.evaluate import evaluate

    return evaluate("tiny", "cpu", ["fp8_cache", "static_scales"], steps=12, seeds=2, frames=False, release="v9")


@pytest.fixture
def evaluated(store, result):
    from worker.evaluate import records

    store.insert_arrow("evaluations", to_arrow("evaluation", records(result)), dedup_token=result["evaluation_id"])
    return store


def _figure(html: str, div_id: str) -> dict:
    m = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div_id) + r'",\s*(\[.*?\]),\s*(\{.*?\}),\s*\{"displaylogo"',
                  html, flags=re.DOTALL)
    assert m, f"no plotly figure {div_id!r}"
    return {"data": orjson.loads(m.group(1)), "layout": orjson.loads(m.group(2))}


def test_the_page_draws_each_free_running_curve_inside_its_band(client, evaluated, result):
    r = client.get("/dashboard/evaluations")
    assert r.status_code == 200, r.text
    assert result["evaluation_id"] in r.text and "Evaluations behind the numeric switch defaults" in r.text
    rows = client.get("/v1/evaluations", params={"switch": "fp8_cache", "metric": "divergence"}).json()["evaluations"]
    rows.sort(key=lambda x: x["step"])
    fig = _figure(r.text, "ev-div-0")  # fp8_cache sorts first
    by_name = {t.get("name"): t for t in fig["data"]}
    assert by_name["candidate / plain"]["x"] == [x["step"] for x in rows]
    assert by_name["candidate / plain"]["y"] == pytest.approx([x["value"] for x in rows])
    assert by_name["band: correct implementations"]["y"] == pytest.approx([x["band_lo"] for x in rows])
    assert by_name["gate: the band's top"]["y"] == pytest.approx([x["band_hi"] for x in rows])
    assert client.get("/dashboard/evaluations", params={"evaluation_id": "nope"}).status_code == 200


def test_an_empty_store_says_how_to_get_an_evaluation(client):
    r = client.get("/dashboard/evaluations")
    assert r.status_code == 200 and "no evaluation recorded" in r.text


def test_the_weekly_report_has_an_evaluation_section_only_in_a_week_with_evaluations(evaluated, tmp_path, result):
    from api.report import build_weekly_report

    html_path, json_path = build_weekly_report(evaluated, iso_week_of(datetime.now(UTC)), tmp_path)
    data = orjson.loads(json_path.read_bytes())
    overall = {x["switch"]: x["verdict"] for x in data["evaluations"] if x["metric"] == "overall"}
    assert overall == result["overall"]
    assert "Evaluations of numeric switches" in html_path.read_text() and 'id="r-ev-div-0"' in html_path.read_text()
    html_path, _ = build_weekly_report(evaluated, "2026-W01", tmp_path)
    assert "Evaluations of numeric switches" not in html_path.read_text()


@pytest.mark.e2e
@pytest.mark.skipif(not browser.available(), reason=f"no chromium at {browser.CHROMIUM}")
def test_the_page_renders_in_chromium(app, evaluated):
    with serve(app) as base, browser.Chromium() as chromium:
        res = chromium.load(base + "/dashboard/evaluations")
    assert res.errors == [], res.errors
    assert res.rendered == res.charts >= 2
