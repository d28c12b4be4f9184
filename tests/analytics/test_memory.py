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
