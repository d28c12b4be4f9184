"""The DiT: a TP rank's weights are the slice of the full model's; row-parallel sums match."""

from __future__ import annotations

import pytest
import torch

from worker.config import ModelShape, tp_rank_of
from worker.model import DiT


def test_rank_shards_are_slices_of_the_full_weights():
    shape = ModelShape.from_name("tiny")
    full = DiT(shape)
    hd, H = shape.head_dim, shape.n_heads
    for rank in range(2):
        part = DiT(tp_rank_of(shape, 2, rank))
        hs = slice(rank * H // 2 * hd, (rank + 1) * H // 2 * hd)
        fs = slice(rank * shape.ffn // 2, (rank + 1) * shape.ffn // 2)
        for b_full, b_part in zip(full.blocks, part.blocks, strict=True):
            q_full = b_full.qkv.w.view(3, H * hd, -1)[:, hs].reshape(-1, shape.d_model)
            torch.testing.assert_close(b_part.qkv.w, q_full, rtol=0, atol=0)
            torch.testing.assert_close(b_part.o.w, b_full.o.w[:, hs], rtol=0, atol=0)
            torch.testing.assert_close(b_part.up.w, b_full.up.w[fs], rtol=0, atol=0)
            torch.testing.assert_close(b_part.down.w, b_full.down.w[:, fs], rtol=0, atol=0)
            torch.testing.assert_close(b_part.table, b_full.table, rtol=0, atol=0)


def test_row_parallel_partials_sum_to_the_full_product():
    shape = ModelShape.from_name("tiny")
    full = DiT(shape).blocks[0]
    parts = [DiT(tp_rank_of(shape, 2, r)).blocks[0] for r in range(2)]
    x = torch.randn(5, shape.ffn)
    fs = shape.ffn // 2
    partial = [p.row_parallel(x[:, r * fs:(r + 1) * fs], p.down) for r, p in enumerate(parts)]
    torch.testing.assert_close(partial[0] + partial[1], full.row_parallel(x, full.down), rtol=1e-5, atol=1e-5)


def test_allreduce_hook_is_called_after_every_row_parallel_output():
    model = DiT(ModelShape.from_name("tiny"))
    calls = []
    model.set_allreduce(lambda y: calls.append(y.shape) or y)
    from worker.cache import make_cache
    from worker.config import Switches

    cache = make_cache(model.shape, Switches(), "cpu", torch.float32)
    model.first_forward(torch.randn(6, model.shape.d_model), cache)
    assert len(calls) == 3 * model.shape.n_blocks and all(s == (6, model.shape.d_model) for s in calls)


def _fp8_chunks(model, fusion, steps=4):
    from worker.cache import make_cache
    from worker.config import Switches

    model.set_fusion(fusion)
    shape = model.shape
    cache = make_cache(shape, Switches.from_mapping({"ring_cache": True, "rope_at_write": True, "fp8_cache": True}),
                       model.device, model.dtype)
    g = torch.Generator().manual_seed(3)
    cond_kv = model.first_forward(torch.randn(9, shape.d_model, generator=g), cache)
    outs = []
    for i in range(steps):
        cache.begin_step(shape.new_tokens, reset=i == 2)
        outs.append(model.denoise_chunk(torch.randn(shape.new_tokens, shape.latent_channels, generator=g),
                                        cache, cond_kv))
        cache.end_step()
    return torch.stack(outs)


@pytest.mark.parametrize("act_scales", ["tensor", "row"])
def test_fused_block_path_equals_the_unfused_fp8_path(act_scales):
    from worker.model import BlockFusion

    model = DiT(ModelShape.from_name("tiny"), dtype=torch.bfloat16, fp8=True)
    model.act_scales = act_scales
    model.set_compile(False)
    plain = _fp8_chunks(model, None)
    fused = _fp8_chunks(model, BlockFusion.eager(model.act_scales))
    assert torch.isfinite(plain.float()).all()
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def test_row_scaled_activations_fused_equal_unfused_and_track_the_per_tensor_path():
    from worker.model import BlockFusion

    model = DiT(ModelShape.from_name("tiny"), dtype=torch.bfloat16, fp8=True)
    model.act_scales = "row"
    model.set_compile(False)
    assert all(b.qkv.quant.__name__ == "quantize_act_rows" and b.qkv.site is None for b in model.blocks)
    model.act_scales = "tensor"
    model.set_compile(False)  # installs the per-tensor quantizer on every linear
    assert all(b.down.quant.__name__ == "quantize_act" for b in model.blocks)
    per_tensor = _fp8_chunks(model, None)
    model.act_scales = "row"
    model.set_compile(False)
    plain = _fp8_chunks(model, None)
    fused = _fp8_chunks(model, BlockFusion.eager("row"))
    assert torch.isfinite(plain.float()).all()
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)
    # a different rounding of the same model: close to the per-tensor path, not equal to it
    assert not torch.equal(plain, per_tensor)
    err = (plain.float() - per_tensor.float()).norm() / per_tensor.float().norm()
    assert err < 0.1, err


def test_per_row_quantization_is_one_scale_per_row_and_saturates_nowhere():
    from worker.fp8 import FP8_MAX, quantize_act_rows, scaled_mm

    x = torch.randn(37, 64) * torch.logspace(-3, 3, 37)[:, None]  # rows six decades apart
    q, s = quantize_act_rows(x)
    assert s.shape == (37, 1) and q.dtype == torch.float8_e4m3fn
    assert torch.isfinite(q.float()).all() and q.float().abs().amax(-1).eq(FP8_MAX).all()
    w = torch.randn(48, 64).to(torch.float8_e4m3fn)
    y = scaled_mm(q, s, w, torch.tensor(0.5))
    ref = x @ (w.float() * 0.5).t()
    rel = ((y.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max()
    assert rel < 0.08, rel  # every row keeps FP8's relative precision, however small it is


def test_unknown_activation_scales_are_refused():
    model = DiT(ModelShape.from_name("tiny"))
    model.act_scales = "block"
    with pytest.raises(ValueError, match="valid"):
        model.set_compile(False)


def test_fusion_needs_fp8_weights():
    from worker.model import BlockFusion

    with pytest.raises(ValueError, match="FP8 weights"):
        DiT(ModelShape.from_name("tiny")).set_fusion(BlockFusion.eager("row"))


def test_static_scales_calibrate_then_fuse_and_track_the_per_row_path():
    """act_scales "static": every linear's input scale calibrated over a first forward and one chunk
    (the blocks run unfused meanwhile), then fixed; fused == unfused bit for bit (each calibrating on the
    same inputs), and the latents stay close to the dynamic per-row path's."""
    from worker.model import BlockFusion

    model = DiT(ModelShape.from_name("tiny"), dtype=torch.bfloat16, fp8=True)
    assert model.act_scales == "static" and model.calibrating  # the default: sites from construction
    model.act_scales = "row"
    model.set_compile(False)
    assert not model.calibrating
    per_row = _fp8_chunks(model, None)
    model.act_scales = "static"
    model.set_compile(False)  # fresh sites: calibrate again
    assert model.calibrating and all(b.o.quant is b.o.site for b in model.blocks)
    plain = _fp8_chunks(model, None)
    assert not model.calibrating
    scales = [b.down.in_scale.clone() for b in model.blocks]
    assert all(float(s) > 0 for s in scales)
    model.reset_act_scales()  # fresh sites: the fused run calibrates on the same inputs again
    assert model.calibrating
    fusion, used = BlockFusion.eager("static"), []
    res_ln_quant = fusion.res_ln_quant
    fusion.res_ln_quant = lambda *a: used.append(1) or res_ln_quant(*a)
    fused = _fp8_chunks(model, fusion)
    assert used, "the fused path must run once calibrated"
    assert torch.isfinite(plain.float()).all()
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)
    assert all(torch.equal(b.down.in_scale, s) for b, s in zip(model.blocks, scales, strict=True))
    err = (plain.float() - per_row.float()).norm() / per_row.float().norm()
    assert 0 < err < 0.1, err


def test_static_scale_covers_its_calibration_inputs_then_saturates():
    from worker.fp8 import FP8_MAX, StaticScale

    site = StaticScale("cpu", calls=2)
    q, s = site(torch.tensor([1.0, -3.0]))
    q, s = site(torch.tensor([0.5, 2.0]))
    assert not site.calibrating and float(s) == pytest.approx(3.0 * 2.0 / FP8_MAX)
    assert q.float().abs().max() < FP8_MAX  # calibration inputs sit inside the range (margin 2)
    q, s2 = site(torch.tensor([100.0, -100.0, 1.0]))  # beyond the calibrated range: saturates, never NaN
    assert torch.equal(s2, s) and q.float().tolist()[:2] == [FP8_MAX, -FP8_MAX]


def test_compile_switch_keeps_the_static_calibration_and_a_reset_starts_over():
    """Flipping compile mid-session swaps the quantizer only: the sites, their scales and their count
    stay (a mid-session recalibration would run unfused, uncaptured, without a first forward)."""
    model = DiT(ModelShape.from_name("tiny"), dtype=torch.bfloat16, fp8=True)
    _fp8_chunks(model, None, steps=1)
    assert not model.calibrating
    sites = [(lin.site, lin.site.scale.clone()) for lin in model._linears()]
    model.set_compile(True)  # on CPU the compile switch compiles nothing, but runs the same code
    model.set_compile(False)
    assert not model.calibrating
    for lin, (site, scale) in zip(model._linears(), sites, strict=True):
        assert lin.site is site and lin.quant is site and torch.equal(site.scale, scale)
    model.reset_act_scales()  # in place: a warm worker's graphs read these scale tensors (worker/graphs.py)
    assert model.calibrating
    for lin, (site, _) in zip(model._linears(), sites, strict=True):
        assert lin.site is site and site.left == 1 + model.shape.passes and float(site.scale) == 0.0
    model.act_scales = "row"
    model.set_compile(False)
    assert not model.calibrating and all(lin.site is None for lin in model._linears())


def test_fusion_must_match_the_activation_scaling():
    from worker.model import BlockFusion

    model = DiT(ModelShape.from_name("tiny"), dtype=torch.bfloat16, fp8=True)
    assert model.act_scales == "static"
    with pytest.raises(ValueError, match=r"valid: BlockFusion.eager\('static'\)"):
        model.set_fusion(BlockFusion.eager("row"))
    model.set_fusion(BlockFusion.eager("static"))


@pytest.mark.parametrize(
    "fusable,compile,triton,act_scales,kind",
    [
        (False, True, True, "static", None),  # CPU, bf16 weights or fuse_blocks off: unfused
        (True, False, False, "static", None),  # neither switch: unfused
        (True, True, False, "static", "static"),  # compile alone: inductor's chains
        (True, False, True, "static", "triton"),  # the Triton chains need no compile
        (True, True, True, "static", "triton"),  # both: the Triton chains (faster on the H200)
        (True, True, True, "row", "row"),  # dynamic scales have no Triton chain: compiled
        (True, False, True, "tensor", None),
    ],
)
def test_the_switches_pick_the_fused_chains(fusable, compile, triton, act_scales, kind):
    from worker.model import fusion_kind

    assert fusion_kind(fusable, compile, triton, act_scales) == kind
