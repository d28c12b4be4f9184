"""Slow drift (analytics/drift.py): Mann-Kendall + Theil-Sen on literal series with known answers, and a
simulated 0.5%/day cache-upkeep drift inside one release flagged within 10 days, benign fleets not."""

from datetime import timedelta

import numpy as np
import pytest

from analytics import drift
from analytics.simulate import simulate_fleet


def test_a_strictly_rising_series_is_a_trend_with_its_slope():
    t = drift.trend([10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5])
    assert t.tau == pytest.approx(1.0) and t.slope_per_day == pytest.approx(0.5) and t.drifting
    # the smallest one-sided Mann-Kendall p-value on 6 points is 1/720
    assert drift.trend(list(range(6))).p_value == pytest.approx(1 / 720, rel=1e-6)


def test_a_falling_or_flat_series_is_not_a_drift():
    assert not drift.trend([13.5, 13.0, 12.5, 12.0, 11.5, 11.0, 10.5]).drifting  # better, not worse
    assert not drift.trend([5.0] * 10).drifting


def test_below_the_practical_floor_is_not_a_drift():
    """0.1%/day is a real trend (tau = 1) but 0.7%/week is under the 2%/week floor."""
    t = drift.trend([100 * 1.001**d for d in range(14)])
    assert t.tau == pytest.approx(1.0) and t.p_value < 1e-6 and not t.drifting
    assert t.pct_per_week == pytest.approx(0.7, abs=0.01)


def test_half_a_percent_a_day_is_flagged_within_ten_days_through_day_noise():
    rng = np.random.default_rng(3)
    first = []
    for _ in range(20):
        noise = np.exp(rng.normal(0, 0.005, 21))  # 0.5% day-to-day noise: as large as a day's drift
        series = 8.5 * 1.005 ** np.arange(21) * noise
        first.append(next((n for n in range(3, 22) if drift.trend(series[:n]).drifting), None))
    assert all(f is not None and f <= 10 for f in first), first


def test_noise_alone_is_not_a_drift():
    rng = np.random.default_rng(4)
    flagged = sum(drift.trend(8.5 * np.exp(rng.normal(0, 0.01, 14))).drifting for _ in range(200))
    assert flagged / 200 <= 0.02


def test_a_simulated_drift_inside_a_release_is_found_within_ten_days(store, small):
    sim = simulate_fleet(store, weeks=3, incidents=[("drift", 5)], seed=21, **small)
    rel = sim.release("drift")
    rows = drift.run(store, rel.start - timedelta(days=5), rel.start + timedelta(days=10))
    hit = [r for r in rows if r["metric"] == "cache_upkeep_ms_p50" and f"release={rel.name}" in r["scope"]]
    assert {r["scope"].split(",")[0] for r in hit} == {f"gpu_kind={k}" for k in {w.gpu_kind for w in sim.workers}}
    assert all(0.02 < r["effect"] < 0.07 for r in hit)  # 3.5% a week, measured over 10 noisy days
    assert [r for r in rows if r not in hit] == []


def test_a_benign_release_has_no_drift(store, small):
    sim = simulate_fleet(store, weeks=2, incidents=[("benign", 5)], seed=22, **small)
    assert drift.run(store, sim.start, sim.end) == []


def test_a_rate_near_zero_is_judged_in_points_not_percent():
    """A late-chunk rate from 0.10% to 0.16% over 12 days: +60% of its level, but 0.035 points a week."""
    rates = [0.001 + 0.00005 * d for d in range(12)]
    assert drift.trend(rates).drifting  # as a level it would be a drift
    assert not drift.trend(rates, share=True).drifting
    assert drift.trend([0.01 + 0.002 * d for d in range(8)], share=True).drifting  # 1.4 points a week
