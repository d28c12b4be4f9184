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
blamed; several, or none, are not (a tie means no attribution). Cohorts that overlap (every compile
worker also runs cuda_graphs) are told apart by what each looks like without the other
(``_separate_cohorts``), as a memory growth's switches are (``_separate_switches``). A regressed GPU kind
where the switch cannot be contrasted (on the same workers as another, or on all of them) takes the
release's blame over all its regressed kinds when its own evidence agrees (``across_kinds``).

Each result has a ``state``: 'blamed', 'tie', 'waiting' (a switch splits the work too thinly to
contrast yet, or the rollout has not reached the baseline work without it) or 'none explains'.
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
            why = ("no comparable process without it: no contrast" if not without else
                   f"only {len(without)} comparable process{'es' if len(without) > 1 else ''} without it "
                   f"({where}; {MIN_CONTRAST} needed): no contrast yet")
            c.update(explains=False, why=why, waiting=bool(without) or any(not _on(p, name) for p in procs))
        contrasts[name] = c
    cands = [n for n, c in contrasts.items() if c.get("explains")]
    if len(cands) > 1:  # several switches contrast: what does each look like without the other?
        winner = _separate_switches(mine, cands, contrasts)
        if winner:
            contrasts = {n: c if n == winner or n not in cands else {**c, "explains": False,
                                                                      "why": f"{winner} carries it without it"}
                         for n, c in contrasts.items()}
    return _pick(contrasts, "memory growth present in processes with it, absent in comparable ones without it",
                 lambda c: (round(c["share_growing_with"] - c["share_growing_without"], 9), -c["fisher_p"]))


def _separate_switches(mine: list[dict[str, Any]], cands: list[str], contrasts: dict[str, dict[str, Any]]) -> str:
    """Of switches that each contrast, the one whose growth holds without the others, in the release's
    own processes (every GPU kind): ``a`` beats ``b`` when processes running ``b`` without ``a`` exist
    and none of them grows, while those running ``a`` without ``b`` are none or grow (more than half).
    E.g. every leaking process runs both compile and fused_allreduce, and a process with compile and
    without fused_allreduce is healthy: fused_allreduce carries it. One process is evidence here (the
    switches already contrast with the processes without either). Returns the switch that beats every
    other, else '' (they stay tied, or the stronger contrast decides)."""
    beats: dict[str, dict[str, Any]] = {n: {} for n in cands}
    for a in cands:
        for b in cands:
            if a == b:
                continue
            b_only = [p for p in mine if _on(p, b) and not _on(p, a)]
            a_only = [p for p in mine if _on(p, a) and not _on(p, b)]
            b_clean = bool(b_only) and not any(p["flagged"] for p in b_only)
            a_grows = not a_only or sum(p["flagged"] for p in a_only) > len(a_only) / 2
            if b_clean and a_grows:
                beats[a][b] = {"processes_with_it_without_this": len(b_only), "growing": 0,
                               "processes_with_this_without_it": len(a_only),
                               "growing_too": sum(p["flagged"] for p in a_only)}
    winners = [n for n in cands if set(beats[n]) == set(cands) - {n}]
    if len(winners) != 1:
        return ""
    contrasts[winners[0]]["beats"] = beats[winners[0]]
    return winners[0]


def _pick(contrasts: dict[str, dict[str, Any]], method: str, strength: Callable[[dict], tuple]) -> dict[str, Any]:
    """The strictly strongest candidate, and ``state``: 'blamed'; 'tie' (candidates that cannot be told
    apart); 'waiting' (no candidate, but a switch that splits the work has too little of it on one
    side to contrast yet: the evidence may come); 'none explains' (every contrast made, none holds)."""
    cands = {n: c for n, c in contrasts.items() if c.get("explains")}
    out = {"attribution": "", "attribution_method": "", "switches": contrasts}
    if not cands:
        waiting = sorted(n for n, c in contrasts.items() if c.get("waiting"))
        out["state"] = "waiting" if waiting else "none explains"
        out["why"] = (f"no switch blamed yet: too little comparable work on one side of {', '.join(waiting)} to "
                      f"contrast" if waiting else
                      "no switch explains it: the comparable work without each candidate shows the same effect, "
                      "or there is none to compare with")
        return out
    ranked = sorted(cands, key=lambda n: strength(cands[n]), reverse=True)
    if len(ranked) > 1 and strength(cands[ranked[0]]) == strength(cands[ranked[1]]):
        tied = [n for n in ranked if strength(cands[n]) == strength(cands[ranked[0]])]
        out["state"] = "tie"
        out["why"] = f"a tie between {', '.join(sorted(tied))}: they cannot be told apart, so neither is blamed"
        return out
    out.update(attribution=ranked[0], attribution_method=method, state="blamed",
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


def _separate_cohorts(t: pl.DataFrame, c: pl.DataFrame, cands: dict[str, dict[str, Any]],
                      regressed: Callable[[pl.DataFrame, pl.DataFrame], bool]) -> dict[str, dict[str, Any]]:
    """Of switches whose cohorts each carry a regression, the one that carries it without the others.
    ``a`` beats ``b`` when the sessions with ``b`` but without ``a`` (``MIN_COHORT`` or more) do not
    regress against the baseline, and those with ``a`` but without ``b`` are none or do regress (e.g.
    every ``compile`` worker also runs ``cuda_graphs``, but ``cuda_graphs`` workers without ``compile``
    are fine: ``compile`` carries it). The one that beats every other is kept, with the evidence; when
    none does, all stay (a tie)."""
    has = {n: _has(t, n) for n in cands}
    ref = c if not c.is_empty() else t.filter(~pl.any_horizontal(*has.values()))
    beats: dict[str, list[str]] = {n: [] for n in cands}
    evidence: dict[str, dict[str, Any]] = {n: {} for n in cands}
    if ref.is_empty():
        return cands
    for a in cands:
        for b in cands:
            if a == b:
                continue
            b_only, a_only = t.filter(has[b] & ~has[a]), t.filter(has[a] & ~has[b])
            if len(b_only) < MIN_COHORT:
                continue
            b_clean = not regressed(b_only, ref)
            a_carries = len(a_only) < MIN_COHORT or regressed(a_only, ref)
            evidence[a][b] = {"sessions_with_it_without_this": len(b_only), "those_regress": not b_clean,
                              "sessions_with_this_without_it": len(a_only), "those_regress_too": a_carries}
            if b_clean and a_carries:
                beats[a].append(b)
    winners = [n for n in cands if set(beats[n]) == set(cands) - {n}]
    if len(winners) != 1:
        return cands
    w = winners[0]
    return {w: {**cands[w], "beats": evidence[w]}}


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
            thin = 0 < st[name] < 1  # it splits the release, too thinly yet
            rolling = st[name] == 1 and sc[name] < 1  # baseline work without it has not been upgraded yet
            if (thin or rolling) and not t.is_empty():
                n_on = int(_has(t, name).sum())
                contrasts[name] = {"share_treatment": st[name], "share_baseline": sc[name], "explains": False,
                                   "waiting": True, "sessions_with": n_on, "sessions_without": len(t) - n_on,
                                   "why": f"fewer than {MIN_COHORT} sessions on one side: no contrast yet" if thin
                                   else "every session of the release runs it, some of the baseline's do not: "
                                        "no contrast until the rollout reaches them"}
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
    if len(inside_cands) > 1:  # cohorts that overlap: what does each look like without the other?
        inside_cands = _separate_cohorts(t, c, inside_cands, regressed)
        contrasts.update(inside_cands)
    if inside_cands:  # a cohort that carries the effect beats a mere difference of state
        contrasts_for_pick = inside_cands
    else:
        contrasts_for_pick = {n: v for n, v in contrasts.items() if v["explains"]}
    waiting = {n: v for n, v in contrasts.items() if v.get("waiting")}
    out = _pick(contrasts_for_pick | waiting, "", lambda v: (v["strength"],))
    out["switches"] = contrasts
    if out["attribution"]:
        out["attribution_method"] = contrasts[out["attribution"]]["method"]
    return out


def across_kinds(kind_blame: dict[str, Any], release_blame: dict[str, Any], t_kind: pl.DataFrame) -> dict[str, Any]:
    """A GPU kind's regression blame, completed by the release's (``release_blame``: the kinds that
    regressed pooled, each session's metric relative to its kind's baseline). Inside one kind a switch
    can be inseparable from another (on the same workers: a tie) or too rare for two cohorts; across
    kinds it may not be. The release's switch is blamed for the kind when the kind's own evidence agrees
    with it: its cohort carries the effect there (possibly tied), or every session of the kind runs it.
    A kind whose own contrast clears it (its sessions without the switch regress too), or that runs
    without it, keeps no blame. The kind's own clean blame always stands."""
    name = release_blame.get("attribution", "")
    if kind_blame["attribution"] or not name:
        return kind_blame
    own = kind_blame["switches"].get(name)
    runs_it = not t_kind.is_empty() and _shares(t_kind)[name] >= RUNS_IT
    if (own is not None and own.get("explains")) or (own is None and runs_it):
        return {**kind_blame, "attribution": name, "state": "blamed",
                "attribution_method": f"{release_blame['attribution_method']}, across the release's GPU kinds",
                "why": f"{name}: carries the regression across the release's GPU kinds "
                       f"({release_blame['why']}); this kind's own evidence agrees"
                       + (f" (here: {kind_blame['why']})" if kind_blame.get("why") else "")}
    return kind_blame
