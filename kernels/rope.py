"""RoPE (rotate-half / NeoX, contract 6) and FP8 e4m3 helpers shared by the kernels and their references.

Plain torch: ``inv_freq(head_dim)``, ``rotate(x, angle)`` and ``quantize_fp8(x, scale)``. The Triton
kernels compute the same angles in fp32 in-kernel (``pos * inv_freq``), so the references here use
exactly that formula in the dtype they are given (fp32 reference, fp64 truth in the tests).
Triton: ``to_fp8_saturating(y, EXACT_ROUND)``, the kernels' one float32 -> e4m3 conversion.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0: the largest finite float8_e4m3fn
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def log2_base_term(head_dim: int, base: float) -> float:
    """2*log2(base)/head_dim: inv_freq[i] = 2**(-i * this); what the kernels receive."""
    return 2.0 * math.log2(base) / head_dim


def inv_freq(head_dim: int, base: float = 10000.0, dtype=torch.float32, device=None) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies base**(-2i/head_dim), computed in ``dtype``."""
    i = torch.arange(head_dim // 2, dtype=dtype, device=device)
    return torch.exp2(i * -log2_base_term(head_dim, base))


def rotate(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [..., D] by angle [..., D/2] (broadcast), in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = torch.cos(angle), torch.sin(angle)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_at(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE of x [H, T, D] at absolute positions [T], computed in x's dtype."""
    freq = inv_freq(x.shape[-1], base, dtype=x.dtype, device=x.device)
    angle = positions.to(x.dtype)[:, None] * freq[None, :]  # [T, D/2]
    return rotate(x, angle)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """clamp(x / scale[h], -448, 448) -> float8_e4m3fn; x [H, ..., D], scale [H] (saturates, no NaN/inf)."""
    s = scale.to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
    return torch.clamp(x / s, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q [H, ..., D] fp8 -> q * scale[h] in ``dtype``."""
    return q.to(dtype) * scale.to(dtype).reshape(-1, *([1] * (q.dim() - 1)))


def keys_contiguous(cache: torch.Tensor) -> bool:
    """True when a cache [H,S,D] has slot stride 1 (head_dim strided): the keys-contiguous layout of
    ``kernels.fp8_attention.v_layout``, the FP8 P@V MMA's operand layout."""
    return cache.stride(1) == 1 and cache.stride(2) != 1


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU test mode); kernels then pre-round before FP8 casts."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def to_fp8_saturating(y, EXACT_ROUND: tl.constexpr):
    """fp32 -> float8e4nv: clamp to +-448 (saturate, never NaN/inf), round to nearest even.

    EXACT_ROUND (set under TRITON_INTERPRET=1 only): the interpreter's numpy cast loses the exponent
    carry when rounding up (0.0303 -> 0.0156 instead of 0.03125), so there the value is first rounded
    to the e4m3 grid in fp32 ((y + c) - c with ulp(c) = the e4m3 ulp of y) and the cast is then exact.
    On the GPU the hardware conversion rounds to nearest even itself.
    """
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if EXACT_ROUND:
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6)  # below 2**-6: e4m3 subnormals, fixed ulp 2**-9
        magic = tl.exp2((e + 20).to(tl.float32)) * 1.5  # 1.5 * 2**23 * 2**(e-3)
        y = (y + magic) - magic
    return y.to(tl.float8e4nv)


@triton.jit
def to_bf16(y, EXACT_ROUND: tl.constexpr):
    """fp32 -> bf16, round to nearest even. EXACT_ROUND (interpreter only): its cast truncates, so round
    to the bf16 grid in fp32 first, as in ``to_fp8_saturating``."""
    if EXACT_ROUND:
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, -126)
        magic = tl.exp2((e + 16).to(tl.float32)) * 1.5  # 1.5 * 2**23 * 2**(e-7)
        y = (y + magic) - magic
    return y.to(tl.bfloat16)
