"""Memory growth per new shape: the August incident's signature, per worker process.

    procs, rows = analyze(store, start, end)   # polars (one row per process) + findings rows

A worker process starts at a deploy (its release changes) or after an ``oom`` event. Within a
process, each session's peak reserved memory and ``buffers_registered`` are regressed on the
number of distinct first-forward token counts the process has seen so far (not on time: a leak
per shape is invisible to a fixed-prompt benchmark, and grows with the *rate of new shapes*).
A process is flagged when the slope is significant (one-sided linregress, p < ``MAX_P``) and at
least ``MIN_BYTES_PER_SHAPE``. Time to OOM = headroom / (bytes per shape x new shapes per hour).

Attribution: among processes of the same release, the switch that is on in the flagged processes
and off in the healthy ones (largest difference in the share of processes running it; Fisher's
exact test in the evidence). Early in a rollout there may be no healthy process on the release to
contrast with: then, if ``buffers_registered`` (the fused kernel's registry) grows per shape in every
flagged process and all of them run ``fused_allreduce``, the blame goes to it.
"""

from __future__ import annotations

import json
from datetime import datetime

import numpy as np
import polars as pl
from scipy.stats import fisher_exact

from analytics import queries
from analytics.findings import finding
from analytics.stats import slope_test
from collector.records import SWITCH_NAMES, decode_switches

GIB = 2**30
# Per-GPU memory of the kinds we run (bytes); an unknown kind falls back to the OOM events' capacity.
GPU_MEMORY_BYTES: dict[str, int] = {"h100": 80 * GIB, "h200": 141 * GIB, "b200": 192 * GIB, "a100": 80 * GIB}
MIN_SESSIONS = 8
MIN_SHAPES = 5
MIN_BYTES_PER_SHAPE = 64 * 2**20
MAX_P = 1e-3
CRITICAL_HOURS_TO_OOM = 24.0
ATTRIBUTION_MIN_DIFF = 0.5
# ``buffers_registered`` is the fused all-reduce kernel's buffer registry (records.StepRecord)
REGISTRY_OWNER = "fused_allreduce"


def sessions_with_processes(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Sessions in [start, end) with ``process`` (worker process id) and ``shapes_seen`` columns."""
    s = queries.memory_sessions(store, start, end)
    if s.is_empty():
        return s.with_columns(pl.lit("").alias("process"), pl.lit(0).alias("shapes_seen"))
    ooms = queries.events(store, "oom", start, end).select("worker_id", pl.col("ts").alias("oom_ts"))
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
    s = s.with_columns(
        pl.col("first_forward_tokens").is_first_distinct().over("process").cast(pl.Int64).alias("new_shape")
    )
    return s.with_columns(pl.col("new_shape").cum_sum().over("process").alias("shapes_seen"))


def _capacity(gpu_kind: str, ooms: pl.DataFrame) -> int | None:
    """Per-GPU memory of a kind; an unknown kind takes the capacity its OOM events reported."""
    if gpu_kind in GPU_MEMORY_BYTES:
        return GPU_MEMORY_BYTES[gpu_kind]
    caps = [json.loads(d).get("capacity_bytes") for d in ooms.filter(pl.col("gpu_kind") == gpu_kind)["detail"]]
    caps = [c for c in caps if c]
    return int(max(caps)) if caps else None


def analyze(store, start: datetime, end: datetime) -> tuple[pl.DataFrame, list[dict]]:
    """One row per worker process (slopes, p-values, time to OOM, flagged) and the findings rows."""
    s = sessions_with_processes(store, start, end)
    if s.is_empty():
        return pl.DataFrame(), []
    oom_events = queries.events(store, "oom", start, end)
    oom_counts = oom_events.group_by("worker_id", "release").len("ooms")
    procs = []
    for key, g in s.group_by("process", maintain_order=True):
        g = g.sort("start_ts")
        x = g["shapes_seen"].to_numpy()
        y = g["mem_reserved_max"].to_numpy().astype(float)
        b = g["buffers_max"].to_numpy().astype(float)
        mem, buf = slope_test(x, y), slope_test(x, b)
        t0, t1 = g["start_ts"][0], g["start_ts"][-1]
        hours = max((t1 - t0).total_seconds() / 3600, 1e-9)
        new_per_hour = (x[-1] - x[0]) / hours if len(x) > 1 else 0.0
        gpu_kind = g["gpu_kind"][0]
        cap = _capacity(gpu_kind, oom_events)
        growth_per_hour = mem.slope * new_per_hour
        tto = max(cap - y[-1], 0.0) / growth_per_hour if cap and growth_per_hour > 0 else None
        states = [decode_switches(v) for v in g["switch_state"].to_list()]
        on = {name: float(np.mean([name in st for st in states])) for name in SWITCH_NAMES}
        flagged = (
            len(g) >= MIN_SESSIONS
            and x[-1] >= MIN_SHAPES
            and mem.p_value < MAX_P
            and mem.slope >= MIN_BYTES_PER_SHAPE
        )
        procs.append(
            {
                "process": key[0],
                "worker_id": g["worker_id"][0],
                "release": g["release"][0],
                "gpu_kind": gpu_kind,
                "start_ts": t0,
                "end_ts": t1,
                "sessions": len(g),
                "shapes": int(x[-1]),
                "reserved_first": float(y[0]),
                "reserved_last": float(y[-1]),
                "bytes_per_shape": mem.slope,
                "bytes_p": mem.p_value,
                "buffers_per_shape": buf.slope,
                "buffers_p": buf.p_value,
                "new_shapes_per_hour": new_per_hour,
                "capacity_bytes": cap,
                "hours_to_oom": tto,
                "flagged": flagged,
                "switches_on": on,
                "series": list(zip(x.tolist()[-60:], y.astype(np.int64).tolist()[-60:], b.astype(int).tolist()[-60:])),
            }
        )
    df = pl.DataFrame([{k: v for k, v in p.items() if k not in ("switches_on", "series")} for p in procs])
    rows = _findings(procs, oom_counts, start, end)
    return df, rows


def attribute(procs: list[dict]) -> dict[str, dict]:
    """Per release with flagged processes: the switch blamed ('' when none stands out) and evidence."""
    out = {}
    for release in sorted({p["release"] for p in procs if p["flagged"]}):
        same = [p for p in procs if p["release"] == release and p["sessions"] >= MIN_SESSIONS]
        bad = [p for p in same if p["flagged"]]
        good = [p for p in same if not p["flagged"]]
        if not good:  # no healthy process on this release: compare with every healthy process
            good = [p for p in procs if not p["flagged"] and p["sessions"] >= MIN_SESSIONS]
        scores = {}
        for name in SWITCH_NAMES:
            a = sum(p["switches_on"][name] >= 0.5 for p in bad)
            h = sum(p["switches_on"][name] >= 0.5 for p in good)
            share_bad = a / len(bad)
            share_good = h / len(good) if good else 0.0
            p_val = float(fisher_exact([[a, len(bad) - a], [h, len(good) - h]], alternative="greater")[1]) if good else 1.0
            scores[name] = {"on_in_affected": share_bad, "on_in_healthy": share_good, "fisher_p": p_val}
        best = max(scores, key=lambda n: (scores[n]["on_in_affected"] - scores[n]["on_in_healthy"], -scores[n]["fisher_p"]))
        diff = scores[best]["on_in_affected"] - scores[best]["on_in_healthy"]
        # one affected process cannot separate the switches it ran with: blame needs two or more
        clear = len(bad) >= 2 and scores[best]["on_in_affected"] >= 0.9 and diff >= ATTRIBUTION_MIN_DIFF
        blamed, method = (best, "switch on in affected, off in healthy processes") if clear else ("", "")
        if not blamed and _registry_grows(bad) and scores[REGISTRY_OWNER]["on_in_affected"] >= 0.9:
            # no healthy process to contrast with yet (e.g. early in a rollout), but the growing count
            # is the fused kernel's own buffer registry, and every affected process runs that kernel
            blamed, method = REGISTRY_OWNER, "buffers_registered (the fused kernel's registry) grows per shape"
        out[release] = {
            "attribution": blamed,
            "attribution_method": method,
            "affected_processes": len(bad),
            "healthy_processes": len(good),
            "switches": {n: v for n, v in scores.items() if v["on_in_affected"] != v["on_in_healthy"]},
        }
    return out


def _registry_grows(bad: list[dict]) -> bool:
    return bool(bad) and all(p["buffers_per_shape"] >= 0.5 and p["buffers_p"] < MAX_P for p in bad)


def _findings(procs: list[dict], oom_counts: pl.DataFrame, start: datetime, end: datetime) -> list[dict]:
    blame = attribute(procs)
    ooms = {(r["worker_id"], r["release"]): r["ooms"] for r in oom_counts.iter_rows(named=True)}
    rows = []
    for p in procs:
        if not p["flagged"]:
            continue
        tto = p["hours_to_oom"]
        n_oom = ooms.get((p["worker_id"], p["release"]), 0)
        critical = n_oom > 0 or (tto is not None and tto < CRITICAL_HOURS_TO_OOM)
        rows.append(
            finding(
                "memory_growth",
                {"release": p["release"], "worker_id": p["worker_id"]},
                "reserved_bytes_per_shape",
                p["start_ts"],
                p["end_ts"],
                value=p["bytes_per_shape"],
                baseline=p["reserved_first"],
                effect=p["buffers_per_shape"],
                confidence=1.0 - p["bytes_p"],
                severity="critical" if critical else "warning",
                attribution=blame[p["release"]]["attribution"],
                evidence={
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
                    "test": "scipy.stats.linregress one-sided (slope > 0) of peak reserved bytes on distinct shapes seen",
                },
            )
        )
    for release, b in blame.items():
        same = [p for p in procs if p["release"] == release]
        bad = [p for p in same if p["flagged"]]
        ttos = [p["hours_to_oom"] for p in bad if p["hours_to_oom"] is not None]
        n_oom = sum(v for (w, r), v in ooms.items() if r == release)
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
                confidence=1.0 - min(p["bytes_p"] for p in bad),
                severity="critical" if n_oom or (ttos and min(ttos) < CRITICAL_HOURS_TO_OOM) else "warning",
                attribution=b["attribution"],
                evidence={
                    **b,
                    "median_bytes_per_shape": float(np.median([p["bytes_per_shape"] for p in bad])),
                    "min_hours_to_oom": min(ttos) if ttos else None,
                    "ooms": n_oom,
                    "workers": sorted({p["worker_id"] for p in bad}),
                },
            )
        )
    return rows
