"""Power and clocks: a GPU kind at its power cap, a worker slowed by heat, a kind that is power-bound
all along; healthy samples raise nothing. Literal per-minute frames, then a hold-out fleet through ingest."""

import json
from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl

from analytics import power

END = datetime(2026, 11, 30, 12, tzinfo=UTC)


def _minutes(rng, kind="h100", workers=("w1", "w2", "w3"), days=7, share=None, clock=1980.0, diffusion=140.0,
             reason="SW_POWER_CAP", only=None, since=None):
    """Busy minutes of ``workers`` of one kind over ``days`` to END, one every 20 minutes each: ``share`` of
    their samples carry ``reason`` (on ``only`` workers, since ``since``) at 85% clock and +20% diffusion."""
    rows = []
    for w in workers:
        t = END - timedelta(days=days)
        while t < END:
            hit = share is not None and (only is None or w in only) and (since is None or t >= since)
            s = share if hit else 0.0
            rows.append({"worker_id": w, "gpu_kind": kind, "release": "v1", "minute": t, "samples": 120,
                         "power_w": 690.0 if hit else 560.0, "power_max_w": 700.0 if hit else 600.0,
                         "sm_clock_mhz": clock * (1 - 0.15 * s / max(share or 1, 1e-9)) + rng.normal(0, 5),
                         "temp_c": 60.0, **{r: (s if r == reason else 0.0) for r in power.SLOWING},
                         "steps": 300, "diffusion_ms": diffusion * (1 + 0.2 * s / max(share or 1, 1e-9)) + rng.normal(0, 1)})
            t += timedelta(minutes=20)
    return pl.DataFrame(rows)


def test_healthy_samples_raise_nothing():
    assert power.judge(_minutes(np.random.default_rng(0)), END) == []


def test_a_kind_at_its_power_cap_is_named_with_its_reason_and_step_effect():
    rng = np.random.default_rng(1)
    m = pl.concat([_minutes(rng, share=0.7, since=END - power.RECENT), _minutes(rng, kind="h200")])
    rows = power.judge(m, END)
    assert [(r["scope"], r["severity"]) for r in rows] == [("gpu_kind=h100", "warning")]
    ev = json.loads(rows[0]["evidence"])
    assert ev["reasons"] == ["SW_POWER_CAP"] and ev["judgement"] == "change"
    assert 0.15 < rows[0]["effect"] < 0.25 and "SW_POWER_CAP in 70% of samples (was 0%)" in ev["condition"]


def test_one_hot_worker_is_scoped_to_itself():
    rng = np.random.default_rng(2)
    rows = power.judge(_minutes(rng, share=0.8, reason="HW_THERMAL", only={"w2"}, workers=("w1", "w2", "w3", "w4")),
                       END)
    assert [(r["scope"], r["severity"]) for r in rows] == [("gpu_kind=h100,worker_id=w2", "warning")]
    assert json.loads(rows[0]["evidence"])["reasons"] == ["HW_THERMAL"]


def test_a_kind_power_bound_all_along_is_a_note_with_its_throttled_clock():
    """The real H200: 60% of its samples at the software power cap from the first minute; no change to
    judge, so an info note (no incident) that says how bound it is."""
    rng = np.random.default_rng(3)
    m = _minutes(rng, kind="h200", share=1.0)
    m = m.with_columns(  # every other minute throttled: 50-60% of the samples
        pl.when(pl.int_range(pl.len()) % 5 < 3).then(pl.col("SW_POWER_CAP")).otherwise(0.0).alias("SW_POWER_CAP"))
    rows = power.judge(m, END)
    assert [(r["scope"], r["severity"]) for r in rows] == [("gpu_kind=h200", "info")]
    ev = json.loads(rows[0]["evidence"])
    assert ev["judgement"] == "level" and ev["reasons"] == ["SW_POWER_CAP"]
    assert ev["throttled"]["minutes"] > 0 and ev["unthrottled"]["minutes"] > 0


def test_the_job_finds_a_power_capped_kind_in_a_holdout_fleet_with_real_labels(store):
    """The hold-out generator posts the real device names through ingest: the finding is scoped to the
    canonical kind, h100, with the samples' reason, and the power job is scheduled like the others."""
    from analytics import holdout, jobs
    from analytics.simulate import pinned_end

    res = holdout.generate(store, scenario="power_capped", seed=1, end=pinned_end(), days=8, onset_day=6,
                           sessions_per_day=24)
    assert {r[0] for r in store.query_rows("SELECT DISTINCT gpu_kind FROM gpu_samples")} == {"h100", "h200", "b200"}
    rows = jobs.run_job("power", store, end=res.onset + timedelta(hours=24))
    acting = [r for r in rows if r["severity"] != "info"]
    assert [r["scope"] for r in acting] == ["gpu_kind=h100"]
    assert json.loads(acting[0]["evidence"])["reasons"] == ["SW_POWER_CAP"]


def test_the_finding_reads_as_its_condition():
    from analytics.describe import describe

    rng = np.random.default_rng(1)
    row = power.judge(_minutes(rng, share=0.7, since=END - power.RECENT), END)[0]
    assert describe(row).startswith("clocks down: SW_POWER_CAP in 70% of samples (was 0%); SM clock")
