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
FP8 GEMM (`fp8_gemm`). One kernel, one program per output tile, operands through TMA descriptors or
pointer loads (`TileConfig.tma`), fp32 promotion every BLOCK_K products (as cuBLAS's default); the
fused path always uses `FUSED_CONFIG`. This module holds what the worker runs: the tuning variants
that were swept and never became the worker's (Gluon, persistent and stream-K grids, other promotion
schedules, per-shape tuning) are gone; their H200 sweep stays in docs/PERFORMANCE.md (issue 7) and
``bench/gemm_allreduce.py --sweep`` times the tilings this kernel still takes.
Over 450 lines: one op per module; the GEMM epilogue's tile push and the reduce kernel share one flag and
epoch handshake over the symmetric workspace, which reads only beside its reference (down from 999 lines).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
log = logging.getLogger("livestep.kernels.gemm_allreduce")


class GemmAllReduceError(ValueError):
    """Bad operands or workspace use; the message lists what is valid."""


# ----------------------------------------------------------------------------------------------------
# Tile configs


@dataclass(frozen=True)
class TileConfig:
    """One tiling of the kernel: BLOCK_M x BLOCK_N output tiles, BLOCK_K per K step (the promotion
    interval: the FP8 tensor-core sums are added into fp32 every BLOCK_K products; 128 is cuBLAS's
    default), grouped tile order (GROUP_M), warps and pipeline stages; ``tma``: operands through
    host-side TMA tensor descriptors (K-major operands only; other layouts fall back to pointer loads)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    tma: bool = False

    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"
                + (" tma" if self.tma else ""))


# A plain GEMM's tiling (benches and tests: the worker's own GEMMs are torch._scaled_mm).
DEFAULT_CONFIG = TileConfig(128, 128, 128, 8, 8, 4)
# The fused path always uses this tiling: every rank must cut the output into the same tiles (the
# flags are per tile). 64x128 with TMA loads and 3 stages was the fastest push-epilogue config over
# both row-parallel shapes in the 2026-11-29 H200 sweep (attn-out 0.967, FFN down 0.873 of _scaled_mm;
# 128x128 pointer loads: 0.686, 0.735; docs/PERFORMANCE.md).
FUSED_CONFIG = TileConfig(64, 128, 128, 16, 4, 3, tma=True)
# the smallest tile a config may use: flags are sized for it so one buffer serves every config
_MIN_TILE = 64


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
def _k_loop(a_ptr, b_ptr, a_desc, b_desc, off_m, off_n, M, N, K,
            stride_am, stride_ak, stride_bk, stride_bn,
            TMA: tl.constexpr, EVEN_K: tl.constexpr, MAX_IMPRECISE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """fp32 sum over every K-block of one output tile (rows off_m.., cols off_n..): the tensor cores'
    partial sums promoted into fp32 every MAX_IMPRECISE (= BLOCK_K) products, None: never (fast)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    if not TMA:
        # rows/cols past the edge wrap around (loads stay in bounds without masks)
        offs_am = (off_m + tl.arange(0, BLOCK_M)) % M
        offs_bn = (off_n + tl.arange(0, BLOCK_N)) % N
        a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    for kk in range(tl.cdiv(K, BLOCK_K)):
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
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=MAX_IMPRECISE)
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
def _fp8_gemm_kernel(
    a_ptr, b_ptr, a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr,
    slot_ptrs, flag_ptrs, epoch_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    rank, max_tiles,
    A_ROWWISE: tl.constexpr, B_COLWISE: tl.constexpr,
    PUSH: tl.constexpr, WORLD: tl.constexpr, EVEN_K: tl.constexpr, MAX_IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """One output tile per program: a [M, K] e4m3, b [K, N] e4m3 (any strides; K-major is fastest;
    TMA: a_desc [M, K] and b_desc [N, K] K-major descriptors, else pointer loads); c [M, N] bf16, or
    with PUSH the partial tile into every rank's slot and its flags (`_tile_reduce_kernel` sums them)."""
    pid = tl.program_id(0)
    pid_m, pid_n, tile = _tile_coords(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _k_loop(a_ptr, b_ptr, a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, TMA, EVEN_K, MAX_IMPRECISE,
                  BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    _epilogue(acc, pid_m, pid_n, tile, c_ptr, a_scale_ptr, b_scale_ptr, slot_ptrs, flag_ptrs, epoch_ptr,
              M, N, stride_cm, stride_cn, rank, max_tiles, A_ROWWISE, B_COLWISE, PUSH, WORLD,
              BLOCK_M, BLOCK_N)  # fmt: skip


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


def _tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """TMA descriptors need K-major rows with 16-byte aligned bases and row strides."""
    return (
        a.stride(1) == 1 and b.stride(0) == 1 and a.stride(0) % 16 == 0 and b.stride(1) % 16 == 0
        and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    )  # fmt: skip


def _launch_gemm(a, b, a_scale, b_scale, c, m, n, k, cfg: TileConfig, push=None, fast_accum=False):
    """Launch the kernel for `cfg`; returns Triton's launched kernel (n_regs / n_spills on GPUs)."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    dummy = a_scale  # any tensor: pointer arguments unused when PUSH is off
    slot_ptrs, flag_ptrs, epoch, rank, world, max_tiles = push or (dummy, dummy, dummy, 0, 1, 0)
    tma = cfg.tma and _tma_ok(a, b)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor.from_tensor(b.t(), [cfg.block_n, cfg.block_k])  # [N, K] K-major
    else:
        a_desc = b_desc = dummy
    return _fp8_gemm_kernel[(tiles,)](
        a, b, a_desc, b_desc, c if c is not None else dummy, a_scale, b_scale, slot_ptrs, flag_ptrs, epoch,
        m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        c.stride(0) if c is not None else 0, c.stride(1) if c is not None else 0, rank, max_tiles,
        A_ROWWISE=a_scale.numel() > 1, B_COLWISE=b_scale.numel() > 1,
        PUSH=push is not None, WORLD=world, EVEN_K=k % cfg.block_k == 0,
        MAX_IMPRECISE=None if fast_accum else cfg.block_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, TMA=tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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
    cfg = config or DEFAULT_CONFIG
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
# Symmetric workspaces


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
