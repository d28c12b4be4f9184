"""Change points in daily series: E-Divisive means with a minimum segment length and a noise floor.

    change_points([1.0] * 10 + [2.0] * 10)                 # -> [ChangePoint(index=10, ...)]
    rows = run(store, start, end)                           # findings rows (kind='changepoint')

Method: E-Divisive with means (Matteson & James, "A Nonparametric Approach for Multiple Change
Point Analysis of Multivariate Data", JASA 2014), as used by MongoDB's signal-processing-algorithms
and Apache Otava (Fleming et al., "Hunter: Using Change Point Detection to Hunt for Performance
Regressions", ICPE 2023). We call Otava's maintained implementation
(``otava.analysis.compute_change_points``), then keep only change points that leave at least
``min_segment`` points on each side and whose relative change of the segment means exceeds
max(``min_magnitude``, ``noise_k`` x the series' own noise) — the day-to-day spread of the values
within their segments, i.e. the metric's measured run-to-run noise.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import polars as pl
from otava.analysis import compute_change_points

from analytics import queries
from analytics.findings import finding

# Daily series the change-point pass watches: metric -> (per-session column, aggregate, floor)
DAILY_METRICS: dict[str, tuple[str, str, float]] = {
    "step_period_ms_p50": ("step_period_ms", "median", 0.03),
    "diffusion_ms_p50": ("diffusion_ms", "median", 0.03),
    "cache_upkeep_ms_p50": ("upkeep_ms", "median", 0.10),
    "energy_per_chunk_mj_p50": ("energy_per_chunk_mj", "median", 0.03),
    "late_chunk_rate": ("late_rate", "mean", 0.5),
}
RATE_SHIFT = 0.01  # added to "mean" (rate) series before judging: a change near zero counts relative to 1%
MIN_SEGMENT_DAYS = 3
MIN_SESSIONS_PER_DAY = 20


@dataclass(frozen=True)
class ChangePoint:
    index: int  # first index of the new segment
    mean_before: float
    mean_after: float
    rel_change: float  # mean_after / mean_before - 1
    threshold: float  # the relative change it had to exceed
    p_value: float


def segment_noise(series: np.ndarray, indexes: Sequence[int]) -> float:
    """Pooled within-segment standard deviation, relative to the series' mean level."""
    bounds = [0, *indexes, len(series)]
    resid = np.concatenate([series[a:b] - series[a:b].mean() for a, b in itertools.pairwise(bounds) if b > a])
    dof = max(len(series) - len(bounds) + 1, 1)
    level = float(np.mean(np.abs(series))) or 1.0
    return float(np.sqrt(np.sum(resid**2) / dof) / level)


def change_points(
    series: Sequence[float],
    *,
    min_segment: int = MIN_SEGMENT_DAYS,
    max_pvalue: float = 0.001,
    min_magnitude: float = 0.0,
    noise_k: float = 3.0,
    noise: float | None = None,
    window_len: int = 50,
) -> list[ChangePoint]:
    """Change points of one series (E-Divisive means via Otava), filtered by segment length and noise.

    ``noise``: the metric's relative run-to-run noise if measured elsewhere; by default the pooled
    within-segment spread of this series.
    """
    x = np.asarray(series, dtype=float)
    if len(x) < 2 * min_segment:
        return []
    found, _ = compute_change_points(list(x), window_len=window_len, max_pvalue=max_pvalue)
    pvals = {int(c.index): float(c.stats.pvalue) for c in found}
    kept: list[int] = []
    for i in sorted(pvals):
        if i - (kept[-1] if kept else 0) >= min_segment and len(x) - i >= min_segment:
            kept.append(i)
    while True:  # drop the weakest change below the noise floor, re-measure, repeat
        lvl_noise = segment_noise(x, kept) if noise is None else noise
        threshold = max(min_magnitude, noise_k * lvl_noise)
        bounds = [0, *kept, len(x)]
        means = [x[a:b].mean() for a, b in itertools.pairwise(bounds)]
        changes = [(means[k + 1] / means[k] - 1.0) if means[k] else np.inf for k in range(len(kept))]
        weak = [k for k, c in enumerate(changes) if abs(c) <= threshold]
        if not weak:
            break
        kept.pop(min(weak, key=lambda k: abs(changes[k])))
    return [
        ChangePoint(i, float(means[k]), float(means[k + 1]), float(changes[k]), threshold, pvals[i])
        for k, i in enumerate(kept)
    ]


def daily_series(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per day and GPU kind: session count, the DAILY_METRICS aggregates and the release mix."""
    s = queries.session_frame(store, start, end).filter(pl.col("streamed_s") >= queries.MIN_STREAMED_S)
    if s.is_empty():
        return s
    s = s.with_columns(pl.col("start_ts").dt.truncate("1d").alias("day"))
    aggs = [pl.len().alias("sessions")]
    for metric, (col, how, _) in DAILY_METRICS.items():
        aggs.append((pl.col(col).median() if how == "median" else pl.col(col).mean()).alias(metric))
    aggs.append(pl.col("release").alias("releases"))
    return s.group_by("gpu_kind", "day").agg(aggs).sort("gpu_kind", "day")


def run(store, start: datetime, end: datetime) -> list[dict]:
    """Findings (kind='changepoint') for each GPU kind and daily metric with a change in [start, end)."""
    rows = []
    daily = daily_series(store, start, end)
    if daily.is_empty():
        return rows
    for (gpu_kind,), g in daily.group_by("gpu_kind", maintain_order=True):
        g = g.filter(pl.col("sessions") >= MIN_SESSIONS_PER_DAY).sort("day")
        days = g["day"].to_list()
        for metric, (_, how, floor) in DAILY_METRICS.items():
            values = g[metric].fill_null(0.0).to_numpy()
            shift = RATE_SHIFT if how == "mean" else 0.0  # rates near zero: judged as relative to 1%
            values = values + shift
            for cp in change_points(values, min_magnitude=floor):
                if cp.rel_change <= 0:  # an improvement is not a regression finding
                    continue
                before = g["releases"][: cp.index].explode().value_counts(normalize=True)
                after = g["releases"][cp.index :].explode().value_counts(normalize=True)
                share = {r: 0.0 for r in set(before["releases"]) | set(after["releases"])}
                mix = {
                    r: float(after.filter(pl.col("releases") == r)["proportion"].sum())
                    - float(before.filter(pl.col("releases") == r)["proportion"].sum())
                    for r in share
                }
                rows.append(
                    finding(
                        "changepoint",
                        {"gpu_kind": gpu_kind},
                        metric,
                        days[cp.index],
                        days[cp.index] + timedelta(days=1),
                        value=cp.mean_after - shift,  # the series' own means (the shift only judged)
                        baseline=cp.mean_before - shift,
                        effect=cp.rel_change,
                        confidence=1.0 - cp.p_value,
                        severity="critical" if cp.rel_change > 3 * cp.threshold else "warning",
                        evidence={
                            "method": "E-Divisive means (Matteson & James 2014) via otava.analysis.compute_change_points",
                            "threshold": cp.threshold,
                            "min_segment_days": MIN_SEGMENT_DAYS,
                            "series_days": [d.date().isoformat() for d in days],
                            "series": (values - shift).tolist(),
                            "release_share_change": mix,
                            "release_gaining": max(mix, key=mix.get) if mix else "",
                        },
                    )
                )
    return rows
