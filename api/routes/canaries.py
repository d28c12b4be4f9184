"""Canary routes: start one (admin), list, read, evaluate (one or every running one).

    POST /v1/canaries                  {"switch": "fused_allreduce", "scope": "release=v7", "fraction": 0.1,
                                        "min_sessions": 30, "who": "...", "why": "..."}
    GET  /v1/canaries[?status=running]     GET /v1/canaries/{id}
    POST /v1/canaries/{id}/evaluate    promote, roll back, or stay pending (admin; the scheduler may call
                                       api.canary.evaluate_running directly)
    POST /v1/canaries/evaluate         every running canary

Any role that runs the analytics scheduler also evaluates running canaries every 10 minutes
(``api.canary.schedule``, wired by api/app.py's lifespan, not by this router).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from api import canary
from api.deps import AdminDep, ReaderDep, SettingsDep, StoreDep
from api.routes._common import PageDep
from api.switchboard import SwitchError

router = APIRouter(prefix="/v1/canaries", tags=["canaries"])
CanaryId = Annotated[str, Path(pattern=r"^[0-9a-f]{12}$", description="canary id (12 hex digits)")]


class CanaryStart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    switch: str = Field(min_length=1, max_length=64)
    scope: str = Field(default="", max_length=400, description="'release=v7' etc.; '' = the whole fleet")
    fraction: float = Field(gt=0, lt=1, description="share of the scope's workers that get the switch back")
    min_sessions: int | None = Field(default=None, ge=1, le=1_000_000,
                                     description="sessions each side needs before a decision")
    who: str = Field(min_length=1, max_length=200)
    why: str = Field(min_length=1, max_length=2000)


def _call(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except canary.CanaryError as e:
        raise HTTPException(e.status, detail=str(e)) from e
    except SwitchError as e:
        raise HTTPException(422, detail=str(e)) from e


@router.post("", status_code=201)
async def start(body: CanaryStart, store: StoreDep, settings: SettingsDep, _admin: AdminDep) -> dict[str, Any]:
    return await run_in_threadpool(
        _call, canary.start_canary, store, body.switch, body.scope, fraction=body.fraction, actor=body.who,
        reason=body.why, min_sessions=body.min_sessions or settings.canary_min_sessions)


@router.get("")
def list_(store: StoreDep, page: PageDep, _auth: ReaderDep,
          status: Annotated[str | None, Query(pattern="^(running|promoted|rolled_back|cancelled)$")] = None
          ) -> dict[str, Any]:
    return {"canaries": canary.list_canaries(store, status, page.limit, page.offset), "limit": page.limit,
            "offset": page.offset}


@router.post("/evaluate")
async def evaluate_all(store: StoreDep, _admin: AdminDep) -> dict[str, Any]:
    return {"results": await run_in_threadpool(_call, canary.evaluate_running, store)}


@router.get("/{canary_id}")
def get(canary_id: CanaryId, store: StoreDep, _auth: ReaderDep) -> dict[str, Any]:
    return _call(canary.get_canary, store, canary_id)


@router.post("/{canary_id}/evaluate")
async def evaluate(canary_id: CanaryId, store: StoreDep, _admin: AdminDep) -> dict[str, Any]:
    return await run_in_threadpool(_call, canary.evaluate, store, canary_id)
