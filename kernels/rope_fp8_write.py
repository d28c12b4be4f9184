"""Fused write of new tokens into the FP8 ring cache: RoPE at absolute positions -> FP8 e4m3 -> ring slots.

``rope_fp8_write(x, positions, slots, scale, cache)`` (contract 6) does, in one kernel, what the worker's
torch path does in several ops: cache[h, slots[t]] = fp8(clamp(rope(x[h, t], positions[t]) / scale[h])).
``apply_rope=False`` writes V (quantize only). ``rope_fp8_write_ref`` is the same in plain torch (fp32).
Works eagerly, under ``torch.compile`` (a ``torch.library.triton_op``) and on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rope import (
    FP8_DTYPE,
    SUPPORTED_HEAD_DIMS,
    interpreting,
    log2_base_term,
    quantize_fp8,
    rope_at,
    to_fp8_saturating,
)


@triton.jit
def _rope_fp8_write_kernel(
    X,
    POS,
    SLOT,
    SCALE,
    CACHE,  # x [H,T,D]; positions, slots [T]; scale [H]; cache [H,S,D] fp8
    T,
    stride_xh,
    stride_xt,
    stride_ch,
    stride_cs,
    freq_exp,  # 2*log2(base)/D: inv_freq[i] = 2**(-i*freq_exp)
    APPLY_ROPE: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tb = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    i = tl.arange(0, HALF)
    x_ptr = X + h * stride_xh + t[:, None].to(tl.int64) * stride_xt + i[None, :]
    x1 = tl.load(x_ptr, mask=tmask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=tmask[:, None], other=0.0).to(tl.float32)
    if APPLY_ROPE:
        pos = tl.load(POS + t, mask=tmask, other=0).to(tl.float32)
        inv_freq = tl.exp2(i.to(tl.float32) * -freq_exp)
        angle = pos[:, None] * inv_freq[None, :]
        c = tl.cos(angle)
        s = tl.sin(angle)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    scale = tl.load(SCALE + h)
    y1 = to_fp8_saturating(y1 / scale, EXACT_ROUND)
    y2 = to_fp8_saturating(y2 / scale, EXACT_ROUND)
    slot = tl.load(SLOT + t, mask=tmask, other=0).to(tl.int64)
    c_ptr = CACHE + h * stride_ch + slot[:, None] * stride_cs + i[None, :]
    tl.store(c_ptr, y1, mask=tmask[:, None])
    tl.store(c_ptr + HALF, y2, mask=tmask[:, None])


def _check(x, positions, slots, scale, cache) -> None:
    assert x.dim() == 3 and cache.dim() == 3, (
        f"x {tuple(x.shape)} and cache {tuple(cache.shape)} must be [H,*,D]"
    )
    H, T, D = x.shape
    assert cache.shape[0] == H and cache.shape[2] == D, f"cache {tuple(cache.shape)} vs x {tuple(x.shape)}"
    assert D in SUPPORTED_HEAD_DIMS, f"head_dim {D} not in {SUPPORTED_HEAD_DIMS}"
    assert cache.dtype == FP8_DTYPE, f"cache dtype {cache.dtype}, valid: {FP8_DTYPE}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), (
        f"x dtype {x.dtype}, valid: bf16/fp16/fp32"
    )
    assert positions.shape == (T,) and slots.shape == (T,), f"positions/slots must be [{T}]"
    assert positions.dtype == torch.int64 and slots.dtype == torch.int64, "positions and slots must be int64"
    assert scale.shape == (H,) and scale.dtype == torch.float32, f"scale must be fp32 [{H}]"
    assert x.stride(-1) == 1 and cache.stride(-1) == 1, "last dim must be contiguous"
    assert positions.is_contiguous() and slots.is_contiguous() and scale.is_contiguous()


def _launch(x, positions, slots, scale, cache, apply_rope, base, wrap=lambda k: k) -> None:
    H, T, D = x.shape
    block_t = 32 if D <= 128 else 16
    grid = (triton.cdiv(T, block_t), H)
    wrap(_rope_fp8_write_kernel)[grid](
        x,
        positions,
        slots,
        scale,
        cache,
        T,
        x.stride(0),
        x.stride(1),
        cache.stride(0),
        cache.stride(1),
        log2_base_term(D, base),
        APPLY_ROPE=apply_rope,
        EXACT_ROUND=interpreting(),
        HALF=D // 2,
        BLOCK_T=block_t,
        num_warps=4,
    )


@torch.library.triton_op("livestep::rope_fp8_write", mutates_args={"cache"})
def _rope_fp8_write_op(
    x: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    scale: torch.Tensor,
    cache: torch.Tensor,
    apply_rope: bool,
    base: float,
) -> None:
    _launch(x, positions, slots, scale, cache, apply_rope, base, wrap=torch.library.wrap_triton)


def rope_fp8_write(
    x: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    scale: torch.Tensor,
    cache: torch.Tensor,
    apply_rope: bool = True,
    base: float = 10000.0,
) -> None:
    """In place: cache[h, slots[t]] = fp8(clamp(rope(x[h,t], positions[t]) / scale[h], +-448)).

    x [H,T,D] bf16/fp16/fp32; positions, slots int64 [T] (slots distinct); scale fp32 [H]; cache [H,S,D] fp8.
    """
    _check(x, positions, slots, scale, cache)
    if x.shape[1] == 0:
        return
    if torch.compiler.is_compiling():
        torch.ops.livestep.rope_fp8_write(x, positions, slots, scale, cache, apply_rope, float(base))
    else:
        _launch(x, positions, slots, scale, cache, apply_rope, float(base))


def rope_fp8_write_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    scale: torch.Tensor,
    cache: torch.Tensor,
    apply_rope: bool = True,
    base: float = 10000.0,
    compute_dtype=torch.float32,
) -> None:
    """Plain torch version of ``rope_fp8_write`` (computes in ``compute_dtype``), in place."""
    y = x.to(compute_dtype)
    if apply_rope:
        y = rope_at(y, positions, base)
    cache[:, slots] = quantize_fp8(y, scale)
