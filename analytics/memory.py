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

The detector's parts: ``analytics.memory_processes`` (processes and their explanations),
``analytics.memory_fits`` (the fits, the naming rule and their thresholds), ``analytics.memory_findings``
(the findings rows and attribution); this module runs them (``analyze``) and re-exports their names.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np
import polars as pl

from analytics import queries
from analytics.memory_findings import (  # noqa: F401 (re-exported: imported from here)
    CRITICAL_HOURS_TO_OOM,
    NAMES_SEP,
    attribute,
    findings_rows,
)
from analytics.memory_fits import (  # noqa: F401 (re-exported: imported from here)
    GROWTH_NOISE_K,
    MAX_P,
    MIN_GROWTH,
    MIN_SEPARATE_SESSIONS,
    MIN_SESSIONS,
    RESERVED_BLOCK,
    RIVAL_P,
    SEPARATE_P,
    SPREAD_FLOOR,
    judge_process,
    judge_release,
    name_key,
    release_fit,
    separate,
)
from analytics.memory_processes import (  # noqa: F401 (re-exported: imported from here)
    GIB,
    GPU_MEMORY_BYTES,
    MIN_SHAPES,
    OVER_TIME,
    PER_SESSION,
    RATE_MIN_HOURS,
    RATE_WINDOW,
    SIZED,
    SIZED_KEY,
    capacity,
    explainers,
    fleet_rates,
    judged_all,
    key_of,
    sessions_with_processes,
    with_processes,
)
from analytics.stats import slope_test
from collector.records import SWITCH_NAMES, decode_switches

HISTORY = timedelta(days=14)  # before the window: where a process started, which shapes it had seen


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
        xs, y, b = explainers(g), g["mem_reserved_max"].to_numpy().astype(float), \
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
            own = {n: slope_test(x, y) for n, x in xs.items() if judged_all(n, [xs])}
            r2 = {n: 1 - float(np.sum((y - f.intercept - f.slope * xs[n]) ** 2)) / max(float(np.sum((y - y.mean()) ** 2)), 1e-300)
                  for n, f in own.items()}
            unit = max(own, key=lambda n: (own[n].p_value < MAX_P and own[n].slope > 0, r2[n]))
        x = xs[unit]
        j = judge_process(x, y, b, xs[key_of(unit)])
        gpu_kind = g["gpu_kind"][0]
        cap = capacity(g, oom_events)
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
    rows = findings_rows(procs, releases, oom_counts, start, end)
    return df, rows
