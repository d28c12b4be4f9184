"""GELU (tanh approximation) + static FP8 quantization of the FFN hidden activations, one pass.

``gelu_fp8(u, scale)``: the FFN-down GEMM's input when the activation scales are static
(``worker/model.py``'s ``BlockFusion``): ``F.gelu(u, approximate="tanh")`` divided by the static
per-tensor ``scale``, saturated to e4m3 (+-448, never NaN/inf), rounded once, from fp32, as the compiled
chains do (the torch ops round the GELU to u's dtype first).
GELU's tanh form 0.5*u*(1 + tanh(z)) is computed as u*sigmoid(2z), the same function without a tanh
call. ``gelu_fp8_ref`` is the chain in torch ops.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.rope import FP8_DTYPE, FP8_MAX, interpreting, to_fp8_saturating

_K = math.sqrt(2.0 / math.pi)  # z = _K * (u + 0.044715 u^3)


@triton.jit
def _gelu_fp8_kernel(U, S, Q, n, K: tl.constexpr, EXACT_ROUND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    z2 = tl.maximum((2.0 * K) * (u + 0.044715 * u * u * u), -80.0)  # exp(80) stays finite: h -> 0, not 0/inf
    h = u / (1.0 + tl.exp(-z2))  # 0.5 u (1 + tanh(z)) = u sigmoid(2z)
    tl.store(Q + offs, to_fp8_saturating(h / tl.load(S), EXACT_ROUND), mask=mask)


def gelu_fp8(u: torch.Tensor, scale: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """e4m3 of gelu_tanh(u) / scale, saturating; u contiguous, any shape. ``cfg``: BLOCK, num_warps."""
    assert u.is_contiguous(), f"u {tuple(u.shape)} must be contiguous"
    assert scale.numel() == 1 and scale.dtype == torch.float32, "scale must be one fp32 value (static, per tensor)"
    cfg = cfg or {"BLOCK": 1024, "num_warps": 4}  # bench/chains.py on the H200: 8.28 us at the rank shape
    q = torch.empty(u.shape, dtype=FP8_DTYPE, device=u.device)
    n = u.numel()
    _gelu_fp8_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](
        u, scale, q, n, K=_K, EXACT_ROUND=interpreting(),
        BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
    )
    return q


def gelu_fp8_ref(u: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The chain in torch ops: ``F.gelu(approximate="tanh")``, then divide, clamp and cast."""
    return (F.gelu(u, approximate="tanh") / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
