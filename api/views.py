"""What the routes, the dashboard pages and the weekly report show: the read layer's frames
(analytics/queries.py) shaped for JSON and for the pages. No SQL here, and no routes: the routers
(api/routes/) and the report import this module, never each other.

    rows(df, json_cols=("evidence",))          # JSON-ready rows (ISO datetimes, NaN as null)
    finding_rows(queries.findings_frame(store, kind="regression"))   # with one-sentence summaries
    fps_table(store, start, end, ["week", "release"])                 # fleet fps fractions, grouped
    release_quantiles(store, start, end, ["fps"])                     # per-release quantiles per metric
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

import orjson
import polars as pl

from analytics import queries as aq
from analytics.describe import describe
from collector import catalog

# The per-session metrics the API serves, from the catalogue (collector/catalog.py)
Metric = Enum("Metric", {m: m for m in catalog.API_METRICS}, type=str)
Metric.__doc__ = "A per-session metric (collector/catalog.py's METRICS)."
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def session_frame(store, start: datetime, end: datetime, filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """One row per session that started in [start, end): labels, counts and per-session metrics (fps,
    step period, late rate, ...); ``analytics.queries.session_frame`` with the dashboard's column names."""
    return aq.session_frame(store, start, end, filters).rename(
        {"start_ts": "first_ts", "end_ts": "last_ts", "switch_state": "switches"})


def rows(df: pl.DataFrame, json_cols: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """A frame as JSON-ready rows (datetimes as ISO strings, NaN as null); ``json_cols`` hold JSON
    text (evidence, event detail) and come back decoded (empty as ``{}``, unparsable text as is)."""
    out = []
    for r in df.iter_rows(named=True):
        for k, v in r.items():
            if isinstance(v, datetime):
                r[k] = v.isoformat()
            elif isinstance(v, float) and math.isnan(v):
                r[k] = None
        for k in json_cols:
            try:
                r[k] = orjson.loads(r[k] or "{}")
            except orjson.JSONDecodeError:
                pass
        out.append(r)
    return out


def filters_of(**kw: str | None) -> dict[str, str]:
    return {k: v for k, v in kw.items() if v}


def sessions_in(store, start: datetime, end: datetime, **filters: str | None) -> pl.DataFrame:
    """``session_frame`` of the sessions that streamed >= 1 s (the population of every fleet figure)."""
    df = session_frame(store, start, end, filters_of(**filters) or None)
    return df.filter(pl.col("streamed_s") >= catalog.MIN_STREAMED_S) if df.height else df


def fps_table(store, start: datetime, end: datetime, group_by: list[str], **filters: str | None) -> pl.DataFrame:
    """Fractions of sessions (streamed >= 1 s) at or below 24 fps and at or below 23.5 fps (named as the
    fps findings' metrics: ``frac_le_24fps``, ``frac_le_23_5fps``; counts ``n_le_24``, ``n_le_23_5``), grouped by any of
    week / release / gpu_kind. Reads analytics' fleet roll-up (days already rolled come from
    ``fleet_daily``, the rest live), so a fleet-wide view never groups millions of sessions."""
    df = aq.fps_fractions(store, start, end)
    for k, v in filters_of(**filters).items():
        df = df.filter(pl.col(k) == v) if df.height else df
    if df.height == 0:
        return pl.DataFrame()
    df = df.with_columns(pl.col("week").cast(pl.Date).cast(pl.String),
                         (pl.col("mean_fps") * pl.col("sessions")).alias("_fps_sum"))
    return df.group_by(group_by).agg(
        pl.col("sessions").sum(), pl.col("n_le_24").sum(), pl.col("n_le_23_5").sum(), pl.col("_fps_sum").sum(),
    ).with_columns(
        (pl.col("n_le_24") / pl.col("sessions")).alias("frac_le_24fps"),
        (pl.col("n_le_23_5") / pl.col("sessions")).alias("frac_le_23_5fps"),
        (pl.col("_fps_sum") / pl.col("sessions")).alias("mean_fps"),
    ).drop("_fps_sum").filter(pl.col("sessions") > 0).sort(group_by)


def quantile_rows(df: pl.DataFrame, metric: str, by: str = "release") -> list[dict[str, Any]]:
    if df.height == 0:
        return []
    agg = df.drop_nulls(metric).group_by(by).agg(
        pl.len().alias("sessions"), pl.col(metric).mean().alias("mean"),
        *[pl.col(metric).quantile(p, "linear").alias(f"p{round(p * 100)}") for p in QUANTILES],
    )
    return rows(agg.sort(by))


def q_name(p: float) -> str:
    return f"p{round(p * 100)}"


def release_quantiles(store, start: datetime, end: datetime, metrics: list[str], releases: list[str] | None = None,
                      **filters: str | None) -> dict[str, list[dict[str, Any]]]:
    """Per metric: ``quantile_rows`` of the sessions (streamed >= 1 s) in [start, end), computed in
    ClickHouse (``analytics.queries.metric_quantiles``) so only one row per release comes back instead
    of every session. Sessions whose metric is missing (null or NaN) are not counted for that metric."""
    assert set(metrics) <= set(catalog.API_METRICS), metrics
    f: dict[str, Any] = filters_of(**filters)
    if releases is not None:
        f["release"] = releases
    df = aq.metric_quantiles(store, start, end, metrics, QUANTILES, f)
    out: dict[str, list[dict[str, Any]]] = {}
    for m in metrics:
        out[m] = [
            {"release": r["release"], "sessions": r[f"{m}__n"], "mean": r[f"{m}__mean"],
             **{q_name(p): v for p, v in zip(QUANTILES, r[f"{m}__q"], strict=True)}}
            for r in df.iter_rows(named=True) if r[f"{m}__n"]
        ]
    return out


def finding_rows(df: pl.DataFrame) -> list[dict[str, Any]]:
    """Findings as dicts, evidence parsed, each with its one-sentence ``summary`` (analytics/describe.py)."""
    out = rows(df, json_cols=("evidence",))
    for r in out:
        r["summary"] = describe(r)
    return out


def memory_growth_frame(store, start: datetime, end: datetime, **filters: str | None) -> pl.DataFrame:
    """Per session: peak reserved memory against the distinct first-forward shapes its worker has
    seen so far since the worker's process (re)started within the window (the August leak's signature)."""
    df = session_frame(store, start, end, filters_of(**filters) or None)
    if df.height == 0:
        return df
    shapes = aq.session_first_forward(store, start, end)
    if shapes.height == 0:
        return shapes
    df = df.select("release", "gpu_kind", "worker_id", "session_id", "first_ts", "mem_reserved_max",
                   "buffers_max", "switches").join(shapes, on="session_id").sort("worker_id", "first_ts")
    return df.with_columns(
        pl.col("first_forward_tokens").is_first_distinct().cast(pl.Int64).cum_sum().over("worker_id")
        .alias("distinct_shapes")
    )


def fp8_saturation_rows(store, start: datetime, end: datetime, release: str | None = None,
                        gpu_kind: str | None = None) -> list[dict[str, Any]]:
    """Per release x GPU kind: sessions sampled with static scales, the share saturating and its 95%
    interval, the p95 and max of the sessions' largest saturated fraction, ``flagged`` judged over
    [start, end) (``analytics.saturation``: counted in ClickHouse over ``session_stats``, one row per
    group back, judged by the job's own ``judge_groups``)."""
    from analytics import saturation

    groups = saturation.judge_groups(saturation.group_saturation(store, start, end, release=release,
                                                                 gpu_kind=gpu_kind))
    if groups.is_empty():
        return []
    return rows(groups.select("release", "gpu_kind", "sessions", "saturating", "share", "ci_low", "ci_high",
                              "p_value", "sat_p95", "sat_max", "sampled_steps", "saturating_steps",
                              "saturating_workers", "flagged"))


def flagged_over(start: datetime, end: datetime) -> str:
    """What ``flagged`` was judged over, beside the job's own window (whose findings are the ones acted on)."""
    from analytics.jobs import SATURATION_WINDOW

    days = SATURATION_WINDOW / timedelta(days=1)
    return (f"judged over the range shown ({start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} UTC); the hourly "
            f"fp8_saturation job judges the last {days:g} days and its findings are the ones acted on")
