"""Two cohorts compared within strata, so that a changed mix of sessions cannot pass for a regression.

    j = judge_continuous_within(metric, t_groups, c_groups, floor=0.03)      # van Elteren's test
    p = judge_proportion_within(metric, t_counts, c_counts, floor=0.02)      # Cochran-Mantel-Haenszel

Each ``*_groups`` / ``*_counts`` is a list over strata, the same stratum at the same index on both sides
(``pairs`` builds them from two frames with a ``stratum`` column, analytics/strata.py); a stratum with
sessions on one side only cannot be compared and is left out (its sessions are counted apart). The
verdict has the same rules as the pooled judges of analytics/stats.py (one-sided, worse-positive effect
beyond max(floor, k x noise), ``min_samples`` per side among the compared sessions):

- continuous: **van Elteren's stratified Wilcoxon rank-sum test** (van Elteren 1960, "On the combination
  of independent two-sample tests of Wilcoxon"; Lehmann, *Nonparametrics*, 2006, sec. 3.3): each
  stratum's Mann-Whitney U centred on its null mean, weighted by 1 / (N_k + 1) (the locally most powerful
  weights), summed and divided by the square root of the summed weighted (tie-corrected) variances; the
  normal approximation gives the one-sided p. Neither scipy nor statsmodels has it (scipy's
  ``mannwhitneyu`` is one stratum, statsmodels' ``rank_compare_2indep`` too), so it is written here on
  scipy's ``rankdata``. Effect: the within-stratum ratios of medians, averaged with the weights
  n_t n_c / (n_t + n_c) of each stratum (Mantel and Haenszel's, which favour strata both sides fill).
- proportions: **the Cochran-Mantel-Haenszel test** (statsmodels ``StratifiedTable.test_null_odds``), one
  stratum one 2x2 table, one-sided by the sign of the summed observed-minus-expected counts; effect: the
  Mantel-Haenszel risk difference (the same weights).

A pooled comparison of a release whose sessions are twice as long finds a larger late-chunk rate (a long
session holds a larger share of reset steps) though no step got slower; within strata of session length the
rates are the same and the verdict is "no change".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl
from scipy import stats as sps
from statsmodels.stats.contingency_tables import StratifiedTable

from analytics.stats import Judgement, finite_values

# said in the evidence of every release comparison made within strata
NOTE = ("compared within strata of session length (half-octaves of steps) x prompt (octaves of "
        "first_forward_tokens) per GPU kind: van Elteren's stratified rank-sum test (continuous), "
        "Cochran-Mantel-Haenszel (proportions); strata with sessions on one side only are left out")


def pairs(t: pl.DataFrame, c: pl.DataFrame) -> tuple[list[str], list[pl.DataFrame], list[pl.DataFrame], int, int]:
    """The strata both frames have (sorted), each side's rows per stratum, and the rows of each side in
    strata the other side lacks (not comparable)."""
    st, sc = set(t["stratum"].to_list()), set(c["stratum"].to_list())
    both = sorted(st & sc)
    tg = {k[0]: g for k, g in t.group_by("stratum")}
    cg = {k[0]: g for k, g in c.group_by("stratum")}
    return (both, [tg[s] for s in both], [cg[s] for s in both],
            sum(len(tg[s]) for s in st - sc), sum(len(cg[s]) for s in sc - st))


def _mh_weight(n: int, m: int) -> float:
    return n * m / (n + m)


def judge_continuous_within(
    metric: str,
    treatment: Sequence[Sequence[float]],
    control: Sequence[Sequence[float]],
    *,
    floor: float,
    noise: float = 0.0,
    noise_k: float = 3.0,
    min_samples: int = 30,
    alpha: float = 0.01,
    pooled: tuple[float, float] | None = None,
) -> Judgement:
    """Van Elteren's test in the worse (greater) direction over strata; ``treatment[k]`` and ``control[k]``
    one stratum's values. ``pooled``: the medians to show (default: of the compared values)."""
    threshold = max(floor, noise_k * noise)
    groups = [(finite_values(a), finite_values(b)) for a, b in zip(treatment, control, strict=True)]
    groups = [(a, b) for a, b in groups if len(a) and len(b)]
    nt, nc = sum(len(a) for a, _ in groups), sum(len(b) for _, b in groups)
    if pooled is None:
        pooled = ((float(np.median(np.concatenate([a for a, _ in groups]))) if nt else float("nan")),
                  (float(np.median(np.concatenate([b for _, b in groups]))) if nc else float("nan")))
    enough = nt >= min_samples and nc >= min_samples
    ratios, weights = [], []
    for a, b in groups:
        mc = float(np.median(b))
        if mc:
            ratios.append(float(np.median(a)) / mc)
            weights.append(_mh_weight(len(a), len(b)))
    effect = float(np.average(ratios, weights=weights)) - 1.0 if ratios else 0.0
    p = _van_elteren_greater(groups) if enough else 1.0
    regressed = enough and p < alpha and effect > threshold
    return Judgement(metric, nt, nc, pooled[0], pooled[1], effect, threshold, p, "van_elteren", enough, regressed,
                     strata=len(groups))


def _van_elteren_greater(groups: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """One-sided p that the first sample of each stratum tends to be larger (normal approximation)."""
    num = var = 0.0
    for a, b in groups:
        n, m = len(a), len(b)
        big = n + m
        x = np.concatenate([a, b])
        u = float(sps.rankdata(x)[:n].sum()) - n * (n + 1) / 2
        _, counts = np.unique(x, return_counts=True)
        ties = float((counts.astype(float) ** 3 - counts).sum()) / (big * (big - 1)) if big > 1 else 0.0
        w = 1.0 / (big + 1)
        num += w * (u - n * m / 2)
        var += w * w * n * m / 12 * ((big + 1) - ties)
    if var <= 0:
        return 1.0
    return float(sps.norm.sf(num / np.sqrt(var)))


def judge_proportion_within(
    metric: str,
    treatment: Sequence[tuple[int, int]],
    control: Sequence[tuple[int, int]],
    *,
    floor: float,
    noise: float = 0.0,
    noise_k: float = 3.0,
    min_samples: int = 30,
    alpha: float = 0.01,
    sessions: tuple[int, int] | None = None,
) -> Judgement:
    """The CMH test, one-sided (is the treatment's proportion larger within strata?); ``treatment[k]`` is
    stratum k's (events, trials). ``sessions``: the compared sessions per side, for ``min_samples`` (default:
    the trials)."""
    threshold = max(floor, noise_k * noise)
    cells = [(kt, nt, kc, nc) for (kt, nt), (kc, nc) in zip(treatment, control, strict=True) if nt and nc]
    kt_all, nt_all = sum(x[0] for x in cells), sum(x[1] for x in cells)
    kc_all, nc_all = sum(x[2] for x in cells), sum(x[3] for x in cells)
    st, sc = sessions if sessions is not None else (nt_all, nc_all)
    enough = st >= min_samples and sc >= min_samples
    pt = kt_all / nt_all if nt_all else float("nan")
    pc = kc_all / nc_all if nc_all else float("nan")
    wsum = sum(_mh_weight(nt, nc) for _, nt, _, nc in cells)
    effect = (sum(_mh_weight(nt, nc) * (kt / nt - kc / nc) for kt, nt, kc, nc in cells) / wsum) if wsum else 0.0
    p = 1.0
    events = kt_all + kc_all
    if enough and 0 < events < nt_all + nc_all:
        observed_minus_expected = sum(kt - nt * (kt + kc) / (nt + nc) for kt, nt, kc, nc in cells)
        tables = [np.array([[kt, nt - kt], [kc, nc - kc]], dtype=float) for kt, nt, kc, nc in cells]
        two_sided = float(StratifiedTable(tables).test_null_odds(correction=False).pvalue)
        if np.isfinite(two_sided):
            p = two_sided / 2 if observed_minus_expected > 0 else 1.0 - two_sided / 2
    regressed = enough and p < alpha and effect > threshold
    return Judgement(metric, st, sc, pt, pc, effect, threshold, p, "cochran_mantel_haenszel", enough, regressed,
                     strata=len(cells))
