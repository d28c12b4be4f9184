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

import polars as pl

from analytics import queries as aq
from collector import catalog

DEADLINE_MS = catalog.CHUNK_DEADLINE_MS  # one 4-frame chunk at 24 fps: 166.7 ms


# The fleet series and the annotation queries are the read layer's (SQL text lives there); named here
# too, as the dashboard and Grafana read them from this module.
Series, SERIES, SERIES_BY_NAME = aq.Series, aq.SERIES, aq.SERIES_BY_NAME
series_sql, series_frame, live_source = aq.series_sql, aq.series_frame, aq.live_source
ANNOTATION_SQL = aq.ANNOTATION_SQL


# -- what happened, to read the series against -----------------------------------------------------

@dataclass(frozen=True)
class Mark:
    ts: datetime
    kind: str  # rollout | switch | incident_open | incident_close
    text: str


def releases_by_rollout(store, end: datetime) -> list[tuple[str, datetime]]:
    """Every release with its first session before ``end``, oldest first (rollout order, not names)."""
    df = aq.release_first_seen(store, end)
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


def annotations(store, start: datetime, end: datetime, releases: list[str] | None = None) -> list[Mark]:
    """Release rollouts, switch changes (applied decisions of the control plane) and incidents opened /
    closed in [start, end) (``releases``: only their rollouts)."""
    marks = []
    for kind in ANNOTATION_SQL:
        for t, text in aq.annotation_rows(store, kind, start, end):
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
