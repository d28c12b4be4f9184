"""The read layer: every SELECT that reads the store, as typed functions (SQL -> polars / rows).

Routes, pages, reports, canaries, incidents, metrics and jobs call a function here and never write a
query (STYLE.md "Growing by addition"); DDL is sql/ + collector/migrations.py, ingest's writes (and
their own landed-row check) collector/store.py: the three modules that hold SQL. Per-session figures
derive from the metric catalogue (collector/catalog.py): its ``SESSION_COLUMNS`` and ``METRICS`` are the
per-session SELECT here, as its ``SESSION_STATES`` are the view that fills session_stats.

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

from dataclasses import dataclass
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


# -- optional filters as one parameterized WHERE clause ------------------------------------------------
# Every query of the form "rows of this, if given":
#     w = Where().eq("switch", switch).eq("changed", changed, "Bool").since("ts", start).until("ts", end)
#     store.query_df(f"SELECT ... FROM t WHERE {w}", w.params)        # "1" when no filter is given
#     store.query_df(w.page(COLUMNS, "t FINAL", "ts DESC"), w.params)   # a page: Where(limit=.., offset=..)
# A filter whose value is None (or an empty string) is left out; every value travels as a server-side
# parameter (``{name:Type}``), never in the SQL text. Time bounds are half-open: ``since`` inclusive,
# ``until`` exclusive, as every range in the API (api/routes/_common.py's ``TimeRange``).
_TS = "DateTime64(3, 'UTC')"


class Where:
    """The conjunction of the filters given so far, and their parameters (``params``)."""

    def __init__(self, **params: Any):
        self.parts: list[str] = []
        self.params: dict[str, Any] = dict(params)  # e.g. limit/offset, which the query uses too

    def _param(self, col: str, value: Any) -> str:
        name = f"w_{col}"
        i = 1
        while name in self.params:
            i += 1
            name = f"w_{col}_{i}"
        self.params[name] = value
        return name

    @staticmethod
    def _given(value: Any) -> bool:
        return value is not None and value != ""

    def eq(self, col: str, value: Any, type_: str = "String") -> Where:
        if self._given(value):
            self.parts.append(f"{col} = {{{self._param(col, value)}:{type_}}}")
        return self

    def any_of(self, col: str, values, type_: str = "String") -> Where:
        if values:
            self.parts.append(f"{col} IN {{{self._param(col, list(values))}:Array({type_})}}")
        return self

    def since(self, col: str, t) -> Where:
        if t is not None:
            self.parts.append(f"{col} >= {{{self._param(col, t)}:{_TS}}}")
        return self

    def until(self, col: str, t) -> Where:
        if t is not None:
            self.parts.append(f"{col} < {{{self._param(col, t)}:{_TS}}}")
        return self

    def overlapping(self, lo_col: str, hi_col: str, start, end) -> Where:
        """Rows whose interval [lo_col, hi_col) overlaps [start, end) (either bound may be None)."""
        if start is not None:
            self.parts.append(f"{hi_col} > {{{self._param(hi_col, start)}:{_TS}}}")
        if end is not None:
            self.parts.append(f"{lo_col} < {{{self._param(lo_col, end)}:{_TS}}}")
        return self

    def sql(self, text: str, **params: Any) -> Where:
        """A condition of the caller's own, with its parameters."""
        self.parts.append(text)
        self.params.update(params)
        return self

    def __str__(self) -> str:
        return " AND ".join(self.parts) if self.parts else "1"

    def page(self, columns, source: str, order: str) -> str:
        """``SELECT columns FROM source WHERE <these filters> ORDER BY order``, one page: the ``limit`` and
        ``offset`` this ``Where`` was made with."""
        return (f"SELECT {', '.join(columns)} FROM {source} WHERE {self} ORDER BY {order} "
                "LIMIT {limit:UInt32} OFFSET {offset:UInt32}")


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


def power_minutes(store, start: datetime, end: datetime, reasons: dict[str, int]) -> pl.DataFrame:
    """Per worker and minute in which it was stepping: its GPU samples (count, mean and max power, mean
    SM clock, mean temperature, the share of samples carrying each of ``reasons``: column name -> bit of
    the throttle-reasons mask) beside the median diffusion time of its non-reset steps that minute."""
    shares = ", ".join(f"avg(bitAnd(ifNull(throttle_reasons, 0), {int(bit)}) != 0) AS {name}"
                       for name, bit in reasons.items())
    sql = f"""
    SELECT g.worker_id AS worker_id, g.gpu_kind AS gpu_kind, g.release AS release, g.minute AS minute,
           g.samples AS samples, g.power_avg AS power_w, g.power_max AS power_max_w, g.clock_avg AS sm_clock_mhz,
           g.temp_avg AS temp_c, {", ".join(f"g.{n} AS {n}" for n in reasons)},
           st.steps AS steps, st.diffusion_med AS diffusion_ms
    FROM (
        SELECT worker_id, any(gpu_kind) AS gpu_kind, anyLast(release) AS release, toDateTime64(toStartOfMinute(ts), 3, 'UTC') AS minute,
               count() AS samples, avg(power_w) AS power_avg, max(power_w) AS power_max,
               avg(sm_clock_mhz) AS clock_avg, avg(temp_c) AS temp_avg, {shares}
        FROM gpu_samples
        WHERE ts >= {{start:DateTime64(3, 'UTC')}} AND ts < {{end:DateTime64(3, 'UTC')}}
        GROUP BY worker_id, minute
    ) AS g
    INNER JOIN (
        SELECT worker_id, toDateTime64(toStartOfMinute(ts), 3, 'UTC') AS minute, count() AS steps, median(diffusion_ms) AS diffusion_med
        FROM steps
        WHERE ts >= {{start:DateTime64(3, 'UTC')}} AND ts < {{end:DateTime64(3, 'UTC')}} AND NOT reset_step
        GROUP BY worker_id, minute
    ) AS st ON g.worker_id = st.worker_id AND g.minute = st.minute
    ORDER BY gpu_kind, worker_id, minute
    """
    return store.query_df(sql, {"start": start, "end": end})


def session_step_slopes(store, start: datetime, end: datetime, releases: list[str], min_steps: int) -> pl.DataFrame:
    """Per session of ``releases`` that started in [start, end) with ``min_steps`` ordinary (non-reset)
    steps or more: the least-squares slope of its ordinary steps' diffusion time on the step index
    (ms a step), their median, its last step, and its reset steps' median over the ordinary median (null
    without reset steps)."""
    sql = """
    SELECT release, any(gpu_kind) AS gpu_kind, any(worker_id) AS worker_id, session_id, min(ts) AS start_ts,
           countIf(NOT reset_step) AS steps, max(step) AS last_step,
           tupleElement(simpleLinearRegressionIf(toFloat64(step), diffusion_ms, NOT reset_step), 1) AS slope_ms_per_step,
           medianIf(diffusion_ms, NOT reset_step) AS step_ms,
           if(countIf(reset_step) > 0, medianIf(diffusion_ms, reset_step) / medianIf(diffusion_ms, NOT reset_step),
              NULL) AS reset_ratio
    FROM steps
    WHERE ts >= {start:DateTime64(3, 'UTC')} AND ts < {end:DateTime64(3, 'UTC')} AND release IN {rel:Array(String)}
    GROUP BY release, session_id
    HAVING steps >= {min_steps:UInt32} AND start_ts >= {start:DateTime64(3, 'UTC')}
    ORDER BY start_ts
    """
    return store.query_df(sql, {"start": start, "end": end, "rel": releases, "min_steps": min_steps})


def session_shapes(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per session recorded in [start, end): its shape columns (``records.SHAPE_KEYS``; null from older
    workers), to join to a per-session frame on ``session_id``."""
    return store.query_df(
        f"SELECT session_id, {', '.join(f'any({c}) AS {c}' for c in _SHAPE_COLUMNS)} FROM sessions "
        "WHERE ts >= {start:DateTime64(3, 'UTC')} AND ts < {end:DateTime64(3, 'UTC')} GROUP BY session_id",
        {"start": start, "end": end})


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


# -- releases, findings, one session's drill-down (the API's reads) ---------------------------------

def releases_in(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Releases with sessions that started in [start, end): first and last seen, distinct sessions."""
    return store.query_df(
        "SELECT release, min(first_ts) AS first_seen, max(last_ts) AS last_seen, uniqExact(session_id) AS sessions "
        "FROM session_stats WHERE first_ts >= {start:DateTime64(3, 'UTC')} AND first_ts < {end:DateTime64(3, 'UTC')} "
        "GROUP BY release ORDER BY first_seen", {"start": start, "end": end})


def metric_quantiles(store, start: datetime, end: datetime, metrics: list[str], levels: tuple[float, ...],
                     filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """Per release, for each per-session metric (catalog.METRICS) of sessions that started in [start, end)
    and streamed >= 1 s: ``<m>__n`` sessions with a finite value, ``<m>__mean``, ``<m>__q`` exact
    quantiles at ``levels`` (linear interpolation, as polars' "linear"). One row per release."""
    unknown = sorted(set(metrics) - set(catalog.METRICS_BY_NAME))
    if unknown:
        raise QueryError(f"unknown metric(s) {unknown}; valid metrics: {', '.join(catalog.METRICS_BY_NAME)}")
    params: dict[str, Any] = {"start": start, "end": end, "min_s": MIN_STREAMED_S}
    lv = ", ".join(repr(p) for p in levels)
    cols = []
    for m in metrics:
        ok = f"ifNull(isFinite({m}), 0)"
        cols.append(f"countIf({ok}) AS {m}__n, avgIf({m}, {ok}) AS {m}__mean, "
                    f"quantilesExactInclusiveIf({lv})({m}, {ok}) AS {m}__q")
    sql = (f"SELECT release, {', '.join(cols)} FROM ({session_sql(filters, params)}) "
           "WHERE streamed_s >= {min_s:Float64} GROUP BY release ORDER BY release")
    return store.query_df(sql, params)


FINDING_COLUMNS = ("kind", "scope", "metric", "window_start", "window_end", "baseline", "value", "effect",
                   "confidence", "severity", "status", "attribution", "evidence", "job", "first_seen", "updated_at")


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
    return store.query_df(w.page(FINDING_COLUMNS, "findings FINAL", "window_start DESC, kind, scope, metric"), w.params)


def session_first_forward(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per session whose start record is in [start - 1 day, end): its first-forward token count."""
    return store.query_df(
        "SELECT session_id, any(first_forward_tokens) AS first_forward_tokens FROM sessions "
        "WHERE ts >= {start:DateTime64(3, 'UTC')} - INTERVAL 1 DAY AND ts < {end:DateTime64(3, 'UTC')} "
        "GROUP BY session_id", {"start": start, "end": end})


# The drill-down's columns: the step record's own fields (collector/records.py), in wire order
STEP_COLUMNS: tuple[str, ...] = ("step", "ts") + tuple(
    c.name for c in records.columns("step") if c.name not in ("step", "ts", "simulated", *catalog.LABEL_KEYS))


def session_steps(store, session_id: str, limit: int = 100_000, offset: int = 0) -> pl.DataFrame:
    """One session's raw steps (``STEP_COLUMNS``), in step order: the session page's charts."""
    return store.query_df(
        f"SELECT {', '.join(STEP_COLUMNS)} FROM steps WHERE session_id = {{sid:String}} ORDER BY step, ts "
        "LIMIT {limit:UInt32} OFFSET {offset:UInt32}",
        {"sid": session_id, "limit": limit, "offset": offset},
    )


def session_step_page(store, session_id: str, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
    """A page of one session's stored step rows (every column), in step order, and the session's step count."""
    params = {"sid": session_id, "limit": limit, "offset": offset}
    total = store.query_rows("SELECT count() FROM steps WHERE session_id = {sid:String}", params)[0][0]
    if not total:
        return [], 0
    rows = store.query_arrow(
        "SELECT * FROM steps WHERE session_id = {sid:String} ORDER BY step, ts "
        "LIMIT {limit:UInt32} OFFSET {offset:UInt64}", params).to_pylist()
    return rows, total


def session_memory(store, session_id: str) -> pl.DataFrame:
    return store.query_df(
        "SELECT step, ts, mem_allocated_bytes, mem_reserved_bytes, buffers_registered FROM steps "
        "WHERE session_id = {sid:String} ORDER BY step, ts LIMIT 100000", {"sid": session_id})


def session_events(store, session_id: str, limit: int = 1000, offset: int = 0) -> pl.DataFrame:
    return store.query_df(
        "SELECT ts, kind, worker_id, release, gpu_kind, detail FROM events WHERE session_id = {sid:String} "
        "ORDER BY ts LIMIT {limit:UInt32} OFFSET {offset:UInt32}",
        {"sid": session_id, "limit": limit, "offset": offset},
    )


def session_known(store, session_id: str) -> bool:
    """The store has statistics or events of this session."""
    return bool(store.query_rows(
        "SELECT (SELECT count() FROM session_stats WHERE session_id = {sid:String}) + "
        "(SELECT count() FROM events WHERE session_id = {sid:String})", {"sid": session_id})[0][0])


def session_turns(store, session_id: str) -> pl.DataFrame:
    """One session's conversational turns, in order (the marks on its step chart)."""
    return store.query_df(
        "SELECT turn, step, ts, speaking, cond_tokens, policy, latency_ms, queue_ms, dropped_chunks, stall_ms "
        "FROM turns WHERE session_id = {sid:String} ORDER BY turn LIMIT 10000", {"sid": session_id})


def session_gpu_samples(store, session_id: str, limit: int = 20_000) -> pl.DataFrame:
    """One session's NVML samples, in time order."""
    return store.query_df(
        "SELECT ts, gpu_index, power_w, sm_clock_mhz, throttle_reasons, temp_c, mem_used_bytes FROM gpu_samples "
        "WHERE session_id = {sid:String} ORDER BY ts, gpu_index LIMIT {limit:UInt32}",
        {"sid": session_id, "limit": limit})


# -- the switch control plane: rules, audit, canaries, incidents, alert deliveries (api/) -------------
# Each table's columns, named once: the api's writers insert rows in this order.
RULE_COLUMNS = ["name", "scope", "cohort", "value", "active", "bucket_lo", "bucket_hi", "version", "actor",
                "reason", "updated_at", "source"]
AUDIT_COLUMNS = ["ts", "source", "action", "name", "scope", "cohort", "old_value", "new_value", "changed",
                 "version", "actor", "reason", "ref", "evidence"]
CANARY_COLUMNS = ["id", "name", "scope", "fraction", "bucket_lo", "bucket_hi", "min_sessions", "status", "started_at",
                  "decided_at", "actor", "reason", "evidence", "updated_at"]
INCIDENT_COLUMNS = ["id", "key", "kind", "scope", "release", "gpu_kind", "switch", "state", "severity", "summary",
                    "opened_at", "updated_at", "mitigated_at", "resolved_at", "lifted_at", "notified_at",
                    "notifications", "flips", "acted", "evidence_keys", "evidence", "evidence_at", "version"]


def switch_rules(store) -> list[tuple]:
    """Every switch rule's newest version (FINAL), as tuples in ``RULE_COLUMNS`` order."""
    return store.query_rows(f"SELECT {', '.join(RULE_COLUMNS)} FROM switch_rules FINAL")


def switch_rules_version(store) -> int:
    """The highest rule version ever written (0: none)."""
    return int(store.query_rows("SELECT max(version) FROM switch_rules")[0][0] or 0)


def switch_audit(store, *, name: str | None = None, source: str | None = None, changed: bool | None = None,
                 start: datetime | None = None, end: datetime | None = None, limit: int = 100,
                 offset: int = 0) -> pl.DataFrame:
    """Control-plane decisions (``AUDIT_COLUMNS``), newest first."""
    w = (Where(limit=limit, offset=offset).eq("name", name).eq("source", source).eq("changed", changed, "Bool")
         .since("ts", start).until("ts", end))
    return store.query_df(w.page(AUDIT_COLUMNS, "switch_audit", "ts DESC, version DESC"), w.params)


def audit_changes(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Decisions in [start, end) that changed a switch, and every canary decision, oldest first (the report)."""
    w = Where().since("ts", start).until("ts", end).sql("(changed OR action LIKE 'canary%')")
    cols = ", ".join(c for c in AUDIT_COLUMNS if c != "version")
    return store.query_df(f"SELECT {cols} FROM switch_audit WHERE {w} ORDER BY ts", w.params)


def applied_changes(store) -> list[tuple]:
    """(ts, name, scope, source, actor, reason) of every decision that changed a switch, oldest first."""
    return store.query_rows(
        "SELECT ts, name, scope, source, actor, reason FROM switch_audit WHERE changed ORDER BY ts") or []


def events_of_kinds(store, kinds: tuple[str, ...], start: datetime, end: datetime, limit: int = 5000) -> pl.DataFrame:
    """Events of these kinds in [start, end), oldest first."""
    return store.query_df(
        "SELECT ts, kind, worker_id, session_id, release, gpu_kind, detail FROM events "
        "WHERE kind IN {k:Array(String)} "
        "AND ts >= {s:DateTime64(3, 'UTC')} AND ts < {e:DateTime64(3, 'UTC')} ORDER BY ts LIMIT {limit:UInt32}",
        {"k": list(kinds), "s": start, "e": end, "limit": limit})


def canaries_frame(store, *, canary_id: str | None = None, status: str | None = None,
                   start: datetime | None = None, end: datetime | None = None,
                   limit: int = 100, offset: int = 0) -> pl.DataFrame:
    """Canaries (FINAL, ``CANARY_COLUMNS``), newest start first; ``start``/``end``: those running at some
    time in [start, end) (started before ``end``, not decided before ``start``)."""
    w = Where(limit=limit, offset=offset).eq("id", canary_id).eq("status", status).until("started_at", end)
    if start is not None:
        w.sql("(decided_at IS NULL OR decided_at >= {w_decided:DateTime64(3, 'UTC')})", w_decided=start)
    return store.query_df(w.page(CANARY_COLUMNS, "canaries FINAL", "started_at DESC"), w.params)


def workers_seen(store, start: datetime, end: datetime, scope: dict[str, str]) -> list[str]:
    """Workers with a session that started in [start, end) within ``scope`` (label -> value), sorted."""
    w = Where(s=start, e=end)
    for k, v in scope.items():
        if k not in catalog.LABEL_KEYS:
            raise QueryError(f"unknown scope key {k!r}; valid keys: {', '.join(catalog.LABEL_KEYS)}")
        w.eq(k, v)
    return [r[0] for r in store.query_rows(
        "SELECT DISTINCT worker_id FROM session_stats WHERE first_ts >= {s:DateTime64(3, 'UTC')} "
        f"AND first_ts < {{e:DateTime64(3, 'UTC')}} AND {w} ORDER BY worker_id", w.params)]


def open_findings(store, kinds: tuple[str, ...], severities: tuple[str, ...] = ("warning", "critical")) -> pl.DataFrame:
    """Open findings of these kinds and severities (FINAL): what the incident logic groups."""
    return store.query_df(
        "SELECT kind, scope, metric, window_start, window_end, baseline, value, effect, confidence, "
        "severity, status, attribution, evidence, first_seen FROM findings FINAL "
        "WHERE status = 'open' AND kind IN {k:Array(String)} AND severity IN {sev:Array(String)}",
        {"k": list(kinds), "sev": list(severities)})


def incidents_frame(store, *, state: str | None = None, kind: str | None = None, limit: int | None = None,
                    offset: int = 0) -> pl.DataFrame:
    """Incidents (FINAL, ``INCIDENT_COLUMNS``); ``state`` 'open' = every state but resolved. With ``limit``:
    not resolved first, then newest first, paged; without: every incident, unordered."""
    if limit is None:
        return store.query_df(f"SELECT {', '.join(INCIDENT_COLUMNS)} FROM incidents FINAL")
    w = Where(limit=limit, offset=offset).eq("kind", kind)
    if state == "open":
        w.sql("state != 'resolved'")
    else:
        w.eq("state", state)
    return store.query_df(w.page(INCIDENT_COLUMNS, "incidents FINAL", "state = 'resolved', updated_at DESC, id"), w.params)


def incidents_during(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Incidents opened before ``end`` that were not resolved before ``start`` (the weekly report)."""
    return store.query_df(
        "SELECT id, state, severity, kind, scope, switch, summary, opened_at, mitigated_at, resolved_at, flips, "
        "notifications FROM incidents FINAL WHERE opened_at < {e:DateTime64(3, 'UTC')} "
        "AND (resolved_at IS NULL OR resolved_at >= {s:DateTime64(3, 'UTC')}) ORDER BY opened_at, id",
        {"s": start, "e": end})


def incident_log_frame(store, incident: str | None = None, start: datetime | None = None,
                       end: datetime | None = None, limit: int = 1000) -> pl.DataFrame:
    w = Where(limit=limit).eq("incident_id", incident).since("ts", start).until("ts", end)
    return store.query_df(f"SELECT ts, incident_id, event, state, detail FROM incident_log WHERE {w} "
                          "ORDER BY ts, incident_id LIMIT {limit:UInt32}", w.params)


def alert_delivered(store, key: str) -> bool:
    """An alert delivery with this dedup key was recorded (a replay)."""
    return bool(store.query_rows("SELECT count() FROM alert_deliveries WHERE dedup_key = {k:String}", {"k": key})[0][0])


# -- the service's own state, for Prometheus (api/metrics.py): name -> SQL (each reads the one table after FROM)
STATE_QUERIES: dict[str, str] = {
    "findings": "SELECT kind, severity, count() FROM findings FINAL WHERE status = 'open' GROUP BY kind, severity",
    "critical": "SELECT kind, attribution, scope, count() FROM findings FINAL "
                "WHERE status = 'open' AND severity = 'critical' GROUP BY kind, attribution, scope",
    "jobs": "SELECT job, count(), countIf(status = 'failed'), "
            "toUnixTimestamp64Milli(maxIf(finished_at, status = 'ok')) / 1000 FROM job_runs GROUP BY job",
    "rules": "SELECT name, value, count() FROM switch_rules FINAL WHERE active GROUP BY name, value",
    "webhook": "SELECT action, count() FROM switch_audit WHERE source = 'alert' GROUP BY action",
    # per release: first session start (its rollout) and the switch states its sessions started with
    "releases": "SELECT release, toUnixTimestamp64Milli(min(ts)) / 1000 AS rollout, groupUniqArray(switches), "
                "groupUniqArray(gpu_kind) FROM sessions WHERE phase = 'start' GROUP BY release "
                "ORDER BY rollout DESC LIMIT 50",
    # incidents (api/incidents.py, where its table exists): open until resolved
    "incidents": "SELECT kind, severity, state, count() FROM incidents FINAL WHERE state != 'resolved' "
                 "GROUP BY kind, severity, state",
    "incidents_critical": "SELECT kind, switch, release, gpu_kind, count() FROM incidents FINAL "
                          "WHERE state != 'resolved' AND severity = 'critical' GROUP BY kind, switch, release, gpu_kind",
}
STATE_TABLES: dict[str, str] = {name: sql.split(" FROM ", 1)[1].split()[0] for name, sql in STATE_QUERIES.items()}


def tables(store) -> set[str]:
    """The tables of the store's database."""
    return {r[0] for r in store.query_rows("SELECT name FROM system.tables WHERE database = currentDatabase()")}


def state_rows(store, name: str) -> list[tuple]:
    """The rows of one of ``STATE_QUERIES``."""
    return store.query_rows(STATE_QUERIES[name])


# -- fleet series over time (the dashboard's and Grafana's charts, api/timeseries.py) -------------------
# A ``Series`` is SQL aggregates over fleet_daily-shaped rows (one per day, release and GPU kind of
# sessions that streamed >= 1 s: the roll-up of closed days plus the live view for the rest).

@dataclass(frozen=True)
class Series:
    name: str
    title: str
    unit: str  # api/dashboard.py's human(): "ms", "ratio", "fps", "count"
    select: str  # aggregates over fleet_daily-shaped rows, each "AS <column>"
    columns: tuple[str, ...]  # the plotted columns (one line per release and column)
    threshold: float | None = None  # drawn as a line (the deadline)
    threshold_label: str = ""


SERIES: tuple[Series, ...] = (
    Series("step_period", "session step period, p50 and p99 of sessions per day", "ms",
           "arrayElement(quantilesTDigestMerge(0.5, 0.95, 0.99)(period_q), 1) AS p50, "
           "arrayElement(quantilesTDigestMerge(0.5, 0.95, 0.99)(period_q), 3) AS p99",
           ("p50", "p99"), catalog.CHUNK_DEADLINE_MS, "deadline 166.7 ms"),
    Series("late_chunks", "late chunks (share of chunks delivered after their deadline)", "ratio",
           "sum(late_chunks) / greatest(sum(chunks), 1) AS late_share, sum(late_chunks) AS late", ("late_share",)),
    Series("fps_fractions", "sessions at or below 24 fps and at or below 23.5 fps, per day", "ratio",
           "sum(n_le_24) / greatest(sum(sessions), 1) AS le_24fps, "
           "sum(n_le_23_5) / greatest(sum(sessions), 1) AS le_23_5fps, sum(sessions) AS session_count",
           ("le_24fps", "le_23_5fps")),
)
SERIES_BY_NAME = {s.name: s for s in SERIES}


def series_sql(s: Series, source: str, where: str = "") -> str:
    """The series over ``source`` (SQL of fleet_daily-shaped rows), per day and release."""
    return (f"SELECT day, release, {s.select} FROM ({source}) {('WHERE ' + where) if where else ''} "
            "GROUP BY day, release ORDER BY day, release")


def series_frame(store, s: Series, start: datetime, end: datetime, gpu_kind: str | None = None,
                 releases: list[str] | None = None) -> pl.DataFrame:
    """One fleet series per day and release over [start, end) (rolled-up days plus the live rest)."""
    params: dict[str, Any] = {}
    source = _daily_union(store, start, end, params)
    w = Where(**params).eq("gpu_kind", gpu_kind).any_of("release", releases)
    return store.query_df(series_sql(s, source, str(w)), w.params)


def series_time_sql(s: Series, source: str, where: str = "", columns: tuple[str, ...] | None = None) -> str:
    """The series over ``source`` with its day as ``time`` (Grafana's panels, api/grafana.py)."""
    return (f"SELECT day AS time, release, {', '.join(columns or s.columns)} FROM "
            f"({series_sql(s, source, where)}) ORDER BY time")


def live_source() -> str:
    """The fleet_daily-shaped rows computed live from the session_fleet view, with ``{start:...}`` /
    ``{end:...}`` / ``{min_s:...}`` parameters (what Grafana runs, its macros substituted)."""
    return _daily_sql({})


# Each returns (time, text) for one kind of mark in [{s}, {e}) (api/grafana.py's annotations are these).
_T = "{s:DateTime64(3, 'UTC')}", "{e:DateTime64(3, 'UTC')}"
_INCIDENT = "concat(kind, ' ', scope, if(switch = '', '', concat(' (', switch, ')')))"
ANNOTATION_SQL: dict[str, str] = {
    "rollout": "SELECT min(first_ts) AS time, concat('rollout ', release) AS text FROM session_stats "
               f"GROUP BY release HAVING time >= {_T[0]} AND time < {_T[1]} ORDER BY time LIMIT 200",
    "switch": "SELECT ts AS time, concat(name, ' ', if(isNull(new_value), 'cleared', if(new_value, 'on', 'off')), "
              "' (', if(scope = '', 'fleet', scope), ') by ', actor) AS text FROM switch_audit "
              f"WHERE changed AND cohort = '' AND ts >= {_T[0]} AND ts < {_T[1]} ORDER BY ts LIMIT 200",
    # incidents (api/incidents.py): opened, and resolved
    "incident_open": f"SELECT opened_at AS time, concat('incident opened: ', {_INCIDENT}) AS text FROM incidents "
                     f"FINAL WHERE opened_at >= {_T[0]} AND opened_at < {_T[1]} ORDER BY time LIMIT 200",
    "incident_close": f"SELECT assumeNotNull(resolved_at) AS time, concat('incident closed: ', {_INCIDENT}) AS text "
                      f"FROM incidents FINAL WHERE resolved_at IS NOT NULL AND resolved_at >= {_T[0]} "
                      f"AND resolved_at < {_T[1]} ORDER BY time LIMIT 200",
}


def annotation_rows(store, kind: str, start: datetime, end: datetime) -> list[tuple]:
    """(time, text) of one kind of ``ANNOTATION_SQL`` mark in [start, end), oldest first."""
    return store.query_rows(ANNOTATION_SQL[kind], {"s": start, "e": end})


# -- evaluations (``livestep evaluate``'s records; api/routes/evaluations.py, api/evaluation_gate.py) ----
EVALUATION_COLUMNS = ("session_id", "ts", "release", "gpu_kind", "worker_id", "switch", "configuration", "preset",
                      "metric", "value", "band_lo", "band_hi", "verdict", "n", "step")


def evaluation_rows(store, *, switch=None, gpu_kind=None, release=None, metric=None, verdict=None, evaluation_id=None,
                    start=None, end=None, metrics: tuple[str, ...] = (), limit: int = 100,
                    offset: int = 0) -> list[dict[str, Any]]:
    """Evaluation rows, newest first then by step (the dashboard and the weekly report read these);
    ``metrics``: only these. ``evaluation_id`` is the row's session_id; ``ts`` an ISO string."""
    w = Where(limit=limit, offset=offset).any_of("metric", metrics)
    for col, v in (("switch", switch), ("gpu_kind", gpu_kind), ("release", release), ("metric", metric),
                   ("verdict", verdict), ("session_id", evaluation_id)):
        w.eq(col, v)
    w.since("ts", start).until("ts", end)
    rows = store.query_rows(w.page(EVALUATION_COLUMNS, "evaluations", "ts DESC, switch, metric, step"), w.params)
    out = []
    for r in rows:
        d = dict(zip(EVALUATION_COLUMNS, r, strict=True))
        d["evaluation_id"] = d.pop("session_id")
        d["ts"] = d["ts"].isoformat()
        out.append(d)
    return out


_LATEST_VERDICTS_SQL = """
SELECT switch, gpu_kind, release, argMax(verdict, ts) AS latest_verdict,
       argMax(session_id, ts) AS evaluation_id, max(ts) AS latest_ts, argMax(preset, ts) AS latest_preset,
       argMax(configuration, ts) AS latest_configuration, argMax(evaluator, ts), argMax(device_type, ts),
       argMax(tp, ts), argMax(steps, ts), argMax(seeds, ts), argMax(reruns, ts)
FROM evaluations
WHERE metric = 'overall' AND verdict != 'incomplete' AND evaluator IS NOT NULL AND evaluator != '' AND {where}
GROUP BY switch, gpu_kind, release
ORDER BY switch, gpu_kind, release"""


def latest_verdicts(store, switch: str | None = None, gpu_kind: str | None = None,
                    release: str | None = None) -> list[tuple]:
    """(switch, gpu_kind, release, verdict, evaluation_id, ts, preset, configuration, evaluator, device_type,
    tp, steps, seeds, reruns) of the newest complete overall verdict per switch, GPU kind and release that an
    evaluator posted (rows without one are never evidence), filtered by what is given."""
    w = Where().eq("switch", switch).eq("gpu_kind", gpu_kind).eq("release", release)
    return store.query_rows(_LATEST_VERDICTS_SQL.format(where=w), w.params)


def release_gpu_kinds(store, release: str, days: int = 30) -> list[str]:
    """The GPU kinds a release ran sessions on over the last ``days``, and those it has evaluations for."""
    rows = store.query_rows(
        "SELECT DISTINCT gpu_kind FROM session_stats WHERE release = {r:String} "
        "AND first_ts >= now64(3) - toIntervalDay({d:UInt32}) "
        "UNION DISTINCT SELECT DISTINCT gpu_kind FROM evaluations WHERE release = {r:String} AND metric = 'overall'",
        {"r": release, "d": days})
    return sorted(r[0] for r in rows)


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


# -- counts the demo and the CLI print -------------------------------------------------------------------

def stored_counts(store, session_id: str, kinds: tuple[str, ...]) -> dict[str, int]:
    """Rows of one session stored per record kind (collector/records.py's tables)."""
    sql = " UNION ALL ".join(
        f"SELECT '{kind}' AS kind, count() AS n FROM {records.TABLES[kind]} WHERE session_id = {{s:String}}"
        for kind in kinds)
    return {k: int(n) for k, n in store.query_rows(sql, {"s": session_id})}


def step_count(store, *, simulated: bool | None = None, worker_id: str | None = None) -> int:
    """Stored steps, of simulated (or real) sessions, of one worker, as given."""
    w = Where().eq("simulated", simulated, "Bool").eq("worker_id", worker_id)
    return store.query_rows(f"SELECT count() FROM steps WHERE {w}", w.params)[0][0]


def session_row(store, session_id: str) -> dict[str, Any] | None:
    """One session's finalized figures (the session SELECT with the listing's detail columns), or None."""
    params: dict[str, Any] = {}
    rows = store.query_arrow(session_sql({"session_id": session_id}, params, window="overlap", detail=True),
                             params).to_pylist()
    return rows[0] if rows else None


# -- FP8 saturation per session and per release x GPU kind (analytics/saturation.py) ---------------------
_SATURATION_COLUMNS = ", ".join(
    f"{c.sql} AS {c.name}" for c in (*(c for c in catalog.SESSION_COLUMNS if c.name in ("start_ts", "end_ts", "steps")),
                                     *catalog.FP8_COLUMNS,
                                     *(c for c in catalog.SESSION_COLUMNS if c.name == "switch_state")))
_SATURATION_SQL = f"""
SELECT {_LABELS}, {_SATURATION_COLUMNS}
FROM session_stats
WHERE first_ts >= {{start:DateTime64(3, 'UTC')}} - INTERVAL 1 DAY AND first_ts < {{end:DateTime64(3, 'UTC')}} {{filters}}
GROUP BY {_LABELS}
HAVING start_ts >= {{start:DateTime64(3, 'UTC')}} AND start_ts < {{end:DateTime64(3, 'UTC')}} AND sampled_steps > 0
"""

# saturation.count_sessions in ClickHouse: one row per release x gpu_kind over the per-session rows
# (quantile as polars' "linear": R-7, quantileExactInclusive)
_SATURATION_GROUPS_SQL = """
SELECT release, gpu_kind,
       count()                                   AS sessions,
       countIf(s_sat)                            AS saturating,
       quantileExactInclusive(0.95)(s_max)       AS sat_p95,
       max(s_max)                                AS sat_max,
       sum(s_sampled)                            AS sampled_steps,
       sum(s_sat_steps)                          AS saturating_steps,
       countIf(s_sat AND s_static > 0)           AS static_saturating,
       uniqExactIf(worker_id, s_sat)             AS saturating_workers,
       min(s_start)                              AS start_ts,
       max(s_end)                                AS end_ts
FROM (SELECT release, gpu_kind, worker_id, ifNull(sat_max, 0) AS s_max, s_max > {tolerance:Float64} AS s_sat,
             sampled_steps AS s_sampled, saturating_steps AS s_sat_steps, static_steps AS s_static,
             start_ts AS s_start, end_ts AS s_end
      FROM ({sessions}))
GROUP BY release, gpu_kind
ORDER BY release, gpu_kind
"""


def _saturation_sql(start: datetime, end: datetime, release: str | None, gpu_kind: str | None) -> tuple[str, dict]:
    params: dict[str, Any] = {"start": start, "end": end}
    filters = ""
    for key, value in (("release", release), ("gpu_kind", gpu_kind)):
        if value:
            filters += f" AND {key} = {{{key}:String}}"
            params[key] = value
    return _SATURATION_SQL.replace("{filters}", filters), params


def saturation_sessions(store, start: datetime, end: datetime, release: str | None = None,
                        gpu_kind: str | None = None) -> pl.DataFrame:
    """Sessions that started in [start, end) with at least one sampled step: counts, max and mean fraction."""
    sql, params = _saturation_sql(start, end, release, gpu_kind)
    return store.query_df(sql + "ORDER BY release, gpu_kind, start_ts", params)


def saturation_groups(store, start: datetime, end: datetime, release: str | None = None,
                      gpu_kind: str | None = None, *, tolerance: float) -> pl.DataFrame:
    """``saturation_sessions`` counted per release x gpu_kind in ClickHouse (one row per group back)."""
    sql, params = _saturation_sql(start, end, release, gpu_kind)
    return store.query_df(_SATURATION_GROUPS_SQL.replace("{sessions}", sql), {**params, "tolerance": tolerance})


# -- conversational turns (analytics/turns.py; worker/turns.py sends them) -------------------------------
TURN_FILTER_KEYS: tuple[str, ...] = ("release", "gpu_kind", "worker_id", "session_id", "policy")


class TurnQueryError(QueryError, ValueError):
    """A turn query that cannot be answered; the message lists what is valid."""


def _turn_filters(filters: dict[str, Any] | None, params: dict[str, Any]) -> str:
    out = []
    for i, (key, value) in enumerate(sorted((filters or {}).items())):
        if key not in TURN_FILTER_KEYS:
            raise TurnQueryError(f"unknown turn filter {key!r}; valid filters: {', '.join(TURN_FILTER_KEYS)}")
        params[f"t{i}"] = [value] if isinstance(value, str) else [str(v) for v in value]
        out.append(f"AND {key} IN {{t{i}:Array(String)}}")
    return " ".join(out)


def _turn_medians(parts: tuple[str, ...]) -> str:
    return ",\n".join(
        f"arrayElement(quantilesTDigestMerge(0.5, 0.95, 0.99)({p}_q), 1) AS {p}_ms" for p in ("latency", *parts))


def turn_sessions(store, start: datetime, end: datetime, parts: tuple[str, ...],
                  filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """One row per session with turns that began in [start, end), from ``turn_stats``: labels, policy,
    turns, stalled turns, and each part's and the latency's median (``<part>_ms``)."""
    params: dict[str, Any] = {"start": start, "end": end}
    where = _turn_filters(filters, params)
    sql = f"""
SELECT release, gpu_kind, worker_id, session_id, min(first_ts) AS start_ts, anyLast(policy) AS policy,
    countMerge(turns) AS turns, countIfMerge(stalled_turns) AS stalled_turns,
    sumMerge(dropped_chunks) AS dropped_chunks,
    {_turn_medians(parts)}
FROM turn_stats
WHERE first_ts >= {{start:DateTime64(3, 'UTC')}} AND first_ts < {{end:DateTime64(3, 'UTC')}} {where}
GROUP BY release, gpu_kind, worker_id, session_id
ORDER BY start_ts"""
    return store.query_df(sql, params)


def turn_rows(store, start: datetime, end: datetime, parts: tuple[str, ...],
              filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """Raw turns that arrived in [start, end): labels, policy, latency and its parts (``<part>_ms``)."""
    params: dict[str, Any] = {"start": start, "end": end}
    where = _turn_filters(filters, params)
    cols = ", ".join(f"{p}_ms" for p in parts)
    return store.query_df(
        f"SELECT release, gpu_kind, session_id, ts, policy, speaking, cond_tokens, latency_ms, {cols}, stall_ms "
        "FROM turns WHERE ts >= {start:DateTime64(3, 'UTC')} AND ts < {end:DateTime64(3, 'UTC')} "
        f"{where} ORDER BY ts",
        params,
    )


def turn_stage_medians(store, start: datetime, end: datetime, parts: tuple[str, ...]) -> pl.DataFrame:
    """Per release x GPU kind x policy: turns, stalled turns and the median of each part and the latency."""
    return store.query_df(
        f"SELECT release, gpu_kind, policy, countMerge(turns) AS turns, countIfMerge(stalled_turns) AS stalled,"
        f" {_turn_medians(parts)} FROM turn_stats "
        "WHERE first_ts >= {start:DateTime64(3, 'UTC')} AND first_ts < {end:DateTime64(3, 'UTC')} "
        "GROUP BY release, gpu_kind, policy ORDER BY release, gpu_kind, policy",
        {"start": start, "end": end},
    )


def turn_stage_means(store, start: datetime, end: datetime, parts: tuple[str, ...]) -> pl.DataFrame:
    """Per release x GPU kind x policy: turns, the mean of each part and of the latency (means of parts
    that add up per turn add up), and the latency's median; from the turns of the window."""
    means = ", ".join(f"avg(t.{p}_ms) AS {p}_ms" for p in ("latency", *parts))  # t.: the column, not the alias
    return store.query_df(
        f"SELECT release, gpu_kind, policy, count() AS turns, {means}, quantile(0.5)(t.latency_ms) AS latency_p50_ms "
        "FROM turns AS t WHERE ts >= {start:DateTime64(3, 'UTC')} AND ts < {end:DateTime64(3, 'UTC')} "
        "GROUP BY release, gpu_kind, policy ORDER BY release, gpu_kind, policy",
        {"start": start, "end": end},
    )


# -- findings and job runs, as the analytics read them back --------------------------------------------

def read_findings(store, kind: str | None = None, job: str | None = None, status: str | None = None) -> pl.DataFrame:
    """The newest version of every finding (FINAL, every column), optionally of one kind / job / status."""
    w = Where().eq("kind", kind).eq("job", job).eq("status", status)
    return store.query_df(f"SELECT * FROM findings FINAL WHERE {w} ORDER BY kind, scope, metric, window_start",
                          w.params)


def job_runs(store, job: str | None = None) -> pl.DataFrame:
    """Recorded job runs, newest first."""
    w = Where().eq("job", job)
    return store.query_df(f"SELECT * FROM job_runs WHERE {w} ORDER BY started_at DESC", w.params)


def flip_costs(store, start: datetime, end: datetime, switch: str | None = None,
               filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """The ``flip_cost`` events in [start, end) (collector/flip_fields.py), one row per flip and switch it
    changed (``switch``, ``value``: the new value), newest first; ``switch`` keeps that switch's rows, ``filters``
    are label filters (``FILTER_KEYS`` but ``switches``). A session-start build (no switch changed) has no row."""
    params: dict[str, Any] = {"start": start, "end": end, "k": records.FLIP_COST_KIND}
    where, _ = filter_clause({k: v for k, v in (filters or {}).items() if k != "switches"}, params)
    if switch is not None:
        params["sw"] = switch
        where += " AND kv.1 = {sw:String}"
    return store.query_df(
        "SELECT worker_id, session_id, release, gpu_kind, ts, kv.1 AS switch, kv.2 AS value, "
        "JSONExtractString(detail, 'mode') AS mode, JSONExtractInt(detail, 'step') AS step, "
        "JSONExtract(detail, 'applied_step', 'Nullable(Int64)') AS applied_step, "
        "JSONExtractInt(detail, 'late_chunks') AS late_chunks, JSONExtractFloat(detail, 'stall_ms') AS stall_ms, "
        "JSONExtractInt(detail, 'steps_observed') AS steps_observed, "
        "JSONExtract(detail, 'to_new_config_ms', 'Nullable(Float64)') AS to_new_config_ms, "
        "JSONExtract(detail, 'build_ms', 'Nullable(Float64)') AS build_ms, "
        "JSONExtract(detail, 'apply_ms', 'Nullable(Float64)') AS apply_ms, "
        "JSONExtract(detail, 'out_of_service_ms', 'Nullable(Float64)') AS out_of_service_ms, "
        "JSONExtract(detail, 'error', 'Nullable(String)') AS error "
        "FROM events ARRAY JOIN JSONExtractKeysAndValues(detail, 'changed', 'Bool') AS kv "
        "WHERE kind = {k:String} AND ts >= {start:DateTime64(3, 'UTC')} AND ts < {end:DateTime64(3, 'UTC')}"
        f" {where} ORDER BY ts DESC, worker_id, switch",
        params,
    )


# -- what the Grafana dashboard adds to the pages' series (api/grafana.py; the plugin's macros in place) -----

def label_values_sql(label: str) -> str:
    """A dashboard variable's values: every ``release`` or ``gpu_kind`` seen in sessions."""
    if label not in ("release", "gpu_kind"):
        raise ValueError(f"no variable for {label!r}; valid: release, gpu_kind")
    return f"SELECT DISTINCT {label} FROM session_fleet ORDER BY {label}"


GRAFANA_TABLES = {  # panel title -> SQL; $release / $gpu_kind are the dashboard's variables
    "open findings": "SELECT kind, severity, scope, metric, value, attribution AS switch, first_seen FROM findings FINAL "
                     "WHERE status = 'open' AND severity IN ('warning', 'critical') ORDER BY severity, first_seen DESC",
    "active switch rules": "SELECT name AS switch, if(value, 'on', 'off') AS value, scope, cohort, actor, reason, "
                           "updated_at FROM switch_rules FINAL WHERE active ORDER BY updated_at DESC",
}
TURN_LATENCY_SQL = ("SELECT $__timeInterval(ts) AS time, release, quantile(0.5)(latency_ms) AS p50, "
                    "quantile(0.95)(latency_ms) AS p95 FROM turns WHERE ts >= $__fromTime AND ts < $__toTime "
                    "AND release IN (${release:singlequote}) AND gpu_kind IN (${gpu_kind:singlequote}) "
                    "GROUP BY time, release ORDER BY time")


def turn_releases(store) -> list[str]:
    """Every release that has turn records (a release can have turns and no session statistics yet)."""
    return [r[0] for r in store.query_rows("SELECT DISTINCT release FROM turns ORDER BY release")]
