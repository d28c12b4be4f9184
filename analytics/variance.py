"""Variance changes: a release whose per-session times spread more than its baseline's, as an info note.

    rows = run(store, start, end)      # findings (kind='variance', severity 'info') per release x GPU kind
    j = spread_change(treatment, control)

The same median with twice the variance is not a regression (no rollback, no alert: severity is
always ``info``) but it is worth a note: more sessions near the deadline, a noisier neighbour, a
kernel that sometimes takes a slow path. Method: the Brown-Forsythe test (Levene's test on deviations
from the median, ``scipy.stats.levene(center="median")``: robust to the skew of step times), one-sided
by direction (only a wider spread is noted), with a practical floor on the ratio of robust spreads
(median absolute deviations, ``scipy.stats.median_abs_deviation``): at least ``MIN_SPREAD_RATIO``.
Release and baseline as the regression detector pairs them (``regressions.baselines``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import polars as pl
from scipy.stats import levene, median_abs_deviation

from analytics import queries
from analytics.findings import finding
from collector import catalog

METRICS: dict[str, str] = {m.finding_name: m.name for m in catalog.METRICS if m.variance}  # collector/catalog.py
MAX_P = 1e-3
MIN_SPREAD_RATIO = 1.2  # MAD ratio: variance x 1.44
MIN_SAMPLES = 50


@dataclass(frozen=True)
class SpreadChange:
    n_treatment: int
    n_control: int
    spread_treatment: float  # median absolute deviation (normal-consistent)
    spread_control: float
    ratio: float
    p_value: float
    wider: bool


def spread_change(treatment: Sequence[float], control: Sequence[float], *, max_p: float = MAX_P,
                  min_ratio: float = MIN_SPREAD_RATIO, min_samples: int = MIN_SAMPLES) -> SpreadChange:
    """Brown-Forsythe on two samples; ``wider`` when the treatment's spread is significantly larger."""
    t = np.asarray(treatment, dtype=float)
    c = np.asarray(control, dtype=float)
    t, c = t[np.isfinite(t)], c[np.isfinite(c)]
    if len(t) < 3 or len(c) < 3:
        return SpreadChange(len(t), len(c), 0.0, 0.0, 1.0, 1.0, False)
    st = float(median_abs_deviation(t, scale="normal"))
    sc = float(median_abs_deviation(c, scale="normal"))
    ratio = st / sc if sc > 0 else (float("inf") if st > 0 else 1.0)
    p = float(levene(t, c, center="median").pvalue)
    if not np.isfinite(p):  # both samples without any spread around their medians: no change of spread
        p = 1.0
    wider = len(t) >= min_samples and len(c) >= min_samples and p < max_p and ratio >= min_ratio
    return SpreadChange(len(t), len(c), st, sc, ratio, p, wider)


def _median_moved(t: np.ndarray, c: np.ndarray, col: str) -> bool:
    """The medians differ by the release judge's floor or more (collector/catalog.py's regression_floor)."""
    floor = catalog.METRICS_BY_NAME[col].regression_floor if col in catalog.METRICS_BY_NAME else None
    t, c = t[np.isfinite(t)], c[np.isfinite(c)]
    if floor is None or not len(t) or not len(c) or np.median(c) == 0:
        return False
    return abs(float(np.median(t)) / float(np.median(c)) - 1) >= floor


def run(store, start: datetime, end: datetime, releases: list[str] | None = None) -> list[dict]:
    """Info findings for each release (per GPU kind) whose per-session times spread wider than its
    baseline release's."""
    from analytics.regressions import BASELINE_LOOKBACK, baselines

    rows = []
    for release, base, first_seen in baselines(store, end):
        if releases is not None and release not in releases:
            continue
        t_all = queries.session_frame(store, max(start, first_seen), end, {"release": release})
        if t_all.is_empty():
            continue
        c_all = queries.session_frame(store, first_seen - BASELINE_LOOKBACK, end, {"release": base})
        t_all = t_all.filter(pl.col("streamed_s") >= queries.MIN_STREAMED_S)
        c_all = c_all.filter(pl.col("streamed_s") >= queries.MIN_STREAMED_S)
        for gpu_kind in sorted(set(t_all["gpu_kind"].to_list())):
            t = t_all.filter(pl.col("gpu_kind") == gpu_kind)
            c = c_all.filter(pl.col("gpu_kind") == gpu_kind)
            for metric, col in METRICS.items():
                tv, cv = t[col].cast(pl.Float64).to_numpy(), c[col].cast(pl.Float64).to_numpy()
                j = spread_change(tv, cv)
                if not j.wider or _median_moved(tv, cv, col):
                    continue  # a moved median is the regression detector's finding, not a "same median" note
                rows.append(
                    finding(
                        "variance",
                        {"release": release, "gpu_kind": gpu_kind},
                        f"{metric}_spread",
                        queries.day_floor(first_seen),
                        end,
                        value=j.spread_treatment,
                        baseline=j.spread_control,
                        effect=j.ratio - 1.0,
                        confidence=1.0 - j.p_value,
                        severity="info",  # never a rollback: the median did not move
                        evidence={
                            "method": "Brown-Forsythe (scipy.stats.levene, center='median'); spreads are "
                                      "normal-consistent median absolute deviations",
                            "baseline_release": base,
                            "p_value": j.p_value,
                            "spread_ratio": j.ratio,
                            "variance_ratio": j.ratio**2,
                            "floor_spread_ratio": MIN_SPREAD_RATIO,
                            "n_treatment": j.n_treatment,
                            "n_control": j.n_control,
                        },
                    )
                )
    return rows
