"""FP8 saturation served and acted on: ``GET /v1/fp8-saturation`` per release x GPU kind (bad input 4xx
listing what is valid), ``fp8_saturation`` findings listed, and the loop closed on a real store: steps
that saturate on one release -> the job's critical finding -> the signed webhook delivery (the
notifier's own body) -> ``GET /v1/switches`` answers ``static_scales: false`` for that release's workers
and leaves every other scope alone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import orjson
import pytest

from analytics.jobs import run_job
from tests.api.helpers import fp8_fleet, fp8_session

END = datetime(2026, 11, 10, 12, tzinfo=UTC)
RANGE = {"start": (END - timedelta(days=2)).isoformat(), "end": END.isoformat()}


@pytest.fixture
def fleet(store):
    fp8_fleet(store, END)
    for i in range(40):  # isolated outliers: under the tolerance
        fp8_session(store, f"v6-h200-{i}", "v6", "h200", 2e-7, END - timedelta(hours=6, minutes=i))
    return store


def test_per_release_and_gpu_kind_figures(client, fleet):
    r = client.get("/v1/fp8-saturation", params=RANGE)
    assert r.status_code == 200, r.text
    body = r.json()
    got = {(x["release"], x["gpu_kind"]): x for x in body["rows"]}
    assert set(got) == {("v7", "h200"), ("v7", "h100"), ("v6", "h200")}
    bad = got[("v7", "h200")]
    assert (bad["sessions"], bad["saturating"], bad["share"]) == (40, 10, 0.25)
    assert bad["ci_low"] < 0.25 < bad["ci_high"] and bad["sat_max"] == pytest.approx(2e-3, rel=1e-6)
    assert bad["sampled_steps"] == 40 * 3 and bad["saturating_steps"] == 10 * 3
    assert bad["saturating_workers"] == 5 and bad["flagged"]
    # flagged is judged over the range asked for, which is not the hourly job's window: the body says so
    assert "range shown" in body["flagged_over"] and "last 2 days" in body["flagged_over"]
    assert body["job_window_days"] == 2
    assert all(got[k]["saturating"] == 0 for k in (("v7", "h100"), ("v6", "h200")))
    assert body["session_saturated_above"] > 0 and body["findings"] == []
    only = client.get("/v1/fp8-saturation", params={**RANGE, "release": "v7", "gpu_kind": "h100"}).json()["rows"]
    assert [(x["release"], x["gpu_kind"]) for x in only] == [("v7", "h100")]
    outside = {"start": (END + timedelta(days=1)).isoformat(), "end": (END + timedelta(days=2)).isoformat()}
    assert client.get("/v1/fp8-saturation", params=outside).json()["rows"] == []


@pytest.mark.parametrize("params,status,fragment", [
    ({"release": "v99"}, 404, "known releases: v6, v7"),
    ({"release": ""}, 422, "release"),
    ({"gpu_kind": "x" * 200}, 422, "gpu_kind"),
    ({"start": "yesterday"}, 422, "start"),
])
def test_bad_queries_are_4xx_saying_what_is_valid(client, fleet, params, status, fragment):
    r = client.get("/v1/fp8-saturation", params={**RANGE, **params})
    assert r.status_code == status, r.text
    assert fragment in r.text


def test_saturating_release_turns_static_scales_off_through_its_incident(client, fleet):
    from api import incidents

    def switch(**labels):
        return client.get("/v1/switches", params=labels).json()["switches"].get("static_scales")

    assert switch(release="v7", gpu_kind="h200", worker_id="w1") is None  # no rule yet: the worker's default
    rows = run_job("fp8_saturation", fleet, now=END)
    assert [(r["kind"], r["scope"], r["severity"], r["attribution"]) for r in rows] == \
        [("fp8_saturation", "gpu_kind=h200,release=v7", "critical", "static_scales")]

    rep = incidents.sync(fleet, now=END)  # the scheduler's hand-off after the job
    assert len(rep.flips) == 1
    assert switch(release="v7", gpu_kind="h200", worker_id="w1") is False
    assert switch(release="v7", gpu_kind="h100", worker_id="w1") is None  # other GPU kind, other release: untouched
    assert switch(release="v6", gpu_kind="h200", worker_id="w1") is None
    hist = client.get("/v1/switches/history", params={"source": "incident"}).json()["decisions"]
    assert [(d["name"], d["scope"], d["changed"], d["new_value"]) for d in hist] == \
        [("static_scales", "gpu_kind=h200,release=v7", True, False)]
    listed = client.get("/v1/findings", params={**RANGE, "kind": "fp8_saturation"}).json()["findings"]
    assert [f["scope"] for f in listed] == ["gpu_kind=h200,release=v7"]
    assert listed[0]["evidence"]["saturating_sessions"] == 10
    assert listed[0]["summary"].split(" (95% CI")[0] == (
        f"{100 * listed[0]['value']:.3g}% of {listed[0]['evidence']['sessions']} sampled sessions clip FP8 activations")
    assert hist[0]["reason"].startswith(listed[0]["summary"])  # the audit says why in the same words
    served = client.get("/v1/fp8-saturation", params={**RANGE, "release": "v7"}).json()
    assert [f["scope"] for f in served["findings"]] == ["gpu_kind=h200,release=v7"]


def test_weekly_report_has_a_saturation_section_only_with_findings(fleet, tmp_path):
    from analytics.queries import iso_week_of
    from api.report import build_weekly_report

    week = iso_week_of(END)
    html, js = build_weekly_report(fleet, week, tmp_path / "before")
    assert "FP8 saturation" not in html.read_text()
    run_job("fp8_saturation", fleet, now=END)
    html, js = build_weekly_report(fleet, week, tmp_path / "after")
    text = html.read_text()
    assert "FP8 saturation" in text and "gpu_kind=h200,release=v7" in text
    [f] = orjson.loads(js.read_bytes())["fp8_saturation_findings"]
    assert (f["scope"], f["attribution"], f["evidence"]["saturating_sessions"]) == \
        ("gpu_kind=h200,release=v7", "static_scales", 10)
