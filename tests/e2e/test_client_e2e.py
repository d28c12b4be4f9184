"""The shipping client against a real ``livestep serve`` subprocess (uvicorn, spool, chDB).

Each server process gets its own chDB and spool directories (tmp_path) and an ephemeral loopback
port. Stored rows are read back through the server's own HTTP reads, and, after the server has
exited, counted in its chDB directory by a separate process (chDB: one process per directory).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import datetime

import httpx
import pytest

from api.demo import SessionSpec, session_records
from collector.client import TelemetryClient
from tests.serving import Serve, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def serve(tmp_path):
    s = Serve(tmp_path, free_port())
    yield s
    s.stop()


def test_round_trip_exact_counts_and_values(serve):
    serve.start()
    spec = SessionSpec(steps=120, seed=7)
    sent = list(session_records(spec))
    c = TelemetryClient(serve.url, batch_rows=64, flush_interval_s=0.1)
    for kind, row in sent:
        c.put(kind, row)
    assert c.close(timeout_s=20.0)
    put = Counter(kind for kind, _ in sent)
    assert (c.sent, c.dropped, c.failed_batches) == (sum(put.values()), 0, 0)

    assert serve.wait_drained()["spool"]["batches"] == 0
    stored = serve.steps(spec.session_id)
    expected = [row for kind, row in sent if kind == "step"]
    assert len(stored) == len(expected) == 120
    for got, want in zip(stored, expected, strict=True):
        assert got["step"] == want["step"]
        assert datetime.fromisoformat(got["ts"]) == want["ts"].replace(
            microsecond=want["ts"].microsecond // 1000 * 1000
        )
        assert got["diffusion_ms"] == pytest.approx(want["diffusion_ms"], rel=1e-6)  # Float32 column at most
        assert got["step_period_ms"] == pytest.approx(want["step_period_ms"], rel=1e-6)
        assert got["late"] == want["late"] and got["reset_step"] == want["reset_step"]
        assert got["mem_reserved_bytes"] == want["mem_reserved_bytes"]
        assert got["switches"] == want["switches"]
        assert got["worker_id"] == spec.worker_id and got["release"] == spec.release

    r = httpx.get(f"{serve.url}/v1/sessions", params={"worker_id": spec.worker_id}, timeout=10).json()
    (summary,) = [s for s in r["sessions"] if s["session_id"] == spec.session_id]
    streamed_s = sum(row["step_period_ms"] for row in expected) / 1000
    assert summary["steps"] == 120
    assert summary["fps"] == pytest.approx(4 * 120 / streamed_s, rel=1e-4)

    serve.stop()
    assert serve.count_stored(spec.session_id) == {
        "steps": put["step"],
        "gpu_samples": put["gpu_sample"],
        "sessions": put["session"],
        "events": put["event"],
    }


def test_collector_killed_mid_stream_then_back_every_row_once(serve):
    serve.start()
    spec = SessionSpec(steps=1500, seed=3)
    steps = [row for kind, row in session_records(spec) if kind == "step"]
    c = TelemetryClient(
        serve.url,
        batch_rows=50,
        flush_interval_s=0.05,
        give_up_after_s=300,
        max_attempts=100_000,  # the outage lasts as long as a restart takes on a busy machine
        backoff_base_s=0.05,
        backoff_max_s=0.5,
    )
    # a third goes in while the collector is up; it dies with batches in flight
    for row in steps[:500]:
        c.put("step", row)
    end = time.monotonic() + 60
    while c.sent < 100 and time.monotonic() < end:
        time.sleep(0.005)
    assert c.sent >= 100
    serve.kill()
    # the session goes on: every put returns while nothing listens
    producer = threading.Thread(target=lambda: [c.put("step", row) for row in steps[500:]])
    producer.start()
    producer.join(30)
    assert not producer.is_alive(), "put() waited for the collector"
    assert c.buffered > 0  # what could not be shipped waits in the client, not in put()

    serve.start()
    assert c.flush(timeout_s=60.0)
    assert (c.sent, c.dropped, c.failed_batches) == (1500, 0, 0)
    assert c.retries > 0
    c.close()

    assert serve.wait_drained()["spool"]["batches"] == 0
    stored = serve.steps(spec.session_id)
    assert sorted(s["step"] for s in stored) == list(range(1500))  # every acked row, exactly once
    serve.stop()
    assert serve.count_stored(spec.session_id)["steps"] == 1500


def test_spool_full_429_is_retried_until_the_store_is_back(tmp_path):
    down = tmp_path / "store-down"
    serve = Serve(
        tmp_path, free_port(), LIVESTEP_SPOOL_MAX_BYTES=str(1 << 20), LIVESTEP_FAULT_STORE_DOWN_FILE=str(down)
    )
    try:
        serve.start()
        down.touch()  # the writer now treats the store as down: the spool fills to its 1 MiB bound
        spec = SessionSpec(steps=12_000, seed=5)
        steps = [row for kind, row in session_records(spec) if kind == "step"]
        c = TelemetryClient(
            serve.url, batch_rows=500, flush_interval_s=0.05, max_attempts=100_000, backoff_max_s=0.5
        )
        for row in steps:
            c.put("step", row)
        end = time.monotonic() + 60
        while c.retries == 0 and time.monotonic() < end:
            time.sleep(0.05)
        health = httpx.get(serve.url + "/v1/health", timeout=5).json()
        assert c.retries > 0 and c.sent < 12_000  # 429: the spool is over its bound
        assert health["spool"]["bytes"] >= health["spool"]["max_bytes"] * 0.5
        down.unlink()  # the store is back: the spool drains, the retries get in
        assert c.flush(timeout_s=120.0)
        assert (c.sent, c.dropped, c.failed_batches) == (12_000, 0, 0)
        c.close()
        assert serve.wait_drained(60)["spool"]["batches"] == 0
        stored = serve.steps(spec.session_id)
        assert sorted(s["step"] for s in stored) == list(range(12_000))
    finally:
        serve.stop()
