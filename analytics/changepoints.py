"""Change points in daily series, judged as Apache Otava judges them, plus a floor in the metric's units.

    change_points([1.0] * 10 + [2.0] * 10)                 # -> [ChangePoint(index=10, ...)]
    rows = run(store, start, end)                           # findings rows (kind='changepoint')

Method: E-Divisive with means (Matteson & James, "A Nonparametric Approach for Multiple Change
Point Analysis of Multivariate Data", JASA 2014), as used by MongoDB's signal-processing-algorithms
and Apache Otava (Fleming et al., "Hunter: Using Change Point Detection to Hunt for Performance
Regressions", ICPE 2023). We call Otava's maintained implementation
(``otava.analysis.compute_change_points``: split into windows, then merge by its t-test
significance and its relative ``min_magnitude``) and keep Otava's significance as the test: a shift
is real when Otava's t-test of the two segments says so (p < ``max_pvalue``), which already weighs
it against the standard error of the segment means. Two filters are ours, both documented floors,
neither a second noise test:

- ``min_segment``: at least that many points (days) on each side of a change;
- ``min_effect``: the change of the segment means must exceed this, in the metric's own units
  (``DAILY_METRICS``: the smallest change worth a finding, e.g. 1 ms of step time).

The daily series are compared within strata of session length and prompt (``analytics.strata``): each day's
value is its marginal mean under the window's mix of strata, so a release whose sessions are longer (and
so hold a larger share of the slow, late reset steps) moves no series; the evidence says so (``strata``)
and keeps the plain daily aggregate beside it (``series_unstratified``).

(livestep once also required 3 x the spread of individual points: with daily medians of ~56
sessions that is ~7 x the noise of a segment mean, and it dropped real 2-4% steps that Otava finds
at p < 0.001.) With ``min_segment=1`` and ``min_effect=0`` the answers are Otava's own.

Otava is installed without its declared dependencies (``pip install --no-deps -r
requirements-nodeps.txt``, ``OTAVA``): ``otava.analysis`` needs numpy and scipy only, while the package
declares BigQuery, gRPC, Slack and PostgreSQL clients and pins numpy. It is imported when a change
point is computed, so a server without it runs every other job; this one says what to install.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import polars as pl

from analytics import queries, strata
from analytics.findings import finding
from collector import catalog

# Daily series the change-point pass watches: metric -> (per-session column, aggregate, effect floor in
# the metric's units: the smallest change of the segment means worth a finding)
# the metric catalogue's ``daily`` entries (collector/catalog.py). Floors: step period and diffusion
# 1.5 ms (~1% of a step, 0.9% of the 166.7 ms budget), upkeep 0.1 ms (~1.2% of a healthy ~8.5 ms mean),
# energy 4000 mJ (~1% of a 4-GPU chunk), late-chunk rate 0.005 (half a point of chunks late).
DAILY_METRICS: dict[str, tuple[str, str, float]] = {
    m.finding_name + ("_p50" if m.daily[0] == "median" else ""): (m.name, m.daily[0], m.daily[1])
    for m in catalog.METRICS if m.daily is not None}
# Why floors at ~1%: a fleet's day-level spread (load, thermals) moves every session of a day together;
# three days 1% apart are significant to a t-test yet not a regression anyone would act on.
MIN_SEGMENT_DAYS = 3
MIN_SESSIONS_PER_DAY = 20
MAX_PVALUE = 0.001
CRITICAL_REL_CHANGE = 0.10  # a change of the means by 10% or more is critical, less a warning


OTAVA = "apache-otava>=0.8,<0.9"  # requirements-nodeps.txt installs this, --no-deps


class ChangepointError(Exception):
    """Change points cannot be computed here (the message says what to install)."""


def _otava():
    try:
        from otava.analysis import TTestSignificanceTester, compute_change_points
    except ImportError as e:
        raise ChangepointError(f"change points need Apache Otava ({e.name} is missing): "
                               f"pip install --no-deps '{OTAVA}' (its numpy and scipy come with livestep[server])") from None
    return TTestSignificanceTester, compute_change_points


@dataclass(frozen=True)
class ChangePoint:
    index: int  # first index of the new segment
    mean_before: float
    mean_after: float
    rel_change: float  # mean_after / mean_before - 1
    threshold: float  # the absolute change of the means it had to exceed (min_effect)
    p_value: float  # Otava's t-test of the two segments
    stderr: float = 0.0  # standard error of the difference of the segment means (evidence)


def change_points(
    series: Sequence[float],
    *,
    min_segment: int = MIN_SEGMENT_DAYS,
    max_pvalue: float = MAX_PVALUE,
    min_magnitude: float = 0.0,
    min_effect: float = 0.0,
    window_len: int = 50,
) -> list[ChangePoint]:
    """Change points of one series: Otava's (``window_len``, ``max_pvalue``, relative
    ``min_magnitude``: Otava's parameters), then at least ``min_segment`` points per segment and a
    change of the means beyond ``min_effect`` (the series' units). A change our filters drop merges
    its two segments, so its neighbours are re-measured with Otava's own t-test (as Otava's merge
    step does) and dropped in turn if no longer significant."""
    x = np.asarray(series, dtype=float)
    if len(x) < 2 * min_segment or len(x) < 2:
        return []
    TTestSignificanceTester, compute_change_points = _otava()
    found, _ = compute_change_points(list(x), window_len=window_len, max_pvalue=max_pvalue,
                                     min_magnitude=min_magnitude)
    kept: list[int] = []
    for i in sorted(int(c.index) for c in found):
        if i - (kept[-1] if kept else 0) >= min_segment and len(x) - i >= min_segment:
            kept.append(i)
    tester = TTestSignificanceTester(max_pvalue)
    while True:  # re-measure (Otava's t-test) after each drop; drop the weakest that fails, repeat
        bounds = [0, *kept, len(x)]
        segs = [x[a:b] for a, b in itertools.pairwise(bounds)]
        means = [float(v.mean()) for v in segs]
        deltas = [means[k + 1] - means[k] for k in range(len(kept))]
        pvals = {i: float(tester.compare(segs[k], segs[k + 1]).pvalue) for k, i in enumerate(kept)}
        weak = [k for k, i in enumerate(kept) if pvals[i] >= max_pvalue]
        if weak:  # Otava's merge order: the least significant first
            kept.pop(max(weak, key=lambda k: pvals[kept[k]]))
            continue
        weak = [k for k, d in enumerate(deltas) if abs(d) <= min_effect]
        if not weak:
            break
        kept.pop(min(weak, key=lambda k: abs(deltas[k])))

    def se(k: int) -> float:
        a, b = segs[k], segs[k + 1]
        va = a.var(ddof=1) / len(a) if len(a) > 1 else 0.0
        vb = b.var(ddof=1) / len(b) if len(b) > 1 else 0.0
        return float(np.sqrt(va + vb))

    return [
        ChangePoint(i, means[k], means[k + 1], (means[k + 1] / means[k] - 1.0) if means[k] else float("inf"),
                    min_effect, pvals[i], se(k))
        for k, i in enumerate(kept)
    ]


def daily_series(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per day and GPU kind: session count, the DAILY_METRICS aggregates and the release mix. Each metric is
    compared within strata of session length and prompt (``analytics.strata``: the day's marginal mean under
    the window's mix of strata, from the day x stratum aggregates), so a changed mix of sessions does not move it;
    ``<metric>_unstratified`` is the plain aggregate over the day's sessions, for the evidence."""
    s = queries.session_frame(store, start, end).filter(pl.col("streamed_s") >= queries.MIN_STREAMED_S)
    if s.is_empty():
        return s
    s = strata.with_strata(s, queries.session_first_forward(store, start, end))
    s = s.with_columns(pl.col("start_ts").dt.truncate("1d").alias("day"))

    def agg(col: str, how: str) -> pl.Expr:
        return pl.col(col).median() if how == "median" else pl.col(col).mean()

    cells = s.group_by("gpu_kind", "day", "stratum").agg(
        pl.len().alias("sessions"), *(agg(col, how).alias(m) for m, (col, how, _) in DAILY_METRICS.items()))
    daily = strata.standardize(cells, ["gpu_kind"], "day", list(DAILY_METRICS), size="sessions")
    plain = s.group_by("gpu_kind", "day").agg(
        *(agg(col, how).alias(f"{m}_unstratified") for m, (col, how, _) in DAILY_METRICS.items()),
        pl.col("release").alias("releases"))
    return daily.join(plain, on=["gpu_kind", "day"], how="left").sort("gpu_kind", "day")


def run(store, start: datetime, end: datetime) -> list[dict]:
    """Findings (kind='changepoint') for each GPU kind and daily metric with a change in [start, end)."""
    rows = []
    daily = daily_series(store, start, end)
    if daily.is_empty():
        return rows
    for (gpu_kind,), g in daily.group_by("gpu_kind", maintain_order=True):
        g = g.filter(pl.col("sessions") >= MIN_SESSIONS_PER_DAY).sort("day")
        days = g["day"].to_list()
        for metric, (_, _how, floor) in DAILY_METRICS.items():
            values = g[metric].fill_null(0.0).to_numpy()
            for cp in change_points(values, min_effect=floor):
                if cp.mean_after <= cp.mean_before:  # an improvement is not a regression finding
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
                        value=cp.mean_after,
                        baseline=cp.mean_before,
                        effect=cp.rel_change,
                        confidence=1.0 - cp.p_value,
                        severity="critical" if cp.rel_change >= CRITICAL_REL_CHANGE else "warning",
                        evidence={
                            "method": "E-Divisive means (Matteson & James 2014) via otava.analysis.compute_change_points",
                            "p_value": cp.p_value,
                            "effect_floor": cp.threshold,
                            "stderr_of_means": cp.stderr,
                            "min_segment_days": MIN_SEGMENT_DAYS,
                            "series_days": [d.date().isoformat() for d in days],
                            "series": values.tolist(),
                            "series_unstratified": g[f"{metric}_unstratified"].to_list(),
                            "strata": strata.NOTE,
                            "release_share_change": mix,
                            "release_gaining": max(mix, key=mix.get) if mix else "",
                        },
                    )
                )
    return rows
