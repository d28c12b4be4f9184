"""FP8 saturation (analytics/saturation.py): the proportion judge on literal per-session frames with a
known answer (the tolerance against one lost channel at the prod shape; critical only on enough
sessions and workers), the job on a store (a drifting cohort flagged and blamed on static_scales, a
healthy fleet not, a finding resolved once it goes away, first_seen kept from day to day), the
ClickHouse counting equal to the frame's, and the simulator's drifting cohort found."""

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
              sampled: int = 3, workers: int = 5) -> list[dict]:
    """One row per session; session i runs on worker f"w{i % workers}"."""
    return [{"release": release, "gpu_kind": gpu_kind, "worker_id": f"w{i % workers}",
             "session_id": f"{release}-{gpu_kind}-{i}",
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
    assert a["static_saturating"] == 10 and a["saturating_workers"] == 5
    assert (g[("v1", "h100")]["saturating"], g[("v1", "h100")]["flagged"]) == (0, False)
    assert g[("v1", "h100")]["p_value"] == 1.0
    assert (g[("v2", "h200")]["share"], g[("v2", "h200")]["enough"], g[("v2", "h200")]["flagged"]) == (1.0, False, False)
    assert (g[("v2", "h100")]["saturating"], g[("v2", "h100")]["flagged"]) == (1, False)
    assert (g[("v3", "h200")]["saturating"], g[("v3", "h200")]["flagged"]) == (0, False)


# the 57B shape (d_model 7680) at TP=1: 9d static-scale GEMM-input elements per token and block
ONE_CHANNEL_TP1 = 1 / (9 * 7680)        # one channel of one linear's input lost in every token: 14.5 ppm
ONE_CHANNEL_TP3 = 1 / (5 * 7680)        # on a TP=3 rank (row-parallel inputs sharded): 26 ppm
ONE_CHANNEL_TP3_FUSED = 1 / (3 * 7680)  # TP=3 with fused_allreduce (row-parallel inputs not counted): 43 ppm


@pytest.mark.parametrize("lost", [ONE_CHANNEL_TP1, ONE_CHANNEL_TP3, ONE_CHANNEL_TP3_FUSED, 3 * ONE_CHANNEL_TP1])
def test_one_lost_channel_saturates_a_session_whatever_the_tp_size(lost):
    frame = pl.DataFrame(_sessions("v1", "h200", [0.0] * 30 + [lost] * 10))
    (g,) = saturation.judge(frame).iter_rows(named=True)
    assert (g["saturating"], g["flagged"]) == (10, True)


@pytest.mark.parametrize("outlier", [1e-7, 1e-6, 9.9e-6])
def test_isolated_outliers_below_ten_ppm_do_not_saturate(outlier):
    frame = pl.DataFrame(_sessions("v1", "h200", [outlier] * 40))
    (g,) = saturation.judge(frame).iter_rows(named=True)
    assert (g["saturating"], g["flagged"]) == (0, False)


def test_judge_of_nothing_sampled_is_empty():
    assert saturation.judge(pl.DataFrame(_sessions("v1", "h200", [None] * 50))).is_empty()


def test_findings_severity_and_attribution():
    start, end = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 11, 3, 6, tzinfo=UTC)
    frame = pl.DataFrame(
        _sessions("v1", "h200", [0.0] * 30 + [5 * TOL] * 8 + [50 * TOL] * 2)   # 25% on 5 workers: critical
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
    assert (ev["sessions"], ev["saturating_sessions"], ev["saturating_workers"]) == (40, 10, 5)
    assert ev["max_fraction"] == pytest.approx(50 * TOL) and len(ev["worst_sessions"]) == 5
    # sessions 38 and 39 (on w3 and w4) are the worst; every worker has two saturating sessions
    assert ev["worst_workers"] == [["w3", 2, 50 * TOL], ["w4", 2, 50 * TOL], ["w0", 2, 5 * TOL],
                                   ["w1", 2, 5 * TOL], ["w2", 2, 5 * TOL]]
    assert (rows["gpu_kind=b200,release=v1"]["severity"], rows["gpu_kind=b200,release=v1"]["attribution"]) == \
        ("warning", "static_scales")
    assert rows["gpu_kind=h200,release=v2"]["attribution"] == ""


@pytest.mark.parametrize("maxima,workers,severity", [
    ([0.0] * 30 + [5 * TOL] * 5, 2, "critical"),    # 14%, 5 saturating sessions on 2 workers: just enough
    ([0.0] * 26 + [5 * TOL] * 4, 2, "warning"),     # 13% but only 4 saturating sessions
    ([0.0] * 30 + [5 * TOL] * 10, 1, "warning"),    # 25%, all on one worker
    ([0.0] * 95 + [5 * TOL] * 5, 2, "warning"),     # 5 on 2 workers but 5%: under CRITICAL_SHARE
])
def test_critical_only_on_enough_sessions_and_workers(maxima, workers, severity):
    frame = pl.DataFrame(_sessions("v1", "h200", maxima, workers=workers))
    groups = saturation.judge(frame)
    assert groups["flagged"].to_list() == [True]
    (row,) = saturation.findings(groups, frame, datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 11, 3, tzinfo=UTC))
    ev = json.loads(row["evidence"])
    assert row["severity"] == severity
    assert ev["saturating_workers"] == min(workers, ev["saturating_sessions"]) == len(ev["worst_workers"])


# ---- on a store -------------------------------------------------------------------------------------

def _steps(store, session_id: str, t0: datetime, sat: float | None, release="v7", gpu_kind="h200",
           switches="fp8_cache,static_scales", worker_id="w1"):
    rows = step_rows(40, session_id=session_id, ts=t0, release=release, switches=switches, gpu_kind=gpu_kind,
                     worker_id=worker_id)
    for r in rows:
        r["fp8_saturated"] = sat if r["step"] % 8 == 4 else None
    store.insert_arrow("steps", records.to_arrow("step", rows), dedup_token=session_id)


def test_job_flags_a_saturating_cohort_and_resolves_it_once_gone(store):
    end = datetime(2026, 11, 10, 12, tzinfo=UTC)
    for i in range(40):  # v7 on h200: half the sessions saturate (on workers w1, w3), 30 h before the run
        _steps(store, f"bad-{i}", end - timedelta(hours=30, minutes=i), 3e-3 if i % 2 else 0.0, worker_id=f"w{i % 4}")
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


def test_counts_in_clickhouse_equal_the_session_frames(store):
    """group_saturation (one row per group from ClickHouse) judged by judge_groups is judge() of the
    per-session frame, column for column (p95 interpolated alike)."""
    end = datetime(2026, 11, 10, 12, tzinfo=UTC)
    for i in range(37):
        t = end - timedelta(hours=5, minutes=i)
        _steps(store, f"a-{i}", t, [0.0, 2e-6, 1e-5, 3e-5, 4e-3][i % 5] * (1 + i / 37), worker_id=f"w{i % 3}")
        _steps(store, f"b-{i}", t, 1e-7 * i, gpu_kind="h100", release="v8", worker_id=f"w{i % 4}")
        _steps(store, f"c-{i}", t, None, gpu_kind="b200", switches="fp8_cache")  # never sampled
    _steps(store, "old", end - timedelta(days=3), 4e-3)  # started before the range
    start = end - timedelta(days=2)
    for release, gpu_kind in ((None, None), ("v7", None), (None, "h100")):
        framed = saturation.judge(saturation.session_saturation(store, start, end, release, gpu_kind))
        counted = saturation.judge_groups(saturation.group_saturation(store, start, end, release, gpu_kind))
        assert counted.columns == framed.columns and counted.height == framed.height > 0
        for a, b in zip(counted.iter_rows(named=True), framed.iter_rows(named=True), strict=True):
            floats = [k for k, v in b.items() if isinstance(v, float)]
            assert {k: a[k] for k in floats} == pytest.approx({k: b[k] for k in floats}, rel=1e-12, abs=1e-15)
            assert {k: a[k] for k in b if k not in floats} == {k: b[k] for k in b if k not in floats}
    (g,) = saturation.judge_groups(saturation.group_saturation(store, start, end, "v7")).iter_rows(named=True)
    assert (g["sessions"], g["saturating"], g["saturating_workers"]) == (37, 21, 3)


def test_a_finding_open_from_day_to_day_keeps_its_first_seen(store):
    end = datetime(2026, 11, 10, 12, tzinfo=UTC)
    for i in range(40):  # saturating sessions on the morning of day 1: in the window of both days' runs
        _steps(store, f"bad-{i}", end - timedelta(hours=6, minutes=i), 3e-3 if i % 2 else 0.0, worker_id=f"w{i % 4}")
    [day1] = run_job("fp8_saturation", store, now=end)
    [day2] = run_job("fp8_saturation", store, now=end + timedelta(hours=18))  # the next day: a new key
    assert day2["window_start"] == day1["window_start"] + timedelta(days=1)
    stored = read_findings(store, kind="fp8_saturation")
    assert stored["status"].to_list() == ["resolved", "open"]  # day 1's key resolved, day 2's open
    assert stored["first_seen"].n_unique() == 1  # day 2's row carries day 1's first_seen (stored in ms)
    assert day2["first_seen"] == stored["first_seen"][0]
    assert abs(day2["first_seen"] - day1["first_seen"]) < timedelta(milliseconds=1) < day2["updated_at"] - day1["updated_at"]


def test_first_seen_carries_within_an_open_series_only(store):
    """write_findings: a day-keyed fp8_saturation finding takes its open series' first_seen; another
    scope, another kind (first_seen per key) and a series that resolved in between start anew."""
    from analytics.findings import finding, write_findings

    t = [datetime(2026, 11, d, 12, tzinfo=UTC) for d in (10, 11, 12, 13)]

    def day(i: int, kind: str = "fp8_saturation", scope: str = "gpu_kind=h200,release=v7") -> dict:
        return finding(kind, scope, "fp8_saturated", t[i].replace(hour=0), t[i], value=0.5)

    def write(i: int, *rows: dict) -> dict[tuple[str, str], datetime]:
        out = write_findings(store, "j", t[i] - timedelta(days=2), t[i], list(rows), now=t[i])
        return {(r["kind"], r["scope"]): r["first_seen"] for r in out}

    fp8, cp, other = ("fp8_saturation", "gpu_kind=h200,release=v7"), ("changepoint", "gpu_kind=h200,release=v7"), \
        ("fp8_saturation", "gpu_kind=h100,release=v7")
    assert write(0, day(0), day(0, "changepoint")) == {fp8: t[0], cp: t[0]}
    assert write(1, day(1), day(1, "changepoint"), day(1, scope=other[1])) == {fp8: t[0], cp: t[1], other: t[1]}
    assert write(2) == {}  # nothing found: the day-2 keys resolve
    assert read_findings(store, status="open").is_empty()
    assert write(3, day(3)) == {fp8: t[3]}  # open again after a gap: a new first_seen


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
