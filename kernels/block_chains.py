"""One-pass Triton kernels for the DiT block's elementwise chains around its FP8 GEMMs (per-row scales).

    hq, hs = ln_quant_rows(x, w, b)                 # LayerNorm (modulated by w, b or plain) -> FP8
    x, hq, hs = res_ln_quant_rows(x, g, y, w, b)    # x + g*y (or x + y), its LayerNorm -> FP8
    uq, us = gelu_quant_rows(u)                     # tanh GELU -> FP8
    oq, os_ = quant_rows(o)                         # FP8 of a row (= worker.fp8.quantize_act_rows)

x, y, u, o: bf16 [M, K]; g, w, b: bf16 [K] or None. Each returns FP8 e4m3 [M, K] and fp32 scales [M, 1]
(amax/448 per row). One program holds whole rows in registers (BLOCK = next_power_of_2(K)): every input
row is read from HBM once and every output written once; the math is fp32 with the bf16 roundings of
the torch chain (``worker.model._chains(quantize_act_rows)``) at the same places: the residual (also an
output), the LayerNorm / GELU output. ``*_ref`` are the same chains in plain torch. ``cfg=`` overrides
the launch ({"ROWS": rows per program, "num_warps": n}) for bench/chains.py's sweep. Works eagerly, under
``torch.compile`` (``torch.library.triton_op``), in CUDA graphs, and on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.rope import FP8_DTYPE, FP8_MAX, interpreting, to_bf16, to_fp8_saturating

LN_EPS = 1e-5  # F.layer_norm's default, what the worker's chains use
AMAX_FLOOR = 1e-12  # worker.fp8.quantize_act_rows: an all-zero row gets scale 1e-12/448 and q = 0
MAX_K = 32768  # a row must fit one program's registers


@triton.jit
def _gelu_tanh(x, INTERPRETER: tl.constexpr):
    """torch's tanh GELU in its own order: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))).

    On the GPU tanh is libdevice's tanhf, what eager torch and inductor call. The interpreter has no
    libdevice: tanh(|z|) = 1 - 2 / (exp(2|z|) + 1) there, sign restored (about an fp32 ulp off)."""
    inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
    if INTERPRETER:
        t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.abs(inner), 20.0)) + 1.0)  # tanh(|z|); 1.0 from 20 on
        t = tl.where(inner < 0, -t, t)
    else:
        t = libdevice.tanh(inner)
    return 0.5 * x * (1.0 + t)


@triton.jit
def _signed(r, y, EXACT_ROUND: tl.constexpr):
    """r = a rounding of y (bf16 or FP8) with y's sign bit. The interpreter's pre-rounding ((y + c) - c,
    kernels/rope.py) turns -0 and negatives that round to 0 into +0 (the GPU's casts keep -0, as torch's):
    there the sign bit is set back on the exact (on-grid) value, whose cast is then exact."""
    if EXACT_ROUND:
        rf = r.to(tl.float32)
        r = tl.where(y.to(tl.int32, bitcast=True) < 0, -tl.abs(rf), rf).to(r.dtype)
    return r


@triton.jit
def _rows_kernel(
    X,
    G,
    Y,
    W,
    B,  # x [M,K]; g [K]; y [M,K]; w, b [K] (unused ones: any pointer)
    XOUT,
    Q,
    SCALE,  # x + g*y bf16 [M,K] (RESIDUAL only); FP8 [M,K]; fp32 [M]
    M,
    K,
    stride_x,
    stride_y,
    eps,
    RESIDUAL: tl.constexpr,  # 0: none, 1: x + y, 2: x + g*y
    LN: tl.constexpr,
    AFFINE: tl.constexpr,  # LN with weight w and bias b
    GELU: tl.constexpr,
    EXACT_ROUND: tl.constexpr,  # the interpreter: pre-rounded casts, tanh without libdevice
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    rmask = rows < M
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    h = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [ROWS, BLOCK]
    if RESIDUAL > 0:
        y = tl.load(Y + r64 * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL == 2:
            g = tl.load(G + cols, mask=cmask, other=0.0).to(tl.float32)
            h = h + g[None, :] * y  # g*y of two bf16 is exact in fp32: one rounding, as addcmul
        else:
            h = h + y
        # the residual is a bf16 tensor in torch: its LayerNorm reads the rounded values
        hb = _signed(to_bf16(h, EXACT_ROUND), h, EXACT_ROUND)
        tl.store(XOUT + r64 * K + cols[None, :], hb, mask=mask)
        h = hb.to(tl.float32)
    if LN:
        mean = tl.sum(h, axis=1) / K
        d = tl.where(mask, h - mean[:, None], 0.0)
        rstd = tl.math.rsqrt(tl.sum(d * d, axis=1) / K + eps)
        h = d * rstd[:, None]
        if AFFINE:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
            b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
            h = h * w[None, :] + b[None, :]
        h = _signed(to_bf16(h, EXACT_ROUND), h, EXACT_ROUND).to(tl.float32)  # F.layer_norm returns bf16
    if GELU:
        h = _gelu_tanh(h, EXACT_ROUND)
        h = _signed(to_bf16(h, EXACT_ROUND), h, EXACT_ROUND).to(tl.float32)  # F.gelu returns bf16
    # padded columns hold 0 in every branch (loads, d and w, b are 0 there; gelu(0) = 0)
    amax = tl.max(tl.abs(h), axis=1)
    scale = tl.maximum(amax, 1e-12) * (1.0 / 448.0)
    v = tl.math.div_rn(h, scale[:, None])  # IEEE division, as torch's (Triton's `/` is approximate)
    q = _signed(to_fp8_saturating(v, EXACT_ROUND), v, EXACT_ROUND)
    tl.store(Q + r64 * K + cols[None, :], q, mask=mask)
    tl.store(SCALE + rows, scale, mask=rmask)


def _config(M: int, K: int) -> dict:
    """Fixed launch: one row per program, warps by row length (~16-32 fp32 values per thread and tensor).

    Prod rows: K = 7680 (BLOCK 8192) and 10240 (16384) -> 16 warps; 2560 (4096) -> 8 warps."""
    block = triton.next_power_of_2(K)
    if interpreting():
        return {"ROWS": 2, "num_warps": 4}
    return {"ROWS": 1, "num_warps": 16 if block >= 8192 else 8 if block >= 2048 else 4}


def _check_rows(name: str, t: torch.Tensor, M: int | None = None, K: int | None = None) -> None:
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name}: dtype {t.dtype}, valid: torch.bfloat16")
    if t.dim() != 2:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, valid: [M, K]")
    if M is not None and tuple(t.shape) != (M, K):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, valid: {(M, K)} (x's)")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: strides {t.stride()}: the last dim must be contiguous")
    if not 1 <= t.shape[1] <= MAX_K:
        raise ValueError(f"{name}: row length {t.shape[1]}, valid: 1..{MAX_K}")


def _check_vec(name: str, t: torch.Tensor | None, x: torch.Tensor) -> None:
    if t is None:
        return
    K = x.shape[1]
    if t.dtype != torch.bfloat16 or tuple(t.shape) != (K,) or not t.is_contiguous():
        raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)}, valid: contiguous torch.bfloat16 [{K}] or None")
    if t.device != x.device:
        raise ValueError(f"{name}: device {t.device}, valid: x's device {x.device}")


def _check_affine(w, b, x) -> None:
    if (w is None) != (b is None):
        raise ValueError("w and b: both given (modulated LayerNorm) or both None (plain LayerNorm)")
    _check_vec("w", w, x)
    _check_vec("b", b, x)


def _launch(x, g, y, w, b, residual: bool, ln: bool, gelu: bool, rows: int = 0, num_warps: int = 0,
            wrap=lambda k: k, outs=None):
    """Allocate the outputs (or take ``outs`` = (x_new or None, q, scale), the tests' poisoned buffers) and
    launch ``_rows_kernel``; rows/num_warps 0 = ``_config``'s choice. Returns (x_new or None, q, scale)."""
    M, K = x.shape
    cfg = _config(M, K)
    cfg = {"ROWS": rows or cfg["ROWS"], "num_warps": num_warps or cfg["num_warps"]}
    if outs is None:
        x_new = torch.empty((M, K), dtype=x.dtype, device=x.device) if residual else None
        q = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    else:
        x_new, q, scale = outs
    if M == 0:
        return x_new, q, scale
    mode = (2 if g is not None else 1) if residual else 0
    wrap(_rows_kernel)[(triton.cdiv(M, cfg["ROWS"]),)](
        x,
        g if g is not None else x,
        y if y is not None else x,
        w if w is not None else x,
        b if b is not None else x,
        x_new if x_new is not None else q,
        q,
        scale,
        M,
        K,
        x.stride(0),
        (y if y is not None else x).stride(0),
        LN_EPS,
        RESIDUAL=mode,
        LN=ln,
        AFFINE=w is not None,
        GELU=gelu,
        EXACT_ROUND=interpreting(),
        BLOCK=triton.next_power_of_2(K),
        **cfg,
    )
    return x_new, q, scale


@torch.library.triton_op("livestep::rows_quant", mutates_args=())
def _rows_quant_op(
    x: torch.Tensor,
    w: torch.Tensor | None,
    b: torch.Tensor | None,
    ln: bool,
    gelu: bool,
    rows: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    _, q, scale = _launch(x, None, None, w, b, False, ln, gelu, rows, num_warps, wrap=torch.library.wrap_triton)
    return q, scale


@torch.library.triton_op("livestep::res_ln_quant_rows", mutates_args=())
def _res_ln_quant_op(
    x: torch.Tensor,
    g: torch.Tensor | None,
    y: torch.Tensor,
    w: torch.Tensor | None,
    b: torch.Tensor | None,
    rows: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch(x, g, y, w, b, True, True, False, rows, num_warps, wrap=torch.library.wrap_triton)


def _cfg_args(cfg: dict | None) -> tuple[int, int]:
    cfg = cfg or {}
    unknown = set(cfg) - {"ROWS", "num_warps"}
    if unknown:
        raise ValueError(f"cfg keys {sorted(unknown)}; valid: ['ROWS', 'num_warps']")
    return int(cfg.get("ROWS", 0)), int(cfg.get("num_warps", 0))


def _rows_quant(x, w, b, ln: bool, gelu: bool, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rows("x", x)
    _check_affine(w, b, x)
    rows, warps = _cfg_args(cfg)
    if torch.compiler.is_compiling():
        return torch.ops.livestep.rows_quant(x, w, b, ln, gelu, rows, warps)
    _, q, scale = _launch(x, None, None, w, b, False, ln, gelu, rows, warps)
    return q, scale


def ln_quant_rows(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
                  cfg: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of x [M, K] (times w plus b when given), then per-row FP8: (h_fp8 [M, K], scale [M, 1])."""
    return _rows_quant(x, w, b, True, False, cfg)


def gelu_quant_rows(u: torch.Tensor, cfg: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh GELU of u [M, K], then per-row FP8: (fp8 [M, K], scale [M, 1])."""
    return _rows_quant(u, None, None, False, True, cfg)


def quant_rows(x: torch.Tensor, cfg: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 of x [M, K]: (fp8 [M, K], scale [M, 1]); ``worker.fp8.quantize_act_rows`` in one pass."""
    return _rows_quant(x, None, None, False, False, cfg)


def res_ln_quant_rows(x: torch.Tensor, g: torch.Tensor | None, y: torch.Tensor, w: torch.Tensor | None,
                      b: torch.Tensor | None, cfg: dict | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_new = x + g*y (g [K]) or x + y, bf16; then LayerNorm(x_new) (times w plus b when given) and
    per-row FP8: (x_new [M, K], h_fp8 [M, K], scale [M, 1])."""
    _check_rows("x", x)
    _check_rows("y", y, *x.shape)
    if y.device != x.device:
        raise ValueError(f"y: device {y.device}, valid: x's device {x.device}")
    _check_vec("g", g, x)
    _check_affine(w, b, x)
    rows, warps = _cfg_args(cfg)
    if torch.compiler.is_compiling():
        return torch.ops.livestep.res_ln_quant_rows(x, g, y, w, b, rows, warps)
    return _launch(x, g, y, w, b, True, True, False, rows, warps)


def quant_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch ``quant_rows``: fp32 row amax, scale = max(amax, 1e-12) / 448, (x / scale) -> e4m3."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp_min(AMAX_FLOOR) * (1.0 / FP8_MAX)
    return (x / scale).to(FP8_DTYPE), scale


def ln_quant_rows_ref(x, w, b) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_rows_ref(F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS))


def res_ln_quant_rows_ref(x, g, y, w, b) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.addcmul(x, g, y) if g is not None else x + y
    return (x, *ln_quant_rows_ref(x, w, b))


def gelu_quant_rows_ref(u) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_rows_ref(F.gelu(u, approximate="tanh"))
