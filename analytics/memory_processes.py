"""Worker processes and their candidate explanations of memory growth (analytics/memory.py's first part):
sessions grouped into processes (a deploy or an OOM starts one), each shape key's distinct values seen so
far, the tokens of the distinct prompt lengths, sessions served and hours; the fleet's rates of new values;
a process's GPU memory."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import numpy as np
import polars as pl

from analytics import queries
from collector.gpu_kinds import canonical_gpu_kind
from collector.records import SHAPE_KEYS

GIB = 2**30
# A process's GPU memory is what its worker reported (the session record's ``gpu_mem_total_bytes``), for any
# GPU; for workers before that field: the capacity its kind's OOM events reported, then this table of the
# kinds we run (bytes; keyed on canonical kinds, collector/gpu_kinds.py).
GPU_MEMORY_BYTES: dict[str, int] = {"h100": 80 * GIB, "h200": 141 * GIB, "b200": 192 * GIB, "a100": 80 * GIB}
MIN_SHAPES = 5
PER_SESSION = "per session"
OVER_TIME = "over time"
# A buffer sized by its shape (the fused all-reduce's is m x d_model x 2 bytes, m the first-forward tokens)
# grows with the tokens of the new values, not their count: its own explanation, of the same key.
SIZED = "first_forward_tokens, sized by its tokens"
SIZED_KEY = "first_forward_tokens"
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


def capacity(g: pl.DataFrame, ooms: pl.DataFrame) -> int | None:
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


def explainers(g: pl.DataFrame) -> dict[str, np.ndarray]:
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
        return False  # judged with its key (``judged_all``)
    return name not in SHAPE_KEYS or (len(x) > 0 and x[-1] >= MIN_SHAPES)


def judged_all(name: str, xs: list[dict[str, np.ndarray]]) -> bool:
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
