"""The read layer: every SELECT that reads the store, as typed functions (SQL -> polars / rows).

Routes, pages, reports, canaries, incidents, metrics and jobs call a function here and never write a
query (STYLE.md "Growing by addition"); DDL is sql/ + collector/migrations.py, ingest's writes are
collector/'s. Per-session figures derive from the metric catalogue (collector/catalog.py): its
``SESSION_COLUMNS`` and ``METRICS`` are the session view's SELECT.

Fleet-wide figures read the per-session materialized views, never raw steps: ``session_stats``
(every per-session aggregate; the analytics jobs) and, for the dashboard's fleet queries over long
windows, the ``fleet_daily`` roll-up of closed days plus the time-ordered ``session_fleet`` view
for the hours not rolled up yet (sql/012, sql/013):

    df = session_frame(store, start, end)                  # one row per session, finalized
    rows, total = session_list(store, {"release": "v7"}, start=t, limit=50)  # GET /v1/sessions's page
    df = fps_fractions(store, start, end)                   # per ISO week, release, GPU kind
    df = release_distribution(store, start, end)            # per release: fps / step-time quantiles

Cohort filters (``{"release": "v7"}``, ``{"worker_id": ["w1", "w2"]}``) become parameterized
``IN`` clauses; their keys must be in ``FILTER_KEYS``. Label filters select partial rows (a session's
labels never change); ``switches`` selects sessions by their final switch state (``switch_state``).

Why one module over ~450 lines: it is the one place SQL text that reads the store lives (issue 28),
so a change of a table or view is one file to read, and the sections below (sessions, fleet roll-up,
drill-down, findings, switch control plane, incidents and canaries, evaluations, turns, metrics) share
the session SQL and the ``Where`` builder instead of each repeating them.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import polars as pl

from collector import catalog, records

# The fleet thresholds and cohort filters are the catalogue's (collector/catalog.py), named here too
# because every detector reads them as ``queries.MIN_STREAMED_S`` etc.
FPS_BUDGET, FPS_LOW = catalog.FPS_BUDGET, catalog.FPS_LOW
FRAMES_PER_STEP, MIN_STREAMED_S = catalog.FRAMES_PER_STEP, catalog.MIN_STREAMED_S
FILTER_KEYS: tuple[str, ...] = catalog.FILTER_KEYS

# One finalized row per session: the aggregate columns every per-session read shares (analytics'
# frames, the dashboard's fleet views, the API's ``GET /v1/sessions``), from the catalogue's
# ``SESSION_COLUMNS``. A session is spread over several partial rows (one per insert block until
# merged); each column merges them in any order, so a block replayed late never rolls it back.
_LABELS = "release, gpu_kind, worker_id, session_id"
_SESSION_COLUMNS = "\n    " + _LABELS + "".join(
    f",\n    {c.sql:<50} AS {c.name}" for c in catalog.SESSION_COLUMNS if not c.detail)
# The session listing's extra columns (``detail=True``): reset steps and t-digest quantiles
# [p50, p95, p99] of the step period and the diffusion time.
_DETAIL_COLUMNS = "".join(f",\n    {c.sql:<50} AS {c.name}" for c in catalog.SESSION_COLUMNS if c.detail)

_SESSIONS_SQL = """
SELECT {columns}
FROM session_stats
WHERE 1 {where} {filters}
GROUP BY release, gpu_kind, worker_id, session_id
{having}
"""

# Sessions that started in [start, end). The WHERE prunes partitions (a session's partial rows may
# carry a later first_ts, hence the day of slack); HAVING puts the session in the window by its start.
_STARTED_WHERE = ("AND first_ts >= {start:DateTime64(3, 'UTC')} - INTERVAL 1 DAY "
                  "AND first_ts < {end:DateTime64(3, 'UTC')}")
_STARTED_HAVING = "HAVING start_ts >= {start:DateTime64(3, 'UTC')} AND start_ts < {end:DateTime64(3, 'UTC')}"

# Per-session metrics derived from the finalized states (catalog.METRICS: streamed seconds, fps, ...).
_METRICS_SQL = "SELECT *" + "".join(f",\n    {m.sql:<58} AS {m.name}" for m in catalog.METRICS
                                if m.sql != m.name) + """
FROM ({sessions})
WHERE 1 {state_filters}
"""


class QueryError(Exception):
    """A query was asked for something that does not exist; the message lists valid values."""


# filters on a session's final state, not on its partial rows: the column each one reads
STATE_FILTERS = {"switches": "switch_state"}


def filter_clause(filters: dict[str, Any] | None, params: dict[str, Any], prefix: str = "f") -> tuple[str, str]:
    """(label clause, state clause): ``AND col IN {p:Array(String)}`` for each filter, fills ``params``.
    The label clause applies to partial rows, the state clause to finalized sessions (STATE_FILTERS).
    Keys must be in FILTER_KEYS."""
    labels, states = [], []
    for i, (key, value) in enumerate(sorted((filters or {}).items())):
        if key not in FILTER_KEYS:
            raise QueryError(f"unknown cohort filter {key!r}; valid filters: {', '.join(FILTER_KEYS)}")
        values = [value] if isinstance(value, str) else [str(v) for v in value]
        name = f"{prefix}{i}"
        params[name] = values
        column = STATE_FILTERS.get(key, key)
        (states if key in STATE_FILTERS else labels).append(f"AND {column} IN {{{name}:Array(String)}}")
    return " ".join(labels), " ".join(states)


def _sessions_sql(filters: str, window: str = "started", detail: bool = False,
                  start: bool = True, end: bool = True) -> str:
    """The finalized per-session rows (no derived metrics). ``window``: "started" (sessions that
    started in [start, end), partition-pruned) or "overlap" (sessions that overlap [start, end);
    either bound may be left out with ``start``/``end`` False, and every partial row is read)."""
    if window == "started":
        where, having = _STARTED_WHERE, _STARTED_HAVING
    elif window == "overlap":
        where = ""
        conds = (["end_ts >= {start:DateTime64(3, 'UTC')}"] if start else []) + \
                (["start_ts < {end:DateTime64(3, 'UTC')}"] if end else [])
        having = "HAVING " + " AND ".join(conds) if conds else ""
    else:
        raise QueryError(f"unknown session window {window!r}; valid windows: started, overlap")
    return (_SESSIONS_SQL.replace("{columns}", _SESSION_COLUMNS + (_DETAIL_COLUMNS if detail else ""))
            .replace("{where}", where).replace("{filters}", filters).replace("{having}", having))


def session_sql(filters: dict[str, Any] | None, params: dict[str, Any], prefix: str = "f", *,
                window: str = "started", detail: bool = False) -> str:
    """The per-session SQL (with derived metrics) for a cohort; ``params`` gets the filter values.
    ``window``/``detail`` as in ``_sessions_sql``; with "overlap" the bounds present in ``params``
    ("start", "end") apply."""
    labels, states = filter_clause(filters, params, prefix)
    inner = _sessions_sql(labels, window, detail, start="start" in params, end="end" in params)
    return _METRICS_SQL.replace("{sessions}", inner).replace("{state_filters}", states)


def session_frame(store, start: datetime, end: datetime, filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """One row per session that started in [start, end): labels, counts, per-session metrics."""
    params: dict[str, Any] = {"start": start, "end": end}
    return store.query_df(session_sql(filters, params) + " ORDER BY start_ts", params)


def session_list(
    store, filters: dict[str, Any] | None = None, start: datetime | None = None, end: datetime | None = None,
    min_streamed_s: float = 0.0, simulated: bool | None = None, limit: int = 100, offset: int = 0,
) -> tuple[list[dict[str, Any]], int]:
    """A page of sessions that overlap [start, end) (either bound optional), newest start first, with
    the listing's detail columns; and the number of sessions that match. The API's ``GET /v1/sessions``."""
    params: dict[str, Any] = {"min_s": min_streamed_s, "limit": limit, "offset": offset}
    params.update({k: v for k, v in (("start", start), ("end", end)) if v is not None})
    cond = "streamed_s >= {min_s:Float64}"
    if simulated is not None:
        cond += " AND simulated = {simulated:Bool}"
        params["simulated"] = simulated
    source = f"SELECT * FROM ({session_sql(filters, params, window='overlap', detail=True)}) WHERE {cond}"
    rows = store.query_arrow(
        f"SELECT *, count() OVER () AS total FROM ({source}) ORDER BY start_ts DESC, session_id "
        "LIMIT {limit:UInt32} OFFSET {offset:UInt64}", params).to_pylist()
    if rows:
        return rows, rows[0]["total"]
    return rows, store.query_rows(f"SELECT count() FROM ({source})", params)[0][0]  # offset past the end


# Per-session aggregates of one cohort, as rows of fleet_daily (the roll-up table's shape).
_DAILY_SQL = """
SELECT toDate(start_ts) AS day, release, gpu_kind,
       count() AS sessions,
       countIf(fps <= {budget}) AS n_le_24,
       countIf(fps <= {low}) AS n_le_23_5,
       sum(fps) AS fps_sum,
       sum(late_chunks) AS late_chunks,
       sum(steps) AS chunks,
       sum(ifNull(energy_mj, 0)) AS energy_sum,
       quantilesTDigestState(0.05, 0.5, 0.95)(fps) AS fps_q,
       quantilesTDigestState(0.5, 0.95, 0.99)(step_period_ms) AS period_q
FROM ({sessions})
WHERE streamed_s >= {{min_s:Float64}}
GROUP BY day, release, gpu_kind
"""


# The same per-session counters from the time-ordered ``session_fleet`` view (sql/013): a window of
# hours reads only its parts. {lo}/{hi} name the query parameters of the window's bounds.
MAX_SESSION_HOURS = 6
_FLEET_SESSIONS_SQL = """
SELECT release, gpu_kind, session_id,
       min(first_ts) AS start_ts, sum(steps) AS steps, sum(late_chunks) AS late_chunks,
       sum(period_ms_sum) AS period_ms_sum, sum(energy_mj_sum) AS energy_mj
FROM session_fleet
WHERE hour >= toStartOfHour({{{lo}:DateTime64(3, 'UTC')}}) - INTERVAL {slack} HOUR
  AND hour < {{{hi}:DateTime64(3, 'UTC')}} + INTERVAL {slack} HOUR
GROUP BY release, gpu_kind, session_id
HAVING start_ts >= {{{lo}:DateTime64(3, 'UTC')}} AND start_ts < {{{hi}:DateTime64(3, 'UTC')}}
"""
_FLEET_METRICS_SQL = f"""
SELECT *, period_ms_sum / 1000 AS streamed_s,
       steps * {FRAMES_PER_STEP} / greatest(period_ms_sum / 1000, 1e-9) AS fps,
       period_ms_sum / steps AS step_period_ms
FROM ({{sessions}})
"""


def _daily_sql(params: dict[str, Any], lo: str = "start", hi: str = "end", live_stats: bool = False) -> str:
    """fleet_daily-shaped rows for sessions starting in [params[lo], params[hi]): from session_fleet,
    or (``live_stats``) from session_stats — the same numbers, the reference path."""
    if live_stats:
        sessions = session_sql(None, params).replace("{start:", "{" + lo + ":").replace("{end:", "{" + hi + ":")
    else:
        inner = _FLEET_SESSIONS_SQL.format(lo=lo, hi=hi, slack=MAX_SESSION_HOURS)
        sessions = _FLEET_METRICS_SQL.replace("{sessions}", inner)
    return _DAILY_SQL.format(budget=FPS_BUDGET, low=FPS_LOW, sessions=sessions)


def _rolled_through(store) -> datetime | None:
    """The first day not rolled up (every day before it is in fleet_daily), or None."""
    from datetime import UTC

    r = store.query_rows("SELECT max(day), count() FROM fleet_daily_marks FINAL")
    if not r or not r[0][1]:
        return None
    return datetime.combine(r[0][0], datetime.min.time(), UTC) + timedelta(days=1)


def _daily_union(store, start: datetime, end: datetime, params: dict[str, Any], live: bool = False) -> str:
    """SQL of fleet_daily-shaped rows for sessions in [start, end): rolled-up days from fleet_daily,
    the rest (partial days at the edges, days not rolled yet) computed live from session_fleet
    (``live``: everything from session_stats)."""
    params.update({"start": start, "end": end, "min_s": MIN_STREAMED_S})
    if live:
        return _daily_sql(params, live_stats=True)
    through = _rolled_through(store)
    r_lo = day_floor(start) + (timedelta(days=1) if day_floor(start) < start else timedelta(0))
    r_hi = min(day_floor(end), through) if through else r_lo
    if r_hi <= r_lo:
        return _daily_sql(params)
    params.update({"r_lo": r_lo, "r_hi": r_hi})
    parts = [
        ("SELECT day, release, gpu_kind, sessions, n_le_24, n_le_23_5, fps_sum, late_chunks, chunks, energy_sum, "
        "fps_q, period_q FROM fleet_daily WHERE day >= toDate({r_lo:DateTime64(3, 'UTC')}) "
        "AND day < toDate({r_hi:DateTime64(3, 'UTC')}) AND (day, rolled_at) IN "
        "(SELECT day, rolled_at FROM fleet_daily_marks FINAL)")  # the latest roll of each day only
    ]
    if start < r_lo:
        parts.append(_daily_sql(params, "start", "r_lo"))
    if r_hi < end:
        parts.append(_daily_sql(params, "r_hi", "end"))
    return " UNION ALL ".join(f"({p})" for p in parts)


def fps_fractions(
    store, start: datetime, end: datetime, filters: dict[str, Any] | None = None, live: bool = False
) -> pl.DataFrame:
    """Per ISO week (Monday), release and GPU kind: sessions that streamed >= 1 s, how many averaged
    <= 24 fps and <= 23.5 fps, and the mean fps. The dashboard's fleet query.

    Days rolled up by ``rollup`` come from ``fleet_daily``; the rest is grouped per session live
    from ``session_stats``. ``live=True`` (or any cohort filter) computes everything live."""
    params: dict[str, Any] = {"start": start, "end": end, "min_s": MIN_STREAMED_S}
    if filters:
        source = session_sql(filters, params)
        sql = f"""
        SELECT toMonday(start_ts) AS week, release, gpu_kind, count() AS sessions,
               countIf(fps <= {FPS_BUDGET}) AS n_le_24, countIf(fps <= {FPS_LOW}) AS n_le_23_5,
               avg(fps) AS mean_fps
        FROM ({source}) WHERE streamed_s >= {{min_s:Float64}}
        GROUP BY week, release, gpu_kind ORDER BY week, release, gpu_kind
        """
        return store.query_df(sql, params)
    sql = f"""
    SELECT toMonday(day) AS week, release, gpu_kind, sum(n) AS sessions, sum(n_le_24) AS n_le_24,
           sum(n_le_23_5) AS n_le_23_5, sum(fps_sum) / sum(n) AS mean_fps
    FROM (SELECT *, sessions AS n FROM ({_daily_union(store, start, end, params, live)}))
    GROUP BY week, release, gpu_kind ORDER BY week, release, gpu_kind
    """
    return store.query_df(sql, params)


def release_distribution(store, start: datetime, end: datetime, live: bool = False) -> pl.DataFrame:
    """Per release and GPU kind: session count and quantiles (t-digest) of session fps and step period,
    late-chunk rate and energy per chunk. The dashboard's per-release distribution query."""
    params: dict[str, Any] = {}
    sql = f"""
    SELECT release, gpu_kind, sum(sessions) AS sessions,
           quantilesTDigestMerge(0.05, 0.5, 0.95)(fps_q) AS fps_q,
           quantilesTDigestMerge(0.5, 0.95, 0.99)(period_q) AS step_period_q,
           sum(late_chunks) / sum(chunks) AS late_rate, sum(energy_sum) / sum(chunks) AS energy_per_chunk_mj
    FROM ({_daily_union(store, start, end, params, live)})
    GROUP BY release, gpu_kind ORDER BY release, gpu_kind
    """
    return store.query_df(sql, params)


def rollup(store, now: datetime, full: bool = False) -> list[str]:
    """Roll finalized sessions of closed days (before ``now``'s day) into ``fleet_daily``: days never
    rolled, the last rolled day again (sessions that crossed midnight), and any day whose step count
    in session_fleet changed since it was rolled (late rows; the day before it too). Returns the days."""
    from datetime import UTC

    today = day_floor(now.astimezone(UTC))
    current = {
        d: n for d, n in store.query_rows(
            "SELECT toDate(hour) AS d, sum(steps) FROM session_fleet "
            "WHERE hour < {today:DateTime64(3, 'UTC')} GROUP BY d", {"today": today})
    }
    marks = {d: n for d, n in store.query_rows("SELECT day, steps_total FROM fleet_daily_marks FINAL")}
    todo = set(current) if full else {d for d in current if marks.get(d) != current[d]}
    todo |= {d - timedelta(days=1) for d in todo if d - timedelta(days=1) in current}
    if marks:
        last = max(marks)
        todo |= {last} if last in current else set()
    days = sorted(todo)
    # contiguous runs of days -> one INSERT ... SELECT each
    runs: list[list] = []
    for d in days:
        if runs and (d - runs[-1][-1]).days == 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    now_utc = datetime.now(UTC)
    for run in runs:
        lo = datetime.combine(run[0], datetime.min.time(), UTC)
        hi = datetime.combine(run[-1], datetime.min.time(), UTC) + timedelta(days=1)
        params: dict[str, Any] = {"start": lo, "end": hi, "min_s": MIN_STREAMED_S, "now": now_utc}
        store.command(
            "INSERT INTO fleet_daily SELECT *, {now:DateTime64(3, 'UTC')} AS rolled_at FROM (" + _daily_sql(params) + ")",
            parameters=params,
        )
    if days:
        rows = [[d, current[d], now_utc] for d in days]
        store.client().insert("fleet_daily_marks", rows, column_names=["day", "steps_total", "rolled_at"])
    return [d.isoformat() for d in days]


def release_first_seen(store, end: datetime) -> pl.DataFrame:
    """Each release with its first and last session start before ``end``, oldest first."""
    return store.query_df(
        "SELECT release, min(first_ts) AS first_seen, max(first_ts) AS last_seen FROM session_stats "
        "WHERE first_ts < {end:DateTime64(3, 'UTC')} GROUP BY release ORDER BY first_seen",
        {"end": end},
    )


_SHAPE_COLUMNS = tuple(dict.fromkeys(c for cols in records.SHAPE_KEYS.values() for c in cols))


def memory_sessions(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per session, for memory analysis: worker, release, start, the shape columns
    (``records.SHAPE_KEYS``, from the ``sessions`` table: null from older workers), the GPU's total
    memory the worker reported (null from older workers), peak reserved memory and buffer count (from
    ``session_stats``), switches."""
    params: dict[str, Any] = {"start": start, "end": end}
    sql = f"""
    SELECT s.release AS release, s.gpu_kind AS gpu_kind, s.worker_id AS worker_id, s.session_id AS session_id,
           s.start_ts AS start_ts, s.mem_reserved_max AS mem_reserved_max, s.buffers_max AS buffers_max,
           s.switch_state AS switch_state, {", ".join(f"t.{c} AS {c}" for c in _SHAPE_COLUMNS)},
           t.gpu_mem_total_bytes AS gpu_mem_total_bytes
    FROM ({_sessions_sql("")}) AS s
    INNER JOIN (
        SELECT session_id, {", ".join(f"any({c}) AS {c}" for c in _SHAPE_COLUMNS)},
               max(gpu_mem_total_bytes) AS gpu_mem_total_bytes
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


def fleet_shapes(store, gpu_kind: str, release: str | None = None, days: int = 30) -> list[tuple[str, int]]:
    """The (preset, TP size) pairs a GPU kind's workers ran sessions with over the last ``days`` (of a
    release when given): the shapes an evaluation must have been measured on to count for that kind
    (api/evaluation_gate.py)."""
    w = "gpu_kind = {k:String} AND ts >= now64(3) - toIntervalDay({d:UInt32})"
    params: dict = {"k": gpu_kind, "d": days}
    if release:
        w += " AND release = {r:String}"
        params["r"] = release
    rows = store.query_rows(f"SELECT DISTINCT shape, tp_size FROM sessions WHERE {w} ORDER BY shape, tp_size", params)
    return [(r[0], int(r[1])) for r in rows]
