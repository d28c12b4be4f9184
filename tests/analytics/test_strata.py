"""Daily fleet series compared within strata (analytics/strata.py): a change of the session mix alone moves
neither the change-point nor the drift series; a real per-step change in the same changed mix still does."""

import json
from datetime import UTC, datetime, timedelta

import polars as pl

from analytics import changepoints, drift, holdout, strata
from analytics.detector_eval import sim_end

DAY0 = datetime(2026, 11, 1, tzinfo=UTC)


def _cells(shift: float = 0.0) -> pl.DataFrame:
    """Two strata (short sessions at 1.0, long ones at 2.0); from day 5 the long ones go from 10% of the
    sessions to 90%, and every stratum moves by ``shift``."""
    rows = []
    for d in range(10):
        late = d >= 5
        for stratum, value, n in (("short", 1.0, 90 if not late else 10), ("long", 2.0, 10 if not late else 90)):
            rows.append({"gpu_kind": "h100", "day": DAY0 + timedelta(days=d), "stratum": stratum,
                         "value": value + (shift if late else 0.0), "sessions": n})
    return pl.DataFrame(rows)


def test_a_changed_mix_alone_leaves_the_marginal_means_flat():
    plain = _cells().group_by("day").agg(((pl.col("value") * pl.col("sessions")).sum() / pl.col("sessions").sum())
                                         .alias("v")).sort("day")["v"]
    assert plain[9] - plain[0] > 0.7  # what the unstratified daily mean does
    out = strata.standardize(_cells(), ["gpu_kind"], "day", ["value"], size="sessions")
    assert max(out["value"]) - min(out["value"]) < 1e-6


def test_a_change_of_every_stratum_moves_them_by_that_change():
    out = strata.standardize(_cells(shift=0.3), ["gpu_kind"], "day", ["value"], size="sessions")["value"]
    assert abs((out[9] - out[0]) - 0.3) < 1e-6


def test_a_stratum_a_day_lacks_is_filled_from_the_other_days_not_dropped():
    c = _cells().filter(~((pl.col("stratum") == "long") & (pl.col("day") < DAY0 + timedelta(days=5))))
    out = strata.standardize(c, ["gpu_kind"], "day", ["value"], size="sessions")["value"]
    assert max(out) - min(out) < 1e-6


def _acting(rows):
    return [(r["kind"], r["scope"], r["metric"]) for r in rows if r["severity"] in ("warning", "critical")]


def _fleet(store, scenario, seed):
    res = holdout.generate(store, scenario=scenario, seed=seed, end=sim_end(seed), days=10, onset_day=6,
                           sessions_per_day=30)
    return res, res.onset + timedelta(hours=96)


def test_longer_sessions_with_the_same_steps_raise_no_change_point_or_drift(store):
    # seed 4: before strata, the h100 late-chunk rate (its reset steps are late, and twice as long a session
    # holds a larger share of them) was a critical change point "release gaining share: v2"
    _, end = _fleet(store, "longer_sessions", 4)
    rows = changepoints.run(store, end - timedelta(days=42), end) + drift.run(store, end - timedelta(days=28), end)
    assert _acting(rows) == []
    plain = changepoints.daily_series(store, end - timedelta(days=42), end)
    h100 = plain.filter((pl.col("gpu_kind") == "h100") & (pl.col("sessions") >= changepoints.MIN_SESSIONS_PER_DAY))
    raw = h100["late_chunk_rate_unstratified"].to_list()
    assert sum(raw[-3:]) / 3 - sum(raw[:5]) / 5 > changepoints.DAILY_METRICS["late_chunk_rate"][2] * 0.6  # the mix moved


def test_a_real_per_step_change_in_the_same_changed_mix_is_still_found(store):
    res, end = _fleet(store, "longer_sessions_slower", 5)
    rows = [r for r in changepoints.run(store, end - timedelta(days=42), end) if r["metric"] == "diffusion_ms_p50"]
    assert sorted(r["scope"] for r in rows) == [f"gpu_kind={k}" for k in sorted(res.kinds)]
    for r in rows:
        ev = json.loads(r["evidence"])
        assert ev["release_gaining"] == "v2" and ev["strata"] == strata.NOTE
        assert 0.025 < r["effect"] < 0.055  # the +4% of every step, not the mix
