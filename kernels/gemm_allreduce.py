"""FP8 GEMM fused with the tensor-parallel all-reduce over plain peer-to-peer symmetric memory.

    ws = symmetric_workspace(group, m, n)                        # one per steady shape (worker/buffers.py)
    out = fused_gemm_allreduce(ws, a_fp8, w_fp8.t(), a_scale, w_scale)   # bf16 [M, N], summed over group
    ref = gemm_allreduce_ref(a_fp8, w_fp8.t(), a_scale, w_scale, group)

Each rank computes its partial ``(a @ b) * scales`` tile by tile (Triton, e4m3 operands, fp32
accumulate). With a TP group, as each output tile completes the GEMM kernel stores it (bf16) into the
slot ``[parity, rank]`` of every rank's symmetric buffer with plain peer-to-peer stores, then raises
the tile's flag ``[parity, rank, tile]`` on every rank (release, system scope). A second short kernel
(`_tile_reduce_kernel`) waits until all ``world`` flags of a tile carry the call's epoch (acquire)
and sums the partials in fp32: each rank owns its whole output, so no broadcast phase is needed and
any world size works, odd ones included. No multicast object is ever created: symmetric memory is
set up with ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` (NVLS stays off). The epoch lives in device memory
(bumped by a tiny torch op after each call), so the path holds no host state per call and no sync.

Which calls take the fused path is decided by the worker's bounded ``BufferRegistry``
(worker/buffers.py; ``worker.parallel.gemm_allreduce`` for raw operands). World size 1 is a plain
FP8 GEMM (`fp8_gemm`). A `TileConfig` picks the classic kernel (one program per tile, pointer loads)
or the variant kernel (persistent, stream-K, TMA loads, `occupancy` CTAs per SM); `tune` times the
candidates per steady shape, the fused path keeps `FUSED_CONFIG`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

try:  # Gluon (Triton >= 3.5): explicit wgmma waits, for the overlapped-promotion kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.language.nvidia.hopper import tma as gl_tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    # the TMA load is `async_copy_global_to_shared` in Triton 3.5/3.6, `async_load` later
    _gl_tma_load = getattr(gl_tma, "async_load", None) or gl_tma.async_copy_global_to_shared
except Exception:  # noqa: BLE001 -- no (or another) Gluon: the gluon configs report unavailable
    gluon = None

FP8 = torch.float8_e4m3fn
log = logging.getLogger("livestep.kernels.gemm_allreduce")


class GemmAllReduceError(ValueError):
    """Bad operands or registry use; the message lists what is valid."""


# ----------------------------------------------------------------------------------------------------
# Tile configs. Chosen per (M, N, K) by `pick_config`; bench/gemm_allreduce.py sweeps CONFIGS on the
# H200 and prints the rate of each, so the table below is the measured winner at the rank shapes.


@dataclass(frozen=True)
class TileConfig:
    """One tiling and main-loop variant (every variant computes the same product; see ACCUMULATION).

    persistent: grid = the SM count, each program loops over output tiles (grouped order);
    stream_k: persistent, and the (tile, K-block) iteration space is cut evenly between programs, a
    tile split between two programs is summed through a small fp32 workspace (no wave tail);
    tma: operands loaded through host-side TMA tensor descriptors (K-major operands only; other
    layouts fall back to pointer loads); flatten: ``tl.range(flatten=True)`` over the persistent
    tile loop (prefetch across tiles); acc: how fp32 promotion is done (ACCUMULATION); occupancy:
    persistent programs per SM (2: two CTAs share an SM, so one's fp32 promotion adds overlap the
    other's tensor-core work; needs tiles small enough for two, e.g. 64x128 on 4 warps).
    gluon: the Gluon kernel (GPU only, K-major operands, no push epilogue): one program per tile, TMA
    ring, and with promotion two partial accumulators in turn so each K-block's fp32 add overlaps the
    next block's wgmma (`acc` is ignored: promotion every BLOCK_K products, as "flag").
    The classic kernel runs unless persistent, stream_k, tma or gluon is set.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    persistent: bool = False
    stream_k: bool = False
    tma: bool = False
    flatten: bool = False
    acc: str = "flag"
    occupancy: int = 1
    gluon: bool = False

    @property
    def classic(self) -> bool:
        return not (self.persistent or self.stream_k or self.tma or self.gluon)

    def label(self) -> str:
        kind = "gluon" if self.gluon else "sk" if self.stream_k else "pers" if self.persistent else "tile"
        acc = "overlap" if self.gluon else self.acc
        extra = "".join(f" {f}" for f in ("tma", "flatten") if getattr(self, f))
        extra += f" x{self.occupancy}" if self.occupancy != 1 else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} "
            f"{kind}{extra} {acc}"
        )


# ACCUMULATION (the default, fp32-promoted path; ``fast_accum=True`` ignores `acc` and lets the FP8
# tensor cores accumulate the whole K in their own reduced-precision accumulator, as
# ``_scaled_mm(use_fast_accum=True)``). In every `acc` mode a partial sum of BLOCK_K products is
# formed in the tensor-core accumulator (starting from zero) and then added into the fp32
# accumulator, so the promotion interval is exactly BLOCK_K products:
#   "flag": ``tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)`` (the compiler's partial accumulator);
#   "add":  ``acc += tl.dot(a, b)`` (an explicit zero-initialised dot, then an fp32 add);
#   "lag":  as "add", but the add of block i is issued after the dot of block i+1 (same sums, same
#           order of fp32 additions as "add": identical results; only the schedule differs).
# BLOCK_K = 128 matches cuBLAS/CUTLASS's default FP8 promotion (every 4 wgmma k-groups of 32 = 128
# products, ``use_fast_accum=False``); BLOCK_K = 64 promotes more often (more precise than cuBLAS);
# BLOCK_K = 256 promotes every 256 products (less precise than cuBLAS: not its default).
ACC_MODES = {"flag": 0, "add": 1, "lag": 2}


# candidates: the best of a first H200 sweep at M=757 (10 configs; 128x256x64, 64x128, 128x64 and
# 64x256 w8 never won); `tune` picks among them per steady shape
CLASSIC_CONFIGS: tuple[TileConfig, ...] = (
    TileConfig(128, 128, 128, 8, 8, 4),
    TileConfig(128, 128, 128, 8, 4, 5),
    TileConfig(128, 128, 128, 8, 8, 3),
    TileConfig(256, 128, 128, 8, 8, 3),
    TileConfig(64, 256, 128, 8, 4, 4),
    TileConfig(128, 256, 128, 8, 8, 3),
)
# Variants: bench/gemm_allreduce.py --sweep compares them all at the rank shapes (the 12:45 H200 sweep
# picked TUNE_CONFIGS below from them). Two costs are targeted (register/smem figures
# are ptxas -v for sm_90a with Triton 3.6):
#  - promotion: with fp32 promotion ptxas must wait for each K-block's wgmma before the fp32 adds
#    (its C7517 "warpgroup.wait injected"), so the tensor cores idle during the adds unless another
#    CTA on the SM fills the gap: 128x128 on 4 warps (255 regs, 96 KiB smem) and 64x128 on 4 warps
#    (~165 regs) fit two (three with 3 stages) CTAs per SM; 128x128 on 8 warps (158 regs) fits one.
#  - the wave tail at M=757 (6 row tiles of 128: 360 / 180 tiles on 132 SMs = 2.73 / 1.36 waves):
#    persistent and stream-K grids. 128x256 stream-K spills (> 255 regs) and is left out.
VARIANT_CONFIGS: tuple[TileConfig, ...] = (
    # two or three CTAs per SM (promotion overlapped by the other CTA)
    TileConfig(128, 128, 128, 8, 4, 3),
    TileConfig(128, 128, 128, 8, 4, 3, tma=True),
    TileConfig(128, 128, 128, 8, 4, 3, persistent=True, tma=True, occupancy=2),
    TileConfig(64, 128, 128, 16, 4, 4),
    TileConfig(64, 128, 128, 16, 4, 4, tma=True),
    TileConfig(64, 128, 128, 16, 4, 3, tma=True),
    TileConfig(64, 128, 128, 16, 4, 4, persistent=True, tma=True, occupancy=2),
    TileConfig(64, 128, 128, 16, 4, 3, persistent=True, tma=True, occupancy=3),
    TileConfig(64, 128, 128, 16, 4, 4, stream_k=True, tma=True, occupancy=2),
    # one CTA per SM: TMA, persistent, stream-K
    TileConfig(128, 128, 128, 8, 8, 4, tma=True),
    TileConfig(128, 128, 128, 8, 8, 4, persistent=True, tma=True),
    TileConfig(128, 128, 128, 8, 8, 4, persistent=True, tma=True, flatten=True),
    TileConfig(128, 128, 128, 8, 8, 4, stream_k=True),
    TileConfig(128, 128, 128, 8, 8, 4, stream_k=True, tma=True),
    TileConfig(128, 256, 128, 8, 8, 3, tma=True),
    TileConfig(128, 256, 128, 8, 8, 3, persistent=True, tma=True),
    # fast accumulation fits two of these per SM (127 regs); with promotion one (155)
    TileConfig(128, 128, 128, 8, 8, 3, tma=True),
    TileConfig(128, 128, 128, 8, 8, 3, persistent=True, tma=True, occupancy=2),
    # promotion written as an explicit add (see ACCUMULATION)
    TileConfig(128, 128, 128, 8, 8, 4, acc="add"),
    TileConfig(128, 128, 128, 8, 8, 4, tma=True, acc="add"),
    TileConfig(64, 128, 128, 16, 4, 4, tma=True, acc="add"),
    TileConfig(128, 128, 128, 8, 8, 4, stream_k=True, tma=True, acc="lag"),
    # Gluon, promotion overlapped with the wgmma inside the CTA (no C7514/C7517 serialization; 205
    # regs: 64x128 on 4 warps fits two CTAs per SM). 128x256 spills with promotion: fast only.
    TileConfig(64, 128, 128, 16, 4, 4, gluon=True),
    TileConfig(64, 128, 128, 16, 4, 3, gluon=True),
    TileConfig(128, 128, 128, 8, 8, 4, gluon=True),
    TileConfig(128, 128, 128, 8, 8, 3, gluon=True),
    TileConfig(128, 256, 128, 8, 8, 3, gluon=True),
)
CONFIGS: tuple[TileConfig, ...] = CLASSIC_CONFIGS + VARIANT_CONFIGS
# What `tune` tries at warm-up: the winners of the H200 sweep (2026-11-29 12:45 UTC, `bench/gemm_allreduce.py
# --sweep`, M=757, every config checked against the reference first; docs/PERFORMANCE.md), so warm-up
# times 7 configs per shape, not 33. Fp32-promoted accumulation: Gluon 128x128 w8 s4 won QKV, FFN up and
# FFN down (0.956 / 0.931 / 0.936 of _scaled_mm), the persistent 64x128 TMA grid of 3 CTAs per SM
# attention-out (0.998). Fast accumulation: the persistent 128x128 TMA grids and 128x256 for FFN up.
# The Gluon configs passed the sweep's hang-guarded child check on all four shapes before joining.
TUNE_CONFIGS: tuple[TileConfig, ...] = (
    TileConfig(128, 128, 128, 8, 8, 4, gluon=True),
    TileConfig(64, 128, 128, 16, 4, 3, persistent=True, tma=True, occupancy=3),
    TileConfig(64, 128, 128, 16, 4, 3, tma=True),
    TileConfig(128, 128, 128, 8, 8, 4, persistent=True, tma=True, flatten=True),
    TileConfig(128, 128, 128, 8, 8, 4, persistent=True, tma=True),
    TileConfig(128, 256, 128, 8, 8, 3, persistent=True, tma=True),
    CLASSIC_CONFIGS[0],
)
# The fused path always uses this tiling: every rank must cut the output into the same tiles (the
# flags are per tile), and a per-rank `tune` could disagree. Of the configs with the push epilogue
# (not Gluon), 64x128 with TMA loads and 3 stages was the fastest over both row-parallel shapes in
# the sweep above (attn-out 0.967, FFN down 0.873 of _scaled_mm; the classic 128x128: 0.686, 0.735).
FUSED_CONFIG = TileConfig(64, 128, 128, 16, 4, 3, tma=True)
# (M, N, K, fast_accum) -> the config `tune` measured fastest on this GPU (plain GEMMs only)
TUNED: dict[tuple[int, int, int, bool], TileConfig] = {}
# the same key -> [(config, ms per call under CUDA graphs)] of every candidate `tune` timed
TUNE_LOG: dict[tuple[int, int, int, bool], list[tuple[TileConfig, float]]] = {}
# the smallest tile any config uses: flags are sized for it so one buffer serves every config
_MIN_TILE = 64


def pick_config(m: int, n: int, k: int, fast_accum: bool = False) -> TileConfig:
    """The tile config for an (M, N, K) problem: the tuned one where known, else a safe default."""
    return TUNED.get((m, n, k, fast_accum), CONFIGS[0])


def tune(m: int, n: int, k: int, fast_accum: bool = False, device="cuda",
         candidates: tuple[TileConfig, ...] | None = None) -> TileConfig:  # fmt: skip
    """Time every candidate config (default TUNE_CONFIGS) at (M, N, K) under CUDA graphs and keep the
    fastest for `pick_config`. A candidate that fails to compile/launch or gives a wrong result is
    skipped. Call at warm-up for the steady-state shapes (it synchronises), never per step."""
    key = (m, n, k, fast_accum)
    if key in TUNED:
        return TUNED[key]
    a = torch.randn(m, k, device=device).to(FP8)
    w = torch.randn(n, k, device=device).to(FP8)
    one = torch.ones((), device=device)
    ref = gemm_allreduce_ref(a, w.t(), one, one).float()
    tol = 2.0**-6 * ref.abs().max().item()
    best, best_t = CONFIGS[0], float("inf")
    tlog = TUNE_LOG.setdefault(key, [])
    for cfg in candidates or TUNE_CONFIGS:
        try:
            out = fp8_gemm(a, w.t(), one, one, config=cfg, fast_accum=fast_accum)
            if not (out.float() - ref).abs().max().item() <= tol:
                log.warning("tune: %s gives a wrong result at %s: skipped", cfg, key)
                continue
            t = triton.testing.do_bench_cudagraph(
                lambda cfg=cfg: fp8_gemm(a, w.t(), one, one, config=cfg, fast_accum=fast_accum), rep=20
            )
        except Exception as e:  # noqa: BLE001 -- does not compile / fit on this GPU: not a candidate
            log.info("tune: %s unavailable at %s (%s)", cfg, key, type(e).__name__)
            continue
        tlog.append((cfg, t))
        if t < best_t:
            best, best_t = cfg, t
    TUNED[key] = best
    return best


# ----------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering (L2 reuse): program id -> (pid_m, pid_n, row-major tile id)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    return pid_m, pid_n, pid_m * num_pid_n + pid_n


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr,
    slot_ptrs, flag_ptrs, epoch_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    rank, max_tiles,
    A_ROWWISE: tl.constexpr, B_COLWISE: tl.constexpr,
    PUSH: tl.constexpr, WORLD: tl.constexpr, EVEN_K: tl.constexpr, MAX_IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACC: tl.constexpr = 0,
):  # fmt: skip
    # a: [M, K] e4m3; b: [K, N] e4m3 (any strides; K-major is fastest); c: [M, N] bf16 (when not PUSH)
    pid = tl.program_id(0)
    pid_m, pid_n, tile = _tile_coords(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # one tile, every K-block, pointer loads: the shared loop (MAX_IMPRECISE=BLOCK_K promotes the FP8
    # tensor-core sums to fp32 every BLOCK_K products, as cuBLAS does by default; ACC: see ACCUMULATION)
    acc = _k_loop(a_ptr, b_ptr, a_ptr, b_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, tl.cdiv(K, BLOCK_K), M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, False, EVEN_K, ACC, MAX_IMPRECISE,
                  BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    _epilogue(acc, pid_m, pid_n, tile, c_ptr, a_scale_ptr, b_scale_ptr, slot_ptrs, flag_ptrs, epoch_ptr,
              M, N, stride_cm, stride_cn, rank, max_tiles, A_ROWWISE, B_COLWISE, PUSH, WORLD,
              BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _push_tile(c, mask, offs_m, offs_n, tile, slot_ptrs, flag_ptrs, epoch_ptr, M, N, rank, max_tiles,
               WORLD: tl.constexpr):  # fmt: skip
    """Store one finished partial tile into slot [parity, rank] of every rank, then raise its flags.

    Slots on each rank: bf16 [2, WORLD, M, N]; flags: int64 [2, WORLD, max_tiles]; `slot_ptrs` and
    `flag_ptrs` hold each rank's base address (peer-mapped), `epoch_ptr` this rank's call counter.
    """
    epoch = tl.load(epoch_ptr)
    parity = epoch % 2
    slot_off = (parity * WORLD + rank) * M * N
    offs = slot_off + offs_m[:, None] * N + offs_n[None, :]
    for r in tl.static_range(WORLD):
        dst = tl.load(slot_ptrs + r).to(tl.pointer_type(tl.bfloat16))
        tl.store(dst + offs, c, mask=mask)
    tl.debug_barrier()  # every thread's stores of this tile precede the flag (release below)
    flag_off = (parity * WORLD + rank) * max_tiles + tile
    for r in tl.static_range(WORLD):
        flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(flags + flag_off, epoch, sem="release", scope="sys")


@triton.jit
def _k_loop(a_ptr, b_ptr, a_desc, b_desc, off_m, off_n, k_lo, k_hi, M, N, K,
            stride_am, stride_ak, stride_bk, stride_bn,
            TMA: tl.constexpr, EVEN_K: tl.constexpr, ACC: tl.constexpr, MAX_IMPRECISE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """fp32 sum over K-blocks [k_lo, k_hi) of one output tile (rows off_m.., cols off_n..)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    if not TMA:
        # rows/cols past the edge wrap around (loads stay in bounds without masks)
        offs_am = (off_m + tl.arange(0, BLOCK_M)) % M
        offs_bn = (off_n + tl.arange(0, BLOCK_N)) % N
        a_ptrs = a_ptr + offs_am[:, None] * stride_am + (k_lo * BLOCK_K + offs_k)[None, :] * stride_ak
        b_ptrs = b_ptr + (k_lo * BLOCK_K + offs_k)[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    for kk in range(k_lo, k_hi):
        if TMA:  # out-of-bounds rows and the K tail read as zeros
            a = a_desc.load([off_m, kk * BLOCK_K])
            b = b_desc.load([off_n, kk * BLOCK_K]).T
        else:
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if ACC == 0:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=MAX_IMPRECISE)
        elif ACC == 1:
            acc += tl.dot(a, b)
        else:
            acc += prev
            prev = tl.dot(a, b)
    if ACC == 2:
        acc += prev
    return acc


@triton.jit
def _epilogue(acc, pid_m, pid_n, tile, c_ptr, a_scale_ptr, b_scale_ptr, slot_ptrs, flag_ptrs, epoch_ptr,
              M, N, stride_cm, stride_cn, rank, max_tiles,
              A_ROWWISE: tl.constexpr, B_COLWISE: tl.constexpr, PUSH: tl.constexpr, WORLD: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Scales, bf16, then the masked store (or the push to every rank's slot + flags)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if A_ROWWISE:
        acc = acc * tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    else:
        acc = acc * tl.load(a_scale_ptr)
    if B_COLWISE:
        acc = acc * tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    else:
        acc = acc * tl.load(b_scale_ptr)
    c = acc.to(tl.bfloat16)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if PUSH:
        _push_tile(
            c, mask, offs_m, offs_n, tile, slot_ptrs, flag_ptrs, epoch_ptr, M, N, rank, max_tiles, WORLD
        )
    else:
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, c, mask=mask)


@triton.jit
def _fp8_gemm_tiles_kernel(
    a_ptr, b_ptr, a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr,
    slot_ptrs, flag_ptrs, epoch_ptr, part_ptr, count_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    rank, max_tiles,
    A_ROWWISE: tl.constexpr, B_COLWISE: tl.constexpr,
    PUSH: tl.constexpr, WORLD: tl.constexpr, EVEN_K: tl.constexpr, MAX_IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACC: tl.constexpr, TMA: tl.constexpr, STREAM_K: tl.constexpr, FLATTEN: tl.constexpr,
):  # fmt: skip
    """The variant kernel: programs loop over output tiles (grid = tiles: one each; grid = SMs:
    persistent), or with STREAM_K over an even share of the (tile, K-block) iterations.

    TMA: a_desc [M, K] and b_desc [N, K] (K-major) tensor descriptors, else pointer loads. Tile ids
    and the epilogue (incl. PUSH) are the classic kernel's, so `_tile_reduce_kernel` pairs with it.
    Stream-K: the grid never exceeds the tile count, so a program's share is at least one tile's K
    and a tile is split between at most two programs, programs p-1 (its first K-blocks) and p (the
    rest): both store their fp32 partial in boundary slot p of `part_ptr` [grid, 2, BLOCK_M*BLOCK_N]
    and bump `count_ptr[p]`; whichever arrives second adds the other's partial (a + b: the same
    value in either order) and finishes the tile, then re-arms the counter for the next call.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    if STREAM_K:
        total = num_tiles * k_tiles
        share = total // nprog
        extra = total % nprog
        it = pid * share + tl.minimum(pid, extra)
        end = it + share + (pid < extra).to(tl.int32)
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        while it < end:
            t = it // k_tiles
            k0 = it - t * k_tiles
            k1 = tl.minimum(k_tiles, k0 + (end - it))
            pid_m, pid_n, tile = _tile_coords(t, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = _k_loop(a_ptr, b_ptr, a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k0, k1, M, N, K,
                          stride_am, stride_ak, stride_bk, stride_bn,
                          TMA, EVEN_K, ACC, MAX_IMPRECISE, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            if (k0 == 0) & (k1 == k_tiles):
                _epilogue(acc, pid_m, pid_n, tile, c_ptr, a_scale_ptr, b_scale_ptr, slot_ptrs, flag_ptrs,
                          epoch_ptr, M, N, stride_cm, stride_cn, rank, max_tiles,
                          A_ROWWISE, B_COLWISE, PUSH, WORLD, BLOCK_M, BLOCK_N)  # fmt: skip
            else:
                head = (k0 == 0).to(tl.int32)  # this program holds the tile's first K-blocks
                slot = pid + head
                part = part_ptr + slot.to(tl.int64) * (2 * BLOCK_M * BLOCK_N)
                tl.store(part + (1 - head) * (BLOCK_M * BLOCK_N) + offs, acc)
                tl.debug_barrier()  # every thread's partial precedes the counter (release below)
                seen = tl.atomic_add(count_ptr + slot, 1, sem="acq_rel", scope="gpu")
                if seen == 1:  # the other half is there: finish the tile
                    tl.debug_barrier()
                    acc += tl.load(part + head * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
                    tl.atomic_xchg(count_ptr + slot, 0)
                    _epilogue(acc, pid_m, pid_n, tile, c_ptr, a_scale_ptr, b_scale_ptr, slot_ptrs,
                              flag_ptrs, epoch_ptr, M, N, stride_cm, stride_cn, rank, max_tiles,
                              A_ROWWISE, B_COLWISE, PUSH, WORLD, BLOCK_M, BLOCK_N)  # fmt: skip
            it += k1 - k0
    else:
        for t in tl.range(pid, num_tiles, nprog, flatten=FLATTEN):
            pid_m, pid_n, tile = _tile_coords(t, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = _k_loop(a_ptr, b_ptr, a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, k_tiles, M, N, K,
                          stride_am, stride_ak, stride_bk, stride_bn,
                          TMA, EVEN_K, ACC, MAX_IMPRECISE, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            _epilogue(acc, pid_m, pid_n, tile, c_ptr, a_scale_ptr, b_scale_ptr, slot_ptrs, flag_ptrs,
                      epoch_ptr, M, N, stride_cm, stride_cn, rank, max_tiles,
                      A_ROWWISE, B_COLWISE, PUSH, WORLD, BLOCK_M, BLOCK_N)  # fmt: skip


if gluon is not None:

    @gluon.jit
    def _gl_mma(a_bufs, b_bufs, bars, blk, zero, STAGES: gl.constexpr):
        """Issue K-block `blk`'s wgmma (async, into a fresh accumulator) once its stage has landed."""
        s = blk % STAGES
        mbarrier.wait(bars.index(s), (blk // STAGES) & 1)
        b = b_bufs.index(s).permute((1, 0))
        return warpgroup_mma(a_bufs.index(s), b, zero, use_acc=False, is_async=True)

    @gluon.jit
    def _gl_refill(a_desc, b_desc, a_bufs, b_bufs, bars, blk, k_tiles, off_m, off_n,
                   STAGES: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """Once the wgmma of block blk-1 is done, its stage takes block blk + STAGES - 1 (if any)."""
        nxt = blk + STAGES - 1
        ok = nxt < k_tiles
        t = nxt % STAGES
        mbarrier.expect(bars.index(t), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=ok)
        _gl_tma_load(a_desc, [off_m, nxt * BLOCK_K], bars.index(t), a_bufs.index(t), pred=ok)
        _gl_tma_load(b_desc, [off_n, nxt * BLOCK_K], bars.index(t), b_bufs.index(t), pred=ok)

    @gluon.jit
    def _gl_fp8_gemm_kernel(
        a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
        A_ROWWISE: gl.constexpr, B_COLWISE: gl.constexpr, FAST: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr, WARPS_M: gl.constexpr, WARPS_N: gl.constexpr,
    ):  # fmt: skip
        """One output tile: a [M, K] and b [N, K] (K-major) TMA descriptors into a STAGES-deep ring.

        FAST: one accumulator chained through the wgmmas (the hardware's accumulation). Otherwise
        each K-block's products go into a fresh accumulator, alternately p0 / p1, and the other one
        (the previous block, complete after ``wait(1)``) is added into the fp32 `acc` while this
        block's wgmma runs: promotion every BLOCK_K products, the same sums as the "flag" mode.
        The loop is unrolled by two so no in-flight accumulator is ever copied (a copy would make
        ptxas serialise the wgmmas).
        """
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_pid_n
        first_m = (pid // width) * GROUP_M
        group_size = gl.minimum(num_pid_m - first_m, GROUP_M)
        off_m = (first_m + (pid % width) % group_size) * BLOCK_M
        off_n = ((pid % width) // group_size) * BLOCK_N

        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, BLOCK_N // WARPS_N, 32]
        )
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        k_tiles = gl.cdiv(K, BLOCK_K)
        for i in gl.static_range(STAGES - 1):
            ok = i < k_tiles
            mbarrier.expect(bars.index(i), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=ok)
            _gl_tma_load(a_desc, [off_m, i * BLOCK_K], bars.index(i), a_bufs.index(i), pred=ok)
            _gl_tma_load(b_desc, [off_n, i * BLOCK_K], bars.index(i), b_bufs.index(i), pred=ok)

        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)
        if FAST:
            for kk in range(k_tiles):
                s = kk % STAGES
                mbarrier.wait(bars.index(s), (kk // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                _gl_refill(a_desc, b_desc, a_bufs, b_bufs, bars, kk, k_tiles, off_m, off_n, STAGES, BLOCK_K)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        else:
            zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)
            p0 = _gl_mma(a_bufs, b_bufs, bars, 0, zero, STAGES)
            _gl_refill(a_desc, b_desc, a_bufs, b_bufs, bars, 0, k_tiles, off_m, off_n, STAGES, BLOCK_K)
            for j in range((k_tiles - 1) // 2):
                p1 = _gl_mma(a_bufs, b_bufs, bars, 2 * j + 1, zero, STAGES)
                acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
                _gl_refill(
                    a_desc, b_desc, a_bufs, b_bufs, bars, 2 * j + 1, k_tiles, off_m, off_n, STAGES, BLOCK_K
                )
                p0 = _gl_mma(a_bufs, b_bufs, bars, 2 * j + 2, zero, STAGES)
                acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(p1,))
                _gl_refill(
                    a_desc, b_desc, a_bufs, b_bufs, bars, 2 * j + 2, k_tiles, off_m, off_n, STAGES, BLOCK_K
                )
            if k_tiles % 2 == 0:
                p1 = _gl_mma(a_bufs, b_bufs, bars, k_tiles - 1, zero, STAGES)
                acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
                acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
            else:
                acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(p0,))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        if A_ROWWISE:
            acc = acc * gl.expand_dims(gl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0), 1)
        else:
            acc = acc * gl.load(a_scale_ptr)
        if B_COLWISE:
            acc = acc * gl.expand_dims(gl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0), 0)
        else:
            acc = acc * gl.load(b_scale_ptr)
        mask = (gl.expand_dims(offs_m, 1) < M) & (gl.expand_dims(offs_n, 0) < N)
        ptrs = c_ptr + gl.expand_dims(offs_m, 1) * stride_cm + gl.expand_dims(offs_n, 0)
        gl.store(ptrs, acc.to(gl.bfloat16), mask=mask)


def _gluon_layout(cfg: TileConfig) -> tuple[int, int]:
    """warps_per_cta of the Gluon kernel's wgmma layout: warps along M first (16 rows each)."""
    warps_m = min(cfg.num_warps, cfg.block_m // 16)
    return warps_m, cfg.num_warps // warps_m


def _launch_gluon(a, b, a_scale, b_scale, c, m, n, k, cfg: TileConfig, fast_accum: bool):
    if gluon is None:
        raise GemmAllReduceError(
            f"this Triton ({triton.__version__}) has no Gluon: {cfg.label()} unavailable"
        )
    fp8 = gl.float8e4nv
    a_desc = GluonDescriptor.from_tensor(
        a, [cfg.block_m, cfg.block_k], gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], fp8)
    )
    b_desc = GluonDescriptor.from_tensor(  # b.t(): the [N, K] K-major weight
        b.t(),
        [cfg.block_n, cfg.block_k],
        gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_k], fp8),
    )
    warps_m, warps_n = _gluon_layout(cfg)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return _gl_fp8_gemm_kernel[(tiles,)](
        a_desc, b_desc, c, a_scale, b_scale, m, n, k, c.stride(0),
        A_ROWWISE=a_scale.numel() > 1, B_COLWISE=b_scale.numel() > 1, FAST=fast_accum,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, WARPS_M=warps_m, WARPS_N=warps_n, num_warps=cfg.num_warps,
    )  # fmt: skip


@triton.jit
def _tile_reduce_kernel(
    slot_ptr, flag_ptr, epoch_ptr, out_ptr,
    M, N, stride_om, stride_on, max_tiles,
    WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """This rank's sum of a tile: wait for its WORLD flags to carry the epoch, add the partials (fp32).

    Uses the GEMM's tiling, so tile ids match the flags the GEMM raised. Runs unchanged under
    TRITON_INTERPRET=1 with ranks emulated as separate buffers in one process.
    """
    pid = tl.program_id(0)
    pid_m, pid_n, tile = _tile_coords(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    epoch = tl.load(epoch_ptr)
    parity = epoch % 2
    for r in tl.static_range(WORLD):
        f = flag_ptr + (parity * WORLD + r) * max_tiles + tile
        seen = tl.atomic_cas(f, epoch, epoch, sem="acquire", scope="sys")
        while seen != epoch:
            seen = tl.atomic_cas(f, epoch, epoch, sem="acquire", scope="sys")
    tl.debug_barrier()
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in tl.static_range(WORLD):
        src = slot_ptr + (parity * WORLD + r) * M * N + offs_m[:, None] * N + offs_n[None, :]
        acc += tl.load(src, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(tl.bfloat16), mask=mask
    )


# ----------------------------------------------------------------------------------------------------
# Wrappers


def _operands(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor):
    """Validate and normalise: b as a [K, N] view (an [N, K] weight is transposed when unambiguous)."""
    if a.dim() != 2 or b.dim() != 2:
        raise GemmAllReduceError(f"a and b must be 2-D; got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.dtype != FP8 or b.dtype != FP8:
        raise GemmAllReduceError(f"a and b must be {FP8}; got {a.dtype}, {b.dtype}")
    m, k = a.shape
    if b.shape[0] != k:
        if b.shape[1] != k:
            raise GemmAllReduceError(f"b must be [K, N] or [N, K] with K={k}; got {tuple(b.shape)}")
        b = b.t()  # an [N, K] weight (nn.Linear layout): the K-major [K, N] view
    n = b.shape[1]
    a_scale = a_scale.reshape(-1).float()
    b_scale = b_scale.reshape(-1).float()
    if a_scale.numel() not in (1, m) or b_scale.numel() not in (1, n):
        raise GemmAllReduceError(
            f"a_scale must have 1 or M={m} values and b_scale 1 or N={n}; "
            f"got {a_scale.numel()} and {b_scale.numel()}"
        )
    return a, b, a_scale, b_scale, m, n, k


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _num_sms(device) -> int:
    """Programs of a persistent grid: the SM count on a GPU; 4 under the interpreter (tests)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _INTERPRET_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


_SMS: dict[int, int] = {}
_INTERPRET_SMS = 4
# stream-K boundary workspaces per (device, grid, BLOCK_M, BLOCK_N): fp32 partials [grid, 2, BM*BN]
# and int32 counters [grid] (zero between calls: the finishing program re-arms its counter). One
# stream at a time may use a workspace (the worker's GEMMs run on one stream).
_STREAM_K_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _stream_k_workspace(device, grid: int, cfg: TileConfig) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), grid, cfg.block_m, cfg.block_n)
    ws = _STREAM_K_WS.get(key)
    if ws is None:  # first use (tune / warm-up, before any graph capture)
        ws = _STREAM_K_WS[key] = (
            torch.empty((grid, 2, cfg.block_m * cfg.block_n), dtype=torch.float32, device=device),
            torch.zeros(grid, dtype=torch.int32, device=device),
        )
    return ws


def _tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """TMA descriptors need K-major rows with 16-byte aligned bases and row strides."""
    return (
        a.stride(1) == 1 and b.stride(0) == 1 and a.stride(0) % 16 == 0 and b.stride(1) % 16 == 0
        and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    )  # fmt: skip


def _launch_gemm(a, b, a_scale, b_scale, c, m, n, k, cfg: TileConfig, push=None, fast_accum=False):
    """Launch the kernel `cfg` selects; returns Triton's launched kernel (n_regs / n_spills on GPUs)."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    dummy = a_scale  # any tensor: pointer arguments unused when PUSH is off
    slot_ptrs, flag_ptrs, epoch, rank, world, max_tiles = push or (dummy, dummy, dummy, 0, 1, 0)
    acc_mode = 0 if fast_accum else ACC_MODES[cfg.acc]
    common = dict(  # noqa: C408 -- kernel keyword arguments
        A_ROWWISE=a_scale.numel() > 1, B_COLWISE=b_scale.numel() > 1,
        PUSH=push is not None, WORLD=world, EVEN_K=k % cfg.block_k == 0,
        MAX_IMPRECISE=None if fast_accum else cfg.block_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, ACC=acc_mode,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    strides = (
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        c.stride(0) if c is not None else 0, c.stride(1) if c is not None else 0,
    )  # fmt: skip
    if cfg.gluon:
        if push is not None or not a.is_cuda or c is None or c.stride(1) != 1:
            raise GemmAllReduceError(f"{cfg.label()}: the Gluon kernel is a plain GEMM on a GPU (no push)")
        if _tma_ok(a, b):
            return _launch_gluon(a, b, a_scale, b_scale, c, m, n, k, cfg, fast_accum)
        cfg = TileConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages)
    if cfg.classic:
        return _fp8_gemm_kernel[(tiles,)](
            a, b, c if c is not None else dummy, a_scale, b_scale, slot_ptrs, flag_ptrs, epoch,
            m, n, k, *strides, rank, max_tiles, **common,
        )  # fmt: skip
    grid = min(tiles, _num_sms(a.device) * cfg.occupancy) if (cfg.persistent or cfg.stream_k) else tiles
    tma = cfg.tma and _tma_ok(a, b)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor.from_tensor(b.t(), [cfg.block_n, cfg.block_k])  # [N, K] K-major
    else:
        a_desc = b_desc = dummy
    part, count = _stream_k_workspace(a.device, grid, cfg) if cfg.stream_k else (dummy, dummy)
    return _fp8_gemm_tiles_kernel[(grid,)](
        a, b, a_desc, b_desc, c if c is not None else dummy, a_scale, b_scale,
        slot_ptrs, flag_ptrs, epoch, part, count,
        m, n, k, *strides, rank, max_tiles, **common,
        TMA=tma, STREAM_K=cfg.stream_k, FLATTEN=cfg.flatten,
    )  # fmt: skip


def fp8_gemm(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    config: TileConfig | None = None, fast_accum: bool = False,
) -> torch.Tensor:  # fmt: skip
    """bf16 ``(a @ b) * a_scale * b_scale`` (Triton on GPU or under TRITON_INTERPRET=1, else torch).

    ``fast_accum`` lets the FP8 tensor cores accumulate without fp32 promotion (like
    ``_scaled_mm(use_fast_accum=True)``); off, sums are promoted every BLOCK_K products."""
    a, b, a_scale, b_scale, m, n, k = _operands(a, b, a_scale, b_scale)
    if not _use_triton(a):
        return _gemm_torch(a, b, a_scale, b_scale)
    c = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    cfg = config or pick_config(m, n, k, fast_accum)
    _launch_gemm(a, b, a_scale, b_scale, c, m, n, k, cfg, fast_accum=fast_accum)
    return c


def _gemm_torch(a, b, a_scale, b_scale) -> torch.Tensor:
    sa = a_scale.view(-1, 1) if a_scale.numel() > 1 else a_scale
    sb = b_scale.view(1, -1) if b_scale.numel() > 1 else b_scale
    return ((a.float() @ b.float()) * sa * sb).to(torch.bfloat16)


def gemm_allreduce_ref(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, group=None
) -> torch.Tensor:
    """Plain torch: fp32 GEMM of the dequantized operands, then all-reduce (fp32), then bf16."""
    a, b, a_scale, b_scale, _, _, _ = _operands(a, b, a_scale, b_scale)
    sa = a_scale.view(-1, 1) if a_scale.numel() > 1 else a_scale
    sb = b_scale.view(1, -1) if b_scale.numel() > 1 else b_scale
    out = (a.float() @ b.float()) * sa * sb
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out.to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------
# Symmetric workspaces and the registry


@dataclass
class SymmetricWorkspace:
    """One rank's view of a symmetric buffer set for one (M, N): slots, flags, peers' addresses.

    slots: bf16 [2, world, M, N] (parity, source rank); flags: int64 [2, world, max_tiles];
    slot_ptrs / flag_ptrs: int64 [world] base addresses of every rank's slots / flags (peer-mapped on
    GPUs; plain addresses of separate buffers when ranks are emulated in one process);
    epoch: int64 [1] this rank's call counter (device memory, starts at 1).
    """

    rank: int
    world: int
    m: int
    n: int
    slots: torch.Tensor
    flags: torch.Tensor
    slot_ptrs: torch.Tensor
    flag_ptrs: torch.Tensor
    epoch: torch.Tensor
    handles: tuple = ()  # symmetric-memory handles kept alive with the workspace

    @property
    def max_tiles(self) -> int:
        return self.flags.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size() + self.flags.numel() * 8


def _max_tiles(m: int, n: int, min_tile: int = _MIN_TILE) -> int:
    return triton.cdiv(m, min_tile) * triton.cdiv(n, min_tile)


def _pointer_table(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """int64 [n] of the tensors' addresses on ``device``; on CUDA copied from pinned memory without a
    host sync (the worker's step loop creates the steady shape's buffer: no sync allowed there)."""
    host = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def emulated_workspaces(
    world: int, m: int, n: int, device="cpu", min_tile: int = 16
) -> list[SymmetricWorkspace]:
    """`world` workspaces in one process, each rank a separate buffer (CPU tests, TRITON_INTERPRET=1)."""
    slots = [torch.zeros((2, world, m, n), dtype=torch.bfloat16, device=device) for _ in range(world)]
    flags = [
        torch.zeros((2, world, _max_tiles(m, n, min_tile)), dtype=torch.int64, device=device)
        for _ in range(world)
    ]
    slot_ptrs, flag_ptrs = _pointer_table(slots, device), _pointer_table(flags, device)
    return [
        SymmetricWorkspace(r, world, m, n, slots[r], flags[r], slot_ptrs, flag_ptrs,
                           torch.ones(1, dtype=torch.int64, device=device))
        for r in range(world)
    ]  # fmt: skip


def symmetric_workspace(group, m: int, n: int) -> SymmetricWorkspace:
    """Allocate this rank's slots and flags in PyTorch symmetric memory (no multicast) and exchange
    peers' addresses. Collective: every rank of `group` calls it for the same (M, N), in order."""
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # plain P2P only; never an NVLS object
    import torch.distributed._symmetric_memory as symm_mem

    try:  # the CUDA (driver VMM + P2P) backend, not NVSHMEM; fixed once anything is allocated
        symm_mem.set_backend("CUDA")
    except (RuntimeError, ValueError, AttributeError):
        pass

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = torch.device("cuda", torch.cuda.current_device())
    slots = symm_mem.empty((2, world, m, n), dtype=torch.bfloat16, device=device)
    flags = symm_mem.empty((2, world, _max_tiles(m, n)), dtype=torch.int64, device=device)
    flags.zero_()
    symm_mem.enable_symm_mem_for_group(group.group_name)  # idempotent; required before torch 2.8
    h_slots = symm_mem.rendezvous(slots, group=group)
    h_flags = symm_mem.rendezvous(flags, group=group)
    slot_ptrs = torch.tensor(list(h_slots.buffer_ptrs), dtype=torch.int64, device=device)
    flag_ptrs = torch.tensor(list(h_flags.buffer_ptrs), dtype=torch.int64, device=device)
    torch.cuda.synchronize()
    dist.barrier(group=group)  # every rank's flags are zero before any peer may raise one
    return SymmetricWorkspace(
        rank,
        world,
        m,
        n,
        slots,
        flags,
        slot_ptrs,
        flag_ptrs,
        torch.ones(1, dtype=torch.int64, device=device),
        (h_slots, h_flags),
    )


def push_partials(ws: SymmetricWorkspace, a, b, a_scale, b_scale, config: TileConfig | None = None,
                  fast_accum: bool = False):  # fmt: skip
    """Phase 1 on one rank: the FP8 GEMM, each finished tile stored into every rank's slot + flag.
    Every rank of a call must use the same `config` (default FUSED_CONFIG)."""
    a, b, a_scale, b_scale, m, n, k = _operands(a, b, a_scale, b_scale)
    if (m, n) != (ws.m, ws.n):
        raise GemmAllReduceError(f"workspace is for (M, N)=({ws.m}, {ws.n}); got ({m}, {n})")
    cfg = config or FUSED_CONFIG
    assert cfg.block_m >= _MIN_TILE and cfg.block_n >= _MIN_TILE or not a.is_cuda
    push = (ws.slot_ptrs, ws.flag_ptrs, ws.epoch, ws.rank, ws.world, ws.max_tiles)
    _launch_gemm(a, b, a_scale, b_scale, None, m, n, k, cfg, push=push, fast_accum=fast_accum)
    return cfg


def reduce_tiles(ws: SymmetricWorkspace, cfg: TileConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """Phase 2 on one rank: wait for each tile's flags, sum the world partials, then bump the epoch."""
    if out is None:
        out = torch.empty((ws.m, ws.n), dtype=torch.bfloat16, device=ws.slots.device)
    grid = (triton.cdiv(ws.m, cfg.block_m) * triton.cdiv(ws.n, cfg.block_n),)
    assert grid[0] <= ws.max_tiles
    _tile_reduce_kernel[grid](
        ws.slots, ws.flags, ws.epoch, out,
        ws.m, ws.n, out.stride(0), out.stride(1), ws.max_tiles,
        WORLD=ws.world, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        num_warps=8 if cfg.block_m * cfg.block_n >= 128 * 128 else 4,
    )  # fmt: skip
    ws.epoch.add_(1)  # device-side counter: graph-capturable, no host state per call
    return out


def fused_gemm_allreduce(ws: SymmetricWorkspace, a, b, a_scale, b_scale, config=None,
                         fast_accum: bool = False) -> torch.Tensor:  # fmt: skip
    """Both phases on one rank (the real multi-GPU path: every rank calls it for the same call)."""
    cfg = push_partials(ws, a, b, a_scale, b_scale, config, fast_accum)
    return reduce_tiles(ws, cfg)
