"""Conversational turns: ``GET /v1/turns`` (latency per release x GPU kind with intervals, per-stage
medians), the ``/dashboard/turns`` page (the per-stage median bars as the paper draws them, the table,
the turn-latency findings) and the turn marks on a session page's step chart (``mark_turns``).
The numbers come from analytics/turns.py; the worker side is worker/turns.py.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
import polars as pl
from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import HTMLResponse

from analytics import queries as aq
from analytics import turns
from api import dashboard as d
from api import views as qr
from api.deps import StoreDep, require_reader
from api.routes._common import Label, TimeRangeDep

router = APIRouter(tags=["turns"], dependencies=[Depends(require_reader)])

PART_COLORS = {"wait": "#98a2b3", "recompute": "#f79009", "generation": "#2e90fa", "queue": "#b42318"}
PART_NOTES = {"wait": "wait for the step in progress", "recompute": "cross-attention K/V recompute",
              "generation": "first chunk generated", "queue": "queued behind older chunks"}


def _filters(release: str | None, gpu_kind: str | None) -> dict[str, str]:
    return {k: v for k, v in (("release", release), ("gpu_kind", gpu_kind)) if v is not None}


def _known(store, release: str | None) -> None:
    if release is None:
        return
    known = aq.releases_seen(store)
    if release not in known:
        raise HTTPException(404, detail=f"unknown release {release!r}; known releases: {', '.join(known) or 'none'}")


def _findings(store, tr, release: str | None, gpu_kind: str | None) -> list[dict[str, Any]]:
    df = aq.findings_frame(store, kind="regression", scope_labels={"release": release, "gpu_kind": gpu_kind},
                           start=tr.start, end=tr.end, limit=1000)
    if df.height:
        df = df.filter(pl.col("metric").str.starts_with("turn_"))
    return qr.finding_rows(df)


@router.get("/v1/turns")
def turns_summary(store: StoreDep, tr: TimeRangeDep, release: Label = None, gpu_kind: Label = None) -> dict[str, Any]:
    """Turns that arrived in the window, per release x GPU kind: ``rows`` has, for the latency and each of
    its parts (``part``: latency, wait, recompute, generation, queue), turns, sessions and p50/p95/p99
    with 95% intervals (``p50_lo``/``p50_hi``, ...: a bootstrap over sessions); ``stages`` the median of
    each part per release x GPU kind x policy (from the turn_stats view); ``findings`` the turn-latency
    regressions. An unknown release is 404 listing the known ones."""
    _known(store, release)
    f = _filters(release, gpu_kind)
    table = turns.latency_table(store, tr.start, tr.end, f)
    stages = turns.stage_medians(store, tr.start, tr.end)
    for k, v in f.items():
        stages = stages.filter(pl.col(k) == v) if stages.height else stages
    return {"start": tr.start.isoformat(), "end": tr.end.isoformat(), "parts": list(turns.PARTS),
            "rows": qr.rows(table), "stages": qr.rows(stages), "findings": _findings(store, tr, release, gpu_kind)}


def fig_stages(stages: list[dict[str, Any]]) -> go.Figure:
    """One horizontal bar per release x GPU kind x policy: the parts' medians stacked (the paper's drawing)."""
    labels = [f"{r['release']} · {r['gpu_kind']} · {r['policy']}" for r in stages]
    fig = go.Figure()
    for part in turns.PARTS:
        fig.add_trace(go.Bar(
            y=labels, x=[r[f"{part}_ms"] for r in stages], name=f"{part}: {PART_NOTES[part]}", orientation="h",
            marker_color=PART_COLORS[part], customdata=[[r["turns"], r["latency_ms"]] for r in stages],
            hovertemplate="%{y}<br>" + part + " median %{x:.0f} ms (turn latency median %{customdata[1]:.0f} ms, "
                          "%{customdata[0]} turns)<extra></extra>"))
    fig.update_layout(title="turn latency: median of each stage (conditioning arrived -> first frame played)",
                      barmode="stack", xaxis_title="ms", yaxis={"type": "category", "autorange": "reversed"},
                      legend={"orientation": "h", "y": -0.2}, height=max(300, 60 + 34 * len(stages)))
    return fig


@router.get("/dashboard/turns", response_class=HTMLResponse)
def turns_page(store: StoreDep, tr: TimeRangeDep, release: Label = None, gpu_kind: Label = None) -> str:
    body = turns_summary(store, tr, release, gpu_kind)
    note = f"turns that arrived {tr.start:%Y-%m-%d %H:%M} to {tr.end:%Y-%m-%d %H:%M} UTC"
    if not body["rows"]:
        sections = [d.section("Turn latency", '<p class="muted">No turn arrived in this range: workers send a '
                                              "turn record for every new conditioning a session receives.</p>",
                              note=note)]
    else:
        cols = ["release", "gpu_kind", "part", "turns", "sessions"] + [
            f"{q}{s}" for q in ("p50", "p95", "p99") for s in ("", "_lo", "_hi")]
        shown = [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in body["rows"]]
        sections = [
            d.section("Per-stage medians", d.chart(fig_stages(body["stages"]), "turn-stages",
                                                   max(300, 60 + 34 * len(body["stages"]))), note=note),
            d.section("Turn latency and its parts: p50 / p95 / p99 (95% interval, bootstrap over sessions)",
                      d.table(shown, cols)),
        ]
    sections.append(d.section("Turn-latency regressions", d.table(
        [{k: r.get(k) for k in ("scope", "metric", "value", "baseline", "effect", "severity", "summary")}
         for r in body["findings"]], empty="none")))
    return d.page("Turns", sections)


def mark_turns(fig: go.Figure, marks: pl.DataFrame) -> go.Figure:
    """A session's turns on its step chart: a dotted line (``dashboard.add_marks``, kind "turn") at the
    first step that used each turn's conditioning, and a marker per turn with its latency on hover."""
    if not marks.height:
        return fig
    rows = list(marks.iter_rows(named=True))
    d.add_marks(fig, [(r["step"], "turn", f"turn {r['turn']}: {r['latency_ms']:.0f} ms") for r in rows])
    fig.add_trace(go.Scatter(
        x=[r["step"] for r in rows], y=[1.0] * len(rows), yaxis="y2", mode="markers", name="turns",
        marker={"symbol": "triangle-down", "size": 9, "color": ["#12b76a" if r["speaking"] else "#667085" for r in rows]},
        customdata=[[r["turn"], "speaking" if r["speaking"] else "listening", r["latency_ms"], r["policy"],
                     r["cond_tokens"]] for r in rows],
        hovertemplate="turn %{customdata[0]} (%{customdata[1]}, %{customdata[4]} tokens, %{customdata[3]}): "
                      "first frame %{customdata[2]:.0f} ms after its conditioning<extra></extra>"))
    fig.update_layout(yaxis2={"overlaying": "y", "range": [0, 1.05], "visible": False})
    return fig
