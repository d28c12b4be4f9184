"""Turn latency: the simulator's turns in ClickHouse (turns + the turn_stats view), per release x GPU
kind quantiles with intervals, and the detector: a release that keeps the whole playout buffer at a turn
(a deeper queue) is flagged against its baseline; a benign release is not."""

from __future__ import annotations

import orjson
import pytest

from analytics import turns
from analytics.simulate import SimulationError, simulate_fleet
from tests.collector.helpers import migrated_store


@pytest.fixture(scope="module")
def fleet(chdb_dir):
    """Two weeks of a small fleet with turns, simulated once for the module's tests (read only)."""
    from tests.analytics.conftest import SMALL

    store = migrated_store(chdb_dir)
    sim = simulate_fleet(store, weeks=2, incidents=[("benign", 4), ("benign", 9)], seed=7, turns=True,
                         turn_queue="v1.2", **{**SMALL, "session_median_s": 20.0})
    yield store, sim
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


def test_the_deeper_queue_is_flagged_and_the_benign_release_is_not(fleet):
    store, sim = fleet
    rows = turns.run(store, sim.start, sim.end)
    flagged = {(r["scope"], r["metric"]) for r in rows}
    assert {s for s, _ in flagged} == {f"gpu_kind={k},release=v1.2" for k in ("b200", "h100", "h200")}
    assert {m for _, m in flagged} >= {"turn_latency_ms", "turn_queue_ms"}
    for r in rows:
        ev = orjson.loads(r["evidence"])
        assert ev["baseline_release"] == "v1.1" and ev["worst_part"] == "queue"
        assert ev["policies"] == {"treatment": ["keep"], "control": ["trim"]}
        if r["metric"] == "turn_latency_ms":  # two more chunks played first: ~333 ms on ~420
            assert 0.5 < r["effect"] < 1.2 and r["severity"] == "critical"
            assert ev["part_change_ms"]["queue"] == pytest.approx(333, rel=0.1)


def test_quantiles_with_intervals_per_release_gpu_kind_and_part(fleet):
    store, sim = fleet
    df = turns.latency_table(store, sim.start, sim.end, n_boot=100)
    assert set(df["part"].unique()) == {"latency", "wait", "recompute", "generation", "queue"}
    assert set(df["release"].unique()) == {"v1.0", "v1.1", "v1.2"}
    for row in df.iter_rows(named=True):
        for q in ("p50", "p95", "p99"):
            assert row[f"{q}_lo"] <= row[q] <= row[f"{q}_hi"], row
        assert row["p50"] <= row["p95"] <= row["p99"] and row["turns"] > row["sessions"] > 30
    lat = df.filter(df["part"] == "latency")
    base = lat.filter(lat["release"] == "v1.1").sort("gpu_kind")
    deep = lat.filter(lat["release"] == "v1.2").sort("gpu_kind")
    assert (deep["p50_lo"] > base["p50_hi"]).all()  # the intervals tell the two apart


def test_stage_medians_merge_the_views_states(fleet):
    store, sim = fleet
    df = turns.stage_medians(store, sim.start, sim.end)
    raw = store.query_rows("SELECT release, gpu_kind, count() FROM turns GROUP BY release, gpu_kind")
    assert sorted(df.select("release", "gpu_kind", "turns").rows()) == sorted(raw)
    v12 = df.filter(df["release"] == "v1.2")
    assert set(v12["policy"]) == {"keep"} and (v12["queue_ms"] > 300).all()
    for row in df.iter_rows(named=True):  # the parts' medians add up to about the latency's
        parts = sum(row[f"{p}_ms"] for p in turns.PARTS)
        assert parts == pytest.approx(row["latency_ms"], rel=0.15)


def test_every_turn_is_consistent(fleet):
    store, _ = fleet
    bad = store.query_rows(
        "SELECT count() FROM turns WHERE abs(wait_ms + recompute_ms + generation_ms + queue_ms - latency_ms) > 0.01 "
        "OR generated_at < ts OR played_at < generated_at")
    assert bad == [(0,)]
    assert store.query_rows("SELECT countIf(speaking) * 2 >= count() - 1 FROM turns") == [(True,)]


def test_turn_queue_must_name_a_simulated_release(store, small):
    with pytest.raises(SimulationError, match="valid: v1.0, v1.1"):
        simulate_fleet(store, weeks=1, incidents=["benign"], turns=True, turn_queue="v9", **small)


def test_the_scheduled_job_writes_the_turn_findings(fleet):
    from analytics import jobs
    from analytics.findings import read_findings

    store, sim = fleet
    rows = jobs.run_job("turn_regressions", store, start=sim.start, end=sim.end)
    assert rows and {r["metric"] for r in rows} >= {"turn_latency_ms"}
    stored = read_findings(store, kind="regression")
    assert set(stored.filter(stored["metric"] == "turn_latency_ms")["scope"]) == {
        f"gpu_kind={k},release=v1.2" for k in ("b200", "h100", "h200")}


def _frame(n: int, latency: float, queue: float, stalled_every: int, seed: int):
    """Per-session turn frames as ``session_turns`` returns them: lognormal spread around the medians."""
    from datetime import UTC, datetime, timedelta

    import numpy as np
    import polars as pl

    rng = np.random.default_rng(seed)
    spread = np.exp(rng.normal(0, 0.05, n))
    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    return pl.DataFrame({
        "start_ts": [t0 + timedelta(hours=3 * i) for i in range(n)],  # eight sessions a day
        "policy": ["trim"] * n, "turns": [10] * n,
        "stalled_turns": [1 if i % stalled_every == 0 else 0 for i in range(n)],
        "latency_ms": latency * spread, "queue_ms": queue * spread,
        "wait_ms": 70.0 * spread, "recompute_ms": 2.0 * spread, "generation_ms": 270.0 * spread,
    })


@pytest.mark.parametrize(("latency", "queue", "stalled_every", "flagged"), [
    (440.0, 90.0, 10, set()),  # the same
    (452.0, 92.0, 10, set()),  # +3%: within the floor (5%) of a turn's latency
    (600.0, 250.0, 10, {"turn_latency_ms", "turn_queue_ms"}),  # a deeper queue
    (440.0, 90.0, 2, {"turn_stall_rate"}),  # 5 in 10 sessions with a stalled turn, was 1 in 10
])
def test_the_judges_on_literal_cohorts(latency, queue, stalled_every, flagged):
    control = _frame(120, 440.0, 90.0, 10, seed=1)
    treatment = _frame(120, latency, queue, stalled_every, seed=2)
    got = {j.metric for j in turns.judge(treatment, control) if j.regressed}
    assert got == flagged


@pytest.mark.e2e
def test_simulate_with_turns_then_analyze_as_commands(tmp_path):
    from tests.analytics.test_cli import livestep

    dsn = f"chdb://{tmp_path / 'chdb'}"
    out = livestep("simulate", "--direct", "--dsn", dsn, "--weeks", "1", "--incident", "benign@3", "--workers", "6",
                   "--sessions-per-day", "48", "--session-median-s", "20", "--turns", "--turn-queue", "v1.1",
                   "--no-progress")
    assert out.returncode == 0, out.stderr
    out = livestep("analyze", "turn_regressions", "--dsn", dsn)
    assert out.returncode == 0, out.stderr
    assert "turn_latency_ms" in out.stdout and "release=v1.1" in out.stdout
    bad = livestep("simulate", "--direct", "--dsn", dsn, "--turns", "--turn-queue", "v9")
    assert bad.returncode != 0 and "valid: v1.0" in bad.stderr
