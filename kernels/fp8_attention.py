"""Flash attention of bf16 queries over the FP8 ring window (contract 6), with per-head K/V descales.

``fp8_attention(q, k_cache, v_cache, k_scale, v_scale, n_valid)`` -> [H,Tq,D] bf16: every query attends
to slots [0, n_valid) (no mask inside the window: RoPE carries position, ring order is irrelevant).
Online softmax in fp32. V may be stored in either of two layouts, same logical shape [H,S,D]:
``v_layout(H, S, D)`` keys-contiguous (storage [H,D,S_pad], slot stride 1: what an FP8 P@V MMA wants as its
K-major B operand) or head_dim-contiguous (plain [H,S,D]). Precision model:
  * Q is quantized per query row inside the kernel (row amax / 448: no extra pass, no host sync), so
    S = (q8 @ k8^T) * q_row_scale * k_scale is an FP8 x FP8 tensor-core dot (K is consumed as stored,
    K-major) with fp32 accumulation; the scales and log2(e) fold into one FMA before exp2;
  * ``pv_fp8=True``: P is cast to FP8 with P = exp2(s - m + 8) in [0, 256] (the 2**8 headroom keeps
    probabilities down to 2**-17 out of the subnormal range; the row sum uses the same shift) and
    P @ V8 is an FP8 MMA straight from shared memory when V is keys-contiguous; ``pv_fp8=False``: P and
    V in bf16 (V converted in registers every tile). ``pv_fp8=None`` takes ``TUNED`` for V's layout;
  * out = acc * v_scale / l, rounded to bf16.
Per-row FP8 Q costs accuracy: on random data ~2.6% relative error vs the fp64 truth (bf16 SDPA: 0.4%);
``qk_fp8=False`` (bf16 operands, dequantized in registers) gives 0.25% and runs ~1.35x slower.
``TMA``: K/V tiles through host TensorDescriptors over slots [0, n_valid) (zero fill, no load masks).
Tried and dropped (slower on the H200 sweep, see docs/PERFORMANCE.md): split window (flash-decoding), half
tiles with a polynomial exp2 on the FMA pipes, warp specialisation.
``q_cos``/``q_sin`` (the step's RoPE tables): the queries are rotated as they load (``rope_q_ref``), so
the worker's separate query-RoPE pass is gone; ``out_scale`` (a static activation scale): the output is
stored as FP8 [Tq, H*D], the output projection's input, so its quantization pass is gone too.
head_dim < 32 always takes the bf16 QK path (FP8 MMA needs K >= 32). ``fp8_attention_ref`` is plain
torch in fp32; ``fp8_attention_lowp_ref`` models the kernel's precision (for the tests' error bound).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.rope import (
    FP8_DTYPE,
    FP8_MAX,
    SUPPORTED_HEAD_DIMS,
    dequantize_fp8,
    interpreting,
    keys_contiguous,
    to_bf16,
    to_fp8_saturating,
)

LOG2E = 1.4426950408889634
SLOT_PAD = 16  # keys-contiguous V: slot stride padded to 16 bytes so every head_dim row loads 16 B vectors

# The launch choice on Hopper per V layout: bench/kernels.py --only attention sweeps the variants and
# prints the winner as one such line; set it here. Keys: pv_fp8, tiles (BLOCK_M x BLOCK_N), num_warps,
# num_stages, TMA (K/V tiles through host TensorDescriptors).
_TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
_PLAIN = {"TMA": False}
TUNED = {  # H200 sweep 2026-11-29 12:47 UTC: keys 64x128 w4 s3 with TMA 66.1 us = 0.755x SDPA (pointer
    # loads 77.8 us); dims: the old default (108.5 us)
    "keys": {"pv_fp8": True, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "TMA": True},
    "dims": {"pv_fp8": False, **_TILES, **_PLAIN},
}

# (qk_fp8, pv_fp8) -> relative-error bound vs the fp64 truth on random data (tests and bench use it)
REL_ERR_BOUND = {(True, False): 0.06, (True, True): 0.08, (False, True): 0.04, (False, False): 0.02}


def v_layout(H: int, S: int, D: int, dtype=FP8_DTYPE, device=None) -> torch.Tensor:
    """Zeros [H,S,D] stored keys-contiguous: storage [H,D,S_pad] (slot stride 1, head_dim stride S_pad)."""
    s_pad = triton.cdiv(S, SLOT_PAD) * SLOT_PAD
    return torch.zeros(H, D, s_pad, dtype=dtype, device=device)[:, :, :S].transpose(1, 2)


def to_keys_contiguous(x: torch.Tensor) -> torch.Tensor:
    """A copy of x [H,S,D] in ``v_layout``'s keys-contiguous storage (same values, bytes copied)."""
    out = v_layout(*x.shape, dtype=x.dtype, device=x.device)
    if x.element_size() == 1:  # fp8: copy the bytes (CPU builds lack some float8 copy kernels)
        out.view(torch.uint8).copy_(x.view(torch.uint8))
    else:
        out.copy_(x)
    return out


@triton.jit
def _bf16_operand(x, INTERPRET: tl.constexpr):
    """x rounded to bf16 for a bf16 MMA; under the interpreter (whose bf16 dot is wrong) held as fp32."""
    x = to_bf16(x.to(tl.float32), INTERPRET)
    if INTERPRET:
        x = x.to(tl.float32)
    return x


@triton.jit
def _attn_block(
    acc,
    l_i,
    m_i,
    q,
    row_c,
    k_base,
    v_base,
    start,
    hi,
    stride_ks,
    stride_vs,
    stride_vd,
    offs_d,
    offs_n0,
    h32,
    MASKED: tl.constexpr,
    QK_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    V_KEYS: tl.constexpr,
    TMA: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    """One BLOCK_N tile of slots [start, start + BLOCK_N) (masked to < hi when MASKED)."""
    offs_n = start + offs_n0
    k, v = _load_kv(
        k_base, v_base, h32, start, offs_n0, hi, stride_ks, stride_vs, stride_vd, offs_d, MASKED, V_KEYS, TMA
    )
    if MASKED:
        nmask = offs_n < hi
    if not QK_FP8:
        k = _bf16_operand(k, EXACT_ROUND)
    qk = tl.dot(q, tl.trans(k))  # [M, N] fp32 raw codes; row_c (> 0) folds all scales and log2(e)
    if MASKED:
        qk = tl.where(nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * row_c)
    if PV_FP8:
        m_sub = m_new - 8.0  # p in [0, 256]: FP8 headroom (see module docstring)
    else:
        m_sub = m_new
    p = tl.math.exp2(qk * row_c[:, None] - m_sub[:, None])  # one FMA + exp2 per score
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _p_dot_v(acc * alpha[:, None], p, v, PV_FP8, EXACT_ROUND)
    return acc, l_i, m_new


@triton.jit
def _load_kv(k_base, v_base, h32, start, offs_n0, hi, stride_ks, stride_vs, stride_vd, offs_d,
             MASKED: tl.constexpr, V_KEYS: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """K [N, D] and V [N, D] tiles of slots start + offs_n0 (masked to < hi when MASKED, zeros there).
    TMA: k_base, v_base are descriptors over slots [0, n_valid) (zero fill past it: no mask needed)."""
    N: tl.constexpr = offs_n0.shape[0]
    D: tl.constexpr = offs_d.shape[0]
    offs_n = start + offs_n0
    if TMA:
        k = k_base.load([h32, start, 0]).reshape(N, D)
        if V_KEYS:
            v = v_base.load([h32, 0, start]).reshape(D, N)  # [D, N], slots contiguous
        else:
            v = v_base.load([h32, start, 0]).reshape(N, D)
    else:
        k_ptr = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
        if V_KEYS:
            v_ptr = v_base + offs_d[:, None] * stride_vd + offs_n[None, :]  # [D, N], slots contiguous
        else:
            v_ptr = v_base + offs_n[:, None] * stride_vs + offs_d[None, :]
        if MASKED:
            nmask = offs_n < hi
            k = tl.load(k_ptr, mask=nmask[:, None], other=0.0)
            if V_KEYS:
                v = tl.load(v_ptr, mask=nmask[None, :], other=0.0)
            else:
                v = tl.load(v_ptr, mask=nmask[:, None], other=0.0)
        else:
            k = tl.load(k_ptr)
            v = tl.load(v_ptr)
    if V_KEYS:
        v = tl.trans(v)
    return k, v


@triton.jit
def _p_dot_v(acc, p, v, PV_FP8: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """acc + P @ V: P in FP8 (V as stored) or both in bf16."""
    if PV_FP8:
        if EXACT_ROUND:
            p8 = to_fp8_saturating(p, EXACT_ROUND)
        else:
            p8 = p.to(tl.float8e4nv)  # p in [0, 256], never NaN: the hardware cast needs no clamp
        acc = tl.dot(p8, v, acc)
    else:
        acc = tl.dot(_bf16_operand(p, EXACT_ROUND), _bf16_operand(v, EXACT_ROUND), acc)
    return acc


@triton.jit
def _fp8_attention_kernel(
    Q,
    K,
    V,
    KSCALE,
    VSCALE,
    OUT,  # q [H,Tq,D] bf16; k, v [H,S,D] fp8; scales [H]; out [H,Tq,D] bf16 (FP8_OUT: a view of [Tq,H*D] fp8)
    COS,
    SIN,  # ROPE_Q: the queries' RoPE tables [Tq, D] fp32 (cos, rotate-half-signed sin), row stride D
    OSCALE,  # FP8_OUT: the output's static scale [] fp32
    Tq,
    n_valid,
    qk_scale,  # qk_scale = sm_scale * log2(e)
    stride_qh,
    stride_qt,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_oh,
    stride_ot,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QK_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    V_KEYS: tl.constexpr,
    TMA: tl.constexpr,  # K, V are TensorDescriptors over slots [0, n_valid) (host-built)
    ROPE_Q: tl.constexpr,  # rotate the queries on load (q*cos + roll(q, D/2)*sin, rounded to bf16)
    FP8_OUT: tl.constexpr,  # out = fp8(clamp(o / OSCALE)) instead of bf16
    EXACT_ROUND: tl.constexpr,
):
    mb = tl.program_id(0)
    h32 = tl.program_id(1)
    h = h32.to(tl.int64)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n0 = tl.arange(0, BLOCK_N)
    mmask = offs_m < Tq
    q_ptr = Q + h * stride_qh + offs_m[:, None] * stride_qt
    q = tl.load(q_ptr + offs_d[None, :], mask=mmask[:, None], other=0.0)
    if ROPE_Q:  # the roll is a second load of the tile at rotated offsets (from L1/L2)
        q_roll = tl.load(q_ptr + ((offs_d + D // 2) % D)[None, :], mask=mmask[:, None], other=0.0)
        t_off = offs_m[:, None] * D + offs_d[None, :]
        cos = tl.load(COS + t_off, mask=mmask[:, None], other=0.0)
        sin = tl.load(SIN + t_off, mask=mmask[:, None], other=0.0)
        q = to_bf16(q.to(tl.float32) * cos + q_roll.to(tl.float32) * sin, EXACT_ROUND)
    c = tl.cast(qk_scale, tl.float32) * tl.load(KSCALE + h)  # scalars may arrive as fp64 under inductor
    if QK_FP8:
        qf = q.to(tl.float32)
        q_row_scale = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30) / 448.0  # [M]: per-row Q quantization
        q = to_fp8_saturating(qf / q_row_scale[:, None], EXACT_ROUND)
        row_c = q_row_scale * c
    else:
        q = _bf16_operand(q, EXACT_ROUND)
        row_c = tl.zeros([BLOCK_M], dtype=tl.float32) + c
    if TMA:
        k_base = K
        v_base = V
    else:
        k_base = K + h * stride_kh
        v_base = V + h * stride_vh
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    n_full = (n_valid // BLOCK_N) * BLOCK_N
    for start in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _attn_block(
            acc, l_i, m_i, q, row_c, k_base, v_base, tl.multiple_of(start, BLOCK_N), n_valid,
            stride_ks, stride_vs, stride_vd, offs_d, offs_n0,
            h32, False, QK_FP8, PV_FP8, V_KEYS, TMA, EXACT_ROUND,
        )  # fmt: skip
    if n_full < n_valid:
        acc, l_i, m_i = _attn_block(
            acc, l_i, m_i, q, row_c, k_base, v_base, n_full, n_valid,
            stride_ks, stride_vs, stride_vd, offs_d, offs_n0,
            h32, True, QK_FP8, PV_FP8, V_KEYS, TMA, EXACT_ROUND,
        )  # fmt: skip
    out = acc * (tl.load(VSCALE + h) / l_i)[:, None]
    o_ptr = OUT + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    if FP8_OUT:
        tl.store(o_ptr, to_fp8_saturating(out / tl.load(OSCALE), EXACT_ROUND), mask=mmask[:, None])
    else:
        tl.store(o_ptr, to_bf16(out, EXACT_ROUND), mask=mmask[:, None])


def _check(q, k_cache, v_cache, k_scale, v_scale, n_valid) -> None:
    assert q.dim() == 3 and k_cache.dim() == 3, (
        f"q {tuple(q.shape)}, k {tuple(k_cache.shape)} must be [H,*,D]"
    )
    H, _, D = q.shape
    assert k_cache.shape == v_cache.shape, f"k {tuple(k_cache.shape)} != v {tuple(v_cache.shape)}"
    assert k_cache.shape[0] == H and k_cache.shape[2] == D, (
        f"cache {tuple(k_cache.shape)} vs q {tuple(q.shape)}"
    )
    assert D in SUPPORTED_HEAD_DIMS, f"head_dim {D} not in {SUPPORTED_HEAD_DIMS}"
    assert q.dtype == torch.bfloat16, f"q dtype {q.dtype}, valid: torch.bfloat16"
    assert k_cache.dtype == FP8_DTYPE and v_cache.dtype == FP8_DTYPE, f"caches must be {FP8_DTYPE}"
    assert k_scale.shape == (H,) and v_scale.shape == (H,), f"scales must be [{H}]"
    assert k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32, "scales must be fp32"
    assert 1 <= n_valid <= k_cache.shape[1], f"n_valid {n_valid} must be in [1, {k_cache.shape[1]}]"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "q and k: last dim contiguous"
    assert v_cache.stride(-1) == 1 or keys_contiguous(v_cache), (
        f"v strides {v_cache.stride()}: valid layouts: head_dim contiguous, or slots contiguous (v_layout)"
    )


def _tuned(v_cache: torch.Tensor) -> dict:
    return TUNED["keys" if keys_contiguous(v_cache) else "dims"]


def _config(Tq: int, D: int, v_cache: torch.Tensor | None = None) -> dict:
    """Launch tiles (no autotuning): ``TUNED`` for V's layout on the GPU (the sweep's winner); small
    tiles for tiny problems and the interpreter."""
    if interpreting() or Tq <= 32:
        bm = 16 if Tq <= 16 else 32
        return {"BLOCK_M": bm, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, **_PLAIN}
    cfg = {k: v for k, v in (TUNED["dims"] if v_cache is None else _tuned(v_cache)).items() if k != "pv_fp8"}
    if D > 128:
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 64)
    return cfg


def _launch(
    q,
    k_cache,
    v_cache,
    k_scale,
    v_scale,
    n_valid,
    sm_scale,
    qk_fp8,
    pv_fp8,
    wrap=lambda k: k,
    cfg=None,
    q_cos=None,
    q_sin=None,
    out_scale=None,
):
    """Launch the kernel; ``cfg`` overrides the tiles (bench/kernels.py sweeps them, tests pin them)."""
    H, Tq, D = q.shape
    if out_scale is None:
        out = torch.empty_like(q)
    else:  # token-major FP8 [Tq, H*D], viewed [H, Tq, D] for the kernel's strides
        out = torch.empty(Tq, H * D, dtype=FP8_DTYPE, device=q.device).view(Tq, H, D).transpose(0, 1)
    cfg = dict(cfg or _config(Tq, D, v_cache))
    tma = cfg.pop("TMA", False)
    if wrap is torch.library.wrap_triton:
        # under torch.compile (the triton_op) loads go through pointers: torch 2.11's wrap_triton does
        # not take host TensorDescriptors built inside the op (KeyError in identify_mutated_tensors, then
        # the FX graph cache fails on the descriptor's tensor; seen on the H200, 2026-11-29). Same tiles,
        # same products in the same order: the chain test checks compiled == eager bit for bit.
        tma = False
    v_keys = keys_contiguous(v_cache)
    k_arg, v_arg = k_cache, v_cache
    if tma:  # descriptors over slots [0, n_valid): the copy engine zero-fills past the window
        from triton.tools.tensor_descriptor import TensorDescriptor

        bn = cfg["BLOCK_N"]
        k_arg = TensorDescriptor.from_tensor(k_cache[:, :n_valid], [1, bn, D])
        if v_keys:
            v_arg = TensorDescriptor.from_tensor(v_cache.transpose(1, 2)[:, :, :n_valid], [1, D, bn])
        else:
            v_arg = TensorDescriptor.from_tensor(v_cache[:, :n_valid], [1, bn, D])
    grid = (triton.cdiv(Tq, cfg["BLOCK_M"]), H)
    wrap(_fp8_attention_kernel)[grid](
        q,
        k_arg,
        v_arg,
        k_scale,
        v_scale,
        out,
        q if q_cos is None else q_cos,
        q if q_sin is None else q_sin,
        k_scale if out_scale is None else out_scale,
        Tq,
        n_valid,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        D=D,
        QK_FP8=qk_fp8 and D >= 32,
        PV_FP8=pv_fp8,
        V_KEYS=v_keys,
        TMA=tma,
        ROPE_Q=q_cos is not None,
        FP8_OUT=out_scale is not None,
        EXACT_ROUND=interpreting(),
        **cfg,
    )
    return out if out_scale is None else out.transpose(0, 1).reshape(Tq, H * D)


@torch.library.triton_op("livestep::fp8_attention", mutates_args=())
def _fp8_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    n_valid: int,
    sm_scale: float,
    qk_fp8: bool,
    pv_fp8: bool,
    q_cos: torch.Tensor | None = None,
    q_sin: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return _launch(
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        n_valid,
        sm_scale,
        qk_fp8,
        pv_fp8,
        wrap=torch.library.wrap_triton,
        q_cos=q_cos,
        q_sin=q_sin,
        out_scale=out_scale,
    )


def fp8_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    n_valid: int,
    sm_scale: float | None = None,
    qk_fp8: bool = True,
    pv_fp8: bool | None = None,
    q_cos: torch.Tensor | None = None,
    q_sin: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [H,Tq,D] bf16 over k/v [H,S,D] fp8 slots [0, n_valid) -> [H,Tq,D] bf16.

    v may be head_dim-contiguous or keys-contiguous (``v_layout``); ``pv_fp8=None``: ``TUNED``'s choice.
    ``q_cos``, ``q_sin`` [Tq, D] fp32 (the tables of ``rope_q_ref``): the queries are rotated in the
    kernel as they load (same values as attending with ``rope_q_ref(q, q_cos, q_sin)``, one pass less).
    ``out_scale`` (fp32 [], a static activation scale): the output is instead FP8 [Tq, H*D] token-major,
    clamp(o / out_scale, +-448) -- the output projection's GEMM input, no quantization pass after."""
    _check(q, k_cache, v_cache, k_scale, v_scale, n_valid)
    _check_rope_tables(q, q_cos, q_sin)
    assert out_scale is None or (out_scale.shape == () and out_scale.dtype == torch.float32), (
        f"out_scale: {None if out_scale is None else (tuple(out_scale.shape), out_scale.dtype)}; valid: fp32 []"
    )
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    pv = bool(_tuned(v_cache)["pv_fp8"]) if pv_fp8 is None else bool(pv_fp8)
    if torch.compiler.is_compiling():
        return torch.ops.livestep.fp8_attention(
            q, k_cache, v_cache, k_scale, v_scale, n_valid, sm, qk_fp8, pv, q_cos, q_sin, out_scale
        )
    return _launch(
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        n_valid,
        sm,
        qk_fp8,
        pv,
        q_cos=q_cos,
        q_sin=q_sin,
        out_scale=out_scale,
    )


def _check_rope_tables(q, q_cos, q_sin) -> None:
    if q_cos is None and q_sin is None:
        return
    Tq, D = q.shape[1], q.shape[2]
    assert q_cos is not None and q_sin is not None, "q_cos and q_sin go together"
    for name, t in (("q_cos", q_cos), ("q_sin", q_sin)):
        assert t.shape == (Tq, D) and t.dtype == torch.float32 and t.is_contiguous(), (
            f"{name}: {tuple(t.shape)} {t.dtype}; valid: contiguous fp32 [{Tq}, {D}]"
        )


def rope_q_ref(q: torch.Tensor, q_cos: torch.Tensor, q_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with tables (cos, sin with the first half negated) [T, D]: fp32 math, q's dtype."""
    qf = q.float()
    return (qf * q_cos + qf.roll(q.shape[-1] // 2, dims=-1) * q_sin).to(q.dtype)


def fp8_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    n_valid: int,
    sm_scale: float | None = None,
    compute_dtype=torch.float32,
) -> torch.Tensor:
    """Plain torch: dequantize slots [0, n_valid), softmax attention in ``compute_dtype``, bf16 out."""
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    k = dequantize_fp8(k_cache[:, :n_valid], k_scale, compute_dtype)
    v = dequantize_fp8(v_cache[:, :n_valid], v_scale, compute_dtype)
    s = (q.to(compute_dtype) @ k.transpose(-1, -2)) * sm
    return (torch.softmax(s, dim=-1) @ v).to(torch.bfloat16)


def fp8_attention_lowp_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    n_valid: int,
    sm_scale: float | None = None,
    qk_fp8: bool = True,
    pv_fp8: bool = False,
) -> torch.Tensor:
    """The kernel's precision model in torch (FA3's ``intermediate_dtype`` reference): Q quantized per row
    and P cast to FP8 as the kernel does, the rest in fp32. Tests bound the kernel's error against the
    fp64 truth by this reference's own error (err <= 2 * err_ref + atol)."""
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qf = q.float()
    if qk_fp8 and q.shape[-1] >= 32:
        row = qf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
        qf = torch.clamp(qf / row, -FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * row
    k = dequantize_fp8(k_cache[:, :n_valid], k_scale)
    v = v_cache[:, :n_valid].float()
    s = (qf @ k.transpose(-1, -2)) * sm
    p = torch.exp(s - s.amax(-1, keepdim=True)) * 256.0
    l = p.sum(-1, keepdim=True)
    p = p.to(FP8_DTYPE).float() if pv_fp8 else p.to(torch.bfloat16).float()
    return ((p @ v) * v_scale.reshape(-1, 1, 1) / l).to(torch.bfloat16)
