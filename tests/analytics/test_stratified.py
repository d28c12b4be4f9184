"""Release comparisons within strata (analytics/stratified.py): a changed mix of session lengths alone is no
regression where the pooled comparison calls one; a change inside every stratum still is; each test reduces to
its textbook one-stratum form."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl
import pytest
from scipy import stats as sps

from analytics import regressions, stratified
from analytics.detector_eval import sim_end
from analytics.holdout import generate

DAY0 = datetime(2026, 11, 1, tzinfo=UTC)


def _sessions(rng, n: int, long_share: float, *, slower: float = 0.0) -> pl.DataFrame:
    """Per-session frame as ``queries.session_frame`` has it: short sessions (40 steps, no reset) and long
    ones (160 steps, whose reset steps are late and slow): a session's late rate and median step depend on
    its length, not on its release; ``slower`` scales every step."""
    rows = []
    for i in range(n):
        long = rng.random() < long_share
        steps = 160 if long else 40
        period = (150.0 if long else 140.0) * float(np.exp(rng.normal(0, 0.01))) * (1 + slower)
        late = int(rng.binomial(steps, 0.05 if long else 0.005))
        rows.append({"session_id": f"s{i}", "start_ts": DAY0 + timedelta(hours=i % 240), "streamed_s": steps / 6,
                     "steps": steps, "late_chunks": late, "fps": 24.0 - late / steps * 24,
                     **{col: period for col, _ in regressions.CONTINUOUS.values()},
                     "stratum": "long" if long else "short"})
    return pl.DataFrame(rows)


def _regressed(t: pl.DataFrame, c: pl.DataFrame) -> set[str]:
    return {j.metric for j in regressions.judge(t, c) if j.regressed}


def test_a_mix_of_longer_sessions_alone_is_no_regression_within_strata_and_is_one_pooled():
    rng = np.random.default_rng(1)
    control, release = _sessions(rng, 400, 0.1), _sessions(rng, 400, 0.9)
    pooled = _regressed(release.drop("stratum"), control.drop("stratum"))
    assert {"late_chunk_rate", "step_period_ms"} <= pooled  # what the pooled judges said of the mix
    assert _regressed(release, control) == set()
    assert {j.test for j in regressions.judge(release, control)} == {"van_elteren", "cochran_mantel_haenszel"}


def test_a_change_inside_every_stratum_is_found_within_strata():
    rng = np.random.default_rng(2)
    control, release = _sessions(rng, 400, 0.1), _sessions(rng, 400, 0.9, slower=0.08)
    judged = {j.metric: j for j in regressions.judge(release, control)}
    assert judged["step_period_ms"].regressed and judged["step_period_ms"].strata == 2
    assert judged["step_period_ms"].effect == pytest.approx(0.08, abs=0.01)  # the per-step change, not the mix


def test_one_stratum_is_mann_whitney_and_its_p_value():
    rng = np.random.default_rng(3)
    t, c = rng.normal(0.3, 1, 80), rng.normal(0, 1, 90)
    j = stratified.judge_continuous_within("m", [t], [c], floor=0.0, min_samples=10)
    ref = sps.mannwhitneyu(t, c, alternative="greater", method="asymptotic", use_continuity=False).pvalue
    assert j.p_value == pytest.approx(ref, rel=1e-9)


def test_ties_are_corrected_as_scipy_corrects_them():
    t, c = np.repeat([1.0, 2.0, 3.0], [30, 30, 40]), np.repeat([1.0, 2.0, 3.0], [40, 30, 30])
    j = stratified.judge_continuous_within("m", [t], [c], floor=0.0, min_samples=10)
    ref = sps.mannwhitneyu(t, c, alternative="greater", method="asymptotic", use_continuity=False).pvalue
    assert j.p_value == pytest.approx(ref, rel=1e-9)


def test_one_table_is_the_chi_square_test_of_two_proportions():
    j = stratified.judge_proportion_within("m", [(60, 1000)], [(30, 1000)], floor=0.0, min_samples=10)
    chi2 = sps.chi2_contingency([[60, 940], [30, 970]], correction=False)
    n = 2000  # CMH's variance uses N - 1 where Pearson's uses N
    assert j.p_value == pytest.approx(sps.chi2.sf(chi2.statistic * (n - 1) / n, 1) / 2, rel=1e-9)
    assert j.effect == pytest.approx(0.03)
    better = stratified.judge_proportion_within("m", [(30, 1000)], [(60, 1000)], floor=0.0, min_samples=10)
    assert better.p_value > 0.99 and better.effect < 0 and not better.regressed  # one-sided: better is no regression


def test_a_stratum_one_side_lacks_is_left_out_and_counted():
    t = pl.DataFrame({"stratum": ["a", "a", "b"], "v": [1, 2, 3]})
    c = pl.DataFrame({"stratum": ["a", "c", "c"], "v": [1, 2, 3]})
    both, tg, cg, t_out, c_out = stratified.pairs(t, c)
    assert both == ["a"] and len(tg[0]) == 2 and len(cg[0]) == 1 and (t_out, c_out) == (1, 2)


def test_non_finite_values_and_empty_strata_do_not_count():
    j = stratified.judge_continuous_within("m", [[np.nan, 1.0], []], [[1.0], [2.0]], floor=0.0, min_samples=1)
    assert (j.n_treatment, j.n_control, j.strata) == (1, 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [4, 7])
def test_the_holdout_release_with_longer_sessions_raises_no_regression(store, seed):
    res = generate(store, scenario="longer_sessions", seed=seed, end=sim_end(seed), days=10, onset_day=6,
                   sessions_per_day=30)
    rows = regressions.run(store, res.start, res.onset + timedelta(hours=96))
    assert rows == [], [(r["scope"], r["metric"], r["effect"]) for r in rows]


@pytest.mark.slow
def test_the_holdout_release_slower_in_a_changed_mix_is_found_within_strata(store):
    res = generate(store, scenario="longer_sessions_slower", seed=5, end=sim_end(5), days=10, onset_day=6,
                   sessions_per_day=30)
    rows = [r for r in regressions.run(store, res.start, res.onset + timedelta(hours=96))
            if r["metric"] == "diffusion_ms" and "segment" not in json.loads(r["evidence"])]
    assert rows
    for r in rows:
        ev = json.loads(r["evidence"])
        assert ev["comparison"] == stratified.NOTE and ev["strata"] >= 2 and ev["test"] == "van_elteren"
        assert 0.025 < r["effect"] < 0.055  # holdout.SLOWER per step, not the mix
