"""The verdicts of ``livestep evaluate``: pure functions of the measured series (numpy + scipy).

    teacher_forced_verdict(cand, plain, k=2.0, atol=1e-3)   # per step: err <= k * err_plain + atol
    divergence_verdict(cand_runs, rerun_runs, bins=10)      # the curve inside the rerun band (bootstrap)
    drift_verdict(errors, segment=42)                       # a monotonic trend over session age?

Teacher-forced: the kernel tests' rule (flash-attention's ``err <= k * err_ref + atol``), step by step:
the candidate's error against the truth may be at most ``k`` times the plain path's own error plus
``atol`` (the metric's units), on all but ``MAX_OVER`` of the steps. A rule on *every* step is a
maximum over the steps, stricter the longer the run: over 1,000 tiny CPU steps the real static scales
broke it at 1 step (ratio 2.06) and the production set at 2, while a broken scale or rotation breaks it
at every step (docs/PERFORMANCE.md). ``MAX_OVER`` stays below one step in a reset interval (1/42), so a
break at the position resets alone still fails. Free-running: steps are cut into ``bins``; per run, the mean distance
in a bin; the bin passes when the lower end of the bootstrap interval of the candidate runs' mean does
not exceed ``k`` times the upper end of the reruns' (``scipy.stats.bootstrap``, percentile, 95 %). The
same k = 2 as the kernel tests: on the tiny model a rerun perturbation of one bf16 rounding step moves
the trajectory 0.6-0.9x as far as the real FP8 switches do (docs/PERFORMANCE.md), so k = 1 would
refuse every one of them; a broken scale or rotation lands orders of magnitude outside. Drift: the
series is averaged per ``segment`` (a position-reset interval) so that neighbouring steps' correlation
does not fake significance; Kendall's tau of segment mean vs age (the Mann-Kendall test,
``scipy.stats.kendalltau``) and the Theil-Sen slope (``scipy.stats.theilslopes``) over the session,
relative to the median: error accumulates when tau > 0 at p < ``alpha`` and grows by more than
``min_growth`` over the session.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

K = 2.0  # teacher-forced: the candidate's error may be twice the plain path's own ...
ATOL = 1e-3  # ... plus this (rel_l2 units) ...
MAX_OVER = 0.01  # ... on all but this share of the steps (below 100 steps: on every one)
K_DIVERGENCE = 2.0  # free-running: the candidate may move the trajectory at most twice as far as a rerun
CONFIDENCE = 0.95
ALPHA = 0.01  # drift: significance of the trend test
MIN_GROWTH = 0.10  # drift: and at least +10 % over the session


@dataclass
class Verdict:
    metric: str
    value: float
    verdict: str  # pass | fail | no_effect
    n: int
    band_lo: float | None = None
    band_hi: float | None = None
    detail: dict = field(default_factory=dict)
    curve: list[dict] = field(default_factory=list)  # points: step, value, band_lo, band_hi, verdict

    def as_dict(self) -> dict:
        return asdict(self)


def teacher_forced_verdict(cand: list[float], plain: list[float], *, k: float = K, atol: float = ATOL,
                           identical: bool = False, max_over: float = MAX_OVER) -> Verdict:
    """``value`` = mean candidate error / mean plain error; fail when more than ``max_over`` of the steps
    (rounded down: any step at all in a run under 1 / max_over steps) break the rule.
    ``identical``: the candidate equalled the plain path at every step (the switch does nothing here)."""
    c, p = np.asarray(cand, float), np.asarray(plain, float)
    if c.shape != p.shape or c.size == 0:
        raise ValueError(f"teacher-forced series of {c.size} and {p.size} steps: need the same, nonzero")
    bound = k * p + atol
    bad = np.flatnonzero(c > bound)
    ratio = float(c.mean() / p.mean()) if p.mean() > 0 else float("inf")
    allowed = int(max_over * c.size)
    verdict = "no_effect" if identical else ("fail" if bad.size > allowed else "pass")
    return Verdict("teacher_forced_ratio", ratio, verdict, int(c.size), None, k, detail={
        "k": k, "atol": atol, "steps_allowed_over": allowed, "worst_step": int(np.argmax(c / bound)), "worst": float((c / bound).max()),
        "max_ratio": float((c / np.maximum(p, 1e-30)).max()), "steps_over": int(bad.size),
        "mean_error": float(c.mean()), "mean_plain_error": float(p.mean())})


def mean_interval(x: np.ndarray, confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the mean of ``x`` (percentile; a constant sample is its own interval)."""
    from scipy.stats import bootstrap

    x = np.asarray(x, float)
    if x.size < 2 or np.ptp(x) == 0:
        return float(x.mean()), float(x.mean())
    ci = bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=2000, method="percentile",
                   rng=np.random.default_rng(seed)).confidence_interval
    return float(ci.low), float(ci.high)


def divergence_verdict(cand_runs: list[list[float]], rerun_runs: list[list[float]], *, bins: int = 10,
                       k: float = K_DIVERGENCE, confidence: float = CONFIDENCE) -> Verdict:
    """The candidate's divergence curve against the rerun band, per bin of steps: a bin fails when the
    candidate's interval lies wholly above ``k`` times the reruns' (k = 1: strictly within the band);
    ``value`` = the largest ratio of the candidate's mean distance to the reruns' over the bins."""
    c, r = np.asarray(cand_runs, float), np.asarray(rerun_runs, float)
    if c.ndim != 2 or r.ndim != 2 or c.shape[1] != r.shape[1] or min(c.shape[0], r.shape[0]) < 2:
        raise ValueError(f"runs x steps {c.shape} and {r.shape}: need >= 2 runs each over the same steps")
    steps = c.shape[1]
    edges = np.unique(np.linspace(0, steps, min(bins, steps) + 1).round().astype(int))
    curve, worst, failed = [], 0.0, 0
    for lo, hi in itertools.pairwise(edges):
        cm, rm = c[:, lo:hi].mean(1), r[:, lo:hi].mean(1)
        c_lo, _ = mean_interval(cm, confidence)
        r_lo, r_hi = mean_interval(rm, confidence)
        ok = c_lo <= k * r_hi
        failed += not ok
        ratio = float(cm.mean() / rm.mean()) if rm.mean() > 0 else float("inf") if cm.mean() > 0 else 1.0
        worst = max(worst, ratio)
        curve.append({"step": int(hi), "value": float(cm.mean()), "band_lo": r_lo, "band_hi": r_hi,
                      "rerun_mean": float(rm.mean()), "verdict": "pass" if ok else "fail"})
    return Verdict("divergence_ratio", worst, "fail" if failed else "pass", int(c.shape[0]),
                   curve[-1]["band_lo"], curve[-1]["band_hi"],
                   detail={"bins": len(curve), "bins_outside": failed, "steps": steps, "confidence": confidence,
                           "k": k},
                   curve=curve)


def drift_verdict(errors: list[float], *, segment: int = 42, stride: int = 1, alpha: float = ALPHA,
                  min_growth: float = MIN_GROWTH, metric: str = "drift_tau") -> Verdict:
    """Does the (teacher-forced) error grow with session age? ``value`` = Kendall's tau of the segment
    means vs age; the detail has p, the Theil-Sen slope and the growth over the session. ``stride``:
    session steps per point (a probed session: the steps between probes), for the curve's step axis."""
    from scipy.stats import kendalltau, theilslopes

    e = np.asarray(errors, float)
    n = e.size // segment
    if n < 4:
        raise ValueError(f"{e.size} steps make {n} segments of {segment}: the trend test needs >= 4")
    means = e[: n * segment].reshape(n, segment).mean(1)
    age = np.arange(n)
    tau, p = kendalltau(age, means)
    slope, _, s_lo, s_hi = theilslopes(means, age)
    med = float(np.median(means))
    growth = float(slope * (n - 1) / med) if med > 0 else 0.0
    accumulates = bool(tau > 0 and p < alpha and growth > min_growth)
    curve = [{"step": int((i + 1) * segment * stride), "value": float(m), "band_lo": None, "band_hi": None,
              "verdict": "fail" if accumulates else "pass"} for i, m in enumerate(means)]
    return Verdict(metric, float(tau), "fail" if accumulates else "pass", int(n), None, None, detail={
        "p_value": float(p), "sen_slope": float(slope), "sen_slope_ci": [float(s_lo), float(s_hi)],
        "growth": growth, "median": med, "segment": segment, "stride": stride, "alpha": alpha, "min_growth": min_growth},
        curve=curve)
