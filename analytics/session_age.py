"""Within a session: step time against the step's index (degradation with session age), and reset steps.

    rows = run(store, start, end)          # findings (kind='regression'), per release against its baseline

A session-level median hides a step time that grows as the session ages (+0.02 ms a step is +1% by step 60
and +6% by step 400; a fleet median over sessions of mixed length barely moves). Per session, the slope of
the diffusion time against the step index is fitted over its ordinary steps (ClickHouse
``simpleLinearRegression``, least squares), and its reset steps (a delta rotation) are their own class: the
ratio of their median to the ordinary steps' median. A release is judged against its baseline release
(``regressions.baselines``) per GPU kind with the release detector's Mann-Whitney judge
(``stats.judge_continuous``'s test, one-sided) on the per-session slopes:

- **age**: the median slope rose by at least ``MIN_SLOPE_MS`` ms a step and by enough to add
  ``MIN_AGE_EFFECT`` of the step time by the median session's last step;
- **resets**: the reset steps' ratio rose beyond ``RESET_FLOOR`` (Kayenta's ratio judge).

A change on every GPU kind the release runs on (regressed on one at least, leaning the same way on each of
the others: p < ``CONSISTENT_P``) is one finding at the release's scope (its kinds in the evidence), not one
per kind. Session length does not enter the judgement: a release whose sessions are
longer with the same per-step behaviour has the same slopes.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np
import polars as pl
from scipy.stats import mannwhitneyu

from analytics import queries
from analytics.findings import finding
from analytics.regressions import baselines
from analytics.stats import judge_continuous

AGE_METRIC = "diffusion_ms_per_step"
RESET_METRIC = "reset_step_ratio"
MIN_STEPS = 16  # ordinary steps of a session for its slope
MIN_SESSIONS = 30  # per side
MIN_SLOPE_MS = 0.005
MIN_AGE_EFFECT = 0.005  # of the step time, by the median session's last step
RESET_FLOOR = 0.05
ALPHA = 0.01
CONSISTENT_P = 0.1  # a kind that leans the same way as the kinds that regressed, for the release's scope
CRITICAL_EFFECT = 0.10  # by the 95th-percentile session's last step
BASELINE_LOOKBACK = timedelta(days=7)


def run(store, start: datetime, end: datetime) -> list[dict]:
    rows = []
    for release, base, first_seen in baselines(store, end):
        s = queries.session_step_slopes(store, min(start, first_seen - BASELINE_LOOKBACK), end, [release, base],
                                        MIN_STEPS)
        t = s.filter((pl.col("release") == release) & (pl.col("start_ts") >= max(start, first_seen)))
        c = s.filter((pl.col("release") == base) & (pl.col("start_ts") >= first_seen - BASELINE_LOOKBACK))
        rows += judge(t, c, release, base, queries.day_floor(first_seen), end)
    return rows


def _age(t: pl.DataFrame, c: pl.DataFrame) -> dict | None:
    if t.height < MIN_SESSIONS or c.height < MIN_SESSIONS:
        return None
    a, b = t["slope_ms_per_step"].to_numpy(), c["slope_ms_per_step"].to_numpy()
    p = float(mannwhitneyu(a, b, alternative="greater").pvalue)
    slope = float(np.median(a)) - float(np.median(b))
    step_ms = float(np.median(t["step_ms"].to_numpy()))
    last, p95 = float(np.median(t["last_step"].to_numpy())), float(np.quantile(t["last_step"].to_numpy(), 0.95))
    effect = slope * last / step_ms if step_ms else 0.0
    return {"p_value": p, "slope_ms_per_step": slope, "treatment_slope": float(np.median(a)),
            "control_slope": float(np.median(b)), "step_ms": step_ms, "median_last_step": last, "p95_last_step": p95,
            "effect_at_median_length": effect, "effect_at_p95_length": slope * p95 / step_ms if step_ms else 0.0,
            "n_treatment": t.height, "n_control": c.height,
            "regressed": p < ALPHA and slope >= MIN_SLOPE_MS and effect >= MIN_AGE_EFFECT}


def _resets(t: pl.DataFrame, c: pl.DataFrame):
    t, c = t.filter(pl.col("reset_ratio").is_not_null()), c.filter(pl.col("reset_ratio").is_not_null())
    return judge_continuous(RESET_METRIC, t["reset_ratio"].to_numpy(), c["reset_ratio"].to_numpy(),
                            floor=RESET_FLOOR, min_samples=MIN_SESSIONS, alpha=ALPHA)


def _age_row(scope, kinds, j, base, since, end) -> dict:
    cond = (f"diffusion grows {j['slope_ms_per_step']:+.3f} ms a step within sessions (baseline {base}: "
            f"{j['control_slope']:+.3f}), {j['effect_at_median_length']:+.1%} by step {j['median_last_step']:.0f} "
            f"(median session), {j['effect_at_p95_length']:+.1%} by step {j['p95_last_step']:.0f} (p95)")
    return finding("regression", scope, AGE_METRIC, since, end, value=j["treatment_slope"],
                   baseline=j["control_slope"], effect=j["effect_at_median_length"], confidence=1 - j["p_value"],
                   severity="critical" if j["effect_at_p95_length"] >= CRITICAL_EFFECT else "warning",
                   evidence={**j, "baseline_release": base, "gpu_kinds": kinds, "condition": cond,
                             "judge": "per-session least-squares slope of diffusion_ms on the step index "
                                      "(ordinary steps), one-sided Mann-Whitney U against the baseline's"})


def judge(t: pl.DataFrame, c: pl.DataFrame, release: str, base: str, since: datetime, end: datetime) -> list[dict]:
    """Findings of ``release`` (sessions ``t``) against ``base`` (``c``), ``queries.session_step_slopes``'
    columns."""
    kinds = sorted(set(t["gpu_kind"].to_list()) & set(c["gpu_kind"].to_list())) if t.height and c.height else []
    ages = {k: _age(t.filter(pl.col("gpu_kind") == k), c.filter(pl.col("gpu_kind") == k)) for k in kinds}
    resets = {k: _resets(t.filter(pl.col("gpu_kind") == k), c.filter(pl.col("gpu_kind") == k)) for k in kinds}
    rows = []
    aged = [k for k, j in ages.items() if j and j["regressed"]]
    # the same on every kind (each at least leaning: p < ``CONSISTENT_P`` and the slope floor): one finding
    consistent = all(j and j["p_value"] < CONSISTENT_P and j["slope_ms_per_step"] >= MIN_SLOPE_MS for j in ages.values())
    if aged and consistent and len(kinds) > 1:
        j = _age(t, c)
        if j is not None:
            j["regressed_kinds"] = aged
            rows.append(_age_row({"release": release}, aged, j, base, since, end))
    else:
        rows += [_age_row({"release": release, "gpu_kind": k}, [k], ages[k], base, since, end) for k in aged]
    for k, r in resets.items():
        if r.regressed:
            rows.append(finding("regression", {"release": release, "gpu_kind": k}, RESET_METRIC, since, end,
                                value=r.treatment, baseline=r.control, effect=r.effect, confidence=1 - r.p_value,
                                severity="warning",
                                evidence={**r.as_dict(), "baseline_release": base, "condition":
                                          f"reset steps {r.treatment:.2f}x the ordinary steps' median "
                                          f"(baseline {base}: {r.control:.2f}x)"}))
    return rows
