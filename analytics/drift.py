"""Slow drift inside a release: a monotonic trend in a daily series, with a practical floor in % per week.

    d = trend([8.5, 8.55, 8.59, ...])        # Trend(tau, p_value, slope_per_day, rel_per_week, ...)
    rows = run(store, start, end)            # findings (kind='drift') per release x GPU kind x metric

A change-point detector looks for steps; a metric that grows 0.5% a day has none, and a release
boundary never comes. Method: the Mann-Kendall trend test (Mann 1945, Kendall 1975: Kendall's tau
between the day index and the value, which is what ``scipy.stats.kendalltau`` computes, ties
corrected) with the Theil-Sen slope (Sen 1968: the median of pairwise slopes, ``scipy.stats.theilslopes``,
robust to a few odd days). A series drifts when the trend is significant in the worse direction
(one-sided p < ``MAX_P``), the Theil-Sen slope's 95% interval excludes zero, and the slope, relative
to the series' median, exceeds ``MIN_PCT_PER_WEEK`` (the practical floor: smaller trends are real
but not worth a finding). The daily series are one release's sessions on one GPU kind (days with at
least ``MIN_SESSIONS_PER_DAY`` of them; per-step means, see ``daily_by_release``), over the release's own days only: a rollout's mix of
releases is not a trend. Needs ``MIN_DAYS`` days (the Mann-Kendall test cannot reach p < 0.01 on
fewer than 6 points); a 0.5%/day drift is flagged on its 6th-7th day.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import polars as pl
from scipy.stats import kendalltau, theilslopes

from analytics import queries, strata
from analytics.changepoints import DAILY_METRICS
from analytics.findings import finding

MAX_P = 0.01
MIN_PCT_PER_WEEK = 2.0  # % of the series' median per week
MIN_POINTS_PER_WEEK = 0.5  # rates (shares near zero): percentage points per week, not % of the level
MIN_DAYS = 6
MIN_SESSIONS_PER_DAY = 20
CRITICAL_PCT_PER_WEEK = 10.0


@dataclass(frozen=True)
class Trend:
    n: int
    tau: float
    p_value: float  # one-sided, in the worse (upward) direction
    slope_per_day: float  # Theil-Sen, in the series' units
    slope_low: float  # its 95% interval
    slope_high: float
    level: float  # the series' median
    pct_per_week: float  # slope_per_day * 7 / level * 100
    drifting: bool


def trend(series: Sequence[float], *, max_p: float = MAX_P, min_pct_per_week: float = MIN_PCT_PER_WEEK,
          min_days: int = MIN_DAYS, share: bool = False) -> Trend:
    """Mann-Kendall (one-sided, upward = worse) with the Theil-Sen slope on one daily series.

    ``share``: the series is a rate in [0, 1]: ``pct_per_week`` is then percentage points per week
    (a late-chunk rate of 0.1% doubling is not a 100%/week drift) and the floor ``MIN_POINTS_PER_WEEK``."""
    y = np.asarray(series, dtype=float)
    y = y[np.isfinite(y)]
    n = len(y)
    if n < 3 or np.ptp(y) == 0:
        return Trend(n, 0.0, 1.0, 0.0, 0.0, 0.0, float(np.median(y)) if n else 0.0, 0.0, False)
    x = np.arange(n, dtype=float)
    res = kendalltau(x, y)
    tau, p2 = float(res.statistic), float(res.pvalue)
    p = p2 / 2 if tau > 0 else 1.0 - p2 / 2
    slope, _, lo, hi = theilslopes(y, x, alpha=0.95)
    level = float(np.median(y))
    if share:
        pct, min_pct_per_week = float(slope) * 7 * 100, MIN_POINTS_PER_WEEK
    else:
        pct = float(slope) * 7 / abs(level) * 100 if level else 0.0
    drifting = n >= min_days and p < max_p and lo > 0 and pct >= min_pct_per_week
    return Trend(n, tau, p, float(slope), float(lo), float(hi), level, pct, drifting)


def daily_by_release(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per release, GPU kind and day: sessions and each DAILY_METRICS column's mean per step (the
    sessions' means weighted by their steps). Not the daily median of session means the change-point
    pass uses: a short session's mean swings with its one or two reset steps, and those swings (~1.5%
    day to day) would hide a 0.5%/day drift for weeks; a day's mean over all its steps does not swing.
    Compared within strata of session length and prompt (``analytics.strata``: the day's marginal mean under
    the window's mix, from each stratum's per-step mean that day, weighted by steps): sessions of a release
    growing longer over the weeks hold more reset steps, which is not a drift of any step."""
    s = queries.session_frame(store, start, end).filter(pl.col("streamed_s") >= queries.MIN_STREAMED_S)
    if s.is_empty():
        return s
    s = strata.with_strata(s, queries.session_first_forward(store, start, end))
    s = s.with_columns(pl.col("start_ts").dt.truncate("1d").alias("day"), pl.col("steps").cast(pl.Float64).alias("w"))
    aggs = [pl.len().alias("sessions"), pl.col("w").sum().alias("steps")]
    for metric, (col, _, _) in DAILY_METRICS.items():  # per-step means: every step of the day counts once
        aggs.append(((pl.col(col) * pl.col("w")).sum() / pl.col("w").filter(pl.col(col).is_not_null()).sum())
                    .alias(metric))
    cells = s.group_by("release", "gpu_kind", "day", "stratum").agg(aggs)
    daily = strata.standardize(cells.drop("sessions"), ["release", "gpu_kind"], "day", list(DAILY_METRICS),
                               size="steps")
    n = s.group_by("release", "gpu_kind", "day").agg(pl.len().alias("sessions"))
    return daily.join(n, on=["release", "gpu_kind", "day"], how="left").sort("release", "gpu_kind", "day")


def run(store, start: datetime, end: datetime) -> list[dict]:
    """Findings (kind='drift') for each release x GPU kind x daily metric that drifts in [start, end)."""
    rows = []
    daily = daily_by_release(store, start, end)
    if daily.is_empty():
        return rows
    for (release, gpu_kind), g in daily.group_by("release", "gpu_kind", maintain_order=True):
        g = g.filter(pl.col("sessions") >= MIN_SESSIONS_PER_DAY).sort("day")
        days = g["day"].to_list()
        for metric, (_, how, _) in DAILY_METRICS.items():
            values = g[metric].to_numpy().astype(float)
            t = trend(values, share=how == "mean")
            if not t.drifting:
                continue
            rows.append(
                finding(
                    "drift",
                    {"release": release, "gpu_kind": gpu_kind},
                    metric,
                    days[0],
                    days[-1] + timedelta(days=1),
                    value=t.slope_per_day,
                    baseline=t.level,
                    effect=t.pct_per_week / 100,
                    confidence=1.0 - t.p_value,
                    severity="critical" if t.pct_per_week >= CRITICAL_PCT_PER_WEEK else "warning",
                    evidence={
                        "method": "Mann-Kendall (scipy.stats.kendalltau on day index, one-sided) with the "
                                  "Theil-Sen slope (scipy.stats.theilslopes)",
                        "tau": t.tau,
                        "p_value": t.p_value,
                        "slope_per_day": t.slope_per_day,
                        "slope_ci95": [t.slope_low, t.slope_high],
                        "pct_per_week": t.pct_per_week,
                        "floor_pct_per_week": MIN_PCT_PER_WEEK,
                        "days": len(days),
                        "series_days": [d.date().isoformat() for d in days],
                        "series": values.tolist(),
                        "strata": strata.NOTE,
                    },
                )
            )
    return rows
