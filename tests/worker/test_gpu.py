"""On a CUDA GPU (marker gpu; CI has none): the step loop never syncs, and the caches agree in bf16/FP8.

Run on the H200: ``python -m pytest -q -m gpu tests/worker/test_gpu.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker.cache import make_cache
from worker.config import ModelShape, Switches
from worker.model import DiT
from worker.session import Worker
from worker.telemetry import ListSink

pytestmark = pytest.mark.gpu

ALL_BUT_GRAPHS = Switches.all_on(cuda_graphs=False, compile=False)


@pytest.fixture(scope="module")
def small_worker():
    shape = ModelShape.from_name("small", n_blocks=2, window=2400, cond_tokens=(256, 600))
    return Worker(shape, device="cuda")


@pytest.mark.parametrize("switches", [Switches(), ALL_BUT_GRAPHS], ids=["plain", "all-on"])
def test_step_loop_has_no_host_sync(small_worker, switches):
    sink = ListSink()
    s = small_worker.run_session(
        steps=12, realtime=False, switches=switches, sink=sink, sync_debug=True, cond_tokens=300
    )
    assert s.steps == 12 and len(sink.rows["step"]) == 12
    assert all(r["diffusion_ms"] > 0 for r in sink.rows["step"])
    assert [r["step"] for r in sink.rows["step"] if r["cache_upkeep_ms"] is not None] == [0, 8]  # sampled
    assert s.buffers_registered == (1 if switches.fused_allreduce else 0)


def test_cuda_graph_session_runs_and_replays(small_worker):
    sink = ListSink()
    s = small_worker.run_session(
        steps=10, realtime=False, switches=Switches.all_on(), sink=sink, cond_tokens=300
    )
    assert s.steps == 10 and 0 < s.graphed_steps < 10, "once the window is full the step replays a graph"
    # events cannot sit inside a graph: a replayed step reports no upkeep/attention split
    graphed = [r for r in sink.rows["step"] if r["cache_upkeep_ms"] is not None][-1:]
    assert not graphed or graphed[0]["step"] < 10 - s.graphed_steps


def _latents(model: DiT, sw: Switches, compile: bool = False, triton_chains: bool = False) -> tuple[torch.Tensor, int]:
    """9 chunks from the same noise (resets every 3): stacked latents and the ring's wraps. ``compile``:
    the model's compiled, fused path (the cache's ops follow ``sw``); ``triton_chains``: its chains as the
    Triton kernels (``BlockFusion.triton``), compile or not."""
    shape = model.shape
    model.act_scales = "static"  # what the last session's static_scales switch left is not this test's
    model.set_compile(compile, triton=triton_chains)
    model.reset_act_scales()  # static activation scales: every run calibrates on its own inputs
    cache = make_cache(shape, sw, "cuda", model.dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    ckv = model.first_forward(torch.randn(300, shape.d_model, generator=g, device="cuda"), cache)
    lat = []
    for i in range(9):  # 300 + 9 x 757 tokens: the 2400-slot window wraps twice
        cache.begin_step(shape.new_tokens, reset=i > 0 and i % 3 == 0)
        lat.append(
            model.denoise_chunk(
                torch.randn(shape.new_tokens, shape.latent_channels, generator=g, device="cuda"), cache, ckv
            ).float()
        )
        cache.end_step()
    return torch.stack(lat), cache.book.wraps


RING_FP8 = Switches(ring_cache=True, rope_at_write=True, fp8_cache=True, delta_rotation=True)


def test_ring_fp8_agrees_with_plain_in_bf16(small_worker):
    plain, _ = _latents(small_worker.model, Switches())
    ring, wraps = _latents(small_worker.model, RING_FP8)
    assert wraps >= 2
    rel = (ring - plain).norm() / plain.norm()
    assert rel < 0.05, rel


def test_triton_kernels_agree_with_the_torch_ops(small_worker):
    """The ring + FP8 cache with the Triton ops (fused K/V write, the queries rotated inside the FP8
    attention kernel, delta rotation) and with the torch ops: the same latents up to FP8 attention."""
    torch_ops, _ = _latents(small_worker.model, RING_FP8)
    kernels, wraps = _latents(small_worker.model, dataclasses.replace(RING_FP8, triton_kernels=True))
    assert wraps >= 2 and torch.isfinite(kernels).all()
    rel = (kernels - torch_ops).norm() / torch_ops.norm()
    assert rel < 0.05, rel


def test_fused_compiled_path_agrees_with_the_unfused_one(small_worker):
    """compile on: the fused chains, the queries' RoPE and the FP8 outputs (self- and cross-attention)
    stored by the attention kernel with static scales; the unfused path's latents up to FP8 rounding."""
    model = small_worker.model
    sw = dataclasses.replace(RING_FP8, triton_kernels=True)
    try:
        fused, _ = _latents(model, sw, compile=True)
        assert model.blocks[0].fusion is not None and not model.calibrating
    finally:
        model.set_compile(False)
    unfused, _ = _latents(model, sw)
    assert torch.isfinite(fused).all()
    rel = (fused - unfused).norm() / unfused.norm()
    assert rel < 0.05, rel


def test_triton_chains_agree_with_the_compiled_chains(small_worker):
    """The fused path's chains as Triton kernels (residual + LayerNorm + FP8, GELU + FP8) and compiled by
    inductor: the same latents up to FP8 rounding; with the triton switch alone (compile off) too."""
    model = small_worker.model
    sw = dataclasses.replace(RING_FP8, triton_kernels=True)
    try:
        compiled, _ = _latents(model, sw, compile=True)
        assert model.blocks[0].fusion is model._fusions["static"]
        kernels, _ = _latents(model, sw, compile=True, triton_chains=True)
        assert model.blocks[0].fusion is model._fusions["triton"] and not model.calibrating
        no_compile, _ = _latents(model, sw, triton_chains=True)
        assert model.blocks[0].fusion is model._fusions["triton"]
    finally:
        model.set_compile(False)
    assert model.blocks[0].fusion is None
    assert torch.isfinite(kernels).all() and torch.isfinite(no_compile).all()
    for other in (kernels, no_compile):
        rel = (other - compiled).norm() / compiled.norm()
        assert rel < 0.05, rel


def test_saturation_probe_steps_are_sync_free(small_worker):
    """static_scales on: every 4th step runs a saturation probe (device counts, a pinned copy read when
    the step is done); the loop still never syncs."""
    sink = ListSink()
    s = small_worker.run_session(
        steps=12,
        realtime=False,
        switches=ALL_BUT_GRAPHS,
        sink=sink,
        sync_debug=True,
        saturation_every=4,
        cond_tokens=300,
    )
    by_step = {r["step"]: r["fp8_saturated"] for r in sink.rows["step"]}
    assert s.steps == 12 and [i for i, v in sorted(by_step.items()) if v is not None] == [4, 8]
    assert all(0 <= by_step[i] < 1e-3 for i in (4, 8)), by_step  # calibrated with margin 2: ~nothing clips


def test_saturation_probe_steps_replay_a_graph_of_their_own(small_worker):
    """Every switch on: the probed steps replay the probed graph, so a session graphs as many steps as
    one that never probes, and still reports fp8_saturated on exactly the probed steps."""
    runs = {}
    for every in (4, 1000):
        sink = ListSink()
        s = small_worker.run_session(
            steps=14, realtime=False, switches=Switches.all_on(), sink=sink, saturation_every=every, cond_tokens=300
        )
        runs[every] = (s, [r["step"] for r in sink.rows["step"] if r["fp8_saturated"] is not None])
    (s4, probed4), (s_none, probed_none) = runs[4], runs[1000]
    assert probed4 == [4, 8, 12] and probed_none == []
    assert s4.graphed_steps > len(probed4) and s4.graphed_steps == s_none.graphed_steps


def test_a_probed_graph_counts_as_the_eager_probe_and_leaves_the_chunks_unchanged(small_worker):
    """The runner with every switch on, chunks from the same noise: probes at steps 4, 6 and 8 replay the
    probed graph between replays of the plain one. The latents of the whole run equal the run without
    probes, and each step's count and total equal those of the same steps run eagerly (no graphs), and
    those of a runner given the probe up front (both graphs captured at the first graphed step)."""
    from worker.fp8 import SaturationProbe
    from worker.session import ChunkRunner

    model, shape, sw = small_worker.model, small_worker.model.shape, Switches.all_on()
    model.act_scales = "static"
    model.set_compile(True)
    T, C = shape.new_tokens, shape.latent_channels

    def run(probe_at, graphs=True, shrink=1.0, upfront=False):
        model.reset_act_scales()
        cache = make_cache(shape, sw, "cuda", model.dtype)
        probe = SaturationProbe("cuda", compiled=True)
        runner = ChunkRunner(model, use_graphs=graphs, probe=probe if upfront else None)
        g = torch.Generator(device="cuda").manual_seed(3)
        ckv = model.first_forward(torch.randn(300, shape.d_model, generator=g, device="cuda"), cache)
        outs, graphed, counts = [], [], []
        for i in range(9):
            if i == 2 and shrink != 1.0:  # calibrated: scales shrunk so that some inputs clip
                for lin in model._linears():
                    lin.site.scale.mul_(shrink)
            cache.begin_step(T)
            noise = torch.randn(T, C, generator=g, device="cuda")
            p = None
            if i in probe_at:
                p = probe
                p.start()
            out, was_graphed = runner(noise, cache, ckv, probe=p)
            if p is not None:
                host, n = p.finish()
                torch.cuda.synchronize()
                counts.append((int(host), n))
            cache.end_step()
            outs.append(out.float())
            graphed.append(was_graphed)
        torch.cuda.synchronize()
        return torch.stack(outs), graphed, counts

    try:
        plain, g_plain, _ = run(set())
        probed, g_probed, counts = run({4, 6, 8})
        _, g_eager, eager_counts = run({4, 6, 8}, graphs=False, shrink=0.1)
        _, _, graph_counts = run({4, 6, 8}, shrink=0.1)
        _, g_upfront, upfront_counts = run({4, 6, 8}, shrink=0.1, upfront=True)  # both graphs at once
    finally:
        model.set_compile(False)
    assert any(g_plain) and g_probed == g_plain and g_probed[4] and not any(g_eager)
    assert len(counts) == 3 and all(n > 0 and c == 0 for c, n in counts)  # margin 2: nothing clips
    assert g_upfront == g_plain and [n for _, n in upfront_counts] == [n for _, n in graph_counts]
    assert [n for _, n in graph_counts] == [n for _, n in eager_counts]
    assert all(c > 0 for c, _ in eager_counts), eager_counts
    for counts in (graph_counts, upfront_counts):
        assert all(abs(cg - ce) <= 0.02 * ce for (cg, _), (ce, _) in zip(counts, eager_counts)), (counts, eager_counts)
    rel = (probed - plain).norm() / plain.norm()
    assert rel < 1e-3, rel
