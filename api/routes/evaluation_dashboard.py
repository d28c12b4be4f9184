"""``/dashboard/evaluations``: the verdicts behind the numeric switch defaults and one evaluation run's
free-running curves inside the band of correct implementations (api/evaluation_views.py draws them).

    /dashboard/evaluations                       the latest verdicts, and the newest run's curves
    /dashboard/evaluations?evaluation_id=<id>    that run
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse

from api import dashboard as d
from api import evaluation_views
from api.deps import StoreDep, require_reader
from api.routes._common import Label

router = APIRouter(tags=["dashboard pages"], dependencies=[Depends(require_reader)])


@router.get("/dashboard/evaluations", response_class=HTMLResponse)
def evaluations_page(store: StoreDep, evaluation_id: Label = None) -> str:
    return d.page("Evaluations", evaluation_views.sections(store, evaluation_id=evaluation_id))
