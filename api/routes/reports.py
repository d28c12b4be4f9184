"""Weekly reports: list, serve, and build on demand (``api/report.py``).

    GET  /v1/reports                    the reports in the reports directory, newest first
    GET  /v1/reports/2026-W47.html      one report (HTML; plotly.js linked relatively, works offline)
    GET  /v1/reports/2026-W47.json      the same as JSON
    POST /v1/reports/2026-W47           build (or rebuild) that week's report now (admin)
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse

from api import dashboard as d
from api.deps import AdminDep, SettingsDep, StoreDep, require_reader
from api.report import PLOTLY_NAME, build_weekly_report, list_reports, report_paths
from api.routes._common import ISO_WEEK, iso_week_range

router = APIRouter(prefix="/v1/reports", tags=["reports"], dependencies=[Depends(require_reader)])
Week = Annotated[str, Path(pattern=ISO_WEEK, description="ISO week of the years 2000-2199, e.g. 2026-W47")]


def _check_week(week: str) -> None:
    iso_week_range(week)  # a 422 naming the week unless it exists and lies in the store's range


@router.get("")
def reports(settings: SettingsDep) -> dict[str, Any]:
    rows = list_reports(settings.reports_dir) if settings.reports_dir.exists() else []
    for r in rows:
        r["html_url"] = f"/v1/reports/{r['iso_week']}.html"
        r["json_url"] = f"/v1/reports/{r['iso_week']}.json"
    return {"reports": rows, "dir": str(settings.reports_dir)}


@router.get(f"/{PLOTLY_NAME}", include_in_schema=False)
def plotly_js() -> FileResponse:
    return FileResponse(d.PLOTLY_JS, media_type="application/javascript")


def _file(settings, week: str, kind: str) -> FileResponse:
    _check_week(week)
    html_path, json_path = report_paths(settings.reports_dir, week)
    path = html_path if kind == "html" else json_path
    if not path.exists():
        raise HTTPException(404, detail=f"no report for {week} yet; build it with POST /v1/reports/{week}")
    return FileResponse(path, media_type="text/html" if kind == "html" else "application/json")


@router.get("/{week}.html", response_class=FileResponse)
def report_html(week: Week, settings: SettingsDep) -> FileResponse:
    return _file(settings, week, "html")


@router.get("/{week}.json")
def report_json(week: Week, settings: SettingsDep) -> FileResponse:
    return _file(settings, week, "json")


@router.post("/{week}")
async def build_report(week: Week, store: StoreDep, settings: SettingsDep, _admin: AdminDep) -> dict[str, Any]:
    _check_week(week)
    html_path, json_path = await run_in_threadpool(build_weekly_report, store, week, settings.reports_dir)
    return {"iso_week": week, "html_url": f"/v1/reports/{week}.html", "json_url": f"/v1/reports/{week}.json",
            "html": str(html_path), "json": str(json_path)}
