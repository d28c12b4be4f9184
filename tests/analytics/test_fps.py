"""Weekly fps fractions: the ClickHouse aggregation over session_stats equals a direct computation
from the raw step rows."""

from datetime import timedelta

import polars as pl
import pytest

from analytics import fps, queries
from analytics.simulate import simulate_fleet


def direct_from_raw_steps(store, start, end) -> pl.DataFrame:
    raw = store.query_df("SELECT release, gpu_kind, session_id, ts, step_period_ms FROM steps")
    per_session = raw.group_by("release", "gpu_kind", "session_id").agg(
        pl.len().alias("steps"), pl.col("step_period_ms").cast(pl.Float64).sum().alias("period_ms"),
        pl.col("ts").min().alias("start_ts"),
    ).with_columns((pl.col("period_ms") / 1000).alias("streamed_s"))
    per_session = per_session.with_columns((pl.col("steps") * 4 / pl.col("streamed_s")).alias("fps"))
    per_session = per_session.filter((pl.col("streamed_s") >= 1.0) & (pl.col("start_ts") >= start)
                                     & (pl.col("start_ts") < end))
    return per_session.with_columns(pl.col("start_ts").dt.truncate("1w").dt.date().alias("week")).group_by(
        "week", "release", "gpu_kind").agg(
        pl.len().alias("sessions"), (pl.col("fps") <= 24).sum().alias("n_le_24"),
        (pl.col("fps") <= 23.5).sum().alias("n_le_23_5"),
    ).sort("week", "release", "gpu_kind")


def test_weekly_fractions_equal_a_direct_computation(store, small):
    sim = simulate_fleet(store, weeks=2, incidents=["august"], seed=3, **small)
    got = fps.weekly_fractions(store, sim.start, sim.end).sort("week", "release", "gpu_kind")
    want = direct_from_raw_steps(store, sim.start, sim.end)
    key = ["week", "release", "gpu_kind", "sessions", "n_le_24", "n_le_23_5"]
    assert got.select(key).with_columns(pl.col(c).cast(pl.Int64) for c in key[3:]).to_dicts() == \
        want.select(key).with_columns(pl.col(c).cast(pl.Int64) for c in key[3:]).to_dicts()
    assert got["n_le_24"].sum() > 0  # the incident makes some sessions slow: the check is not vacuous
    for r in got.iter_rows(named=True):
        assert r["frac_le_24fps"] == r["n_le_24"] / r["sessions"]
        assert r["frac_le_24fps_lo"] <= r["frac_le_24fps"] <= r["frac_le_24fps_hi"]
        assert r["frac_le_23_5fps"] <= r["frac_le_24fps"]


def test_sessions_shorter_than_a_second_are_not_counted(store, small):
    sim = simulate_fleet(store, weeks=1, seed=4, **small)
    raw = store.query_df("SELECT session_id, sum(step_period_ms) / 1000 AS s FROM steps GROUP BY session_id")
    short = (raw["s"] < 1.0).sum()
    assert short > 0
    got = fps.weekly_fractions(store, sim.start, sim.end)
    assert got["sessions"].sum() == len(raw) - short


def test_findings_rows_carry_counts_and_intervals(store, small):
    sim = simulate_fleet(store, weeks=1, seed=5, **small)
    rows = fps.run(store, sim.start, sim.end)
    assert {r["metric"] for r in rows} == {"frac_le_24fps", "frac_le_23_5fps"}
    for r in rows:
        assert r["kind"] == "fps_fraction" and r["scope"].startswith("gpu_kind=")
        assert r["window_start"].weekday() == 0
        assert '"ci_method": "wilson"' in r["evidence"]


def test_rolled_up_fleet_queries_equal_the_live_ones(store, small):
    sim = simulate_fleet(store, weeks=2, incidents=["august"], seed=6, **small)
    start = sim.start + timedelta(hours=5)  # a window that does not start at midnight
    live = queries.fps_fractions(store, start, sim.end, live=True)
    dist_live = queries.release_distribution(store, start, sim.end, live=True)
    rolled_days = queries.rollup(store, now=sim.end)
    assert len(rolled_days) >= 13
    rolled = queries.fps_fractions(store, start, sim.end)
    counts = ["week", "release", "gpu_kind", "sessions", "n_le_24", "n_le_23_5"]
    assert rolled.select(counts).equals(live.select(counts))
    dist = queries.release_distribution(store, start, sim.end)
    assert dist["sessions"].to_list() == dist_live["sessions"].to_list()
    assert dist["late_rate"].to_list() == pytest.approx(dist_live["late_rate"].to_list())
    # only the last closed day is rolled again (sessions crossing midnight) until late rows arrive
    assert queries.rollup(store, now=sim.end) == [rolled_days[-1]]
    store.command("TRUNCATE TABLE steps")
    store.command("TRUNCATE TABLE session_stats")
    store.command("TRUNCATE TABLE session_fleet")
    simulate_fleet(store, weeks=2, incidents=["august"], seed=7, **(small | {"end": sim.end}))  # "late" rows
    assert len(queries.rollup(store, now=sim.end)) >= 13
    assert queries.fps_fractions(store, start, sim.end).select(counts).equals(
        queries.fps_fractions(store, start, sim.end, live=True).select(counts))


def test_a_weekly_finding_is_resolved_only_by_a_later_week_that_shows_it_fixed(store):
    """Writing week 2 (still above the threshold) keeps week 1's warning open; week 3 at 'info' (fixed)
    resolves both. (The weekly job once resolved every earlier week as soon as a new week was written.)"""
    from datetime import UTC, datetime

    from analytics.findings import finding, read_findings, write_findings

    w1 = datetime(2026, 11, 2, tzinfo=UTC)

    def week(n: int, severity: str, share: float) -> list[dict]:
        start = w1 + timedelta(days=7 * n)
        rows = [finding("fps_fraction", {"release": "v1", "gpu_kind": "h100"}, "frac_le_24fps", start,
                        start + timedelta(days=7), value=share, severity=severity)]
        write_findings(store, "weekly_fps", start, start + timedelta(days=7), rows)
        return rows

    def open_weeks() -> list:
        df = read_findings(store, kind="fps_fraction", status="open")
        return sorted(t.date().isoformat() for t in df["window_start"].to_list())

    week(0, "warning", 0.12)
    week(1, "warning", 0.09)
    assert open_weeks() == ["2026-11-02", "2026-11-09"]
    week(2, "info", 0.01)
    assert open_weeks() == ["2026-11-16"]
    resolved = read_findings(store, kind="fps_fraction", status="resolved")
    assert sorted(resolved["severity"].to_list()) == ["warning", "warning"]
