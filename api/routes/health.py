"""``GET /v1/health``: is the store reachable, how deep is the spool, how far behind is the writer.

200 when the store answers, 503 (same body) when it does not; never needs a token (load balancers).
The body names the process's role and livestep version (checked during a rolling upgrade).
``status`` is ``degraded`` (with ``reasons``) while acked rows are not on their way into the store:
collector/state.py says when.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from collector.state import collector_state
from collector.version import __version__

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str  # ok | degraded
    reasons: list[str]
    role: str
    version: str  # this process's livestep (upgrades: docs/DEPLOY.md)
    store: dict
    spool: dict | None
    writer: dict | None
    quarantine: dict
    scheduler: bool


@router.get("/v1/health", response_model=Health, responses={503: {"model": Health, "description": "store unreachable"}})
async def health(request: Request):
    st = request.app.state
    store = st.store
    reachable = await run_in_threadpool(store.ping) if store is not None else False
    store_info = {"reachable": reachable, "dsn": store.dsn.redacted() if store is not None else None,
                  "error": st.store_error}
    state = collector_state(reachable, st.spool, st.writer)
    body = Health(status=state["status"], reasons=state["reasons"], role=st.settings.role, version=__version__,
                  store=store_info, spool=state["spool"], writer=state["writer"], quarantine=state["quarantine"],
                  scheduler=getattr(st, "scheduler", None) is not None)
    return JSONResponse(body.model_dump(), status_code=200 if reachable else 503)
