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

from datetime import timedelta
from enum import Enum
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query

from analytics import queries as aq
from analytics.findings import KINDS as FINDING_KINDS
from analytics.findings import SEVERITIES
from api.deps import StoreDep, require_reader
from api.routes._common import Label, PageDep, TimeRangeDep
from api.views import (
    QUANTILES,
    Metric,
    finding_rows,
    flagged_over,
    fp8_saturation_rows,
    fps_table,
    memory_growth_frame,
    q_name,
    release_quantiles,
    rows,
)

router = APIRouter(prefix="/v1", tags=["dashboards"], dependencies=[Depends(require_reader)])

SessionId = Annotated[str, Path(min_length=1, max_length=128)]


class GroupKey(str, Enum):
    week = "week"
    release = "release"
    gpu_kind = "gpu_kind"


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
    return {"releases": rows(aq.releases_in(store, tr.start, tr.end))}


@router.get("/releases/distributions")
def distributions(
    store: StoreDep, tr: TimeRangeDep, metric: Metric = Metric.step_period_ms, release: Label = None,
    gpu_kind: Label = None,
) -> dict[str, Any]:
    """Quantiles of a per-session metric (step time, upkeep, energy per chunk, late rate) per release."""
    qs = release_quantiles(store, tr.start, tr.end, [metric.value], release=release, gpu_kind=gpu_kind)
    return {"metric": metric.value, "quantiles": [q_name(p) for p in QUANTILES], "rows": qs[metric.value]}


@router.get("/releases/compare")
def compare_releases(
    store: StoreDep, tr: TimeRangeDep,
    baseline: Annotated[str, Query(min_length=1, max_length=128)],
    candidate: Annotated[str, Query(min_length=1, max_length=128)],
    gpu_kind: Label = None,
) -> dict[str, Any]:
    """Per-metric quantiles of two releases side by side, the median's relative change, and the
    regression findings about the candidate (on ``gpu_kind`` when given)."""
    known = set(aq.releases_seen(store))
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
    fnd = aq.findings_frame(store, kind="regression", scope_labels={"release": candidate, "gpu_kind": gpu_kind},
                         limit=200)
    return {"baseline": baseline, "candidate": candidate, "metrics": metrics, "findings": finding_rows(fnd)}


@router.get("/findings")
def findings(
    store: StoreDep, tr: TimeRangeDep, page: PageDep,
    kind: Annotated[str | None, Query(pattern="^(" + "|".join(FINDING_KINDS) + ")$")] = None,
    severity: Annotated[str | None, Query(pattern="^(" + "|".join(SEVERITIES) + ")$")] = None,
    status: Annotated[str | None, Query(pattern="^(open|resolved|acknowledged)$")] = None,
    scope: Annotated[str | None, Query(max_length=400, description="substring of the canonical scope")] = None,
    attribution: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    df = aq.findings_frame(store, kind=kind, severity=severity, status=status, scope_contains=scope,
                        attribution=attribution, start=tr.start, end=tr.end, limit=page.limit, offset=page.offset)
    return {"findings": finding_rows(df), "limit": page.limit, "offset": page.offset}


@router.get("/memory/growth")
def memory_growth(
    store: StoreDep, tr: TimeRangeDep, page: PageDep, release: Label = None, gpu_kind: Label = None,
    worker_id: Label = None,
) -> dict[str, Any]:
    df = memory_growth_frame(store, tr.start, tr.end, release=release, gpu_kind=gpu_kind, worker_id=worker_id)
    fnd = aq.findings_frame(store, kind="memory_growth", start=tr.start, end=tr.end, limit=100)
    return {"sessions": rows(df.slice(page.offset, page.limit)) if df.height else [], "total": df.height,
            "findings": finding_rows(fnd), "limit": page.limit, "offset": page.offset}


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
        known = aq.releases_seen(store)
        if release not in known:
            raise HTTPException(404, detail=f"unknown release {release!r}; known releases: "
                                            f"{', '.join(known) or 'none'}")
    fnd = aq.findings_frame(store, kind="fp8_saturation", status="open",
                         scope_labels={"release": release, "gpu_kind": gpu_kind}, start=tr.start, end=tr.end,
                         limit=100)
    return {"start": tr.start.isoformat(), "end": tr.end.isoformat(),
            "flagged_over": flagged_over(tr.start, tr.end),
            "job_window_days": SATURATION_WINDOW / timedelta(days=1),
            "session_saturated_above": saturation.SATURATED_FRACTION, "tolerated_share": saturation.TOLERATED_SHARE,
            "min_sessions": saturation.MIN_SESSIONS,
            "rows": fp8_saturation_rows(store, tr.start, tr.end, release=release, gpu_kind=gpu_kind),
            "findings": finding_rows(fnd)}


def _known_session(store, session_id: str) -> None:
    if not aq.session_known(store, session_id):
        raise HTTPException(404, detail=f"no session {session_id!r} in the store (list sessions at /v1/sessions)")


@router.get("/sessions/{session_id:path}/events")
def events_of_session(store: StoreDep, session_id: SessionId, page: PageDep) -> dict[str, Any]:
    _known_session(store, session_id)
    df = aq.session_events(store, session_id, page.limit, page.offset)
    out = rows(df, json_cols=("detail",))
    return {"session_id": session_id, "events": out, "limit": page.limit, "offset": page.offset}


@router.get("/sessions/{session_id:path}/memory")
def memory_of_session(store: StoreDep, session_id: SessionId) -> dict[str, Any]:
    _known_session(store, session_id)
    df = aq.session_memory(store, session_id)
    return {"session_id": session_id, "series": rows(df)}
