"""Session reads: ``GET /v1/sessions`` (filters + paging, from ``session_stats``) and
``GET /v1/sessions/{session_id}/steps`` (raw steps of one session, paged).

    GET /v1/sessions?release=v7&gpu_kind=h200&min_streamed_s=1&start=2026-11-01T00:00:00Z&limit=50&offset=0

A session's figures come from the per-session aggregate states (never a scan of raw steps):
frames = 4 per step, streamed_s = sum of step periods, fps = frames / streamed_s. The time range
selects sessions that overlap [start, end).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import BaseModel

from api.deps import ReadAuth, StoreDep

router = APIRouter(tags=["sessions"], dependencies=[ReadAuth])

FRAMES_PER_STEP = 4
MAX_LIMIT = 1000
MAX_OFFSET = 10_000_000
TIME_MIN = datetime(1970, 1, 1, tzinfo=UTC)  # what DateTime64(3, 'UTC') holds, with margin
TIME_MAX = datetime(2200, 1, 1, tzinfo=UTC)

LabelQ = Annotated[str | None, Query(min_length=1, max_length=128)]


class SessionSummary(BaseModel):
    session_id: str
    release: str
    gpu_kind: str
    worker_id: str
    simulated: bool
    first_ts: datetime
    last_ts: datetime
    steps: int
    frames: int
    streamed_s: float
    fps: float | None
    late_chunks: int
    reset_steps: int
    step_period_ms_p50: float | None
    step_period_ms_p95: float | None
    step_period_ms_p99: float | None
    diffusion_ms_p50: float | None
    diffusion_ms_p95: float | None
    diffusion_ms_p99: float | None
    mem_reserved_max: int
    buffers_max: int
    switches: str


class SessionPage(BaseModel):
    sessions: list[SessionSummary]
    total: int
    limit: int
    offset: int


class StepPage(BaseModel):
    session_id: str
    steps: list[dict[str, Any]]
    total: int
    limit: int
    offset: int


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


_SESSIONS_SQL = """
SELECT
    session_id, release, gpu_kind, worker_id,
    max(simulated)                                          AS s_simulated,
    min(first_ts)                                           AS s_first_ts,
    max(last_ts)                                            AS s_last_ts,
    countMerge(steps)                                       AS s_steps,
    countIfMerge(late_chunks)                               AS s_late,
    countIfMerge(reset_steps)                               AS s_resets,
    sumMerge(period_ms_sum) / 1000                          AS s_streamed_s,
    quantilesTDigestMerge(0.5, 0.95, 0.99)(period_ms_q)     AS s_period_q,
    quantilesTDigestMerge(0.5, 0.95, 0.99)(diffusion_ms_q)  AS s_diffusion_q,
    max(mem_reserved_max)                                   AS s_mem_max,
    max(buffers_max)                                        AS s_buffers_max,
    argMax(switches, last_ts)                               AS s_switches,
    count() OVER ()                                         AS s_total
FROM session_stats
WHERE 1 {where}
GROUP BY release, gpu_kind, worker_id, session_id
HAVING s_streamed_s >= {{min_streamed_s:Float64}} {having}
ORDER BY s_first_ts DESC, session_id
LIMIT {{limit:UInt32}} OFFSET {{offset:UInt64}}
"""


@router.get("/v1/sessions", response_model=SessionPage, summary="Sessions with their per-session figures")
def list_sessions(
    store: StoreDep,
    release: LabelQ = None,
    gpu_kind: LabelQ = None,
    worker_id: LabelQ = None,
    start: Annotated[datetime | None, Query(description="sessions that end at or after this UTC time")] = None,
    end: Annotated[datetime | None, Query(description="sessions that start before this UTC time")] = None,
    min_streamed_s: Annotated[float, Query(ge=0, le=1e9, description="only sessions that streamed this long")] = 0.0,
    simulated: Annotated[bool | None, Query(description="only simulated (true) or real (false) sessions")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> SessionPage:
    params: dict[str, Any] = {"min_streamed_s": min_streamed_s, "limit": limit, "offset": offset}
    where, having = [], []
    for name, value in (("release", release), ("gpu_kind", gpu_kind), ("worker_id", worker_id)):
        if value is not None:
            where.append(f"AND {name} = {{{name}:String}}")
            params[name] = value
    for name, t in (("start", start), ("end", end)):
        if t is not None and not TIME_MIN <= _utc(t) <= TIME_MAX:
            raise HTTPException(422, f"{name} ({t.isoformat()}) is out of range; valid: a UTC time between "
                                     f"{TIME_MIN.date()} and {TIME_MAX.date()}")
    if start is not None and end is not None and _utc(start) >= _utc(end):
        raise HTTPException(422, f"start ({start.isoformat()}) must be before end ({end.isoformat()})")
    if start is not None:
        having.append("AND s_last_ts >= {start:DateTime64(3, 'UTC')}")
        params["start"] = _utc(start)
    if end is not None:
        having.append("AND s_first_ts < {end:DateTime64(3, 'UTC')}")
        params["end"] = _utc(end)
    if simulated is not None:
        having.append("AND s_simulated = {simulated:Bool}")
        params["simulated"] = simulated
    sql = _SESSIONS_SQL.format(where=" ".join(where), having=" ".join(having))
    rows = store.query_arrow(sql, params).to_pylist()
    total = rows[0]["s_total"] if rows else _count_sessions(store, sql, params)
    out = []
    for r in rows:
        streamed = r["s_streamed_s"] or 0.0
        frames = r["s_steps"] * FRAMES_PER_STEP
        pq = [_finite(float(x)) for x in (r["s_period_q"] or [None] * 3)]
        dq = [_finite(float(x)) for x in (r["s_diffusion_q"] or [None] * 3)]
        out.append(SessionSummary(
            session_id=r["session_id"], release=r["release"], gpu_kind=r["gpu_kind"], worker_id=r["worker_id"],
            simulated=bool(r["s_simulated"]), first_ts=r["s_first_ts"], last_ts=r["s_last_ts"],
            steps=r["s_steps"], frames=frames, streamed_s=_finite(streamed) or 0.0,
            fps=_finite(frames / streamed) if streamed > 0 else None,
            late_chunks=r["s_late"], reset_steps=r["s_resets"],
            step_period_ms_p50=pq[0], step_period_ms_p95=pq[1], step_period_ms_p99=pq[2],
            diffusion_ms_p50=dq[0], diffusion_ms_p95=dq[1], diffusion_ms_p99=dq[2],
            mem_reserved_max=r["s_mem_max"], buffers_max=r["s_buffers_max"], switches=r["s_switches"],
        ))
    return SessionPage(sessions=out, total=total, limit=limit, offset=offset)


def _count_sessions(store, sql: str, params: dict) -> int:
    """The total when the page is empty (an offset past the end): count the filtered sessions."""
    inner = sql.split("ORDER BY")[0]
    return store.query_rows(f"SELECT count() FROM ({inner})", params)[0][0]


@router.get("/v1/sessions/{session_id}/steps", response_model=StepPage, summary="Raw steps of one session")
def session_steps(
    store: StoreDep,
    session_id: Annotated[str, Path(min_length=1, max_length=128)],
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> StepPage:
    params = {"sid": session_id, "limit": limit, "offset": offset}
    total = store.query_rows("SELECT count() FROM steps WHERE session_id = {sid:String}", params)[0][0]
    if total == 0:
        raise HTTPException(404, f"no steps recorded for session {session_id!r}; list sessions at GET /v1/sessions")
    rows = store.query_arrow(
        "SELECT * FROM steps WHERE session_id = {sid:String} ORDER BY step, ts "
        "LIMIT {limit:UInt32} OFFSET {offset:UInt64}", params
    ).to_pylist()
    steps = [{k: _finite(v) for k, v in r.items()} for r in rows]
    return StepPage(session_id=session_id, steps=steps, total=total, limit=limit, offset=offset)
