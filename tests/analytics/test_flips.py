"""Flips that hurt sessions (analytics/flips.py): on literal flip_cost rows with a known answer, and as a job on a
store: a flip whose sessions got late chunks is a finding (critical when it stalled a second), a clean one nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import orjson
import polars as pl

from analytics import flips
from analytics.findings import read_findings
from analytics.jobs import run_job

T0 = datetime(2026, 12, 2, 8, 0, tzinfo=UTC)


def _flip(switch: str, value: bool, late: int = 0, stall_ms: float = 0.0, release: str = "v1", gpu_kind: str = "h200",
          worker: str = "w1", step: int = 10, applied: int = 40) -> dict:
    return {"worker_id": worker, "session_id": f"s-{worker}-{switch}-{value}-{late}", "release": release,
            "gpu_kind": gpu_kind, "ts": T0, "switch": switch, "value": value, "mode": "background", "step": step,
            "applied_step": applied, "late_chunks": late, "stall_ms": stall_ms, "steps_observed": 24,
            "to_new_config_ms": 5000.0, "build_ms": 4900.0, "apply_ms": 20.0, "out_of_service_ms": 0.0, "error": None}


def _sessions(release="v1", gpu_kind="h200", late=0, steps=10_000) -> pl.DataFrame:
    return pl.DataFrame([{"release": release, "gpu_kind": gpu_kind, "late_chunks": late, "steps": steps}])


def test_judge_on_literal_flips():
    df = pl.DataFrame([_flip("static_scales", False, late=1, stall_ms=9650.0), _flip("static_scales", False),
                       _flip("static_scales", True),  # flipped back on: clean
                       _flip("compile", False, late=1, stall_ms=80.0, release="v2"),  # v2's sessions are often late
                       _flip("fp8_cache", False, late=2, stall_ms=300.0, gpu_kind="b200")])  # no sessions seen there
    sessions = pl.concat([_sessions(), _sessions(release="v2", late=3_000)])
    j = {(r["release"], r["gpu_kind"], r["switch"], r["value"]): r for r in flips.judge(df, sessions).iter_rows(named=True)}
    off = j[("v1", "h200", "static_scales", False)]
    assert (off["flips"], off["late_flips"], off["late_chunks"], off["chunks"]) == (2, 1, 1, 2 * (24 + 30))
    assert off["hurt"] and off["max_stall_ms"] == 9650.0
    assert not j[("v1", "h200", "static_scales", True)]["hurt"]
    assert not j[("v2", "h200", "compile", False)]["hurt"]  # one late chunk is v2's usual rate (30%), not the flip
    assert j[("v1", "b200", "fp8_cache", False)]["hurt"]
    rows = flips.findings(flips.judge(df, sessions), T0, T0 + timedelta(hours=1))
    got = {(r["scope"], r["metric"]): r for r in rows}
    assert set(got) == {("gpu_kind=h200,release=v1", "static_scales=off"), ("gpu_kind=b200,release=v1", "fp8_cache=off")}
    assert got[("gpu_kind=h200,release=v1", "static_scales=off")]["severity"] == "critical"  # a 9.65 s stall
    assert got[("gpu_kind=b200,release=v1", "fp8_cache=off")]["severity"] == "warning"
    assert all(r["kind"] == "flip_cost" and r["attribution"] in ("static_scales", "fp8_cache") for r in rows)


def _insert(store, rows: list[dict]) -> None:
    cols = ["worker_id", "session_id", "release", "gpu_kind", "ts", "simulated", "kind", "detail"]
    store.client().insert("events", [[r["worker_id"], r["session_id"], r["release"], r["gpu_kind"], r["ts"], False,
                                      "flip_cost", orjson.dumps(r["detail"]).decode()] for r in rows], column_names=cols)


def flip_event(switch: str, value: bool, late: int, stall_ms: float, ts: datetime, worker: str = "w1",
               release: str = "v1", gpu_kind: str = "h200") -> dict:
    """A flip_cost event as a worker sends it (the fields of collector/flip_fields.py)."""
    return {"worker_id": worker, "session_id": f"s-{worker}-{ts.timestamp()}", "release": release, "gpu_kind": gpu_kind,
            "ts": ts, "detail": {"step": 12, "applied_step": 40, "changed": {switch: value}, "switches": "",
                                 "mode": "background", "late_chunks": late, "stall_ms": stall_ms, "steps_observed": 24,
                                 "to_new_config_ms": 4700.0, "apply_ms": 21.0, "build_ms": 4600.0,
                                 "out_of_service_ms": 0.0, "error": None}}


def test_the_job_raises_a_finding_for_a_flip_that_stalls_and_nothing_for_one_that_does_not(store):
    now = datetime.now(UTC)
    _insert(store, [flip_event("static_scales", False, 0, 0.0, now - timedelta(hours=2), worker="w1"),
                    flip_event("static_scales", False, 0, 0.0, now - timedelta(hours=2), worker="w2")])
    assert run_job("flips", store, now=now) == []  # clean flips: nothing
    _insert(store, [flip_event("triton_kernels", False, 3, 2100.0, now - timedelta(hours=1), worker="w3")])
    rows = run_job("flips", store, now=now)
    assert [(r["metric"], r["severity"], r["attribution"]) for r in rows] == [
        ("triton_kernels=off", "critical", "triton_kernels")]
    stored = read_findings(store, kind="flip_cost")
    assert len(stored) == 1 and stored["scope"][0] == "gpu_kind=h200,release=v1"
