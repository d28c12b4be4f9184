"""FP8 saturation with static activation scales: the share of sessions whose linears' inputs clip at +-448.

    sessions = session_saturation(store, start, end)   # one row per sampled session (session_stats)
    groups = judge(sessions)                           # pure: per release x gpu_kind, the proportion test
    groups = judge_groups(group_saturation(store, start, end))  # the same, counted in ClickHouse
    rows = run(store, start, end)                      # findings (kind='fp8_saturation')

Static scales (``worker/fp8.py StaticScale``, the ``static_scales`` switch) are calibrated on a
session's first forward + chunk and then fixed; values beyond ~2x the calibrated range saturate at the
FP8 maximum instead of overflowing. A long session can drift past it: a quality regression, never a
NaN. Workers send ``fp8_saturated`` (the fraction of a sampled step's FP8 activation elements at
+-448) on about one step in 64; ``session_stats`` keeps each session's max, mean and sample counts
(sql/022), so this reads one row per session, never raw steps.

A session *saturates* when its largest sampled fraction exceeds ``SATURATED_FRACTION``. Per release x
GPU kind, the saturating share of the sampled sessions is tested as a proportion against
``TOLERATED_SHARE`` (exact one-sided binomial test, scipy; Clopper-Pearson interval in the evidence),
with at least ``MIN_SESSIONS`` sampled sessions (``judge_groups``: the one place that decides, whether
the per-group counts come from the session frame, ``count_sessions``, or from ClickHouse,
``group_saturation``). A flagged group is a finding blaming ``static_scales`` when its saturating
sessions were sampled with that switch on. It is critical (the webhook turns the switch off for the
scope) only on enough evidence: ``CRITICAL_SHARE`` of the sessions, at least
``CRITICAL_MIN_SESSIONS`` saturating sessions and ``CRITICAL_MIN_WORKERS`` distinct saturating workers
(sessions of one worker are not independent: one bad GPU or one kind of prompt); otherwise a warning.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import polars as pl
from scipy.stats import binomtest

from analytics import queries
from analytics.findings import finding
from analytics.queries import day_floor

# A session saturates above 10 ppm of its sampled FP8 GEMM-input elements at the FP8 maximum. The
# denominator is every static-scale GEMM input element of the step; per token and block at the 57B
# shape (d = 7680, H*hd = d, ffn = 4d) at TP=1: qkv, cq and up take d each, o and co H*hd = d each, down
# ffn = 4d, so 9d. One channel of one linear's input lost in every token is then 1/(9d) = 14.5 ppm; one
# residual channel lost in the three LN-fed inputs (qkv, cq, up) 3/(9d) = 43 ppm. On a TP=3 rank the
# row-parallel inputs are sharded (o, co: d/3, down: 4d/3; 5d in all): one channel is 1/(5d) = 26 ppm,
# and under fused_allreduce the row-parallel inputs quantize dynamically and are not counted (3d): 43
# ppm. 1e-5 is below the smallest of these, so a session is flagged before one channel of one linear is
# lost in every token, whatever the TP size and switches; under it the clipped elements are isolated
# outliers (beyond ~2x the calibrated range) whose error is of the order of FP8's own rounding (3
# mantissa bits: 6% per element). Fractions are comparable only within one TP size x fused_allreduce.
SATURATED_FRACTION = 1e-5
# Some sessions may saturate (an unusual prompt far outside the calibration): up to 1% of them.
TOLERATED_SHARE = 0.01
# Critical (the webhook turns static scales off for the scope) only on enough evidence: one sampled
# session in ten saturating, at least 5 of them and on at least 2 distinct workers; else a warning.
CRITICAL_SHARE = 0.10
CRITICAL_MIN_SESSIONS = 5
CRITICAL_MIN_WORKERS = 2
MIN_SESSIONS = 30
ALPHA = 0.01
SWITCH = "static_scales"
# blame the switch when (nearly) every saturating session was sampled with it on
ATTRIBUTION_MIN_SHARE = 0.9

GROUP_COLUMNS = ("release", "gpu_kind", "sessions", "saturating", "share", "ci_low", "ci_high", "p_value",
                 "sat_p95", "sat_max", "sampled_steps", "saturating_steps", "static_saturating",
                 "saturating_workers", "enough", "flagged", "start_ts", "end_ts")


def session_saturation(store, start: datetime, end: datetime, release: str | None = None,
                       gpu_kind: str | None = None) -> pl.DataFrame:
    """Sessions that started in [start, end) with at least one sampled step: counts, max and mean fraction."""
    return queries.saturation_sessions(store, start, end, release, gpu_kind)


def group_saturation(store, start: datetime, end: datetime, release: str | None = None, gpu_kind: str | None = None,
                     *, tolerance: float = SATURATED_FRACTION) -> pl.DataFrame:
    """``count_sessions`` of ``session_saturation``'s sessions, counted in ClickHouse: one row per
    release x gpu_kind comes back instead of one per session (the dashboard's range can be 400 days)."""
    return queries.saturation_groups(store, start, end, release, gpu_kind, tolerance=tolerance)


def count_sessions(sessions: pl.DataFrame, *, tolerance: float = SATURATED_FRACTION) -> pl.DataFrame:
    """Per release x gpu_kind of ``sessions`` (``session_saturation``'s columns; at least release,
    gpu_kind, worker_id, sat_max, sampled_steps, saturating_steps, static_steps): sampled sessions,
    saturating ones (sat_max > ``tolerance``) and their distinct workers, the p95 and max of the
    sessions' max fraction, step counts. Pure; ``group_saturation`` is the same in SQL."""
    s = sessions.filter(pl.col("sampled_steps") > 0).with_columns(pl.col("sat_max").fill_null(0.0)).with_columns(
        (pl.col("sat_max") > tolerance).alias("_sat"))
    has_ts = "start_ts" in s.columns
    return s.group_by("release", "gpu_kind", maintain_order=True).agg(
        pl.len().alias("sessions"),
        pl.col("_sat").sum().alias("saturating"),
        pl.col("sat_max").quantile(0.95, "linear").alias("sat_p95"),
        pl.col("sat_max").max().alias("sat_max"),
        pl.col("sampled_steps").sum().alias("sampled_steps"),
        pl.col("saturating_steps").sum().alias("saturating_steps"),
        (pl.col("_sat") & (pl.col("static_steps") > 0)).sum().alias("static_saturating"),
        pl.col("worker_id").filter(pl.col("_sat")).n_unique().alias("saturating_workers"),
        *([pl.col("start_ts").min(), pl.col("end_ts").max()] if has_ts else []),
    ).sort("release", "gpu_kind")


def judge_groups(counts: pl.DataFrame, *, tolerated_share: float = TOLERATED_SHARE,
                 min_sessions: int = MIN_SESSIONS, alpha: float = ALPHA) -> pl.DataFrame:
    """Per group of ``counts`` (``count_sessions`` or ``group_saturation``): the saturating share with a
    95% Clopper-Pearson interval, the one-sided exact binomial p-value against ``tolerated_share``, and
    ``flagged`` (enough sessions, p < ``alpha`` and share above the tolerated one). Pure."""
    counts = counts.filter(pl.col("sessions") > 0) if counts.height else counts
    if counts.is_empty():
        return pl.DataFrame(schema={"release": pl.String, "gpu_kind": pl.String, "flagged": pl.Boolean})
    out = []
    for r in counts.iter_rows(named=True):
        n, k = int(r["sessions"]), int(r["saturating"])
        test = binomtest(k, n, tolerated_share, alternative="greater")
        ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")  # two-sided Clopper-Pearson
        enough = n >= min_sessions
        share = k / n
        out.append({**r, "sessions": n, "saturating": k, "share": share, "ci_low": float(ci.low),
                    "ci_high": float(ci.high), "p_value": float(test.pvalue), "enough": enough,
                    "flagged": bool(enough and test.pvalue < alpha and share > tolerated_share)})
    return pl.DataFrame(out).select([c for c in GROUP_COLUMNS if c in out[0]])


def judge(sessions: pl.DataFrame, *, tolerance: float = SATURATED_FRACTION, tolerated_share: float = TOLERATED_SHARE,
          min_sessions: int = MIN_SESSIONS, alpha: float = ALPHA) -> pl.DataFrame:
    """``judge_groups`` of ``count_sessions(sessions)``: per release x gpu_kind, the counts, the share
    and its interval, the p-value and ``flagged``. Pure."""
    return judge_groups(count_sessions(sessions, tolerance=tolerance), tolerated_share=tolerated_share,
                        min_sessions=min_sessions, alpha=alpha)


def severity(group: dict[str, Any]) -> str:
    """``critical`` on enough evidence (``CRITICAL_SHARE``, ``CRITICAL_MIN_SESSIONS`` saturating sessions on
    ``CRITICAL_MIN_WORKERS`` distinct workers), else ``warning``."""
    enough = (group["share"] >= CRITICAL_SHARE and group["saturating"] >= CRITICAL_MIN_SESSIONS
              and group["saturating_workers"] >= CRITICAL_MIN_WORKERS)
    return "critical" if enough else "warning"


def attribution(group: dict[str, Any]) -> str:
    """``static_scales`` when the group's saturating sessions were sampled with it on, else ''.

    Our worker probes only with static scales (a sampled step always has static_scales on), so this
    guards against other senders and future probes: a dynamic-scale probe would read about one
    element per row at +-448 (1/K of a K-wide input, above the tolerance) on every sampled step."""
    k = group["saturating"]
    return SWITCH if k and group["static_saturating"] / k >= ATTRIBUTION_MIN_SHARE else ""


def findings(groups: pl.DataFrame, sessions: pl.DataFrame, start: datetime, end: datetime) -> list[dict]:
    """One ``fp8_saturation`` finding per flagged group (``judge``'s rows).

    Keyed by the day it was judged (``window_start``: the day of ``end``): the hourly runs of a day
    replace one finding, the next day's run writes a new key and resolves the old one, and a run that
    no longer flags the group resolves the day's key (it lies in the window; findings.write_findings)
    even after the saturating sessions aged out of the window. ``first_seen`` carries over from the
    open finding of the previous day (findings.write_findings: same kind, scope and metric), so a
    problem that lasts a week reads a week old. Evidence: the worst sessions ([session, worker, max
    fraction]) and the distinct saturating workers (how many; the worst five as [worker, saturating
    sessions, max fraction]).
    """
    rows = []
    for g in groups.iter_rows(named=True):
        if not g["flagged"]:
            continue
        mine = sessions.filter((pl.col("release") == g["release"]) & (pl.col("gpu_kind") == g["gpu_kind"]))
        worst = mine.sort("sat_max", descending=True, nulls_last=True).head(5)
        workers = (mine.filter(pl.col("sat_max").fill_null(0.0) > SATURATED_FRACTION)
                   .group_by("worker_id").agg(pl.len().alias("n"), pl.col("sat_max").max().alias("m"))
                   .sort(["n", "m", "worker_id"], descending=[True, True, False]).head(5))
        rows.append(finding(
            "fp8_saturation", {"release": g["release"], "gpu_kind": g["gpu_kind"]}, "fp8_saturated",
            max(day_floor(end), start), end,
            value=g["share"], baseline=TOLERATED_SHARE, effect=g["share"] - TOLERATED_SHARE,
            confidence=1.0 - g["p_value"],
            severity=severity(g),
            attribution=attribution(g),
            evidence={
                "sessions": g["sessions"],
                "saturating_sessions": g["saturating"],
                "share": g["share"],
                "ci95": [g["ci_low"], g["ci_high"]],
                "p_value": g["p_value"],
                "tolerated_share": TOLERATED_SHARE,
                "session_saturated_above": SATURATED_FRACTION,
                "p95_session_max_fraction": g["sat_p95"],
                "max_fraction": g["sat_max"],
                "sampled_steps": g["sampled_steps"],
                "saturating_steps": g["saturating_steps"],
                "saturating_sessions_with_static_scales": g["static_saturating"],
                "first_session_start": g.get("start_ts"),
                "last_session_end": g.get("end_ts"),
                "worst_sessions": [[r["session_id"], r["worker_id"], r["sat_max"]]
                                   for r in worst.iter_rows(named=True)],
                "saturating_workers": g["saturating_workers"],
                "worst_workers": [[r["worker_id"], r["n"], r["m"]] for r in workers.iter_rows(named=True)],
                "critical_needs": {"share": CRITICAL_SHARE, "saturating_sessions": CRITICAL_MIN_SESSIONS,
                                   "saturating_workers": CRITICAL_MIN_WORKERS},
                "test": "scipy.stats.binomtest one-sided (share of sessions with max fp8_saturated above "
                        f"{SATURATED_FRACTION:g} > {TOLERATED_SHARE:g}); Clopper-Pearson 95% interval",
            },
        ))
    return rows


def run(store, start: datetime, end: datetime) -> list[dict]:
    """The job: sampled sessions that started in [start, end) -> findings rows."""
    sessions = session_saturation(store, start, end)
    if sessions.is_empty():
        return []
    return findings(judge(sessions), sessions, start, end)
