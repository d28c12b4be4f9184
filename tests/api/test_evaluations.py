"""Evaluations as telemetry and as the gate on numeric switch defaults: a real (tiny) evaluation's records
go through the shipping client, a real uvicorn collector, the spool and the writer into chDB and come back
from ``GET /v1/evaluations``; a canary of a numeric switch without a passing evaluation is refused with a
4xx naming what is missing; ``GET /v1/switches/rules`` shows the evaluation behind each default."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest

from api import canary
from api.switchboard import get_switchboard
from tests.api.evaluations import put_evaluation
from tests.api.live import serve
from tests.collector.helpers import chdb_dsn, drained, make_settings, wait_for

TOKEN = "test-ingest-token"


pytestmark = pytest.mark.usefixtures("torch_chains_only")  # tests/conftest.py


@pytest.fixture(scope="module")
def result():
    from worker.evaluate import evaluate

    return evaluate("tiny", "cpu", ["fp8_cache", "static_scales"], steps=8, reruns=2, release="v9", gpu_kind="h200")


def test_evaluation_records_round_trip_through_the_collector(result, tmp_path, chdb_dir):
    from api.app import create_app
    from worker.evaluate import records, ship

    settings = make_settings(chdb_dsn(chdb_dir), tmp_path, role="all", ingest_tokens=[TOKEN])
    app = create_app(settings)
    with serve(app, lifespan="on") as url:
        sent = ship(result, url, TOKEN)
        wait_for(lambda: drained(app), what="the spool drained")
        auth = {"Authorization": f"Bearer {TOKEN}"}
        got = httpx.get(f"{url}/v1/evaluations", params={"release": "v9", "limit": 1000}, headers=auth).json()
        latest = httpx.get(f"{url}/v1/evaluations/latest", params={"release": "v9"}, headers=auth).json()
        bad = httpx.get(f"{url}/v1/evaluations", params={"metric": "vibes"}, headers=auth)
    want = records(result)
    assert sent == len(want) == len(got["evaluations"])
    key = lambda r: (r["switch"], r["metric"], r["step"] if r["step"] is not None else -1)
    for w, g in zip(sorted(want, key=key), sorted(got["evaluations"], key=key), strict=True):
        assert g["evaluation_id"] == result["evaluation_id"] and g["gpu_kind"] == "h200"
        assert (g["value"], g["band_lo"], g["band_hi"], g["verdict"], g["n"]) == (
            w["value"], w["band_lo"], w["band_hi"], w["verdict"], w["n"])
    assert {(x["switch"], x["verdict"]) for x in latest["latest"]} == {
        ("fp8_cache", result["overall"]["fp8_cache"]), ("static_scales", result["overall"]["static_scales"])}
    assert bad.status_code == 422 and "valid: teacher_forced_ratio" in bad.json()["detail"]


def _canary(client, admin, switch="fused_allreduce", scope="release=v7"):
    return client.post("/v1/canaries", headers=admin, json={"switch": switch, "scope": scope, "fraction": 0.3,
                                                            "who": "op", "why": "fixed"})


def _off(client, admin, switch, scope):
    r = client.put(f"/v1/switches/{switch}", headers=admin, json={"value": False, "scope": scope, "who": "a",
                                                                  "why": "b"})
    assert r.status_code == 200


def test_a_canary_of_a_numeric_switch_without_a_passing_evaluation_is_refused(client, admin, store):
    _off(client, admin, "fused_allreduce", "release=v7")
    r = _canary(client, admin)
    assert r.status_code == 409 and "no evaluation on any GPU kind" in r.json()["detail"]
    assert "livestep evaluate --switch fused_allreduce" in r.json()["detail"]
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
    from tests.api.test_canary import T0, stream

    put_evaluation(store, "fused_allreduce", "h200", "v7", ts=T0 - timedelta(hours=1))
    get_switchboard(store, cache_s=0).set("fused_allreduce", False, "release=v7", actor="a", reason="b")
    c = canary.start_canary(store, "fused_allreduce", "release=v7", fraction=0.3, actor="a", reason="b",
                            min_sessions=30, now=T0)
    stream(store, c["bucket_hi"])  # a cohort no worse than the rest: it would be promoted
    put_evaluation(store, "fused_allreduce", "h200", "v7", verdict="fail", ts=T0 + timedelta(minutes=30))
    r = canary.evaluate(store, c["id"], now=T0 + timedelta(hours=1))
    assert r["status"] == "rolled_back" and r["evidence"]["regressed"] == ["evaluation"]
    assert "'fail'" in r["evidence"]["gate"]


def test_the_h200_evaluations_as_the_gate_reads_them(client, admin, store):
    """The H200's own runs (tests/worker/h200), judged and stored as evaluation records: the production
    set's failed free-running judge is the evidence shown for that kind, and a teacher-forced pass alone
    (every switch's, there) lets no numeric switch on."""
    from collector.records import to_arrow
    from tests.worker.test_evaluate import _h200
    from worker.evaluate import judge, records

    for name in ("teacher_forced", "free_running"):
        got = judge(_h200(name))
        store.insert_arrow("evaluations", to_arrow("evaluation", records(got)), dedup_token=f"h200-{name}")
    kinds = client.get("/v1/switches/rules").json()["defaults_by_gpu_kind"]["by_gpu_kind"]
    [h200] = [k for k in kinds if k["gpu_kind"] == "NVIDIA H200" and k["release"] == "dev"]
    assert h200["production"]["verdict"] == "fail"
    assert h200["switches"]["fp8_cache"]["default"] is False and h200["switches"]["cuda_graphs"]["default"]
    r = client.put("/v1/switches/fp8_cache", headers=admin, json={
        "value": True, "scope": "gpu_kind=NVIDIA H200,release=dev", "who": "op", "why": "teacher-forced passed"})
    assert r.status_code == 409 and "no evaluation" in r.json()["detail"]
