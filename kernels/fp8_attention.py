"""Flash attention of bf16 queries over the FP8 ring window (contract 6), with per-head K/V descales.

``fp8_attention(q, k_cache, v_cache, k_scale, v_scale, n_valid)`` -> [H,Tq,D] bf16: every query attends
to slots [0, n_valid) (no mask inside the window: RoPE carries position, ring order is irrelevant).
Online softmax in fp32. Precision model (defaults ``qk_fp8=True, pv_fp8=False``):
  * Q is quantized per query row inside the kernel (row amax / 448: no extra pass, no host sync), so
    S = (q8 @ k8^T) * q_row_scale * k_scale is an FP8 x FP8 tensor-core dot (K is consumed as stored,
    K-major) with fp32 accumulation; the scales and log2(e) fold into one FMA before exp2;
  * P @ V in bf16 by default: FP8 MMA needs V keys-contiguous, but the cache stores V [slots, head_dim],
    and the transposing FP8 path measured 2x slower on an H200. ``pv_fp8=True`` casts P to FP8 with
    P = exp2(s - m + 8) in [0, 256] (the 2**8 headroom keeps probabilities down to 2**-17 out of the
    subnormal range; the row sum uses the same shift);
  * out = acc * v_scale / l, rounded to bf16.
Per-row FP8 Q costs accuracy: on random data ~2.6% relative error vs the fp64 truth (bf16 SDPA: 0.4%);
``qk_fp8=False`` (bf16 operands, dequantized in registers) gives 0.25% and runs ~1.35x slower.
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
    to_bf16,
    to_fp8_saturating,
)

LOG2E = 1.4426950408889634


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
    n_valid,
    stride_ks,
    stride_vs,
    offs_d,
    offs_n0,
    MASKED: tl.constexpr,
    QK_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    offs_n = start + offs_n0
    if MASKED:
        nmask = offs_n < n_valid
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=nmask[:, None], other=0.0)
    else:
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :])
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :])
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
    acc = acc * alpha[:, None]
    if PV_FP8:
        acc = tl.dot(to_fp8_saturating(p, EXACT_ROUND), v, acc)
    else:
        acc = tl.dot(_bf16_operand(p, EXACT_ROUND), _bf16_operand(v, EXACT_ROUND), acc)
    return acc, l_i, m_new


@triton.jit
def _fp8_attention_kernel(
    Q,
    K,
    V,
    KSCALE,
    VSCALE,
    OUT,  # q [H,Tq,D] bf16; k, v [H,S,D] fp8; scales [H]; out [H,Tq,D] bf16
    Tq,
    n_valid,
    qk_scale,  # qk_scale = sm_scale * log2(e)
    stride_qh,
    stride_qt,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    stride_oh,
    stride_ot,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QK_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n0 = tl.arange(0, BLOCK_N)
    mmask = offs_m < Tq
    q = tl.load(
        Q + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :], mask=mmask[:, None], other=0.0
    )
    c = tl.cast(qk_scale, tl.float32) * tl.load(KSCALE + h)  # scalars may arrive as fp64 under inductor
    if QK_FP8:
        qf = q.to(tl.float32)
        q_row_scale = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30) / 448.0  # [M]: per-row Q quantization
        q = to_fp8_saturating(qf / q_row_scale[:, None], EXACT_ROUND)
        row_c = q_row_scale * c
    else:
        q = _bf16_operand(q, EXACT_ROUND)
        row_c = tl.zeros([BLOCK_M], dtype=tl.float32) + c
    k_base = K + h * stride_kh
    v_base = V + h * stride_vh
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    n_full = (n_valid // BLOCK_N) * BLOCK_N
    for start in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _attn_block(
            acc,
            l_i,
            m_i,
            q,
            row_c,
            k_base,
            v_base,
            start,
            n_valid,
            stride_ks,
            stride_vs,
            offs_d,
            offs_n0,
            False,
            QK_FP8,
            PV_FP8,
            EXACT_ROUND,
        )
    if n_full < n_valid:
        acc, l_i, m_i = _attn_block(
            acc,
            l_i,
            m_i,
            q,
            row_c,
            k_base,
            v_base,
            n_full,
            n_valid,
            stride_ks,
            stride_vs,
            offs_d,
            offs_n0,
            True,
            QK_FP8,
            PV_FP8,
            EXACT_ROUND,
        )
    out = acc * (tl.load(VSCALE + h) / l_i)[:, None]
    o_ptr = OUT + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
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
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "last dim contiguous"


def _config(Tq: int, D: int) -> dict:
    """Fixed tiles (no autotuning): 128 x 128, 8 warps, 3 stages on Hopper (the fastest of the tiles
    bench/kernels.py compared on an H200); small tiles for tiny problems and the interpreter."""
    if interpreting() or Tq <= 32:
        return {"BLOCK_M": 16 if Tq <= 16 else 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_M": 128, "BLOCK_N": 128 if D <= 128 else 64, "num_warps": 8, "num_stages": 3}


def _launch(
    q, k_cache, v_cache, k_scale, v_scale, n_valid, sm_scale, qk_fp8, pv_fp8, wrap=lambda k: k, cfg=None
):
    """Launch the kernel; ``cfg`` overrides the fixed tiles (bench/kernels.py compares a few)."""
    H, Tq, D = q.shape
    out = torch.empty_like(q)
    cfg = cfg or _config(Tq, D)
    grid = (triton.cdiv(Tq, cfg["BLOCK_M"]), H)
    wrap(_fp8_attention_kernel)[grid](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        out,
        Tq,
        n_valid,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        D=D,
        QK_FP8=qk_fp8 and D >= 32,
        PV_FP8=pv_fp8,
        EXACT_ROUND=interpreting(),
        **cfg,
    )
    return out


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
    pv_fp8: bool = False,
) -> torch.Tensor:
    """Attention of q [H,Tq,D] bf16 over k/v [H,S,D] fp8 slots [0, n_valid) -> [H,Tq,D] bf16."""
    _check(q, k_cache, v_cache, k_scale, v_scale, n_valid)
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if torch.compiler.is_compiling():
        return torch.ops.livestep.fp8_attention(
            q, k_cache, v_cache, k_scale, v_scale, n_valid, sm, qk_fp8, pv_fp8
        )
    return _launch(q, k_cache, v_cache, k_scale, v_scale, n_valid, sm, qk_fp8, pv_fp8)


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
