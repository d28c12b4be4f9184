"""Blame by contrast: a switch is blamed only when what it touches differs from comparable work without it.

    b = memory_blame(procs, release)        # per-process memory growth (analytics/memory.py's procs)
    b = regression_blame(t, c, judge)       # a release regression: treatment / baseline session frames

Both return ``{"attribution": name or '', "attribution_method": ..., "switches": {name: contrast}, "why": ...}``.

Memory: the affected processes are the release's flagged ones. For each switch they run (>= 90 % of
them), the comparable processes *without* it are those of the same release and GPU kind, else (fewer
than ``MIN_CONTRAST`` there) of the same release, else the other releases' processes of that GPU kind
(the baseline); the processes *with* it come from the same pool. The switch is a candidate when at
least ``MIN_CONTRAST`` comparable processes run without it, as many with it grow, and the share of those
without it that grow is lower than the share of those with it by ``MIN_SHARE_DIFF`` or more (Fisher's
exact test, one-sided, in the evidence and ranking the candidates: early in a rollout 3 growing processes
against 2 healthy ones are already a clean split, p = 0.1). If the processes without the switch grow
just the same, the switch is not the cause.
No candidate: "no switch explains it". Two or more candidates with the same contrast (switches that
were always on together): a tie, no attribution -- never the order of the switch list. Otherwise the
strictly strongest candidate.

Regression: for each switch whose share of sessions differs between the baseline and the treatment,
or that splits the treatment into two cohorts of ``MIN_COHORT`` sessions or more, the treatment cohort
with the switch is judged against the cohort without it inside the release when both exist (the
cohort carries the effect: it regresses against the rest and the rest does not against the baseline),
else the switch is the only difference in state between baseline and treatment. One such switch is
blamed; several, or none, are not (a tie means no attribution).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import polars as pl
from scipy.stats import fisher_exact

from collector.records import SWITCH_NAMES, decode_switches

MIN_CONTRAST = 2
MIN_SHARE_DIFF = 0.5
RUNS_IT = 0.9  # a switch "runs" in a group when this share of it has it on
MIN_COHORT = 30  # sessions per cohort inside a release (the regression judges' MIN_SAMPLES)
MIN_STATE_SHIFT = 0.5


def _on(p: dict[str, Any], name: str) -> bool:
    return p["switches_on"].get(name, 0.0) >= 0.5


def memory_blame(procs: list[dict[str, Any]], release: str, min_sessions: int = 1) -> dict[str, Any]:
    """The switch whose absence, in comparable processes, removes the growth the release's flagged
    processes show ('' when none does, or when two do equally)."""
    mine = [p for p in procs if p["release"] == release and p["sessions"] >= min_sessions]
    bad = [p for p in mine if p["flagged"]]
    kinds = {p["gpu_kind"] for p in bad}
    contrasts: dict[str, dict[str, Any]] = {}
    for name in SWITCH_NAMES:
        if not bad or sum(_on(p, name) for p in bad) < RUNS_IT * len(bad):
            continue
        levels = (("same release and GPU kind", [p for p in mine if p["gpu_kind"] in kinds]),
                  ("same release", mine),
                  ("baseline: other releases, same GPU kind",
                   [p for p in procs if p["gpu_kind"] in kinds and p["sessions"] >= min_sessions
                    and (p["release"] == release or not _on(p, name))]))
        where, pool = next(((w, q) for w, q in levels if sum(not _on(p, name) for p in q) >= MIN_CONTRAST),
                           levels[-1])
        with_ = [p for p in pool if _on(p, name)]
        without = [p for p in pool if not _on(p, name)]
        g_with, g_without = sum(p["flagged"] for p in with_), sum(p["flagged"] for p in without)
        c = {"compared_with": where, "processes_with": len(with_), "growing_with": g_with,
             "processes_without": len(without), "growing_without": g_without}
        if len(without) >= MIN_CONTRAST and with_:
            share_w, share_wo = g_with / len(with_), g_without / len(without)
            p_val = float(fisher_exact([[g_with, len(with_) - g_with], [g_without, len(without) - g_without]],
                                       alternative="greater")[1])
            c.update(share_growing_with=share_w, share_growing_without=share_wo, fisher_p=p_val,
                     explains=share_w - share_wo >= MIN_SHARE_DIFF and g_with >= MIN_CONTRAST)
        else:
            c.update(explains=False, why="no comparable process without it: no contrast")
        contrasts[name] = c
    return _pick(contrasts, "memory growth present in processes with it, absent in comparable ones without it",
                 lambda c: (round(c["share_growing_with"] - c["share_growing_without"], 9), -c["fisher_p"]))


def _pick(contrasts: dict[str, dict[str, Any]], method: str, strength: Callable[[dict], tuple]) -> dict[str, Any]:
    cands = {n: c for n, c in contrasts.items() if c.get("explains")}
    out = {"attribution": "", "attribution_method": "", "switches": contrasts}
    if not cands:
        out["why"] = ("no switch explains it: the comparable work without each candidate shows the same effect, "
                      "or there is none to compare with")
        return out
    ranked = sorted(cands, key=lambda n: strength(cands[n]), reverse=True)
    if len(ranked) > 1 and strength(cands[ranked[0]]) == strength(cands[ranked[1]]):
        tied = [n for n in ranked if strength(cands[n]) == strength(cands[ranked[0]])]
        out["why"] = f"a tie between {', '.join(sorted(tied))}: they cannot be told apart, so neither is blamed"
        return out
    out.update(attribution=ranked[0], attribution_method=method,
               why=f"{ranked[0]}: {method}")
    return out


def _shares(df: pl.DataFrame) -> dict[str, float]:
    if df.is_empty():
        return dict.fromkeys(SWITCH_NAMES, 0.0)
    counts = df["switch_state"].value_counts()
    total = max(int(counts["count"].sum()), 1)
    states = [(decode_switches(st), n) for st, n in counts.iter_rows()]
    return {name: sum(n for st, n in states if name in st) / total for name in SWITCH_NAMES}


def _has(df: pl.DataFrame, name: str) -> pl.Series:
    return df["switch_state"].map_elements(lambda s: name in decode_switches(s), return_dtype=pl.Boolean)


def regression_blame(t: pl.DataFrame, c: pl.DataFrame, regressed: Callable[[pl.DataFrame, pl.DataFrame], bool]
                     ) -> dict[str, Any]:
    """Blame for a release regression; ``regressed(a, b)`` says whether session frame ``a`` regressed
    against ``b`` on the finding's metric (the release detector's judge)."""
    st, sc = _shares(t), _shares(c)
    contrasts: dict[str, dict[str, Any]] = {}
    for name in SWITCH_NAMES:
        shift = st[name] - sc[name]
        inside = None
        if 0 < st[name] < 1 and not t.is_empty():
            mask = _has(t, name)
            on, off = t.filter(mask), t.filter(~mask)
            if len(on) >= MIN_COHORT and len(off) >= MIN_COHORT:
                inside = (on, off)
        if inside is None and abs(shift) < MIN_STATE_SHIFT:
            continue
        cc: dict[str, Any] = {"share_treatment": st[name], "share_baseline": sc[name]}
        if inside is not None:
            on, off = inside
            carries = regressed(on, off) and (c.is_empty() or not regressed(off, c))
            cc.update(method="cohorts inside the release", sessions_with=len(on), sessions_without=len(off),
                      explains=bool(carries), strength=2)
        else:
            cc.update(method="state differs between baseline and treatment", explains=shift > 0, strength=1)
        contrasts[name] = cc
    inside_cands = {n: v for n, v in contrasts.items() if v["explains"] and v["strength"] == 2}
    if inside_cands:  # a cohort that carries the effect beats a mere difference of state
        contrasts_for_pick = inside_cands
    else:
        contrasts_for_pick = {n: v for n, v in contrasts.items() if v["explains"]}
    out = _pick(contrasts_for_pick, "", lambda v: (v["strength"],))
    out["switches"] = contrasts
    if out["attribution"]:
        out["attribution_method"] = contrasts[out["attribution"]]["method"]
    return out
