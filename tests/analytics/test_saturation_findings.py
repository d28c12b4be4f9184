"""FP8 saturation (analytics/saturation.py): the proportion judge on literal per-session frames with a
known answer, the job on a store (a drifting cohort flagged and blamed on static_scales, a healthy
fleet not, a finding resolved once it goes away), and the simulator's drifting cohort found."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import polars as pl
import pytest

from analytics import saturation
from analytics.findings import read_findings
from analytics.jobs import run_job
from analytics.simulate import SimulationError, simulate_fleet
from collector import records
from tests.collector.helpers import step_rows

TOL = saturation.SATURATED_FRACTION


def _sessions(release: str, gpu_kind: str, maxima: list[float | None], static: bool = True,
              sampled: int = 3) -> list[dict]:
    return [{"release": release, "gpu_kind": gpu_kind, "worker_id": "w", "session_id": f"{release}-{gpu_kind}-{i}",
             "sampled_steps": sampled if m is not None else 0, "saturating_steps": int(bool(m)) * sampled,
             "static_steps": sampled if static and m is not None else 0, "sat_max": m}
            for i, m in enumerate(maxima)]


def _by_group(df: pl.DataFrame) -> dict[tuple[str, str], dict]:
    return {(r["release"], r["gpu_kind"]): r for r in df.iter_rows(named=True)}


def test_judge_on_literal_sessions():
    frame = pl.DataFrame(
        _sessions("v1", "h200", [0.0] * 20 + [TOL / 2] * 10 + [5 * TOL] * 10 + [None] * 5)  # 10 of 40 saturate
        + _sessions("v1", "h100", [0.0] * 40)                      # none
        + _sessions("v2", "h200", [5 * TOL] * 10)                  # all, but too few sessions
        + _sessions("v2", "h100", [0.0] * 99 + [5 * TOL])          # 1 in 100: the tolerated share
        + _sessions("v3", "h200", [TOL] * 40)                      # at the tolerance, not above it
    )
    g = _by_group(saturation.judge(frame))
    a = g[("v1", "h200")]
    assert (a["sessions"], a["saturating"], a["share"]) == (40, 10, 0.25)  # the 5 unsampled sessions left out
    assert a["flagged"] and a["enough"] and a["p_value"] < 1e-10
    assert a["sat_p95"] == pytest.approx(5 * TOL) and a["sat_max"] == pytest.approx(5 * TOL)
    assert a["ci_low"] < 0.25 < a["ci_high"] and a["ci_low"] > saturation.TOLERATED_SHARE
    assert a["static_saturating"] == 10
    assert (g[("v1", "h100")]["saturating"], g[("v1", "h100")]["flagged"]) == (0, False)
    assert g[("v1", "h100")]["p_value"] == 1.0
    assert (g[("v2", "h200")]["share"], g[("v2", "h200")]["enough"], g[("v2", "h200")]["flagged"]) == (1.0, False, False)
    assert (g[("v2", "h100")]["saturating"], g[("v2", "h100")]["flagged"]) == (1, False)
    assert (g[("v3", "h200")]["saturating"], g[("v3", "h200")]["flagged"]) == (0, False)


def test_judge_of_nothing_sampled_is_empty():
    assert saturation.judge(pl.DataFrame(_sessions("v1", "h200", [None] * 50))).is_empty()


def test_findings_severity_and_attribution():
    start, end = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 11, 3, 6, tzinfo=UTC)
    frame = pl.DataFrame(
        _sessions("v1", "h200", [0.0] * 30 + [5 * TOL] * 10)                    # 25%: critical, blamed
        + _sessions("v1", "b200", [0.0] * 190 + [5 * TOL] * 10)                 # 5%: warning
        + _sessions("v2", "h200", [0.0] * 30 + [5 * TOL] * 10, static=False)    # measured without static scales
    )
    rows = {r["scope"]: r for r in saturation.findings(saturation.judge(frame), frame, start, end)}
    assert set(rows) == {"gpu_kind=h200,release=v1", "gpu_kind=b200,release=v1", "gpu_kind=h200,release=v2"}
    crit = rows["gpu_kind=h200,release=v1"]
    assert (crit["kind"], crit["metric"], crit["severity"], crit["attribution"]) == \
        ("fp8_saturation", "fp8_saturated", "critical", "static_scales")
    assert crit["value"] == 0.25 and crit["baseline"] == saturation.TOLERATED_SHARE
    assert crit["window_start"] == datetime(2026, 11, 3, tzinfo=UTC) and crit["window_end"] == end
    ev = json.loads(crit["evidence"])
    assert (ev["sessions"], ev["saturating_sessions"]) == (40, 10)
    assert ev["max_fraction"] == pytest.approx(5 * TOL) and len(ev["worst_sessions"]) == 5
    assert (rows["gpu_kind=b200,release=v1"]["severity"], rows["gpu_kind=b200,release=v1"]["attribution"]) == \
        ("warning", "static_scales")
    assert rows["gpu_kind=h200,release=v2"]["attribution"] == ""


# ---- on a store -------------------------------------------------------------------------------------

def _steps(store, session_id: str, t0: datetime, sat: float | None, release="v7", gpu_kind="h200",
           switches="fp8_cache,static_scales"):
    rows = step_rows(40, session_id=session_id, ts=t0, release=release, switches=switches, gpu_kind=gpu_kind)
    for r in rows:
        r["fp8_saturated"] = sat if r["step"] % 8 == 4 else None
    store.insert_arrow("steps", records.to_arrow("step", rows), dedup_token=session_id)


def test_job_flags_a_saturating_cohort_and_resolves_it_once_gone(store):
    end = datetime(2026, 11, 10, 12, tzinfo=UTC)
    for i in range(40):  # v7 on h200: half the sessions saturate, 30 h before the run
        _steps(store, f"bad-{i}", end - timedelta(hours=30, minutes=i), 3e-3 if i % 2 else 0.0)
    for i in range(40):  # v7 on h100: isolated outliers only
        _steps(store, f"ok-{i}", end - timedelta(hours=30, minutes=i), 1e-7, gpu_kind="h100")
    for i in range(40):  # static scales off: nothing measured
        _steps(store, f"off-{i}", end - timedelta(hours=30, minutes=i), None, gpu_kind="b200", switches="fp8_cache")
    rows = run_job("fp8_saturation", store, now=end)
    assert [(r["scope"], r["severity"], r["attribution"]) for r in rows] == \
        [("gpu_kind=h200,release=v7", "critical", "static_scales")]
    assert rows[0]["value"] == 0.5
    assert len(read_findings(store, kind="fp8_saturation", status="open")) == 1
    assert run_job("fp8_saturation", store, now=end + timedelta(hours=1))  # the same day: replaced, still open
    assert len(read_findings(store, kind="fp8_saturation", status="open")) == 1
    # a day later the saturating sessions have left the 2-day window: the finding resolves
    assert run_job("fp8_saturation", store, now=end + timedelta(hours=20)) == []
    assert read_findings(store, kind="fp8_saturation", status="open").is_empty()
    assert len(read_findings(store, kind="fp8_saturation", status="resolved")) == 1


def test_simulated_drift_is_found_on_its_cohort_only(store, small):
    small["session_median_s"] = 30.0
    sim = simulate_fleet(store, weeks=1, incidents=[("august", 3)], seed=14, fp8_drift=("august", "b200"), **small)
    aug = sim.release("august").name
    rows = run_job("fp8_saturation", store, now=sim.end)
    assert [(r["scope"], r["severity"], r["attribution"]) for r in rows] == \
        [(f"gpu_kind=b200,release={aug}", "critical", "static_scales")]
    healthy = saturation.judge(saturation.session_saturation(store, sim.end - timedelta(days=2), sim.end))
    assert healthy.filter(pl.col("gpu_kind") != "b200")["saturating"].sum() == 0
    assert healthy["sessions"].min() >= saturation.MIN_SESSIONS


def test_a_fleet_without_drift_samples_but_is_not_flagged(store, small):
    sim = simulate_fleet(store, weeks=0.5, seed=15, **small)
    assert run_job("fp8_saturation", store, now=sim.end) == []
    sampled = store.query_rows("SELECT countIf(fp8_saturated IS NOT NULL), count(), max(fp8_saturated) FROM steps")[0]
    assert 0 < sampled[0] < sampled[1] / 50 and sampled[2] < saturation.SATURATED_FRACTION


def test_simulator_refuses_an_unknown_drift_cohort(store):
    with pytest.raises(SimulationError, match="GPU kinds"):
        simulate_fleet(store, weeks=1, fp8_drift=("august", "tpu"))
