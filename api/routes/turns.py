"""Conversational turns: ``GET /v1/turns`` (latency per release x GPU kind with intervals, per-stage
medians), the ``/dashboard/turns`` page (per-stage bars of the parts' means, which add up to the mean latency, the table,
the turn-latency findings); the turn marks on a session page's step chart are api/dashboard.py's ``mark_turns``.
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
    known = sorted(set(aq.releases_seen(store)) | set(aq.turn_releases(store)))  # turns-only releases too
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
    means = turns.stage_means(store, tr.start, tr.end)
    for k, v in f.items():
        stages = stages.filter(pl.col(k) == v) if stages.height else stages
        means = means.filter(pl.col(k) == v) if means.height else means
    return {"start": tr.start.isoformat(), "end": tr.end.isoformat(), "parts": list(turns.PARTS),
            "rows": qr.rows(table), "stages": qr.rows(stages), "stage_means": qr.rows(means),
            "findings": _findings(store, tr, release, gpu_kind)}


def fig_stages(means: list[dict[str, Any]]) -> go.Figure:
    """One horizontal bar per release x GPU kind x policy: the parts' means stacked, which add up to the
    mean turn latency (medians of parts do not add up to the median latency, so they are not stacked);
    the median latency is a marker beside the bar."""
    labels = [f"{r['release']} · {r['gpu_kind']} · {r['policy']}" for r in means]
    fig = go.Figure()
    for part in turns.PARTS:
        fig.add_trace(go.Bar(
            y=labels, x=[r[f"{part}_ms"] for r in means], name=f"{part}: {PART_NOTES[part]}", orientation="h",
            marker_color=PART_COLORS[part], customdata=[[r["turns"], r["latency_ms"]] for r in means],
            hovertemplate="%{y}<br>" + part + " mean %{x:.0f} ms (of a mean turn latency of %{customdata[1]:.0f} ms, "
                          "%{customdata[0]} turns)<extra></extra>"))
    fig.add_trace(go.Scatter(y=labels, x=[r["latency_p50_ms"] for r in means], mode="markers", name="median latency",
                             marker={"symbol": "line-ns-open", "size": 18, "color": "#1d2330", "line": {"width": 2}},
                             hovertemplate="%{y}<br>median turn latency %{x:.0f} ms<extra></extra>"))
    fig.update_layout(title="turn latency: mean of each stage, adding up to the mean latency (conditioning arrived "
                            "-> first frame played); | the median latency",
                      barmode="stack", xaxis_title="ms", yaxis={"type": "category", "autorange": "reversed"},
                      legend={"orientation": "h", "y": -0.2}, height=max(300, 60 + 34 * len(means)))
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
            d.section("Where a turn's time goes (means of the parts)", d.chart(
                fig_stages(body["stage_means"]), "turn-stages", max(300, 60 + 34 * len(body["stage_means"]))),
                note=note + "; the medians of the parts are in the table below (they do not add up)"),
            d.section("Turn latency and its parts: p50 / p95 / p99 (95% interval, bootstrap over sessions)",
                      d.table(shown, cols)),
        ]
    sections.append(d.section("Turn-latency regressions", d.table(
        [{k: r.get(k) for k in ("scope", "metric", "value", "baseline", "effect", "severity", "summary")}
         for r in body["findings"]], empty="none")))
    return d.page("Turns", sections)
