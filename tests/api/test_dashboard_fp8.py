"""FP8 saturation on the dashboards: the fleet page's panel (per release x GPU kind, the share of sampled
sessions saturating with its interval, the tolerated share as a line, the open findings; the same numbers
as ``GET /v1/fp8-saturation``), its empty state, the gpu_kind and time-range filters (bad values 4xx
saying what is valid), and a session page's sampled steps as markers."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import orjson
import pytest

from analytics import saturation
from analytics.jobs import run_job
from api import dashboard as d
from tests.api.helpers import fp8_fleet, fp8_session

END = datetime(2026, 11, 10, 12, tzinfo=UTC)
RANGE = {"start": (END - timedelta(days=2)).isoformat(), "end": END.isoformat()}
TITLE = "FP8 saturation (static scales)"


@pytest.fixture
def fleet(store):
    fp8_fleet(store, END)
    fp8_session(store, "v7-h100-off", "v7", "h100", None, END - timedelta(hours=6, minutes=50),
                switches="fp8_cache,ring_cache")  # never sampled
    return store


def _panel(html: str) -> str:
    """The FP8 section of a page ('' when absent)."""
    for sec in re.findall(r"<section>.*?</section>", html, flags=re.DOTALL):
        if f"<h2>{TITLE}</h2>" in sec:
            return sec
    return ""


def _figure(html: str, div_id: str) -> dict:
    """The plotly figure (data + layout) drawn into ``div_id``."""
    m = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div_id) + r'",\s*(\[.*?\]),\s*(\{.*?\}),\s*\{"displaylogo"',
                  html, flags=re.DOTALL)
    assert m, f"no plotly figure {div_id!r}"
    return {"data": orjson.loads(m.group(1)), "layout": orjson.loads(m.group(2))}


def test_fleet_panel_draws_the_rest_figures_per_release_and_gpu_kind(client, fleet):
    r = client.get("/dashboard/", params=RANGE)
    assert r.status_code == 200, r.text
    panel = _panel(r.text)
    assert panel and 'id="fp8-saturation"' in panel
    fig = _figure(r.text, "fp8-saturation")
    rest = {(x["release"], x["gpu_kind"]): x for x in client.get("/v1/fp8-saturation", params=RANGE).json()["rows"]}
    drawn = {(x, t["name"]): (y, hi, lo) for t in fig["data"]
             for x, y, hi, lo in zip(t["x"], t["y"], t["error_y"]["array"], t["error_y"]["arrayminus"], strict=True)}
    assert set(drawn) == set(rest) == {("v7", "h200"), ("v7", "h100")}
    for k, (y, hi, lo) in drawn.items():
        assert y == pytest.approx(rest[k]["share"])
        assert y + hi == pytest.approx(rest[k]["ci_high"]) and y - lo == pytest.approx(rest[k]["ci_low"])
    assert drawn[("v7", "h200")][0] == 0.25 and drawn[("v7", "h100")][0] == 0.0
    line = [s for s in fig["layout"]["shapes"] if s.get("y0") == s.get("y1")]
    assert [s["y0"] for s in line] == [saturation.TOLERATED_SHARE]
    assert "tolerated 1%" in r.text
    assert "<th>flagged (range shown)</th>" in panel
    assert "judged over the range shown" in panel and "judges the last 2 days" in panel


def test_fleet_panel_marks_the_open_finding_of_its_scope(client, fleet):
    run_job("fp8_saturation", fleet, now=END)
    panel = _panel(client.get("/dashboard/", params=RANGE).text)
    rows = re.findall(r"<tr>(.*?)</tr>", panel.split("<tbody>")[1], flags=re.DOTALL)
    cells = {tuple(re.findall(r"<td>(.*?)</td>", row)[:2]): re.findall(r"<td>(.*?)</td>", row)[-1] for row in rows}
    assert cells == {("v7", "h100"): "", ("v7", "h200"): "critical"}


def test_fleet_panel_follows_the_gpu_kind_filter(client, fleet):
    fig = _figure(client.get("/dashboard/", params={**RANGE, "gpu_kind": "h100"}).text, "fp8-saturation")
    assert [(t["name"], t["x"]) for t in fig["data"]] == [("h100", ["v7"])]


@pytest.mark.parametrize("params", [
    {"start": (END + timedelta(days=1)).isoformat(), "end": (END + timedelta(days=2)).isoformat()},
    {**RANGE, "gpu_kind": "b200"},
])
def test_fleet_panel_says_so_when_nothing_was_sampled(client, fleet, params):
    r = client.get("/dashboard/", params=params)
    assert r.status_code == 200, r.text
    panel = _panel(r.text)
    assert "No session" in panel and "was sampled with static FP8 scales" in panel
    assert "fp8-saturation" not in r.text
    assert ("on b200" in panel) == ("gpu_kind" in params)


def test_fleet_panel_escapes_the_gpu_kind_it_echoes(client, fleet):
    r = client.get("/dashboard/", params={**RANGE, "gpu_kind": "<script>x</script>"})
    assert r.status_code == 200 and "on &lt;script&gt;x&lt;/script&gt;" in _panel(r.text)
    assert "<script>x</script>" not in r.text


@pytest.mark.parametrize("params,fragment", [
    ({"gpu_kind": ""}, "gpu_kind"),
    ({"gpu_kind": "x" * 200}, "gpu_kind"),
    ({"start": "yesterday"}, "start"),
    ({"start": END.isoformat(), "end": (END - timedelta(days=1)).isoformat()}, "must be before end"),
    ({"start": (END - timedelta(days=500)).isoformat(), "end": END.isoformat()}, "maximum of 400 days"),
])
def test_fleet_page_bad_queries_are_4xx_saying_what_is_valid(client, fleet, params, fragment):
    r = client.get("/dashboard/", params=params)
    assert r.status_code == 422, r.text
    assert fragment in r.text


def test_session_page_marks_the_sampled_steps(client, fleet):
    r = client.get("/dashboard/sessions/v7-h200-0")
    assert r.status_code == 200, r.text
    assert _panel(r.text)
    fig = _figure(r.text, "session-fp8")
    (trace,) = fig["data"]
    assert trace["mode"] == "markers" and trace["x"] == [7, 15, 23]
    assert trace["y"] == pytest.approx([2e-3] * 3, rel=1e-6)
    assert [s["y0"] for s in fig["layout"]["shapes"]] == [saturation.SATURATED_FRACTION]


def test_session_page_without_sampled_steps_says_so(client, fleet):
    r = client.get("/dashboard/sessions/v7-h100-off")
    assert r.status_code == 200, r.text
    assert "No step of this session was sampled" in _panel(r.text) and "session-fp8" not in r.text


def test_fp8_figure_without_rows_keeps_the_reference_line():
    fig = d.fig_fp8_saturation([], 0.01)
    assert len(fig.data) == 0 and fig.layout.shapes[0].y0 == 0.01
