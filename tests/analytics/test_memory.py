"""Memory growth per new shape: the August incident is found within a day of its rollout and
blamed on the fused all-reduce; a healthy fleet is not flagged."""

import json
from datetime import timedelta

from analytics import memory
from analytics.findings import read_findings
from analytics.jobs import run_job
from analytics.simulate import simulate_fleet


def test_august_incident_flagged_within_a_day_and_attributed(store, small):
    small["workers"] = 12
    sim = simulate_fleet(store, weeks=1, incidents=[("august", 3)], seed=11, **small)
    aug = sim.release("august")
    rows = run_job("memory", store, end=aug.start + timedelta(days=1))
    summary = [r for r in rows if r["scope"] == f"release={aug.name}"]
    assert len(summary) == 1
    assert summary[0]["attribution"] == "fused_allreduce"
    assert summary[0]["severity"] == "critical"
    per_process = [r for r in rows if "worker_id=" in r["scope"]]
    assert per_process and all(r["scope"].startswith(f"release={aug.name},") for r in per_process)
    leaking_workers = {w.worker_id for w in sim.workers if "fused_allreduce" in w.switches}
    for r in per_process:
        ev = json.loads(r["evidence"])
        assert r["scope"].split("worker_id=")[1] in leaking_workers
        assert r["value"] > 500 * 2**20  # ~0.9 GiB per new first-forward shape
        assert ev["buffers_per_shape"] > 0.9 and ev["p_value"] < 1e-3
        assert ev["hours_to_oom"] is not None and ev["hours_to_oom"] < 72
    assert len(read_findings(store, kind="memory_growth", status="open")) == len(rows)


def test_healthy_and_benign_fleets_are_not_flagged(store, small):
    sim = simulate_fleet(store, weeks=1, incidents=["benign"], seed=12, **small)
    procs, rows = memory.analyze(store, sim.start, sim.end)
    assert rows == []
    assert len(procs) >= len(sim.workers) and not procs["flagged"].any()


def test_processes_split_at_deploys_and_ooms(store, small):
    sim = simulate_fleet(store, weeks=1, incidents=[("august", 2)], seed=13, **small)
    s = memory.sessions_with_processes(store, sim.start, sim.end)
    assert sim.ooms > 0
    n_proc = s.select("process").n_unique()
    # one process per worker before the rollout, one after the deploy, one more after each OOM
    assert n_proc == 2 * len(sim.workers) + sim.ooms


def _frame(rng, *, workers=4, sessions=72, leak_on=None, per_value=16e6, headroom=1.5e9, noise=50e6,
           kind="h200"):
    """memory_sessions-shaped rows: one session every 10 minutes per worker, prompt lengths from 400
    values (mostly new ones), 14 decoder resolutions in rotation; reserved grows ``per_value`` per new
    value of ``leak_on`` (a SHAPE_KEYS name, or None)."""
    from datetime import UTC, datetime

    import polars as pl
    cap = memory.GPU_MEMORY_BYTES[kind]
    t0 = datetime(2026, 11, 2, tzinfo=UTC)
    rows = []
    for w in range(workers):
        seen = set()
        for i in range(sessions):
            tokens = int(rng.integers(800, 1200))
            res = [(360 + 40 * r, 640 + 64 * r) for r in range(14)][int(rng.integers(14))]
            value = {"first_forward_tokens": tokens, "decoder_resolution": res, None: None}[leak_on]
            seen.add(value)
            grown = per_value * (len(seen) if leak_on else 0)
            rows.append({"release": "v2", "gpu_kind": kind, "worker_id": f"w{w}", "session_id": f"s{w}-{i}",
                         "start_ts": t0 + timedelta(minutes=10 * i), "buffers_max": 1, "switch_state": "ring_cache",
                         "mem_reserved_max": int(cap - headroom - 72 * per_value + grown + rng.normal(0, noise)),
                         "first_forward_tokens": tokens, "cond_tokens": tokens - 757, "decoder_height": res[0],
                         "decoder_width": res[1], "tp_size": 1, "chunk_frames": 4})
    return pl.DataFrame(rows), pl.DataFrame()


def test_a_small_leak_with_a_day_to_oom_is_critical_and_names_its_key():
    """16 MB per new prompt length, far below any fixed per-shape floor: at ~6 new lengths an hour and
    ~1.5 GB of headroom it runs out of memory in well under a day, so it is critical."""
    import numpy as np

    s, ooms = _frame(np.random.default_rng(1), leak_on="first_forward_tokens")
    _procs, rows = memory.analyze_frame(s, ooms)
    release = [r for r in rows if r["scope"] == "release=v2"]
    assert len(release) == 1 and release[0]["severity"] == "critical"
    ev = json.loads(release[0]["evidence"])
    assert ev["explained_by"] == "first_forward_tokens" and "cond_tokens" in ev["aliases"]
    assert ev["min_hours_to_oom"] < memory.CRITICAL_HOURS_TO_OOM
    assert 8e6 < ev["release_bytes_per_unit"] < 32e6


def test_a_leak_keyed_on_decoder_resolution_is_named_for_it_and_bounded():
    """+180 MB per new resolution, 14 in rotation: named for the resolution (not the prompt); at the rate
    new resolutions arrive, 20 GB of headroom last days: a warning."""
    import numpy as np

    s, ooms = _frame(np.random.default_rng(2), leak_on="decoder_resolution", per_value=180e6, headroom=20e9,
                     noise=300e6)
    _procs, rows = memory.analyze_frame(s, ooms)
    release = [r for r in rows if r["scope"] == "release=v2"]
    assert len(release) == 1
    ev = json.loads(release[0]["evidence"])
    assert ev["explained_by"] == "decoder_resolution"
    assert release[0]["severity"] == "warning" and ev["min_hours_to_oom"] > memory.CRITICAL_HOURS_TO_OOM


def test_no_leak_no_finding_on_literal_noise():
    import numpy as np

    for seed in range(5):
        s, ooms = _frame(np.random.default_rng(10 + seed), leak_on=None)
        assert memory.analyze_frame(s, ooms)[1] == []
