"""Conditions: the segment a regression lives in is found and named; none is invented where a release is
healthy, slower everywhere, or where a segment is slower on both releases alike."""

import numpy as np
import polars as pl

from analytics import conditions

BUCKETS = (512, 768, 1024, 1280, 1536, 1792, 2048)


def _sessions(rng, n, *, long_effect=0.0, everywhere=0.0, inherent=0.0):
    ff = rng.choice(BUCKETS, n)
    y = 140.0 * np.exp(rng.normal(0, 0.02, n)) * (1 + everywhere) * (1 + inherent * (ff > 1500))
    y = y * (1 + long_effect * (ff > 1500))
    return pl.DataFrame({"first_forward_tokens": ff, "cond_tokens": ff - 500, "tp_size": np.ones(n, int),
                         "steps": rng.integers(20, 200, n), "diffusion_ms": y})


def test_a_regression_only_for_long_prompts_is_named():
    rng = np.random.default_rng(0)
    seg = conditions.segment(_sessions(rng, 300, long_effect=0.15), _sessions(rng, 300), "diffusion_ms")
    assert seg is not None and seg["condition"] == "first_forward_tokens > 1,280" and seg["aliases"] == ["cond_tokens"]
    assert 0.1 < seg["effect_inside"] < 0.2 and abs(seg["effect_outside"]) < 0.015


def test_no_segment_when_healthy_broad_or_slower_on_both_releases():
    rng = np.random.default_rng(1)
    assert conditions.segment(_sessions(rng, 300), _sessions(rng, 300), "diffusion_ms") is None
    assert conditions.segment(_sessions(rng, 300, everywhere=0.1), _sessions(rng, 300), "diffusion_ms") is None
    assert conditions.segment(_sessions(rng, 300, inherent=0.2), _sessions(rng, 300, inherent=0.2),
                              "diffusion_ms") is None


def test_the_release_detector_names_the_long_prompt_condition_on_a_holdout_fleet(store):
    import json
    from datetime import timedelta

    from analytics import holdout, jobs
    from analytics.detector_eval import sim_end

    res = holdout.generate(store, scenario="long_prompts", seed=0, end=sim_end(0), days=10, onset_day=6,
                           sessions_per_day=30)
    rows = jobs.run_job("regressions", store, end=res.onset + timedelta(hours=72))
    named = {json.loads(r["evidence"]).get("condition") for r in rows}
    assert rows and named == {"first_forward_tokens > 1,280"}
