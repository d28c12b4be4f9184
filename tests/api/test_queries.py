"""Dashboard REST on a simulated fleet: fps fractions, distributions, comparison, memory, findings;
bad filters, ranges and paging are 4xx with the reason."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import polars as pl
import pytest

from tests.api.conftest import bare_app, make_settings

END = datetime(2026, 11, 23, tzinfo=UTC)
RANGE = {"start": (END - timedelta(days=14)).isoformat(), "end": END.isoformat()}


@pytest.fixture
def fleet(store):
    from analytics.simulate import simulate_fleet

    return simulate_fleet(store, weeks=2, incidents=[("august", 6)], workers=6, sessions_per_day=12,
                          session_median_s=20, seed=2, end=END)


def test_fleet_fps_fractions_group_and_bound(client, fleet):
    r = client.get("/v1/fleet/fps", params={**RANGE, "group_by": ["release"]})
    assert r.status_code == 200
    rows = r.json()["rows"]
    assert {x["release"] for x in rows} == {rel.name for rel in fleet.releases}
    assert all(0 <= x["frac_le_24fps"] <= 1 and 0 <= x["frac_le_23_5fps"] <= x["frac_le_24fps"] and x["sessions"] > 0 for x in rows)
    weekly = client.get("/v1/fleet/fps", params=RANGE).json()["rows"]
    assert sum(x["sessions"] for x in weekly) == sum(x["sessions"] for x in rows)
    assert {x["week"] for x in weekly} <= {"2026-11-09", "2026-11-16"}


def test_distributions_and_compare(client, fleet):
    a, b = (rel.name for rel in fleet.releases[:2])
    r = client.get("/v1/releases/distributions", params={**RANGE, "metric": "step_period_ms"})
    rows = r.json()["rows"]
    assert [x["release"] for x in rows] == sorted([a, b])
    assert all(x["p5"] <= x["p50"] <= x["p95"] <= x["p99"] for x in rows)
    c = client.get("/v1/releases/compare", params={**RANGE, "baseline": a, "candidate": b}).json()
    assert set(c["metrics"]) >= {"fps", "step_period_ms", "upkeep_ms", "energy_per_chunk_mj", "late_rate"}
    # the August release leaks and fragments: its sessions are slower than the baseline's
    assert c["metrics"]["step_period_ms"]["median_change"] > 0


def test_memory_growth_counts_distinct_shapes_per_worker(client, fleet):
    first = client.get("/v1/memory/growth", params={**RANGE, "limit": 10}).json()
    assert first["total"] > 10 and len(first["sessions"]) == 10
    worker = first["sessions"][0]["worker_id"]
    body = client.get("/v1/memory/growth", params={**RANGE, "limit": 1000, "worker_id": worker}).json()
    df = pl.DataFrame(body["sessions"]).sort("first_ts")
    assert body["total"] == df.height > 0 and set(df["worker_id"]) == {worker}
    shapes = df["distinct_shapes"].to_list()
    assert shapes[0] == 1 and shapes == sorted(shapes)
    assert shapes[-1] == df["first_forward_tokens"].n_unique()


def test_session_events_and_memory(client, fleet, store):
    sid = store.query_rows("SELECT session_id FROM session_stats ORDER BY session_id LIMIT 1")[0][0]
    mem = client.get(f"/v1/sessions/{sid}/memory").json()["series"]
    assert len(mem) > 0 and {"mem_reserved_bytes", "buffers_registered"} <= set(mem[0])
    assert client.get(f"/v1/sessions/{sid}/events").status_code == 200
    assert client.get("/v1/sessions/no-such-session/memory").status_code == 404


@pytest.mark.parametrize("path,params,status,fragment", [
    ("/v1/fleet/fps", {"start": "2026-11-10T00:00:00Z", "end": "2026-11-01T00:00:00Z"}, 422, "before"),
    ("/v1/fleet/fps", {"start": "2020-01-01T00:00:00Z", "end": "2026-01-01T00:00:00Z"}, 422, "400 days"),
    ("/v1/fleet/fps", {"start": "yesterday"}, 422, "start"),
    ("/v1/fleet/fps", {"group_by": "planet"}, 422, "group_by"),
    ("/v1/releases/distributions", {"metric": "vibes"}, 422, "metric"),
    ("/v1/findings", {"limit": 0}, 422, "limit"),
    ("/v1/findings", {"limit": 5000}, 422, "limit"),
    ("/v1/findings", {"offset": -1}, 422, "offset"),
    ("/v1/findings", {"kind": "gossip"}, 422, "kind"),
    ("/v1/releases/compare", {"baseline": "v0", "candidate": "v9"}, 404, "known releases"),
    ("/v1/releases/compare", {"baseline": "v0"}, 422, "candidate"),
])
def test_bad_queries_are_4xx_with_reason(client, path, params, status, fragment):
    r = client.get(path, params=params)
    assert r.status_code == status, r.text
    assert fragment in str(r.json()["detail"])


def test_findings_filters_and_paging(client, store):
    from datetime import datetime as dt

    now = dt.now(UTC)
    store.client().insert("findings", [
        ["memory_growth", f"release=v{i}", "bytes_per_shape", now - timedelta(days=1), now, None, float(i), None,
         0.99, "critical" if i % 2 else "warning", "open", "fused_allreduce", "{}", "test", now, now]
        for i in range(5)], column_names=["kind", "scope", "metric", "window_start", "window_end", "baseline",
                                          "value", "effect", "confidence", "severity", "status", "attribution",
                                          "evidence", "job", "first_seen", "updated_at"])
    r = client.get("/v1/findings", params={"kind": "memory_growth", "severity": "critical"}).json()
    assert sorted(f["scope"] for f in r["findings"]) == ["release=v1", "release=v3"]
    p1 = client.get("/v1/findings", params={"limit": 2}).json()["findings"]
    p2 = client.get("/v1/findings", params={"limit": 2, "offset": 2}).json()["findings"]
    assert len(p1) == len(p2) == 2 and not {f["scope"] for f in p1} & {f["scope"] for f in p2}


def test_reads_need_a_token_when_read_tokens_are_set(store, tmp_path):
    from fastapi.testclient import TestClient

    app = bare_app(store, make_settings(tmp_path, read_tokens=["reader"]))
    with TestClient(app) as c:
        assert c.get("/v1/findings").status_code == 401
        assert c.get("/v1/switches").status_code == 401
        assert c.get("/v1/findings", headers={"Authorization": "Bearer reader"}).status_code == 200
        assert c.get("/v1/switches", headers={"Authorization": "Bearer reader"}).status_code == 200


def test_fleet_fps_equals_a_per_session_computation_after_the_rollup(client, fleet, store):
    from analytics.queries import rollup
    from api.views import sessions_in

    rollup(store, END + timedelta(days=1))  # every simulated day closed and rolled up
    got = {r["release"]: r for r in client.get("/v1/fleet/fps", params={**RANGE, "group_by": "release"}).json()["rows"]}
    df = sessions_in(store, END - timedelta(days=14), END)
    for (rel,), g in df.group_by(["release"]):
        assert got[rel]["sessions"] == g.height
        assert got[rel]["frac_le_24fps"] == pytest.approx(float((g["fps"] <= 24).mean()))
        assert got[rel]["frac_le_23_5fps"] == pytest.approx(float((g["fps"] <= 23.5).mean()))


def sessions_from_raw_steps(store, start: datetime, end: datetime) -> pl.DataFrame:
    """Per-session metrics straight from the raw ``steps`` rows (no view, no roll-up): the reference."""
    steps = store.query_df("SELECT session_id, release, ts, step_period_ms, late, cache_upkeep_ms, energy_mj FROM steps")
    per = steps.group_by("session_id", "release").agg(
        pl.col("ts").min().alias("start"), pl.len().alias("n"),
        pl.col("step_period_ms").cast(pl.Float64).sum().alias("period_sum"),
        pl.col("late").cast(pl.Int64).sum().alias("late"),
        pl.col("cache_upkeep_ms").cast(pl.Float64).mean().alias("upkeep_ms"),
    ).with_columns(
        (pl.col("n") * 4 / (pl.col("period_sum") / 1000)).alias("fps"),
        (pl.col("period_sum") / pl.col("n")).alias("step_period_ms"),
        (pl.col("late") / pl.col("n")).alias("late_rate"),
    )
    return per.filter((pl.col("period_sum") >= 1000) & (pl.col("start") >= start) & (pl.col("start") < end))


def test_fleet_fps_equals_the_raw_steps_before_and_after_the_rollup(client, fleet, store):
    from analytics.queries import rollup

    raw = sessions_from_raw_steps(store, END - timedelta(days=14), END)
    assert raw.height > 50 and raw["release"].n_unique() >= 2
    for rolled in (False, True):
        if rolled:
            assert rollup(store, END + timedelta(days=1))  # every simulated day closed and rolled up
        got = {r["release"]: r for r in
               client.get("/v1/fleet/fps", params={**RANGE, "group_by": "release"}).json()["rows"]}
        assert set(got) == set(raw["release"])
        for (rel,), g in raw.group_by(["release"]):
            assert got[rel]["sessions"] == g.height
            assert got[rel]["frac_le_24fps"] == pytest.approx(float((g["fps"] <= 24).mean()))
            assert got[rel]["frac_le_23_5fps"] == pytest.approx(float((g["fps"] <= 23.5).mean()))
            assert got[rel]["mean_fps"] == pytest.approx(float(g["fps"].mean()), rel=1e-9)


@pytest.mark.parametrize("metric", ["fps", "step_period_ms", "late_rate", "upkeep_ms"])
def test_distributions_and_compare_equal_the_raw_steps(client, fleet, store, metric):
    raw = sessions_from_raw_steps(store, END - timedelta(days=14), END).drop_nulls(metric)
    body = client.get("/v1/releases/distributions", params={**RANGE, "metric": metric}).json()
    got = {r["release"]: r for r in body["rows"]}
    assert set(got) == set(raw["release"])
    for (rel,), g in raw.group_by(["release"]):
        assert got[rel]["sessions"] == g.height
        assert got[rel]["mean"] == pytest.approx(float(g[metric].mean()), rel=1e-6, abs=1e-12)
        for q in body["quantiles"]:
            want = g[metric].quantile(int(q[1:]) / 100, "linear")
            assert got[rel][q] == pytest.approx(want, rel=1e-6, abs=1e-12), (rel, q)
    a, b = sorted(got)[:2]
    c = client.get("/v1/releases/compare", params={**RANGE, "baseline": a, "candidate": b}).json()
    assert c["metrics"][metric]["baseline"] == got[a] and c["metrics"][metric]["candidate"] == got[b]
    change = got[b]["p50"] / got[a]["p50"] - 1 if got[a]["p50"] else None  # late rate: a median of 0
    assert c["metrics"][metric]["median_change"] == pytest.approx(change)
    one = client.get("/v1/releases/distributions", params={**RANGE, "metric": metric, "release": a}).json()
    assert one["rows"] == [got[a]]
