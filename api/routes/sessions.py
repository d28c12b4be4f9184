"""Session reads: ``GET /v1/sessions`` (filters + paging, from ``session_stats``) and
``GET /v1/sessions/{session_id}/steps`` (raw steps of one session, paged).

    GET /v1/sessions?release=v7&gpu_kind=h200&min_streamed_s=1&start=2026-11-01T00:00:00Z&limit=50&offset=0

A session's figures come from the per-session aggregate states (never a scan of raw steps), through
``analytics.queries.session_list`` (the one per-session SQL): frames = FRAMES_PER_STEP per step,
streamed_s = sum of step periods, fps = frames / streamed_s, switches = the state at the session's
latest steps. The time range selects sessions that overlap [start, end).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from pydantic import BaseModel, create_model

from analytics.queries import FRAMES_PER_STEP, session_list, session_step_page
from api.deps import StoreDep, require_reader
from api.routes._common import utc_in_range
from collector import catalog

router = APIRouter(tags=["sessions"], dependencies=[Depends(require_reader)])

MAX_LIMIT = 1000
MAX_OFFSET = 10_000_000

LabelQ = Annotated[str | None, Query(min_length=1, max_length=128)]


class _SessionSummary(BaseModel):
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


# ... and the catalogue's per-session columns served as they are (collector/catalog.py, ``summary=True``)
SessionSummary = create_model(  # type: ignore[call-overload]
    "SessionSummary", __base__=_SessionSummary, __doc__="One session's figures (GET /v1/sessions).",
    **{c.name: (float | None, None) for c in catalog.SUMMARY_COLUMNS})


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
    start, end = utc_in_range("start", start), utc_in_range("end", end)
    if start is not None and end is not None and start >= end:
        raise HTTPException(422, f"start ({start.isoformat()}) must be before end ({end.isoformat()})")
    filters = {k: v for k, v in (("release", release), ("gpu_kind", gpu_kind), ("worker_id", worker_id)) if v is not None}
    rows, total = session_list(
        store, filters, start=start, end=end,
        min_streamed_s=min_streamed_s, simulated=simulated, limit=limit, offset=offset)
    out = []
    for r in rows:
        streamed = r["streamed_s"] or 0.0
        frames = r["steps"] * FRAMES_PER_STEP
        pq = [_finite(float(x)) for x in (r["period_ms_q"] or [None] * 3)]
        dq = [_finite(float(x)) for x in (r["diffusion_ms_q"] or [None] * 3)]
        out.append(SessionSummary(
            session_id=r["session_id"], release=r["release"], gpu_kind=r["gpu_kind"], worker_id=r["worker_id"],
            simulated=bool(r["simulated"]), first_ts=r["start_ts"], last_ts=r["end_ts"],
            steps=r["steps"], frames=frames, streamed_s=_finite(streamed) or 0.0,
            fps=_finite(frames / streamed) if streamed > 0 else None,
            late_chunks=r["late_chunks"], reset_steps=r["reset_steps"],
            step_period_ms_p50=pq[0], step_period_ms_p95=pq[1], step_period_ms_p99=pq[2],
            diffusion_ms_p50=dq[0], diffusion_ms_p95=dq[1], diffusion_ms_p99=dq[2],
            mem_reserved_max=r["mem_reserved_max"], buffers_max=r["buffers_max"], switches=r["switch_state"],
            **{c.name: _finite(r[c.name]) for c in catalog.SUMMARY_COLUMNS},
        ))
    return SessionPage(sessions=out, total=total, limit=limit, offset=offset)


@router.get("/v1/sessions/{session_id:path}/steps", response_model=StepPage, summary="Raw steps of one session")
def session_steps(
    store: StoreDep,
    session_id: Annotated[str, Path(min_length=1, max_length=128)],
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> StepPage:
    rows, total = session_step_page(store, session_id, limit, offset)
    if total == 0:
        raise HTTPException(404, f"no steps recorded for session {session_id!r}; list sessions at GET /v1/sessions")
    steps = [{k: _finite(v) for k, v in r.items()} for r in rows]
    return StepPage(session_id=session_id, steps=steps, total=total, limit=limit, offset=offset)
