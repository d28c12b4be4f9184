"""The kernels at the prod57b TP=3 rank shape on the GPU, and chained eagerly vs torch.compile + CUDA graphs.

Shape: 20 heads x 128, 757 new tokens, 5,788-slot window. Errors are bounded by the reference's own
error against the fp64 truth (FA3 rule: err <= 2 * err_ref + atol). The chain is write -> attention ->
write (across the ring wrap, K+V in one launch) -> attention -> delta rotation -> attention; compiled and graph-replayed
results must equal the eager chain bit for bit. V runs in both layouts (head_dim-contiguous and the
keys-contiguous ``v_layout`` the worker uses with the kernels), the chain also with pointer loads (no TMA).
"""

from __future__ import annotations

import pytest
import torch

import kernels.fp8_attention as fa
from kernels.delta_rotate import delta_rotate
from kernels.fp8_attention import fp8_attention, rope_q_ref, to_keys_contiguous
from kernels.gelu_fp8 import gelu_fp8
from kernels.norm_fp8 import res_ln_fp8
from kernels.rope_fp8_write import rope_fp8_write, rope_fp8_write_kv
from tests.kernels.helpers import poisoned_cache, random_fp8_window, random_scale
from tests.kernels.test_chains_fp8 import test_gelu_fp8_matches_the_torch_chain as _gelu_case
from tests.kernels.test_chains_fp8 import test_res_ln_fp8_matches_the_torch_chain as _res_ln_case
from tests.kernels.test_delta_rotate import test_matches_reference as _delta_case
from tests.kernels.test_fp8_attention import (
    DEFAULT,
    MODES,
    _inputs,
    _rope_tables,
    check_attention,
    check_fp8_output,
)
from tests.kernels.test_rope_fp8_write import _run_case as _rope_case
from tests.kernels.test_rope_fp8_write import poisoned_keys_cache

pytestmark = pytest.mark.gpu

H, D, T, S = 20, 128, 757, 5788  # prod57b at TP=3: one rank's heads
D_MODEL, FFN = 7680, 10240  # the rank's residual width and FFN slice


@pytest.mark.parametrize("apply_rope", [True, False])
@pytest.mark.parametrize("keys", [False, True], ids=["dims", "keys"])
def test_rope_fp8_write_prod_shape_wrapping(apply_rope, keys, rng, device):
    _rope_case(H, T, S, D, S - 300, apply_rope, torch.bfloat16, rng, device, keys=keys)


@pytest.mark.parametrize("keys", [False, True], ids=["dims", "keys"])
def test_rope_fp8_write_two_heads_per_program_odd_heads(keys, rng, device, monkeypatch):
    """HEADS=2 tiles over 7 heads at the prod token/slot counts: the last program's second head is masked."""
    import kernels.rope_fp8_write as rfw

    monkeypatch.setattr(rfw, "_config", lambda T, D: {"BLOCK_T": 16, "HEADS": 2, "num_warps": 4})
    _rope_case(7, T, S, D, S - 300, True, torch.bfloat16, rng, device, keys=keys)


@pytest.mark.parametrize("spread", [1.0, 40.0])
def test_delta_rotate_prod_shape(spread, rng, device):
    _delta_case(H, S, D, spread, rng, device)


# the prod shape for the default, the old all-FP8 pair and the all-bf16 one (bench/attention.py checks
# every pair's error at this shape before timing it)
PROD_MODES = [DEFAULT, ("fp8", "fp8"), ("bf16", "bf16")]


@pytest.mark.parametrize("n_valid", [S, 3001])
@pytest.mark.parametrize("mode", PROD_MODES, ids=["default", "fp8-fp8", "bf16"])
@pytest.mark.parametrize("v_keys", [False, True], ids=["v_dims", "v_keys"])
def test_fp8_attention_prod_shape(n_valid, mode, v_keys, rng, device):
    check_attention(H, T, S, D, n_valid, *mode, rng, device, MODES[mode], v_keys=v_keys)


@pytest.mark.parametrize(
    "Hh,Tq,Sw,n_valid", [(7, 301, 2049, 2001), (3, 1000, 6000, 5999), (20, 33, 700, 129)]
)
@pytest.mark.parametrize("mode", PROD_MODES, ids=["default", "fp8-fp8", "bf16"])
def test_fp8_attention_odd_sizes_gpu(Hh, Tq, Sw, n_valid, mode, rng, device):
    """Odd heads / queries / windows with the launch tiles of the GPU (TUNED, TMA): vs the fp64 truth."""
    check_attention(Hh, Tq, Sw, D, n_valid, *mode, rng, device, MODES[mode], v_keys=True)


def test_pv_split_is_refused_on_the_gpu(rng, device):
    """pv="split" returned non-finite outputs on the H200 (kernels/fp8_attention.py): refused, listing the
    modes that run here."""
    g, _ = rng
    q, k, v, ks, vs = _inputs(2, 40, 64, D, 64, g, device, True)
    with pytest.raises(AssertionError, match=r"valid here: \['fp8', 'bf16'\]"):
        fp8_attention(q, k, v, ks, vs, 64, pv="split")


@pytest.mark.parametrize("v_keys", [False, True], ids=["v_dims", "v_keys"])
def test_fp8_attention_rotating_queries_prod_shape(v_keys, rng, device):
    """q_cos/q_sin at the prod shape: the output of attending with queries rotated beforehand, up to
    the odd fp32 rounding (FMA) flip of a rotated query before its bf16/FP8 rounding."""
    g, seed = rng
    q, k, v, ks, vs = _inputs(H, T, S, D, S, g, device, v_keys)
    cos, sin = _rope_tables(T, D, 40_000, device)
    got = fp8_attention(q, k, v, ks, vs, S, q_cos=cos, q_sin=sin).double()
    want = fp8_attention(rope_q_ref(q, cos, sin), k, v, ks, vs, S).double()
    rel = ((got - want).norm() / want.norm()).item()
    assert torch.isfinite(got).all() and rel <= 1e-3, f"rel {rel}: seed={seed} v_keys={v_keys}"


@pytest.mark.parametrize("v_keys", [False, True], ids=["v_dims", "v_keys"])
def test_fp8_attention_fp8_output_prod_shape(v_keys, rng, device):
    check_fp8_output(H, T, S, D, S, v_keys, rng, device)


def _cfg(bm, bn, w, st, tma=False):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "TMA": tma}


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg(64, 128, 4, 3), _cfg(128, 64, 8, 4), _cfg(128, 128, 8, 3, tma=True), _cfg(64, 128, 4, 3, tma=True),
    ],
    ids=["64x128w4", "128x64s4", "128x128-tma", "64x128w4-tma"],
)  # fmt: skip
@pytest.mark.parametrize("n_valid", [3001])
@pytest.mark.parametrize("v_keys", [False, True], ids=["v_dims", "v_keys"])
@pytest.mark.parametrize("mode", [DEFAULT, ("fp8", "fp8")], ids=["default", "fp8-fp8"])
def test_fp8_attention_variants_prod_shape(cfg, n_valid, v_keys, mode, rng, device):
    check_attention(H, T, S, D, n_valid, *mode, rng, device, MODES[mode], v_keys=v_keys, cfg=cfg)


class _Chain(torch.nn.Module):
    """write -> attention -> write (wraps) -> attention -> delta rotation -> attention, on cache buffers."""

    def __init__(self, k_cache, v_cache, k_scale, v_scale, n_first: int, delta: int, pair=DEFAULT):
        super().__init__()
        self.qk, self.pv = pair  # the precision pair (the worker's attention_fp8_dots switch: fa.FAST)
        for name, t in (
            ("k_cache", k_cache),
            ("v_cache", v_cache),
            ("k_scale", k_scale),
            ("v_scale", v_scale),
        ):
            self.register_buffer(name, t)
            torch._dynamo.mark_static_address(t)  # caches live at fixed addresses (as in the worker)
        self.n_first, self.delta = n_first, delta

    def forward(self, k1, v1, pos1, slots1, q1, k2, v2, pos2, slots2, q2, q3, cos2, sin2, out_scale):
        kc, vc, ks, vs = self.k_cache, self.v_cache, self.k_scale, self.v_scale
        rope_fp8_write(k1, pos1, slots1, ks, kc)
        rope_fp8_write(v1, pos1, slots1, vs, vc, apply_rope=False)
        qk, pv = self.qk, self.pv
        o1 = fp8_attention(q1, kc, vc, ks, vs, self.n_first, qk=qk, pv=pv)
        rope_fp8_write_kv(k2, v2, pos2, slots2, ks, vs, kc, vc)  # the one-launch K+V entry point
        o2 = fp8_attention(q2, kc, vc, ks, vs, kc.shape[1], qk=qk, pv=pv, q_cos=cos2, q_sin=sin2)  # rotated on load
        delta_rotate(kc, ks, self.delta)
        o3 = fp8_attention(q3, kc, vc, ks, vs, kc.shape[1], qk=qk, pv=pv, out_scale=out_scale)  # FP8 [T, H*D]
        return o1, o2, o3


def _chain_inputs(g, device):
    n0 = S - T - 300  # valid slots before the first write; the second write wraps the ring
    args = []
    for i, head in enumerate((n0, n0 + T)):
        k = torch.randn(H, T, D, generator=g, device=device).bfloat16()
        v = torch.randn(H, T, D, generator=g, device=device).bfloat16()
        pos = torch.arange(30_000 + i * T, 30_000 + (i + 1) * T, device=device)
        slots = (head + torch.arange(T, device=device)) % S
        q = torch.randn(H, T, D, generator=g, device=device).bfloat16()
        args += [k, v, pos, slots, q]
    args.append(torch.randn(H, T, D, generator=g, device=device).bfloat16())
    args += _rope_tables(T, D, 30_000 + T, device)
    args.append(torch.tensor(0.004, device=device))  # the third attention's static output scale
    return args, n0 + T


def _bits(t: torch.Tensor) -> torch.Tensor:
    """FP8 outputs compared by their bytes (no float8 equality kernel needed)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy in t's layout (clone() of a padded keys-contiguous view would come back contiguous)."""
    return to_keys_contiguous(t) if t.stride(1) == 1 else t.clone()


@pytest.mark.parametrize(
    "v_keys,tuned,pair",
    [
        (False, {}, DEFAULT),
        (True, {}, DEFAULT),  # the default: TMA eagerly, pointer loads under torch.compile (must agree bit for bit)
        (True, {"TMA": False}, DEFAULT),  # pointer loads on both sides
        (True, {}, fa.FAST),  # the attention_fp8_dots switch's pair, at its own tiles (TUNED_PAIRS)
    ],
    ids=["v_dims", "v_keys", "v_keys-pointers", "v_keys-fast"],
)
def test_chain_eager_compiled_and_graphed_agree(v_keys, tuned, pair, rng, device, monkeypatch):
    g, seed = rng
    if tuned:  # a variant as the default launch of the keys layout
        monkeypatch.setitem(fa.TUNED, "keys", {**fa.TUNED["keys"], **tuned})
    ks, vs = random_scale(H, g, device), random_scale(H, g, device)
    k0 = random_fp8_window(H, S, D, ks, g, device)
    v0 = random_fp8_window(H, S, D, vs, g, device)
    if v_keys:
        v0 = to_keys_contiguous(v0)
    args, n_first = _chain_inputs(g, device)
    k0.view(torch.uint8)[:, n_first - T : S - 300] = 0x7F  # slots the first write must overwrite
    v0.view(torch.uint8)[:, n_first - T : S - 300] = 0x7F
    delta = 42 * T

    def fresh():
        return _Chain(k0.clone(), _clone(v0), ks.clone(), vs.clone(), n_first, delta, pair).to(device)

    eager = fresh()
    want = [o.clone() for o in eager(*args)]
    want_caches = (eager.k_cache.clone(), eager.v_cache.clone())
    msg = f"seed={seed} v_keys={v_keys} tuned={tuned} pair={pair}"
    assert eager.v_cache.stride(1) == (1 if v_keys else D), msg
    for o in want:
        assert torch.isfinite(o.float()).all(), msg
    assert torch.isfinite(want_caches[0].float()).all() and torch.isfinite(want_caches[1].float()).all(), msg

    # torch.compile with CUDA graphs (cudagraph trees); record, then replay twice from reset caches
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    mod = fresh()
    compiled = torch.compile(mod, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        mod.k_cache.copy_(k0)
        mod.v_cache.copy_(v0)
        got = [o.clone() for o in compiled(*args)]
        for a, b in zip(got, want, strict=True):
            assert torch.equal(_bits(a), _bits(b)), f"compiled chain differs from eager: {msg}"
        assert torch.equal(mod.k_cache.view(torch.uint8), want_caches[0].view(torch.uint8)), msg
        assert torch.equal(mod.v_cache.view(torch.uint8), want_caches[1].view(torch.uint8)), msg
    assert not counters["inductor"]["cudagraph_skips"], f"cudagraphs skipped: {dict(counters['inductor'])}"

    # the eager chain captured in a plain CUDA graph, replayed from reset caches
    mod = fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mod(*args)  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = mod(*args)
    for _ in range(2):
        mod.k_cache.copy_(k0)
        mod.v_cache.copy_(v0)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(outs, want, strict=True):
            assert torch.equal(_bits(a), _bits(b)), f"graph replay differs from eager: {msg}"
        assert torch.equal(mod.k_cache.view(torch.uint8), want_caches[0].view(torch.uint8)), msg


@pytest.mark.parametrize("v_keys", [False, True], ids=["v_dims", "v_keys"])
def test_poisoned_slots_never_leak_into_attention(v_keys, rng, device):
    """Prod shape: NaN codes past n_valid (a partly filled ring) leave every output finite."""
    g, _ = rng
    ks, vs = random_scale(H, g, device), random_scale(H, g, device)
    kc = poisoned_cache(H, S, D, device)
    vc = poisoned_keys_cache(H, S, D, device) if v_keys else poisoned_cache(H, S, D, device)
    x = torch.randn(H, T, D, generator=g, device=device).bfloat16()
    slots = torch.arange(T, device=device)
    rope_fp8_write(x, slots, slots, ks, kc)
    rope_fp8_write(x, slots, slots, vs, vc, apply_rope=False)
    out = fp8_attention(x, kc, vc, ks, vs, T)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("form", ["ln_affine", "res_gate_affine", "res_gate", "res"])
def test_res_ln_fp8_prod_shape(form, rng, device):
    _res_ln_case(T, D_MODEL, torch.bfloat16, form, rng, device)


def test_gelu_fp8_prod_shape(rng, device):
    _gelu_case((T, FFN), torch.bfloat16, rng, device)


def test_chains_graphed_equal_eager(rng, device):
    """residual + LayerNorm + FP8 then GELU + FP8, captured in one CUDA graph and replayed on new inputs
    copied into the captured ones: the same bytes as the eager calls on those inputs."""
    g, seed = rng
    x, y = (torch.randn(T, D_MODEL, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    gate, w, b = (
        torch.rand(D_MODEL, generator=g, device=device, dtype=torch.bfloat16) + 0.5 for _ in range(3)
    )
    u = torch.randn(T, FFN, generator=g, device=device, dtype=torch.bfloat16)
    s = torch.tensor(0.02, device=device)

    def chain():
        x_new, h = res_ln_fp8(x, s, y=y, g=gate, w=w, b=b)
        return x_new, h, gelu_fp8(u, s)

    chain()  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for t in (x, y, u):
        t.copy_(torch.randn(t.shape, generator=g, device=device, dtype=t.dtype))
    graph.replay()
    for got, want in zip(outs, chain(), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"seed={seed}"
