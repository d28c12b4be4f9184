"""The static_scales switch and its saturation probe: what the fleet sees when FP8 inputs outgrow
their calibrated scales (tiny FP8 model on CPU; the no-sync GPU check is in test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from collector import records
from worker.cache import make_cache
from worker.config import ModelShape, Switches
from worker.fp8 import FP8, FP8_MAX, SaturationProbe, count_saturated
from worker.model import BlockFusion, DiT
from worker.session import Session, Worker
from worker.telemetry import ListSink

RING_FP8 = {"ring_cache": True, "rope_at_write": True, "fp8_cache": True}


def _fp8_worker() -> Worker:
    shape = ModelShape.from_name("tiny")
    return Worker(shape, device="cpu", model=DiT(shape, dtype=torch.bfloat16, fp8=True))


def test_count_saturated_counts_the_codes_at_448_of_either_sign():
    x = torch.randn(37, 19) * 300
    x[3, :5] = torch.tensor([448.0, -448.0, 1e6, -1e6, 447.0])  # 447 rounds to 448 as well
    q = x.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    assert int(count_saturated(q)) == int((q.float().abs() == FP8_MAX).sum())
    assert int(count_saturated(torch.zeros(4, 4).to(FP8))) == 0


def _calibrated_model(fusion: BlockFusion | None):
    model = DiT(ModelShape.from_name("tiny"), dtype=torch.bfloat16, fp8=True)
    model.set_fusion(fusion)
    shape = model.shape
    cache = make_cache(shape, Switches.from_mapping(RING_FP8), "cpu", model.dtype)
    g = torch.Generator().manual_seed(5)
    cond_kv = model.first_forward(torch.randn(9, shape.d_model, generator=g), cache)

    def chunk():
        cache.begin_step(shape.new_tokens)
        model.denoise_chunk(torch.randn(shape.new_tokens, shape.latent_channels, generator=g), cache, cond_kv)
        cache.end_step()

    chunk()  # the first chunk finishes the calibration
    assert model.probe_ready
    return model, chunk


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_probe_counts_every_static_gemm_input_clipped_at_448(fused):
    """After calibration the inputs sit inside the range (margin 2): nothing saturates. Scales shrunk 8x
    (inputs 8x past calibration) clip many elements, and the probe counts exactly the elements whose
    |x / scale| rounds to 448 or beyond (>= 432), counted independently from the inputs."""
    model, chunk = _calibrated_model(BlockFusion.eager("static") if fused else None)
    probe = SaturationProbe("cpu")
    probe.start()
    model.set_probe(probe)
    chunk()
    host, total = probe.finish()
    per_pass = sum(lin.site is not None and lin is not b.ckv for b in model.blocks for lin in b.linears)
    assert int(host) == 0 and total > 0

    for lin in model._linears():  # drift: every static scale now covers an 8th of its inputs
        lin.site.scale /= 8
    seen = {"ref": 0, "calls": 0}
    if not fused:  # the unfused path quantizes through the sites: count the reference from their inputs
        for lin in model._linears():
            quant = lin.site.quant

            def counting(x, s, quant=quant):
                seen["ref"] += int(((x / s).abs() >= 432).sum())  # x / s rounded as the quantizer does
                seen["calls"] += 1
                return quant(x, s)

            lin.site.quant = counting
    probe.start()
    chunk()
    host, total2 = probe.finish()
    model.set_probe(None)
    assert total2 == total and int(host) > 0
    assert int(host) / total < 1  # clipped, not everything
    if not fused:
        assert seen["calls"] == per_pass * model.shape.passes  # the cross K/V is once per session
        assert int(host) == seen["ref"]


def test_session_reports_fp8_saturated_on_sampled_steps_only():
    sink = ListSink()
    s = _fp8_worker().run_session(
        steps=9, realtime=False, sink=sink, saturation_every=3, switches={**RING_FP8, "static_scales": True}
    )
    steps = sink.rows["step"]
    for row in steps:
        records.StepRecord.model_validate(row)
    sampled = [r["step"] for r in steps if r["fp8_saturated"] is not None]
    assert sampled == [3, 6]  # step 0 still calibrates (first forward + first chunk)
    assert all(r["fp8_saturated"] == 0.0 for r in steps if r["step"] in sampled)  # inside the range
    assert s.steps == 9 and s.probed_steps == 2 and s.max_fp8_saturated == 0.0


def test_static_scales_off_is_the_plain_dynamic_path_and_reports_nothing():
    w = _fp8_worker()
    sink = ListSink()
    s = w.run_session(steps=4, realtime=False, sink=sink, saturation_every=1, switches=RING_FP8)
    assert w.model.act_scales == "row" and not w.model.calibrating
    assert all(lin.site is None and lin.probe is None for lin in w.model._linears())
    assert all(r["fp8_saturated"] is None for r in sink.rows["step"])
    assert s.probed_steps == 0 and s.max_fp8_saturated is None


def test_static_scales_flipped_mid_session_recalibrates_or_goes_dynamic():
    """Off at step 4 (the rollback): per-token scales from the next step, probes stop. On again at 8:
    fresh scales calibrate over the next chunk and a pass, then probes resume."""
    w = _fp8_worker()
    sink = ListSink()
    flips = {4: {"static_scales": False}, 8: {"static_scales": True}}
    s = w.run_session(
        steps=16,
        realtime=False,
        sink=sink,
        saturation_every=2,
        switch_source=flips.get,
        switches={**RING_FP8, "static_scales": True},
    )
    by_step = {r["step"]: r for r in sink.rows["step"]}
    assert [e["step"] for e in s.switch_events] == [4, 8]
    assert "static_scales" not in by_step[5]["switches"] and "static_scales" in by_step[9]["switches"]
    sampled = [i for i, r in sorted(by_step.items()) if r["fp8_saturated"] is not None]
    assert sampled == [2, 10, 12, 14]  # 8 calibrates; nothing sampled while dynamic (4, 6)
    assert w.model.act_scales == "static" and not w.model.calibrating
    assert all(lin.probe is None for lin in w.model._linears())  # the session unhooks its probe


def test_switch_name_is_on_the_wire():
    assert "static_scales" in records.SWITCH_NAMES
    assert Switches.all_on().static_scales and not Switches().static_scales


@pytest.mark.parametrize("every", [0, -3])
def test_saturation_every_must_be_positive(every):
    with pytest.raises(ValueError, match="valid: a positive number of steps"):
        Session(_fp8_worker(), steps=1, saturation_every=every)


@pytest.mark.parametrize("upfront", [True, False])
@pytest.mark.parametrize("first_probe", [3, 4])
def test_runner_captures_each_graph_once_and_sets_the_probed_total(cpu_graphs, upfront, first_probe):
    """The runner given the session's probe, or meeting it at the first graphed step, captures the plain
    and the probed graph there after one warm-up (under tensor parallel every rank then runs the same
    forwards); a runner meeting a probe only later captures it then. Two captures either way, every step
    after the window fills is graphed, and a probed replay reports the element total of one forward
    (the eager probed step's)."""
    from worker.graphs import ChunkRunner

    model = _fp8_worker().model
    shape = model.shape
    model.act_scales = "static"
    model.set_compile(False)
    cache = make_cache(shape, Switches.from_mapping(RING_FP8), "cpu", model.dtype)
    probe = SaturationProbe("cpu")
    runner = ChunkRunner(model, use_graphs=True, probe=probe if upfront else None)
    runner.use_graphs = True  # CPU: the bookkeeping only (the GPU tests replay real graphs)
    g = torch.Generator().manual_seed(0)
    ckv = model.first_forward(torch.randn(20, shape.d_model, generator=g), cache)
    graphed, totals, captures = [], {}, []
    for i in range(12):
        cache.begin_step(shape.new_tokens)
        p = probe if i >= first_probe and (i - first_probe) % 4 == 0 or i == 1 else None
        if p is not None:
            p.start()
        _, was_graphed = runner(torch.randn(shape.new_tokens, shape.latent_channels, generator=g), cache, ckv, probe=p)
        if p is not None:
            totals[i] = p.total
        graphed.append(was_graphed)
        captures.append(cpu_graphs.made)
        cache.end_step()
    full = next(i for i, gr in enumerate(graphed) if gr)
    assert full == 3 and all(graphed[full:]) and not any(graphed[:full])
    assert cpu_graphs.made == 2
    eager_total = totals[1]  # step 1: eager (window not full), the probe counted directly
    assert eager_total > 0 and all(t == eager_total for t in totals.values()), totals
    together = upfront or first_probe == 3
    assert captures[3:5] == ([2, 2] if together else [1, 2]), captures
    assert cpu_graphs.warmups.made == (1 if together else 2)
