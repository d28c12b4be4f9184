"""A tiny live worker session shipping to a real ``livestep serve`` (uvicorn, spool, chDB).

The server runs as a subprocess with its own chDB and spool directories (tmp_path) on an
ephemeral loopback port; after it exits, a separate process counts what was stored.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.serving import Serve, counted, free_port, read_store
from worker.session import run_session

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def server(tmp_path):
    serve = Serve(tmp_path, free_port()).start()
    yield serve.url, serve.proc, tmp_path
    serve.stop()


def _stored(tmp_path: Path, session_id: str) -> dict:
    return read_store(tmp_path, session_id, **counted("steps", "sessions", "events"),
                      fps="s.query_rows(\"SELECT avg_fps FROM sessions WHERE session_id = {s:String} AND phase = 'end'\", "
                          "q)[0][0]",
                      kinds="sorted(r[0] for r in s.query_rows('SELECT kind FROM events WHERE session_id = {s:String}', q))")


def test_live_session_records_arrive_in_chdb(server):
    url, proc, tmp_path = server
    flip = {10: {"ring_cache": True, "rope_at_write": True}}
    s = run_session("tiny", steps=30, collector_url=url, realtime=False, switch_source=flip.get,
                    worker_id="w-e2e", release="v-e2e")
    assert s.telemetry_dropped == 0 and s.telemetry_sent == s.records["step"] + s.records["session"] + s.records["event"]
    deadline = time.monotonic() + 30
    while httpx.get(url + "/v1/health", timeout=5).json()["spool"]["batches"] and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    got = _stored(tmp_path, s.session_id)
    assert got["steps"] == 30 and got["sessions"] == 2
    # the store's fps (frames / summed step periods) is the session's own; a tiny CPU worker
    # generates faster than the 24 fps player that holds it back
    assert got["fps"] == pytest.approx(s.avg_fps) and s.avg_fps > 24.0
    assert "switch_applied" in got["kinds"] and "session_end" in got["kinds"]


def test_control_plane_flip_reaches_a_running_session(server):
    import threading

    from worker.config import Switches
    from worker.switches import HttpSource
    from worker.telemetry import ListSink

    url, _, _ = server
    sink = ListSink()
    source = HttpSource(url, worker_id="w-cp", release="v-cp", gpu_kind="cpu", interval_s=0.1)
    result = {}
    start = Switches.all_on()  # what a production worker runs; no rule names a switch yet
    t = threading.Thread(target=lambda: result.setdefault("s", run_session(
        "tiny", steps=60, sink=sink, switch_source=source, chunk_period_s=0.05, worker_id="w-cp", release="v-cp",
        switches=start)))
    t.start()
    deadline = time.monotonic() + 30
    while source.version is None or len(sink.rows["step"]) < 3:  # polled once, streaming
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = httpx.put(f"{url}/v1/switches/delta_rotation", timeout=10,
                  json={"value": False, "scope": "worker_id=w-cp", "who": "test", "why": "e2e flip"})
    assert r.status_code == 200, r.text
    t.join(60)
    s = result["s"]
    applied = [e["detail"] for e in sink.rows["event"] if e["kind"] == "switch_applied"]
    assert len(applied) == 1 and applied[0]["changed"] == {"delta_rotation": False}
    k = applied[0]["step"]
    assert 0 < k < 60 and s.steps == 60
    states = [r["switches"] for r in sink.rows["step"]]
    assert all(st == start.encode() for st in states[:k])  # nothing else was touched
    assert all("delta_rotation" not in st.split(",") for st in states[k:])
