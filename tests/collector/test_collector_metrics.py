"""The collector's /metrics: names and types, ingest counts, spool and writer state, fleet counters per release."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client.openmetrics.parser import text_string_to_metric_families

from tests.collector.conftest import TOKEN
from tests.collector.helpers import ARROW, arrow_body, json_rows, step_rows, wait_for

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def scrape(c, accept: str = OPENMETRICS) -> dict:
    r = c.get("/metrics", headers={"Accept": accept})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(fams: dict, family: str, sample: str, **labels) -> float:
    for s in fams[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {sample}{labels} in {family}: {fams[family].samples}")


def test_names_and_types(collector):
    c = collector()
    fams = scrape(c)
    want = {
        "livestep_collector_rows_accepted": "counter", "livestep_collector_rows_refused": "counter",
        "livestep_collector_batches_refused": "counter", "livestep_collector_batches_deduplicated": "counter",
        "livestep_collector_spool_bytes": "gauge", "livestep_collector_spool_oldest_row_age_seconds": "gauge",
        "livestep_collector_writer_up": "gauge", "livestep_collector_store_errors": "counter",
        "livestep_collector_writer_block_rows": "histogram", "livestep_fleet_step_period_seconds": "histogram",
        "livestep_fleet_late_chunks": "counter", "livestep_fleet_chunks": "counter",
        "livestep_fleet_slow_sessions": "counter", "livestep_collector_degraded": "gauge",
        "livestep_collector_quarantine_batches": "gauge", "livestep_collector_quarantine_rows": "gauge",
        "livestep_collector_writer_failing_seconds": "gauge",
    }
    assert {n: fams[n].type for n in want} == want
    assert "livestep_findings_open" not in fams  # the api role's families are not a collector's


def test_text_format_without_openmetrics_accept(collector):
    c = collector()
    r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE livestep_collector_spool_bytes gauge" in r.text and "# EOF" not in r.text


def test_metrics_needs_a_token_off_loopback_rules(collector):
    c = collector(read_tokens=["reader-token"])
    r = c.get("/metrics", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 403
    assert c.get("/metrics", headers={"Authorization": "Bearer reader-token"}).status_code == 200
    assert c.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200  # ingest reads too


def test_ingest_counts_and_fleet_counters(collector):
    c = collector()
    late_rows = step_rows(10, session_id="a", release="v2")  # step_rows: every 5th step late
    r = c.post("/v1/telemetry", content=arrow_body("step", late_rows), headers={"Content-Type": ARROW,
                                                                                "Idempotency-Key": "b1"})
    assert r.status_code == 200, r.text
    assert c.post("/v1/telemetry", content=arrow_body("step", late_rows),
                  headers={"Content-Type": ARROW, "Idempotency-Key": "b1"}).json()["duplicate"]
    ok = step_rows(6, session_id="b", release="v1", late=False, step_period_ms=100.0)
    assert c.post("/v1/telemetry", json={"steps": json_rows(ok)}).status_code == 200
    bad = json_rows(step_rows(1, release="v1"))
    bad[0]["step_period_ms"] = -1
    assert c.post("/v1/telemetry", json={"steps": bad}).status_code == 422
    bad_arrow = step_rows(4, release="v1")
    bad_arrow[2]["step_period_ms"] = float("nan")
    assert c.post("/v1/telemetry", content=arrow_body("step", bad_arrow), headers={"Content-Type": ARROW}
                  ).status_code == 422
    assert c.post("/v1/telemetry", content=b"x", headers={"Content-Type": "text/csv"}).status_code == 415
    assert c.post("/v1/telemetry", json={"steps": json_rows(ok)}, headers={"Authorization": "Bearer x"}).status_code == 403
    end = {"worker_id": "w1", "session_id": "a", "release": "v2", "gpu_kind": "cpu", "phase": "end",
           "ts": (datetime.now(UTC) - timedelta(minutes=1)).isoformat(), "first_forward_tokens": 8,
           "streamed_s": 2.0, "frames": 40, "avg_fps": 20.0, "late_chunks": 2, "stall_ms": 10.0, "tp_size": 1,
           "shape": "tiny", "switches": "ring_cache"}
    assert c.post("/v1/telemetry", json={"sessions": [end, {**end, "session_id": "short", "streamed_s": 0.5}]}
                  ).status_code == 200

    fams = wait_for(lambda: (f := scrape(c)) and value(f, "livestep_collector_writer_rows",
                                                       "livestep_collector_writer_rows_total") >= 18 and f,
                    what="the writer to store 18 rows")
    assert value(fams, "livestep_collector_rows_accepted", "livestep_collector_rows_accepted_total", kind="step") == 16
    assert value(fams, "livestep_collector_batches_deduplicated", "livestep_collector_batches_deduplicated_total") == 1
    assert value(fams, "livestep_collector_batches_refused", "livestep_collector_batches_refused_total",
                 status="422", reason="invalid") == 2
    assert value(fams, "livestep_collector_rows_refused", "livestep_collector_rows_refused_total",
                 kind="step", reason="invalid") == 4  # the Arrow batch read as a table (the JSON one failed its model)
    assert value(fams, "livestep_collector_batches_refused", "livestep_collector_batches_refused_total",
                 status="415") == 1
    assert value(fams, "livestep_collector_batches_refused", "livestep_collector_batches_refused_total",
                 status="403", reason="forbidden") == 1
    assert value(fams, "livestep_fleet_late_chunks", "livestep_fleet_late_chunks_total", release="v2") == 2
    assert value(fams, "livestep_fleet_late_chunks", "livestep_fleet_late_chunks_total", release="v1") == 0
    assert value(fams, "livestep_fleet_chunks", "livestep_fleet_chunks_total", release="v1", gpu_kind="cpu") == 6
    # 166.5 ms sits under the 0.1667 s bucket, 100 ms under 0.1
    assert value(fams, "livestep_fleet_step_period_seconds", "livestep_fleet_step_period_seconds_bucket",
                 release="v2", le="0.16") == 0
    assert value(fams, "livestep_fleet_step_period_seconds", "livestep_fleet_step_period_seconds_bucket",
                 release="v2", le="0.1667") == 10
    assert value(fams, "livestep_fleet_step_period_seconds", "livestep_fleet_step_period_seconds_bucket",
                 release="v1", le="0.1") == 6
    # the short session is not judged; the other one is at or below 24 fps
    assert value(fams, "livestep_fleet_sessions", "livestep_fleet_sessions_total", release="v2") == 1
    assert value(fams, "livestep_fleet_slow_sessions",
                 "livestep_fleet_slow_sessions_total", release="v2") == 1
    assert value(fams, "livestep_collector_spool_bytes", "livestep_collector_spool_bytes") >= 0
    assert value(fams, "livestep_collector_writer_up", "livestep_collector_writer_up") == 1
    blocks = value(fams, "livestep_collector_writer_block_rows", "livestep_collector_writer_block_rows_count",
                   kind="step")
    assert blocks >= 1


def test_spool_full_counts_429_its_rows_and_store_errors(collector, tmp_path):
    down = tmp_path / "down"
    down.touch()  # the store is held down: the spool fills up
    c = collector(spool_max_bytes=1 << 20, fault_store_down_file=down)
    for i in range(400):  # ~10 KB a batch against a 1 MiB bound
        r = c.post("/v1/telemetry", content=arrow_body("step", step_rows(100, start=100 * i)),
                   headers={"Content-Type": ARROW, "Idempotency-Key": f"b{i}"})
        if r.status_code == 429:
            break
        assert r.status_code == 200
    assert r.status_code == 429, "the bound was never reached"
    fams = scrape(c)
    assert value(fams, "livestep_collector_batches_refused", "livestep_collector_batches_refused_total",
                 status="429", reason="spool_full") == 1
    assert value(fams, "livestep_collector_rows_refused", "livestep_collector_rows_refused_total",
                 kind="step", reason="spool_full") == 100
    assert value(fams, "livestep_collector_spool_bytes", "livestep_collector_spool_bytes") > (1 << 20) - 20_000
    assert value(fams, "livestep_collector_rows_accepted", "livestep_collector_rows_accepted_total",
                 kind="step") == 100 * i
    wait_for(lambda: value(scrape(c), "livestep_collector_store_errors", "livestep_collector_store_errors_total") > 0,
             what="a failed insert counted")
    assert value(fams, "livestep_collector_spool_oldest_row_age_seconds",
                 "livestep_collector_spool_oldest_row_age_seconds") > 0


def test_fleet_counters_keep_only_the_releases_stored_most_recently():
    """A fleet rolling through releases does not grow the release label without bound."""
    from collector import records
    from collector.metrics import FleetCounters

    fleet = FleetCounters(max_releases=3)
    for i in range(6):
        fleet.observe("step", records.to_arrow("step", step_rows(2, release=f"v{i}")))
    fleet.observe("step", records.to_arrow("step", step_rows(2, release="v3")))  # v3 seen again: kept
    fleet.observe("step", records.to_arrow("step", step_rows(2, release="v6")))
    releases = {s.labels["release"] for f in fleet.families() if f.name.startswith("livestep_fleet")
                for s in f.samples}
    assert releases == {"v5", "v3", "v6"}
