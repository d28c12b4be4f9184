"""Dashboard REST (``/v1/...``): fleet fps fractions, per-release distributions and comparison,
session drill-down (events, memory; raw steps are api/routes/sessions.py's), memory growth against distinct shapes,
FP8 saturation per release and GPU kind, findings.

Every list takes ``start``/``end`` (ISO 8601, default the last 56 days, at most 400 days) and the
list endpoints ``limit``/``offset``; bad values are 422 with the reason. Fleet figures never read raw
steps: fps fractions come from analytics' daily roll-up (``analytics.queries.fps_fractions``:
``fleet_daily`` plus the live tail); per-release distributions and the release comparison are exact
quantiles of per-session metrics (``analytics.queries.session_sql`` over ``session_stats``)
aggregated in ClickHouse, one row per release back (the roll-up's t-digests hold only fps and step
period at fixed levels, so ``release_distribution`` cannot answer these). Drill-down reads raw rows
of one session.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from enum import Enum
from typing import Annotated, Any

import orjson
import polars as pl
from fastapi import APIRouter, Depends, HTTPException, Path, Query

from analytics.describe import describe
from api.deps import StoreDep, require_reader
from api.routes._common import Label, PageDep, TimeRangeDep
from collector import catalog
from collector.where import Where

router = APIRouter(prefix="/v1", tags=["dashboards"], dependencies=[Depends(require_reader)])

SessionId = Annotated[str, Path(min_length=1, max_length=128)]


class Metric(str, Enum):
    fps = "fps"
    step_period_ms = "step_period_ms"
    diffusion_ms = "diffusion_ms"
    upkeep_ms = "upkeep_ms"
    energy_per_chunk_mj = "energy_per_chunk_mj"
    late_rate = "late_rate"


class GroupKey(str, Enum):
    week = "week"
    release = "release"
    gpu_kind = "gpu_kind"


QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
FPS_BUDGET, FPS_LOW, MIN_STREAMED_S = catalog.FPS_BUDGET, catalog.FPS_LOW, catalog.MIN_STREAMED_S
FILTER_KEYS = catalog.FILTER_KEYS

def session_frame(store, start: datetime, end: datetime, filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """One row per session that started in [start, end): labels, counts and per-session metrics (fps,
    step period, late rate, ...); ``analytics.queries.session_frame`` with the dashboard's column names."""
    from analytics import queries as aq

    for k in filters or {}:
        assert k in FILTER_KEYS, k
    return aq.session_frame(store, start, end, filters).rename(
        {"start_ts": "first_ts", "end_ts": "last_ts", "switch_state": "switches"})


def releases_seen(store) -> list[str]:
    return [r[0] for r in store.query_rows("SELECT DISTINCT release FROM session_stats ORDER BY release")]


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


def _filters(**kw: str | None) -> dict[str, str]:
    return {k: v for k, v in kw.items() if v}


def sessions_in(store, start: datetime, end: datetime, **filters: str | None) -> pl.DataFrame:
    df = session_frame(store, start, end, _filters(**filters) or None)
    return df.filter(pl.col("streamed_s") >= MIN_STREAMED_S) if df.height else df


def fps_table(store, start: datetime, end: datetime, group_by: list[str], **filters: str | None) -> pl.DataFrame:
    """Fractions of sessions (streamed >= 1 s) at or below 24 fps and at or below 23.5 fps (named as the
    fps findings' metrics: ``frac_le_24fps``, ``frac_le_23_5fps``; counts ``n_le_24``, ``n_le_23_5``), grouped by any of
    week / release / gpu_kind. Reads analytics' fleet roll-up (days already rolled come from
    ``fleet_daily``, the rest live), so a fleet-wide view never groups millions of sessions."""
    from analytics import queries as aq

    df = aq.fps_fractions(store, start, end)
    for k, v in _filters(**filters).items():
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


@router.get("/fleet/fps")
def fleet_fps(
    store: StoreDep, tr: TimeRangeDep, release: Label = None, gpu_kind: Label = None,
    group_by: Annotated[list[GroupKey] | None, Query(description="any of week, release, gpu_kind")] = None,
) -> dict[str, Any]:
    """Fractions of sessions (streamed >= 1 s) at or below 24 fps (``frac_le_24fps``) and at or below
    23.5 fps (``frac_le_23_5fps``), with their counts, grouped."""
    keys = list(dict.fromkeys(g.value for g in group_by or list(GroupKey)))
    df = fps_table(store, tr.start, tr.end, keys, release=release, gpu_kind=gpu_kind)
    return {"start": tr.start.isoformat(), "end": tr.end.isoformat(), "group_by": keys, "rows": rows(df)}


@router.get("/releases")
def releases(store: StoreDep, tr: TimeRangeDep) -> dict[str, Any]:
    df = store.query_df(
        "SELECT release, min(first_ts) AS first_seen, max(last_ts) AS last_seen, uniqExact(session_id) AS sessions "
        "FROM session_stats WHERE first_ts >= {start:DateTime64(3, 'UTC')} AND first_ts < {end:DateTime64(3, 'UTC')} "
        "GROUP BY release ORDER BY first_seen", {"start": tr.start, "end": tr.end})
    return {"releases": rows(df)}


def quantile_rows(df: pl.DataFrame, metric: str, by: str = "release") -> list[dict[str, Any]]:
    if df.height == 0:
        return []
    agg = df.drop_nulls(metric).group_by(by).agg(
        pl.len().alias("sessions"), pl.col(metric).mean().alias("mean"),
        *[pl.col(metric).quantile(p, "linear").alias(f"p{round(p * 100)}") for p in QUANTILES],
    )
    return rows(agg.sort(by))


@router.get("/releases/distributions")
def distributions(
    store: StoreDep, tr: TimeRangeDep, metric: Metric = Metric.step_period_ms, release: Label = None,
    gpu_kind: Label = None,
) -> dict[str, Any]:
    """Quantiles of a per-session metric (step time, upkeep, energy per chunk, late rate) per release."""
    qs = release_quantiles(store, tr.start, tr.end, [metric.value], release=release, gpu_kind=gpu_kind)
    return {"metric": metric.value, "quantiles": [_q(p) for p in QUANTILES], "rows": qs[metric.value]}


def _q(p: float) -> str:
    return f"p{round(p * 100)}"


def release_quantiles(store, start: datetime, end: datetime, metrics: list[str], releases: list[str] | None = None,
                      **filters: str | None) -> dict[str, list[dict[str, Any]]]:
    """Per metric: ``quantile_rows`` of the sessions (streamed >= 1 s) in [start, end), computed in
    ClickHouse (exact quantiles, linear interpolation as polars' "linear") so only one row per
    release comes back instead of every session. Sessions whose metric is missing (null or NaN) are
    not counted for that metric."""
    from analytics import queries as aq

    allowed = {m.value for m in Metric}
    assert set(metrics) <= allowed, metrics
    f = _filters(**filters)
    if releases is not None:
        f["release"] = releases
    params: dict[str, Any] = {"start": start, "end": end, "min_s": MIN_STREAMED_S}
    levels = ", ".join(repr(p) for p in QUANTILES)
    cols = []
    for m in metrics:
        ok = f"ifNull(isFinite({m}), 0)"
        cols.append(f"countIf({ok}) AS {m}__n, avgIf({m}, {ok}) AS {m}__mean, "
                    f"quantilesExactInclusiveIf({levels})({m}, {ok}) AS {m}__q")
    sql = (f"SELECT release, {', '.join(cols)} FROM ({aq.session_sql(f, params)}) "
           "WHERE streamed_s >= {min_s:Float64} GROUP BY release ORDER BY release")
    df = store.query_df(sql, params)
    out: dict[str, list[dict[str, Any]]] = {}
    for m in metrics:
        out[m] = [
            {"release": r["release"], "sessions": r[f"{m}__n"], "mean": r[f"{m}__mean"],
             **{_q(p): v for p, v in zip(QUANTILES, r[f"{m}__q"], strict=True)}}
            for r in df.iter_rows(named=True) if r[f"{m}__n"]
        ]
    return out


def findings_frame(store, *, kind: str | None = None, severity: str | None = None, status: str | None = None,
                   scope_contains: str | None = None, scope_labels: dict[str, str | None] | None = None,
                   attribution: str | None = None, start: datetime | None = None, end: datetime | None = None,
                   limit: int = 100, offset: int = 0) -> pl.DataFrame:
    """Findings (FINAL) filtered by column values; ``scope_contains`` is a substring of the canonical
    scope (the /v1/findings filter), ``scope_labels`` exact labels: every given ``key=value`` is one of
    the scope's comma-separated parts (``release=v1`` matches neither ``release=v1.2`` nor ``v10``)."""
    w = Where(limit=limit, offset=offset)
    for col, val in (("kind", kind), ("severity", severity), ("status", status), ("attribution", attribution)):
        w.eq(col, val)
    if scope_contains:
        w.sql("position(scope, {scope:String}) > 0", scope=scope_contains)
    for i, (k, v) in enumerate(sorted((scope_labels or {}).items())):
        if v:
            w.sql(f"has(splitByChar(',', scope), {{label{i}:String}})", **{f"label{i}": f"{k}={v}"})
    w.overlapping("window_start", "window_end", start, end)
    return store.query_df(
        "SELECT kind, scope, metric, window_start, window_end, baseline, value, effect, confidence, severity, "
        "status, attribution, evidence, job, first_seen, updated_at FROM findings FINAL "
        f"WHERE {w} ORDER BY window_start DESC, kind, scope, metric "
        "LIMIT {limit:UInt32} OFFSET {offset:UInt32}",
        w.params,
    )


def finding_rows(df: pl.DataFrame) -> list[dict[str, Any]]:
    """Findings as dicts, evidence parsed, each with its one-sentence ``summary`` (analytics/describe.py)."""
    out = rows(df, json_cols=("evidence",))
    for r in out:
        r["summary"] = describe(r)
    return out


@router.get("/releases/compare")
def compare_releases(
    store: StoreDep, tr: TimeRangeDep,
    baseline: Annotated[str, Query(min_length=1, max_length=128)],
    candidate: Annotated[str, Query(min_length=1, max_length=128)],
    gpu_kind: Label = None,
) -> dict[str, Any]:
    """Per-metric quantiles of two releases side by side, the median's relative change, and the
    regression findings about the candidate (on ``gpu_kind`` when given)."""
    known = set(releases_seen(store))
    missing = [r for r in (baseline, candidate) if r not in known]
    if missing:
        raise HTTPException(404, detail=f"unknown release(s) {missing}; known releases: {', '.join(sorted(known)) or 'none'}")
    per_metric = release_quantiles(store, tr.start, tr.end, [m.value for m in Metric], [baseline, candidate],
                                   gpu_kind=gpu_kind)
    metrics = {}
    for m in Metric:
        qs = {r["release"]: r for r in per_metric[m.value]}
        b, c = qs.get(baseline), qs.get(candidate)
        change = (c["p50"] / b["p50"] - 1) if b and c and b["p50"] else None
        metrics[m.value] = {"baseline": b, "candidate": c, "median_change": change}
    fnd = findings_frame(store, kind="regression", scope_labels={"release": candidate, "gpu_kind": gpu_kind},
                         limit=200)
    return {"baseline": baseline, "candidate": candidate, "metrics": metrics, "findings": finding_rows(fnd)}


@router.get("/findings")
def findings(
    store: StoreDep, tr: TimeRangeDep, page: PageDep,
    kind: Annotated[str | None, Query(
        pattern="^(fps_fraction|memory_growth|regression|changepoint|canary|fp8_saturation)$")] = None,
    severity: Annotated[str | None, Query(pattern="^(info|warning|critical)$")] = None,
    status: Annotated[str | None, Query(pattern="^(open|resolved|acknowledged)$")] = None,
    scope: Annotated[str | None, Query(max_length=400, description="substring of the canonical scope")] = None,
    attribution: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    df = findings_frame(store, kind=kind, severity=severity, status=status, scope_contains=scope,
                        attribution=attribution, start=tr.start, end=tr.end, limit=page.limit, offset=page.offset)
    return {"findings": finding_rows(df), "limit": page.limit, "offset": page.offset}


def memory_growth_frame(store, start: datetime, end: datetime, **filters: str | None) -> pl.DataFrame:
    """Per session: peak reserved memory against the distinct first-forward shapes its worker has
    seen so far since the worker's process (re)started within the window (the August leak's signature)."""
    df = session_frame(store, start, end, _filters(**filters) or None)
    if df.height == 0:
        return df
    shapes = store.query_df(
        "SELECT session_id, any(first_forward_tokens) AS first_forward_tokens FROM sessions "
        "WHERE ts >= {start:DateTime64(3, 'UTC')} - INTERVAL 1 DAY AND ts < {end:DateTime64(3, 'UTC')} "
        "GROUP BY session_id", {"start": start, "end": end})
    if shapes.height == 0:
        return shapes
    df = df.select("release", "gpu_kind", "worker_id", "session_id", "first_ts", "mem_reserved_max",
                   "buffers_max", "switches").join(shapes, on="session_id").sort("worker_id", "first_ts")
    return df.with_columns(
        pl.col("first_forward_tokens").is_first_distinct().cast(pl.Int64).cum_sum().over("worker_id")
        .alias("distinct_shapes")
    )


@router.get("/memory/growth")
def memory_growth(
    store: StoreDep, tr: TimeRangeDep, page: PageDep, release: Label = None, gpu_kind: Label = None,
    worker_id: Label = None,
) -> dict[str, Any]:
    df = memory_growth_frame(store, tr.start, tr.end, release=release, gpu_kind=gpu_kind, worker_id=worker_id)
    fnd = findings_frame(store, kind="memory_growth", start=tr.start, end=tr.end, limit=100)
    return {"sessions": rows(df.slice(page.offset, page.limit)) if df.height else [], "total": df.height,
            "findings": finding_rows(fnd), "limit": page.limit, "offset": page.offset}


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


@router.get("/fp8-saturation")
def fp8_saturation(store: StoreDep, tr: TimeRangeDep, release: Label = None, gpu_kind: Label = None) -> dict[str, Any]:
    """Per release x GPU kind, sessions that started in the window and were sampled with static FP8
    scales: how many, the share whose largest saturated fraction exceeds the tolerance (``share``,
    95% Clopper-Pearson ``ci_low``/``ci_high``), the p95 (``sat_p95``) and max of that fraction, the
    distinct saturating workers, ``flagged`` judged over the range asked for (``flagged_over`` says so:
    the default range is not the hourly job's window), and the open ``fp8_saturation`` findings of
    exactly the scope asked for. An unknown release is 404 listing the known ones."""
    from analytics import saturation
    from analytics.jobs import SATURATION_WINDOW

    if release is not None:
        known = releases_seen(store)
        if release not in known:
            raise HTTPException(404, detail=f"unknown release {release!r}; known releases: "
                                            f"{', '.join(known) or 'none'}")
    fnd = findings_frame(store, kind="fp8_saturation", status="open",
                         scope_labels={"release": release, "gpu_kind": gpu_kind}, start=tr.start, end=tr.end,
                         limit=100)
    return {"start": tr.start.isoformat(), "end": tr.end.isoformat(),
            "flagged_over": flagged_over(tr.start, tr.end),
            "job_window_days": SATURATION_WINDOW / timedelta(days=1),
            "session_saturated_above": saturation.SATURATED_FRACTION, "tolerated_share": saturation.TOLERATED_SHARE,
            "min_sessions": saturation.MIN_SESSIONS,
            "rows": fp8_saturation_rows(store, tr.start, tr.end, release=release, gpu_kind=gpu_kind),
            "findings": finding_rows(fnd)}


def session_steps(store, session_id: str, limit: int = 100_000, offset: int = 0) -> pl.DataFrame:
    return store.query_df(
        "SELECT step, ts, diffusion_ms, step_period_ms, decode_ms, cache_upkeep_ms, attention_ms, allreduce_ms, "
        "late, playout_depth, reset_step, energy_mj, mem_allocated_bytes, mem_reserved_bytes, buffers_registered, "
        "switches, fp8_saturated FROM steps WHERE session_id = {sid:String} ORDER BY step, ts "
        "LIMIT {limit:UInt32} OFFSET {offset:UInt32}",
        {"sid": session_id, "limit": limit, "offset": offset},
    )


def session_events(store, session_id: str, limit: int = 1000, offset: int = 0) -> pl.DataFrame:
    return store.query_df(
        "SELECT ts, kind, worker_id, release, gpu_kind, detail FROM events WHERE session_id = {sid:String} "
        "ORDER BY ts LIMIT {limit:UInt32} OFFSET {offset:UInt32}",
        {"sid": session_id, "limit": limit, "offset": offset},
    )


def _known_session(store, session_id: str) -> None:
    n = store.query_rows(
        "SELECT (SELECT count() FROM session_stats WHERE session_id = {sid:String}) + "
        "(SELECT count() FROM events WHERE session_id = {sid:String})", {"sid": session_id})[0][0]
    if not n:
        raise HTTPException(404, detail=f"no session {session_id!r} in the store (list sessions at /v1/sessions)")


@router.get("/sessions/{session_id:path}/events")
def events_of_session(store: StoreDep, session_id: SessionId, page: PageDep) -> dict[str, Any]:
    _known_session(store, session_id)
    df = session_events(store, session_id, page.limit, page.offset)
    out = rows(df, json_cols=("detail",))
    return {"session_id": session_id, "events": out, "limit": page.limit, "offset": page.offset}


@router.get("/sessions/{session_id:path}/memory")
def memory_of_session(store: StoreDep, session_id: SessionId) -> dict[str, Any]:
    _known_session(store, session_id)
    df = store.query_df(
        "SELECT step, ts, mem_allocated_bytes, mem_reserved_bytes, buffers_registered FROM steps "
        "WHERE session_id = {sid:String} ORDER BY step, ts LIMIT 100000", {"sid": session_id})
    return {"session_id": session_id, "series": rows(df)}
