"""Variance changes (analytics/variance.py): Brown-Forsythe on literal samples with known answers, and a
simulated release with twice the step-time variance and the same median: an info note, never a
regression or a rollback."""

import numpy as np

from analytics import regressions, variance
from analytics.simulate import simulate_fleet


def test_twice_the_variance_is_wider_the_same_is_not():
    rng = np.random.default_rng(5)
    base = rng.normal(150, 2.0, 600)
    assert variance.spread_change(rng.normal(150, 2.0 * np.sqrt(2), 600), base).wider
    assert not variance.spread_change(rng.normal(150, 2.0, 600), base).wider
    assert not variance.spread_change(base, rng.normal(150, 2.0 * np.sqrt(2), 600)).wider  # narrower: no note


def test_two_samples_without_spread_have_no_change_of_spread():
    # exact values (a counter that does not move) made Brown-Forsythe's p NaN, which evidence cannot hold
    same = variance.spread_change([1.0] * 50, [1.0] * 50)
    assert same.p_value == 1.0 and not same.wider and same.ratio == 1.0


def test_a_significant_but_tiny_widening_is_under_the_floor():
    rng = np.random.default_rng(6)
    j = variance.spread_change(rng.normal(150, 2.2, 20000), rng.normal(150, 2.0, 20000))
    assert j.p_value < 1e-6 and not j.wider and 1.05 < j.ratio < 1.15


def test_a_wider_release_gets_an_info_note_and_no_regression(store, small):
    sim = simulate_fleet(store, weeks=1, incidents=[("variance", 3)], seed=31, **small)
    rel = sim.release("variance")
    notes = variance.run(store, sim.start, sim.end)
    assert notes and all(r["severity"] == "info" and f"release={rel.name}" in r["scope"] for r in notes)
    assert any(r["metric"] == "step_period_ms_spread" for r in notes)
    assert [r for r in regressions.run(store, sim.start, sim.end) if r["metric"].startswith("step_period")] == []


def test_a_benign_release_gets_no_note(store, small):
    sim = simulate_fleet(store, weeks=1, incidents=[("benign", 3)], seed=32, **small)
    assert variance.run(store, sim.start, sim.end) == []


def test_no_same_median_note_where_the_median_moved():
    """A release slower by 20% and wider: the regression detector's finding, never a note saying 'same
    median' beside it."""
    import numpy as np

    from analytics import variance

    rng = np.random.default_rng(7)
    c = 150.0 * np.exp(rng.normal(0, 0.02, 400))
    assert not variance._median_moved(150.0 * np.exp(rng.normal(0, 0.06, 400)), c, "step_period_ms")
    assert variance._median_moved(180.0 * np.exp(rng.normal(0, 0.06, 400)), c, "step_period_ms")
