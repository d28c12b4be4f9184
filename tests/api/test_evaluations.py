"""Evaluations as evidence and as the gate on numeric switch defaults: a real (tiny) evaluation posted by an
evaluator to a real uvicorn and judged by the server (never by the ingest token, never on its own word);
evidence counts only where it was measured; a canary or an "on" write without a passing evaluation is
refused with a 4xx naming what is missing, logged and audited; a numeric switch turned on reaches a
worker only for a GPU kind with evidence; ``GET /v1/switches/rules`` shows the evaluation behind each
default."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest

from api import canary
from api.switchboard import get_switchboard
from tests.api.evaluations import put_evaluation
from tests.api.live import serve
from tests.collector.helpers import chdb_dsn, make_settings

TOKEN = "test-ingest-token"


pytestmark = pytest.mark.usefixtures("torch_chains_only")  # tests/conftest.py


EVALUATOR = "evaluator-token-0123456789"


@pytest.fixture(scope="module")
def result():
    from worker.evaluate import evaluate

    return evaluate("tiny", "cpu", ["fp8_cache", "static_scales"], steps=8, seeds=2, frames=False, release="v9")


def test_evaluations_are_posted_by_an_evaluator_judged_by_the_server_and_never_by_the_ingest_token(
        result, tmp_path, chdb_dir):
    from api.app import create_app
    from collector.records import to_arrow
    from worker.evaluate import records, ship

    settings = make_settings(chdb_dsn(chdb_dir), tmp_path, role="all", ingest_tokens=[TOKEN],
                             evaluator_tokens={"ci-cpu": EVALUATOR})
    app = create_app(settings)
    with serve(app, lifespan="on") as url:
        forged = {**result, "overall": {n: "pass" for n in result["overall"]}}
        got = ship(forged, url, EVALUATOR)  # a posted verdict is never taken: the server judges the series
        auth = {"Authorization": f"Bearer {TOKEN}"}
        rows = httpx.get(f"{url}/v1/evaluations", params={"release": "v9", "limit": 1000}, headers=auth).json()
        by_ingest = httpx.post(f"{url}/v1/evaluations", json=result, headers=auth)
        import pyarrow as pa
        sink = pa.BufferOutputStream()
        table = to_arrow("evaluation", records(result))
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        via_ingest = httpx.post(f"{url}/v1/telemetry", content=sink.getvalue().to_pybytes(),
                                headers={**auth, "Content-Type": "application/vnd.apache.arrow.stream"})
        bad = httpx.get(f"{url}/v1/evaluations", params={"metric": "vibes"}, headers=auth)
    assert got["overall"] == result["overall"] and got["evaluator"] == "ci-cpu" and got["gpu_kind"] == "cpu"
    assert got["rows"] == len(rows["evaluations"]) and {r["evaluation_id"] for r in rows["evaluations"]} == {
        result["evaluation_id"]}
    assert by_ingest.status_code == 403 and "evaluator token" in by_ingest.json()["detail"]
    assert via_ingest.status_code == 403 and "POST /v1/evaluations" in via_ingest.text
    assert bad.status_code == 422 and "valid: teacher_forced_ratio" in bad.json()["detail"]


def test_a_cpu_or_tiny_evaluation_never_unlocks_a_gpu_kind(client, admin, store):
    """Evidence counts only where it was measured: a passing row from a CPU, from tiny on a GPU, from too
    few seeds, or without an evaluator, leaves the H200's rule locked (409 naming why); the refusal is
    audited; an accepted write cites its evaluation."""
    def on():
        return client.put("/v1/switches/fp8_cache", headers=admin, json={
            "value": True, "scope": "gpu_kind=NVIDIA H200,release=v7", "who": "op", "why": "t"})

    for bad in ({"gpu_kind": "cpu"}, {"device_type": "cpu"}, {"preset": "tiny"}, {"seeds": 1}, {"evaluator": None}):
        kind = bad.pop("gpu_kind", "h200")
        put_evaluation(store, "fp8_cache", kind, "v7", **bad)
        r = on()
        assert r.status_code == 409, (bad, r.text)
    audit = client.get("/v1/switches/history", params={"name": "fp8_cache"}).json()["decisions"]
    assert [d for d in audit if d["action"] == "gate_refused" and not d["changed"] and d["evidence"]["gate"]]
    eid = put_evaluation(store, "fp8_cache", "h200", "v7")
    r = on()
    assert r.status_code == 200, r.text
    assert r.json()["evidence"]["evaluations"][0]["evaluation_id"] == eid


def test_a_release_wide_rule_reaches_a_gpu_kind_only_once_the_gate_holds_its_evidence(client, admin, store):
    """A release-wide "on" is checked at the write against the kinds known then (here: h100's evaluation);
    an H200 that joins the release later is handed the switch only once an H200 evaluation is posted, and
    meanwhile the older fleet "off" still decides for it (GET /v1/switches and its explanation)."""
    def poll(kind):
        return client.get("/v1/switches", params={"worker_id": "w1", "release": "v8", "gpu_kind": kind}).json()

    client.put("/v1/switches/fp8_cache", headers=admin, json={"value": False, "who": "op", "why": "fleet off"})
    put_evaluation(store, "fp8_cache", "h100", "v8")
    r = client.put("/v1/switches/fp8_cache", headers=admin, json={"value": True, "scope": "release=v8", "who": "op",
                                                                  "why": "h100 evidence"})
    assert r.status_code == 200, r.text
    assert [e["gpu_kind"] for e in r.json()["evidence"]["evaluations"]] == ["h100"]
    assert poll("h100")["switches"]["fp8_cache"] is True
    assert poll("h200")["switches"]["fp8_cache"] is False  # the fleet's "off", not the unevidenced "on"
    why = client.get("/v1/switches/explain", params={"worker_id": "w1", "release": "v8", "gpu_kind": "h200"}
                     ).json()["switches"]["fp8_cache"]
    assert why["decided_by"]["scope"] == "" and "gpu_kind=h200" in why["not_deciding"][0]["why_not"]
    put_evaluation(store, "fp8_cache", "h200", "v8", preset="tiny")  # no evidence for an H200: still withheld
    assert poll("h200")["switches"]["fp8_cache"] is False
    put_evaluation(store, "fp8_cache", "h200", "v8")
    assert poll("h200")["switches"]["fp8_cache"] is True
    put_evaluation(store, "fp8_cache", "h200", "v8", verdict="fail")  # a newer failing evaluation withdraws it
    assert poll("h200")["switches"]["fp8_cache"] is False


def test_a_release_wide_rule_without_a_fleet_rule_leaves_a_new_kind_its_own_value(client, admin, store):
    put_evaluation(store, "fp8_cache", "h100", "v8")
    r = client.put("/v1/switches/fp8_cache", headers=admin, json={"value": True, "scope": "release=v8", "who": "op",
                                                                  "why": "t"})
    assert r.status_code == 200, r.text
    got = client.get("/v1/switches", params={"worker_id": "w2", "release": "v8", "gpu_kind": "h200"}).json()
    assert "fp8_cache" not in got["switches"]
    assert "fp8_cache" not in client.get("/v1/switches", params={"release": "v8"}).json()["switches"]  # no kind named


def _canary(client, admin, switch="fused_allreduce", scope="release=v7"):
    return client.post("/v1/canaries", headers=admin, json={"switch": switch, "scope": scope, "fraction": 0.3,
                                                            "who": "op", "why": "fixed"})


def _off(client, admin, switch, scope):
    r = client.put(f"/v1/switches/{switch}", headers=admin, json={"value": False, "scope": scope, "who": "a",
                                                                  "why": "b"})
    assert r.status_code == 200


def test_a_canary_of_a_numeric_switch_without_a_passing_evaluation_is_refused(client, admin, store, caplog):
    _off(client, admin, "fused_allreduce", "release=v7")
    with caplog.at_level("WARNING", logger="livestep.gate"):
        r = _canary(client, admin)
    assert r.status_code == 409 and "no evaluation on any GPU kind" in r.json()["detail"]
    assert "livestep evaluate --switch fused_allreduce" in r.json()["detail"]
    # refused through POST /v1/canaries as through PUT: a log line and an audit row
    assert any("gate refused fused_allreduce" in m and "by op" in m for m in caplog.messages)
    audit = client.get("/v1/switches/history", params={"name": "fused_allreduce", "source": "canary"}).json()
    [refusal] = audit["decisions"]
    assert (refusal["action"], refusal["changed"], refusal["scope"], refusal["actor"]) == (
        "gate_refused", False, "release=v7", "op") and "no evaluation" in refusal["evidence"]["gate"]
    eid = put_evaluation(store, "fused_allreduce", "h200", "v7", verdict="fail")
    r = _canary(client, admin)
    assert r.status_code == 409 and f"run {eid}" in r.json()["detail"] and "'fail'" in r.json()["detail"]
    r = _canary(client, admin, scope="")  # no release named: which evaluation would count?
    assert r.status_code == 422 and "must name a release" in r.json()["detail"]
    put_evaluation(store, "fused_allreduce", "h200", "v7", verdict="pass")  # newer: this one counts
    put_evaluation(store, "fused_allreduce", "b200", "v7", verdict="no_effect")  # another kind of the release
    r = _canary(client, admin)
    assert r.status_code == 409 and "gpu_kind=b200" in r.json()["detail"] and "'no_effect'" in r.json()["detail"]
    put_evaluation(store, "fused_allreduce", "h200", "v7", verdict="incomplete")  # drift alone: no evidence
    r = _canary(client, admin, scope="gpu_kind=h200,release=v7")  # the kind with the passing evaluation
    assert r.status_code == 201, r.text
    assert r.json()["evidence"]["evaluations"][0]["verdict"] == "pass"
    refusals = client.get("/v1/switches/history", params={"name": "fused_allreduce", "source": "canary"}).json()
    assert sum(d["action"] == "gate_refused" for d in refusals["decisions"]) == 4  # every refusal, 422 and 409


def test_turning_a_numeric_switch_on_needs_what_a_canary_needs_and_off_needs_nothing(client, admin, store):
    """PUT value=true is the other way to make a numeric switch a default: the same gate as a canary."""
    def on(scope):
        return client.put("/v1/switches/fp8_cache", headers=admin,
                          json={"value": True, "scope": scope, "who": "op", "why": "re-enable"})

    _off(client, admin, "fp8_cache", "release=v7")  # off: always allowed, evaluated or not
    r = on("release=v7")
    assert r.status_code == 409 and "no evaluation" in r.json()["detail"]
    assert on("").status_code == 422 and "must name a release" in on("").json()["detail"]
    put_evaluation(store, "fp8_cache", "h200", "v7", verdict="fail")
    assert on("release=v7").status_code == 409
    assert client.get("/v1/switches", params={"release": "v7"}).json()["switches"]["fp8_cache"] is False
    put_evaluation(store, "fp8_cache", "h200", "v7", verdict="pass")
    r = on("gpu_kind=h200,release=v7")
    assert r.status_code == 200 and r.json()["changed"], r.text
    assert client.get("/v1/switches", params={"release": "v7", "gpu_kind": "h200"}).json()["switches"]["fp8_cache"]
    ok = client.put("/v1/switches/cuda_graphs", headers=admin,  # moves no number: no evaluation needed
                    json={"value": True, "scope": "", "who": "op", "why": "t"})
    assert ok.status_code == 200


def test_a_switch_that_moves_no_number_needs_no_evaluation(client, admin):
    _off(client, admin, "cuda_graphs", "release=v7")
    assert _canary(client, admin, "cuda_graphs").status_code == 201


def test_rules_show_the_evaluation_behind_each_default(client, store):
    put_evaluation(store, "fp8_cache", "h200", "v7")
    put_evaluation(store, "static_scales", "h200", "v7", verdict="fail")
    body = client.get("/v1/switches/rules").json()
    (h200,) = body["defaults_by_gpu_kind"]["by_gpu_kind"]
    assert (h200["gpu_kind"], h200["release"]) == ("h200", "v7")
    sw = h200["switches"]
    assert sw["fp8_cache"]["default"] is True and sw["fp8_cache"]["evaluation"]["verdict"] == "pass"
    assert sw["static_scales"]["default"] is False and sw["static_scales"]["evaluation"]["verdict"] == "fail"
    assert sw["ring_cache"]["default"] is False and sw["ring_cache"]["evaluation"] is None  # never evaluated
    assert sw["cuda_graphs"] == {"default": True, "numeric": False, "evaluation": None}
    assert sw["buffer_per_shape"]["default"] is False  # the fault switch is never a default


def test_a_canary_whose_evaluation_fails_meanwhile_is_not_promoted(store):
    """A canary of the H200s of v7, started on a passing H200 evaluation; a failing one posted meanwhile
    rolls it back at its decision, though its cohort is no worse than the rest."""
    from tests.api.test_canary import T0, stream

    scope = "gpu_kind=h200,release=v7"
    put_evaluation(store, "fused_allreduce", "h200", "v7", ts=T0 - timedelta(hours=1))
    get_switchboard(store, cache_s=0).set("fused_allreduce", False, scope, actor="a", reason="b")
    c = canary.start_canary(store, "fused_allreduce", scope, fraction=0.3, actor="a", reason="b", min_sessions=30,
                            now=T0)
    assert [e["gpu_kind"] for e in c["evidence"]["evaluations"]] == ["h200"]
    stream(store, c["bucket_hi"])  # a cohort no worse than the rest: it would be promoted
    put_evaluation(store, "fused_allreduce", "h200", "v7", verdict="fail", ts=T0 + timedelta(minutes=30))
    r = canary.evaluate(store, c["id"], now=T0 + timedelta(hours=1))
    assert r["status"] == "rolled_back" and r["evidence"]["regressed"] == ["evaluation"]
    assert "'fail'" in r["evidence"]["gate"] and "gpu_kind=h200" in r["evidence"]["gate"]
