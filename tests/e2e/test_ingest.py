"""End to end on a real uvicorn (ephemeral loopback port) in this process: shipping client and raw
HTTP -> collector -> spool -> chDB -> the server's own reads, with exact counts and values."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from collector.client import TelemetryClient
from tests.collector.helpers import (
    ARROW,
    INGEST_TOKEN,
    arrow_body,
    drained,
    event_row,
    json_rows,
    step_rows,
    wait_for,
)

pytestmark = pytest.mark.e2e


def test_shipping_client_round_trip_exact(app_server):
    app, url = app_server
    client = TelemetryClient(url, token=INGEST_TOKEN, batch_rows=64, flush_interval_s=0.05)
    sessions = {"e1": 150, "e2": 90, "e3": 7}
    for sid, n in sessions.items():
        for r in step_rows(n, session_id=sid, worker_id=f"w-{sid}"):
            client.put("step", r)
        client.put("event", event_row("session_end", session_id=sid, detail={"steps": n}))
    assert client.flush(timeout_s=30)
    client.close(timeout_s=30)
    assert client.dropped == 0 and client.failed_batches == 0
    wait_for(lambda: drained(app), what="spool drained")

    with httpx.Client(base_url=url) as h:
        page = h.get("/v1/sessions").json()
        got = {s["session_id"]: (s["steps"], s["frames"], s["late_chunks"], s["worker_id"]) for s in page["sessions"]}
        assert got == {sid: (n, 4 * n, len(range(0, n, 5)), f"w-{sid}") for sid, n in sessions.items()}
        steps = h.get("/v1/sessions/e2/steps", params={"limit": 1000}).json()
        assert steps["total"] == 90
        want = step_rows(90, session_id="e2", worker_id="w-e2")
        assert [s["step"] for s in steps["steps"]] == list(range(90))
        assert [(s["diffusion_ms"], s["mem_allocated_bytes"], s["reset_step"], s["late"]) for s in steps["steps"]] \
            == [(w["diffusion_ms"], w["mem_allocated_bytes"], w["reset_step"], w["late"]) for w in want]
        health = h.get("/v1/health").json()
        assert health["status"] == "ok" and health["spool"]["batches"] == 0
    store = app.state.store
    assert store.query_rows("SELECT session_id, JSONExtractInt(detail, 'steps') FROM events ORDER BY 1") == \
        sorted((sid, n) for sid, n in sessions.items())


def test_concurrent_clients_with_retries_store_every_row_once(app_server):
    app, url = app_server

    def sender(k: int) -> int:
        rows = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {INGEST_TOKEN}"}) as h:
            for b in range(12):
                sid = f"c{k}"
                batch = step_rows(100, session_id=sid, start=100 * b)
                if b % 3 == 0:  # JSON path
                    req = {"json": {"steps": json_rows(batch)}, "headers": {"idempotency-key": f"{sid}-{b}"}}
                else:
                    req = {"content": arrow_body("step", batch),
                           "headers": {"content-type": ARROW, "idempotency-key": f"{sid}-{b}"}}
                first = h.post("/v1/telemetry", **req)
                again = h.post("/v1/telemetry", **req)  # the client's retry after a lost ack
                assert first.status_code == again.status_code == 200, (first.text, again.text)
                assert (first.json()["duplicate"], again.json()["duplicate"]) == (False, True)
                rows += 100
        return rows

    with ThreadPoolExecutor(8) as ex:
        sent = sum(ex.map(sender, range(8)))
    wait_for(lambda: drained(app), what="spool drained")
    store = app.state.store
    assert store.query_rows("SELECT count(), uniqExact(session_id, step) FROM steps") == [(sent, sent)]
    assert store.query_rows("SELECT countMerge(steps) FROM session_stats") == [(sent,)]
    with httpx.Client(base_url=url) as h:
        page = h.get("/v1/sessions", params={"limit": 100}).json()
    assert page["total"] == 8 and {s["steps"] for s in page["sessions"]} == {1200}
