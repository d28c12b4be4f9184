"""``GET /v1/health``: is the store reachable, how deep is the spool, how far behind is the writer.

200 when the store answers, 503 (same body) when it does not; never needs a token (load balancers).
The body names the process's role and livestep version (checked during a rolling upgrade).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from collector.version import __version__

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str  # ok | degraded
    role: str
    version: str  # this process's livestep (upgrades: docs/DEPLOY.md)
    store: dict
    spool: dict | None
    writer: dict | None
    scheduler: bool


@router.get("/v1/health", response_model=Health, responses={503: {"model": Health, "description": "store unreachable"}})
async def health(request: Request):
    st = request.app.state
    store = st.store
    reachable = await run_in_threadpool(store.ping) if store is not None else False
    store_info = {"reachable": reachable, "dsn": store.dsn.redacted() if store is not None else None,
                  "error": st.store_error}
    spool = st.spool.stats() if st.spool is not None else None
    writer = st.writer.stats() if st.writer is not None else None
    if writer is not None:
        writer["lag_s"] = spool["oldest_age_s"] if spool else 0.0
        last = writer.pop("last_insert_at")
        writer["since_last_insert_s"] = round(time.time() - last, 3) if last else None
    ok = reachable and (writer is None or (writer["alive"] and writer["last_error"] is None))
    body = Health(status="ok" if ok else "degraded", role=st.settings.role, version=__version__, store=store_info,
                  spool=spool, writer=writer, scheduler=getattr(st, "scheduler", None) is not None)
    return JSONResponse(body.model_dump(), status_code=200 if reachable else 503)
