"""Incidents (api/incidents.py): the API and the dashboard page that leads with them.

    GET /v1/incidents[?state=open|opened|escalated|mitigated|resolved|reopened&kind=memory_growth]
        incidents, not resolved first, newest first; each with its evidence (the findings grouped in it)
    GET /v1/incidents/{id}       one incident, its log (state changes, flips, notifications) and what its flip
                                 cost the workers' live sessions (``flip_cost``)
    GET /dashboard/incidents     the page: open incidents first, then the resolved, then the log
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from fastapi.responses import HTMLResponse

from api import dashboard as d
from api import incidents as inc
from api.deps import ReaderDep, StoreDep, require_reader
from api.routes._common import PageDep

router = APIRouter(tags=["incidents"])
IncidentId = Annotated[str, Path(pattern=r"^[0-9a-f]{12}$", description="incident id (12 hex digits)")]
StateQ = Annotated[str | None, Query(pattern="^(open|" + "|".join(inc.STATES) + ")$",
                                     description="'open' = every state but resolved")]
KindQ = Annotated[str | None, Query(pattern="^(" + "|".join(inc.KINDS) + ")$")]


@router.get("/v1/incidents")
def list_incidents(store: StoreDep, page: PageDep, _auth: ReaderDep, state: StateQ = None,
                   kind: KindQ = None) -> dict[str, Any]:
    return {"incidents": inc.list_incidents(store, state, kind, page.limit, page.offset), "limit": page.limit,
            "offset": page.offset}


@router.get("/v1/incidents/{incident_id}")
def get_incident(incident_id: IncidentId, store: StoreDep, _auth: ReaderDep) -> dict[str, Any]:
    found = [i for i in inc.list_incidents(store, limit=100_000) if i["id"] == incident_id]
    if not found:
        raise HTTPException(404, detail=f"no incident {incident_id!r} (list them at GET /v1/incidents)")
    return {**found[0], "log": inc.incident_log(store, incident_id),
            "flip_cost": inc.flip_cost(store, found[0])}  # what its flip cost the live sessions


_COLUMNS = ["state", "severity", "kind", "scope", "switch", "summary", "opened_at", "updated_at", "flips",
            "notifications", "evidence_count"]


@router.get("/dashboard/incidents", response_class=HTMLResponse, dependencies=[Depends(require_reader)])
def incidents_page(store: StoreDep) -> str:
    rows = inc.list_incidents(store, limit=500)
    live = [{**r, "switch": r["switch"] or "none explains it", "id": d.Link(f"/v1/incidents/{r['id']}", r["id"]),
             "flip_cost": inc.flip_cost_brief(inc.flip_cost(store, r)) if r["flips"] else ""}
            for r in rows if r["state"] != "resolved"]
    done = [{**r, "id": d.Link(f"/v1/incidents/{r['id']}", r["id"])} for r in rows if r["state"] == "resolved"]
    log = inc.incident_log(store, limit=300)[-300:][::-1]
    return d.page("Incidents", [
        d.section("Open incidents", d.table(live, ["id", *_COLUMNS, "flip_cost"], empty="no open incident"), note=(
            "one incident per root cause (finding kind x scope x attributed switch); per-process findings are its "
            "evidence; a critical incident with a switch turns it off once, at its scope; flip_cost: what that flip "
            "cost the workers' live sessions (their flip_cost events)")),
        d.section("Resolved", d.table(done, ["id", *_COLUMNS, "resolved_at"], empty="none resolved yet")),
        d.section("Log (newest first)", d.table([{**e, "detail": str(e["detail"])[:200]} for e in log],
                                               ["ts", "incident_id", "event", "state", "detail"], empty="empty")),
    ])
