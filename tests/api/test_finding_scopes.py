"""Findings listed beside a release's figures belong to exactly the scope asked for: ``GET
/v1/fp8-saturation`` and ``GET /v1/releases/compare`` over releases whose names are one another's
prefix (``v1``, ``v1.2``, ``v10``), with and without a ``gpu_kind`` filter."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from analytics.stats import canonical_scope
from tests.api.helpers import fp8_session

END = datetime(2026, 11, 10, 12, tzinfo=UTC)
RANGE = {"start": (END - timedelta(days=2)).isoformat(), "end": END.isoformat()}
SCOPES = {("v1", "h200"), ("v1", "h100"), ("v1.2", "h200"), ("v10", "h200")}
COLUMNS = ["kind", "scope", "metric", "window_start", "window_end", "baseline", "value", "effect", "confidence",
           "severity", "status", "attribution", "evidence", "job", "first_seen", "updated_at"]


def _scopes(pairs) -> set[str]:
    return {canonical_scope({"release": r, "gpu_kind": g}) for r, g in pairs}


@pytest.fixture
def lookalikes(store):
    """A session and an open fp8_saturation and regression finding per scope of SCOPES."""
    for release, gpu_kind in sorted(SCOPES):
        fp8_session(store, f"{release}-{gpu_kind}", release, gpu_kind, 0.0, END - timedelta(hours=6))
    store.client().insert("findings", [
        [kind, scope, metric, END - timedelta(days=1), END, 0.01, 0.5, 0.49, 0.99, "critical", "open", "", "{}",
         "test", END, END]
        for kind, metric in (("fp8_saturation", "fp8_saturated"), ("regression", "step_period_ms"))
        for scope in sorted(_scopes(SCOPES))], column_names=COLUMNS)
    return store


@pytest.mark.parametrize("params,pairs", [
    ({"release": "v1"}, {("v1", "h200"), ("v1", "h100")}),
    ({"release": "v1.2"}, {("v1.2", "h200")}),
    ({"release": "v10"}, {("v10", "h200")}),
    ({"release": "v1", "gpu_kind": "h100"}, {("v1", "h100")}),
    ({"gpu_kind": "h200"}, {("v1", "h200"), ("v1.2", "h200"), ("v10", "h200")}),
    ({}, SCOPES),
])
def test_fp8_saturation_findings_are_of_the_scope_asked_for(client, lookalikes, params, pairs):
    body = client.get("/v1/fp8-saturation", params={**RANGE, **params}).json()
    assert {f["scope"] for f in body["findings"]} == _scopes(pairs)
    assert {(x["release"], x["gpu_kind"]) for x in body["rows"]} == pairs  # rows and findings agree


@pytest.mark.parametrize("baseline,candidate,gpu_kind,pairs", [
    ("v1.2", "v1", None, {("v1", "h200"), ("v1", "h100")}),
    ("v1.2", "v1", "h100", {("v1", "h100")}),
    ("v1", "v1.2", None, {("v1.2", "h200")}),
    ("v1", "v10", "h200", {("v10", "h200")}),
    ("v1", "v10", "h100", set()),
])
def test_compare_lists_the_candidates_regressions_only(client, lookalikes, baseline, candidate, gpu_kind, pairs):
    params = {**RANGE, "baseline": baseline, "candidate": candidate, **({"gpu_kind": gpu_kind} if gpu_kind else {})}
    r = client.get("/v1/releases/compare", params=params)
    assert r.status_code == 200, r.text
    found = r.json()["findings"]
    assert {f["scope"] for f in found} == _scopes(pairs) and {f["kind"] for f in found} <= {"regression"}


def test_findings_list_takes_every_finding_kind(client, store):
    """GET /v1/findings's kind filter is findings.KINDS (drift and variance were refused with a 422 while
    the route typed its own list); an unknown kind is a 422 naming the valid ones."""
    store.client().insert("findings", [
        ["drift", "gpu_kind=h200,release=v1", "step_period_ms_p50", END - timedelta(days=1), END, 0.0, 1.0, 0.1, 0.99,
         "critical", "open", "", "{}", "drift", END, END]], column_names=COLUMNS)
    r = client.get("/v1/findings", params={**RANGE, "kind": "drift"})
    assert r.status_code == 200, r.text
    assert [f["kind"] for f in r.json()["findings"]] == ["drift"]
    assert client.get("/v1/findings", params={**RANGE, "kind": "variance"}).status_code == 200
    bad = client.get("/v1/findings", params={**RANGE, "kind": "drfit"})
    assert bad.status_code == 422 and "drift" in bad.text
