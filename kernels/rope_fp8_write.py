"""Fused write of new tokens into the FP8 ring cache: RoPE at absolute positions -> FP8 e4m3 -> ring slots.

``rope_fp8_write(x, positions, slots, scale, cache)`` (contract 6) does, in one kernel, what the worker's
torch path does in several ops: cache[h, slots[t]] = fp8(clamp(rope(x[h, t], positions[t]) / scale[h])).
``apply_rope=False`` writes V (quantize only); ``rope_fp8_write_kv`` writes K and V in one launch.
``rope_fp8_write_ref`` is the same in plain torch (fp32). cos/sin depend only on (token, frequency), so
each program computes them once for a block of tokens and reuses them across several heads.
A cache may be head_dim-contiguous ([H,S,D] storage) or keys-contiguous (slot stride 1, the FP8 P@V
layout of ``kernels.fp8_attention.v_layout``). There the tokens on the run slots[0] + t (mod S) -- every
write of the worker's ring -- are stored by slot blocks aligned to BLOCK_T (each program gathers the
tokens of its slots), so whole blocks store 16-byte vectors along the slots instead of single bytes;
only the run's two edge blocks store byte-masked, and tokens off the run (arbitrary slots) are scattered.
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
def _load_quant(
    X,
    SCALE,
    h,
    tok,
    mask,
    i,
    c,
    s,
    stride_xh,
    stride_xt,
    ROPE: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rows ``tok`` of head h: load both halves, rotate (cos/sin given) when ROPE, quantize -> (q1, q2)."""
    x_ptr = X + h * stride_xh + tok[:, None].to(tl.int64) * stride_xt + i[None, :]
    x1 = tl.load(x_ptr, mask=mask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask[:, None], other=0.0).to(tl.float32)
    if ROPE:
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    scale = tl.load(SCALE + h)
    return to_fp8_saturating(y1 / scale, EXACT_ROUND), to_fp8_saturating(y2 / scale, EXACT_ROUND)


@triton.jit
def _cos_sin(POS, tok, mask, i, freq_exp, ROPE: tl.constexpr, BLOCK_T: tl.constexpr, HALF: tl.constexpr):
    """cos/sin of the rows' angles pos[tok] * inv_freq[i] (fp32), zeros when not ROPE."""
    if ROPE:
        pos = tl.load(POS + tok, mask=mask, other=0).to(tl.float32)
        angle = pos[:, None] * tl.exp2(i.to(tl.float32) * -tl.cast(freq_exp, tl.float32))[None, :]
        return tl.cos(angle), tl.sin(angle)
    else:
        z = tl.zeros([BLOCK_T, HALF], dtype=tl.float32)
        return z, z


@triton.jit
def _write_tensor(
    X,
    SCALE,
    CACHE,
    POS,
    SLOT,
    h,
    hmask,
    t,
    tmask,
    slot,
    run,
    s_blk,
    tok_blk,
    ok_blk,
    full_blk,
    i,
    c,
    s,
    freq_exp,
    stride_xh,
    stride_xt,
    stride_ch,
    stride_cs,
    stride_cd,
    ROPE: tl.constexpr,
    KEYS: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One head of one tensor (K or V). head_dim-contiguous cache: the token block's rows to their slots.
    Keys-contiguous cache (KEYS): the slot block's run tokens stored along the slots (unmasked, 16-byte
    aligned vectors when the whole block is run; byte-masked at the run's edges), then the token block's
    tokens off the run (arbitrary slots) scattered."""
    base = CACHE + h * stride_ch
    if KEYS:
        ok = ok_blk & hmask
        cb, sb = _cos_sin(POS, tok_blk, ok, i, freq_exp, ROPE, BLOCK_T, HALF)
        q1, q2 = _load_quant(
            X, SCALE, h, tok_blk, ok, i, cb, sb, stride_xh, stride_xt, ROPE, EXACT_ROUND, HALF
        )
        c_blk = base + s_blk[:, None] + i[None, :] * stride_cd
        if full_blk & (tl.min(hmask.to(tl.int32), axis=0) == 1):
            tl.store(c_blk, q1)
            tl.store(c_blk + HALF * stride_cd, q2)
        else:
            tl.store(c_blk, q1, mask=ok[:, None])
            tl.store(c_blk + HALF * stride_cd, q2, mask=ok[:, None])
        off = tmask & hmask & (run == 0)
        q1, q2 = _load_quant(X, SCALE, h, t, off, i, c, s, stride_xh, stride_xt, ROPE, EXACT_ROUND, HALF)
        c_any = base + slot[:, None] + i[None, :] * stride_cd
        tl.store(c_any, q1, mask=off[:, None])
        tl.store(c_any + HALF * stride_cd, q2, mask=off[:, None])
    else:
        m = tmask & hmask
        q1, q2 = _load_quant(X, SCALE, h, t, m, i, c, s, stride_xh, stride_xt, ROPE, EXACT_ROUND, HALF)
        c_ptr = base + slot[:, None] * stride_cs + i[None, :]
        tl.store(c_ptr, q1, mask=m[:, None])
        tl.store(c_ptr + HALF, q2, mask=m[:, None])


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
    S,  # ring slots (cache.shape[1])
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
    CONTIG: tl.constexpr,  # cache slots contiguous (stride 1): keys-contiguous layout
    CONTIG2: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,
):
    # program p: token block p (tokens p*BLOCK_T + j) and, for keys-contiguous caches, slot block p of the
    # run slots[0] + t (mod S) in BLOCK_T-aligned slot space (the grid has two programs more for the
    # alignment and the ring wrap); x HEADS heads. cos/sin depend on (token, freq): computed once here.
    p = tl.program_id(0)
    t = p * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    i = tl.arange(0, HALF)
    slot = tl.load(SLOT + t, mask=tmask, other=0).to(tl.int64)
    slot0 = tl.load(SLOT).to(tl.int64)
    lin = slot0 + t
    run = slot == tl.where(lin >= S, lin - S, lin)  # token on the run slots[0] + t (mod S)
    c, s = _cos_sin(POS, t, tmask, i, freq_exp, APPLY_ROPE, BLOCK_T, HALF)
    # the slot block: BLOCK_T-aligned slots from slots[0] up to S, then from 0 (the wrap)
    a0 = (slot0 // BLOCK_T) * BLOCK_T
    n1 = (S - a0 + BLOCK_T - 1) // BLOCK_T
    s_blk = tl.where(p < n1, a0 + p * BLOCK_T, (p - n1) * BLOCK_T) + tl.arange(0, BLOCK_T)
    tok_blk = s_blk - slot0
    tok_blk = tl.where(tok_blk < 0, tok_blk + S, tok_blk)
    ok_blk = (s_blk < S) & (tok_blk < T)
    on = tl.load(SLOT + tok_blk, mask=ok_blk, other=-1) == s_blk  # the run token's slot really is s_blk
    ok_blk = ok_blk & on
    full_blk = tl.min(ok_blk.to(tl.int32), axis=0) == 1
    for j in tl.static_range(HEADS):
        h = (tl.program_id(1) * HEADS + j).to(tl.int64)
        hmask = (t * 0 + h) < H  # a vector mask (the interpreter rejects a scalar one)
        _write_tensor(
            X,
            SCALE,
            CACHE,
            POS,
            SLOT,
            h,
            hmask,
            t,
            tmask,
            slot,
            run,
            s_blk,
            tok_blk,
            ok_blk,
            full_blk,
            i,
            c,
            s,
            freq_exp,
            stride_xh,
            stride_xt,
            stride_ch,
            stride_cs,
            stride_cd,
            APPLY_ROPE,
            CONTIG,
            EXACT_ROUND,
            HALF,
            BLOCK_T,
        )
        if HAS_SECOND:
            _write_tensor(
                X2,
                SCALE2,
                CACHE2,
                POS,
                SLOT,
                h,
                hmask,
                t,
                tmask,
                slot,
                run,
                s_blk,
                tok_blk,
                ok_blk,
                full_blk,
                i,
                c,
                s,
                freq_exp,
                stride_x2h,
                stride_x2t,
                stride_c2h,
                stride_c2s,
                stride_c2d,
                False,
                CONTIG2,
                EXACT_ROUND,
                HALF,
                BLOCK_T,
            )


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
    """Fixed tiles: 16 tokens x 2 heads per program (prod: 48 x 10 = 480 programs); fastest of the tiles
    bench/kernels.py compared on an H200 (16x2: 1.61 ms/step for K+V, 8x4: 1.78, 16x4: 2.12, 32x4: 2.72)."""
    if interpreting():
        return {"BLOCK_T": 8, "HEADS": 2, "num_warps": 4}
    return {"BLOCK_T": 16 if D <= 128 else 8, "HEADS": 2, "num_warps": 4}


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
    keys = keys_contiguous(cache) or keys_contiguous(v_cache)
    # keys-contiguous: slot blocks may number two more than token blocks (alignment, ring wrap)
    grid = (triton.cdiv(T, cfg["BLOCK_T"]) + (2 if keys else 0), triton.cdiv(H, cfg["HEADS"]))
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
        cache.shape[1],
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
