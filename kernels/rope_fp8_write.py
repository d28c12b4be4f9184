"""Fused write of new tokens into the FP8 ring cache: RoPE at absolute positions -> FP8 e4m3 -> ring slots.

``rope_fp8_write(x, positions, slots, scale, cache)`` (contract 6) does, in one kernel, what the worker's
torch path does in several ops: cache[h, slots[t]] = fp8(clamp(rope(x[h, t], positions[t]) / scale[h])).
``apply_rope=False`` writes V (quantize only); ``rope_fp8_write_kv`` writes K and V in one launch.
``rope_fp8_write_ref`` is the same in plain torch (fp32). cos/sin depend only on (token, frequency), so
each program computes them once for its block of tokens (and its HEADS heads, one by default).
A cache may be head_dim-contiguous ([H,S,D] storage) or keys-contiguous (slot stride 1, the FP8 P@V
layout of ``kernels.fp8_attention.v_layout``): there a block's run of consecutive slots is stored as
one token-major tile (coalesced), and the few tokens off the run (a ring wrap) are scattered.
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
    keys_contiguous,
    log2_base_term,
    quantize_fp8,
    rope_at,
    to_fp8_saturating,
)


@triton.jit
def _load_rows(X, hh, t, m3, i, stride_xh, stride_xt, HALF: tl.constexpr):
    """Both halves of rows t of heads hh: [HEADS, BLOCK_T, HALF] each (masked rows read as zeros)."""
    ptr = X + hh[:, None, None] * stride_xh + t[None, :, None].to(tl.int64) * stride_xt + i[None, None, :]
    return tl.load(ptr, mask=m3, other=0.0), tl.load(ptr + HALF, mask=m3, other=0.0)


@triton.jit
def _quant_store(
    x1,
    x2,
    scale,
    CACHE,
    hh,
    m3,
    slot,
    lin,
    run,
    i,
    c,
    s,
    stride_ch,
    stride_cs,
    stride_cd,
    ROPE: tl.constexpr,
    SLOTS_CONTIG: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rotate (cos/sin given) when ROPE, quantize with the heads' scales [HEADS], store to the ring slots.

    SLOTS_CONTIG (cache slot stride 1): tokens whose slot is lin (the block's first slot + token index,
    ``run``) are stored through lin, which the compiler sees as contiguous; the rest through slot."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if ROPE:
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    q1 = to_fp8_saturating(y1 / scale[:, None, None], EXACT_ROUND)
    q2 = to_fp8_saturating(y2 / scale[:, None, None], EXACT_ROUND)
    base = CACHE + hh[:, None, None] * stride_ch
    if SLOTS_CONTIG:
        c_run = base + lin[None, :, None] + i[None, None, :] * stride_cd
        c_any = base + slot[None, :, None] + i[None, None, :] * stride_cd
        on_run = m3 & run[None, :, None]
        off_run = m3 & (run == 0)[None, :, None]
        tl.store(c_run, q1, mask=on_run)
        tl.store(c_run + HALF * stride_cd, q2, mask=on_run)
        tl.store(c_any, q1, mask=off_run)
        tl.store(c_any + HALF * stride_cd, q2, mask=off_run)
    else:
        c_ptr = base + slot[None, :, None] * stride_cs + i[None, None, :]
        tl.store(c_ptr, q1, mask=m3)
        tl.store(c_ptr + HALF, q2, mask=m3)


@triton.jit
def _rope_fp8_write_kernel(
    X,
    SCALE,
    CACHE,  # x [H,T,D]; scale [H]; cache [H,S,D] fp8
    X2,
    SCALE2,
    CACHE2,  # optional second tensor written without RoPE (V), same shapes
    POS,
    SLOT,  # positions, slots [T] int64
    T,
    H,
    stride_xh,
    stride_xt,
    stride_ch,
    stride_cs,
    stride_cd,
    stride_x2h,
    stride_x2t,
    stride_c2h,
    stride_c2s,
    stride_c2d,
    freq_exp,  # 2*log2(base)/D: inv_freq[i] = 2**(-i*freq_exp)
    APPLY_ROPE: tl.constexpr,
    HAS_SECOND: tl.constexpr,
    CONTIG: tl.constexpr,  # cache slots contiguous (stride 1)
    CONTIG2: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,
):
    # program: BLOCK_T tokens x HEADS heads as [HEADS, BLOCK_T, HALF] tiles. Every load is issued first
    # (a store may alias a later load for the compiler, so loads after a store would wait for it: one
    # memory round trip per head); cos/sin depend on (token, freq) only: computed once here.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    i = tl.arange(0, HALF)
    hh = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    hmask = hh < H
    hh = tl.where(hmask, hh, 0).to(tl.int64)  # a head past H reads head 0 and stores nothing
    m3 = hmask[:, None, None] & tmask[None, :, None]
    k1, k2 = _load_rows(X, hh, t, m3, i, stride_xh, stride_xt, HALF)
    ks = tl.load(SCALE + hh)
    if HAS_SECOND:
        v1, v2 = _load_rows(X2, hh, t, m3, i, stride_x2h, stride_x2t, HALF)
        vs = tl.load(SCALE2 + hh)
    slot = tl.load(SLOT + t, mask=tmask, other=0).to(tl.int64)
    lin = tl.load(SLOT + tl.program_id(0) * BLOCK_T).to(tl.int64) + tl.arange(0, BLOCK_T)  # the block's run
    run = slot == lin
    if APPLY_ROPE:
        pos = tl.load(POS + t, mask=tmask, other=0).to(tl.float32)
        inv_freq = tl.exp2(i.to(tl.float32) * -tl.cast(freq_exp, tl.float32))
        angle = (pos[:, None] * inv_freq[None, :])[None, :, :]
        c = tl.cos(angle)
        s = tl.sin(angle)
    else:
        c = tl.zeros([1, BLOCK_T, HALF], dtype=tl.float32)
        s = c
    _quant_store(
        k1, k2, ks, CACHE, hh, m3, slot, lin, run, i, c, s, stride_ch, stride_cs, stride_cd,
        APPLY_ROPE, CONTIG, EXACT_ROUND, HALF,
    )  # fmt: skip
    if HAS_SECOND:
        _quant_store(
            v1, v2, vs, CACHE2, hh, m3, slot, lin, run, i, c, s, stride_c2h, stride_c2s, stride_c2d,
            False, CONTIG2, EXACT_ROUND, HALF,
        )  # fmt: skip


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
    assert x.stride(-1) == 1, "x: last dim must be contiguous"
    assert cache.stride(-1) == 1 or keys_contiguous(cache), (
        f"cache strides {cache.stride()}: valid layouts: head_dim contiguous, or slots contiguous"
    )
    assert positions.is_contiguous() and slots.is_contiguous() and scale.is_contiguous()


def _config(T: int, D: int) -> dict:
    """Fixed tiles: 16 tokens x 1 head per program (prod: 48 x 20 = 960 programs); the fastest of the tiles
    bench/kernels.py compared on an H200 with every load issued first (K+V, 240 calls: V keys-contiguous
    16x1 1.78 ms/step, 8x2 2.17, 16x2 2.84; V [H,S,D] 16x1 1.38, 8x2 1.37, 16x2 2.15)."""
    if interpreting():
        return {"BLOCK_T": 8, "HEADS": 2, "num_warps": 4}
    return {"BLOCK_T": 16 if D <= 128 else 8, "HEADS": 1, "num_warps": 4}


def _launch(
    x,
    positions,
    slots,
    scale,
    cache,
    apply_rope,
    base,
    v=None,
    v_scale=None,
    v_cache=None,
    wrap=lambda k: k,
    cfg=None,
) -> None:
    """Launch the kernel; with ``v`` given, V (no RoPE) is written in the same launch."""
    H, T, D = x.shape
    cfg = cfg or _config(T, D)
    second = v is not None
    v, v_scale, v_cache = (v, v_scale, v_cache) if second else (x, scale, cache)
    grid = (triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(H, cfg["HEADS"]))
    wrap(_rope_fp8_write_kernel)[grid](
        x,
        scale,
        cache,
        v,
        v_scale,
        v_cache,
        positions,
        slots,
        T,
        H,
        x.stride(0),
        x.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        v.stride(0),
        v.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        log2_base_term(D, base),
        APPLY_ROPE=apply_rope,
        HAS_SECOND=second,
        CONTIG=keys_contiguous(cache),
        CONTIG2=keys_contiguous(v_cache),
        EXACT_ROUND=interpreting(),
        HALF=D // 2,
        **cfg,
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

    x [H,T,D] bf16/fp16/fp32; positions, slots int64 [T] (slots distinct); scale fp32 [H]; cache [H,S,D] fp8
    (head_dim- or slot-contiguous storage).
    """
    _check(x, positions, slots, scale, cache)
    if x.shape[1] == 0:
        return
    if torch.compiler.is_compiling():
        torch.ops.livestep.rope_fp8_write(x, positions, slots, scale, cache, apply_rope, float(base))
    else:
        _launch(x, positions, slots, scale, cache, apply_rope, float(base))


@torch.library.triton_op("livestep::rope_fp8_write_kv", mutates_args={"k_cache", "v_cache"})
def _rope_fp8_write_kv_op(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    base: float,
) -> None:
    _launch(
        k, positions, slots, k_scale, k_cache, True, base, v, v_scale, v_cache, wrap=torch.library.wrap_triton
    )


def rope_fp8_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    base: float = 10000.0,
) -> None:
    """K with RoPE and V without, one launch: same result as two ``rope_fp8_write`` calls (K, then V)."""
    _check(k, positions, slots, k_scale, k_cache)
    _check(v, positions, slots, v_scale, v_cache)
    assert k.shape == v.shape and k_cache.shape == v_cache.shape, "K and V shapes must match"
    if k.shape[1] == 0:
        return
    if torch.compiler.is_compiling():
        torch.ops.livestep.rope_fp8_write_kv(
            k, v, positions, slots, k_scale, v_scale, k_cache, v_cache, float(base)
        )
    else:
        _launch(k, positions, slots, k_scale, k_cache, True, float(base), v, v_scale, v_cache)


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
