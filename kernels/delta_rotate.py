"""One-pass delta rotation of the FP8 key window at a position reset (new_pos = pos - delta).

``delta_rotate(cache, scale, delta)`` (contract 6) re-rotates every cached key in place by the RoPE angle
of ``-delta`` (cos/sin of delta*inv_freq, never the difference of two large angles), FP8 in and out.
Dequantize -> rotate -> requantize with the same per-head scale equals rotating the FP8 codes
themselves (the rotation is linear and the scale is shared), so the kernel rotates the codes in fp32
and saturates at +-448; ``delta_rotate_ref`` does the literal dequantize/rotate/requantize in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rope import (
    FP8_DTYPE,
    SUPPORTED_HEAD_DIMS,
    dequantize_fp8,
    interpreting,
    inv_freq,
    log2_base_term,
    quantize_fp8,
    rotate,
    to_fp8_saturating,
)


@triton.jit
def _delta_rotate_kernel(
    CACHE,
    S,
    stride_ch,
    stride_cs,  # cache [H,S,D] fp8, rotated in place
    delta,  # fp32: the position shift
    freq_exp,  # 2*log2(base)/D
    EXACT_ROUND: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    sb = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    smask = s < S
    i = tl.arange(0, HALF)
    angle = tl.cast(delta, tl.float32) * tl.exp2(
        i.to(tl.float32) * -tl.cast(freq_exp, tl.float32)
    )  # rotation by -delta: cos(a), -sin(a)
    c = tl.cos(angle)[None, :]
    sn = tl.sin(angle)[None, :]
    ptr = CACHE + h * stride_ch + s[:, None].to(tl.int64) * stride_cs + i[None, :]
    x1 = tl.load(ptr, mask=smask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=smask[:, None], other=0.0).to(tl.float32)
    y1 = x1 * c + x2 * sn
    y2 = x2 * c - x1 * sn
    y1 = to_fp8_saturating(y1, EXACT_ROUND)
    y2 = to_fp8_saturating(y2, EXACT_ROUND)
    tl.store(ptr, y1, mask=smask[:, None])
    tl.store(ptr + HALF, y2, mask=smask[:, None])


def _check(cache, scale) -> None:
    assert cache.dim() == 3, f"cache {tuple(cache.shape)} must be [H,S,D]"
    H, _, D = cache.shape
    assert D in SUPPORTED_HEAD_DIMS, f"head_dim {D} not in {SUPPORTED_HEAD_DIMS}"
    assert cache.dtype == FP8_DTYPE, f"cache dtype {cache.dtype}, valid: {FP8_DTYPE}"
    assert scale.shape == (H,), f"scale must be [{H}]"
    assert cache.stride(-1) == 1, "last dim must be contiguous"


def _launch(cache, delta, base, wrap=lambda k: k, cfg=None) -> None:
    """Launch the kernel; ``cfg`` overrides the fixed tile (bench/kernels.py compares a few)."""
    H, S, D = cache.shape
    cfg = cfg or {"BLOCK_S": 64, "num_warps": 4}
    block_s = cfg["BLOCK_S"]
    grid = (triton.cdiv(S, block_s), H)
    wrap(_delta_rotate_kernel)[grid](
        cache,
        S,
        cache.stride(0),
        cache.stride(1),
        float(delta),
        log2_base_term(D, base),
        EXACT_ROUND=interpreting(),
        HALF=D // 2,
        BLOCK_S=block_s,
        num_warps=cfg["num_warps"],
    )


@torch.library.triton_op("livestep::delta_rotate", mutates_args={"cache"})
def _delta_rotate_op(cache: torch.Tensor, scale: torch.Tensor, delta: int, base: float) -> None:
    _launch(cache, delta, base, wrap=torch.library.wrap_triton)


def delta_rotate(cache: torch.Tensor, scale: torch.Tensor, delta: int, base: float = 10000.0) -> None:
    """In place: every key in cache [H,S,D] fp8 (scales [H]) re-rotated as if at position pos - delta."""
    _check(cache, scale)
    if cache.shape[1] == 0:
        return
    if torch.compiler.is_compiling():
        torch.ops.livestep.delta_rotate(cache, scale, int(delta), float(base))
    else:
        _launch(cache, int(delta), float(base))


def delta_rotate_ref(
    cache: torch.Tensor,
    scale: torch.Tensor,
    delta: int,
    base: float = 10000.0,
    compute_dtype=torch.float32,
) -> None:
    """Plain torch ``delta_rotate``: dequantize -> rotate by -delta (in ``compute_dtype``) -> requantize."""
    x = dequantize_fp8(cache, scale, compute_dtype)
    angle = -float(delta) * inv_freq(cache.shape[-1], base, dtype=compute_dtype, device=cache.device)
    cache.copy_(quantize_fp8(rotate(x, angle), scale))
