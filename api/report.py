"""The weekly regression report: one ISO week as HTML (plotly charts, works offline) and JSON.

It lives with the api (its HTML is the dashboards' ``api.dashboard``); the analytics schedule writes it
through the writer this module registers (``install``: ``analytics.jobs.set_report_writer``), so the
analytics never import the api.

    html_path, json_path = build_weekly_report(store, "2026-W47", Path("var/reports"))

Sections: incidents (open during the week, api/incidents.py), fps fractions against the week before,
regressions with their evidence, memory findings,
FP8 saturation findings (only in a week that has some), switch changes and rollbacks (the audit trail and the workers' ``switch_applied``/``rollback``
events), canary decisions. plotly.js is copied once next to the reports and linked relatively, so a
report opens from disk without a network and is served by ``/v1/reports``.
"""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from analytics import queries as aq
from analytics.queries import iso_week_bounds
from api import dashboard as d
from api import evaluation_views
from api import views as qr

PLOTLY_NAME = "plotly.min.js"
REPORTED_EVENTS = ("switch_applied", "rollback", "canary_start", "canary_promote", "canary_rollback", "oom")


def report_paths(out_dir: Path, iso_week: str) -> tuple[Path, Path]:
    base = Path(out_dir) / f"livestep-report-{iso_week}"
    return base.with_suffix(".html"), base.with_suffix(".json")


def _audit(store, start: datetime, end: datetime) -> list[dict[str, Any]]:
    df = aq.audit_changes(store, start, end)
    return qr.rows(df, json_cols=("evidence",))


def _events(store, start: datetime, end: datetime) -> list[dict[str, Any]]:
    df = aq.events_of_kinds(store, REPORTED_EVENTS, start, end)
    return qr.rows(df, json_cols=("detail",))


def _canaries(store, start: datetime, end: datetime) -> list[dict[str, Any]]:
    df = aq.canaries_frame(store, start=start, end=end, limit=10_000).sort("started_at", maintain_order=True)
    return qr.rows(df.select("id", "name", "scope", "fraction", "status", "started_at", "decided_at", "actor",
                             "reason", "evidence"), json_cols=("evidence",))


def _incidents(store, start: datetime, end: datetime) -> list[dict[str, Any]]:
    """Incidents opened before the week's end that were not resolved before its start (api/incidents.py)."""
    df = aq.incidents_during(store, start, end)
    return qr.rows(df)


def weekly_data(store, iso_week: str) -> dict[str, Any]:
    """Everything the report shows, as JSON-ready data."""
    start, end = iso_week_bounds(iso_week)
    prev = start - timedelta(days=7)
    weeks = qr.fps_table(store, prev, end, ["week"])
    by_release = qr.fps_table(store, start, end, ["release", "gpu_kind"])
    week_rows = {r["week"]: r for r in qr.rows(weeks)}
    this, before = week_rows.get(start.date().isoformat()), week_rows.get(prev.date().isoformat())
    change = None
    if this and before:
        change = this["frac_le_24fps"] - before["frac_le_24fps"]
    sessions = qr.sessions_in(store, start, end)
    return {
        "iso_week": iso_week, "start": start.isoformat(), "end": end.isoformat(),
        "generated_at": datetime.now(UTC).isoformat(),
        "fps": {"this_week": this, "week_before": before, "frac_le_24fps_change": change,
                "by_release": qr.rows(by_release)},
        "step_period_quantiles": qr.quantile_rows(sessions, "step_period_ms"),
        "incidents": _incidents(store, start, end),
        "regressions": qr.finding_rows(aq.findings_frame(store, kind="regression", start=start, end=end, limit=500)),
        "memory_findings": qr.finding_rows(aq.findings_frame(store, kind="memory_growth", start=start, end=end,
                                                             limit=500)),
        "canary_findings": qr.finding_rows(aq.findings_frame(store, kind="canary", start=start, end=end, limit=500)),
        "fp8_saturation_findings": qr.finding_rows(aq.findings_frame(store, kind="fp8_saturation", start=start,
                                                                     end=end, limit=500)),
        "switch_changes": _audit(store, start, end),
        "switch_events": _events(store, start, end),
        "canaries": _canaries(store, start, end),
        "evaluations": evaluation_views.week_rows(store, start, end),  # livestep evaluate's verdicts
    }


def _readable_json(v: Any) -> str:
    """JSON with a space after each separator: a table cell can wrap it between items, not inside a word."""
    import json

    return json.dumps(v, default=str, separators=(", ", ": "))


def _html(store, data: dict[str, Any]) -> str:
    start, end = datetime.fromisoformat(data["start"]), datetime.fromisoformat(data["end"])
    weeks = qr.fps_table(store, start - timedelta(days=7), end, ["week", "release"])
    mem = qr.memory_growth_frame(store, start, end)
    fps = data["fps"]
    this, before = fps["this_week"] or {}, fps["week_before"] or {}
    summary = [{"week": data["iso_week"], "sessions": this.get("sessions"),
                "share <= 24 fps": this.get("frac_le_24fps"), "share <= 23.5 fps": this.get("frac_le_23_5fps"),
                "week before, share <= 24 fps": before.get("frac_le_24fps"), "change": fps["frac_le_24fps_change"]}]
    ev_counts: dict[str, int] = {}
    for e in data["switch_events"]:
        ev_counts[e["kind"]] = ev_counts.get(e["kind"], 0) + 1
    applied = [{"ts": e["ts"], "kind": e["kind"], "worker_id": e["worker_id"], "release": e["release"],
                "detail": _readable_json(e["detail"])[:200]} for e in data["switch_events"][:200]]
    findings_cols = ["scope", "summary", "metric", "baseline", "value", "effect", "confidence", "severity", "attribution"]
    regressions = [{**f, "evidence": _readable_json(f["evidence"])[:300]} for f in data["regressions"]]
    saturation = []
    for f in data["fp8_saturation_findings"]:
        ev = f["evidence"] if isinstance(f["evidence"], dict) else {}
        saturation.append({"scope": f["scope"], "status": f["status"], "severity": f["severity"],
                           "attribution": f["attribution"], "sessions": ev.get("sessions"),
                           "saturating": ev.get("saturating_sessions"), "share": f["value"], "ci95": ev.get("ci95"),
                           "p95 fraction": ev.get("p95_session_max_fraction"), "max fraction": ev.get("max_fraction")})
    sat_section = [d.section("FP8 saturation (static activation scales)", d.table(saturation), note=(
        "sessions whose largest sampled fraction of FP8 activations at +-448 exceeds the tolerance, per release "
        "and GPU kind; a critical finding turns static_scales off for its scope"))] if saturation else []
    return d.page(f"Weekly report {data['iso_week']}", [
        d.section("Incidents", d.table(data["incidents"], ["state", "severity", "kind", "scope", "switch", "summary",
                                                       "opened_at", "mitigated_at", "resolved_at", "flips",
                                                       "notifications"], empty="no incident this week"),
                  note="one per root cause; the findings below are their evidence"),
        d.section("fps fractions against the week before", d.table(summary) + d.chart(
            d.fig_fps_weeks(weeks, "frac_le_24fps", "fraction of sessions <= 24 fps"), "r-fps")),
        d.section("Step time per release", d.chart(d.fig_quantiles(data["step_period_quantiles"], "step_period_ms"),
                                                   "r-step")),
        d.section("Regressions (with evidence)", d.table(regressions, findings_cols + ["evidence"],
                                                         empty="no regression findings this week")),
        d.section("Memory", d.chart(d.fig_memory(mem), "r-mem") + d.table(
            data["memory_findings"], findings_cols, empty="no memory findings this week")),
        *sat_section,
        d.section("Switch changes and rollbacks", d.table(
            data["switch_changes"], ["ts", "source", "action", "name", "scope", "cohort", "old_value", "new_value",
                                     "actor", "reason"], empty="no switch changes this week")
            + d.chart(d.fig_counts(list(ev_counts), list(ev_counts.values()), "worker events"), "r-events", 260)
            + d.table(applied, empty="no switch events from workers")),
        d.section("Canaries", d.table(data["canaries"], ["id", "name", "scope", "fraction", "status", "started_at",
                                                         "decided_at", "reason"], empty="no canaries")
            + d.table(data["canary_findings"], findings_cols, empty="")),
        *evaluation_views.report_sections(store, data.get("evaluations", [])),
    ], plotly_src=PLOTLY_NAME, nav=False)


def build_weekly_report(store, iso_week: str, out_dir) -> tuple[Path, Path]:
    """Write the report of ``iso_week`` ('2026-W47') to ``out_dir``; return (html_path, json_path)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = weekly_data(store, iso_week)
    html_path, json_path = report_paths(out_dir, iso_week)
    js = out_dir / PLOTLY_NAME
    if not js.exists() or js.stat().st_size != d.PLOTLY_JS.stat().st_size:
        shutil.copyfile(d.PLOTLY_JS, js)
    tmp_json, tmp_html = json_path.with_suffix(".json.tmp"), html_path.with_suffix(".html.tmp")
    tmp_json.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2, default=str))
    tmp_html.write_text(_html(store, data))
    tmp_json.replace(json_path)
    tmp_html.replace(html_path)
    return html_path, json_path


def list_reports(out_dir) -> list[dict[str, Any]]:
    out = []
    for p in sorted(Path(out_dir).glob("livestep-report-*.json"), reverse=True):
        week = p.stem.removeprefix("livestep-report-")
        out.append({"iso_week": week, "json": p.name, "html": p.with_suffix(".html").name,
                    "generated_at": datetime.fromtimestamp(p.stat().st_mtime, UTC).isoformat()})
    return out


def install() -> None:
    """Make this the analytics' weekly report writer (api/app.py's lifespan and ``livestep analyze`` call it);
    its default directory is the settings' ``reports_dir``."""
    from analytics.jobs import set_report_writer
    from api.settings import get_settings

    set_report_writer(build_weekly_report, lambda: Path(get_settings().reports_dir))
