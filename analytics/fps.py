"""Weekly fps fractions: per ISO week, release and GPU kind, the share of sessions (that streamed
>= 1 s) whose average fps was <= 24 and <= 23.5, with counts and Wilson intervals.

    df = weekly_fractions(store, start, end)        # polars, one row per (week, release, gpu_kind)
    rows = run(store, start, end)                   # the same as findings rows (kind='fps_fraction')

Counting happens in ClickHouse over ``session_stats`` (analytics.queries.fps_fractions); the
intervals are statsmodels' Wilson intervals.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import polars as pl

from analytics import queries
from analytics.findings import finding
from analytics.stats import wilson

# A week is flagged 'warning' when the lower Wilson bound of its <= 24 fps share exceeds this
# (the paper's fleet after the fix: 0.7%; before it, 7-23% per week).
WARN_SHARE_LE_24 = 0.05
METRICS = {"frac_le_24fps": "n_le_24", "frac_le_23_5fps": "n_le_23_5"}


def weekly_fractions(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per ISO week (Monday), release and GPU kind: counts, fractions and 95% Wilson intervals."""
    df = queries.fps_fractions(store, start, end, live=True)  # exact from session_stats, never stale
    out = []
    for r in df.iter_rows(named=True):
        row = dict(r)
        for metric, count_col in METRICS.items():
            lo, hi = wilson(r[count_col], r["sessions"])
            row[metric] = r[count_col] / r["sessions"] if r["sessions"] else 0.0
            row[metric + "_lo"], row[metric + "_hi"] = lo, hi
        out.append(row)
    return pl.DataFrame(out) if out else df


def run(store, start: datetime, end: datetime) -> list[dict]:
    """Findings rows (kind='fps_fraction') for every week/release/GPU kind with sessions in [start, end)."""
    rows = []
    for r in weekly_fractions(store, start, end).iter_rows(named=True):
        week = datetime.combine(r["week"], datetime.min.time()).replace(tzinfo=start.tzinfo)
        for metric, count_col in METRICS.items():
            share, lo, hi = r[metric], r[metric + "_lo"], r[metric + "_hi"]
            severity = "warning" if metric == "frac_le_24fps" and lo > WARN_SHARE_LE_24 else "info"
            rows.append(
                finding(
                    "fps_fraction",
                    {"release": r["release"], "gpu_kind": r["gpu_kind"]},
                    metric,
                    week,
                    week + timedelta(days=7),
                    value=share,
                    severity=severity,
                    evidence={
                        "iso_week": queries.iso_week_of(week),
                        "sessions": r["sessions"],
                        "count": r[count_col],
                        "ci_low": lo,
                        "ci_high": hi,
                        "ci_method": "wilson",
                        "mean_fps": r["mean_fps"],
                        "min_streamed_s": queries.MIN_STREAMED_S,
                    },
                )
            )
    return rows
