"""Pure statistics helpers: Wilson intervals, the Kayenta-style judge, proportions, slopes, scopes."""

import numpy as np
import pytest

from analytics.stats import (
    canonical_scope,
    holm,
    judge_continuous,
    judge_proportion,
    relative_noise,
    slope_test,
    wilson,
)


def test_canonical_scope_sorted_by_key():
    assert canonical_scope({"release": "v7", "gpu_kind": "h100"}) == "gpu_kind=h100,release=v7"
    assert canonical_scope({"worker_id": ["w2", "w1"]}) == "worker_id=w1|w2"


def test_wilson_contains_the_share_and_is_the_known_interval():
    lo, hi = wilson(7, 1000)
    assert lo < 0.007 < hi
    assert (round(lo, 4), round(hi, 4)) == (0.0034, 0.0144)
    assert wilson(0, 0) == (0.0, 1.0)


def test_judge_flags_a_shift_beyond_the_floor_only():
    rng = np.random.default_rng(1)
    ctrl = 160 * np.exp(rng.normal(0, 0.02, 400))
    slow = judge_continuous("step", 1.65 * 160 * np.exp(rng.normal(0, 0.02, 400)), ctrl, floor=0.03)
    assert slow.regressed and slow.effect == pytest.approx(0.65, abs=0.02)
    tiny = judge_continuous("step", 1.01 * 160 * np.exp(rng.normal(0, 0.02, 400)), ctrl, floor=0.03)
    assert tiny.p_value < 0.01 and not tiny.regressed  # significant, but below the effect floor
    faster = judge_continuous("step", 0.8 * ctrl, ctrl, floor=0.03)
    assert not faster.regressed and faster.effect < 0


def test_judge_needs_the_minimum_sample_count_and_the_noise():
    few = judge_continuous("step", [300.0] * 10, [160.0] * 10, floor=0.03, min_samples=30)
    assert not few.enough_samples and not few.regressed
    noisy = judge_continuous("step", np.full(100, 170.0) + np.arange(100) * 1e-3, np.full(100, 160.0), floor=0.03,
                             noise=0.05)
    assert noisy.threshold == pytest.approx(0.15) and not noisy.regressed


def test_proportion_judge_and_holm():
    j = judge_proportion("frac", 120, 1000, 7, 1000, floor=0.02)
    assert j.regressed and j.effect == pytest.approx(0.113)
    same = judge_proportion("frac", 8, 1000, 7, 1000, floor=0.02)
    assert not same.regressed
    corrected = holm([j, same])
    assert corrected[0].regressed and corrected[1].p_value >= same.p_value


def test_slope_and_noise():
    x = np.arange(1, 21)
    s = slope_test(x, 1e9 * x + 6e10)
    assert s.slope == pytest.approx(1e9) and s.p_value < 1e-9
    flat = slope_test(x, np.full(20, 6e10))
    assert flat.slope == 0 and flat.p_value == 1.0
    assert relative_noise([100, 101, 99, 100]) == pytest.approx(np.std([100, 101, 99, 100], ddof=1) / 100)
    assert relative_noise([1.0, 2.0]) == 0.0
