"""rope_fp8_write against its fp32 reference and the fp64 truth, at awkward shapes with a ring wrap, into
head_dim-contiguous and keys-contiguous (``v_layout``) caches."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_attention import v_layout
from kernels.rope import FP8_DTYPE, FP8_MAX, quantize_fp8, rope_at
from kernels.rope_fp8_write import rope_fp8_write, rope_fp8_write_kv, rope_fp8_write_ref
from tests.kernels.helpers import fp8_bytes, max_err, poisoned_cache, random_scale


def poisoned_keys_cache(H: int, S: int, D: int, device) -> torch.Tensor:
    """[H,S,D] float8_e4m3fn of NaN codes, stored keys-contiguous (slot stride 1)."""
    cache = v_layout(H, S, D, FP8_DTYPE, device)
    cache.view(torch.uint8).fill_(0x7F)
    assert cache.stride(1) == 1
    return cache


def _cache(H, S, D, device, keys: bool) -> torch.Tensor:
    return poisoned_keys_cache(H, S, D, device) if keys else poisoned_cache(H, S, D, device)


def _exact(x, positions, scale, apply_rope, base=10000.0) -> torch.Tensor:
    """fp64 truth of the written values in cache units (before rounding to FP8), clamped."""
    y = x.double()
    if apply_rope:
        y = rope_at(y, positions, base)
    return torch.clamp(y / scale.double()[:, None, None], -FP8_MAX, FP8_MAX)


def _run_case(H, T, S, D, head, apply_rope, x_dtype, rng, device, spread=1.0, keys=False):
    g, seed = rng
    scale = random_scale(H, g, device)
    x = (torch.randn(H, T, D, generator=g, device=device) * spread).to(x_dtype)
    start = int(torch.randint(0, 50_000, (1,), generator=g, device=device))
    positions = torch.arange(start, start + T, device=device, dtype=torch.int64)
    slots = (head + torch.arange(T, device=device, dtype=torch.int64)) % S
    cache = _cache(H, S, D, device, keys)
    cache_ref = poisoned_cache(H, S, D, device)
    rope_fp8_write(x, positions, slots, scale, cache, apply_rope=apply_rope)
    rope_fp8_write_ref(x, positions, slots, scale, cache_ref, apply_rope=apply_rope)
    msg = f"seed={seed} H={H} T={T} S={S} D={D} head={head} rope={apply_rope} keys={keys}"

    untouched = torch.ones(S, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.equal(fp8_bytes(cache)[:, untouched], fp8_bytes(cache_ref)[:, untouched]), msg
    assert bool((fp8_bytes(cache)[:, untouched] == 0x7F).all()), f"wrote outside the slots: {msg}"
    got = cache[:, slots].double()
    assert torch.isfinite(got).all(), f"NaN/inf written: {msg}"
    exact = _exact(x, positions, scale, apply_rope)
    err, err_ref = max_err(got, exact), max_err(cache_ref[:, slots].double(), exact)
    assert err <= 2 * err_ref + 1e-6, f"err {err} > 2 * err_ref {err_ref}: {msg}"
    # elementwise: within one e4m3 step of the truth (RTNE is half a step) plus the error an fp32 angle
    # (pos * inv_freq, relative error ~2**-24) can cause: pos * 2**-24 * |x| / scale, with margin 8
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2.0**-6))) - 3)
    angle_err = 8 * 2.0**-24 * (start + T) if apply_rope else 0.0
    atol = angle_err * x.double().abs().amax(dim=(1, 2)) / scale.double()
    bad = (got - exact).abs() > step + atol[:, None, None]
    assert not bad.any(), f"{msg}: got {got[bad][:4].tolist()} exact {exact[bad][:4].tolist()}"
    return cache, exact, slots


@pytest.mark.parametrize(
    "H,T,S,D,head",
    [(3, 5, 7, 32, 4), (5, 13, 19, 16, 11), (2, 33, 40, 64, 30), (7, 9, 9, 32, 0)],
)
@pytest.mark.parametrize("apply_rope", [True, False])
@pytest.mark.parametrize("keys", [False, True], ids=["dims", "keys"])
def test_matches_reference_and_wraps(H, T, S, D, head, apply_rope, keys, rng, device):
    _run_case(H, T, S, D, head, apply_rope, torch.bfloat16, rng, device, keys=keys)


@pytest.mark.parametrize("apply_rope", [True, False])
def test_keys_contiguous_cache_gets_the_same_bytes(apply_rope, rng, device):
    """Scattered (non-consecutive) slots and a wrap: the keys-contiguous cache holds the bytes of the plain one."""
    g, seed = rng
    H, T, S, D = 3, 21, 37, 32
    scale = random_scale(H, g, device)
    x = torch.randn(H, T, D, generator=g, device=device).bfloat16()
    pos = torch.arange(500, 500 + T, device=device)
    run = [9, 10, 11, 12, 14, 15, 16, 17]  # block 1 (8 tokens under the interpreter): a run with a hole
    wrap = [(S - 4 + j) % S for j in range(8)]  # block 2: a consecutive run across the ring's end
    rest = [s for s in torch.randperm(S, generator=g, device=device).tolist() if s not in run + wrap]
    slots = torch.tensor(run + wrap + rest[: T - 16], device=device)
    plain, keys = poisoned_cache(H, S, D, device), poisoned_keys_cache(H, S, D, device)
    rope_fp8_write(x, pos, slots, scale, plain, apply_rope=apply_rope)
    rope_fp8_write(x, pos, slots, scale, keys, apply_rope=apply_rope)
    assert torch.equal(fp8_bytes(keys), fp8_bytes(plain)), f"seed={seed}"


def test_fp32_input(rng, device):
    _run_case(3, 11, 17, 32, 9, True, torch.float32, rng, device)


def test_saturates_beyond_calibrated_range(rng, device):
    """Values far beyond 448 * scale are written as +-448, never NaN or inf."""
    cache, exact, slots = _run_case(3, 6, 10, 32, 7, True, torch.float32, rng, device, spread=1e4)
    got = cache[:, slots].float()
    big = exact.abs() >= FP8_MAX
    assert big.any()
    assert torch.equal(got[big], torch.sign(exact[big]).float() * FP8_MAX)


def test_v_path_is_plain_quantization(rng, device):
    g, seed = rng
    H, T, S, D = 3, 7, 12, 16
    scale = random_scale(H, g, device)
    x = torch.randn(H, T, D, generator=g, device=device).bfloat16()
    slots = (10 + torch.arange(T, device=device)) % S
    cache = poisoned_cache(H, S, D, device)
    rope_fp8_write(x, torch.zeros(T, dtype=torch.int64, device=device), slots, scale, cache, apply_rope=False)
    want = quantize_fp8(x.float(), scale)
    assert torch.equal(fp8_bytes(cache[:, slots]), fp8_bytes(want)), f"seed={seed}"


@pytest.mark.parametrize("H,T,S,D,head", [(3, 9, 14, 32, 10), (5, 17, 17, 16, 3)])
def test_kv_in_one_launch_equals_two_writes(H, T, S, D, head, rng, device):
    """rope_fp8_write_kv (K with RoPE, V without, one launch) writes the same bytes as two calls."""
    g, seed = rng
    ks, vs = random_scale(H, g, device), random_scale(H, g, device)
    k = torch.randn(H, T, D, generator=g, device=device).bfloat16()
    v = torch.randn(H, T, D, generator=g, device=device).bfloat16()
    pos = torch.arange(777, 777 + T, device=device)
    slots = (head + torch.arange(T, device=device)) % S
    for v_keys in (False, True):  # V in either layout; both must equal the plain two-call bytes
        kc, kc2, vc2 = (poisoned_cache(H, S, D, device) for _ in range(3))
        vc = _cache(H, S, D, device, v_keys)
        rope_fp8_write_kv(k, v, pos, slots, ks, vs, kc, vc)
        rope_fp8_write(k, pos, slots, ks, kc2)
        rope_fp8_write(v, pos, slots, vs, vc2, apply_rope=False)
        assert torch.equal(fp8_bytes(kc), fp8_bytes(kc2)), f"seed={seed} v_keys={v_keys}"
        assert torch.equal(fp8_bytes(vc), fp8_bytes(vc2)), f"seed={seed} v_keys={v_keys}"
