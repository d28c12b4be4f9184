"""Flips that hurt sessions: a switch flip whose live sessions got late chunks or stalled is a finding of its own.

    rows = run(store, start, end)      # findings of kind "flip_cost", one per (release, GPU kind, switch, direction)

Evidence: the workers' ``flip_cost`` events (collector/flip_fields.py; analytics/queries.py ``flip_costs``): per
flip, the late chunks and stall from the poll that brought it to ``steps_observed`` chunks after it took
effect. The judge: the late chunks of a group's flips, over the chunks they cover, against the late-chunk rate of
the same release and GPU kind's sessions in the window (a one-sided exact binomial test, scipy); a group is a
finding when p < ``ALPHA`` and at least one flip was late; critical when one flip stalled the player
``STALL_CRITICAL_MS`` or more, else a warning. A healthy warm worker plays with no late chunk at all (docs/
PERFORMANCE.md, issue 21), so on such a fleet one late chunk in a flip's window is enough.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import polars as pl
from scipy.stats import binomtest

from analytics import queries
from analytics.findings import finding

KIND = "flip_cost"
ALPHA = 0.01
STALL_CRITICAL_MS = 1000.0  # a flip that froze the player for a second or more
BASELINE_FLOOR = 1e-6  # late chunks per chunk assumed when the scope's sessions had none


def metric(switch: str, value: bool) -> str:
    """The finding's metric: the switch and the direction it was flipped, e.g. ``static_scales=off``."""
    return f"{switch}={'on' if value else 'off'}"


def judge(flips: pl.DataFrame, sessions: pl.DataFrame) -> pl.DataFrame:
    """Per (release, gpu_kind, switch, value): flips, flips with late chunks, late chunks and chunks covered,
    the worst stall, the scope's baseline late rate, the binomial p-value and ``hurt``."""
    if flips.is_empty():
        return pl.DataFrame()
    base = (sessions.group_by("release", "gpu_kind").agg(
        (pl.col("late_chunks").sum() / pl.col("steps").sum().clip(lower_bound=1)).alias("baseline_rate"))
        if not sessions.is_empty() else pl.DataFrame(schema={"release": pl.Utf8, "gpu_kind": pl.Utf8,
                                                             "baseline_rate": pl.Float64}))
    covered = (pl.col("steps_observed") + (pl.col("applied_step").fill_null(pl.col("step")) - pl.col("step"))
               .clip(lower_bound=0)).clip(lower_bound=1)
    g = (flips.with_columns(covered.alias("chunks"))
         .group_by("release", "gpu_kind", "switch", "value")
         .agg(pl.len().alias("flips"), (pl.col("late_chunks") > 0).sum().alias("late_flips"),
              pl.col("late_chunks").sum().alias("late_chunks"), pl.col("chunks").sum().alias("chunks"),
              pl.col("stall_ms").max().alias("max_stall_ms"), pl.col("stall_ms").sum().alias("stall_ms"),
              pl.col("to_new_config_ms").max().alias("max_to_new_config_ms"),
              pl.col("out_of_service_ms").sum().alias("out_of_service_ms"),
              pl.col("worker_id").n_unique().alias("workers"))
         .join(base, on=["release", "gpu_kind"], how="left")
         .with_columns(pl.col("baseline_rate").fill_null(0.0)))
    p = [binomtest(min(int(k), int(n)), int(n), max(r, BASELINE_FLOOR), alternative="greater").pvalue
         for k, n, r in g.select("late_chunks", "chunks", "baseline_rate").iter_rows()]
    return (g.with_columns(pl.Series("p_value", p, dtype=pl.Float64))
            .with_columns(((pl.col("late_flips") > 0) & (pl.col("p_value") < ALPHA)).alias("hurt"))
            .sort("release", "gpu_kind", "switch", "value"))


def findings(judged: pl.DataFrame, start: datetime, end: datetime) -> list[dict[str, Any]]:
    rows = []
    for r in judged.filter(pl.col("hurt")).iter_rows(named=True) if not judged.is_empty() else []:
        rows.append(finding(
            KIND, {"release": r["release"], "gpu_kind": r["gpu_kind"]}, metric(r["switch"], r["value"]), start, end,
            value=r["late_chunks"] / r["chunks"], baseline=r["baseline_rate"], effect=r["late_flips"] / r["flips"],
            confidence=1.0 - r["p_value"], severity="critical" if r["max_stall_ms"] >= STALL_CRITICAL_MS else "warning",
            attribution=r["switch"], job="flips",
            evidence={k: r[k] for k in ("flips", "late_flips", "late_chunks", "chunks", "max_stall_ms", "stall_ms",
                                        "max_to_new_config_ms", "out_of_service_ms", "workers", "p_value")}))
    return rows


def run(store, start: datetime, end: datetime) -> list[dict[str, Any]]:
    """The job: flips in [start, end) -> findings rows."""
    flips = queries.flip_costs(store, start, end)
    if flips.is_empty():
        return []
    return findings(judge(flips, queries.session_frame(store, start, end)), start, end)
