"""Memory-growth findings rows: per flagged process and per release, with severity from the time to
OOM and the switch blamed by contrast (``attribute``, analytics/blame.py)."""

from __future__ import annotations

from datetime import datetime

import numpy as np
import polars as pl

from analytics.findings import finding
from analytics.memory_fits import MIN_SESSIONS, SEPARATE_P
from analytics.memory_processes import OVER_TIME, PER_SESSION, SIZED, key_of
from collector.records import SHAPE_KEYS

# joins explanations' names in a process row: never a comma, which SIZED's name holds
NAMES_SEP = ";"
CRITICAL_HOURS_TO_OOM = 24.0


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


def findings_rows(procs: list[dict], releases: dict[str, dict], oom_counts: pl.DataFrame, start: datetime | None,
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
