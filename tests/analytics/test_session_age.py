"""Step time within sessions: a release whose steps slow as the session ages is found and named at the
release's scope; longer sessions with the same per-step behaviour are not; reset steps are their own class."""

import json
from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl

from analytics import session_age

END = datetime(2026, 11, 30, tzinfo=UTC)


def _sessions(rng, release, n=120, slope=0.0, kinds=("h100", "h200", "b200"), steps=60, reset_ratio=1.3,
              slope_kinds=None):
    rows = []
    for i in range(n):
        k = kinds[i % len(kinds)]
        last = int(steps * np.exp(rng.normal(0, 0.5)))
        s = slope if slope_kinds is None or k in slope_kinds else 0.0
        rows.append({"release": release, "gpu_kind": k, "worker_id": f"w{i % 9}", "session_id": f"{release}-{i}",
                     "start_ts": END - timedelta(hours=n - i), "steps": last, "last_step": last,
                     "slope_ms_per_step": s + rng.normal(0, 0.02), "step_ms": 130.0 + rng.normal(0, 1),
                     "reset_ratio": reset_ratio + rng.normal(0, 0.02)})
    return pl.DataFrame(rows)


def _judge(t, c):
    return session_age.judge(t, c, "v2", "v1", END - timedelta(days=3), END)


def test_degradation_with_session_age_on_every_kind_is_one_release_finding():
    rng = np.random.default_rng(0)
    rows = _judge(_sessions(rng, "v2", n=300, slope=0.02), _sessions(rng, "v1", n=300))
    assert [(r["scope"], r["metric"]) for r in rows] == [("release=v2", session_age.AGE_METRIC)]
    ev = json.loads(rows[0]["evidence"])
    assert 0.015 < ev["slope_ms_per_step"] < 0.025 and "ms a step within sessions" in ev["condition"]


def test_on_one_kind_only_it_is_scoped_to_that_kind():
    rng = np.random.default_rng(1)
    rows = _judge(_sessions(rng, "v2", n=300, slope=0.03, slope_kinds={"h100"}), _sessions(rng, "v1", n=300))
    assert [r["scope"] for r in rows] == ["gpu_kind=h100,release=v2"]


def test_longer_sessions_with_the_same_steps_raise_nothing():
    rng = np.random.default_rng(2)
    assert _judge(_sessions(rng, "v2", n=300, steps=120), _sessions(rng, "v1", n=300)) == []


def test_slower_reset_steps_are_their_own_class():
    rng = np.random.default_rng(3)
    rows = _judge(_sessions(rng, "v2", n=300, reset_ratio=1.6), _sessions(rng, "v1", n=300))
    assert {r["metric"] for r in rows} == {session_age.RESET_METRIC}


def test_the_job_finds_it_in_a_holdout_fleet(store):
    from analytics import holdout, jobs
    from analytics.simulate import pinned_end

    res = holdout.generate(store, scenario="session_age", seed=2, end=pinned_end(), days=10, onset_day=6,
                           sessions_per_day=30)
    rows = jobs.run_job("session_age", store, end=res.onset + timedelta(hours=72))
    assert [(r["scope"], r["metric"]) for r in rows] == [("release=v2", session_age.AGE_METRIC)]
