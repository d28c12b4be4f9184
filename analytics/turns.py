"""Conversational turns: latency per release and GPU kind split into its parts, and its regressions.

    df = latency_table(store, start, end)      # release x gpu_kind x part: p50/p95/p99 with 95% intervals
    df = stage_medians(store, start, end)      # release x gpu_kind: the median of each part (dashboard)
    rows = run(store, start, end)              # findings: turn latency regressions, release vs baseline

A turn's latency (worker/turns.py) runs from the conditioning's arrival to the first played frame that
uses it and is the sum of four parts: wait (for the step in progress), recompute (the cross-attention
K/V), generation (the first chunk's step) and queue (the rest: chunks played before it). The intervals
are a cluster bootstrap over sessions (a session's turns share its worker, policy and load, so they are
not independent draws). The detector uses the step-time judges (analytics/stats.py, as in
analytics/regressions.py): per-session median latency and queue time through Kayenta's Mann-Whitney
judge, the share of turns that stalled the player through the two-proportion z-test; each with
``MIN_SAMPLES`` sessions per side and an effect beyond max(floor, 3 x the control's day-to-day noise),
Holm-corrected together. A regressed latency's evidence names the part whose median grew most.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import numpy as np
import polars as pl

from analytics import queries
from analytics.findings import finding
from analytics.regressions import ALPHA, BASELINE_LOOKBACK, MIN_SAMPLES, NOISE_K, baselines
from analytics.stats import (
    Judgement,
    absolute_noise,
    holm,
    judge_continuous,
    judge_proportion,
    relative_noise,
)

PARTS: tuple[str, ...] = ("wait", "recompute", "generation", "queue")
QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
# metric -> (per-session column, relative floor on the ratio of medians)
CONTINUOUS: dict[str, tuple[str, float]] = {
    "turn_latency_ms": ("latency_ms", 0.05),
    "turn_queue_ms": ("queue_ms", 0.10),
}
STALL_FLOOR = 0.02  # absolute floor on the share of turns that stalled the player
BOOTSTRAP = 400


TurnQueryError = queries.TurnQueryError  # a turn query that cannot be answered (its message lists what is valid)


def session_turns(store, start: datetime, end: datetime, filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """One row per session with turns that began in [start, end) (``queries.turn_sessions``)."""
    return queries.turn_sessions(store, start, end, PARTS, filters)


def turn_rows(store, start: datetime, end: datetime, filters: dict[str, Any] | None = None) -> pl.DataFrame:
    """Raw turns that arrived in [start, end): labels, policy, latency and its parts (ms)."""
    return queries.turn_rows(store, start, end, PARTS, filters)


def _cluster_bootstrap(values: np.ndarray, groups: np.ndarray, qs: tuple[float, ...], n: int,
                       rng: np.random.Generator) -> np.ndarray:
    """[n, len(qs)] quantiles of ``values`` over resamples of whole groups (sessions) with replacement:
    each resample weighs a value by how often its group was drawn (a weighted quantile, no copies)."""
    order = np.argsort(values, kind="stable")
    v = values[order]
    _, gid = np.unique(groups[order], return_inverse=True)
    k = int(gid.max()) + 1
    out = np.empty((n, len(qs)))
    for b in range(n):
        w = np.bincount(rng.integers(0, k, k), minlength=k)[gid]
        cum = np.cumsum(w)
        out[b] = v[np.minimum(np.searchsorted(cum, np.asarray(qs) * cum[-1], side="left"), len(v) - 1)]
    return out


def latency_table(store, start: datetime, end: datetime, filters: dict[str, Any] | None = None, *,
                  n_boot: int = BOOTSTRAP, seed: int = 0) -> pl.DataFrame:
    """Per release x GPU kind x part ("latency" and each of ``PARTS``): turns, sessions, and p50/p95/p99
    with their 95% intervals (``p50_lo``, ``p50_hi``, ...; a cluster bootstrap over sessions)."""
    df = turn_rows(store, start, end, filters)
    rows = []
    rng = np.random.default_rng(seed)
    for (release, gpu_kind), g in sorted(df.group_by(["release", "gpu_kind"]), key=lambda kv: kv[0]):
        sessions = g["session_id"].to_numpy()
        for part in ("latency", *PARTS):
            v = g[f"{part}_ms"].cast(pl.Float64).to_numpy()
            q = np.quantile(v, QUANTILES)
            boot = _cluster_bootstrap(v, sessions, QUANTILES, n_boot, rng)
            lo, hi = np.quantile(boot, [0.025, 0.975], axis=0)
            row = {"release": release, "gpu_kind": gpu_kind, "part": part, "turns": len(v),
                   "sessions": int(g["session_id"].n_unique())}
            for i, qq in enumerate(QUANTILES):
                name = f"p{round(qq * 100)}"
                row |= {name: float(q[i]), f"{name}_lo": float(lo[i]), f"{name}_hi": float(hi[i])}
            rows.append(row)
    return pl.DataFrame(rows)


def stage_medians(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per release x GPU kind (and policy): turns and the median of each part and of the latency, merged
    in ClickHouse from ``turn_stats`` (the dashboard's per-stage bars)."""
    return queries.turn_stage_medians(store, start, end, PARTS)


def stage_means(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per release x GPU kind (and policy): turns, the mean of each part and of the latency, and the
    latency's median. The parts of a turn add up to its latency, so their means add up to the mean
    latency (their medians do not: the dashboard stacks these)."""
    return queries.turn_stage_means(store, start, end, PARTS)


# ---------------------------------------------------------------------------------------------
# The detector


def _daily(df: pl.DataFrame) -> pl.DataFrame:
    return df.with_columns(pl.col("start_ts").dt.truncate("1d").alias("day"))


def judge(treatment: pl.DataFrame, control: pl.DataFrame) -> list[Judgement]:
    """The step-time judges on two cohorts' per-session turn frames (``session_turns``), Holm-corrected."""
    cd = _daily(control)
    out = []
    for metric, (col, floor) in CONTINUOUS.items():
        daily = cd.group_by("day").agg(pl.col(col).median(), pl.len().alias("n")).filter(pl.col("n") >= 10)
        out.append(judge_continuous(
            metric, treatment[col].cast(pl.Float64).to_numpy(), control[col].cast(pl.Float64).to_numpy(),
            floor=floor, noise=relative_noise(daily[col].to_list()), noise_k=NOISE_K, min_samples=MIN_SAMPLES,
            alpha=ALPHA,
        ))
    rates = [int(g["stalled_turns"].sum()) / max(int(g["turns"].sum()), 1)
             for _, g in cd.group_by("day") if len(g) >= 10]
    kt, nt = int(treatment["stalled_turns"].sum()), int(treatment["turns"].sum())
    kc, nc = int(control["stalled_turns"].sum()), int(control["turns"].sum())
    j = judge_proportion("turn_stall_rate", kt, nt, kc, nc, floor=STALL_FLOOR, noise=absolute_noise(rates),
                         noise_k=NOISE_K, min_samples=0, alpha=ALPHA)
    enough = min(len(treatment), len(control)) >= MIN_SAMPLES
    out.append(Judgement(**(j.as_dict() | {"enough_samples": enough, "regressed": j.regressed and enough})))
    return holm(out, alpha=ALPHA)


def part_shift(treatment: pl.DataFrame, control: pl.DataFrame) -> tuple[str, dict[str, float]]:
    """The part whose per-session median grew most (ms, treatment - control), and every part's change."""
    diff = {p: float(treatment[f"{p}_ms"].median() or 0.0) - float(control[f"{p}_ms"].median() or 0.0)
            for p in PARTS}
    return max(diff, key=lambda p: diff[p]), diff


def _severity(j: Judgement) -> str:
    return "critical" if j.effect > 3 * j.threshold else "warning"


def run(store, start: datetime, end: datetime, releases: list[str] | None = None) -> list[dict]:
    """Findings (kind='regression', metrics ``turn_*``) for each release with turns in [start, end)
    against its baseline release, per GPU kind."""
    rows = []
    for release, base, first_seen in baselines(store, end):
        if releases is not None and release not in releases:
            continue
        t_all = session_turns(store, max(start, first_seen), end, {"release": release})
        if t_all.is_empty():
            continue
        c_all = session_turns(store, first_seen - BASELINE_LOOKBACK, end, {"release": base})
        for gpu_kind in sorted(set(t_all["gpu_kind"].to_list())):
            t = t_all.filter(pl.col("gpu_kind") == gpu_kind)
            c = c_all.filter(pl.col("gpu_kind") == gpu_kind)
            if c.is_empty():
                continue
            part, shift = part_shift(t, c)
            for j in judge(t, c):
                if not j.regressed:
                    continue
                policies = {"treatment": sorted(set(t["policy"].to_list())),
                            "control": sorted(set(c["policy"].to_list()))}
                rows.append(finding(
                    "regression", {"release": release, "gpu_kind": gpu_kind}, j.metric,
                    queries.day_floor(first_seen), end, value=j.treatment, baseline=j.control, effect=j.effect,
                    confidence=1.0 - j.p_value, severity=_severity(j),
                    evidence=j.as_dict() | {"baseline_release": base, "worst_part": part, "part_change_ms": shift,
                                            "policies": policies},
                ))
    return rows
