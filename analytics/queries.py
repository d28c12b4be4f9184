"""SQL -> polars: every query the analytics (and the dashboard's fleet views) run against the store.

Fleet-wide figures read ``session_stats`` (the per-session materialized view), never raw steps:

    df = session_frame(store, start, end)                  # one row per session, finalized
    df = fps_fractions(store, start, end)                   # per ISO week, release, GPU kind
    df = release_distribution(store, start, end)            # per release: fps / step-time quantiles

Cohort filters (``{"release": "v7"}``, ``{"worker_id": ["w1", "w2"]}``) become parameterized
``IN`` clauses; their keys must be in ``FILTER_KEYS``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import polars as pl

FPS_BUDGET = 24.0
FPS_LOW = 23.5
FRAMES_PER_STEP = 4
MIN_STREAMED_S = 1.0

FILTER_KEYS: tuple[str, ...] = ("release", "gpu_kind", "worker_id", "session_id", "switches")

# One finalized row per session. The inner WHERE prunes partitions (a session's partial rows may
# carry a later first_ts, hence the day of slack); HAVING puts the session in the window by its start.
_SESSIONS_SQL = """
SELECT
    release, gpu_kind, worker_id, session_id,
    min(first_ts)                                   AS start_ts,
    max(last_ts)                                    AS end_ts,
    max(simulated)                                  AS simulated,
    countMerge(steps)                               AS steps,
    countIfMerge(late_chunks)                       AS late_chunks,
    sumMerge(period_ms_sum)                         AS period_ms_sum,
    avgMerge(diffusion_ms_avg)                      AS diffusion_ms,
    avgMerge(upkeep_ms_avg)                         AS upkeep_ms,
    sumMerge(energy_mj_sum)                         AS energy_mj,
    max(mem_reserved_max)                           AS mem_reserved_max,
    max(buffers_max)                                AS buffers_max,
    anyLast(switches)                               AS switch_state
FROM session_stats
WHERE first_ts >= {start:DateTime64(3, 'UTC')} - INTERVAL 1 DAY AND first_ts < {end:DateTime64(3, 'UTC')}
      {filters}
GROUP BY release, gpu_kind, worker_id, session_id
HAVING start_ts >= {start:DateTime64(3, 'UTC')} AND start_ts < {end:DateTime64(3, 'UTC')}
"""

# Per-session metrics derived from the finalized states (streamed seconds, fps, per-chunk figures).
_METRICS_SQL = """
SELECT *,
    period_ms_sum / 1000                                        AS streamed_s,
    steps * {frames} / greatest(period_ms_sum / 1000, 1e-9)     AS fps,
    period_ms_sum / steps                                       AS step_period_ms,
    late_chunks / steps                                         AS late_rate,
    energy_mj / steps                                           AS energy_per_chunk_mj
FROM ({sessions})
"""


class QueryError(Exception):
    """A query was asked for something that does not exist; the message lists valid values."""


def filter_clause(filters: dict[str, Any] | None, params: dict[str, Any], prefix: str = "f") -> str:
    """``AND key IN {p:Array(String)}`` for each filter; fills ``params``. Keys must be in FILTER_KEYS."""
    parts = []
    for i, (key, value) in enumerate(sorted((filters or {}).items())):
        if key not in FILTER_KEYS:
            raise QueryError(f"unknown cohort filter {key!r}; valid filters: {', '.join(FILTER_KEYS)}")
        values = [value] if isinstance(value, str) else [str(v) for v in value]
        name = f"{prefix}{i}"
        params[name] = values
        parts.append(f"AND {key} IN {{{name}:Array(String)}}")
    return " ".join(parts)


def session_sql(filters: dict[str, Any] | None, params: dict[str, Any], prefix: str = "f") -> str:
    """The per-session SQL (with derived metrics) for a cohort; ``params`` gets the filter values."""
    inner = _SESSIONS_SQL.replace("{filters}", filter_clause(filters, params, prefix))
    return _METRICS_SQL.replace("{sessions}", inner).replace("{frames}", str(FRAMES_PER_STEP))


def session_frame(store, start: datetime, end: datetime, filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """One row per session that started in [start, end): labels, counts, per-session metrics."""
    params: dict[str, Any] = {"start": start, "end": end}
    return store.query_df(session_sql(filters, params) + " ORDER BY start_ts", params)


def fps_fractions(store, start: datetime, end: datetime, filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """Per ISO week (Monday), release and GPU kind: sessions that streamed >= 1 s, how many averaged
    <= 24 fps and <= 23.5 fps, and the mean fps. The dashboard's fleet query."""
    params: dict[str, Any] = {"start": start, "end": end, "min_s": MIN_STREAMED_S}
    sql = f"""
    SELECT toMonday(start_ts) AS week, release, gpu_kind,
           count() AS sessions,
           countIf(fps <= {FPS_BUDGET}) AS n_le_24,
           countIf(fps <= {FPS_LOW}) AS n_le_23_5,
           avg(fps) AS mean_fps
    FROM ({session_sql(filters, params)})
    WHERE streamed_s >= {{min_s:Float64}}
    GROUP BY week, release, gpu_kind
    ORDER BY week, release, gpu_kind
    """
    return store.query_df(sql, params)


def release_distribution(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per release and GPU kind: session count and quantiles of session fps and step period.
    The dashboard's per-release distribution query."""
    params: dict[str, Any] = {"start": start, "end": end, "min_s": MIN_STREAMED_S}
    sql = f"""
    SELECT release, gpu_kind, count() AS sessions,
           quantiles(0.05, 0.5, 0.95)(fps) AS fps_q,
           quantiles(0.5, 0.95, 0.99)(step_period_ms) AS step_period_q,
           avg(late_rate) AS late_rate, avg(energy_per_chunk_mj) AS energy_per_chunk_mj
    FROM ({session_sql(None, params)})
    WHERE streamed_s >= {{min_s:Float64}}
    GROUP BY release, gpu_kind
    ORDER BY release, gpu_kind
    """
    return store.query_df(sql, params)


def release_first_seen(store, end: datetime) -> pl.DataFrame:
    """Each release with its first and last session start before ``end``, oldest first."""
    return store.query_df(
        "SELECT release, min(first_ts) AS first_seen, max(first_ts) AS last_seen FROM session_stats "
        "WHERE first_ts < {end:DateTime64(3, 'UTC')} GROUP BY release ORDER BY first_seen",
        {"end": end},
    )


def memory_sessions(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per session, for memory analysis: worker, release, start, first-forward tokens (from the
    ``sessions`` table), peak reserved memory and buffer count (from ``session_stats``), switches."""
    params: dict[str, Any] = {"start": start, "end": end}
    sql = f"""
    SELECT s.release AS release, s.gpu_kind AS gpu_kind, s.worker_id AS worker_id, s.session_id AS session_id,
           s.start_ts AS start_ts, s.mem_reserved_max AS mem_reserved_max, s.buffers_max AS buffers_max,
           s.switch_state AS switch_state, t.first_forward_tokens AS first_forward_tokens
    FROM ({_SESSIONS_SQL.replace("{filters}", "")}) AS s
    INNER JOIN (
        SELECT session_id, any(first_forward_tokens) AS first_forward_tokens
        FROM sessions
        WHERE ts >= {{start:DateTime64(3, 'UTC')}} - INTERVAL 1 DAY AND ts < {{end:DateTime64(3, 'UTC')}}
        GROUP BY session_id
    ) AS t ON s.session_id = t.session_id
    ORDER BY worker_id, start_ts
    """
    return store.query_df(sql, params)


def events(store, kind: str, start: datetime, end: datetime) -> pl.DataFrame:
    """Events of one kind in [start, end): worker, release, time, detail JSON."""
    return store.query_df(
        "SELECT worker_id, session_id, release, gpu_kind, ts, detail FROM events WHERE kind = {k:String} "
        "AND ts >= {start:DateTime64(3, 'UTC')} AND ts < {end:DateTime64(3, 'UTC')} ORDER BY worker_id, ts",
        {"k": kind, "start": start, "end": end},
    )


def releases_seen(store) -> list[str]:
    """Every release that has session statistics (the cheap poll of the release watcher)."""
    return [r[0] for r in store.query_rows("SELECT DISTINCT release FROM session_stats ORDER BY release")]


def day_floor(t: datetime) -> datetime:
    return t.replace(hour=0, minute=0, second=0, microsecond=0)


def iso_week_bounds(iso_week: str) -> tuple[datetime, datetime]:
    """'2026-W47' -> (Monday 00:00 UTC, next Monday 00:00 UTC)."""
    from datetime import UTC

    try:
        year, week = iso_week.split("-W")
        monday = datetime.fromisocalendar(int(year), int(week), 1).replace(tzinfo=UTC)
    except ValueError as e:
        raise QueryError(f"ISO week {iso_week!r} is not valid; valid form: YYYY-Www, e.g. 2026-W47") from e
    return monday, monday + timedelta(days=7)


def iso_week_of(t: datetime) -> str:
    y, w, _ = t.isocalendar()
    return f"{y}-W{w:02d}"
