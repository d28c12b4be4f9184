"""Live sessions on the tiny model: records, switches at step boundaries, playout, a down collector."""

from __future__ import annotations

import json

import pytest
import torch

from collector import records
from worker.playout import Playout
from worker.session import Worker, run_session
from worker.telemetry import ListSink


def test_records_follow_the_wire_contract():
    sink = ListSink()
    s = run_session("tiny", steps=20, realtime=False, sink=sink, worker_id="w7", release="v3")
    steps = sink.rows["step"]
    assert [r["step"] for r in steps] == list(range(20)) and s.steps == 20
    for kind, rows in sink.rows.items():
        for row in rows:
            records.MODELS[kind].model_validate(row)  # every field named and typed as the collector wants
    assert {r["phase"] for r in sink.rows["session"]} == {"start", "end"}
    end = next(r for r in sink.rows["session"] if r["phase"] == "end")
    assert end["frames"] == 80 and end["first_forward_tokens"] == s.first_forward_tokens
    shape_cols = [c for cols in records.SHAPE_KEYS.values() for c in cols]  # every shape key the contract names
    assert all(end[c] is not None for c in shape_cols) and end["cond_tokens"] == s.first_forward_tokens
    assert sum(r["reset_step"] for r in steps) == len([i for i in range(1, 20) if i % 7 == 0])
    assert all(r["cache_upkeep_ms"] is not None and r["energy_mj"] is None for r in steps)  # no NVML here


def test_switch_flipped_mid_session_applies_at_the_next_step_and_is_recorded(tmp_path):
    sink = ListSink()
    ring = {"ring_cache": True, "rope_at_write": True, "delta_rotation": True}
    flips = {12: ring, 25: {"rope_at_write": False}, 30: {"fp8_cache": True}}  # 25: invalid -> refused
    s = run_session("tiny", steps=40, realtime=False, sink=sink, switch_source=flips.get)
    by_step = {r["step"]: r["switches"] for r in sink.rows["step"]}
    assert by_step[11] == "" and by_step[12] == "delta_rotation,ring_cache,rope_at_write"
    assert by_step[39] == "delta_rotation,fp8_cache,ring_cache,rope_at_write"
    applied = [e for e in sink.rows["event"] if e["kind"] == "switch_applied"]
    assert [e["detail"]["step"] for e in applied] == [12, 30]
    assert applied[0]["detail"]["changed"] == ring
    errors = [e for e in sink.rows["event"] if e["kind"] == "error"]  # step 25's invalid change, refused
    assert [e["detail"]["step"] for e in errors] == [25]
    assert "Valid cache combinations" in errors[0]["detail"]["error"]
    assert s.steps == 40 and len(s.switch_events) == 2


def test_unknown_switch_from_a_newer_control_plane_is_ignored_and_the_rest_applies():
    sink = ListSink()
    update = {"ring_cache": True, "rope_at_write": True, "warp_drive": True}
    run_session("tiny", steps=6, realtime=False, sink=sink, switch_source={3: update}.get)
    by_step = {r["step"]: r["switches"] for r in sink.rows["step"]}
    assert by_step[2] == "" and by_step[3] == "ring_cache,rope_at_write"
    errors = [e["detail"] for e in sink.rows["event"] if e["kind"] == "error"]
    assert len(errors) == 1 and errors[0]["step"] == 3
    assert "['warp_drive'] ignored" in errors[0]["error"] and "static_scales" in errors[0]["error"]


def test_switch_file_source(tmp_path):
    path = tmp_path / "switches.json"
    path.write_text(json.dumps({"switches": {"rope_at_write": True}}))
    sink = ListSink()
    run_session("tiny", steps=5, realtime=False, sink=sink, switch_source=str(path))
    assert [r["switches"] for r in sink.rows["step"]] == ["rope_at_write"] * 5


def test_collector_down_session_completes_and_counts_drops():
    pytest.importorskip("collector.client")
    s = run_session("tiny", steps=12, realtime=False, collector_url="http://127.0.0.1:9",
                    client_kwargs={"give_up_after_s": 0.2, "max_attempts": 2, "flush_interval_s": 0.05})
    assert s.steps == 12 and s.frames == 48
    assert s.telemetry_sent == 0 and s.telemetry_dropped >= 12 + 2


def test_buffer_per_shape_grows_the_registry_per_first_forward_length():
    w = Worker("tiny")
    for n in (5, 8, 13):
        s = w.run_session(steps=3, realtime=False, cond_tokens=n, switches=["fused_allreduce=on"])
    assert s.buffers_registered == 1  # the steady-state shape only
    w2 = Worker("tiny")
    sink = ListSink()
    for n in (5, 8, 13):
        s = w2.run_session(steps=3, realtime=False, cond_tokens=n, switches=["buffer_per_shape=on"], sink=sink)
    assert s.buffers_registered == 4  # 3 first-forward lengths + the steady shape
    mem = [r["mem_allocated_bytes"] for r in sink.rows["step"]]
    assert mem[-1] > mem[0]


def test_realtime_playout_counts_late_chunks():
    sink = ListSink()
    s = run_session("tiny", steps=10, sink=sink, chunk_period_s=1e-5)  # a period no step can meet
    assert s.late_chunks >= 5 and s.stall_ms > 0 and s.avg_fps < 4 / 1e-5
    assert sum(r["late"] for r in sink.rows["step"]) == s.late_chunks
    ok_sink = ListSink()
    # a period ~30x a tiny step (3-12 ms; a loaded 2-core box has shown 140 ms): the player holds the worker
    ok = run_session("tiny", steps=6, chunk_period_s=0.4, sink=ok_sink)
    assert ok.late_chunks == 0
    # the player held the worker back, yet fps is the worker's own (faster than the player's 10),
    # taken from its generation time per chunk, not from the player's 0.4 s gaps between deliveries
    periods = [r["step_period_ms"] for r in ok_sink.rows["step"]]
    assert all(0 < p < 400.0 for p in periods), periods
    assert ok.avg_fps == pytest.approx(len(periods) * 4 / (sum(periods) / 1000)) and ok.avg_fps > 4 / 0.4


def test_playout_clock_literal_times():
    p = Playout(period_s=1.0, capacity=3, prebuffer=2)
    assert p.deliver(0, 0.1) == (False, 1)
    assert p.deliver(1, 0.5) == (False, 1)  # playback starts at 0.5: chunk 0 playing, 1 buffered
    assert p.deliver(2, 1.0) == (False, 2)
    assert p.deliver(3, 4.0) == (True, 0)  # due at 0.5 + 3 = 3.5: a 0.5 s stall, played on arrival
    assert p.deliver(4, 4.2) == (False, 1)  # due at 0.5 + 4 + 0.5 (the stall shifted the clock)
    assert (p.late_chunks, p.stall_s, p.streamed_s) == (1, 0.5, 5.5)
    assert p.room(6, 4.2) and not p.room(7, 4.2)  # 4 chunks started, at most 3 ahead


def test_upkeep_spans_sampled_every_nth_step():
    sink = ListSink()
    run_session("tiny", steps=10, realtime=False, sink=sink, detail_every=4)
    timed = [r["step"] for r in sink.rows["step"] if r["cache_upkeep_ms"] is not None]
    assert timed == [0, 4, 8]
    assert all(r["attention_ms"] is None for r in sink.rows["step"] if r["step"] not in timed)


def test_step_energy_from_cumulative_counter_interpolated_and_just_past_the_last_sample():
    from worker.nvml import PowerSampler

    p = PowerSampler([], emit=lambda kind, row: None, interval_s=0.1)  # no NVML here: fill the history
    p.available = True
    p._hist.extend([(10.0, 0.0), (10.1, 70_000.0), (10.2, 140_000.0)])  # 700 W as mJ per s
    assert p.energy_between(10.05, 10.15) == pytest.approx(70_000.0)
    # a step that ended after the last sample (emitted before the next one): extrapolated at 700 W
    assert p.energy_between(10.15, 10.25) == pytest.approx(70_000.0)
    assert p.energy_between(10.15, 10.45) is None  # too far past the last sample to guess
    assert p.energy_between(9.9, 10.05) is None  # before the first sample


def test_full_state_source_gives_a_cleared_switch_back_its_start_value():
    from worker.config import Switches
    from worker.switches import SwitchSource

    class RulesSource(SwitchSource):  # what the control plane answers, step by step
        full_state = True

        def poll(self, step):
            return {2: {"compile": False}, 5: {}}.get(step)

    start = Switches(ring_cache=True, rope_at_write=True, compile=True)
    sink = ListSink()
    s = run_session("tiny", steps=8, realtime=False, switches=start, switch_source=RulesSource(), sink=sink)
    assert [e["changed"] for e in s.switch_events] == [{"compile": False}, {"compile": True}]
    states = [r["switches"] for r in sink.rows["step"]]
    assert "compile" not in states[3].split(",") and states[7] == start.encode()


class _SinkWithDrops(ListSink):
    """A sink that has dropped rows of its own (it reports them itself) and refuses the first
    ``refuse`` step records (the worker's own telemetry path loses those)."""

    def __init__(self, refuse: int = 0):
        super().__init__()
        self.dropped, self.refuse = 7, refuse

    def put(self, kind, row):
        if kind == "step" and self.refuse > 0:
            self.refuse -= 1
            raise ValueError("record refused")
        super().put(kind, row)


def _drop_events(sink):
    return [e["detail"] for e in sink.rows["event"] if e["kind"] == "telemetry_dropped"]


def test_session_reports_only_the_drops_of_the_worker_path():
    sink = _SinkWithDrops()
    s = run_session("tiny", steps=4, realtime=False, sink=sink)
    assert _drop_events(sink) == []  # the sink's own drops are the sink's to report
    assert s.telemetry_dropped == 7  # the summary counts every loss

    sink = _SinkWithDrops(refuse=2)
    s = run_session("tiny", steps=4, realtime=False, sink=sink)
    assert _drop_events(sink) == [{"where": "worker", "dropped": 2, "reasons": {"put_failed": 2}}]
    assert s.telemetry_dropped == 7 + 2


def test_attention_fp8_dots_flips_at_a_step_boundary_like_the_others():
    """The FP8 attention's precision switch on at step 9 and off at 15 (FP8 ring cache with the kernels'
    switch): applied at those steps and recorded, the cache rebuilt for it with its window kept. On the CPU
    the worker runs no Triton attention (CacheOps: CUDA only), so the switch moves nothing but the rebuild:
    the window's bytes equal those of a session flipping ``compile`` (inert on the CPU too) at the same
    steps -- the plain path is untouched, the flip is handled as the others are."""
    from worker.session import Session

    base = ["ring_cache=on", "rope_at_write=on", "fp8_cache=on", "triton_kernels=on"]
    runs = {}
    for name in ("attention_fp8_dots", "compile"):
        sink = ListSink()
        flips = {9: {name: True}, 15: {name: False}}
        s = Session(Worker("tiny"), steps=20, realtime=False, sink=sink, switches=base, switch_source=flips.get,
                    seed=4, cond_tokens=5)
        s.run()
        runs[name] = (s, sink)
    s, sink = runs["attention_fp8_dots"]
    by_step = {r["step"]: r["switches"].split(",") for r in sink.rows["step"]}
    assert ["attention_fp8_dots" in by_step[i] for i in (8, 9, 14, 15)] == [False, True, True, False]
    applied = [e["detail"] for e in sink.rows["event"] if e["kind"] == "switch_applied"]
    assert [(e["step"], e["changed"]) for e in applied] == [(9, {"attention_fp8_dots": True}),
                                                            (15, {"attention_fp8_dots": False})]
    assert not [e for e in sink.rows["event"] if e["kind"] == "error"]
    assert not s.cache.switches.attention_fp8_dots and s.cache.book.n_valid == s.w.shape.window
    other = runs["compile"][0]
    for a, b in zip(s.cache.export_tokens()[:2], other.cache.export_tokens()[:2], strict=True):
        assert torch.equal(a, b)
