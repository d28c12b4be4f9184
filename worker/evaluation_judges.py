"""The verdicts of ``livestep evaluate``: pure functions of the measured series (numpy + scipy).

    b = band(impl_runs, plain_runs)                     # acceptable variation: correct implementations
    teacher_forced_verdict(cand_runs, plain_runs, b, resets)   # per step and per seed, reset steps apart
    trajectory_verdict(cand_runs, plain_runs, b)         # free-running distance to the truth, per bin
    drift_verdict(ratio)                                 # a long session: a trend, or a jump, with age?

**The band** (issue 31). Acceptable variation is the spread among *correct implementations* of the plain
path (worker/evaluation_implementations.py: other SDPA backends, a split-K and a bf16-accumulating GEMM,
tensorwise FP8 activation scales) over several weight seeds, prompts and noise sequences: each
implementation's error against the truth divided by the plain path's, per seed (``band``). This is the
paper's "judged against run-to-run variation of a task metric", with the variation a serving stack
really has: a change of floating-point evaluation order (Demmel & Nguyen, ARITH 2013; Higham,
"Accuracy and Stability of Numerical Algorithms", ch. 4), not a synthetic input jitter -- the H200
repeats a run bit for bit. Every judge measures *distance to the truth*, so a switch more accurate than
the plain path has a ratio below 1 and passes.

**Teacher-forced** (same state, same inputs, per step): the candidate fails when the lower end of the
bootstrap interval (95 %, over seeds x steps) of its error ratio lies above the band's top (the worst
seed of any correct implementation), or when more steps than ``MAX_OVER`` of a class break the
per-step bound ``step_hi x plain + atol`` (``step_hi``: the worst step any correct implementation had),
or *any* step exceeds ``CAP`` times its bound: the allowance is bounded in size, not only in count.
Position resets and the ``RESET_TAIL`` steps after each are their own class with their own allowance
(under 1 / MAX_OVER steps: none), and a run with fewer than ``MIN_RESETS`` resets judges them
``incomplete`` -- a break at every third reset cannot hide in the steady steps or outside the run.

**Free-running** (each arm on its own trajectory): per bin of steps, the candidate's distance to the
truth's trajectory over the plain path's, pooled over seeds; a bin fails when the lower end of its
interval lies above the band's top for the same bin, or any step above ``CAP`` times that.

**Drift** (a long free-running session, resumable: worker/evaluation_session.py): the ratio averaged per
position-reset interval; fails on a monotonic trend (Mann-Kendall: Kendall's tau of segment vs age, p <
``ALPHA``, Theil-Sen growth > ``MIN_GROWTH``) or on a jump: any segment above ``JUMP`` times the
session's median (a level shift in the last segments is not a trend).

**Non-finite values fail every judge** (a NaN compares False with any bound; the judges test
finiteness first), and the verdict says how many there were.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

ATOL = 1e-3  # the per-step bound's absolute slack (rel_l2 units)
MAX_OVER = 0.05  # a class may have this share of its steps over the per-step bound (below 20 steps: none) ...
CAP = 1.5  # ... none of them more than this times its bound
RESET_TAIL = 2  # the steps right after a position reset judged with it
MIN_RESETS = 3  # fewer resets in a run: the reset class is not judged (incomplete)
CONFIDENCE = 0.95
ALPHA = 0.01  # drift: significance of the trend test
MIN_GROWTH = 0.10  # drift: and at least +10 % over the session
JUMP = 2.0  # drift: a segment above this times the session's median


@dataclass
class Verdict:
    metric: str
    value: float
    verdict: str  # pass | fail | no_effect | incomplete
    n: int
    band_lo: float | None = None
    band_hi: float | None = None
    detail: dict = field(default_factory=dict)
    curve: list[dict] = field(default_factory=list)  # points: step, value, band_lo, band_hi, verdict

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Band:
    """Acceptable variation: the correct implementations' error ratios to the plain path's."""

    lo: float  # the lowest per-seed mean ratio (at most 1: the plain path is a member)
    hi: float  # the highest per-seed mean ratio (at least 1)
    step_hi: float  # the highest per-step ratio any of them had (at least 1)
    members: dict[str, list[float]]  # implementation -> per-seed mean ratio

    def as_dict(self) -> dict:
        return asdict(self)


def _runs(x) -> list[np.ndarray]:
    return [np.asarray(r, float) for r in x]


def _nonfinite(*series) -> int:
    return int(sum((~np.isfinite(np.asarray(r, float))).sum() for s in series for r in s))


def band(impl_runs: dict[str, list[list[float]]], plain_runs: list[list[float]]) -> Band:
    """``impl_runs``: implementation -> per seed, its per-step errors against the truth; ``plain_runs``:
    per seed, the plain path's. The plain path itself is a member (ratio 1)."""
    plain = _runs(plain_runs)
    members, step_hi = {}, 1.0
    for name, runs in impl_runs.items():
        rs = _runs(runs)
        if _nonfinite(rs):
            raise ValueError(f"implementation {name} has non-finite errors: it is not a correct implementation here")
        members[name] = [float(r.mean() / max(p.mean(), 1e-30)) for r, p in zip(rs, plain, strict=True)]
        step_hi = max(step_hi, *(float((r / np.maximum(p, 1e-30)).max()) for r, p in zip(rs, plain, strict=True)))
    flat = [v for m in members.values() for v in m]
    return Band(min([1.0, *flat]), max([1.0, *flat]), step_hi, members)


def mean_interval(x: np.ndarray, confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the mean of ``x`` (percentile; a constant sample is its own interval)."""
    from scipy.stats import bootstrap

    x = np.asarray(x, float)
    if x.size < 2 or np.ptp(x) == 0:
        return float(x.mean()), float(x.mean())
    ci = bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=2000, method="percentile",
                   rng=np.random.default_rng(seed)).confidence_interval
    return float(ci.low), float(ci.high)


def reset_class(resets: list[bool], tail: int = RESET_TAIL, steps: list[int] | None = None) -> np.ndarray:
    """Which entries are a position reset or one of the ``tail`` steps after one (``steps``: the session
    step of each entry, for a probed run; default 0..n-1)."""
    steps = list(range(len(resets))) if steps is None else steps
    at = [s for s, r in zip(steps, resets, strict=True) if r]
    return np.array([any(0 <= s - a <= tail for a in at) for s in steps], bool)


def _step_rule(c: np.ndarray, bound: np.ndarray) -> dict:
    """The per-step rule on one class: steps over the bound (count allowed: MAX_OVER, size: CAP)."""
    over = c > bound
    allowed = int(MAX_OVER * c.size)
    worst = float((c / bound).max()) if c.size else 0.0
    return {"steps": int(c.size), "steps_over": int(over.sum()), "steps_allowed_over": allowed, "worst": worst,
            "ok": bool(over.sum() <= allowed and worst <= CAP)}


def teacher_forced_verdict(cand_runs, plain_runs, b: Band, resets, *, steps=None, atol: float = ATOL,
                           identical: bool = False) -> Verdict:
    """``cand_runs``/``plain_runs``: per seed, per probed step, the error against the truth; ``resets``
    (and ``steps``, for probed runs): per seed, per entry, whether it was a position reset (its session
    step). ``value``: the candidate's mean error ratio over seeds; ``band_hi``: the band's top."""
    c, p = _runs(cand_runs), _runs(plain_runs)
    if len(c) != len(p) or any(x.shape != y.shape or x.size == 0 for x, y in zip(c, p, strict=True)):
        raise ValueError("teacher-forced series: the candidate's and the plain path's need the same seeds and steps")
    bad = _nonfinite(c, p)
    if bad:
        return Verdict("teacher_forced_ratio", float("inf"), "fail", sum(x.size for x in c), b.lo, b.hi,
                       detail={"nonfinite": bad, "why": f"{bad} non-finite errors"})
    ratios = np.concatenate([x / np.maximum(y, 1e-30) for x, y in zip(c, p, strict=True)])
    per_seed = [float(x.mean() / max(y.mean(), 1e-30)) for x, y in zip(c, p, strict=True)]
    lo, hi = mean_interval(ratios)
    value = float(np.mean(per_seed))
    cc, bound = np.concatenate(c), np.concatenate([b.step_hi * y + atol for y in p])
    steps = steps or [None] * len(c)
    rc = np.concatenate([reset_class(r, steps=s) for r, s in zip(resets, steps, strict=True)])
    n_resets = int(sum(np.sum(r) for r in resets))
    steady, at_resets = _step_rule(cc[~rc], bound[~rc]), _step_rule(cc[rc], bound[rc])
    why = []
    if lo > b.hi:
        why.append(f"error ratio {value:.3f} (interval from {lo:.3f}) above the band's top {b.hi:.3f}")
    if not steady["ok"]:
        why.append(f"steady steps: {steady['steps_over']} over the per-step bound (allowed {steady['steps_allowed_over']}), "
                   f"worst {steady['worst']:.3g}x its bound (cap {CAP})")
    if n_resets >= MIN_RESETS and not at_resets["ok"]:
        why.append(f"reset steps: {at_resets['steps_over']} of {at_resets['steps']} over the per-step bound "
                   f"(allowed {at_resets['steps_allowed_over']}), worst {at_resets['worst']:.3g}x its bound")
    verdict = "no_effect" if identical else "fail" if why else "pass" if n_resets >= MIN_RESETS else "incomplete"
    if verdict == "incomplete":
        why.append(f"{n_resets} position resets in the run: the reset class needs >= {MIN_RESETS}")
    return Verdict("teacher_forced_ratio", value, verdict, int(cc.size), b.lo, b.hi, detail={
        "interval": [lo, hi], "per_seed": per_seed, "step_hi": b.step_hi, "atol": atol, "cap": CAP,
        "steady": steady, "reset": at_resets, "resets": n_resets, "nonfinite": 0, "why": "; ".join(why),
        "mean_error": float(cc.mean()), "mean_plain_error": float(np.concatenate(p).mean())})


def _bins(steps: int, bins: int) -> list[tuple[int, int]]:
    return list(itertools.pairwise(np.unique(np.linspace(0, steps, min(bins, steps) + 1).round().astype(int))))


def trajectory_verdict(cand_runs, plain_runs, impl_runs: dict[str, list[list[float]]], *, bins: int = 10,
                       metric: str = "divergence_ratio") -> Verdict:
    """Free-running: per bin of steps, the candidate's distance to the truth's trajectory over the plain
    path's (per seed, then pooled); the band per bin from the implementations the same way. ``value``:
    the largest bin ratio; a bin fails when its interval lies wholly above the band's top there, or one
    of its steps lies above CAP times the band's top."""
    c, p = _runs(cand_runs), _runs(plain_runs)
    if len(c) != len(p) or len({x.size for x in (*c, *p)}) != 1:
        raise ValueError("free-running series: the candidate's and the plain path's need the same seeds and steps")
    bad = _nonfinite(c, p)
    if bad:
        return Verdict(metric, float("inf"), "fail", len(c), None, None,
                       detail={"nonfinite": bad, "why": f"{bad} non-finite distances"})
    impls = {k: _runs(v) for k, v in impl_runs.items()}
    curve, worst, failed = [], 0.0, 0
    for lo_, hi_ in _bins(c[0].size, bins):
        def ratio(runs, lo_=lo_, hi_=hi_):
            return np.array([r[lo_:hi_].mean() / max(q[lo_:hi_].mean(), 1e-30) for r, q in zip(runs, p, strict=True)])

        cr = ratio(c)
        band_hi = max([1.0, *(float(ratio(r).max()) for r in impls.values())])
        step_worst = max(float((x[lo_:hi_] / np.maximum(q[lo_:hi_], 1e-30)).max()) for x, q in zip(c, p, strict=True))
        c_lo, _ = mean_interval(cr)
        ok = c_lo <= band_hi and step_worst <= CAP * b_step(impls, p, lo_, hi_)
        failed += not ok
        worst = max(worst, float(cr.mean()))
        curve.append({"step": int(hi_), "value": float(cr.mean()), "band_lo": 1.0, "band_hi": band_hi,
                      "verdict": "pass" if ok else "fail"})
    why = f"{failed} of {len(curve)} bins of steps above the band's top (or a step above {CAP}x it)" if failed else ""
    return Verdict(metric, worst, "fail" if failed else "pass", len(c), curve[-1]["band_lo"], curve[-1]["band_hi"],
                   detail={"bins": len(curve), "bins_outside": failed, "steps": int(c[0].size), "nonfinite": 0,
                           "seeds": len(c), "why": why}, curve=curve)


def b_step(impls: dict[str, list[np.ndarray]], plain: list[np.ndarray], lo: int, hi: int) -> float:
    """The worst per-step ratio of any implementation in steps [lo, hi) (1 without implementations)."""
    got = [float((r[lo:hi] / np.maximum(q[lo:hi], 1e-30)).max()) for runs in impls.values()
           for r, q in zip(runs, plain, strict=True)]
    return max([1.0, *got])


def drift_verdict(errors, *, segment: int = 42, stride: int = 1, alpha: float = ALPHA, min_growth: float = MIN_GROWTH,
                  jump: float = JUMP, metric: str = "drift_tau") -> Verdict:
    """Does the series (an error ratio over a long session) grow with age, or jump? ``value`` = Kendall's
    tau of the segment means vs age; the detail has p, the Theil-Sen slope, the growth over the session and
    the largest segment over the median. ``stride``: session steps per point, for the curve's step axis."""
    from scipy.stats import kendalltau, theilslopes

    e = np.asarray(errors, float)
    n = e.size // segment
    if n < 4:
        raise ValueError(f"{e.size} steps make {n} segments of {segment}: the trend test needs >= 4")
    bad = _nonfinite([e])
    if bad:
        return Verdict(metric, float("nan"), "fail", n, detail={"nonfinite": bad, "why": f"{bad} non-finite values"})
    means = e[: n * segment].reshape(n, segment).mean(1)
    age = np.arange(n)
    tau, p = kendalltau(age, means)
    tau, p = (0.0, 1.0) if not np.isfinite(tau) else (float(tau), float(p))  # a constant series: no trend
    slope, _, s_lo, s_hi = theilslopes(means, age)
    med = float(np.median(means))
    growth = float(slope * (n - 1) / med) if med > 0 else 0.0
    top = float(means.max() / med) if med > 0 else 1.0
    accumulates = bool(tau > 0 and p < alpha and growth > min_growth)
    jumps = top > jump
    why = "; ".join([*(["a monotonic trend"] if accumulates else []),
                     *([f"a segment at {top:.3g}x the median"] if jumps else [])])
    verdict = "fail" if why else "pass"
    curve = [{"step": int((i + 1) * segment * stride), "value": float(m), "band_lo": None,
              "band_hi": float(jump * med), "verdict": "fail" if (accumulates or m > jump * med) else "pass"}
             for i, m in enumerate(means)]
    return Verdict(metric, tau, verdict, int(n), None, float(jump * med), detail={
        "p_value": p, "sen_slope": float(slope), "sen_slope_ci": [float(s_lo), float(s_hi)], "growth": growth,
        "median": med, "max_over_median": top, "segment": segment, "stride": stride, "alpha": alpha,
        "min_growth": min_growth, "jump": jump, "nonfinite": 0, "why": why}, curve=curve)
