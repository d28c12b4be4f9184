"""Residual + LayerNorm (+ modulation) + static FP8 quantization of a block's activations, one pass.

``res_ln_fp8(x, scale, y=, g=, w=, b=)`` is the chain that feeds each of a block's FP8 GEMMs when the
activation scales are static (``worker/model.py``'s ``BlockFusion``): the residual ``x + g*y`` (or
``x + y``; none without ``y``) written back as the new residual stream, its LayerNorm over the last dim
(modulated by ``w``, ``b`` when given: adaLN's ``1 + scale`` and shift), divided by the static per-tensor
``scale`` and saturated to e4m3 (+-448, never NaN/inf), rounded once, from fp32, as the compiled chains do
(the torch ops round to the activation dtype first: 2% of codes differ by one step). One program per token row holds the whole row in registers, so the residual and
the row are read once and both outputs written once (the compiled chain loops over the row twice).
``res_ln_fp8_ref`` is the same chain in torch ops (``worker/model.py``'s static chains, literally).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.rope import FP8_DTYPE, FP8_MAX, interpreting, to_bf16, to_fp8_saturating

LN_EPS = 1e-5  # F.layer_norm's default, which the torch chains use


@triton.jit
def _res_ln_fp8_kernel(
    X, Y, G, W, B, S,  # x [M,N]; y [M,N]; g, w, b [N]; scale [] fp32
    XOUT, Q,  # new residual [M,N] (x's dtype), FP8 out [M,N]
    N, stride_x, stride_y, stride_xo, stride_q, eps,
    HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, HAS_AFFINE: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # x is bf16: the new residual is rounded to it before its LayerNorm
    EXACT_ROUND: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            x = x + tl.load(G + cols, mask=mask, other=0.0).to(tl.float32) * y
        else:
            x = x + y
        if ROUND_BF16:
            x = to_bf16(x, EXACT_ROUND).to(tl.float32)
        tl.store(XOUT + row * stride_xo + cols, x, mask=mask)
    mean = tl.sum(x, axis=0) / N
    d = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
    h = d * rstd
    if HAS_AFFINE:
        h = h * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + tl.load(B + cols, mask=mask, other=0.0).to(
            tl.float32
        )
    q = to_fp8_saturating(h / tl.load(S), EXACT_ROUND)
    tl.store(Q + row * stride_q + cols, q, mask=mask)


def _check(x, scale, y, g, w, b) -> None:
    assert x.dim() == 2 and x.stride(-1) == 1, f"x {tuple(x.shape)} must be [M, N], last dim contiguous"
    assert x.dtype in (torch.bfloat16, torch.float32), f"x dtype {x.dtype}; valid: bfloat16, float32"
    assert scale.numel() == 1 and scale.dtype == torch.float32, "scale must be one fp32 value (static, per tensor)"
    if y is not None:
        assert y.shape == x.shape and y.stride(-1) == 1, f"y {tuple(y.shape)} must match x {tuple(x.shape)}"
    if g is not None:
        assert y is not None, "a gate needs the residual branch y"
    for name, v in (("g", g), ("w", w), ("b", b)):
        assert v is None or (v.shape == (x.shape[1],) and v.is_contiguous()), f"{name} must be [{x.shape[1]}]"
    assert (w is None) == (b is None), "w and b come together (LayerNorm affine)"


def res_ln_fp8(x: torch.Tensor, scale: torch.Tensor, y: torch.Tensor | None = None, g: torch.Tensor | None = None,
               w: torch.Tensor | None = None, b: torch.Tensor | None = None, eps: float = LN_EPS,
               cfg: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_new, h_fp8): x_new = x + g*y (x + y without g; x itself without y), h_fp8 = e4m3 of
    LayerNorm(x_new)[*w + b] / scale, saturating. ``cfg`` overrides num_warps (bench/chains.py)."""
    _check(x, scale, y, g, w, b)
    M, N = x.shape
    x_new = torch.empty_like(x) if y is not None else x
    q = torch.empty((M, N), dtype=FP8_DTYPE, device=x.device)
    block = triton.next_power_of_2(N)
    cfg = cfg or {"num_warps": 8 if block >= 4096 else 4}  # bench/chains.py: 10.3-12.1 us at the rank shape
    _res_ln_fp8_kernel[(M,)](
        x, y if y is not None else x, g if g is not None else x, w if w is not None else x,
        b if b is not None else x, scale, x_new, q,
        N, x.stride(0), y.stride(0) if y is not None else 0, x_new.stride(0), q.stride(0), eps,
        HAS_RES=y is not None, HAS_GATE=g is not None, HAS_AFFINE=w is not None,
        ROUND_BF16=x.dtype == torch.bfloat16, EXACT_ROUND=interpreting(), BLOCK=block,
        num_warps=cfg["num_warps"],
    )
    return x_new, q


def res_ln_fp8_ref(x: torch.Tensor, scale: torch.Tensor, y: torch.Tensor | None = None,
                   g: torch.Tensor | None = None, w: torch.Tensor | None = None, b: torch.Tensor | None = None,
                   eps: float = LN_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain in torch ops: ``torch.addcmul`` / add, ``F.layer_norm``, then divide, clamp and cast."""
    if y is not None:
        x = torch.addcmul(x, g, y) if g is not None else x + y
    h = F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return x, (h / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
