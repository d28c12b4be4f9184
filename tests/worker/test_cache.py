"""Ring vs plain cache through the whole model, delta rotation, and moving a window between caches."""

from __future__ import annotations

import pytest
import torch

from worker.cache import PlainCache, RingCache, make_cache, rebuild_cache
from worker.config import ModelShape, Switches
from worker.fp8 import dequantize, head_scale, quantize
from worker.model import DiT
from worker.rope import apply_rope, rotate_by

PLAIN = Switches()
RING = Switches(ring_cache=True, rope_at_write=True, delta_rotation=True)
RING_FP8 = Switches(ring_cache=True, rope_at_write=True, fp8_cache=True, delta_rotation=True)


def stream(model: DiT, switches: Switches, steps: int, flip: dict[int, Switches] | None = None):
    """Latents of every step and the final cache, for the same conditioning and noise."""
    shape = model.shape
    cache = make_cache(shape, switches, "cpu", torch.float32)
    g = torch.Generator().manual_seed(7)
    cond_kv = model.first_forward(torch.randn(11, shape.d_model, generator=g), cache)
    out = []
    for i in range(steps):
        if flip and i in flip:
            cache = rebuild_cache(cache, flip[i])
        cache.begin_step(shape.new_tokens, reset=i > 0 and i % shape.reset_every == 0)
        out.append(model.denoise_chunk(torch.randn(shape.new_tokens, shape.latent_channels, generator=g),
                                       cache, cond_kv))
        cache.end_step()
    return torch.stack(out), cache


@pytest.fixture(scope="module")
def tiny():
    return DiT(ModelShape.from_name("tiny"))


def test_ring_equals_plain_over_wraps_and_resets(tiny):
    plain, pc = stream(tiny, PLAIN, 100)
    ring, rc = stream(tiny, RING, 100)
    assert isinstance(pc, PlainCache) and isinstance(rc, RingCache)
    assert rc.book.wraps >= 2 and rc.book.resets >= 2
    torch.testing.assert_close(ring, plain, rtol=1e-4, atol=1e-4)
    # the ring's reset without delta rotation (un-rotate + re-rotate) lands on the same outputs
    ring_nodelta, _ = stream(tiny, Switches(ring_cache=True, rope_at_write=True), 100)
    torch.testing.assert_close(ring_nodelta, plain, rtol=1e-4, atol=1e-4)


def test_ring_fp8_close_to_plain_within_fp8_tolerance():
    model = DiT(ModelShape.from_name("tiny", fp8_attention=True))
    plain, _ = stream(model, PLAIN, 100)  # re-quantizes the window at every read
    ring, rc = stream(model, RING_FP8, 100)  # quantized once at write, per-head scales from the first forward
    assert rc.k[0].dtype == torch.float8_e4m3fn and rc.book.wraps >= 2 and rc.book.resets >= 2
    assert torch.isfinite(ring).all()
    rel = (ring - plain).norm() / plain.norm()
    assert rel < 0.03, rel  # e4m3 carries 3 mantissa bits: ~2-3% per element, far less on outputs
    fp32_ring, _ = stream(model, RING, 100)
    assert (ring - plain).abs().max() > (fp32_ring - plain).abs().max()  # the FP8 path really quantizes


def test_switching_cache_mid_stream_keeps_the_window(tiny):
    plain, _ = stream(tiny, PLAIN, 40)
    flipped, c = stream(tiny, PLAIN, 40, flip={13: RING, 27: Switches(rope_at_write=True)})
    assert isinstance(c, PlainCache) and c.rope_at_write
    torch.testing.assert_close(flipped, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("delta", [1, 37, 12345])
def test_delta_rotation_equals_rerotating_raw_keys(delta):
    g = torch.Generator().manual_seed(delta)
    raw = torch.randn(3, 29, 16, generator=g, dtype=torch.float64).float()
    pos = torch.randint(delta, delta + 40000, (29,), generator=g)
    rotated = apply_rope(raw, pos)
    torch.testing.assert_close(rotate_by(rotated, delta), apply_rope(raw, pos - delta), rtol=1e-5, atol=1e-5)
    # FP8 in and out with the same per-head scales: within e4m3 rounding of the from-scratch keys
    scale = head_scale(rotated, 1.5)
    cache = quantize(rotated, scale)
    from worker.cache import delta_rotate_torch

    delta_rotate_torch(cache, scale, delta)
    want = apply_rope(raw, pos - delta)
    err = (dequantize(cache, scale, torch.float32) - want).abs().max()
    assert err <= 2 * (dequantize(quantize(want, scale), scale, torch.float32) - want).abs().max() + 1e-3


def test_quantize_saturates_never_nan():
    x = torch.tensor([[[1e9, -1e9, float("1e30"), 0.5]]])
    q = quantize(x, torch.tensor([1.0]))
    assert torch.isfinite(q.float()).all() and q.float().abs().max() == 448


def test_ring_slot_bookkeeping():
    shape = ModelShape.from_name("tiny")
    c = RingCache(shape, RING, "cpu", torch.float32)
    for _ in range(6):  # 6 x 9 tokens through 40 slots: one wrap
        c.begin_step(shape.new_tokens)
        c.end_step()
    assert (c.book.head, c.book.n_valid, c.book.next_pos, c.book.wraps) == (54 % 40, 40, 54, 1)
    pos = c.slot_positions()
    assert pos[(c.book.head - 1) % 40] == 53 and pos[c.book.head] == 14  # newest and oldest


def _keys_contiguous_v_when(monkeypatch, pred) -> None:
    """CacheOps as on the GPU with the kernels: FP8 V stored keys-contiguous (for switches where pred)."""
    from kernels.fp8_attention import v_layout
    from worker.cache import CacheOps

    init = CacheOps.__init__

    def patched(self, switches, device):
        init(self, switches, device)
        if pred(switches):
            self._v_layout = v_layout

    monkeypatch.setattr(CacheOps, "__init__", patched)


RING_FP8_NODELTA = Switches(ring_cache=True, rope_at_write=True, fp8_cache=True)


def _feed(cache, steps: int, seed: int = 3):
    """Random K/V through every block for ``steps`` steps (resets included); the windows' attention."""
    shape = cache.shape
    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(steps):
        cache.begin_step(shape.new_tokens, reset=i > 0 and i % shape.reset_every == 0)
        for b in range(shape.n_blocks):
            k, v, q = (torch.randn(shape.heads, shape.new_tokens, shape.head_dim, generator=g) for _ in range(3))
            outs.append(cache.ops.attention(q, cache.update(b, k, v)))
        cache.end_step()
    return torch.stack(outs)


def _bytes(ts):
    return torch.stack([t.view(torch.uint8) for t in ts])


def test_keys_contiguous_v_store_matches_plain_layout(monkeypatch):
    """The torch ops (indexed stores, views) on a keys-contiguous V store the same bytes."""
    shape = ModelShape.from_name("tiny", fp8_attention=True)
    want_c = make_cache(shape, RING_FP8, "cpu", torch.float32)
    want = _feed(want_c, 12)
    _keys_contiguous_v_when(monkeypatch, lambda s: True)
    got_c = make_cache(shape, RING_FP8, "cpu", torch.float32)
    got = _feed(got_c, 12)
    assert got_c.ops.v_keys_contiguous and got_c.v[0].stride(1) == 1 and got_c.v[0].shape == want_c.v[0].shape
    assert got_c.book.wraps >= 2 and got_c.book.resets >= 1
    assert torch.equal(_bytes(got_c.v), _bytes(want_c.v)) and torch.equal(_bytes(got_c.k), _bytes(want_c.k))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # SDPA over other strides: fp32 rounding


def test_switch_flips_move_the_window_between_v_layouts(monkeypatch):
    """rebuild_cache from a keys-contiguous V (delta rotation here) to the plain layout and back keeps the
    window: the same bytes as the same flips between plain layouts."""
    shape = ModelShape.from_name("tiny", fp8_attention=True)

    def flips():
        c = make_cache(shape, RING_FP8, "cpu", torch.float32)
        _feed(c, 7)
        mid = rebuild_cache(c, RING_FP8_NODELTA)
        back = rebuild_cache(mid, RING_FP8)
        return c, mid, back

    want = flips()
    _keys_contiguous_v_when(monkeypatch, lambda s: s.delta_rotation)
    got = flips()
    assert [c.v[0].stride(1) == 1 for c in got] == [True, False, True]
    for g_c, w_c in zip(got, want, strict=True):
        assert torch.equal(_bytes(g_c.v), _bytes(w_c.v)) and torch.equal(_bytes(g_c.k), _bytes(w_c.k))
        for a, b in zip(g_c.export_tokens()[:2], w_c.export_tokens()[:2], strict=True):
            assert torch.equal(a, b)


def test_cross_window_is_fp8_only_where_attention_reads_fp8_with_the_kernels():
    """The conditioning's K/V: as given without the kernels, for a bf16-reading cache, or for a dtype the
    kernel does not take; FP8 with per-head scales (V keys-contiguous) otherwise, which the torch path
    also reads (dequantized) if the kernels go away mid-session."""
    import kernels.fp8_attention as fa
    from worker.cache import CacheOps, attention_torch

    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(2, 40, 32, generator=g).bfloat16() for _ in range(2))
    ops = CacheOps(Switches(triton_kernels=True), torch.device("cpu"))  # no kernels off CUDA
    assert ops.cross_window(k, v, fp8=True).k_scale is None
    ops._fa, ops._to_keys, ops._fa_dims = fa.fp8_attention, fa.to_keys_contiguous, fa.SUPPORTED_HEAD_DIMS
    assert ops.cross_window(k, v, fp8=False).k is k
    assert ops.cross_window(k.float(), v.float(), fp8=True).k_scale is None
    win = ops.cross_window(k, v, fp8=True)
    assert win.k.dtype == torch.float8_e4m3fn and win.v.stride(1) == 1 and win.n == 40
    assert torch.allclose(dequantize(win.k, win.k_scale, torch.float32), k.float(), rtol=0.07, atol=1e-2)
    q = torch.randn(2, 9, 32, generator=g).bfloat16()
    plain = attention_torch(q, ops.cross_window(k, v, fp8=False)).float()
    read = attention_torch(q, win).float()  # the torch path over the FP8 window
    assert ((read - plain).norm() / plain.norm()) < 0.05


@pytest.mark.parametrize("fast", [False, True], ids=["default", "attention_fp8_dots"])
def test_attention_fp8_dots_picks_the_kernels_precision_pair(fast):
    """With the kernels (here Triton's interpreter), the switch sets the FP8 attention kernel's (qk, pv):
    the output is that pair's precision model's (kernels/fp8_attention.py), far from the other pair's;
    without the kernels the switch changes nothing (SDPA, the plain path)."""
    import kernels.fp8_attention as fa
    from worker.cache import CacheOps, attention_torch

    sw = Switches(triton_kernels=True, attention_fp8_dots=fast)
    assert CacheOps(sw, torch.device("cpu")).attention_pair is None  # no kernels off CUDA: plain SDPA
    ops = CacheOps(sw, torch.device("cpu"), kernels=True)
    pair, other = (fa.FAST, fa.DEFAULT) if fast else (fa.DEFAULT, fa.FAST)
    assert ops.attention_pair == pair and pair != other
    g = torch.Generator().manual_seed(11)
    k, v = (torch.randn(2, 150, 32, generator=g).bfloat16() for _ in range(2))
    q = (torch.randn(2, 24, 32, generator=g) * 1.5).bfloat16()
    win = ops.cross_window(k, v, fp8=True)
    got = ops.attention(q, win).double()
    args = (q, win.k, win.v, win.k_scale, win.v_scale, win.n)
    model = {p: fa.fp8_attention_lowp_ref(*args, qk=p[0], pv=p[1]).double() for p in (pair, other)}
    truth = fa.fp8_attention_ref(*args, compute_dtype=torch.float64).double()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(got, truth) <= fa.REL_ERR_BOUND[pair]
    assert rel(got, model[pair]) < 0.5 * rel(got, model[other]), (rel(got, model[pair]), rel(got, model[other]))
    assert rel(model[fa.FAST], truth) > 4 * rel(model[fa.DEFAULT], truth)  # the price of the fast pair
    plain = attention_torch(q, win).double()  # the torch path reads the same FP8 window
    assert rel(plain, truth) < 0.02


def _whole_window_carry(src, dst) -> None:
    """The carry as it was: the whole window exported at once, then loaded (the reference of the block-wise one)."""
    block, n, next_pos = src.export_blocks()
    k, v = (torch.stack(x) for x in zip(*(block(b) for b in range(src.shape.n_blocks)), strict=True))
    dst.restart()
    dst.book = dst.book.__class__(dst.shape.window, next_pos=next_pos - n)
    dst.begin_step(n)
    for b in range(dst.shape.n_blocks):
        dst.update(b, k[b], v[b])
    dst.end_step()


@pytest.mark.parametrize("src_sw,dst_sw", [(PLAIN, RING_FP8), (RING_FP8, PLAIN), (RING_FP8, RING_FP8), (RING, RING_FP8),
                                           (RING_FP8, RING)], ids=["plain-fp8", "fp8-plain", "fp8-fp8", "ring-fp8", "fp8-ring"])
def test_a_carry_a_block_at_a_time_equals_the_whole_window_carry_bit_for_bit(src_sw, dst_sw):
    from worker.flips import carry_cache

    model = DiT(ModelShape.from_name("tiny", fp8_attention=True))
    _, src = stream(model, src_sw, 23)  # wrapped and reset once
    shape = model.shape
    dst, ref = (make_cache(shape, dst_sw, "cpu", torch.float32) for _ in range(2))
    carry_cache(src, dst)
    _whole_window_carry(src, ref)
    assert (dst.book.n_valid, dst.book.next_pos) == (ref.book.n_valid, ref.book.next_pos)
    for a, b in zip((*dst.k, *dst.v, dst.k_scale, dst.v_scale), (*ref.k, *ref.v, ref.k_scale, ref.v_scale), strict=True):
        assert torch.equal(a.float(), b.float())


def test_a_cache_carried_into_itself_equals_a_copy_carried_into_another():
    from worker.flips import carry_cache

    model = DiT(ModelShape.from_name("tiny", fp8_attention=True))
    _, c = stream(model, RING_FP8, 23)
    _, twin = stream(model, RING_FP8, 23)
    ref = make_cache(model.shape, RING_FP8, "cpu", torch.float32)
    carry_cache(c, c)  # a build compiling the swap's write path on its own cache: each block read before written
    _whole_window_carry(twin, ref)
    assert c.book.next_pos == ref.book.next_pos
    for a, b in zip((*c.k, *c.v, c.k_scale), (*ref.k, *ref.v, ref.k_scale), strict=True):
        assert torch.equal(a.float(), b.float())
