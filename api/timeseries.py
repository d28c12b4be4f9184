"""Fleet figures over time and the events to read them against: one declaration for the dashboard pages
(api/routes/dashboard.py) and the Grafana dashboard (api/grafana.py, deploy/grafana/livestep.json).

    for s in SERIES: df = series_frame(store, s, start, end, gpu_kind="h200")   # day, release, s.columns
    marks = annotations(store, start, end)      # release rollouts, switch changes, incidents opened/closed
    releases_by_rollout(store, end)             # oldest first: the default baseline is the one before the last

A ``Series`` is SQL aggregates over fleet_daily-shaped rows (one per day, release and GPU kind of
sessions that streamed >= 1 s: analytics/queries.py's roll-up of closed days plus the live view for the
rest). The dashboard reads the roll-up; Grafana reads the live view with its time macros, the same
SQL with ``{start}``/``{end}`` bound by the datasource.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import polars as pl

from collector import catalog
from collector.where import Where

DEADLINE_MS = catalog.CHUNK_DEADLINE_MS  # one 4-frame chunk at 24 fps: 166.7 ms


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
           ("p50", "p99"), DEADLINE_MS, "deadline 166.7 ms"),
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
    from analytics.queries import _daily_union

    params: dict[str, Any] = {}
    source = _daily_union(store, start, end, params)
    w = Where(**params).eq("gpu_kind", gpu_kind).any_of("release", releases)
    return store.query_df(series_sql(s, source, str(w)), w.params)


def live_source() -> str:
    """The fleet_daily-shaped rows computed live from the session_fleet view, with ``{start:...}`` /
    ``{end:...}`` / ``{min_s:...}`` parameters (what Grafana runs, its macros substituted)."""
    from analytics.queries import _daily_sql

    return _daily_sql({})


# -- what happened, to read the series against -----------------------------------------------------

@dataclass(frozen=True)
class Mark:
    ts: datetime
    kind: str  # rollout | switch | incident_open | incident_close
    text: str


def releases_by_rollout(store, end: datetime) -> list[tuple[str, datetime]]:
    """Every release with its first session before ``end``, oldest first (rollout order, not names)."""
    from analytics.queries import release_first_seen

    df = release_first_seen(store, end)
    return list(zip(df["release"].to_list(), map(_utc, df["first_seen"].to_list()), strict=True)) if df.height else []


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def default_pair(store, end: datetime, seen: list[str]) -> tuple[str | None, str | None]:
    """(baseline, candidate): the newest release by rollout among ``seen`` and the one rolled out before it."""
    order = [r for r, _ in releases_by_rollout(store, end) if r in set(seen)]
    order += sorted(set(seen) - set(order))
    if not order:
        return None, None
    return (order[-2] if len(order) >= 2 else None), order[-1]


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


def annotations(store, start: datetime, end: datetime, releases: list[str] | None = None) -> list[Mark]:
    """Release rollouts, switch changes (applied decisions of the control plane) and incidents opened /
    closed in [start, end) (``releases``: only their rollouts)."""
    marks = []
    for kind, sql in ANNOTATION_SQL.items():
        for t, text in store.query_rows(sql, {"s": start, "e": end}):
            if kind == "rollout" and releases and text.removeprefix("rollout ") not in releases:
                continue
            marks.append(Mark(_utc(t), kind, text))
    return sorted(marks, key=lambda m: m.ts)


def session_switch_changes(steps: pl.DataFrame) -> list[tuple[int, str]]:
    """(step, "switches now ...") where a session's recorded switch state changes from the step before."""
    if steps.height == 0:
        return []
    out, prev = [], None
    for step, state in zip(steps["step"].to_list(), steps["switches"].to_list(), strict=True):
        if prev is not None and state != prev:
            was, now = set(filter(None, prev.split(","))), set(filter(None, state.split(",")))
            parts = [f"+{s}" for s in sorted(now - was)] + [f"-{s}" for s in sorted(was - now)]
            out.append((step, " ".join(parts)))
        prev = state
    return out


# NVML clock event (throttle) reason bits (nvmlClocksEventReason*), as the gpu_sample records carry them
THROTTLE_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                    0x100: "display_clock"}


def throttle_names(bits: int | None) -> str:
    """The NVML reason bitmask as names ("" when none; idle alone is not a slowdown but is named)."""
    if not bits:
        return ""
    names = [n for b, n in THROTTLE_REASONS.items() if bits & b]
    rest = bits & ~sum(THROTTLE_REASONS)
    return ",".join(names + ([hex(rest)] if rest else []))


def session_gpu_samples(store, session_id: str, limit: int = 20_000) -> pl.DataFrame:
    return store.query_df(
        "SELECT ts, gpu_index, power_w, sm_clock_mhz, throttle_reasons, temp_c, mem_used_bytes FROM gpu_samples "
        "WHERE session_id = {sid:String} ORDER BY ts, gpu_index LIMIT {limit:UInt32}",
        {"sid": session_id, "limit": limit})
