"""The fits that judge memory growth (analytics/memory.py's detector): a release's processes against one
explanation at once (``release_fit``), two explanations told apart (``separate``), the stated rule that
names one (``name_key``, ``judge_release``), one process against one explanation (``judge_process``);
and the thresholds they share."""

from __future__ import annotations

import numpy as np

from analytics.memory_processes import OVER_TIME, judged_all, key_of
from analytics.stats import slope_test
from collector.records import SHAPE_KEYS

MIN_SESSIONS = 8
# p < MAX_P for the best of up to len(SHAPE_KEYS) + 2 fits per process (a Bonferroni share of 1e-3)
MAX_P = 1e-3 / (len(SHAPE_KEYS) + 2)
GROWTH_NOISE_K = 1.0
# A worker's peak reserved memory is exact at the caching allocator's resolution (the H200 soak held it to
# the MiB over 95 sessions): it reserves 2 MiB blocks for small allocations and segments of 20 MiB and
# up for large ones (c10/cuda/CUDACachingAllocator.cpp, kSmallBuffer / kLargeBuffer). So a fit can
# leave no residual at all: the residual spread is floored at the 2 MiB block's quantisation noise
# (2 MiB / sqrt(12)), and a growth within one 20 MiB segment over a process is the allocator's caching
# (it met a larger peak once), not a leak. Neither is a per-shape floor.
RESERVED_BLOCK = 2 * 2**20
SPREAD_FLOOR = RESERVED_BLOCK / 12**0.5
MIN_GROWTH = 20 * 2**20
SEPARATE_P = 1e-3  # one-sided: an explanation's growth beyond its rival's, this unlikely under noise alone
RIVAL_P = 0.05  # an explanation whose own fit grows at this level is a rival the named one must beat
MIN_SEPARATE_SESSIONS = 5  # a process's sessions for its own two-slope fit in ``separate``


def _explained_growth(slope: float, x: np.ndarray, y: np.ndarray) -> float:
    """The growth a fit explains over a process, and no more than its reserved memory moved: a line
    through one step (the allocator met a larger peak once) overstates it."""
    return min(slope * float(x[-1] - x[0]), float(np.ptp(y)))


def _beyond_noise(growth: float, spread: float) -> bool:
    """Growth that counts: beyond ``GROWTH_NOISE_K`` x the spread around the fit and one allocator
    segment (``MIN_GROWTH``)."""
    return growth > max(GROWTH_NOISE_K * spread, MIN_GROWTH)


def release_fit(xs: list[np.ndarray], ys: list[np.ndarray]) -> dict:
    """One explanation over a release's processes: each process its own intercept and slope (a leak
    hits some processes and not others: e.g. only those running a switch), judged together.

    ``r2``: the share of the processes' within-process variance the growing slopes explain;
    ``p_value``: F test of those slopes (positive ones: growth) against the pooled residual spread;
    ``spread``: that residual standard deviation (at least ``SPREAD_FLOOR``); ``slope``: the median slope of the processes that grow
    significantly (else of all); ``growth``: the mean growth the fits explain over a process (at most
    the range its reserved memory moved)."""
    from scipy.stats import f as f_dist

    ss_reg = ss_res = ss_tot = 0.0
    n = k = 0
    slopes, grown, growth = [], [], []
    for x, y in zip(xs, ys, strict=True):
        if len(x) < 3:
            continue
        fit = slope_test(x, y)
        xd, yd = x - x.mean(), y - y.mean()
        tot = float(yd @ yd)
        reg = fit.slope**2 * float(xd @ xd) if fit.slope > 0 else 0.0
        ss_tot += tot
        ss_reg += reg
        ss_res += tot - reg
        n += len(x)
        k += 1
        slopes.append(fit.slope)
        growth.append(_explained_growth(max(fit.slope, 0.0), x, y))
        if fit.slope > 0 and fit.p_value < MAX_P:
            grown.append(fit.slope)
    dof = n - 2 * k
    if k == 0 or dof < 2:
        return {"slope": 0.0, "p_value": 1.0, "r2": 0.0, "spread": 0.0, "growth": 0.0, "processes": k}
    spread2 = max(max(ss_res, 0.0) / dof, SPREAD_FLOOR**2)  # exact data leaves no residual
    p = float(f_dist.sf((ss_reg / k) / spread2, k, dof)) if ss_reg > 0 else 1.0
    return {"slope": float(np.median(grown or slopes)), "p_value": p, "r2": ss_reg / ss_tot if ss_tot > 0 else 0.0,
            "spread": float(np.sqrt(spread2)), "growth": float(np.mean(growth)), "processes": k,
            "ss_res": ss_res}


def separate(explainers: list[dict[str, np.ndarray]], ys: list[np.ndarray], a: str, b: str) -> dict:
    """Can the data tell explanation ``a`` from ``b``? In each process both at once: peak reserved =
    intercept + beta_a x a's count + beta_b x b's count (OLS, statsmodels; each process its own slopes:
    a leak may hit some processes and not others), and the one-sided p of each beta > 0, i.e. that the
    explanation grows memory *beyond* what the other explains. Under a leak per prompt length the
    sessions that reuse a length add nothing, so "per session" has no effect of its own; under a leak per
    session they grow like the rest, so "per prompt length" has none. The processes' p-values are
    combined (Stouffer, scipy). A process whose two counts are proportional (every prompt new so far)
    holds no evidence and is left out; ``collinear`` when none holds any. ``sessions_telling_apart``:
    the sessions, in the processes that hold evidence, where one count moves and the other does not
    (None against ``over time``, which moves at every session: there the evidence is the irregular gaps
    between sessions)."""
    import statsmodels.api as sm
    from scipy.stats import combine_pvalues
    from scipy.stats import t as t_dist

    p_a, p_b, coef_a, coef_b, telling, sessions = [], [], [], [], 0, 0
    for e, y in zip(explainers, ys, strict=True):
        if len(y) < MIN_SEPARATE_SESSIONS:
            continue
        design = np.c_[np.ones(len(y)), e[a], e[b]]
        if np.linalg.matrix_rank(design) < 3:
            continue
        fit = sm.OLS(y, design).fit()
        if fit.df_resid < 1:
            continue
        # standard errors at a residual spread of at least SPREAD_FLOOR: exact data fits with none
        bse = np.sqrt(np.diag(fit.normalized_cov_params)[1:] * max(float(fit.scale), SPREAD_FLOOR**2))
        tvalues = fit.params[1:] / bse
        p_a.append(float(t_dist.sf(tvalues[0], fit.df_resid)))
        p_b.append(float(t_dist.sf(tvalues[1], fit.df_resid)))
        coef_a.append(float(fit.params[1]))
        coef_b.append(float(fit.params[2]))
        telling += int(np.sum((np.diff(e[a]) > 0) != (np.diff(e[b]) > 0)))
        sessions += len(y)
    out = {"keys": [a, b], "processes": len(p_a), "sessions": sessions,
           "sessions_telling_apart": None if OVER_TIME in (a, b) else telling, "collinear": not p_a,
           "median_coef": {a: float(np.median(coef_a)) if coef_a else 0.0,
                           b: float(np.median(coef_b)) if coef_b else 0.0},
           "p_value": {a: 1.0, b: 1.0}}
    if p_a:
        clip = [min(max(p, 1e-300), 1 - 1e-16) for p in p_a], [min(max(p, 1e-300), 1 - 1e-16) for p in p_b]
        out["p_value"] = {a: float(combine_pvalues(clip[0], method="stouffer").pvalue),
                          b: float(combine_pvalues(clip[1], method="stouffer").pvalue)}
    return out


def name_key(explainers: list[dict[str, np.ndarray]], ys: list[np.ndarray], candidates: list[str]
             ) -> tuple[str, list[str], list[dict]]:
    """The decision rule for which explanation names a growth: each pair of candidates (the rivals:
    significant ones first, then by R^2) is fitted together (``separate``); ``a`` *beats* ``b`` when ``a`` grows memory
    beyond ``b`` (p < ``SEPARATE_P``) and ``b`` does not beyond ``a``. The candidate that beats every
    other is named. When none does, the candidates no other beats are ambiguous: the first of them (by
    R^2) is named, the rest are ``ambiguous_with`` it, and the finding says the store does not yet hold
    the evidence to tell them apart (a pair with no process that holds evidence beats neither way).
    Returns (named, ambiguous_with, the pairs' tests)."""
    tests, beaten = [], {c: set() for c in candidates}
    for i, a in enumerate(candidates):
        for b in candidates[i + 1:]:
            t = separate(explainers, ys, a, b)
            tests.append(t)
            pa, pb = t["p_value"][a], t["p_value"][b]
            if pa < SEPARATE_P <= pb:
                beaten[b].add(a)
            elif pb < SEPARATE_P <= pa:
                beaten[a].add(b)
    winners = [c for c in candidates if all(c in beaten[o] for o in candidates if o != c)]
    if winners:
        return winners[0], [], tests
    unbeaten = [c for c in candidates if not beaten[c]] or candidates
    return unbeaten[0], unbeaten[1:], tests


def judge_release(explainers: list[dict[str, np.ndarray]], ys: list[np.ndarray]) -> dict:
    """The explanation of one release's growth from all its processes (``release_fit`` per candidate):
    among the significant ones, the one ``name_key``'s rule names (``key_confident``), or the first of
    those it cannot tell apart (``ambiguous_with`` the rest); its aliases (identical counts); flagged
    when the mean growth it explains exceeds ``GROWTH_NOISE_K`` x the spread around the fits and
    ``MIN_GROWTH``."""
    fits = {}
    for name in explainers[0] if explainers else ():
        if judged_all(name, explainers):
            fits[name] = release_fit([e[name] for e in explainers], ys)
    significant = [n for n, f in fits.items() if f["p_value"] < MAX_P]
    if not fits:
        return {"flagged": False, "significant": False, "explained_by": "", "aliases": [], "ambiguous_with": [],
                "key_confident": False, "key_tests": [], "fits": {}}
    order = sorted(significant or fits, key=lambda n: (-fits[n]["r2"], list(fits).index(n)))

    def aliases_of(name):  # shape keys whose counts equal this one's in every process
        return [n for n in fits if n != name and n in SHAPE_KEYS and name in SHAPE_KEYS
                and all(np.array_equal(e[n], e[name]) for e in explainers)]

    best, ambiguous, tests = order[0], [], []
    if best in significant:  # the rivals: every explanation that nearly fits, one per group of aliases
        rivals = sorted((n for n in fits if fits[n]["p_value"] < RIVAL_P),
                        key=lambda n: (n not in significant, -fits[n]["r2"], list(fits).index(n)))
        reps = [n for i, n in enumerate(rivals) if not set(aliases_of(n)) & set(rivals[:i])]
        best, ambiguous, tests = name_key(explainers, ys, reps)
    aliases = aliases_of(best)
    f = fits[best]
    flagged = best in significant and _beyond_noise(f["growth"], f["spread"])
    confident = best in significant and all(key_of(a) == key_of(best) for a in ambiguous)
    return {"flagged": flagged, "significant": best in significant, "explained_by": best, "key": key_of(best),
            "aliases": aliases, "ambiguous_with": ambiguous, "key_confident": confident, "key_tests": tests,
            "fits": {n: {k: v for k, v in x.items() if k != "ss_res"} for n, x in fits.items()},
            **{k: v for k, v in f.items() if k != "ss_res"}}


def judge_process(x: np.ndarray, y: np.ndarray, b: np.ndarray, shapes: np.ndarray) -> dict:
    """One process against one explanation: slope, p, spread around the fit, growth over the process;
    ``buf``: fused-kernel buffers per distinct value of its key (``shapes``: their count so far)."""
    f = slope_test(x, y)
    resid = y - (f.intercept + f.slope * x)
    spread = max(float(np.std(resid, ddof=2)), SPREAD_FLOOR) if len(y) > 2 else float("inf")
    growth = _explained_growth(f.slope, x, y) if len(x) else 0.0
    flagged = len(y) >= MIN_SESSIONS and f.p_value < MAX_P and f.slope > 0 and _beyond_noise(growth, spread)
    return {"fit": f, "spread": spread, "growth": growth, "buf": slope_test(shapes, b), "flagged": flagged,
            "fitted_last": f.intercept + f.slope * float(x[-1]) if len(x) else 0.0}
