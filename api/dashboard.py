"""Dashboard rendering: plotly figures and the HTML page shell (used by api/routes/dashboard.py and
api/report.py).

    html = page("Fleet", [section("fps", chart(fig_fps_weeks(df)))])

Charts are plotly figures turned into ``<div>`` + script (no plotly.js inside); the page links the
plotly.js the plotly package ships, served by the app at /static/plotly.min.js (works offline).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import plotly
import plotly.colors
import plotly.graph_objects as go
import polars as pl

PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
PLOTLY_URL = "/static/plotly.min.js"
NAV = (("Incidents", "/dashboard/incidents"), ("Fleet", "/dashboard/"), ("Releases", "/dashboard/releases"), ("Sessions", "/dashboard/sessions"),
       ("Memory", "/dashboard/memory"), ("Turns", "/dashboard/turns"),
       ("Findings", "/dashboard/findings"), ("Switches", "/dashboard/switches"), ("Evaluations", "/dashboard/evaluations"),
       ("Reports", "/dashboard/reports"))

_CSS = """
body{font-family:system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:.6rem 1.2rem;display:flex;gap:1.2rem;align-items:center}
header a{color:#cfe0ff;text-decoration:none} header b{margin-right:1rem}
main{padding:1rem 1.2rem;max-width:1400px} section{background:#fff;border-radius:6px;padding:.8rem 1rem;margin:0 0 1rem;
box-shadow:0 1px 2px #0002} h2{font-size:1.05rem;margin:.2rem 0 .6rem} table{border-collapse:collapse;font-size:.85rem}
td,th{border-bottom:1px solid #e3e6ea;padding:.25rem .6rem;text-align:left;vertical-align:top}
td{max-width:36rem;overflow-wrap:break-word;hyphens:manual} .muted{color:#6b7280}
.on{color:#0a7a2f;font-weight:600} .off{color:#b42318;font-weight:600}
form.range{margin:0 0 1rem;font-size:.9rem} form.range a{margin:0 .3rem}
"""


# one colour per release, the same in every figure of the dashboards and the weekly report: a stable hash of
# the release's name into plotly's 24-colour qualitative palette (no store or figure context needed)
RELEASE_PALETTE = tuple(plotly.colors.qualitative.Dark24)


def release_color(release: Any) -> str:
    """The colour of ``release`` wherever it is drawn."""
    import zlib

    return RELEASE_PALETTE[zlib.crc32(str(release).encode()) % len(RELEASE_PALETTE)]


def esc(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def chart(fig: go.Figure, div_id: str, height: int = 360) -> str:
    fig.update_layout(height=height, margin={"l": 50, "r": 20, "t": 40, "b": 40}, template="plotly_white")
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def section(title: str, body: str, note: str = "") -> str:
    n = f'<p class="muted">{esc(note)}</p>' if note else ""
    return f"<section><h2>{esc(title)}</h2>{n}{body}</section>"


def table(rows: list[dict[str, Any]], columns: Iterable[str] | None = None, empty: str = "none") -> str:
    if not rows:
        return f'<p class="muted">{esc(empty)}</p>'
    cols = list(columns or rows[0].keys())
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c), c)}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


@dataclass(frozen=True)
class Link:
    """A table cell that links somewhere; text and address are escaped when rendered (labels come from
    workers: a cell never passes their text through as HTML)."""

    href: str
    text: str


def session_links(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows whose ``session_id`` links to the session's page."""
    return [{**r, "session_id": Link(f"/dashboard/sessions/{quote(str(r['session_id']), safe='')}",
                                     str(r["session_id"]))} for r in rows]


def unit_of(column: str) -> str:
    """The unit a column's name implies (``*_ms``, ``*_bytes``, ``fps``, ``share``/``frac``/``rate``, ...)."""
    c = column.lower()
    for suffix, unit in (("_ms", "ms"), ("_s", "s"), ("_bytes", "bytes"), ("_w", "W"), ("_mhz", "MHz"),
                         ("_mj", "mJ"), ("_c", "°C")):
        if c.endswith(suffix):
            return unit
    if any(w in c for w in ("share", "frac", "rate", "ratio", "change", "effect")) or c.startswith(("le_", "<=")):
        return "ratio"  # "<= 24 fps", "share <= 24 fps": a fraction of sessions, not a frame rate
    if "fps" in c and not c.startswith("n_"):
        return "fps"
    return ""


def human(v: Any, unit: str = "") -> str:
    """The one number formatter of the dashboards and reports: a value in its unit, scaled for reading
    (166.7 ms, 1.5 s, 3.2 GiB, 1.98 GHz, 2.4 %, 23.9 fps)."""
    if v is None:
        return ""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    x = float(v)
    if not math.isfinite(x):
        return "n/a"
    if unit == "ms":
        return f"{x / 1000:.3g} s" if abs(x) >= 10_000 else f"{x:.4g} ms"
    if unit == "s":
        return f"{x * 1000:.3g} ms" if abs(x) < 1 else (f"{x:.4g} s" if abs(x) < 600 else f"{x / 60:.3g} min")
    if unit == "bytes":
        for i, name in enumerate(("B", "KiB", "MiB", "GiB", "TiB")):
            if abs(x) < 1024 ** (i + 1) or name == "TiB":
                return f"{x / 1024**i:.3g} {name}" if i else f"{int(x)} B"
    if unit == "MHz":
        return f"{x / 1000:.3g} GHz" if abs(x) >= 1000 else f"{x:.4g} MHz"
    if unit == "mJ":
        return f"{x / 1000:.3g} J" if abs(x) >= 1000 else f"{x:.4g} mJ"
    if unit == "ratio":
        return f"{x * 100:.3g} %"
    if unit in ("fps", "W", "°C"):
        return f"{x:.3g} {unit}" if unit != "fps" else f"{x:.4g} fps"
    return f"{x:.4g}" if isinstance(v, float) else str(v)


# plotly axis formats per unit (the same units as ``human``)
_AXIS = {"ms": {"ticksuffix": " ms"}, "ratio": {"tickformat": ".1%"}, "fps": {"ticksuffix": " fps"},
         "W": {"ticksuffix": " W"}, "MHz": {"ticksuffix": " MHz"}, "bytes": {"tickformat": ".3s", "ticksuffix": "B"}}


_ISO = re.compile(r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?([+-]\d{2}:?\d{2}|Z)?$")


def when(v: Any) -> str | None:
    """A timestamp (datetime or ISO 8601 text) as people read it: '2026-11-24 13:45 UTC'; None if not one."""
    from datetime import UTC, datetime

    if isinstance(v, str) and _ISO.match(v.strip()):
        try:
            v = datetime.fromisoformat(v.strip())
        except ValueError:
            return None
    if isinstance(v, datetime):
        t = v if v.tzinfo else v.replace(tzinfo=UTC)
        return f"{t.astimezone(UTC):%Y-%m-%d %H:%M} UTC"
    return None


def _cell(v: Any, column: str = "") -> str:
    if (t := when(v)) is not None:
        return esc(t)
    if isinstance(v, bool):
        return f'<span class="{"on" if v else "off"}">{"on" if v else "off"}</span>'
    if isinstance(v, float) or (isinstance(v, int) and unit_of(column) in ("bytes", "ms")):
        return esc(human(v, unit_of(column)))
    if isinstance(v, Link):
        return f'<a href="{esc(v.href)}">{esc(v.text)}</a>'
    return esc(v)


def page(title: str, sections: list[str], plotly_src: str = PLOTLY_URL, inline_js: str | None = None,
         nav: bool = True) -> str:
    """The page shell; ``nav=False`` for a standalone document (a report opened from disk)."""
    nav_html = "".join(f'<a href="{href}">{esc(name)}</a>' for name, href in NAV) if nav else ""
    script = f"<script>{inline_js}</script>" if inline_js else f'<script src="{esc(plotly_src)}"></script>'
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)} · livestep</title>'
            f'<link rel="icon" href="data:,">{script}<style>{_CSS}</style></head><body>'
            f"<header><b>livestep</b>{nav_html}</header><main><h1>{esc(title)}</h1>{''.join(sections)}</main></body></html>")


# -- figures ------------------------------------------------------------------------------------------

def fig_fps_weeks(df: pl.DataFrame, y: str = "frac_le_24fps", title: str = "") -> go.Figure:
    fig = go.Figure()
    if df.height:
        for (rel,), g in df.sort("week").group_by(["release"], maintain_order=True):
            fig.add_trace(go.Bar(x=g["week"].to_list(), y=g[y].to_list(), name=str(rel),
                                 marker_color=release_color(rel)))
    fig.update_layout(title=title or y, barmode="group", yaxis={"tickformat": ".1%"}, xaxis={"type": "category"})
    return fig


def fig_quantiles(qrows: list[dict[str, Any]], metric: str) -> go.Figure:
    """A box per release drawn from precomputed quantiles (p5/p25/p50/p75/p95)."""
    fig = go.Figure()
    for r in qrows:
        fig.add_trace(go.Box(name=str(r["release"]), q1=[r["p25"]], median=[r["p50"]], q3=[r["p75"]],
                             lowerfence=[r["p5"]], upperfence=[r["p95"]], mean=[r["mean"]], x=[str(r["release"])],
                             marker_color=release_color(r["release"])))
    fig.update_layout(title=f"{metric} per session (p5-p95 whiskers)", showlegend=False)
    return fig


def fig_memory(df: pl.DataFrame) -> go.Figure:
    fig = go.Figure()
    if df.height:
        for (rel,), g in df.group_by(["release"], maintain_order=True):
            fig.add_trace(go.Scatter(
                x=g["distinct_shapes"].to_list(), y=(g["mem_reserved_max"] / 2**30).to_list(), mode="markers",
                name=str(rel), text=g["worker_id"].to_list(),
                marker={"size": 5, "opacity": 0.6, "color": release_color(rel)}))
    fig.update_layout(title="peak reserved memory vs distinct first-forward shapes seen by the worker",
                      xaxis_title="distinct shapes so far", yaxis_title="GiB reserved")
    return fig


def fig_series(x: list, ys: dict[str, list], title: str, y_title: str = "") -> go.Figure:
    fig = go.Figure()
    for name, y in ys.items():
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=name))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title=y_title)
    return fig


def fig_counts(labels: list[str], counts: list[int], title: str) -> go.Figure:
    fig = go.Figure(go.Bar(x=labels, y=counts))
    fig.update_layout(title=title, xaxis={"type": "category"})
    return fig


def fig_hist(values: list[float], title: str, x_title: str) -> go.Figure:
    fig = go.Figure(go.Histogram(x=values, nbinsx=60))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title="sessions")
    return fig


def fig_fp8_saturation(rows: list[dict[str, Any]], tolerated_share: float) -> go.Figure:
    """Per release (x) and GPU kind (a bar each): the share of sampled sessions saturating, its 95%
    interval as error bars (``ci_low``/``ci_high``), the tolerated share as a dashed line."""
    fig = go.Figure()
    for kind in sorted({str(r["gpu_kind"]) for r in rows}):
        rs = [r for r in rows if str(r["gpu_kind"]) == kind]
        fig.add_trace(go.Bar(
            x=[str(r["release"]) for r in rs], y=[r["share"] for r in rs], name=kind,
            error_y={"type": "data", "symmetric": False, "array": [r["ci_high"] - r["share"] for r in rs],
                     "arrayminus": [r["share"] - r["ci_low"] for r in rs]},
            customdata=[[r["saturating"], r["sessions"], r["ci_low"], r["ci_high"]] for r in rs],
            hovertemplate="%{x} %{fullData.name}: %{customdata[0]} of %{customdata[1]} sessions (%{y:.1%}, "
                          "95% interval %{customdata[2]:.1%} to %{customdata[3]:.1%})<extra></extra>"))
    fig.add_hline(y=tolerated_share, line_dash="dash", line_color="#b42318",
                  annotation_text=f"tolerated {tolerated_share:.0%}", annotation_position="top left")
    fig.update_layout(title="share of sampled sessions saturating (95% Clopper-Pearson interval)", barmode="group",
                      yaxis={"tickformat": ".0%", "rangemode": "tozero"}, xaxis={"type": "category"},
                      legend_title_text="GPU kind")
    return fig


def fig_fp8_steps(x: list, y: list[float], saturated_above: float) -> go.Figure:
    """A session's sampled steps' saturated fraction as markers; the per-session tolerance as a dashed line."""
    fig = go.Figure(go.Scatter(x=x, y=y, mode="markers", name="fp8_saturated", marker={"size": 7}))
    fig.add_hline(y=saturated_above, line_dash="dash", line_color="#b42318",
                  annotation_text=f"session saturates above {saturated_above:g}", annotation_position="top left")
    fig.update_layout(title="fraction of FP8 GEMM inputs at the FP8 maximum (±448: clipped or rounded up; sampled "
                            "steps)", xaxis_title="step",
                      yaxis={"title": "fraction", "exponentformat": "e", "rangemode": "tozero"}, showlegend=False)
    return fig


# -- time series, their annotations, the range picker -------------------------------------------------

_MARK_COLORS = {"rollout": "#1f4fd1", "switch": "#b45309", "incident_open": "#b42318", "incident_close": "#0a7a2f"}


MARK_ROWS = 6  # label rows under the top of the plot; consecutive marks (by time) take consecutive rows


def add_marks(fig: go.Figure, marks: list, xs: Any = None) -> go.Figure:
    """Vertical lines (shape ``name`` = the mark's kind) with their text, for events on a time (or step)
    axis; ``marks`` are ``api.timeseries.Mark`` or (x, kind, text) tuples. Labels are placed in time order
    on ``MARK_ROWS`` rows, each the row after the previous label's, so marks at the same time (a rollout
    and its switch change) or close together never print over each other."""
    items = [(m.ts, m.kind, m.text) if hasattr(m, "ts") else tuple(m) for m in marks]
    items.sort(key=lambda m: (str(type(m[0])), m[0]))
    for i, (x, kind, text) in enumerate(items):
        color = _MARK_COLORS.get(kind, "#6b7280")
        fig.add_shape(type="line", x0=x, x1=x, yref="paper", y0=0, y1=1, name=kind,
                      line={"color": color, "width": 1, "dash": "dot"})
        fig.add_annotation(x=x, yref="paper", y=1 - (i % MARK_ROWS) / (MARK_ROWS + 1), text=esc(text)[:80],
                           showarrow=False, xanchor="left", yanchor="top", font={"size": 10, "color": color}, name=kind,
                           bgcolor="rgba(255,255,255,0.85)")
    return fig


def mark_turns(fig: go.Figure, marks: pl.DataFrame) -> go.Figure:
    """A session's turns on its step chart: a dotted line (``dashboard.add_marks``, kind "turn") at the
    first step that used each turn's conditioning, and a marker per turn with its latency on hover."""
    if not marks.height:
        return fig
    rows = list(marks.iter_rows(named=True))
    add_marks(fig, [(r["step"], "turn", f"turn {r['turn']}: {r['latency_ms']:.0f} ms") for r in rows])
    fig.add_trace(go.Scatter(
        x=[r["step"] for r in rows], y=[1.0] * len(rows), yaxis="y2", mode="markers", name="turns",
        marker={"symbol": "triangle-down", "size": 9, "color": ["#12b76a" if r["speaking"] else "#667085" for r in rows]},
        customdata=[[r["turn"], "speaking" if r["speaking"] else "listening", r["latency_ms"], r["policy"],
                     r["cond_tokens"]] for r in rows],
        hovertemplate="turn %{customdata[0]} (%{customdata[1]}, %{customdata[4]} tokens, %{customdata[3]}): "
                      "first frame %{customdata[2]:.0f} ms after its conditioning<extra></extra>"))
    fig.update_layout(yaxis2={"overlaying": "y", "range": [0, 1.05], "visible": False})
    return fig


def add_threshold(fig: go.Figure, y: float, label: str) -> go.Figure:
    fig.add_shape(type="line", xref="paper", x0=0, x1=1, y0=y, y1=y, name="threshold",
                  line={"color": "#b42318", "width": 1.5, "dash": "dash"})
    # at the right end, under its line: the marks' labels hang from the top, starting at their event
    fig.add_annotation(xref="paper", x=1, y=y, text=esc(label), showarrow=False, yanchor="top", xanchor="right",
                       font={"size": 10, "color": "#b42318"}, name="threshold", bgcolor="rgba(255,255,255,0.85)")
    return fig


DASHES = ("solid", "dash", "dot", "dashdot")  # a release's second, third ... column on one chart


def day_centre(day: Any) -> Any:
    """Where a day's aggregate is drawn: the middle of the day (12:00 UTC), so that an event of that
    day (a switch flip at 23:31) sits on the side of the point its share of the day is on."""
    from datetime import date, datetime, time, timedelta

    if isinstance(day, datetime):
        return day.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(hours=12)
    if isinstance(day, date):
        return datetime.combine(day, time(12))
    return day


def fig_timeseries(df: pl.DataFrame, series, marks: list) -> go.Figure:
    """One line per release and plotted column of ``series`` (api.timeseries.Series) over days, the
    series' threshold line, and the marks; hover text in human units. A day's point is drawn at its
    middle (``day_centre``); a release has its colour (``release_color``), its columns a dash each."""
    fig = go.Figure()
    if df.height:
        for (rel,), g in df.sort("day").group_by(["release"], maintain_order=True):
            for k, col in enumerate(series.columns):
                ys = g[col].to_list()
                fig.add_trace(go.Scatter(
                    x=[day_centre(x) for x in g["day"].to_list()], y=ys, mode="lines+markers",
                    name=f"{rel} {col}" if len(series.columns) > 1 else str(rel), text=[human(v, series.unit) for v in ys],
                    line={"color": release_color(rel), "dash": DASHES[k % len(DASHES)]},
                    hovertemplate="%{x|%Y-%m-%d} (the day): %{text}<extra>%{fullData.name}</extra>"))
    if series.threshold is not None:
        add_threshold(fig, series.threshold, series.threshold_label)
    add_marks(fig, marks)
    fig.update_layout(title=series.title, yaxis={"rangemode": "tozero", **_AXIS.get(series.unit, {})},
                      xaxis={"type": "date"}, legend={"orientation": "h"})
    return fig


RANGES = (("24 h", 1), ("7 d", 7), ("28 d", 28), ("56 d", 56), ("90 d", 90))


def range_picker(path: str, start, end, params: dict[str, Any] | None = None) -> str:
    """A time-range form (start / end, UTC) with preset links ending now; other query parameters kept."""
    from datetime import UTC, datetime, timedelta
    from urllib.parse import urlencode

    keep = {k: v for k, v in (params or {}).items() if v not in (None, "") and k not in ("start", "end")}
    now = datetime.now(UTC).replace(second=0, microsecond=0) + timedelta(minutes=5)
    links = " ".join(
        f'<a href="{esc(path)}?{esc(urlencode({**keep, "start": (now - timedelta(days=d)).isoformat(), "end": now.isoformat()}))}">'
        f"{esc(label)}</a>" for label, d in RANGES)
    hidden = "".join(f'<input type="hidden" name="{esc(k)}" value="{esc(v)}">' for k, v in keep.items())
    fmt = "%Y-%m-%dT%H:%M"
    return (f'<form class="range" method="get" action="{esc(path)}">range (UTC): '
            f'<input type="datetime-local" name="start" value="{start:{fmt}}"> to '
            f'<input type="datetime-local" name="end" value="{end:{fmt}}"> {hidden}'
            f'<button type="submit">show</button> <span class="muted">last</span> {links}</form>')
