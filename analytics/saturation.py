"""FP8 saturation with static activation scales: the share of sessions whose linears' inputs clip at +-448.

    sessions = session_saturation(store, start, end)   # one row per sampled session (session_stats)
    groups = judge(sessions)                           # pure: per release x gpu_kind, the proportion test
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
with at least ``MIN_SESSIONS`` sampled sessions. A flagged group is a finding blaming
``static_scales`` when its saturating sessions were sampled with that switch on (critical, so the
webhook turns it off for the scope, from ``CRITICAL_SHARE`` of the sessions).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import polars as pl
from scipy.stats import binomtest

from analytics.findings import finding
from analytics.queries import day_floor

# A session saturates above 100 ppm of its sampled FP8 activation elements at +-448. One whole channel
# clipping in every token is 1/7680 = 130 ppm at the 57B shape (d_model 7680), so this flags drift
# before a full channel is lost; below it the clipped elements are isolated outliers (beyond ~2x the
# calibrated range) whose error is of the order of FP8's own rounding (3 mantissa bits: 6% per element).
SATURATED_FRACTION = 1e-4
# Some sessions may saturate (an unusual prompt far outside the calibration): up to 1% of them.
TOLERATED_SHARE = 0.01
CRITICAL_SHARE = 0.10  # one sampled session in ten saturating: turn static scales off for the scope
MIN_SESSIONS = 30
ALPHA = 0.01
SWITCH = "static_scales"
# blame the switch when (nearly) every saturating session was sampled with it on
ATTRIBUTION_MIN_SHARE = 0.9

_SESSIONS_SQL = """
SELECT release, gpu_kind, worker_id, session_id,
       min(first_ts)                        AS start_ts,
       max(last_ts)                         AS end_ts,
       countMerge(steps)                    AS steps,
       countIfMerge(fp8_sampled)            AS sampled_steps,
       countIfMerge(fp8_sat_steps)          AS saturating_steps,
       countIfMerge(fp8_static_steps)       AS static_steps,
       toFloat64(max(fp8_sat_max))          AS sat_max,
       toFloat64(avgMerge(fp8_sat_avg))     AS sat_mean,
       tupleElement(max(switch_last), 2)    AS switch_state
FROM session_stats
WHERE first_ts >= {start:DateTime64(3, 'UTC')} - INTERVAL 1 DAY AND first_ts < {end:DateTime64(3, 'UTC')} {filters}
GROUP BY release, gpu_kind, worker_id, session_id
HAVING start_ts >= {start:DateTime64(3, 'UTC')} AND start_ts < {end:DateTime64(3, 'UTC')} AND sampled_steps > 0
ORDER BY release, gpu_kind, start_ts
"""

GROUP_COLUMNS = ("release", "gpu_kind", "sessions", "saturating", "share", "ci_low", "ci_high", "p_value",
                 "sat_p95", "sat_max", "sampled_steps", "saturating_steps", "static_saturating", "enough",
                 "flagged", "start_ts", "end_ts")


def session_saturation(store, start: datetime, end: datetime, release: str | None = None,
                       gpu_kind: str | None = None) -> pl.DataFrame:
    """Sessions that started in [start, end) with at least one sampled step: counts, max and mean fraction."""
    params: dict[str, Any] = {"start": start, "end": end}
    filters = ""
    for key, value in (("release", release), ("gpu_kind", gpu_kind)):
        if value:
            filters += f" AND {key} = {{{key}:String}}"
            params[key] = value
    return store.query_df(_SESSIONS_SQL.replace("{filters}", filters), params)


def judge(sessions: pl.DataFrame, *, tolerance: float = SATURATED_FRACTION, tolerated_share: float = TOLERATED_SHARE,
          min_sessions: int = MIN_SESSIONS, alpha: float = ALPHA) -> pl.DataFrame:
    """Per release x gpu_kind of ``sessions`` (``session_saturation``'s columns; at least release, gpu_kind,
    sat_max, sampled_steps, saturating_steps, static_steps): sampled sessions, saturating ones
    (sat_max > ``tolerance``), their share with a 95% Clopper-Pearson interval, the one-sided exact
    binomial p-value against ``tolerated_share``, the p95 and max of the sessions' max fraction, and
    ``flagged`` (enough sessions, p < ``alpha`` and share above the tolerated one). Pure."""
    s = sessions.filter(pl.col("sampled_steps") > 0).with_columns(
        (pl.col("sat_max").fill_null(0.0) > tolerance).alias("_sat"))
    if s.is_empty():
        return pl.DataFrame(schema={"release": pl.String, "gpu_kind": pl.String, "flagged": pl.Boolean})
    has_ts = "start_ts" in s.columns
    agg = s.group_by("release", "gpu_kind", maintain_order=True).agg(
        pl.len().alias("sessions"),
        pl.col("_sat").sum().alias("saturating"),
        pl.col("sat_max").fill_null(0.0).quantile(0.95, "linear").alias("sat_p95"),
        pl.col("sat_max").fill_null(0.0).max().alias("sat_max"),
        pl.col("sampled_steps").sum().alias("sampled_steps"),
        pl.col("saturating_steps").sum().alias("saturating_steps"),
        (pl.col("_sat") & (pl.col("static_steps") > 0)).sum().alias("static_saturating"),
        *([pl.col("start_ts").min(), pl.col("end_ts").max()] if has_ts else []),
    ).sort("release", "gpu_kind")
    out = []
    for r in agg.iter_rows(named=True):
        n, k = int(r["sessions"]), int(r["saturating"])
        test = binomtest(k, n, tolerated_share, alternative="greater")
        ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")  # two-sided Clopper-Pearson
        enough = n >= min_sessions
        share = k / n
        out.append({**r, "saturating": k, "share": share, "ci_low": float(ci.low), "ci_high": float(ci.high),
                    "p_value": float(test.pvalue), "enough": enough,
                    "flagged": bool(enough and test.pvalue < alpha and share > tolerated_share)})
    return pl.DataFrame(out).select([c for c in GROUP_COLUMNS if c in out[0]])


def attribution(group: dict[str, Any]) -> str:
    """``static_scales`` when the group's saturating sessions were sampled with it on, else ''."""
    k = group["saturating"]
    return SWITCH if k and group["static_saturating"] / k >= ATTRIBUTION_MIN_SHARE else ""


def findings(groups: pl.DataFrame, sessions: pl.DataFrame, start: datetime, end: datetime) -> list[dict]:
    """One ``fp8_saturation`` finding per flagged group (``judge``'s rows).

    Keyed by the day it was judged (``window_start``: the day of ``end``): the hourly runs of a day
    replace one finding, the next day's run writes a new key and resolves the old one, and a run that
    no longer flags the group resolves the day's key (it lies in the window; findings.write_findings)
    even after the saturating sessions aged out of the window.
    """
    rows = []
    for g in groups.iter_rows(named=True):
        if not g["flagged"]:
            continue
        worst = (sessions.filter((pl.col("release") == g["release"]) & (pl.col("gpu_kind") == g["gpu_kind"]))
                 .sort("sat_max", descending=True, nulls_last=True).head(5))
        rows.append(finding(
            "fp8_saturation", {"release": g["release"], "gpu_kind": g["gpu_kind"]}, "fp8_saturated",
            max(day_floor(end), start), end,
            value=g["share"], baseline=TOLERATED_SHARE, effect=g["share"] - TOLERATED_SHARE,
            confidence=1.0 - g["p_value"],
            severity="critical" if g["share"] >= CRITICAL_SHARE else "warning",
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
