"""Every record a session puts is stored, or counted as lost with its reason (issue 21, item 3).

A real ``livestep serve`` (uvicorn, spool, chDB) per test. The GPU sampler runs on CPU from a
readings source standing in for NVML (CI has no driver), every 5 ms: it puts records right up to
the session's end, as the sampler did on the H200, where every session's client reported 1-3
"dropped" records although the collector acked every body (samples put while the client closed).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from collector.client import TelemetryClient
from tests.serving import Serve, counted, free_port, read_store
from worker.session import run_session

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class SteadyGpu:
    """What NVML reads on one GPU drawing 300 W (a ``PowerSampler`` source), every 5 ms."""

    gpus = (0,)
    interval_s = 0.005

    def __init__(self):
        self.t0 = time.perf_counter()

    def read(self):
        energy = (time.perf_counter() - self.t0) * 300_000.0  # mJ
        return [(0, {"power_w": 300.0, "energy_mj": energy, "sm_clock_mhz": 1980, "mem_used_bytes": 1 << 30,
                     "temp_c": 55.0, "throttle_reasons": 0})]


@pytest.fixture
def serve(tmp_path):
    s = Serve(tmp_path, free_port())
    yield s
    s.stop()


def stored(workdir: Path, session_id: str) -> dict:
    """Rows per table and the stored telemetry_dropped details, read after the server exited."""
    return read_store(workdir, session_id, **counted("steps", "gpu_samples", "sessions", "events"),
                      dropped="[json.loads(r[0]) for r in s.query_rows(\"SELECT detail FROM events WHERE session_id = "
                              "{s:String} AND kind = 'telemetry_dropped'\", q)]")


def test_a_session_with_the_sampler_on_delivers_every_record(serve):
    serve.start()
    sessions = [run_session("tiny", steps=25, collector_url=serve.url, realtime=False, power_source=SteadyGpu(),
                            worker_id="w-rd", release="v-rd") for _ in range(3)]
    assert serve.wait_drained()["spool"]["batches"] == 0
    serve.stop()
    for s in sessions:
        assert s.records["gpu_sample"] > 0 and s.records["step"] == 25
        assert (s.telemetry_dropped, s.telemetry_failed_batches) == (0, 0), s
        assert s.telemetry_sent == sum(s.records.values())  # no drop event was needed either
        got = stored(serve.workdir, s.session_id)
        assert got["dropped"] == []
        assert {t: got[t] for t in ("steps", "gpu_samples", "sessions", "events")} == {
            "steps": s.records["step"], "gpu_samples": s.records["gpu_sample"],
            "sessions": s.records["session"], "events": s.records["event"]}


def test_a_real_loss_is_counted_and_reported_with_its_reason(serve):
    from tests.collector.helpers import step_rows

    serve.start()
    session_id = uuid.uuid4().hex[:12]
    good = step_rows(10, session_id=session_id)
    # the collector refuses this batch (a negative duration), whole: a real loss
    bad = step_rows(3, session_id=session_id, start=10, diffusion_ms=-1.0)
    c = TelemetryClient(serve.url, batch_rows=1000, flush_interval_s=0.05, report_drops_s=0.01)
    for r in good[:5]:
        c.put("step", r)
    assert c.flush(10.0)
    for r in bad:
        c.put("step", r)
    assert not c.flush(10.0)  # a batch was refused meanwhile
    for r in good[5:]:
        c.put("step", r)
    assert not c.close(10.0)
    c.put("step", good[0])  # after close: lost too, counted (no event can carry it any more)
    st = c.stats()
    assert (st["dropped"], st["failed_batches"]) == (4, 1)
    assert st["dropped_by"] == {"refused": 3, "after_close": 1}
    assert serve.wait_drained()["spool"]["batches"] == 0
    serve.stop()
    got = stored(serve.workdir, session_id)
    assert got["steps"] == 10
    (detail,) = got["dropped"]
    assert detail["where"] == "client" and detail["dropped"] == 3 and detail["reasons"] == {"refused": 3}
    assert "HTTP 4" in detail["last_error"]
