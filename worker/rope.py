"""Rotary position embedding (rotate-half / NeoX, ``base=10000``) and the delta rotation.

    k_rot = apply_rope(k, positions)            # k: [heads, T, head_dim], positions: int64 [T]
    k_rot = rotate_by(k_rot, delta)             # as if every position were pos - delta

Angles are computed in float64 and cast, so absolute positions of tens of thousands (the ring
cache between resets) rotate as precisely as small ones. Contract 6 in the kernels' terms.
"""

from __future__ import annotations

import torch

ROPE_BASE = 10000.0


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float = ROPE_BASE, dtype=torch.float32):
    """cos, sin: [T, head_dim] for int64 positions [T] (computed in float64)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, base: float = ROPE_BASE):
    """(cos, signed sin) [T, head_dim] for ``apply_rope_tables``: built once per step, used by every call."""
    cos, sin = rope_cos_sin(positions, head_dim, base)
    h = head_dim // 2
    return cos, torch.cat([-sin[:, :h], sin[:, h:]], dim=-1)


def apply_rope_tables(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE with precomputed tables: x*cos + roll(x, D/2)*signed_sin (= rotate_half form), fp32 math."""
    xf = x.float()
    return torch.addcmul(xf * cos, xf.roll(x.shape[-1] // 2, dims=-1), sin_signed).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = ROPE_BASE) -> torch.Tensor:
    """x: [heads, T, head_dim] rotated at positions [T]; computed in fp32, returned in x's dtype."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], base)
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def rotate_by(x: torch.Tensor, delta: int, base: float = ROPE_BASE) -> torch.Tensor:
    """Keys rotated at positions p -> rotated at p - delta (one rotation by -delta, any p)."""
    pos = torch.full((1,), -int(delta), dtype=torch.int64, device=x.device)
    cos, sin = rope_cos_sin(pos, x.shape[-1], base)
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
