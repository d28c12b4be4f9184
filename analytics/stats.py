"""Small pure statistics helpers shared by the detectors (scipy / statsmodels do the tests).

    lo, hi = wilson(k=7, n=1000)                                  # Wilson score interval
    j = judge_continuous(treat, ctrl, floor=0.03)                 # Kayenta-style Mann-Whitney judge
    p = judge_proportion(k_t, n_t, k_c, n_c, floor=0.02)          # two-proportion z-test
    s = slope_test(shapes_seen, reserved_bytes)                   # growth per unit of x, one-sided
    relative_noise(daily_medians)                                 # spread of a metric's repeated runs

Effects are signed so that a positive effect is *worse* (``higher_is_worse`` flips the sign).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.proportion import proportion_confint, proportions_ztest

from collector.catalog import canonical_scope  # noqa: F401 (the detectors' scope key; declared once there)


def wilson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Wilson score interval for k successes out of n (statsmodels); (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    lo, hi = proportion_confint(int(k), int(n), alpha=alpha, method="wilson")
    share = k / n  # clamp float round-off (k=0 gives a lower bound of ~1e-17)
    return min(max(float(lo), 0.0), share), max(min(float(hi), 1.0), share)


@dataclass(frozen=True)
class Judgement:
    """One metric's verdict: ``regressed`` when significant, worse, beyond the floor and the noise."""

    metric: str
    n_treatment: int
    n_control: int
    treatment: float  # median (continuous) or proportion
    control: float
    effect: float  # signed, positive = worse: relative (median ratio - 1) or absolute (proportions)
    threshold: float  # the effect it had to exceed: max(floor, k * noise)
    p_value: float
    test: str
    enough_samples: bool
    regressed: bool = False
    strata: int = 0  # strata compared (analytics/stratified.py); 0: the cohorts pooled

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def finite_values(values) -> np.ndarray:
    """Values as float64 with None / NaN / inf dropped (vectorized: cohorts have 1e5+ sessions)."""
    a = np.asarray(values, dtype=float)  # None -> nan
    return a[np.isfinite(a)]


def relative_noise(values: Sequence[float]) -> float:
    """Spread of repeated measurements of one metric (e.g. daily medians): std / |mean|; 0 if < 3 values."""
    v = finite_values(values)
    if len(v) < 3 or not np.mean(v):
        return 0.0
    return float(np.std(v, ddof=1) / abs(np.mean(v)))


def absolute_noise(values: Sequence[float]) -> float:
    """Standard deviation of repeated measurements (for proportions); 0 if < 3 values."""
    v = finite_values(values)
    return float(np.std(v, ddof=1)) if len(v) >= 3 else 0.0


def judge_continuous(
    metric: str,
    treatment: Sequence[float],
    control: Sequence[float],
    *,
    floor: float,
    noise: float = 0.0,
    noise_k: float = 3.0,
    higher_is_worse: bool = True,
    min_samples: int = 30,
    alpha: float = 0.01,
) -> Judgement:
    """Kayenta's Mann-Whitney judge: one-sided U test in the worse direction, effect = ratio of
    medians - 1 (signed worse-positive), which must exceed max(floor, noise_k * noise)."""
    t, c = finite_values(treatment), finite_values(control)
    threshold = max(floor, noise_k * noise)
    enough = len(t) >= min_samples and len(c) >= min_samples
    if len(t) == 0 or len(c) == 0:
        return Judgement(metric, len(t), len(c), float("nan"), float("nan"), 0.0, threshold, 1.0, "mannwhitneyu", False)
    mt, mc = float(np.median(t)), float(np.median(c))
    effect = (mt / mc - 1.0) if mc else 0.0
    effect = effect if higher_is_worse else -effect
    p = 1.0
    if enough:
        alt = "greater" if higher_is_worse else "less"
        p = float(sps.mannwhitneyu(t, c, alternative=alt).pvalue)
    regressed = enough and p < alpha and effect > threshold
    return Judgement(metric, len(t), len(c), mt, mc, effect, threshold, p, "mannwhitneyu", enough, regressed)


def judge_proportion(
    metric: str,
    k_t: int,
    n_t: int,
    k_c: int,
    n_c: int,
    *,
    floor: float,
    noise: float = 0.0,
    noise_k: float = 3.0,
    min_samples: int = 30,
    alpha: float = 0.01,
) -> Judgement:
    """Two-proportion z-test (statsmodels), one-sided: is the treatment's proportion larger? The
    absolute difference must exceed max(floor, noise_k * noise)."""
    threshold = max(floor, noise_k * noise)
    enough = n_t >= min_samples and n_c >= min_samples
    pt = k_t / n_t if n_t else float("nan")
    pc = k_c / n_c if n_c else float("nan")
    effect = (pt - pc) if n_t and n_c else 0.0
    p = 1.0
    if enough and (k_t + k_c) > 0 and (k_t + k_c) < (n_t + n_c):
        p = float(proportions_ztest([k_t, k_c], [n_t, n_c], alternative="larger")[1])
    regressed = enough and p < alpha and effect > threshold
    return Judgement(metric, n_t, n_c, pt, pc, effect, threshold, p, "proportions_ztest", enough, regressed)


def holm(judgements: list[Judgement], alpha: float = 0.01) -> list[Judgement]:
    """Step-down (Holm-Sidak) correction of one comparison's p-values; ``regressed`` uses the corrected
    ones. (statsmodels' plain 'holm' branch calls gc.collect() on every call: 0.1-0.3 s each.)"""
    if not judgements:
        return []
    pvals = np.clip([j.p_value for j in judgements], 0.0, 1.0 - 1e-12)  # Sidak's log1p(-1) is -inf
    reject, p_adj, _, _ = multipletests(pvals, alpha=alpha, method="holm-sidak")
    out = []
    for j, r, p in zip(judgements, reject, p_adj):
        d = j.as_dict()
        d["p_value"] = float(p)
        d["regressed"] = bool(j.regressed and r)
        out.append(Judgement(**d))
    return out


@dataclass(frozen=True)
class Slope:
    slope: float
    intercept: float
    p_value: float  # one-sided: slope > 0
    stderr: float
    n: int


def slope_test(x: Sequence[float], y: Sequence[float]) -> Slope:
    """Least-squares slope of y on x with a one-sided test that it is > 0 (scipy linregress)."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xa) < 3 or np.ptp(xa) == 0:
        return Slope(0.0, float(np.mean(ya)) if len(ya) else 0.0, 1.0, float("inf"), len(xa))
    if np.ptp(ya) == 0:
        return Slope(0.0, float(ya[0]), 1.0, 0.0, len(xa))
    r = sps.linregress(xa, ya, alternative="greater")
    return Slope(float(r.slope), float(r.intercept), float(r.pvalue), float(r.stderr), len(xa))
