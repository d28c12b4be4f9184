"""Dashboard pages (HTML, plotly) and the plotly.js they load, served locally (no network).

    /dashboard/                 fleet overview: step period p50/p99, late chunks and fps fractions per day (with
                                rollouts, switch changes, incidents and the deadline drawn on them), fps fractions
                                per week and release, FP8 saturation per release x GPU kind, switch state
    /dashboard/releases         release comparison (default: the newest release against the one rolled out before
                                it), the same time series for the two, per-session distributions per release
    /dashboard/sessions         sessions: the fps histogram and the slowest sessions (links)
    /dashboard/sessions/{id}    one session: step time against the deadline with its switch changes, GPU samples
                                (power, SM clock, throttle reasons), memory, sampled FP8 saturation per step, events
    /dashboard/memory           memory against distinct shapes (the August leak's signature)
    /dashboard/findings         findings of every kind
    /dashboard/switches         switch rules, canaries and the audit trail
    /dashboard/reports          the weekly reports written so far
    /static/plotly.min.js       the plotly.js the plotly package ships
"""

from __future__ import annotations

from typing import Annotated

import polars as pl
from fastapi import APIRouter, Depends, HTTPException, Path, Query
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse

from analytics import queries as aq
from analytics import regressions
from api import dashboard as d
from api import views as qr
from api.deps import SettingsDep, StoreDep, require_reader
from api.routes._common import Label, TimeRange, TimeRangeDep
from api.switchboard import DEFAULTS, get_switchboard
from collector.records import SWITCH_NAMES

MIN_JUDGED = regressions.MIN_SAMPLES

router = APIRouter(tags=["dashboard pages"], dependencies=[Depends(require_reader)])


@router.get("/static/plotly.min.js", include_in_schema=False)
def plotly_js() -> FileResponse:
    return FileResponse(d.PLOTLY_JS, media_type="application/javascript",
                        headers={"Cache-Control": "public, max-age=86400"})


@router.get("/dashboard", include_in_schema=False)
def dashboard_root() -> RedirectResponse:
    return RedirectResponse("/dashboard/")


def timeseries_sections(store, tr: TimeRange, gpu_kind: str | None, releases: list[str] | None, prefix: str) -> list[str]:
    """One chart per ``api.timeseries.SERIES`` (per day and release) with the rollouts, switch changes
    and incidents of the range drawn on it, and the deadline on the step-period chart."""
    from api import timeseries as ts

    marks = ts.annotations(store, tr.start, tr.end, releases)
    out = []
    for s in ts.SERIES:
        df = ts.series_frame(store, s, tr.start, tr.end, gpu_kind=gpu_kind, releases=releases)
        out.append(d.section(s.title, d.chart(d.fig_timeseries(df, s, marks), f"{prefix}-{s.name}", 340),
                             note="dotted lines: release rollouts (blue), switch changes (orange), incidents "
                                  "opened (red) and closed (green)" if marks else "no rollout, switch change or "
                                  "incident in this range"))
    return out


@router.get("/dashboard/", response_class=HTMLResponse)
def fleet_page(store: StoreDep, tr: TimeRangeDep, gpu_kind: Label = None) -> str:
    weeks = qr.fps_table(store, tr.start, tr.end, ["week", "release"], gpu_kind=gpu_kind)
    kinds = qr.fps_table(store, tr.start, tr.end, ["gpu_kind"])
    switches, version = get_switchboard(store).resolve()
    sw_rows = [{"switch": k, "fleet-wide rule": switches.get(k, "none (workers keep their own)"),
               "production default": DEFAULTS[k]} for k in SWITCH_NAMES]
    fig_kind = d.fig_counts(kinds["gpu_kind"].to_list() if kinds.height else [],
                            kinds["mean_fps"].to_list() if kinds.height else [], "mean session fps per GPU kind")
    return d.page("Fleet overview", [
        d.range_picker("/dashboard/", tr.start, tr.end, {"gpu_kind": gpu_kind}),
        *timeseries_sections(store, tr, gpu_kind, None, "fleet"),
        d.section("Sessions at or below 24 fps, per week and release",
                  d.chart(d.fig_fps_weeks(weeks, "frac_le_24fps", "fraction of sessions <= 24 fps"), "fps-weeks"),
                  note=f"sessions that streamed >= 1 s, {tr.start:%Y-%m-%d} to {tr.end:%Y-%m-%d}"),
        d.section("Sessions at or below 23.5 fps", d.chart(d.fig_fps_weeks(weeks, "frac_le_23_5fps",
                                                                    "fraction of sessions <= 23.5 fps"), "fps-low")),
        d.section("Per GPU kind", d.chart(fig_kind, "fps-kind", 300) + d.table(qr.rows(kinds))),
        fp8_saturation_section(store, tr, gpu_kind),
        d.section(f"Fleet-wide switches (version {version})", d.table(sw_rows)),
    ])


FLAGGED_LABEL = "flagged (range shown)"  # not the hourly job's window: the note says which


def fp8_saturation_section(store, tr: TimeRange, gpu_kind: str | None) -> str:
    """The fleet page's FP8 panel: ``GET /v1/fp8-saturation``'s rows and open findings (the same query
    functions), drawn per release x GPU kind against the tolerated share; a sentence when nothing was sampled."""
    from analytics import saturation
    from analytics.stats import canonical_scope

    title = "FP8 saturation (static scales)"
    rows = qr.fp8_saturation_rows(store, tr.start, tr.end, gpu_kind=gpu_kind)
    if not rows:
        on = f" on {gpu_kind}" if gpu_kind else ""
        return d.section(title, '<p class="muted">' + d.esc(
            f"No session{on} was sampled with static FP8 scales between {tr.start:%Y-%m-%d %H:%M} and "
            f"{tr.end:%Y-%m-%d %H:%M} UTC: nothing to judge. Workers send fp8_saturated on about one step in 64, "
            "only with the static_scales switch on.") + "</p>")
    fnd = qr.finding_rows(aq.findings_frame(store, kind="fp8_saturation", status="open", start=tr.start, end=tr.end,
                                            limit=100))
    open_by_scope: dict[str, str] = {}
    for f in fnd:  # newest window first
        open_by_scope.setdefault(f["scope"], f["severity"])
    table = [{**r, FLAGGED_LABEL: "yes" if r["flagged"] else "no",
              "open finding": open_by_scope.get(canonical_scope({"release": r["release"], "gpu_kind": r["gpu_kind"]}),
                                                "")} for r in rows]
    return d.section(title, d.chart(d.fig_fp8_saturation(rows, saturation.TOLERATED_SHARE), "fp8-saturation", 340)
                     + d.table(table, ["release", "gpu_kind", "sessions", "saturating", "share", "ci_low", "ci_high",
                                       "sat_p95", "sat_max", "saturating_workers", FLAGGED_LABEL, "open finding"]),
                     note=f"sessions sampled with static_scales that started {tr.start:%Y-%m-%d} to {tr.end:%Y-%m-%d}; "
                          "a session saturates when its largest sampled fraction of FP8 GEMM inputs at the FP8 "
                          "maximum (+-448: clipped, or rounded up from |x/scale| >= 432) exceeds "
                          f"{saturation.SATURATED_FRACTION:g}; flagged: share above the tolerated "
                          f"{saturation.TOLERATED_SHARE:.0%} (exact binomial test, >= {saturation.MIN_SESSIONS} "
                          f"sessions), {qr.flagged_over(tr.start, tr.end)}; a critical finding (enough "
                          "saturating sessions on several workers) turns static_scales off for its scope")


def judged_releases(df) -> list[str]:
    """Releases with enough sessions in the frame to be judged (``analytics.regressions.MIN_SAMPLES``)."""
    if not df.height:
        return []
    counts = df.group_by("release").len()
    return sorted(r for r, n in counts.iter_rows() if n >= MIN_JUDGED)


@router.get("/dashboard/releases", response_class=HTMLResponse)
def releases_page(store: StoreDep, tr: TimeRangeDep, gpu_kind: Label = None, baseline: Label = None,
                  candidate: Label = None) -> str:
    from api.timeseries import default_pair

    df = qr.sessions_in(store, tr.start, tr.end, gpu_kind=gpu_kind)
    seen = sorted(set(df["release"].to_list())) if df.height else []
    judged = judged_releases(df)  # a dev worker's one-session release is no default side of a comparison
    by_rollout = default_pair(store, tr.end, judged if len(judged) >= 2 else seen)  # newest + the one before it
    cand = candidate or by_rollout[1]
    base = baseline or (by_rollout[0] if cand == by_rollout[1] else None)
    compare_rows = []
    per_metric = {m.value: {r["release"]: r for r in qr.quantile_rows(df, m.value)} for m in qr.Metric}
    if base and cand:
        for m, by in per_metric.items():
            b, c = by.get(base), by.get(cand)
            compare_rows.append({"metric": m, f"{base} p50": b and b["p50"], f"{cand} p50": c and c["p50"],
                                 "median change": (c["p50"] / b["p50"] - 1) if b and c and b["p50"] else None})
    sections = [d.range_picker("/dashboard/releases", tr.start, tr.end,
                               {"gpu_kind": gpu_kind, "baseline": baseline, "candidate": candidate}),
                d.section(f"{cand} against {base}" if base and cand else "Comparison",
                          d.table(compare_rows, empty="needs two releases with sessions in the range"),
                          note="choose with ?baseline=&candidate=; by default the newest release against the "
                               f"one rolled out before it, among releases with at least {MIN_JUDGED} sessions in the "
                               "range (what the regression detector needs); medians of per-session values"),
                *timeseries_sections(store, tr, gpu_kind, [r for r in (base, cand) if r] or None, "release")]
    for i, m in enumerate(qr.Metric):
        qrows = list(per_metric[m.value].values())
        sections.append(d.section(m.value, d.chart(d.fig_quantiles(qrows, m.value), f"dist-{i}", 320)
                                  + d.table(qrows, ["release", "sessions", "p5", "p50", "p95", "p99", "mean"])))
    reg = qr.finding_rows(aq.findings_frame(store, kind="regression", start=tr.start, end=tr.end, limit=100))
    sections.append(d.section("Regression findings", d.table(
        reg, ["scope", "summary", "metric", "baseline", "value", "effect", "confidence", "severity",
              "attribution"])))
    return d.page("Release comparison", sections)


@router.get("/dashboard/sessions", response_class=HTMLResponse)
def sessions_page(store: StoreDep, tr: TimeRangeDep, release: Label = None, gpu_kind: Label = None,
                  worker_id: Label = None) -> str:
    df = qr.sessions_in(store, tr.start, tr.end, release=release, gpu_kind=gpu_kind, worker_id=worker_id)
    slow = []
    if df.height:
        slow = d.session_links(qr.rows(df.sort("fps").head(50)))
    fig = d.fig_hist(df["fps"].to_list() if df.height else [], "session fps (sessions that streamed >= 1 s)", "fps")
    return d.page("Sessions", [
        d.section("fps of every session", d.chart(fig, "sessions-fps", 300),
                  note="filter with ?release=&gpu_kind=&worker_id=&start=&end="),
        d.section("The 50 slowest sessions", d.table(slow, ["session_id", "worker_id", "release", "gpu_kind",
                                                            "first_ts", "steps", "fps", "step_period_ms",
                                                            "late_rate", "mem_reserved_max"])),
    ])


@router.get("/dashboard/sessions/{session_id:path}", response_class=HTMLResponse)
def session_page(store: StoreDep, session_id: Annotated[str, Path(min_length=1, max_length=128)]) -> str:
    steps = aq.session_steps(store, session_id)
    events = aq.session_events(store, session_id)
    if steps.height == 0 and events.height == 0:
        raise HTTPException(404, detail=f"no session {session_id!r} in the store")
    x = steps["step"].to_list() if steps.height else []

    def col(c: str) -> list:
        return steps[c].to_list() if steps.height else []

    from api import timeseries as ts

    times = d.fig_series(x, {"step period": col("step_period_ms"), "diffusion": col("diffusion_ms"),
                             "cache upkeep": col("cache_upkeep_ms")}, "step time", "ms")
    d.add_threshold(times, ts.DEADLINE_MS, "deadline 166.7 ms")
    changes = ts.session_switch_changes(steps)
    d.add_marks(times, [(step, "switch", f"switches {what}") for step, what in changes])
    times.update_layout(yaxis={"ticksuffix": " ms", "rangemode": "tozero"})
    times = d.mark_turns(times, aq.session_turns(store, session_id))  # conversational turns
    mem = d.fig_series(x, {"reserved": [v / 2**30 for v in col("mem_reserved_bytes")],
                           "allocated": [v / 2**30 for v in col("mem_allocated_bytes")]}, "memory", "GiB")
    return d.page(f"Session {session_id}", [
        d.section("Step time", d.chart(times, "session-times"),
                  note=f"{len(changes)} switch change(s) in this session; the dashed line is the 166.7 ms deadline"),
        session_gpu_section(store, session_id),
        d.section("Memory", d.chart(mem, "session-memory")),
        session_fp8_section(steps),
        d.section("Events", d.table(qr.rows(events), empty="no events")),
    ])


def session_gpu_section(store, session_id: str) -> str:
    """The session's NVML samples: power and SM clock over time, throttle reasons where any was set."""
    import plotly.graph_objects as go

    from api import timeseries as ts

    title = "GPU (NVML samples)"
    df = aq.session_gpu_samples(store, session_id)
    if df.height == 0:
        return d.section(title, '<p class="muted">No GPU samples for this session: it ran on a CPU, without NVML '
                                "(no driver), or its worker sent none.</p>")
    fig = go.Figure()
    for (gpu,), g in df.group_by(["gpu_index"], maintain_order=True):
        fig.add_trace(go.Scatter(x=g["ts"].to_list(), y=g["power_w"].to_list(), mode="lines", name=f"GPU {gpu} power",
                                 text=[d.human(v, "W") for v in g["power_w"].to_list()], hovertemplate="%{text}"))
        fig.add_trace(go.Scatter(x=g["ts"].to_list(), y=g["sm_clock_mhz"].to_list(), mode="lines", yaxis="y2",
                                 name=f"GPU {gpu} SM clock", text=[d.human(v, "MHz") for v in g["sm_clock_mhz"].to_list()],
                                 hovertemplate="%{text}", line={"dash": "dot"}))
        hit = g.filter(pl.col("throttle_reasons").fill_null(0) > 1)  # 1 = idle only: not a slowdown
        if hit.height:
            fig.add_trace(go.Scatter(x=hit["ts"].to_list(), y=hit["power_w"].to_list(), mode="markers",
                                     name=f"GPU {gpu} throttled", marker={"symbol": "x", "size": 8, "color": "#b42318"},
                                     text=[ts.throttle_names(int(b)) for b in hit["throttle_reasons"].to_list()],
                                     hovertemplate="%{x}: %{text}<extra>throttle reasons</extra>"))
    fig.update_layout(title="power and SM clock; x: clock event (throttle) reasons", xaxis={"type": "date"},
                      yaxis={"title": "power", "ticksuffix": " W", "rangemode": "tozero"},
                      yaxis2={"title": "SM clock", "ticksuffix": " MHz", "overlaying": "y", "side": "right",
                              "rangemode": "tozero"}, legend={"orientation": "h"})
    reasons = sorted({ts.throttle_names(int(b)) for b in df["throttle_reasons"].drop_nulls().to_list() if b and b > 1})
    return d.section(title, d.chart(fig, "session-gpu", 320),
                     note=f"{df.height} samples; throttle reasons seen: {'; '.join(reasons) or 'none'}")


def session_fp8_section(steps: pl.DataFrame) -> str:
    """A session's sampled steps' ``fp8_saturated`` (markers), or a sentence when none was sampled."""
    from analytics.saturation import SATURATED_FRACTION

    title = "FP8 saturation (static scales)"
    sampled = steps.filter(pl.col("fp8_saturated").is_not_null()) if steps.height else steps
    if sampled.height == 0:
        return d.section(title, '<p class="muted">No step of this session was sampled: it ran without the '
                                "static_scales switch, ended before its first sampled step (about one in 64), or "
                                "came from a worker that does not send fp8_saturated.</p>")
    fig = d.fig_fp8_steps(sampled["step"].to_list(), sampled["fp8_saturated"].to_list(), SATURATED_FRACTION)
    return d.section(title, d.chart(fig, "session-fp8", 300),
                     note=f"{sampled.height} sampled steps, max {sampled['fp8_saturated'].max():.3g}")


@router.get("/dashboard/memory", response_class=HTMLResponse)
def memory_page(store: StoreDep, tr: TimeRangeDep, release: Label = None, gpu_kind: Label = None) -> str:
    df = qr.memory_growth_frame(store, tr.start, tr.end, release=release, gpu_kind=gpu_kind)
    fnd = qr.finding_rows(aq.findings_frame(store, kind="memory_growth", start=tr.start, end=tr.end, limit=100))
    top = []
    if df.height:
        top = d.session_links(qr.rows(df.sort("mem_reserved_max", descending=True).head(20)))
    return d.page("Memory growth", [
        d.section("Memory against distinct shapes", d.chart(d.fig_memory(df), "memory-shapes", 460),
                  note="a leak per first-forward shape shows as memory rising with distinct shapes"),
        d.section("Memory-growth findings", d.table(
            fnd, ["scope", "summary", "metric", "baseline", "value", "effect", "confidence", "severity",
                  "attribution"])),
        d.section("Sessions with the most reserved memory", d.table(
            top, ["session_id", "worker_id", "release", "distinct_shapes", "first_forward_tokens",
                  "mem_reserved_max", "buffers_max"])),
    ])


@router.get("/dashboard/findings", response_class=HTMLResponse)
def findings_page(store: StoreDep, tr: TimeRangeDep,
                  kind: Annotated[str | None, Query(max_length=64)] = None) -> str:
    df = aq.findings_frame(store, kind=kind, start=tr.start, end=tr.end, limit=500)
    counts = df.group_by("kind", "severity").len().sort("kind") if df.height else pl.DataFrame()
    labels = [f"{k}/{s}" for k, s in zip(counts["kind"], counts["severity"], strict=True)] if counts.height else []
    fig = d.fig_counts(labels, counts["len"].to_list() if counts.height else [], "findings by kind and severity")
    return d.page("Findings", [
        d.section("Counts", d.chart(fig, "findings-counts", 300)),
        d.section("Findings", d.table(qr.finding_rows(df), ["kind", "scope", "summary", "window_start", "metric",
                                                            "baseline", "value", "effect", "confidence", "severity",
                                                            "status", "attribution"])),
    ])


@router.get("/dashboard/reports", response_class=HTMLResponse)
def reports_page(settings: SettingsDep) -> str:
    from api.report import list_reports

    rows = list_reports(settings.reports_dir) if settings.reports_dir.exists() else []
    table = [{"week": r["iso_week"], "html": d.Link(f"/v1/reports/{r['iso_week']}.html", "report"),
              "json": d.Link(f"/v1/reports/{r['iso_week']}.json", "json"), "generated": r["generated_at"]}
             for r in rows]
    fig = d.fig_counts([r["iso_week"] for r in rows], [1] * len(rows), "reports written")
    return d.page("Weekly reports", [
        d.section("Reports", d.table(table, empty="no reports yet: POST /v1/reports/{week} builds one"),
                  note=f"from {settings.reports_dir}"),
        d.section("Weeks covered", d.chart(fig, "reports-weeks", 220)),
    ])


@router.get("/dashboard/switches", response_class=HTMLResponse)
def switches_page(store: StoreDep) -> str:
    board = get_switchboard(store)
    rules = [{"switch": r.name, "scope": r.scope or "(fleet)", "cohort": r.cohort, "value": r.value,
              "buckets": f"[{r.bucket_lo}, {r.bucket_hi})", "who": r.actor, "why": r.reason,
              "when": r.updated_at.isoformat()} for r in board.rules()]
    hist = board.history(limit=200)
    canaries = qr.rows(aq.canaries_frame(store, limit=100))
    decisions = pl.DataFrame(hist) if hist else pl.DataFrame()
    per = decisions.group_by("action").len().sort("action") if decisions.height else pl.DataFrame()
    fig = d.fig_counts(per["action"].to_list() if per.height else [], per["len"].to_list() if per.height else [],
                       "decisions by action")
    return d.page("Switches", [
        d.section("Rules", d.table(rules, empty="no rules: every switch at its default")),
        d.section("Canaries", d.table(canaries, empty="no canaries")),
        d.section("Decisions", d.chart(fig, "switch-decisions", 280) + d.table(
            hist, ["ts", "source", "action", "name", "scope", "cohort", "old_value", "new_value", "changed",
                   "actor", "reason"], empty="no decisions yet")),
    ])
