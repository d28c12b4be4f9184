"""Evaluations on the dashboard and in the weekly report: the verdicts behind numeric switch defaults and
each configuration's free-running curve -- its distance to the truth over the plain path's, per bin of
steps -- inside the band of correct implementations of the plain path (``livestep evaluate``'s records).

    sections(store, start, end)     # HTML sections: the latest verdicts, then the newest run's curves
    week_rows(store, start, end)    # the report's JSON: every summary row of the week's evaluation runs
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import plotly.graph_objects as go

from analytics.queries import evaluation_rows
from api import dashboard as d
from api import evaluation_gate

SUMMARY = ("teacher_forced_ratio", "divergence_ratio", "drift_tau", "drift_error_tau", "overall")
MAX_POINTS = 50_000  # curve points of one run drawn (a 14,400-step tiny drift has 2,057 reset intervals)


def week_rows(store, start: datetime, end: datetime) -> list[dict[str, Any]]:
    """Summary rows (no curve points) of the evaluation runs in [start, end), newest first."""
    return evaluation_rows(store, start=start, end=end, metrics=SUMMARY, limit=1000)


def fig_divergence(points: list[dict[str, Any]], title: str) -> go.Figure:
    """Per bin of steps: the candidate's distance to the truth over the plain path's, drawn inside the band
    the correct implementations span (``band_lo`` = 1, the plain path; ``band_hi`` = the worst of them: the
    gate's bound for that bin). Below 1: nearer the truth than the plain path."""
    pts = sorted(points, key=lambda p: p["step"])
    x = [p["step"] for p in pts]
    fig = go.Figure()
    fig.add_scatter(x=x, y=[p["band_hi"] for p in pts], mode="lines", line={"dash": "dot", "color": "#b42318"},
                    name="gate: the band's top")
    fig.add_scatter(x=x, y=[p["band_lo"] for p in pts], mode="lines", line={"width": 0}, fill="tonexty",
                    fillcolor="rgba(90,120,200,0.25)", name="band: correct implementations")
    fig.add_scatter(x=x, y=[p["value"] for p in pts], mode="lines+markers", name="candidate / plain",
                    marker={"color": ["#0a7a2f" if p["verdict"] == "pass" else "#b42318" for p in pts]})
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="distance to the truth / the plain path's")
    return fig


def fig_drift(points: list[dict[str, Any]], title: str) -> go.Figure:
    pts = sorted(points, key=lambda p: p["step"])
    fig = go.Figure()
    fig.add_scatter(x=[p["step"] for p in pts], y=[p["value"] for p in pts], mode="lines+markers",
                    name="error / plain error")
    fig.update_layout(title=title, xaxis_title="session age (steps)", yaxis_title="teacher-forced error ratio")
    return fig


def _latest_table(store) -> str:
    rows = [{"switch": e["switch"], "gpu_kind": e["gpu_kind"], "release": e["release"], "verdict": e["verdict"],
             "preset": e["preset"], "evaluation": d.Link(f"/dashboard/evaluations?evaluation_id={e['evaluation_id']}",
                                                        e["evaluation_id"]),
             "when": e["ts"]} for e in evaluation_gate.evaluations(store)]
    return d.table(rows, empty="no evaluation recorded: run `livestep evaluate ... --collector URL`")


def run_sections(store, evaluation_id: str, prefix: str = "ev") -> list[str]:
    """One evaluation run: its verdicts, and per configuration the divergence curve and the drift curve."""
    summary_rows = evaluation_rows(store, evaluation_id=evaluation_id, metrics=SUMMARY, limit=1000)
    if not summary_rows:
        return [d.section(f"Evaluation {evaluation_id}", d.table([], empty="no such evaluation run"))]
    head = summary_rows[0]
    summary = [{k: r[k] for k in ("switch", "configuration", "metric", "value", "band_lo", "band_hi", "n", "verdict")}
               for r in summary_rows]
    rows = evaluation_rows(store, evaluation_id=evaluation_id, metrics=("divergence", "drift_ratio"), limit=MAX_POINTS)
    out = [d.section(f"Evaluation {evaluation_id}: {head['preset']} on {head['gpu_kind']}, release {head['release']}",
                     d.table(sorted(summary, key=lambda r: (r["switch"], r["metric"]))),
                     note="teacher_forced_ratio: error against the truth / the plain path's own, same state and "
                          "inputs; divergence_ratio: free-running, the largest bin's distance to the truth / the "
                          "plain path's; band_hi: the worst correct implementation's (the bound); frame_*, flicker: "
                          "the decoded frames' view, shown beside the verdict; drift_tau: Kendall's tau of the "
                          "error ratio against session age")]
    for i, switch in enumerate(sorted({r["switch"] for r in rows})):
        div = [r for r in rows if r["switch"] == switch and r["metric"] == "divergence"]
        drift = [r for r in rows if r["switch"] == switch and r["metric"] == "drift_ratio"]
        body = ""
        if div:
            body += d.chart(fig_divergence(div, f"{switch}: free-running distance to the truth, against the band"),
                            f"{prefix}-div-{i}", 300)
        if drift:
            body += d.chart(fig_drift(drift, f"{switch}: error against session age (per reset interval)"),
                            f"{prefix}-drift-{i}", 260)
        if body:
            conf = div[0]["configuration"] if div else drift[0]["configuration"]
            out.append(d.section(switch, body, note=f"configuration: {conf.replace(',', ', ')}"))
    return out


def sections(store, start: datetime | None = None, end: datetime | None = None, evaluation_id: str | None = None,
             prefix: str = "ev") -> list[str]:
    """The latest verdict per switch, GPU kind and release; then one run (the given, else the newest in range)."""
    out = [d.section("Evaluations behind the numeric switch defaults", _latest_table(store),
                     note="a numeric switch is a default (and may be canaried) for a GPU kind and release only with "
                          "a passing evaluation there")]
    if evaluation_id is None:
        newest = evaluation_rows(store, start=start, end=end, metric="overall", limit=1)
        evaluation_id = newest[0]["evaluation_id"] if newest else None
    if evaluation_id is not None:
        out += run_sections(store, evaluation_id, prefix)
    return out


def report_sections(store, rows: list[dict[str, Any]]) -> list[str]:
    """The weekly report's section: the week's verdicts, and the newest run's curves (none: no section)."""
    if not rows:
        return []
    verdicts = [r for r in rows if r["metric"] == "overall"]
    return [d.section("Evaluations of numeric switches", d.table(
        verdicts, ["ts", "evaluation_id", "switch", "configuration", "gpu_kind", "release", "preset", "verdict"]),
        note="each configuration against the truth, over the plain path (livestep evaluate): teacher-forced "
             "error and free-running distance against the band of correct implementations, long-session drift"),
        *run_sections(store, rows[0]["evaluation_id"], "r-ev")]
