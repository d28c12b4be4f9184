"""Memory growth, judged against every shape key, sessions served and time, per worker process.

    procs, rows = analyze(store, start, end)   # polars (one row per process) + findings rows
    procs, rows = analyze_frame(sessions, oom_events)   # the same on a frame (tests, evaluate-detectors)

A worker process starts at a deploy (its release changes) or after an ``oom`` event. Within a process,
each session's peak reserved memory is regressed (one-sided ``linregress``) on each candidate
explanation of growth:

- each shape key of the contract (``collector.records.SHAPE_KEYS``: first-forward tokens, conditioning
  tokens, decoder output resolution, TP size, chunk frames): the number of its distinct values the
  process has seen so far (a buffer kept per new value grows with the *rate of new values*, invisible
  to a fixed-prompt benchmark); a key needs ``MIN_SHAPES`` distinct values to be judged;
- ``per session``: the number of sessions served;
- ``over time``: hours since the process started.

A release is judged on all its processes at once (``judge_release``: each process its own slope, an
F test of the growing ones against the pooled residual spread, so a leak too small to see in one
process is seen in ten). The significant explanation (p < ``MAX_P``) that explains the most variance
names the growth; keys whose counts are identical (e.g. first-forward and conditioning tokens when the
first forward is the prompt plus a fixed chunk) are its aliases, and candidates whose residual is
within the noise of the best's are listed as ``also_fits`` (early in a process new prompt lengths
arrive with nearly every session, and "per prompt length" cannot yet be told from "per session").
It is flagged when the mean growth explained over a process exceeds ``GROWTH_NOISE_K`` x the spread
of reserved memory around the fits. A process is flagged on its own fit (the release's explanation
when the release is flagged) by the same rules. There is no fixed bytes-per-shape floor: a small
leak is judged by what it does.

Severity is time to OOM: headroom (GPU memory - last reserved) / (bytes per unit x units per hour),
where units per hour is the FLEET's observed rate of new values of that key (the median, over
processes with ``RATE_MIN_HOURS`` of history, of new values per hour in their last ``RATE_WINDOW``),
sessions per hour for ``per session``, and 1 for ``over time``. Under ``CRITICAL_HOURS_TO_OOM`` (or
with OOMs on the worker's release) the finding is critical, however small the bytes per unit; a key
whose values stopped arriving (rate 0: a bounded rotation) has no time to OOM and stays a warning.

Attribution is by contrast (analytics/blame.py): a switch is blamed only when comparable processes
without it (same release and GPU kind, else the baseline releases') do not grow the same; when they do,
or there are none, or two switches contrast equally, no switch is blamed.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import numpy as np
import polars as pl

from analytics import queries
from analytics.findings import finding
from analytics.stats import slope_test
from collector.records import SHAPE_KEYS, SWITCH_NAMES, decode_switches

GIB = 2**30
# Per-GPU memory of the kinds we run (bytes); an unknown kind falls back to the OOM events' capacity.
GPU_MEMORY_BYTES: dict[str, int] = {"h100": 80 * GIB, "h200": 141 * GIB, "b200": 192 * GIB, "a100": 80 * GIB}
MIN_SESSIONS = 8
MIN_SHAPES = 5
PER_SESSION = "per session"
OVER_TIME = "over time"
# p < MAX_P for the best of up to len(SHAPE_KEYS) + 2 fits per process (a Bonferroni share of 1e-3)
MAX_P = 1e-3 / (len(SHAPE_KEYS) + 2)
GROWTH_NOISE_K = 1.0
AMBIGUOUS_CHI2 = 10.83  # chi-square(1) at p = 0.001: a residual difference the noise makes 1 time in 1000
CRITICAL_HOURS_TO_OOM = 24.0
RATE_WINDOW = timedelta(hours=24)
RATE_MIN_HOURS = 2.0


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


def _capacity(gpu_kind: str, ooms: pl.DataFrame) -> int | None:
    """Per-GPU memory of a kind; an unknown kind takes the capacity its OOM events reported."""
    if gpu_kind in GPU_MEMORY_BYTES:
        return GPU_MEMORY_BYTES[gpu_kind]
    if ooms.is_empty():
        return None
    caps = [json.loads(d).get("capacity_bytes") for d in ooms.filter(pl.col("gpu_kind") == gpu_kind)["detail"]]
    caps = [c for c in caps if c]
    return int(max(caps)) if caps else None


def _seen(values: list) -> np.ndarray:
    """Distinct non-null values seen so far, per row."""
    seen: set = set()
    out = np.empty(len(values), dtype=float)
    for i, v in enumerate(values):
        if v is not None:
            seen.add(v)
        out[i] = len(seen)
    return out


def _explainers(g: pl.DataFrame) -> dict[str, np.ndarray]:
    """Candidate x series of one process (sorted by start): each shape key's distinct values seen
    (every key, judged or not: see ``_judged``), sessions served, hours since the process started."""
    out: dict[str, np.ndarray] = {key: _seen(g[f"key:{key}"].to_list()) for key in SHAPE_KEYS}
    out[PER_SESSION] = np.arange(1, len(g) + 1, dtype=float)
    t = g["start_ts"].to_list()
    out[OVER_TIME] = np.array([(ti - t[0]).total_seconds() / 3600 for ti in t])
    return out


def _judged(name: str, x: np.ndarray) -> bool:
    """A shape key is judged once MIN_SHAPES of its values were seen (a constant key explains nothing)."""
    return name not in SHAPE_KEYS or (len(x) > 0 and x[-1] >= MIN_SHAPES)


def fleet_rates(s: pl.DataFrame) -> dict[str, float]:
    """New values per hour of each shape key, sessions per hour: the median over processes with
    ``RATE_MIN_HOURS`` of history of their rate in their last ``RATE_WINDOW``."""
    per: dict[str, list[float]] = {k: [] for k in (*SHAPE_KEYS, PER_SESSION)}
    for _, g in s.group_by("process"):
        g = g.sort("start_ts")
        t = g["start_ts"].to_list()
        if (t[-1] - t[0]).total_seconds() / 3600 < RATE_MIN_HOURS:
            continue
        lo = t[-1] - RATE_WINDOW
        first = next(i for i, ti in enumerate(t) if ti >= lo)
        hours = max((t[-1] - max(lo, t[0])).total_seconds() / 3600, 1e-9)
        for key in SHAPE_KEYS:
            x = _seen(g[f"key:{key}"].to_list())
            before = x[first - 1] if first > 0 else 0.0
            per[key].append((x[-1] - before) / hours)
        per[PER_SESSION].append((len(t) - first) / hours)
    return {k: float(np.median(v)) if v else 0.0 for k, v in per.items()} | {OVER_TIME: 1.0}


def release_fit(xs: list[np.ndarray], ys: list[np.ndarray]) -> dict:
    """One explanation over a release's processes: each process its own intercept and slope (a leak
    hits some processes and not others: e.g. only those running a switch), judged together.

    ``r2``: the share of the processes' within-process variance the growing slopes explain;
    ``p_value``: F test of those slopes (positive ones: growth) against the pooled residual spread;
    ``spread``: that residual standard deviation; ``slope``: the median slope of the processes that grow
    significantly (else of all); ``growth``: the mean growth the fits explain over a process."""
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
        growth.append(max(fit.slope, 0.0) * float(x[-1] - x[0]))
        if fit.slope > 0 and fit.p_value < MAX_P:
            grown.append(fit.slope)
    dof = n - 2 * k
    if k == 0 or dof < 2 or ss_res <= 0:
        return {"slope": 0.0, "p_value": 1.0, "r2": 0.0, "spread": float("inf"), "growth": 0.0, "processes": k}
    spread2 = ss_res / dof
    p = float(f_dist.sf((ss_reg / k) / spread2, k, dof)) if ss_reg > 0 else 1.0
    return {"slope": float(np.median(grown or slopes)), "p_value": p, "r2": ss_reg / ss_tot if ss_tot > 0 else 0.0,
            "spread": float(np.sqrt(spread2)), "growth": float(np.mean(growth)), "processes": k,
            "ss_res": ss_res}


def judge_release(explainers: list[dict[str, np.ndarray]], ys: list[np.ndarray]) -> dict:
    """The explanation of one release's growth from all its processes (``release_fit`` per candidate):
    the significant one that leaves the least residual; the candidates it cannot be told from (their
    residual within ``AMBIGUOUS_CHI2`` noise variances of the best's); its aliases (identical counts);
    flagged when the mean growth it explains exceeds ``GROWTH_NOISE_K`` x the spread around the fits."""
    fits = {}
    for name in explainers[0] if explainers else ():
        xs = [e[name] for e in explainers]
        if any(_judged(name, x) for x in xs):
            fits[name] = release_fit(xs, ys)
    significant = [n for n, f in fits.items() if f["p_value"] < MAX_P]
    if not fits:
        return {"flagged": False, "significant": False, "explained_by": "", "aliases": [], "also_fits": [],
                "fits": {}}
    best = max(significant or fits, key=lambda n: (fits[n]["r2"], -list(fits).index(n)))
    f = fits[best]
    aliases = [n for n in fits if n != best and n in SHAPE_KEYS
               and all(np.array_equal(e[n], e[best]) for e in explainers)]
    also = [n for n in significant if n != best and n not in aliases and f.get("ss_res") is not None
            and fits[n]["ss_res"] - f["ss_res"] < AMBIGUOUS_CHI2 * f["spread"] ** 2]
    flagged = best in significant and f["growth"] > GROWTH_NOISE_K * f["spread"]
    return {"flagged": flagged, "significant": best in significant, "explained_by": best, "aliases": aliases,
            "also_fits": also,
            "fits": {n: {k: v for k, v in x.items() if k != "ss_res"} for n, x in fits.items()},
            **{k: v for k, v in f.items() if k != "ss_res"}}


def _judge_process(x: np.ndarray, y: np.ndarray, b: np.ndarray) -> dict:
    """One process against one explanation: slope, p, spread around the fit, growth over the process."""
    f = slope_test(x, y)
    resid = y - (f.intercept + f.slope * x)
    spread = float(np.std(resid, ddof=2)) if len(y) > 2 else float("inf")
    growth = f.slope * float(x[-1] - x[0]) if len(x) else 0.0
    flagged = len(y) >= MIN_SESSIONS and f.p_value < MAX_P and f.slope > 0 and growth > GROWTH_NOISE_K * spread
    return {"fit": f, "spread": spread, "growth": growth, "buf": slope_test(x, b), "flagged": flagged,
            "fitted_last": f.intercept + f.slope * float(x[-1]) if len(x) else 0.0}


def analyze(store, start: datetime, end: datetime) -> tuple[pl.DataFrame, list[dict]]:
    """One row per worker process (slopes, p-values, time to OOM, flagged) and the findings rows."""
    s = queries.memory_sessions(store, start, end)
    return analyze_frame(s, queries.events(store, "oom", start, end), start, end)


def analyze_frame(s: pl.DataFrame, oom_events: pl.DataFrame, start: datetime | None = None,
                  end: datetime | None = None) -> tuple[pl.DataFrame, list[dict]]:
    """``analyze`` on a frame of ``queries.memory_sessions``' columns and the window's ``oom`` events."""
    if s.is_empty():
        return pl.DataFrame(), []
    if oom_events.is_empty():
        oom_events = pl.DataFrame(schema={"worker_id": pl.String, "session_id": pl.String, "release": pl.String,
                                          "gpu_kind": pl.String, "ts": pl.Datetime("ms", "UTC"), "detail": pl.String})
    s = with_processes(s, oom_events)
    rates = fleet_rates(s)
    oom_counts = oom_events.group_by("worker_id", "release").len("ooms")
    groups = []
    for key, g in s.group_by("process", maintain_order=True):
        g = g.sort("start_ts")
        groups.append((key[0], g, _explainers(g), g["mem_reserved_max"].to_numpy().astype(float),
                       g["buffers_max"].to_numpy().astype(float)))
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
            own = {n: slope_test(x, y) for n, x in xs.items() if _judged(n, x)}
            r2 = {n: 1 - float(np.sum((y - f.intercept - f.slope * xs[n]) ** 2)) / max(float(np.sum((y - y.mean()) ** 2)), 1e-300)
                  for n, f in own.items()}
            unit = max(own, key=lambda n: (own[n].p_value < MAX_P and own[n].slope > 0, r2[n]))
        x = xs[unit]
        j = _judge_process(x, y, b)
        gpu_kind = g["gpu_kind"][0]
        cap = _capacity(gpu_kind, oom_events)
        slope = rel["slope"] if rel["flagged"] else j["fit"].slope  # the release's pooled slope when judged
        growth_per_hour = slope * rates.get(unit, 0.0)
        tto = max(cap - j["fitted_last"], 0.0) / growth_per_hour if cap and growth_per_hour > 0 else None
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
                "aliases": ",".join(rel["aliases"] if rel["flagged"] else []),
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
                    "aliases": p["aliases"].split(",") if p["aliases"] else [],
                    "units_seen": p["units_seen"],
                    "growth_bytes": p["growth_bytes"],
                    "spread_bytes": p["spread_bytes"],
                    "process": p["process"],
                    "gpu_kind": p["gpu_kind"],
                    "sessions": p["sessions"],
                    "distinct_shapes": p["shapes"],
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
                            "distinct values seen, sessions served and hours; the best significant fit (R^2) names it",
                },
            )
        )
    no_blame = {"attribution": "", "attribution_method": "", "affected_processes": 0, "healthy_processes": 0,
                "switches": {}}
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
                    "aliases": rel["aliases"] if named else [],
                    "also_fits": rel["also_fits"] if named else [],
                    "release_bytes_per_unit": rel.get("slope") if rel["flagged"] else None,
                    "release_p_value": rel.get("p_value") if rel["flagged"] else None,
                    "fits": fits,
                    "median_bytes_per_shape": float(np.median([p["bytes_per_shape"] for p in judged])),
                    "min_hours_to_oom": min(ttos) if ttos else None,
                    "ooms": n_oom,
                    "workers": sorted({p["worker_id"] for p in bad}),
                    "test": "within-process regression pooled over the release's processes (a fixed effect each) "
                            "of peak reserved bytes on each explanation; the best significant fit (R^2) names it",
                },
            )
        )
    return rows
