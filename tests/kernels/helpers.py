"""Input builders and error measures shared by the kernel tests (fresh random data, poisoned outputs)."""

from __future__ import annotations

import torch

from kernels.rope import FP8_DTYPE, FP8_MAX

NAN_FP8 = 0x7F  # float8_e4m3fn NaN bit pattern: the poison for cache slots nobody should read or keep


def poisoned_cache(H: int, S: int, D: int, device) -> torch.Tensor:
    """[H,S,D] float8_e4m3fn filled with NaN codes."""
    return torch.full((H, S, D), NAN_FP8, dtype=torch.uint8, device=device).view(FP8_DTYPE)


def random_scale(H: int, g: torch.Generator, device, lo: float = 0.004, hi: float = 0.05) -> torch.Tensor:
    return (lo + (hi - lo) * torch.rand(H, generator=g, device=device)).float()


def random_fp8_window(H, S, D, scale, g, device, spread: float = 1.0) -> torch.Tensor:
    """Values ~ N(0, spread) quantized with ``scale`` (no NaN codes)."""
    x = torch.randn(H, S, D, generator=g, device=device) * spread
    return torch.clamp(x / scale[:, None, None], -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)
