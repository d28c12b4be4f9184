"""Memory growth, judged against every shape key, sessions served and time, per worker process.

    procs, rows = analyze(store, start, end)   # polars (one row per process) + findings rows
    procs, rows = analyze_frame(sessions, oom_events, start, end)   # the same on a frame (tests)

A worker process starts at a deploy (its release changes) or after an ``oom`` event; it may have
started before the window, so its sessions are read from ``HISTORY`` earlier to count the shapes it
had seen (only the window's sessions are fitted). Within a process,
each session's peak reserved memory is regressed (one-sided ``linregress``) on each candidate
explanation of growth:

- each shape key of the contract (``collector.records.SHAPE_KEYS``: first-forward tokens, conditioning
  tokens, decoder output resolution, TP size, chunk frames): the number of its distinct values the
  process has seen so far (a buffer kept per new value grows with the *rate of new values*, invisible
  to a fixed-prompt benchmark); a key needs ``MIN_SHAPES`` distinct values to be judged;
- ``SIZED``: the tokens of the distinct first-forward lengths seen so far (a buffer sized by its shape,
  as the fused all-reduce's m x d_model x 2 bytes: the same key, bytes per token);
- ``per session``: the number of sessions served;
- ``over time``: hours since the process started.

A release is judged on all its processes at once (``judge_release``: each process its own slope, an
F test of the growing ones against the pooled residual spread, so a leak too small to see in one
process is seen in ten). Keys whose counts are identical in every process (first-forward and
conditioning tokens when the first forward is the prompt plus a fixed chunk) are aliases.

Which explanation names the growth is a stated decision rule (``name_key``), not the best R^2: two
explanations can fit the same curve (in a process's first day nearly every session brings a new prompt
length, so "per prompt length" and "per session" count alike). Each pair of rivals (explanations whose
own fit grows, p < ``RIVAL_P``) is fitted together in every process (``separate``); the evidence that
tells them apart is the sessions where one count moves and the other does not (a session that reuses a
prompt length grows under a per-session leak and not under a per-prompt one). One *beats* the other when
it grows memory beyond it (one-sided p < ``SEPARATE_P``, processes combined) and the other does not
beyond it. The explanation that beats every rival is named (``key_confident``); when none does, the
unbeaten ones are named together (``explained_by`` and ``ambiguous_with``, with each pair's test and
its count of sessions telling them apart): the store does not yet hold the evidence, and the finding
says so instead of guessing. Severity does not wait for it: the time to OOM is the shortest of the
ambiguous explanations'.

The release is flagged when the mean growth its named explanation explains over a process exceeds
``GROWTH_NOISE_K`` x the spread of reserved memory around the fits and one allocator segment
(``MIN_GROWTH``); a worker's reserved memory is exact, so the spread is floored at the allocator's
block (``SPREAD_FLOOR``). A process is flagged on its own
fit (the release's explanation when the release is flagged) by the same rules. There is no fixed
bytes-per-shape floor: a small leak is judged by what it does.

Severity is time to OOM: headroom (GPU memory - last reserved) / (bytes per unit x units per hour),
where units per hour is the FLEET's observed rate of new values of that key (the median, over
processes with ``RATE_MIN_HOURS`` of history, of new values per hour in their last ``RATE_WINDOW``),
sessions per hour for ``per session``, and 1 for ``over time``. Under ``CRITICAL_HOURS_TO_OOM`` (or
with OOMs on the worker's release) the finding is critical, however small the bytes per unit; a key
whose values stopped arriving (rate 0: a bounded rotation) has no time to OOM and stays a warning.

Attribution is by contrast (analytics/blame.py): a switch is blamed only when comparable processes
without it (same release and GPU kind, else the baseline releases') do not grow the same; when they do,
or there are none, or two switches contrast equally, no switch is blamed.

Why one module over ~450 lines: process reconstruction, the per-explanation fits, the fleet
roll-up and attribution share one frame layout and one set of thresholds; they are one detector.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import numpy as np
import polars as pl

from analytics import queries
from analytics.findings import finding
from analytics.stats import slope_test
from collector.gpu_kinds import canonical_gpu_kind
from collector.records import SHAPE_KEYS, SWITCH_NAMES, decode_switches

GIB = 2**30
# A process's GPU memory is what its worker reported (the session record's ``gpu_mem_total_bytes``), for any
# GPU; for workers before that field: the capacity its kind's OOM events reported, then this table of the
# kinds we run (bytes; keyed on canonical kinds, collector/gpu_kinds.py).
GPU_MEMORY_BYTES: dict[str, int] = {"h100": 80 * GIB, "h200": 141 * GIB, "b200": 192 * GIB, "a100": 80 * GIB}
MIN_SESSIONS = 8
MIN_SHAPES = 5
PER_SESSION = "per session"
OVER_TIME = "over time"
# A buffer sized by its shape (the fused all-reduce's is m x d_model x 2 bytes, m the first-forward tokens)
# grows with the tokens of the new values, not their count: its own explanation, of the same key.
SIZED = "first_forward_tokens, sized by its tokens"
SIZED_KEY = "first_forward_tokens"
# joins explanations' names in a process row: never a comma, which SIZED's name holds
NAMES_SEP = ";"
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
CRITICAL_HOURS_TO_OOM = 24.0
RATE_WINDOW = timedelta(hours=24)
RATE_MIN_HOURS = 2.0
HISTORY = timedelta(days=14)  # before the window: where a process started, which shapes it had seen


def _with_key_columns(s: pl.DataFrame) -> pl.DataFrame:
    """One column ``key:<name>`` per shape key (its columns joined; null when any is null)."""
    exprs = []
    for key, cols in SHAPE_KEYS.items():
        present = [c for c in cols if c in s.columns]
        if len(present) < len(cols):
            exprs.append(pl.lit(None, pl.String).alias(f"key:{key}"))
        else:
            exprs.append(pl.concat_str([pl.col(c).cast(pl.String) for c in cols], separator="x").alias(f"key:{key}"))
    return s.with_columns(exprs)


def sessions_with_processes(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Sessions in [start, end) with ``process`` (worker process id) and ``shapes_seen`` columns."""
    s = queries.memory_sessions(store, start, end)
    ooms = queries.events(store, "oom", start, end)
    return with_processes(s, ooms)


def with_processes(s: pl.DataFrame, ooms: pl.DataFrame) -> pl.DataFrame:
    """Sessions (``memory_sessions``' columns) with ``process``, a ``key:<name>`` column per shape key
    and ``shapes_seen`` (distinct first-forward token counts so far in the process)."""
    if s.is_empty():
        return s.with_columns(pl.lit("").alias("process"), pl.lit(0).alias("shapes_seen"))
    ooms = ooms.select("worker_id", pl.col("ts").alias("oom_ts"))
    ooms = ooms.sort("oom_ts").with_columns(pl.int_range(1, pl.len() + 1).over("worker_id").alias("n_oom"))
    s = s.sort("start_ts")
    if ooms.is_empty():
        s = s.with_columns(pl.lit(0).alias("n_oom"))
    else:
        s = s.join_asof(
            ooms, left_on="start_ts", right_on="oom_ts", by="worker_id", strategy="backward", check_sortedness=False
        )
        s = s.with_columns(pl.col("n_oom").fill_null(0))
    s = s.sort("worker_id", "start_ts").with_columns(
        (pl.col("release") != pl.col("release").shift(1)).over("worker_id").fill_null(True).alias("deploy")
    )
    s = s.with_columns(pl.col("deploy").cast(pl.Int64).cum_sum().over("worker_id").alias("deploys"))
    s = s.with_columns(
        pl.format("{}#{}#{}", "worker_id", "deploys", "n_oom").alias("process"),
    )
    s = _with_key_columns(s)
    s = s.with_columns(
        pl.col("first_forward_tokens").is_first_distinct().over("process").cast(pl.Int64).alias("new_shape")
    )
    return s.with_columns(pl.col("new_shape").cum_sum().over("process").alias("shapes_seen"))


def _capacity(g: pl.DataFrame, ooms: pl.DataFrame) -> int | None:
    """Per-GPU memory of a process: what its worker reported; else what its kind's OOM events reported;
    else the table's entry for its (canonical) kind."""
    if "gpu_mem_total_bytes" in g.columns and (reported := g["gpu_mem_total_bytes"].max()) is not None:
        return int(reported)
    gpu_kind = g["gpu_kind"][0]
    caps = [] if ooms.is_empty() else \
        [json.loads(d).get("capacity_bytes") for d in ooms.filter(pl.col("gpu_kind") == gpu_kind)["detail"]]
    caps = [c for c in caps if c]
    if caps:
        return int(max(caps))
    return GPU_MEMORY_BYTES.get(canonical_gpu_kind(gpu_kind))


def _seen(values: list) -> np.ndarray:
    """Distinct non-null values seen so far, per row."""
    seen: set = set()
    out = np.empty(len(values), dtype=float)
    for i, v in enumerate(values):
        if v is not None:
            seen.add(v)
        out[i] = len(seen)
    return out


def _seen_sum(values: list) -> np.ndarray:
    """Sum of the distinct non-null values seen so far, per row (the tokens of the new shapes)."""
    seen: set = set()
    total, out = 0.0, np.empty(len(values), dtype=float)
    for i, v in enumerate(values):
        if v is not None and v not in seen:
            seen.add(v)
            total += float(v)
        out[i] = total
    return out


def key_of(name: str) -> str:
    """The shape key (or 'per session' / 'over time') an explanation names."""
    return SIZED_KEY if name == SIZED else name


def _explainers(g: pl.DataFrame) -> dict[str, np.ndarray]:
    """Candidate x series of one process (sorted by start): each shape key's distinct values seen
    (every key, judged or not: see ``_judged``), the tokens of the distinct first-forward lengths seen
    (``SIZED``), sessions served, hours since the process started."""
    out: dict[str, np.ndarray] = {key: _seen(g[f"key:{key}"].to_list()) for key in SHAPE_KEYS}
    out[SIZED] = _seen_sum(g["first_forward_tokens"].to_list()) if "first_forward_tokens" in g.columns \
        else np.zeros(len(g))
    out[PER_SESSION] = np.arange(1, len(g) + 1, dtype=float)
    t = g["start_ts"].to_list()
    out[OVER_TIME] = np.array([(ti - t[0]).total_seconds() / 3600 for ti in t])
    return out


def _judged(name: str, x: np.ndarray) -> bool:
    """A shape key is judged once MIN_SHAPES of its values were seen (a constant key explains nothing)."""
    if name == SIZED:
        return False  # judged with its key (``_judged_all``)
    return name not in SHAPE_KEYS or (len(x) > 0 and x[-1] >= MIN_SHAPES)


def _judged_all(name: str, xs: list[dict[str, np.ndarray]]) -> bool:
    """Whether any process judges this explanation (``SIZED`` when any judges its key)."""
    return any(_judged(key_of(name), e[key_of(name)]) for e in xs)


def fleet_rates(s: pl.DataFrame) -> dict[str, float]:
    """New values per hour of each shape key, sessions per hour: the median over processes with
    ``RATE_MIN_HOURS`` of history of their rate in their last ``RATE_WINDOW``."""
    per: dict[str, list[float]] = {k: [] for k in (*SHAPE_KEYS, SIZED, PER_SESSION)}
    for _, g in s.group_by("process"):
        g = g.sort("start_ts")
        t = g["start_ts"].to_list()
        if (t[-1] - t[0]).total_seconds() / 3600 < RATE_MIN_HOURS:
            continue
        lo = t[-1] - RATE_WINDOW
        first = next(i for i, ti in enumerate(t) if ti >= lo)
        hours = max((t[-1] - max(lo, t[0])).total_seconds() / 3600, 1e-9)
        for key in (*SHAPE_KEYS, SIZED):
            x = _seen_sum(g["first_forward_tokens"].to_list()) if key == SIZED else _seen(g[f"key:{key}"].to_list())
            before = x[first - 1] if first > 0 else 0.0
            per[key].append((x[-1] - before) / hours)
        per[PER_SESSION].append((len(t) - first) / hours)
    return {k: float(np.median(v)) if v else 0.0 for k, v in per.items()} | {OVER_TIME: 1.0}


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
        if _judged_all(name, explainers):
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


def _judge_process(x: np.ndarray, y: np.ndarray, b: np.ndarray, shapes: np.ndarray) -> dict:
    """One process against one explanation: slope, p, spread around the fit, growth over the process;
    ``buf``: fused-kernel buffers per distinct value of its key (``shapes``: their count so far)."""
    f = slope_test(x, y)
    resid = y - (f.intercept + f.slope * x)
    spread = max(float(np.std(resid, ddof=2)), SPREAD_FLOOR) if len(y) > 2 else float("inf")
    growth = _explained_growth(f.slope, x, y) if len(x) else 0.0
    flagged = len(y) >= MIN_SESSIONS and f.p_value < MAX_P and f.slope > 0 and _beyond_noise(growth, spread)
    return {"fit": f, "spread": spread, "growth": growth, "buf": slope_test(shapes, b), "flagged": flagged,
            "fitted_last": f.intercept + f.slope * float(x[-1]) if len(x) else 0.0}


def analyze(store, start: datetime, end: datetime) -> tuple[pl.DataFrame, list[dict]]:
    """One row per worker process (slopes, p-values, time to OOM, flagged) and the findings rows, judged
    on [start, end); shapes are counted from ``HISTORY`` before it (a process outlives the window)."""
    s = queries.memory_sessions(store, start - HISTORY, end)
    return analyze_frame(s, queries.events(store, "oom", start - HISTORY, end), start, end)


def analyze_frame(s: pl.DataFrame, oom_events: pl.DataFrame, start: datetime | None = None,
                  end: datetime | None = None) -> tuple[pl.DataFrame, list[dict]]:
    """``analyze`` on a frame of ``queries.memory_sessions``' columns and the ``oom`` events. Sessions
    before ``start`` are history: they find where a process started and which shapes it had seen (a
    prompt length seen before the window is not new inside it), and count in the fleet's rates of new
    values; only the window's sessions are fitted and judged."""
    if s.is_empty():
        return pl.DataFrame(), []
    if oom_events.is_empty():
        oom_events = pl.DataFrame(schema={"worker_id": pl.String, "session_id": pl.String, "release": pl.String,
                                          "gpu_kind": pl.String, "ts": pl.Datetime("ms", "UTC"), "detail": pl.String})
    s = with_processes(s, oom_events)
    if start is not None:
        live = s.filter(pl.col("start_ts") >= start)["process"].unique()
        s = s.filter(pl.col("process").is_in(live.implode()))
        oom_events = oom_events.filter(pl.col("ts") >= start)
    rates = fleet_rates(s)
    oom_counts = oom_events.group_by("worker_id", "release").len("ooms")
    groups = []
    for key, g in s.group_by("process", maintain_order=True):
        g = g.sort("start_ts")
        xs, y, b = _explainers(g), g["mem_reserved_max"].to_numpy().astype(float), \
            g["buffers_max"].to_numpy().astype(float)
        if start is not None:  # the history counted the shapes; the window is judged
            keep = (g["start_ts"] >= start).to_numpy()
            g, xs, y, b = g.filter(pl.Series(keep)), {n: x[keep] for n, x in xs.items()}, y[keep], b[keep]
        groups.append((key[0], g, xs, y, b))
    releases = {}
    for rel in dict.fromkeys(g["release"][0] for _, g, *_ in groups):
        mine = [(e, y) for _, g, e, y, _ in groups if g["release"][0] == rel]
        releases[rel] = judge_release([e for e, _ in mine], [y for _, y in mine])
    procs = []
    for name, g, xs, y, b in groups:
        rel = releases[g["release"][0]]
        if rel["flagged"]:
            unit = rel["explained_by"]
        else:  # the process's own best fit
            own = {n: slope_test(x, y) for n, x in xs.items() if _judged_all(n, [xs])}
            r2 = {n: 1 - float(np.sum((y - f.intercept - f.slope * xs[n]) ** 2)) / max(float(np.sum((y - y.mean()) ** 2)), 1e-300)
                  for n, f in own.items()}
            unit = max(own, key=lambda n: (own[n].p_value < MAX_P and own[n].slope > 0, r2[n]))
        x = xs[unit]
        j = _judge_process(x, y, b, xs[key_of(unit)])
        gpu_kind = g["gpu_kind"][0]
        cap = _capacity(g, oom_events)
        slope = rel["slope"] if rel["flagged"] else j["fit"].slope  # the release's pooled slope when judged
        growth_per_hour = slope * rates.get(unit, 0.0)
        tto = max(cap - j["fitted_last"], 0.0) / growth_per_hour if cap and growth_per_hour > 0 else None
        ambiguous = rel["ambiguous_with"] if rel["flagged"] else []
        for other in ambiguous:  # not yet told apart: the shortest time to OOM of the explanations
            per_hour = rel["fits"][other]["slope"] * rates.get(other, 0.0)
            if cap and per_hour > 0:
                t_other = max(cap - j["fitted_last"], 0.0) / per_hour
                tto = t_other if tto is None else min(tto, t_other)
        states = [decode_switches(v) for v in g["switch_state"].to_list()]
        on = {n: float(np.mean([n in st for st in states])) for n in SWITCH_NAMES}
        procs.append(
            {
                "process": name,
                "worker_id": g["worker_id"][0],
                "release": g["release"][0],
                "gpu_kind": gpu_kind,
                "start_ts": g["start_ts"][0],
                "end_ts": g["start_ts"][-1],
                "sessions": len(g),
                "shapes": int(g["shapes_seen"][-1]),
                "explained_by": unit,
                "aliases": NAMES_SEP.join(rel["aliases"] if rel["flagged"] else []),
                "ambiguous_with": NAMES_SEP.join(ambiguous),
                "units_seen": float(x[-1]),
                "reserved_first": float(y[0]),
                "reserved_last": float(y[-1]),
                "bytes_per_shape": j["fit"].slope,  # per unit of ``explained_by``
                "bytes_p": j["fit"].p_value,
                "growth_bytes": j["growth"],
                "spread_bytes": j["spread"],
                "buffers_per_shape": j["buf"].slope,
                "buffers_p": j["buf"].p_value,
                "new_shapes_per_hour": rates.get(unit, 0.0),  # fleet rate of new values of ``explained_by``
                "capacity_bytes": cap,
                "hours_to_oom": tto,
                "flagged": j["flagged"],
                "release_flagged": rel["flagged"],
                "switches_on": on,
                "series": list(zip(x.tolist()[-60:], y.astype(np.int64).tolist()[-60:], b.astype(int).tolist()[-60:])),
            }
        )
    df = pl.DataFrame([{k: v for k, v in p.items() if k not in ("switches_on", "series")} for p in procs])
    rows = _findings(procs, releases, oom_counts, start, end)
    return df, rows


def attribute(procs: list[dict]) -> dict[str, dict]:
    """Per release with flagged processes: the switch blamed by contrast ('' when none explains it, or on a
    tie) and the evidence (analytics/blame.py ``memory_blame``)."""
    from analytics.blame import memory_blame

    out = {}
    for release in sorted({p["release"] for p in procs if p["flagged"]}):
        same = [p for p in procs if p["release"] == release and p["sessions"] >= MIN_SESSIONS]
        b = memory_blame(procs, release, MIN_SESSIONS)
        b["attribution_state"] = b.pop("state")
        out[release] = {**b, "affected_processes": sum(p["flagged"] for p in same),
                        "healthy_processes": sum(not p["flagged"] for p in same)}
    return out


def _findings(procs: list[dict], releases: dict[str, dict], oom_counts: pl.DataFrame, start: datetime | None,
              end: datetime | None) -> list[dict]:
    blame = attribute(procs)
    ooms = {(r["worker_id"], r["release"]): r["ooms"] for r in oom_counts.iter_rows(named=True)}
    rows = []
    for p in procs:
        if not p["flagged"]:
            continue
        tto = p["hours_to_oom"]
        n_oom = ooms.get((p["worker_id"], p["release"]), 0)
        critical = n_oom > 0 or (tto is not None and tto < CRITICAL_HOURS_TO_OOM)
        unit = p["explained_by"]
        metric = {PER_SESSION: "reserved_bytes_per_session", OVER_TIME: "reserved_bytes_per_hour"}.get(
            unit, "reserved_bytes_per_shape")
        rows.append(
            finding(
                "memory_growth",
                {"release": p["release"], "worker_id": p["worker_id"]},
                metric,
                p["start_ts"],
                p["end_ts"],
                value=p["bytes_per_shape"],
                baseline=p["reserved_first"],
                effect=p["buffers_per_shape"],
                confidence=1.0 - p["bytes_p"],
                severity="critical" if critical else "warning",
                attribution=blame[p["release"]]["attribution"],
                evidence={
                    "explained_by": unit,
                    "key": key_of(unit),
                    "aliases": p["aliases"].split(NAMES_SEP) if p["aliases"] else [],
                    "ambiguous_with": p["ambiguous_with"].split(NAMES_SEP) if p["ambiguous_with"] else [],
                    "units_seen": p["units_seen"],
                    "growth_bytes": p["growth_bytes"],
                    "spread_bytes": p["spread_bytes"],
                    "process": p["process"],
                    "gpu_kind": p["gpu_kind"],
                    "sessions": p["sessions"],
                    # the values of the key that explains it (14 resolutions, not the 82 prompt lengths)
                    "distinct_shapes": int(p["units_seen"]) if unit in SHAPE_KEYS else
                    (p["shapes"] if unit == SIZED else None),
                    "p_value": p["bytes_p"],
                    "buffers_per_shape": p["buffers_per_shape"],
                    "buffers_p_value": p["buffers_p"],
                    "new_shapes_per_hour": p["new_shapes_per_hour"],
                    "hours_to_oom": tto,
                    "capacity_bytes": p["capacity_bytes"],
                    "reserved_last": p["reserved_last"],
                    "ooms_on_worker_release": n_oom,
                    "series_shapes_reserved_buffers": p["series"],
                    "test": "scipy.stats.linregress one-sided (slope > 0) of peak reserved bytes on each shape key's "
                            "distinct values seen, sessions served and hours; the release's key_rule names it",
                },
            )
        )
    no_blame = {"attribution": "", "attribution_method": "", "affected_processes": 0, "healthy_processes": 0,
                "switches": {}, "attribution_state": "waiting"}  # no process grows on its own yet
    for release in dict.fromkeys(p["release"] for p in procs):
        rel = releases[release]
        same = [p for p in procs if p["release"] == release]
        bad = [p for p in same if p["flagged"]]
        if not bad and not rel["flagged"]:
            continue
        b = blame.get(release, no_blame)
        judged = same if rel["flagged"] else bad  # a release-wide growth: every process of it grows
        ttos = [p["hours_to_oom"] for p in judged if p["hours_to_oom"] is not None]
        n_oom = sum(v for (w, r), v in ooms.items() if r == release)
        # the release's own judgement names it when significant (short processes after OOMs each fit
        # noisily; a vote of their explanations named the wrong key), else the flagged processes' vote
        named = rel["flagged"] or rel["significant"]
        unit = rel["explained_by"] if named else max(keys := [p["explained_by"] for p in bad], key=keys.count)
        fits = {n: {k: v for k, v in f.items()} for n, f in rel["fits"].items()}
        rows.append(
            finding(
                "memory_growth",
                {"release": release},
                "processes_growing_per_shape",
                min(p["start_ts"] for p in same),
                max(p["end_ts"] for p in same),
                value=len(bad),
                baseline=len(same),
                effect=len(bad) / len(same),
                confidence=1.0 - min([p["bytes_p"] for p in bad] + ([rel["p_value"]] if rel["flagged"] else [])),
                severity="critical" if n_oom or (ttos and min(ttos) < CRITICAL_HOURS_TO_OOM) else "warning",
                attribution=b["attribution"],
                evidence={
                    **b,
                    "explained_by": unit,
                    "key": key_of(unit),
                    "aliases": rel["aliases"] if named else [],
                    "key_confident": bool(named and rel["key_confident"]),
                    "ambiguous_with": rel["ambiguous_with"] if named else [],
                    "key_tests": rel["key_tests"] if named else [],
                    "key_rule": f"each pair of significant explanations fitted together; one that grows memory "
                                f"beyond the other (one-sided p < {SEPARATE_P:g}) while the other does not beyond "
                                f"it beats it; the one that beats all is named, else the unbeaten are ambiguous",
                    "release_bytes_per_unit": rel.get("slope") if rel["flagged"] else None,
                    "release_p_value": rel.get("p_value") if rel["flagged"] else None,
                    "fits": fits,
                    "median_bytes_per_shape": float(np.median([p["bytes_per_shape"] for p in judged])),
                    "min_hours_to_oom": min(ttos) if ttos else None,
                    "ooms": n_oom,
                    "workers": sorted({p["worker_id"] for p in bad}),
                    "test": "within-process regression pooled over the release's processes (a fixed effect each) "
                            "of peak reserved bytes on each explanation; key_rule names it",
                },
            )
        )
    return rows
