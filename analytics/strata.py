"""Strata of sessions, so a daily fleet series moves only when like sessions move, not when the mix does.

    s = with_strata(sessions, first_forward)                 # adds 'stratum' (length bucket x prompt bucket)
    daily = standardize(cells, ["gpu_kind"], "day", metrics, size="sessions")   # a row per kind x day

A day's median step time, or its late-chunk rate, is an average over the sessions of that day; when the
mix of sessions moves (a release whose sessions are twice as long), the average moves with it though no
session got slower: a long session holds a larger share of reset steps (a delta rotation every N steps, the
slow and late ones; a short session ends before its first), so the fleet's late-chunk rate rises with the
sessions' length alone. The daily series of the change-point and drift passes are therefore compared
within strata of the session's length in steps (half-octaves: sessions in one stratum hold about the same
share of reset steps) and its prompt (octaves of first_forward_tokens, the shape that differs per
session; null from older workers is a stratum of its own), within each GPU kind. A day's value is its
marginal mean under the window's mix: the additive model value = day + stratum fitted to the day x stratum cells by weighted least squares, the day's effect plus the
strata's effects averaged with the strata's share of the whole window (``marginal_means``; the same weights
every day). A change of the mix alone leaves it where it was; a change of every stratum by d moves it by d.
Not a plain weighted average of the strata a day has (direct standardization): the strata a day lacks
are the ones a changed mix made rare (the long sessions before a release that makes them common), and
dropping them moved the series as much as the mix did; the model fills them from the other days.
"""

from __future__ import annotations

import numpy as np
import polars as pl

LENGTH_BUCKETS_PER_OCTAVE = 2  # session length in steps: half-octaves
PROMPT_BUCKETS_PER_OCTAVE = 1  # first_forward_tokens: octaves
# said in the evidence of every finding whose series is standardized
NOTE = ("within strata of session length (half-octaves of steps) x prompt (octaves of first_forward_tokens) "
        "per GPU kind: each day's marginal mean under the window's mix of strata (least-squares day + stratum "
        "fit), so a change of the session mix alone does not move it")


def with_strata(sessions: pl.DataFrame, first_forward: pl.DataFrame | None = None) -> pl.DataFrame:
    """``sessions`` (with ``steps`` and ``session_id``) plus ``stratum``: its length bucket and, given
    ``first_forward`` (``queries.session_first_forward``), its prompt bucket ('-' when unknown)."""
    s = sessions
    if first_forward is not None and "first_forward_tokens" not in s.columns:
        s = s.join(first_forward.select("session_id", "first_forward_tokens"), on="session_id", how="left")
    length = (pl.col("steps").cast(pl.Float64).clip(1.0).log(2) * LENGTH_BUCKETS_PER_OCTAVE).floor().cast(pl.Int64)
    if "first_forward_tokens" in s.columns:
        ff = pl.col("first_forward_tokens").cast(pl.Float64)
        prompt = (pl.when(ff > 0).then((ff.log(2) * PROMPT_BUCKETS_PER_OCTAVE).floor().cast(pl.Int64).cast(pl.Utf8))
                  .otherwise(pl.lit("-")))
    else:
        prompt = pl.lit("-")
    return s.with_columns(pl.concat_str([length.cast(pl.Utf8), prompt], separator="/").alias("stratum"))


def standardize(cells: pl.DataFrame, keys: list[str], day: str, metrics: list[str], size: str) -> pl.DataFrame:
    """One row per ``keys`` x ``day`` from ``cells`` (one row per ``keys`` x ``day`` x ``stratum``: each
    metric's value in that stratum that day, and ``size``, the sessions or steps it stands for): each metric
    the day's marginal mean under the window's mix of strata (``marginal_means``); ``size`` summed and the
    number of strata the day had."""
    out = []
    for key, g in cells.group_by(keys, maintain_order=True):
        days = g[day].unique().sort()
        row = {**dict(zip(keys, key, strict=True)), day: days,
               size: [float(g.filter(pl.col(day) == d)[size].sum()) for d in days],
               "strata": [g.filter(pl.col(day) == d)["stratum"].n_unique() for d in days]}
        for m in metrics:
            row[m] = marginal_means(g, day, m, size, days.to_list())
        out.append(pl.DataFrame(row).with_columns(*(pl.lit(v).alias(k) for k, v in zip(keys, key, strict=True))))
    if not out:
        return pl.DataFrame()
    return pl.concat(out, how="vertical_relaxed").sort(*keys, day)


def marginal_means(g: pl.DataFrame, day: str, metric: str, size: str, days: list, iters: int = 200,
                   tol: float = 1e-9) -> list[float | None]:
    """Per day of ``days``: its effect in the additive model value = day + stratum, fitted to the cells by
    least squares weighted by ``size`` (alternating weighted means, which converge to it), plus the strata's
    effects averaged with the strata's share of the window: the day's population marginal mean (Searle, Speed
    & Milliken, "Population marginal means in the linear model", The American Statistician 1980). Unlike a
    plain weighted average of the strata a day has, a stratum the day lacks (the long sessions before a
    release that makes them common) is filled from the other days, not dropped."""
    c = g.filter(pl.col(metric).is_not_null() & pl.col(metric).is_not_nan() & (pl.col(size) > 0))
    if c.is_empty():
        return [None] * len(days)
    d_ix = {d: i for i, d in enumerate(days)}
    strata = c["stratum"].unique().sort().to_list()
    s_ix = {s: i for i, s in enumerate(strata)}
    di = np.array([d_ix[d] for d in c[day].to_list()])
    si = np.array([s_ix[s] for s in c["stratum"].to_list()])
    y = c[metric].cast(pl.Float64).to_numpy()
    w = c[size].cast(pl.Float64).to_numpy()
    wd = np.bincount(di, w, len(days))
    ws = np.bincount(si, w, len(strata))
    a, b = np.zeros(len(days)), np.zeros(len(strata))
    for _ in range(iters):
        a_new = np.divide(np.bincount(di, w * (y - b[si]), len(days)), wd, out=np.zeros(len(days)), where=wd > 0)
        b_new = np.bincount(si, w * (y - a_new[di]), len(strata)) / ws
        done = max(np.abs(a_new - a).max(initial=0.0), np.abs(b_new - b).max(initial=0.0)) < tol * (1 + np.abs(y).max())
        a, b = a_new, b_new
        if done:
            break
    level = float((ws * b).sum() / ws.sum())
    return [float(a[i] + level) if wd[i] > 0 else None for i in range(len(days))]
