"""Turns on the api: ``GET /v1/turns`` (quantiles with intervals per release x GPU kind and part, the
per-stage medians, the turn-latency findings), the /dashboard/turns page drawing those medians, the turn
marks on a session page's step chart, and bad input answered 4xx naming what is valid."""

from __future__ import annotations

import re

import orjson
import pytest
from fastapi.testclient import TestClient

from analytics import turns
from analytics.findings import write_findings
from analytics.simulate import simulate_fleet
from tests.analytics.conftest import SMALL
from tests.api.conftest import make_settings, real_app
from tests.collector.helpers import migrated_store


@pytest.fixture(scope="module")
def site(chdb_dir, tmp_path_factory):

    store = migrated_store(chdb_dir)
    sim = simulate_fleet(store, weeks=2, incidents=[("benign", 7)], seed=11, turns=True, turn_queue="v1.1",
                         **{**SMALL, "workers": 6, "session_median_s": 20.0})
    write_findings(store, "turn_regressions", sim.start, sim.end, turns.run(store, sim.start, sim.end))
    app = real_app(store, make_settings(tmp_path_factory.mktemp("turns")))
    with TestClient(app) as c:
        yield c, store, sim
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


def _range(sim):
    return {"start": sim.start.isoformat(), "end": sim.end.isoformat()}


def _figure(html: str, div_id: str) -> dict:
    m = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div_id) + r'",\s*(\[.*?\]),\s*(\{.*?\}),\s*\{"displaylogo"',
                  html, flags=re.DOTALL)
    assert m, f"no plotly figure {div_id!r}"
    return {"data": orjson.loads(m.group(1)), "layout": orjson.loads(m.group(2))}


def test_v1_turns_quantiles_intervals_stages_and_findings(site):
    c, _, sim = site
    body = c.get("/v1/turns", params=_range(sim)).json()
    assert body["parts"] == ["wait", "recompute", "generation", "queue"]
    keys = {(r["release"], r["gpu_kind"], r["part"]) for r in body["rows"]}
    assert len(keys) == 2 * 3 * 5  # two releases x three GPU kinds x latency + four parts
    for r in body["rows"]:
        assert r["p50_lo"] <= r["p50"] <= r["p50_hi"] and r["p95"] <= r["p99"]
    assert {s["policy"] for s in body["stages"] if s["release"] == "v1.1"} == {"keep"}
    assert {f["scope"] for f in body["findings"] if f["metric"] == "turn_latency_ms"} == {
        f"gpu_kind={k},release=v1.1" for k in ("b200", "h100", "h200")}
    one = c.get("/v1/turns", params={**_range(sim), "release": "v1.0", "gpu_kind": "h100"}).json()
    assert {(r["release"], r["gpu_kind"]) for r in one["rows"]} == {("v1.0", "h100")}
    assert {(s["release"], s["gpu_kind"]) for s in one["stages"]} == {("v1.0", "h100")} and one["findings"] == []


def test_turns_page_stacks_parts_that_add_up(site):
    """The stacked parts are means, and they add up to the mean latency the page states; medians of the
    parts (which do not add up to the median latency) are not stacked."""
    c, store, sim = site
    r = c.get("/dashboard/turns", params=_range(sim))
    assert r.status_code == 200 and "Turn-latency regressions" in r.text
    fig = _figure(r.text, "turn-stages")
    means = c.get("/v1/turns", params=_range(sim)).json()["stage_means"]
    labels = [f"{s['release']} · {s['gpu_kind']} · {s['policy']}" for s in means]
    bars = [t for t in fig["data"] if t["type"] == "bar"]
    assert [t["name"].split(":")[0] for t in bars] == list(turns.PARTS)
    for t, part in zip(bars, turns.PARTS, strict=True):
        assert t["y"] == labels and t["x"] == pytest.approx([s[f"{part}_ms"] for s in means])
    stacked = [sum(t["x"][i] for t in bars) for i in range(len(labels))]
    assert stacked == pytest.approx([s["latency_ms"] for s in means], rel=1e-4)  # parts add up to the whole
    raw = store.query_df("SELECT avg(latency_ms) AS m FROM turns WHERE release = 'v1.1' AND ts >= {s:DateTime64(3)} "
                         "AND ts < {e:DateTime64(3)}", {"s": sim.start, "e": sim.end})["m"][0]
    pooled = [s for s in means if s["release"] == "v1.1"]
    assert sum(s["latency_ms"] * s["turns"] for s in pooled) / sum(s["turns"] for s in pooled) == pytest.approx(raw)
    median = next(t for t in fig["data"] if t.get("name") == "median latency")
    assert median["x"] == pytest.approx([s["latency_p50_ms"] for s in means])
    assert fig["layout"]["barmode"] == "stack"


def test_a_release_with_only_turn_records_answers_200(site):
    """A release whose workers sent turns but no session statistics yet is known (not 404)."""
    from collector import records
    from tests.collector.helpers import turn_rows

    c, store, _ = site
    rows = turn_rows(3, session_id="turn-only-s", release="turn-only")
    store.insert_arrow("turns", records.to_arrow("turn", rows))
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC)
    params = {"release": "turn-only", "start": (now - timedelta(days=2)).isoformat(), "end": now.isoformat()}
    for path in ("/v1/turns", "/dashboard/turns"):
        r = c.get(path, params=params)
        assert r.status_code == 200, (path, r.text)
    assert {s["release"] for s in c.get("/v1/turns", params=params).json()["stage_means"]} == {"turn-only"}


def test_session_page_marks_its_turns_on_the_step_chart(site):
    c, store, _ = site
    sid, n = store.query_rows("SELECT session_id, count() AS n FROM turns GROUP BY session_id "
                              "ORDER BY n DESC, session_id LIMIT 1")[0]
    steps = [s for (s,) in store.query_rows(
        "SELECT step FROM turns WHERE session_id = {sid:String} ORDER BY turn", {"sid": sid})]
    fig = _figure(c.get(f"/dashboard/sessions/{sid}").text, "session-times")
    marks = [t for t in fig["data"] if t.get("name") == "turns"]
    assert len(marks) == 1 and marks[0]["x"] == steps and len(steps) == n >= 3
    lines = [s for s in fig["layout"]["shapes"] if s.get("name") == "turn"]
    assert sorted(s["x0"] for s in lines) == sorted(steps)
    # a session without turns has no marks
    other = store.query_rows("SELECT session_id FROM session_stats WHERE session_id NOT IN "
                             "(SELECT session_id FROM turns) LIMIT 1")[0][0]
    fig = _figure(c.get(f"/dashboard/sessions/{other}").text, "session-times")
    assert not [t for t in fig["data"] if t.get("name") == "turns"]


@pytest.mark.parametrize(("params", "status", "words"), [
    ({"release": "v9"}, 404, ["unknown release 'v9'", "v1.0, v1.1"]),
    ({"gpu_kind": ""}, 422, ["gpu_kind"]),
    ({"start": "2026-01-02T00:00:00Z", "end": "2026-01-01T00:00:00Z"}, 422, ["must be before end"]),
])
def test_bad_input_is_a_4xx_naming_what_is_valid(site, params, status, words):
    c, _, _ = site
    for path in ("/v1/turns", "/dashboard/turns"):
        r = c.get(path, params=params)
        assert r.status_code == status, (path, r.text)
        assert all(w in r.text for w in words), r.text


def test_empty_range_says_so(site):
    c, _, _ = site
    r = c.get("/dashboard/turns", params={"start": "2001-01-01T00:00:00Z", "end": "2001-02-01T00:00:00Z"})
    assert r.status_code == 200 and "No turn arrived in this range" in r.text
    assert c.get("/v1/turns", params={"start": "2001-01-01T00:00:00Z", "end": "2001-02-01T00:00:00Z"}).json()[
        "rows"] == []
