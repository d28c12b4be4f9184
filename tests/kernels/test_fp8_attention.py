"""fp8_attention against the fp64 truth, bounded by its precision-model reference's own error (FA3 rule).

Every precision pair (``QK_MODES`` x ``PV_MODES``), both V layouts (head_dim-contiguous, keys-contiguous
``v_layout``) and the launch variants (tiles, TMA descriptors zero-filling past n_valid); and the precision
model itself: the default's error against the fp64 truth within its bound and far below the old
all-FP8 pair's."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_attention import (
    DEFAULT,
    GPU_PV_MODES,
    REL_ERR_BOUND,
    fp8_attention,
    fp8_attention_lowp_ref,
    fp8_attention_ref,
    launch,
    rope_q_ref,
    split_e4m3_ref,
    to_keys_contiguous,
)
from tests.kernels.helpers import NAN_FP8, max_err, random_fp8_window, random_scale
from worker.rope import apply_rope_tables, rope_tables

# (qk, pv) -> relative-error bound (e4m3 Q or P costs ~2.5% on random data): every pair in the interpreter,
# the GPU's pairs (GPU_PV_MODES) on CUDA
MODES = {m: b for m, b in REL_ERR_BOUND.items() if not torch.cuda.is_available() or m[1] in GPU_PV_MODES}


def _inputs(H, Tq, S, D, n_valid, g, device, v_keys=False):
    q = (torch.randn(H, Tq, D, generator=g, device=device) * 1.5).bfloat16()
    k_scale, v_scale = random_scale(H, g, device), random_scale(H, g, device)
    k = random_fp8_window(H, S, D, k_scale, g, device)
    v = random_fp8_window(H, S, D, v_scale, g, device)
    if v_keys:
        v = to_keys_contiguous(v)
        assert v.stride(1) == 1
    k.view(torch.uint8)[:, n_valid:] = NAN_FP8  # slots past n_valid must never be read
    v.view(torch.uint8)[:, n_valid:] = NAN_FP8
    return q, k, v, k_scale, v_scale


def check_attention(H, Tq, S, D, n_valid, qk, pv, rng, device, rel_bound, v_keys=False, cfg=None):
    g, seed = rng
    q, k, v, ks, vs = _inputs(H, Tq, S, D, n_valid, g, device, v_keys)
    if cfg is None:
        out = fp8_attention(q, k, v, ks, vs, n_valid, qk=qk, pv=pv)
    else:
        out = launch(q, k, v, ks, vs, n_valid, D**-0.5, qk, pv, cfg=cfg)
    truth = fp8_attention_ref(q, k, v, ks, vs, n_valid, compute_dtype=torch.float64).double()
    lowp = fp8_attention_lowp_ref(q, k, v, ks, vs, n_valid, qk=qk, pv=pv)
    msg = f"seed={seed} H={H} Tq={Tq} S={S} D={D} n_valid={n_valid} qk={qk} pv={pv} v_keys={v_keys} cfg={cfg}"
    assert out.shape == q.shape and out.dtype == torch.bfloat16, msg
    assert torch.isfinite(out).all(), f"NaN/inf (masked slots read?): {msg}"
    err, err_ref = max_err(out, truth), max_err(lowp, truth)
    atol = 2.0**-8 * truth.abs().max().item()  # one bf16 rounding of the largest output
    assert err <= 2 * err_ref + atol, f"err {err} > 2 * err_ref {err_ref} + {atol}: {msg}"
    rel = ((out.double() - truth).norm() / truth.norm()).item()
    assert rel <= rel_bound, f"relative error {rel} > {rel_bound}: {msg}"
    return rel


@pytest.mark.parametrize(
    "H,Tq,S,D,n_valid",
    [(3, 19, 45, 32, 37), (5, 7, 40, 16, 40), (2, 33, 70, 64, 65), (3, 40, 64, 32, 1)],
)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("v_keys", [False, True], ids=["v_dims", "v_keys"])
def test_matches_reference(H, Tq, S, D, n_valid, mode, v_keys, rng, device):
    check_attention(H, Tq, S, D, n_valid, *mode, rng, device, MODES[mode], v_keys=v_keys)


def _cfg(bm=16, bn=32, tma=False):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 1, "TMA": tma}


@pytest.mark.parametrize(
    "H,Tq,S,D,n_valid,cfg",
    [
        (2, 21, 150, 32, 143, _cfg()),  # 143 = 4 x 32 + 15: a masked tail
        (3, 33, 200, 64, 200, _cfg(bm=32)),  # whole tiles only, Tq not a multiple of BLOCK_M
        (2, 9, 70, 32, 70, _cfg(bn=16)),
        (3, 19, 150, 32, 141, _cfg(bn=64, tma=True)),  # descriptors: zero fill past n_valid, no masks
        (2, 21, 200, 64, 181, _cfg(bn=64, tma=True)),
    ],
)
@pytest.mark.parametrize(
    "mode", [m for m in (DEFAULT, ("fp8", "fp8"), ("bf16", "split"), ("split", "split")) if m in MODES]
)
@pytest.mark.parametrize("v_keys", [False, True], ids=["v_dims", "v_keys"])
def test_launch_variants_match_reference(H, Tq, S, D, n_valid, cfg, mode, v_keys, rng, device):
    check_attention(H, Tq, S, D, n_valid, *mode, rng, device, MODES[mode], v_keys=v_keys, cfg=cfg)


@pytest.mark.parametrize("v_keys", [False, True], ids=["v_dims", "v_keys"])
def test_single_valid_slot_returns_its_value(v_keys, rng, device):
    """With one valid slot every query gets exactly that slot's V (softmax of one element is 1)."""
    g, seed = rng
    q, k, v, ks, vs = _inputs(3, 9, 20, 32, 1, g, device, v_keys)
    out = fp8_attention(q, k, v, ks, vs, 1)
    want = (v[:, :1].float() * vs[:, None, None]).expand(3, 9, 32).bfloat16()
    assert torch.equal(out, want), f"seed={seed}"


def test_default_precision_is_default(rng, device):
    """qk=None / pv=None take ``DEFAULT`` (what the worker's call gets): the same output as passing it."""
    g, seed = rng
    for v_keys in (False, True):
        q, k, v, ks, vs = _inputs(2, 13, 50, 32, 44, g, device, v_keys)
        want = fp8_attention(q, k, v, ks, vs, 44, qk=DEFAULT[0], pv=DEFAULT[1])
        assert torch.equal(fp8_attention(q, k, v, ks, vs, 44), want), f"seed={seed} v_keys={v_keys}"


def test_unknown_precision_lists_the_valid_ones(rng, device):
    g, _ = rng
    q, k, v, ks, vs = _inputs(2, 8, 16, 32, 16, g, device)
    with pytest.raises(AssertionError, match=r"valid: \['fp8', 'split', 'bf16'\]"):
        fp8_attention(q, k, v, ks, vs, 16, qk="int8")


def test_split_e4m3_keeps_about_eight_bits(rng, device):
    """hi + lo / 16 on the e4m3 grid: within 2**-8 of x relative (plus the subnormal floor), where hi alone
    is off by up to 2**-4; and both parts are exact e4m3 values (the kernel's MMA operands)."""
    g, seed = rng
    x = torch.randn(4096, generator=g, device=device).double() * 100
    x = x.clamp(-448, 448)
    hi, lo = split_e4m3_ref(x)
    err = (hi + lo / 16 - x).abs()
    assert (err <= x.abs() * 2.0**-8 + 2.0**-13).all(), f"seed={seed}"
    assert (hi - x).abs().max() > 4 * err.max(), f"seed={seed}"
    for part in (hi, lo):
        assert torch.equal(part.to(torch.float8_e4m3fn).double(), part), f"seed={seed}"


def test_precision_model_default_within_bound_and_far_below_all_fp8(rng, device):
    """The reference's precision model (a slice of the rank shape: head_dim 128, 2,000 slots): the default
    pair's error vs the fp64 truth stays within its bound, at bf16's level (the all-bf16 pair's error x
    1.5), and 10x below the old all-FP8 pair's."""
    g, seed = rng
    H, Tq, S, D = 2, 96, 2000, 128
    q, k, v, ks, vs = _inputs(H, Tq, S, D, S, g, device)
    truth = fp8_attention_ref(q, k, v, ks, vs, S, compute_dtype=torch.float64).double()

    def rel(qk, pv):
        o = fp8_attention_lowp_ref(q, k, v, ks, vs, S, qk=qk, pv=pv, compute_dtype=torch.float64).double()
        return ((o - truth).norm() / truth.norm()).item()

    default, old, bf16 = rel(*DEFAULT), rel("fp8", "fp8"), rel("bf16", "bf16")
    msg = f"seed={seed} default={default:.2e} fp8/fp8={old:.2e} bf16/bf16={bf16:.2e}"
    assert default <= REL_ERR_BOUND[DEFAULT], msg
    assert default <= 1.5 * bf16, msg
    assert 10 * default <= old, msg


def _rope_tables(Tq, D, start, device):
    """The worker's step tables (cos, sin with the first half negated) [Tq, D] fp32 at positions start + t:
    what the kernel gets from ``worker.cache``."""
    return rope_tables(torch.arange(start, start + Tq, device=device), D)


def test_rope_q_ref_is_the_workers_query_rope(rng, device):
    """The kernel's reference rotation equals worker.rope.apply_rope_tables (the path it replaces)."""
    g, seed = rng
    q = torch.randn(3, 11, 32, generator=g, device=device).bfloat16()
    cos, sin = _rope_tables(11, 32, 12_345, device)
    got, want = rope_q_ref(q, cos, sin).float(), apply_rope_tables(q, cos, sin).float()
    # the worker's addcmul may fuse the multiply-add (one rounding less): a rare 1-ulp flip at bf16
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0**-100))) - 7)
    assert ((got - want).abs() <= ulp).all(), f"seed={seed}"
    assert (got != want).float().mean() < 1e-2, f"seed={seed}"


@pytest.mark.parametrize("H,Tq,S,D,n_valid", [(3, 37, 50, 32, 41), (2, 9, 20, 64, 20)])
@pytest.mark.parametrize("v_keys", [False, True], ids=["v_dims", "v_keys"])
def test_queries_rotated_in_the_kernel_equal_rotated_queries(H, Tq, S, D, n_valid, v_keys, rng, device):
    """q_cos/q_sin: the same output as attending with queries rotated beforehand by ``rope_q_ref``."""
    g, seed = rng
    q, k, v, ks, vs = _inputs(H, Tq, S, D, n_valid, g, device, v_keys)
    cos, sin = _rope_tables(Tq, D, int(torch.randint(0, 30_000, (1,), generator=g)), device)
    got = fp8_attention(q, k, v, ks, vs, n_valid, q_cos=cos, q_sin=sin)
    want = fp8_attention(rope_q_ref(q, cos, sin), k, v, ks, vs, n_valid)
    assert not torch.equal(rope_q_ref(q, cos, sin), q), "the tables must rotate"
    assert torch.equal(got, want), f"seed={seed} v_keys={v_keys}"


def test_rope_tables_are_checked(rng, device):
    g, _ = rng
    q, k, v, ks, vs = _inputs(2, 8, 16, 32, 16, g, device)
    cos, sin = _rope_tables(8, 32, 0, device)
    with pytest.raises(AssertionError, match="go together"):
        fp8_attention(q, k, v, ks, vs, 16, q_cos=cos)
    with pytest.raises(AssertionError, match=r"valid: contiguous fp32 \[8, 32\]"):
        fp8_attention(q, k, v, ks, vs, 16, q_cos=cos[:4], q_sin=sin[:4])


def check_fp8_output(H, Tq, S, D, n_valid, v_keys, rng, device):
    """out_scale: FP8 [Tq, H*D] = clamp(o / out_scale) of the bf16 output, up to its double rounding
    (the kernel rounds once, from fp32): every code within one e4m3 step, most identical."""
    g, seed = rng
    q, k, v, ks, vs = _inputs(H, Tq, S, D, n_valid, g, device, v_keys)
    o = fp8_attention(q, k, v, ks, vs, n_valid)
    scale = (o.float().abs().max() / 300.0).reshape(())  # some values past 448 * scale: saturate
    got = fp8_attention(q, k, v, ks, vs, n_valid, out_scale=scale)
    want = torch.clamp(o.float().transpose(0, 1).reshape(Tq, H * D) / scale, -448.0, 448.0)
    assert got.shape == (Tq, H * D) and got.dtype == torch.float8_e4m3fn and got.is_contiguous()
    gf = got.float()
    assert torch.isfinite(gf).all(), f"seed={seed}"
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0**-6))) - 3)
    assert ((gf - want).abs() <= step + 1e-6).all(), f"seed={seed}"
    # the bf16 rounding first decides a code near an e4m3 half-step: ~2**-5 of them
    assert (gf != want.to(torch.float8_e4m3fn).float()).float().mean() < 0.06, f"seed={seed}"


@pytest.mark.parametrize("v_keys", [False, True], ids=["v_dims", "v_keys"])
def test_fp8_output_is_the_bf16_output_quantized_token_major(v_keys, rng, device):
    check_fp8_output(3, 37, 50, 32, 41, v_keys, rng, device)


def test_each_pair_launches_with_its_sweep_tiles():
    """On the GPU the launch takes a pair's own measured tiles (``TUNED_PAIRS``: the attention_fp8_dots
    switch's FAST pair ran fastest at 64x128) and ``TUNED`` for the others, per V layout."""
    import kernels.fp8_attention as fa

    keys, dims = fa.v_layout(2, 64, 128), torch.zeros(2, 64, 128, dtype=torch.float8_e4m3fn)
    assert fa._tuned(keys, fa.FAST) == fa.TUNED_PAIRS[fa.FAST]["keys"] != fa.TUNED["keys"]
    assert fa._tuned(keys, DEFAULT) == fa._tuned(keys) == fa.TUNED["keys"]
    assert fa._tuned(dims, fa.FAST) == fa.TUNED["dims"]  # no measured tiles of its own there
