"""Conditions: the segment of sessions (a shape key, the session's length) that a regression lives in.

    seg = segment(treatment, control, "diffusion_ms")   # None, or {"condition": "first_forward_tokens > 1,280", ...}

A release that is +15% only for prompts of more than 1,500 tokens moves the release's median by a point or
two: the release judge (Kayenta's, on medians) misses it or finds it without saying where. Method: a
T-learner (Kunzel et al., "Metalearners for estimating heterogeneous treatment effects", PNAS 2019) with
CART trees (Breiman et al. 1984; scikit-learn's ``DecisionTreeRegressor``): a tree fitted on the baseline's
sessions predicts each session's metric from its attributes (so a prompt length that is slower on both
releases is not a condition); the treatment's excess over that prediction is fitted by a one-split tree
(a stump: one condition, named plainly) on half of its sessions, and the split is tested on the other half
(honest estimation, Athey & Imbens, PNAS 2016: the search cannot inflate the test). It is kept when the
held-out sessions inside the segment are slower than the baseline's inside it (one-sided Mann-Whitney,
p < ``ALPHA``, effect >= the judge's floor) and those outside are not (effect < half the floor): the
condition explains the regression rather than merely sitting inside a broad one.
"""

from __future__ import annotations

import numpy as np
import polars as pl
from scipy.stats import mannwhitneyu
from sklearn.tree import DecisionTreeRegressor

from collector.records import SHAPE_KEYS

# session attributes a condition may name: the shape columns, and the session's length in steps
FEATURES: tuple[str, ...] = (*dict.fromkeys(c for cols in SHAPE_KEYS.values() for c in cols), "steps")
ALPHA = 1e-3
MIN_LEAF = 20  # sessions on each side of a split, in the fitting half
SEED = 29


def _matrix(df: pl.DataFrame, feats: list[str]) -> np.ndarray:
    return df.select([pl.col(f).cast(pl.Float64).fill_null(-1.0) for f in feats]).to_numpy()


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.3g}"


def _same_cut(v: np.ndarray, mask: np.ndarray) -> bool:
    """Whether one threshold on ``v`` splits the sessions exactly into ``mask`` and the rest."""
    return bool(v[mask].min() > v[~mask].max() or v[mask].max() < v[~mask].min())


def segment(t: pl.DataFrame, c: pl.DataFrame, col: str, floor: float = 0.03) -> dict | None:
    """The one condition that explains ``t``'s regression of ``col`` against ``c`` (per-session frames with
    ``FEATURES`` columns), or None."""
    feats = [f for f in FEATURES if f in t.columns and f in c.columns
             and t[f].drop_nulls().n_unique() > 1]
    t, c = t.filter(pl.col(col).is_not_null()), c.filter(pl.col(col).is_not_null())
    if not feats or t.height < 4 * MIN_LEAF or c.height < 2 * MIN_LEAF:
        return None
    xt, xc = _matrix(t, feats), _matrix(c, feats)
    yt, yc = t[col].cast(pl.Float64).to_numpy(), c[col].cast(pl.Float64).to_numpy()
    scale = float(np.median(yc))
    if scale <= 0:
        return None
    base = DecisionTreeRegressor(max_depth=3, min_samples_leaf=MIN_LEAF, random_state=SEED).fit(xc, yc / scale)
    excess = yt / scale - base.predict(xt)  # the treatment's effect on each session, beyond the baseline's
    order = np.random.default_rng(SEED).permutation(len(yt))
    fit, held = order[: len(order) // 2], order[len(order) // 2:]
    stump = DecisionTreeRegressor(max_depth=1, min_samples_leaf=MIN_LEAF, random_state=SEED)
    stump.fit(xt[fit], excess[fit])
    if stump.tree_.node_count < 3:
        return None
    f, theta = int(stump.tree_.feature[0]), float(stump.tree_.threshold[0])
    left, right = stump.tree_.children_left[0], stump.tree_.children_right[0]
    high = float(stump.tree_.value[right].ravel()[0]) > float(stump.tree_.value[left].ravel()[0])
    def inside(x):
        return x[:, f] > theta if high else x[:, f] <= theta
    t_in, t_out = yt[held][inside(xt[held])], yt[held][~inside(xt[held])]
    c_in, c_out = yc[inside(xc)], yc[~inside(xc)]
    if min(len(t_in), len(c_in), len(t_out), len(c_out)) < 10:
        return None
    eff_in = float(np.median(t_in)) / float(np.median(c_in)) - 1
    eff_out = float(np.median(t_out)) / float(np.median(c_out)) - 1
    p = float(mannwhitneyu(t_in, c_in, alternative="greater").pvalue)
    if not (p < ALPHA and eff_in >= floor and eff_out < floor / 2):
        return None
    x_all = np.concatenate([xt, xc])
    mask = inside(x_all)
    # features that cut the sessions exactly the same way (cond_tokens = first_forward_tokens - 757) are
    # aliases: the condition is named by the first in FEATURES' order, the shape key's own column first
    same = [g for g in range(len(feats)) if _same_cut(x_all[:, g], mask)]
    f = min(same, key=lambda g: FEATURES.index(feats[g])) if same else f
    values, name = x_all[:, f], feats[f]
    high = bool(values[mask].min() > values[~mask].max())
    lo, hi = (values[~mask], values[mask]) if high else (values[mask], values[~mask])
    cond = f"{name} > {_fmt(lo.max())}" if high else f"{name} <= {_fmt(lo.max())}"
    aliases = [feats[g] for g in same if g != f]
    return {"condition": cond, "feature": name, "aliases": aliases, "threshold": float(lo.max()), "side": "above" if high else "at or below",
            "values_inside": sorted({float(v) for v in (hi if high else lo)})[:20],
            "effect_inside": eff_in, "effect_outside": eff_out, "p_value": p, "metric_column": col,
            "treatment_inside": float(np.median(t_in)), "baseline_inside": float(np.median(c_in)),
            "held_out_sessions": {"inside": len(t_in), "outside": len(t_out)},
            "baseline_sessions": {"inside": len(c_in), "outside": len(c_out)},
            "method": "T-learner: CART on the baseline, a stump on the excess, tested on a held-out half "
                      "(scikit-learn DecisionTreeRegressor; one-sided Mann-Whitney inside the segment)"}
