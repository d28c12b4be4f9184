"""Flash attention of bf16 queries over the FP8 ring window (contract 6), with per-head K/V descales and
the precision of each of its two dots chosen per launch.

``fp8_attention(q, k_cache, v_cache, k_scale, v_scale, n_valid)`` -> [H,Tq,D] bf16: every query attends
to slots [0, n_valid) (no mask inside the window: RoPE carries position, ring order is irrelevant).
Online softmax in fp32. V is stored keys-contiguous (``v_layout``: storage [H,D,S_pad], slot stride 1,
the FP8 P@V MMA's K-major B operand; the worker's layout) or head_dim-contiguous (plain [H,S,D]).

Precision (``QK_MODES`` x ``PV_MODES``; each a constexpr of the one kernel; ``fp8_attention(qk=, pv=)``):
  QK^T  "fp8"    Q rounded per row to e4m3 (row amax / 448), one FP8 MMA against K as cached. e4m3 keeps 3
                 mantissa bits: ~2.5% rms error per Q element, so ~2.5% per logit's spread, which moves every
                 softmax weight by ~2.5% independently: ~2.6% output error on random data (issue 27).
        "split"  Q = (hi + lo / 16) * row_scale, hi and lo both e4m3 (lo = hi's rounding error x 16): two FP8
                 MMAs against K as cached (K stays in shared memory as loaded, no conversion); Q's error
                 ~2**-8 relative, bf16's order (2**-9).
        "bf16"   Q in bf16, K upconverted to bf16 in registers every tile (exact: e4m3 is a subset of bf16).
  P@V   "fp8"    P = exp2(s - m + 8) in [0, 256] (the 2**8 headroom keeps weights down to 2**-17 out of the
                 subnormals) rounded to e4m3, one FP8 MMA accumulating straight into the running output
                 (on sm_90 Triton's FP8 dot adds with the tensor core's reduced-precision accumulator:
                 ``max_num_imprecise_acc`` defaults to 2**30 there). ~2.5% rms error per weight; for
                 zero-mean V the output's relative error is the same ~2.5% (it is itself such a sum).
        "split"  P = hi + lo / 16 (both e4m3, as for Q): two FP8 MMAs into a fresh tile accumulator, added
                 to the fp32 output in registers (two-level accumulation, as SageAttention2's FP8 P@V).
                 **Interpreter only**: on the H200 (Triton 3.6, 2026-12-02) every launch of it returned
                 non-finite outputs, which the interpreter and its model do not; ``precision`` refuses it
                 on the GPU (``GPU_PV_MODES``) until that is understood. It was no faster than "bf16" there.
        "bf16"   P and V (upconverted in registers) in bf16.
  The row sum l is taken in fp32 from the unrounded P; out = acc * v_scale / l, rounded to bf16.
``DEFAULT`` = ("split", "bf16"): relative L2 error 2.6e-3 vs the fp64 truth on random data at the rank
shape (bf16 SDPA on the same inputs: 3.6e-3; the old ("fp8", "fp8"): 3.6e-2; both Q and P in e4m3 cost
~2.5% each), measured with ``bench/attention.py`` on the H200 (docs/PERFORMANCE.md, issue 27): 117.5 us
per call at 128x128 tiles, against 62.8 us for ("fp8", "fp8") and ~90 us for bf16 SDPA -- the precision
costs speed: no pair inside the quality band ran faster than SDPA (("split", "fp8"): 79.5 us, 2.6e-2).
``FAST`` = ("fp8", "fp8") is the operator's choice of speed over that band: the worker's
``attention_fp8_dots`` switch (a numeric switch, off in production, judged by ``livestep evaluate``).
Not done, on purpose: SageAttention's K smoothing (subtract K's mean over the keys) and FA3's Hadamard
rotation reduce the error of quantizing K in the kernel; here K was quantized once, at write time (its
cost, the FP8 cache's, measured at +0.1% model error), and Q's error against K's mean is a constant per
query row, which softmax ignores.

``TMA``: K/V tiles through host TensorDescriptors over slots [0, n_valid) (zero fill, no load masks).
Tried and dropped (slower on the H200 sweep, see docs/PERFORMANCE.md): split window (flash-decoding), half
tiles with a polynomial exp2 on the FMA pipes, warp specialisation, lazy rescaling.
``q_cos``/``q_sin`` (the step's RoPE tables): the queries are rotated as they load (``rope_q_ref``), so
the worker's separate query-RoPE pass is gone; ``out_scale`` (a static activation scale): the output is
stored as FP8 [Tq, H*D], the output projection's input, so its quantization pass is gone too.
head_dim < 32 always takes the bf16 QK path (FP8 MMA needs K >= 32). ``fp8_attention_ref`` is plain
torch in fp32/fp64 (the truth); ``fp8_attention_lowp_ref`` models each precision (the tests' error bound).
Over 450 lines: the kernel, its launch (TMA descriptors, the compile-safe op) and both references belong
to one contract and are read together.
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
QK_MODES = ("fp8", "split", "bf16")  # precision of Q @ K^T (module docstring)
PV_MODES = ("fp8", "split", "bf16")  # precision of P @ V
GPU_PV_MODES = ("fp8", "bf16")  # "split" P@V: non-finite outputs on the H200 (module docstring)
DEFAULT = ("split", "bf16")  # (qk, pv) the worker runs (fp8_attention's qk=None / pv=None)
FAST = ("fp8", "fp8")  # the all-FP8 pair: the worker's attention_fp8_dots switch (off in production)
LO_SHIFT = (
    16.0  # "split": lo = e4m3((x - hi) * 16): hi's rounding error (<= half an e4m3 step) x 16 stays < 448
)

# The launch choice on Hopper per V layout: bench/attention.py sweeps the variants and prints the winner as
# one such line; set it here. Keys: BLOCK_M x BLOCK_N tiles, num_warps, num_stages, TMA (K/V tiles through
# host TensorDescriptors). The precision is not here: ``DEFAULT``.
_TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
TUNED = {  # H200 sweep 2026-12-02 07:31 UTC (bench/attention.py) for DEFAULT: keys 128x128 w8 s3 with TMA
    # 117.5 us (64x128 w4 s3: 159.3 us); ("fp8", "fp8") ran best at 64x128 w4 s3 TMA (62.8 us); dims: the
    # old bf16-P@V default's tiles
    "keys": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "TMA": True},
    "dims": {**_TILES, "TMA": False},
}
# a pair whose sweep winner has other tiles than DEFAULT's, per V layout (the rest take ``TUNED``): FAST ran
# fastest at 64x128 w4 s3 TMA (62.8 us, the old default's launch) in the same H200 sweep
TUNED_PAIRS = {FAST: {"keys": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "TMA": True}}}

# (qk, pv) -> relative-error bound vs the fp64 truth on random data (tests and bench use it): ~1.5x the
# precision model's own error at the rank shape (tiny shapes sit below it too)
REL_ERR_BOUND = {
    ("fp8", "fp8"): 0.08, ("fp8", "split"): 0.06, ("fp8", "bf16"): 0.06,
    ("split", "fp8"): 0.06, ("split", "split"): 0.006, ("split", "bf16"): 0.008,
    ("bf16", "fp8"): 0.06, ("bf16", "split"): 0.006, ("bf16", "bf16"): 0.008,
}  # fmt: skip


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
def _split_e4m3(x, EXACT_ROUND: tl.constexpr):
    """fp32 x (|x| <= 448) -> (hi, lo) e4m3 with x ~ hi + lo / LO_SHIFT (error ~2**-8 |x|)."""
    if EXACT_ROUND:
        hi = to_fp8_saturating(x, EXACT_ROUND)
    else:
        hi = x.to(tl.float8e4nv)  # callers keep |x| <= 448 and finite: the hardware cast needs no clamp
    r = (x - hi.to(tl.float32)) * 16.0  # LO_SHIFT: <= half of 448's e4m3 step (16) x 16 = 256
    if EXACT_ROUND:
        lo = to_fp8_saturating(r, EXACT_ROUND)
    else:
        lo = r.to(tl.float8e4nv)
    return hi, lo


@triton.jit
def _attn_block(
    acc,
    l_i,
    m_i,
    q,
    q_lo,
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
    QK: tl.constexpr,
    PV: tl.constexpr,
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
    if QK == "bf16":
        k = _bf16_operand(k, EXACT_ROUND)
    kt = tl.trans(k)
    if QK == "split":  # (hi + lo / 16) @ K^T: lo's product first, hi's accumulated onto it
        qk = tl.dot(q, kt, tl.dot(q_lo, kt) * (1.0 / 16.0))
    else:
        qk = tl.dot(q, kt)  # [M, N] fp32 raw codes; row_c (> 0) folds all scales and log2(e)
    if MASKED:
        qk = tl.where(nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * row_c)
    if PV == "bf16":
        m_sub = m_new
    else:
        m_sub = m_new - 8.0  # p in [0, 256]: FP8 headroom (see module docstring)
    p = tl.math.exp2(qk * row_c[:, None] - m_sub[:, None])  # one FMA + exp2 per score
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _p_dot_v(acc * alpha[:, None], p, v, PV, EXACT_ROUND)
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
def _p_dot_v(acc, p, v, PV: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """acc + P @ V (p in [0, 256] unless PV is "bf16"): see the module docstring's P@V modes."""
    if PV == "fp8":
        if EXACT_ROUND:
            p8 = to_fp8_saturating(p, EXACT_ROUND)
        else:
            p8 = p.to(tl.float8e4nv)  # p in [0, 256], never NaN: the hardware cast needs no clamp
        acc = tl.dot(p8, v, acc)
    elif PV == "split":  # the tile's two products in a fresh accumulator, then one fp32 add (two-level)
        p_hi, p_lo = _split_e4m3(p, EXACT_ROUND)
        acc = acc + tl.dot(p_hi, v, tl.dot(p_lo, v) * (1.0 / 16.0))
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
    QK: tl.constexpr,  # "fp8" | "split" | "bf16" (QK_MODES)
    PV: tl.constexpr,  # "fp8" | "split" | "bf16" (PV_MODES)
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
    if QK == "bf16":
        q = _bf16_operand(q, EXACT_ROUND)
        q_lo = q
        row_c = tl.zeros([BLOCK_M], dtype=tl.float32) + c
    else:  # per-row e4m3: row amax / 448 (no extra pass, no host sync)
        qf = q.to(tl.float32)
        q_row_scale = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30) / 448.0  # [M]
        qs = tl.minimum(tl.maximum(qf / q_row_scale[:, None], -448.0), 448.0)
        if QK == "split":
            q, q_lo = _split_e4m3(qs, EXACT_ROUND)
        else:
            q = to_fp8_saturating(qs, EXACT_ROUND)
            q_lo = q
        row_c = q_row_scale * c
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
            acc, l_i, m_i, q, q_lo, row_c, k_base, v_base, tl.multiple_of(start, BLOCK_N), n_valid,
            stride_ks, stride_vs, stride_vd, offs_d, offs_n0,
            h32, False, QK, PV, V_KEYS, TMA, EXACT_ROUND,
        )  # fmt: skip
    if n_full < n_valid:
        acc, l_i, m_i = _attn_block(
            acc, l_i, m_i, q, q_lo, row_c, k_base, v_base, n_full, n_valid,
            stride_ks, stride_vs, stride_vd, offs_d, offs_n0,
            h32, True, QK, PV, V_KEYS, TMA, EXACT_ROUND,
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


def precision(qk: str | None = None, pv: str | None = None, model: bool = False) -> tuple[str, str]:
    """(qk, pv) with None taken from ``DEFAULT``; an unknown name lists the valid ones. The kernel on the
    GPU takes ``GPU_PV_MODES`` for pv; the interpreter and the precision model (``model``) every mode."""
    qk = DEFAULT[0] if qk is None else qk
    pv = DEFAULT[1] if pv is None else pv
    pv_modes = PV_MODES if (model or interpreting()) else GPU_PV_MODES
    assert qk in QK_MODES, f"qk {qk!r}; valid: {list(QK_MODES)}"
    assert pv in pv_modes, f"pv {pv!r}; valid here: {list(pv_modes)}"
    return qk, pv


def _tuned(v_cache: torch.Tensor, pair: tuple[str, str] = DEFAULT) -> dict:
    layout = "keys" if keys_contiguous(v_cache) else "dims"
    return TUNED_PAIRS.get(pair, {}).get(layout) or TUNED[layout]


def _config(Tq: int, D: int, v_cache: torch.Tensor | None = None, pair: tuple[str, str] = DEFAULT) -> dict:
    """Launch tiles (no autotuning): ``TUNED`` for V's layout on the GPU (the sweep's winner; a pair's own
    in ``TUNED_PAIRS``); small tiles for tiny problems and the interpreter."""
    if interpreting() or Tq <= 32:
        bm = 16 if Tq <= 16 else 32
        return {"BLOCK_M": bm, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "TMA": False}
    cfg = dict(TUNED["dims"] if v_cache is None else _tuned(v_cache, pair))
    if D > 128:
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 64)
    return cfg


def launch(
    q,
    k_cache,
    v_cache,
    k_scale,
    v_scale,
    n_valid,
    sm_scale=None,
    qk=None,
    pv=None,
    wrap=lambda k: k,
    cfg=None,
    q_cos=None,
    q_sin=None,
    out_scale=None,
):
    """The kernel's launch (eager; ``fp8_attention`` is the entry point): ``cfg`` overrides the tiles
    (bench/attention.py sweeps them, tests pin them), ``qk``/``pv`` the precision (None: ``DEFAULT``)."""
    qk, pv = precision(qk, pv)
    H, Tq, D = q.shape
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(D)
    if out_scale is None:
        out = torch.empty_like(q)
    else:  # token-major FP8 [Tq, H*D], viewed [H, Tq, D] for the kernel's strides
        out = torch.empty(Tq, H * D, dtype=FP8_DTYPE, device=q.device).view(Tq, H, D).transpose(0, 1)
    cfg = dict(cfg or _config(Tq, D, v_cache, (qk, pv)))
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
        sm * LOG2E,
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
        QK=qk if D >= 32 else "bf16",
        PV=pv,
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
    qk: str,
    pv: str,
    q_cos: torch.Tensor | None = None,
    q_sin: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return launch(
        q, k_cache, v_cache, k_scale, v_scale, n_valid, sm_scale, qk, pv,
        wrap=torch.library.wrap_triton, q_cos=q_cos, q_sin=q_sin, out_scale=out_scale,
    )  # fmt: skip


def fp8_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    n_valid: int,
    sm_scale: float | None = None,
    qk: str | None = None,
    pv: str | None = None,
    q_cos: torch.Tensor | None = None,
    q_sin: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [H,Tq,D] bf16 over k/v [H,S,D] fp8 slots [0, n_valid) -> [H,Tq,D] bf16.

    v may be head_dim-contiguous or keys-contiguous (``v_layout``); ``qk``/``pv``: the precision of each
    dot (``QK_MODES``, ``PV_MODES``; None: ``DEFAULT``). ``q_cos``, ``q_sin`` [Tq, D] fp32 (the tables of
    ``rope_q_ref``): the queries are rotated in the kernel as they load (same values as attending with
    ``rope_q_ref(q, q_cos, q_sin)``, one pass less). ``out_scale`` (fp32 [], a static activation scale):
    the output is instead FP8 [Tq, H*D] token-major, clamp(o / out_scale, +-448) -- the output
    projection's GEMM input, no quantization pass after."""
    _check(q, k_cache, v_cache, k_scale, v_scale, n_valid)
    _check_rope_tables(q, q_cos, q_sin)
    assert out_scale is None or (out_scale.shape == () and out_scale.dtype == torch.float32), (
        f"out_scale: {None if out_scale is None else (tuple(out_scale.shape), out_scale.dtype)}; valid: fp32 []"
    )
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qk, pv = precision(qk, pv)
    if torch.compiler.is_compiling():
        return torch.ops.livestep.fp8_attention(
            q, k_cache, v_cache, k_scale, v_scale, n_valid, sm, qk, pv, q_cos, q_sin, out_scale
        )
    return launch(q, k_cache, v_cache, k_scale, v_scale, n_valid, sm, qk, pv, q_cos=q_cos, q_sin=q_sin,
                  out_scale=out_scale)  # fmt: skip


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


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, -FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(x.dtype)


def split_e4m3_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's "split": x (|x| <= 448) -> (hi, lo) on the e4m3 grid, x ~ hi + lo / LO_SHIFT."""
    hi = _e4m3(x)
    return hi, _e4m3((x - hi) * LO_SHIFT)


def _rounded(x: torch.Tensor, mode: str) -> torch.Tensor:
    """x (|x| <= 448) as the kernel feeds it to a dot in ``mode``: e4m3, hi + lo / 16, or bf16."""
    if mode == "fp8":
        return _e4m3(x)
    if mode == "split":
        hi, lo = split_e4m3_ref(x)
        return hi + lo / LO_SHIFT
    return x.to(torch.bfloat16).to(x.dtype)


def fp8_attention_lowp_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    n_valid: int,
    sm_scale: float | None = None,
    qk: str | None = None,
    pv: str | None = None,
    compute_dtype=torch.float32,
) -> torch.Tensor:
    """The kernel's precision model in torch (FA3's ``intermediate_dtype`` reference): Q per row and P as
    the kernel rounds them for ``qk``/``pv`` (None: ``DEFAULT``), products and sums in ``compute_dtype``,
    the row sum from the unrounded P, bf16 out. Tests bound the kernel's error against the fp64 truth by
    this reference's own error (err <= 2 * err_ref + atol)."""
    qk, pv = precision(qk, pv, model=True)
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qf = q.to(compute_dtype)
    if qk != "bf16" and q.shape[-1] >= 32:
        row = qf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
        qf = _rounded(torch.clamp(qf / row, -FP8_MAX, FP8_MAX), qk) * row
    k = dequantize_fp8(k_cache[:, :n_valid], k_scale, compute_dtype)
    v = v_cache[:, :n_valid].to(compute_dtype)
    s = (qf @ k.transpose(-1, -2)) * sm
    p = torch.exp(s - s.amax(-1, keepdim=True))
    if pv != "bf16":
        p = p * 256.0  # the kernel's FP8 headroom (2**8): part of where P rounds
    l = p.sum(-1, keepdim=True)
    return ((_rounded(p, pv) @ v) * v_scale.reshape(-1, 1, 1).to(compute_dtype) / l).to(torch.bfloat16)
