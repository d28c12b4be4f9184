"""Release regressions: a release against its baseline release, per GPU kind; and ``compare`` for
any two cohorts (the canary uses it).

    rows = run(store, start, end)                    # findings (kind='regression') for releases seen
    verdicts = compare(store, {"release": "v1.3"}, {"release": "v1.2"}, start, end)
    any(v["regressed"] for v in verdicts)

Judges (one comparison = one set of judgements, Holm-corrected):
- continuous per-session metrics (step time, diffusion time, cache upkeep, energy per chunk):
  Kayenta's judge — a one-sided Mann-Whitney U test with an effect-size floor on the ratio of medians;
- proportions (late chunks out of chunks; sessions <= 24 fps and <= 23.5 fps out of sessions that
  streamed >= 1 s): a two-proportion z-test (statsmodels) with an absolute floor.
Each needs ``MIN_SAMPLES`` sessions per side, and an effect beyond max(floor, 3 x the metric's
measured noise: the day-to-day spread of the control's daily medians or rates).
The baseline of a release is the release first seen just before it. A release is compared with its
baseline within strata of session length and prompt per GPU kind (analytics/stratified.py: van Elteren,
Cochran-Mantel-Haenszel), so a release whose sessions are longer, per-step behaviour unchanged, is no
regression; ``compare`` (the canary) too.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import polars as pl

from analytics import conditions, queries, strata, stratified
from analytics.blame import across_kinds, regression_blame
from analytics.findings import finding
from analytics.stats import (
    Judgement,
    absolute_noise,
    canonical_scope,
    holm,
    judge_continuous,
    judge_proportion,
    relative_noise,
)
from collector import catalog

# metric -> (per-session column, relative floor on the median ratio): the catalogue's (collector/catalog.py)
CONTINUOUS: dict[str, tuple[str, float]] = {
    m.finding_name: (m.name, m.regression_floor) for m in catalog.METRICS
    if m.regression_floor is not None and m.aggregation != "share"}
# metric -> absolute floor on the difference of proportions (late chunks; the fleet fps fractions)
PROPORTIONS: dict[str, float] = {
    **{m.finding_name: m.regression_floor for m in catalog.METRICS
       if m.regression_floor is not None and m.aggregation == "share"},
    **{name: 0.03 for name in catalog.FPS_FRACTIONS}}
MIN_SAMPLES = 30
ALPHA = 0.01
NOISE_K = 3.0
BASELINE_LOOKBACK = timedelta(days=7)


class RegressionError(Exception):
    """A comparison that cannot be made; the message says what is valid."""


def _proportion_counts(df: pl.DataFrame, metric: str) -> tuple[int, int]:
    if metric == "late_chunk_rate":
        return int(df["late_chunks"].sum()), int(df["steps"].sum())
    limit = catalog.FPS_FRACTIONS[metric]
    return int((df["fps"] <= limit).sum()), len(df)


def _daily(df: pl.DataFrame) -> pl.DataFrame:
    return df.with_columns(pl.col("start_ts").dt.truncate("1d").alias("day"))


def judge(treatment: pl.DataFrame, control: pl.DataFrame) -> list[Judgement]:
    """Every judge on two cohorts' per-session frames (streamed >= 1 s), Holm-corrected. With a ``stratum``
    column on both (``stratify``) each judge compares within strata (analytics/stratified.py), so a
    changed mix of session lengths or prompts is no regression; without, the cohorts are pooled."""
    t, c = _streamed(treatment), _streamed(control)
    within = "stratum" in t.columns and "stratum" in c.columns
    _, tg, cg, _, _ = stratified.pairs(t, c) if within else (None, [t], [c], 0, 0)
    cd = _daily(c)
    out = []
    for metric, (col, floor) in CONTINUOUS.items():
        daily = cd.group_by("day").agg(pl.col(col).median(), pl.len().alias("n")).filter(pl.col("n") >= 10)
        noise = relative_noise(daily[col].to_list())
        args = {"floor": floor, "noise": noise, "noise_k": NOISE_K, "min_samples": MIN_SAMPLES, "alpha": ALPHA}
        if within:
            shown = (_median(t[col]), _median(c[col]))
            out.append(stratified.judge_continuous_within(
                metric, [g[col].cast(pl.Float64).to_numpy() for g in tg],
                [g[col].cast(pl.Float64).to_numpy() for g in cg], pooled=shown, **args))
        else:
            out.append(judge_continuous(metric, t[col].cast(pl.Float64).to_numpy(),
                                        c[col].cast(pl.Float64).to_numpy(), **args))
    sessions = (sum(len(g) for g in tg), sum(len(g) for g in cg))
    for metric, floor in PROPORTIONS.items():
        rates = []
        for _, g in cd.group_by("day"):
            if len(g) >= 10:
                k, n = _proportion_counts(g, metric)
                rates.append(k / n if n else 0.0)
        args = {"floor": floor, "noise": absolute_noise(rates), "noise_k": NOISE_K, "alpha": ALPHA}
        if within:
            j = stratified.judge_proportion_within(
                metric, [_proportion_counts(g, metric) for g in tg], [_proportion_counts(g, metric) for g in cg],
                min_samples=MIN_SAMPLES, sessions=sessions, **args)
        else:
            (kt, nt), (kc, nc) = _proportion_counts(t, metric), _proportion_counts(c, metric)
            j = judge_proportion(metric, kt, nt, kc, nc, min_samples=0, **args)
            enough = min(sessions) >= MIN_SAMPLES  # sessions, not chunks, per side
            j = Judgement(**(j.as_dict() | {"enough_samples": enough, "regressed": j.regressed and enough}))
        out.append(j)
    return holm(out, alpha=ALPHA)


def _streamed(df: pl.DataFrame) -> pl.DataFrame:
    """The sessions a judge counts: those that streamed at least ``queries.MIN_STREAMED_S``."""
    return df.filter(pl.col("streamed_s") >= queries.MIN_STREAMED_S)


def _median(s: pl.Series) -> float:
    m = s.cast(pl.Float64).median()
    return float("nan") if m is None else float(m)


def _mix(t: pl.DataFrame, c: pl.DataFrame) -> dict[str, Any]:
    """What a regression finding's evidence says of its comparison (``run`` stratifies both sides): within
    strata, and the sessions of strata only one side had."""
    _, _, _, t_out, c_out = stratified.pairs(_streamed(t), _streamed(c))  # (``strata``: each judgement's count)
    return {"comparison": stratified.NOTE, "sessions_not_comparable": {"release": t_out, "baseline": c_out}}


def stratify(df: pl.DataFrame, shapes: pl.DataFrame) -> pl.DataFrame:
    """A per-session frame with its shape columns (``queries.session_shapes``) and its ``stratum``."""
    return strata.with_strata(_with_shapes(df, shapes)) if not df.is_empty() else df


def compare(
    store, treatment: dict[str, Any], control: dict[str, Any], start: datetime, end: datetime
) -> list[dict[str, Any]]:
    """Compare two cohorts (filters on release / gpu_kind / worker_id / session_id / switches) over
    sessions that started in [start, end) with the release detector's judges.

    Returns one dict per metric: metric, regressed, treatment, control, effect (positive = worse),
    threshold, p_value (Holm-corrected), test, n_treatment, n_control, enough_samples, scope, severity.
    """
    if not treatment or not control:
        raise RegressionError(f"both cohorts need a filter; valid filter keys: {', '.join(queries.FILTER_KEYS)}")
    shapes = queries.session_shapes(store, start, end)
    t = stratify(queries.session_frame(store, start, end, treatment), shapes)
    c = stratify(queries.session_frame(store, start, end, control), shapes)
    scope = canonical_scope(treatment)
    return [
        j.as_dict() | {"scope": scope, "severity": _severity(j) if j.regressed else "info"}
        for j in judge(t, c)
    ]


def _severity(j: Judgement) -> str:
    return "critical" if j.effect > 3 * j.threshold else "warning"


def baselines(store, end: datetime) -> list[tuple[str, str, datetime]]:
    """(release, its baseline release, the release's first session) for every release but the first."""
    rel = queries.release_first_seen(store, end)
    names, firsts = rel["release"].to_list(), rel["first_seen"].to_list()
    return [(names[i], names[i - 1], firsts[i]) for i in range(1, len(names))]


def relative_to_baseline(kinds: dict[str, tuple[pl.DataFrame, pl.DataFrame]]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The kinds' treatment and baseline sessions pooled, each continuous metric divided by its kind's
    baseline median (GPU kinds differ in step time; a switch's cohort spans kinds)."""
    ts, cs = [], []
    for t, c in kinds.values():
        scale = {col: c[col].cast(pl.Float64).median() for col, _ in CONTINUOUS.values()} if not c.is_empty() else {}
        exprs = [(pl.col(col).cast(pl.Float64) / m).alias(col) for col, m in scale.items() if m]
        ts.append(t.with_columns(exprs) if exprs else t)
        cs.append(c.with_columns(exprs) if exprs else c)
    return pl.concat(ts, how="vertical_relaxed"), pl.concat(cs, how="vertical_relaxed")


def release_blame(kinds: dict[str, tuple[pl.DataFrame, pl.DataFrame]]) -> dict[str, Any]:
    """Blame by contrast over the GPU kinds that regressed, pooled (``relative_to_baseline``), on the
    continuous metrics (a proportion's level differs by kind, so a mix of kinds would confound it)."""
    if len(kinds) < 2:
        return {"attribution": "", "attribution_method": "", "switches": {}, "why": "", "state": ""}
    t, c = relative_to_baseline(kinds)
    return regression_blame(t, c, lambda a, z: any(j.regressed for j in judge(a, z) if j.metric in CONTINUOUS))


def run(store, start: datetime, end: datetime, releases: list[str] | None = None) -> list[dict]:
    """Findings (kind='regression') for each release with sessions in [start, end) (or ``releases``)
    against its baseline, per GPU kind. ``window_start`` is the day the release was first seen, so a
    daily re-run replaces the same finding."""
    rows = []
    for release, base, first_seen in baselines(store, end):
        if releases is not None and release not in releases:
            continue
        t_start = max(start, first_seen)
        t_all = queries.session_frame(store, t_start, end, {"release": release})
        if t_all.is_empty():
            continue
        c_all = queries.session_frame(store, first_seen - BASELINE_LOOKBACK, end, {"release": base})
        shapes = queries.session_shapes(store, first_seen - BASELINE_LOOKBACK, end)
        t_all, c_all = stratify(t_all, shapes), stratify(c_all, shapes)
        regressed, segmented = {}, {}
        for gpu_kind in sorted(set(t_all["gpu_kind"].to_list())):
            t = t_all.filter(pl.col("gpu_kind") == gpu_kind)
            c = c_all.filter(pl.col("gpu_kind") == gpu_kind)
            judged = judge(t, c)
            if any(j.regressed for j in judged):
                regressed[gpu_kind] = (t, c, judged)
            elif (seg := _segment(t, c)) is not None:  # a regression only in a segment: the median hid it
                segmented[gpu_kind] = seg
        for gpu_kind, seg in segmented.items():
            rows.append(_segment_row(release, base, gpu_kind, seg, queries.day_floor(first_seen), end))
        fleet = release_blame({k: (t, c) for k, (t, c, _) in regressed.items()})
        for gpu_kind, (t, c, judged) in regressed.items():
            b = regression_blame(t, c, lambda a, z: any(j.regressed for j in judge(a, z)))  # by contrast
            b = across_kinds(b, fleet, t)
            blamed, shift = b["attribution"], {"why": b["why"], **b["switches"]}
            seg = _segment(t, c)
            mix = _mix(t, c)
            named = {"segment": seg, "condition": seg["condition"]} if seg else {}
            for j in judged:
                if not j.regressed:
                    continue
                rows.append(
                    finding(
                        "regression",
                        {"release": release, "gpu_kind": gpu_kind},
                        j.metric,
                        queries.day_floor(first_seen),
                        end,
                        value=j.treatment,
                        baseline=j.control,
                        effect=j.effect,
                        confidence=1.0 - j.p_value,
                        severity=_severity(j),
                        attribution=blamed,
                        evidence=j.as_dict() | {"baseline_release": base, "switch_share_change": shift,
                                                "attribution_state": b["state"]} | named | mix,
                    )
                )
    return rows


# the per-session metrics a segment is searched on (conditions.segment): the step's own times
SEGMENT_METRICS: tuple[str, ...] = ("diffusion_ms", "step_period_ms")


def _with_shapes(df: pl.DataFrame, shapes: pl.DataFrame) -> pl.DataFrame:
    if df.is_empty() or shapes.is_empty():
        return df
    return df.join(shapes, on="session_id", how="left")


def _segment(t: pl.DataFrame, c: pl.DataFrame) -> dict | None:
    """The first segment (``conditions.segment``) of ``SEGMENT_METRICS`` that explains a regression."""
    t, c = _streamed(t), _streamed(c)
    for metric in SEGMENT_METRICS:
        col, floor = CONTINUOUS[metric]
        if (seg := conditions.segment(t, c, col, floor)) is not None:
            return seg | {"metric": metric}
    return None


def _segment_row(release: str, base: str, gpu_kind: str, seg: dict, since: datetime, end: datetime) -> dict:
    return finding(
        "regression", {"release": release, "gpu_kind": gpu_kind}, seg["metric"], since, end,
        value=seg["treatment_inside"], baseline=seg["baseline_inside"], effect=seg["effect_inside"],
        confidence=1.0 - seg["p_value"], severity="warning",
        evidence={"baseline_release": base, "segment": seg, "condition": seg["condition"],
                  "why": f"{seg['metric']} {seg['effect_inside']:+.1%} for sessions with {seg['condition']} "
                         f"({seg['effect_outside']:+.1%} outside): the release's median hides it"},
    )
