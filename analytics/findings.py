"""Findings rows: build them, write them so a re-run replaces (never duplicates), read them back.

    f = finding("regression", {"release": "v1.3", "gpu_kind": "h100"}, "step_period_ms", start, end,
                value=262.0, baseline=159.0, effect=0.65, confidence=0.999, severity="critical")
    write_findings(store, "regressions", start, end, [f, ...])   # replaces this job's rows in the window
    df = read_findings(store, kind="regression")                 # FINAL, newest version of each key

The table (sql/010_findings.sql) is a ReplacingMergeTree keyed by (kind, scope, metric,
window_start): a re-run writes a newer version of each key. Rows this job wrote earlier for the same
window (or the same kind/scope/metric) that the re-run no longer finds are written back as
``status='resolved'``, so a finding that went away does not stay open; for ``WINDOWED_KINDS`` (a week's
fps shares) a later window resolves an earlier one only when it shows the problem fixed (severity info). ``first_seen`` is kept per
key; for the kinds in ``CONTINUING_KINDS`` (keyed by the day they were judged) a new key carries the
``first_seen`` of the open finding of the same kind/scope/metric it replaces, so a problem that lasts
a week reads a week old instead of starting again every midnight.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

import polars as pl
import pyarrow as pa

from analytics import queries
from analytics.stats import canonical_scope

# Every finding kind, and whether its open warning/critical findings open an incident (api/incidents.py
# groups them by root cause): fleet fps shares are a weekly report's fact, a canary decides itself, a
# variance note is always info; a power cap is a condition of the hardware that an operator must see.
OPENS_INCIDENT: dict[str, bool] = {
    "fps_fraction": False, "memory_growth": True, "regression": True, "changepoint": True, "canary": False,
    "fp8_saturation": True, "drift": True, "variance": False, "power": True,
    "flip_cost": False,  # a flip that hurt sessions is shown, never acted on by another flip (analytics/flips.py)
}
KINDS: tuple[str, ...] = tuple(OPENS_INCIDENT)
INCIDENT_KINDS: tuple[str, ...] = tuple(k for k, opens in OPENS_INCIDENT.items() if opens)
SEVERITIES: tuple[str, ...] = ("info", "warning", "critical")
# kinds whose window_start is the day a rolling detector judged them: the next day's key continues the
# open series (kind, scope, metric) instead of starting a new one
CONTINUING_KINDS: frozenset[str] = frozenset({"fp8_saturation"})
# kinds whose row is a fact about its own window (a week's fps shares): writing a later window does not
# resolve an earlier one; only a later window of the same (kind, scope, metric) at 'info' (fixed) does
WINDOWED_KINDS: frozenset[str] = frozenset({"fps_fraction"})
COLUMNS: tuple[str, ...] = (
    "kind", "scope", "metric", "window_start", "window_end", "baseline", "value", "effect", "confidence",
    "severity", "status", "attribution", "evidence", "job", "first_seen", "updated_at",
)
_TS = pa.timestamp("ms", tz="UTC")
_SCHEMA = pa.schema(
    [
        ("kind", pa.string()), ("scope", pa.string()), ("metric", pa.string()), ("window_start", _TS),
        ("window_end", _TS), ("baseline", pa.float64()), ("value", pa.float64()), ("effect", pa.float64()),
        ("confidence", pa.float64()), ("severity", pa.string()), ("status", pa.string()),
        ("attribution", pa.string()), ("evidence", pa.string()), ("job", pa.string()), ("first_seen", _TS),
        ("updated_at", _TS),
    ]
)


class FindingError(Exception):
    """A finding that does not fit the table; the message lists valid values."""


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def _num(v: Any) -> float | None:
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def finding(
    kind: str,
    scope: dict[str, Any] | str,
    metric: str,
    window_start: datetime,
    window_end: datetime,
    *,
    value: float,
    baseline: float | None = None,
    effect: float | None = None,
    confidence: float | None = None,
    severity: str = "info",
    attribution: str = "",
    evidence: dict[str, Any] | None = None,
    job: str = "",
) -> dict[str, Any]:
    """One findings row as a dict (the table's column names)."""
    if kind not in KINDS:
        raise FindingError(f"unknown finding kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    if severity not in SEVERITIES:
        raise FindingError(f"unknown severity {severity!r}; valid severities: {', '.join(SEVERITIES)}")
    return {
        "kind": kind,
        "scope": scope if isinstance(scope, str) else canonical_scope(scope),
        "metric": metric,
        "window_start": _utc(window_start),
        "window_end": _utc(window_end),
        "baseline": _num(baseline),
        "value": _num(value) if _num(value) is not None else 0.0,
        "effect": _num(effect),
        "confidence": _num(confidence),
        "severity": severity,
        "status": "open",
        "attribution": attribution or "",
        "evidence": json.dumps(evidence or {}, default=_json_default, allow_nan=False, sort_keys=True),
        "job": job,
    }


def _json_default(o: Any):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, datetime):
        return _utc(o).isoformat()
    return str(o)


def _key(row: dict[str, Any]) -> tuple:
    ws = _utc(row["window_start"]).replace(microsecond=(_utc(row["window_start"]).microsecond // 1000) * 1000)
    return (row["kind"], row["scope"], row["metric"], ws)


def read_findings(
    store, kind: str | None = None, job: str | None = None, status: str | None = None
) -> pl.DataFrame:
    """The newest version of every finding (FINAL), optionally of one kind / job / status."""
    return queries.read_findings(store, kind, job, status)


def write_findings(
    store, job: str, start: datetime, end: datetime, rows: list[dict[str, Any]], now: datetime | None = None,
    *, current: bool = False,
) -> list[dict[str, Any]]:
    """Write ``rows`` (from ``finding``) for ``job`` over [start, end); resolve what it no longer finds.

    ``current``: the run is the job's whole judgement of now (a trailing-window detector: memory, FP8
    saturation, change points, every release's regressions), so each open row of the job it did not
    write again is resolved, whatever its window (one that slid out of the window is no longer seen).
    Otherwise only the rows inside [start, end) or of a re-found (kind, scope, metric) are (a weekly
    job's past weeks stay as they were). Keeps ``first_seen`` of keys seen before; a new key of a
    ``CONTINUING_KINDS`` kind takes the earliest ``first_seen`` of its series' open rows. Returns the
    rows written as open findings.
    """
    now = _utc(now or datetime.now(UTC))
    for r in rows:
        r["job"] = job
    existing = queries.read_findings(store, job=job, status="open")
    new_keys = {_key(r) for r in rows}
    new_series = {k[:3] for k in new_keys}
    fixed_after: dict[tuple, datetime] = {}  # windowed series -> the earliest later window that shows it fixed
    for r in rows:
        if r["kind"] in WINDOWED_KINDS and r["severity"] == "info":
            k = _key(r)
            fixed_after[k[:3]] = min(fixed_after.get(k[:3], k[3]), k[3])
    first_seen: dict[tuple, datetime] = {}
    series_first: dict[tuple, datetime] = {}
    stale: list[dict[str, Any]] = []
    s, e = _utc(start), _utc(end)
    for old in existing.iter_rows(named=True):
        k = _key(old)
        first_seen[k] = old["first_seen"]
        if k[0] in CONTINUING_KINDS and old["first_seen"] is not None:
            series_first[k[:3]] = min(series_first.get(k[:3], old["first_seen"]), old["first_seen"])
        in_window = s <= _utc(old["window_start"]) < e
        if k[0] in WINDOWED_KINDS:
            superseded = k[:3] in fixed_after and fixed_after[k[:3]] > k[3]
        else:
            superseded = k[:3] in new_series
        if k not in new_keys and (current or in_window or superseded):
            stale.append({**old, "status": "resolved", "updated_at": now})
    out = []
    for r in rows:
        k = _key(r)
        out.append({**r, "first_seen": first_seen.get(k) or series_first.get(k[:3], now), "updated_at": now})
    batch = out + stale
    if batch:
        cols = {c: [r[c] for r in batch] for c in COLUMNS}
        store.insert_arrow("findings", pa.Table.from_pydict(cols, schema=_SCHEMA))
    return out
