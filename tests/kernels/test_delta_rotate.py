"""delta_rotate against its fp32 reference and the fp64 truth; composes with rope_fp8_write."""

from __future__ import annotations

import pytest
import torch

from kernels.delta_rotate import delta_rotate, delta_rotate_ref
from kernels.rope import FP8_MAX, dequantize_fp8, inv_freq, rotate
from kernels.rope_fp8_write import rope_fp8_write
from tests.kernels.helpers import max_err, poisoned_cache, random_fp8_window, random_scale


def _exact(cache, scale, delta, base=10000.0) -> torch.Tensor:
    """fp64 truth in cache units: the dequantized window rotated by -delta, clamped, before rounding."""
    x = dequantize_fp8(cache, scale, torch.float64)
    angle = -float(delta) * inv_freq(cache.shape[-1], base, dtype=torch.float64, device=cache.device)
    return torch.clamp(rotate(x, angle) / scale.double()[:, None, None], -FP8_MAX, FP8_MAX)


@pytest.mark.parametrize("H,S,D", [(3, 37, 32), (5, 19, 16), (2, 70, 64)])
@pytest.mark.parametrize("spread", [1.0, 40.0])  # 40: most values saturate after rotation
def test_matches_reference(H, S, D, spread, rng, device):
    g, seed = rng
    scale = random_scale(H, g, device)
    cache = random_fp8_window(H, S, D, scale, g, device, spread=spread * 0.02)
    delta = int(torch.randint(1, 100_000, (1,), generator=g, device=device))
    exact = _exact(cache, scale, delta)
    cache_ref = cache.clone()
    delta_rotate(cache, scale, delta)
    delta_rotate_ref(cache_ref, scale, delta)
    msg = f"seed={seed} H={H} S={S} D={D} delta={delta}"
    assert torch.isfinite(cache.float()).all(), f"NaN/inf: {msg}"
    err, err_ref = max_err(cache.double(), exact), max_err(cache_ref.double(), exact)
    assert err <= 2 * err_ref + 1e-6, f"err {err} > 2 * err_ref {err_ref}: {msg}"
    if spread > 1:
        big = exact.abs() >= FP8_MAX
        assert torch.equal(cache.float()[big], torch.sign(exact[big]).float() * FP8_MAX), msg


def test_zero_delta_is_identity(rng, device):
    g, seed = rng
    scale = random_scale(4, g, device)
    cache = random_fp8_window(4, 23, 32, scale, g, device, spread=0.05)
    before = cache.float()
    delta_rotate(cache, scale, 0)
    assert torch.equal(cache.float(), before), f"seed={seed}"  # by value: -0 + 0 may become +0


def test_rotation_equals_writing_at_shifted_positions(rng, device):
    """Write at positions p then rotate by delta == write at p - delta (within two FP8 steps)."""
    g, seed = rng
    H, T, S, D = 3, 11, 11, 32
    scale = random_scale(H, g, device)
    x = torch.randn(H, T, D, generator=g, device=device) * 0.5
    start = int(torch.randint(5_000, 30_000, (1,), generator=g, device=device))
    delta = int(torch.randint(1, 5_000, (1,), generator=g, device=device))
    pos = torch.arange(start, start + T, device=device)
    slots = torch.arange(T, device=device)
    rotated, direct = poisoned_cache(H, S, D, device), poisoned_cache(H, S, D, device)
    rope_fp8_write(x, pos, slots, scale, rotated)
    delta_rotate(rotated, scale, delta)
    rope_fp8_write(x, pos - delta, slots, scale, direct)
    a, b = rotated.double(), direct.double()
    step = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2.0**-6))) - 3)
    assert bool(((a - b).abs() <= 2 * step + 0.05 * b.abs().amax()).all()), f"seed={seed} delta={delta}"
