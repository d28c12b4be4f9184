"""Canary: the cohort gets the switch back; simulated cohorts promote (no regression) or roll back
(slower steps, or memory growing); decisions and evidence land in the audit table and findings."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from api import canary
from api.switchboard import bucket, get_switchboard
from collector.records import to_arrow
from tests.api.evaluations import put_evaluation

T0 = datetime(2026, 11, 20, 8, tzinfo=UTC)
WORKERS = [f"w{i:03d}" for i in range(60)]
ON = "decoder_own_gpu,delta_rotation,fp8_cache,fused_allreduce,ring_cache,rope_at_write"
OFF = "decoder_own_gpu,delta_rotation,fp8_cache,ring_cache,rope_at_write"


def stream(store, hi: int, *, period_x: float = 1.0, mem_x: float = 1.0, sessions: int = 3, seed: int = 0,
           energy: float | None = 80_000.0):
    """Step rows for every worker of release v7 after T0; cohort workers (bucket < hi) run the switch."""
    rng = np.random.default_rng(seed)
    rows = []
    for w in WORKERS:
        in_cohort = bucket(w, "fused_allreduce") < hi
        for s in range(sessions):
            start = T0 + timedelta(minutes=5 + 7 * s, seconds=int(rng.integers(0, 60)))
            period = 160.0 * float(np.exp(rng.normal(0, 0.01))) * (period_x if in_cohort else 1.0)
            mem = int(60e9 * float(np.exp(rng.normal(0, 0.004))) * (mem_x if in_cohort else 1.0))
            for k in range(12):
                rows.append({
                    "worker_id": w, "session_id": f"{w}-s{s}", "release": "v7", "gpu_kind": "h200",
                    "ts": start + timedelta(milliseconds=period * k), "simulated": True, "step": k,
                    "diffusion_ms": period * 0.95, "step_period_ms": period, "decode_ms": 110.0,
                    "cache_upkeep_ms": 6.0, "attention_ms": 10.0, "allreduce_ms": None, "late": False,
                    "playout_depth": 3, "reset_step": False, "energy_mj": energy, "mem_allocated_bytes": mem,
                    "mem_reserved_bytes": mem, "buffers_registered": 1, "switches": ON if in_cohort else OFF})
    store.insert_arrow("steps", to_arrow("step", rows), dedup_token=f"canary-test-{seed}-{hi}")


@pytest.fixture
def running(store):
    put_evaluation(store, "fused_allreduce", "h200", "v7")  # a numeric switch: the gate's evidence
    board = get_switchboard(store, cache_s=0)
    board.set("fused_allreduce", False, "release=v7", actor="alert:test", reason="August leak")
    c = canary.start_canary(store, "fused_allreduce", "release=v7", fraction=0.3, actor="alice",
                            reason="fixed in v7.1", min_sessions=30, now=T0)
    return c


def test_cohort_gets_the_switch_back_and_the_rest_does_not(store, running):
    board = get_switchboard(store)
    cohort = [w for w in WORKERS if bucket(w, "fused_allreduce") < running["bucket_hi"]]
    rest = [w for w in WORKERS if bucket(w, "fused_allreduce") >= running["bucket_hi"]]
    assert cohort and rest
    assert all(board.resolve(w, "v7", "h200")[0]["fused_allreduce"] for w in cohort)
    assert not any(board.resolve(w, "v7", "h200")[0]["fused_allreduce"] for w in rest)
    assert "fused_allreduce" not in board.resolve(cohort[0], "v6", "h200")[0]  # other releases untouched
    actions = [d["action"] for d in board.history()]
    assert actions[0] == "canary_start"


def test_pending_until_enough_sessions(store, running):
    stream(store, running["bucket_hi"], sessions=1)
    r = canary.evaluate(store, running["id"], now=T0 + timedelta(hours=1))
    assert r["status"] == "running" and r["pending"] and r["evidence"]["sessions_cohort"] < 30


def test_pending_while_the_judges_lack_samples_even_if_min_sessions_is_lower(store):
    put_evaluation(store, "fused_allreduce", "h200", "v7")
    get_switchboard(store, cache_s=0).set("fused_allreduce", False, "release=v7", actor="a", reason="b")
    c = canary.start_canary(store, "fused_allreduce", "release=v7", fraction=0.3, actor="a", reason="b",
                            min_sessions=5, now=T0)
    stream(store, c["bucket_hi"], sessions=1)  # ~18 cohort sessions: above 5, below the judges' 30
    r = canary.evaluate(store, c["id"], now=T0 + timedelta(hours=1))
    assert r["status"] == "running" and r["pending"] and r["evidence"]["judges_short_of_samples"]


def test_promote_when_the_cohort_is_no_worse(store, running):
    stream(store, running["bucket_hi"])
    r = canary.evaluate(store, running["id"], now=T0 + timedelta(hours=1))
    assert r["status"] == "promoted", r["evidence"].get("regressed")
    board = get_switchboard(store)
    assert all(board.resolve(w, "v7", "h200")[0]["fused_allreduce"] for w in WORKERS)
    assert [x.cohort for x in board.rules() if x.name == "fused_allreduce"] == [""]
    d = board.history(source="canary")[0]
    assert d["action"] == "canary_promote" and d["changed"] and d["evidence"]["sessions_cohort"] >= 30
    f = store.query_rows("SELECT metric, attribution, severity FROM findings FINAL WHERE kind = 'canary'")
    assert f == [("canary_promoted", "fused_allreduce", "info")]
    assert canary.get_canary(store, running["id"])["status"] == "promoted"
    again = canary.evaluate(store, running["id"], now=T0 + timedelta(hours=2))
    assert again["decided"] is False and again["status"] == "promoted"


def test_promote_without_energy_readings(store, running):
    stream(store, running["bucket_hi"], energy=None)  # no NVML: the energy judge has no say
    r = canary.evaluate(store, running["id"], now=T0 + timedelta(hours=1))
    assert r["status"] == "promoted"


@pytest.mark.parametrize("period_x,mem_x,metric", [(1.25, 1.0, "step_period_ms"), (1.0, 1.4, "mem_reserved_max")])
def test_rollback_when_the_cohort_regresses(store, running, period_x, mem_x, metric):
    stream(store, running["bucket_hi"], period_x=period_x, mem_x=mem_x)
    r = canary.evaluate(store, running["id"], now=T0 + timedelta(hours=1))
    assert r["status"] == "rolled_back" and metric in r["evidence"]["regressed"]
    board = get_switchboard(store)
    assert not any(board.resolve(w, "v7", "h200")[0]["fused_allreduce"] for w in WORKERS)
    d = board.history(source="canary")[0]
    assert d["action"] == "canary_rollback" and d["changed"]
    assert store.query_rows("SELECT metric, severity FROM findings FINAL WHERE kind = 'canary'") == [
        ("canary_rolled_back", "warning")]


def test_alert_during_canary_cancels_it(store, running):
    get_switchboard(store).set("fused_allreduce", False, "", actor="alert:x", reason="leak again")
    r = canary.evaluate(store, running["id"], now=T0 + timedelta(hours=1))
    assert r["status"] == "cancelled"


def test_canary_routes(client, admin, store):
    put_evaluation(store, "fused_allreduce", "h200", "v7")
    w = {"switch": "fused_allreduce", "scope": "release=v7", "fraction": 0.3, "who": "a", "why": "b"}
    r = client.post("/v1/canaries", json=w, headers=admin)
    assert r.status_code == 409 and "not turned off by any rule" in r.json()["detail"]
    client.put("/v1/switches/fused_allreduce", headers=admin, json={"value": True, "scope": "release=v7",
                                                                     "who": "a", "why": "b"})
    r = client.post("/v1/canaries", json=w, headers=admin)
    assert r.status_code == 409 and "already on" in r.json()["detail"]
    client.put("/v1/switches/fused_allreduce", headers=admin, json={"value": False, "scope": "release=v7",
                                                                     "who": "a", "why": "b"})
    assert client.post("/v1/canaries", json=w).status_code == 401
    assert client.post("/v1/canaries", json={**w, "switch": "warp"}, headers=admin).status_code == 422
    assert client.post("/v1/canaries", json={**w, "fraction": 1.5}, headers=admin).status_code == 422
    r = client.post("/v1/canaries", json=w, headers=admin)
    assert r.status_code == 201
    cid = r.json()["id"]
    assert client.post("/v1/canaries", json=w, headers=admin).status_code == 409
    assert client.get(f"/v1/canaries/{cid}").json()["status"] == "running"
    assert [c["id"] for c in client.get("/v1/canaries", params={"status": "running"}).json()["canaries"]] == [cid]
    r = client.post(f"/v1/canaries/{cid}/evaluate", headers=admin)
    assert r.status_code == 200 and r.json()["status"] == "running" and r.json()["pending"]
    assert client.get("/v1/canaries/0123456789ab").status_code == 404
    assert client.get("/v1/canaries/nope").status_code == 422
