"""A step field end to end: the worker's record -> the store -> the read layer -> the API.

``sm_clock_mhz`` (the mean SM clock of the session's GPUs over a step, from the worker's NVML sampler)
was added as one ``Col`` (collector/record_fields.py), one line of the worker's step record
(worker/telemetry.py), one ``Column`` of the metric catalogue (collector/catalog.py) and migration
sql/120: everything below reads it without an edit of its own."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from analytics import queries
from collector import records
from worker.session import run_session
from worker.telemetry import ListSink

CLOCKS = (1768, 1980)  # MHz: one GPU at the software power cap's clock, one at its top clock (DESIGN.md)


class TwoGpus:
    """What NVML reads on two GPUs every 5 ms (a ``PowerSampler`` source standing in for the driver)."""

    gpus = (0, 1)
    interval_s = 0.005

    def __init__(self):
        self.t0 = time.perf_counter()

    def read(self):
        energy = (time.perf_counter() - self.t0) * 300_000.0
        return [(i, {"power_w": 300.0, "energy_mj": energy, "sm_clock_mhz": c, "mem_used_bytes": 1 << 30,
                     "temp_c": 55.0, "throttle_reasons": 0x4 if c < 1900 else 0}) for i, c in enumerate(CLOCKS)]


def test_the_sm_clock_flows_from_the_worker_to_the_api(store, client):
    start = datetime.now(UTC) - timedelta(minutes=1)
    sink = ListSink()
    s = run_session("tiny", steps=16, sink=sink, realtime=False, power_source=TwoGpus(), worker_id="w-clock",
                    release="v-clock")
    steps = sink.rows["step"]
    mean = sum(CLOCKS) / len(CLOCKS)
    clocks = [r["sm_clock_mhz"] for r in steps]
    assert len(steps) == 16 and all(c is None or c == pytest.approx(mean) for c in clocks)
    assert sum(c is not None for c in clocks) >= 8, clocks  # the sampler runs beside the steps

    store.insert_arrow("steps", records.to_arrow("step", steps), dedup_token=s.session_id)  # as the writer does
    end = datetime.now(UTC) + timedelta(minutes=1)

    frame = queries.session_frame(store, start, end, {"session_id": s.session_id})
    assert frame.height == 1 and frame["sm_clock_mhz"][0] == pytest.approx(mean, rel=1e-6)
    drill = queries.session_steps(store, s.session_id)["sm_clock_mhz"].to_list()  # the session page's read
    assert [d is None for d in drill] == [c is None for c in clocks]
    assert [d for d in drill if d is not None] == pytest.approx([c for c in clocks if c is not None], rel=1e-6)

    listed = client.get("/v1/sessions", params={"worker_id": "w-clock"}).json()["sessions"]
    assert [x["session_id"] for x in listed] == [s.session_id]
    assert listed[0]["sm_clock_mhz"] == pytest.approx(mean, rel=1e-6)
    page = client.get(f"/v1/sessions/{s.session_id}/steps", params={"limit": 100}).json()["steps"]
    got = [r["sm_clock_mhz"] for r in page]
    assert [g is None for g in got] == [c is None for c in clocks]
    assert [g for g in got if g is not None] == pytest.approx([c for c in clocks if c is not None], rel=1e-6)


def test_without_nvml_the_field_is_null_all_the_way(store, client):
    sink = ListSink()
    s = run_session("tiny", steps=4, sink=sink, realtime=False, worker_id="w-noclock", release="v-clock")
    assert [r["sm_clock_mhz"] for r in sink.rows["step"]] == [None] * 4  # CPU: no sampler, no clock
    store.insert_arrow("steps", records.to_arrow("step", sink.rows["step"]), dedup_token=s.session_id)
    listed = client.get("/v1/sessions", params={"worker_id": "w-noclock"}).json()["sessions"]
    assert len(listed) == 1 and listed[0]["sm_clock_mhz"] is None
