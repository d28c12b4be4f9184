"""FP8 GEMM fused with the tensor-parallel all-reduce over plain peer-to-peer symmetric memory.

    out = gemm_allreduce(a_fp8, w_fp8.t(), a_scale, w_scale, group)   # bf16 [M, N], summed over group
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

Buffers come from a bounded `BufferRegistry` keyed by the steady-state shape (M, N, dtype): calls of
any other M (first forwards: the prompt length varies per session) take GEMM + NCCL ``all_reduce``
and never allocate. The fault switch ``buffer_per_shape`` reproduces the August incident: a buffer
per distinct M, unbounded. ``len(registry)`` is the telemetry field ``buffers_registered``.
World size 1 (or ``group=None``) is a plain FP8 GEMM (`fp8_gemm`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
log = logging.getLogger("livestep.kernels.gemm_allreduce")


class GemmAllReduceError(ValueError):
    """Bad operands or registry use; the message lists what is valid."""


# ----------------------------------------------------------------------------------------------------
# Tile configs. Chosen per (M, N, K) by `pick_config`; bench/gemm_allreduce.py sweeps CONFIGS on the
# H200 and prints the rate of each, so the table below is the measured winner at the rank shapes.


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4


# candidates: the best of a first H200 sweep at M=757 (10 configs; 128x256x64, 64x128, 128x64 and
# 64x256 w8 never won); `tune` picks among them per steady shape
CONFIGS: tuple[TileConfig, ...] = (
    TileConfig(128, 128, 128, 8, 8, 4),
    TileConfig(128, 128, 128, 8, 4, 5),
    TileConfig(128, 128, 128, 8, 8, 3),
    TileConfig(256, 128, 128, 8, 8, 3),
    TileConfig(64, 256, 128, 8, 4, 4),
    TileConfig(128, 256, 128, 8, 8, 3),
)
# The fused path always uses this tiling: every rank must cut the output into the same tiles (the
# flags are per tile), and a per-rank `tune` could disagree. It won both row-parallel shapes
# (attn-out K=2560, FFN down K=10240) on the H200 at M=757 (bench/gemm_allreduce.py).
FUSED_CONFIG = CONFIGS[0]
# (M, N, K, fast_accum) -> the config `tune` measured fastest on this GPU (plain GEMMs only)
TUNED: dict[tuple[int, int, int, bool], TileConfig] = {}
# the same key -> [(config, ms per call under CUDA graphs)] of every candidate `tune` timed
TUNE_LOG: dict[tuple[int, int, int, bool], list[tuple[TileConfig, float]]] = {}
# the smallest tile any config uses: flags are sized for it so one buffer serves every config
_MIN_TILE = 64


def pick_config(m: int, n: int, k: int, fast_accum: bool = False) -> TileConfig:
    """The tile config for an (M, N, K) problem: the tuned one where known, else a safe default."""
    return TUNED.get((m, n, k, fast_accum), CONFIGS[0])


def tune(m: int, n: int, k: int, fast_accum: bool = False, device="cuda") -> TileConfig:
    """Time every candidate config at (M, N, K) under CUDA graphs and keep the fastest for
    `pick_config`. Call at warm-up for the steady-state shapes (it synchronises), never per step."""
    key = (m, n, k, fast_accum)
    if key in TUNED:
        return TUNED[key]
    a = torch.randn(m, k, device=device).to(FP8)
    w = torch.randn(n, k, device=device).to(FP8)
    one = torch.ones((), device=device)
    best, best_t = CONFIGS[0], float("inf")
    log = TUNE_LOG.setdefault(key, [])
    for cfg in CONFIGS:
        try:
            t = triton.testing.do_bench_cudagraph(
                lambda cfg=cfg: fp8_gemm(a, w.t(), one, one, config=cfg, fast_accum=fast_accum), rep=20
            )
        except (RuntimeError, triton.runtime.errors.OutOfResources):
            continue  # does not fit this GPU: not a candidate
        log.append((cfg, t))
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
):  # fmt: skip
    # a: [M, K] e4m3; b: [K, N] e4m3 (any strides; K-major is fastest); c: [M, N] bf16 (when not PUSH)
    pid = tl.program_id(0)
    pid_m, pid_n, tile = _tile_coords(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows/cols past the edge wrap around (loads stay in bounds without masks; stores are masked)
    offs_am = offs_m % M
    offs_bn = offs_n % N
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        # MAX_IMPRECISE=BLOCK_K: FP8 tensor-core sums are promoted to fp32 every BLOCK_K products
        # (as cuBLAS does by default); None: the backend's fast accumulation
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=MAX_IMPRECISE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if A_ROWWISE:
        acc = acc * tl.load(a_scale_ptr + offs_am)[:, None]
    else:
        acc = acc * tl.load(a_scale_ptr)
    if B_COLWISE:
        acc = acc * tl.load(b_scale_ptr + offs_bn)[None, :]
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


def _launch_gemm(a, b, a_scale, b_scale, c, m, n, k, cfg: TileConfig, push=None, fast_accum=False) -> None:
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    dummy = a_scale  # any tensor: pointer arguments unused when PUSH is off
    slot_ptrs, flag_ptrs, epoch, rank, world, max_tiles = push or (dummy, dummy, dummy, 0, 1, 0)
    _fp8_gemm_kernel[grid](
        a, b, c if c is not None else dummy, a_scale, b_scale,
        slot_ptrs, flag_ptrs, epoch,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        c.stride(0) if c is not None else 0, c.stride(1) if c is not None else 0,
        rank, max_tiles,
        A_ROWWISE=a_scale.numel() > 1, B_COLWISE=b_scale.numel() > 1,
        PUSH=push is not None, WORLD=world, EVEN_K=k % cfg.block_k == 0,
        MAX_IMPRECISE=None if fast_accum else cfg.block_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
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


def emulated_workspaces(
    world: int, m: int, n: int, device="cpu", min_tile: int = 16
) -> list[SymmetricWorkspace]:
    """`world` workspaces in one process, each rank a separate buffer (CPU tests, TRITON_INTERPRET=1)."""
    slots = [torch.zeros((2, world, m, n), dtype=torch.bfloat16, device=device) for _ in range(world)]
    flags = [
        torch.zeros((2, world, _max_tiles(m, n, min_tile)), dtype=torch.int64, device=device)
        for _ in range(world)
    ]
    slot_ptrs = torch.tensor([s.data_ptr() for s in slots], dtype=torch.int64, device=device)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=device)
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


@dataclass
class BufferRegistry:
    """Symmetric buffers of the fused path, keyed by (M, N, dtype); bounded to steady-state shapes.

    `steady_m` is the steady-state token count (new tokens per step); calls with another M (first
    forwards) get None and take NCCL. With `buffer_per_shape` (the fault switch) every M gets its
    own buffer and nothing is ever evicted: the August leak. `len(registry)` = buffers_registered.
    """

    group: object = None
    steady_m: int | None = None
    capacity: int = 4
    buffer_per_shape: bool = False
    entries: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(getattr(e, "nbytes", 0) for e in self.entries.values())

    def admits(self, m: int) -> bool:
        return self.buffer_per_shape or (self.steady_m is not None and m == self.steady_m)

    def lookup(self, m: int, n: int, dtype=torch.bfloat16, device=None):
        """The workspace for (M, N, dtype), created on first use; None when M is not admitted."""
        if not self.admits(m):
            return None
        key = (m, n, dtype)
        ws = self.entries.get(key)
        if ws is None:
            if not self.buffer_per_shape and len(self.entries) >= self.capacity:
                raise GemmAllReduceError(
                    f"buffer registry full ({self.capacity} steady-state shapes: "
                    f"{sorted(k[:2] for k in self.entries)}); only steady_m={self.steady_m} is admitted"
                )
            ws = self._create(m, n, device)
            self.entries[key] = ws
        return ws

    def _create(self, m: int, n: int, device):
        world = dist.get_world_size(self.group) if self.group is not None else 1
        if device is not None and torch.device(device).type == "cuda" and world > 1:
            try:
                return symmetric_workspace(self.group, m, n)
            except RuntimeError as e:  # no P2P here: keep the plain path (every rank fails alike)
                log.warning("symmetric memory unavailable (%s): this shape takes NCCL", e)
        # no peer-to-peer memory here (CPU/gloo): a local stand-in of the same size, so the registry's
        # growth is real memory; the call itself takes GEMM + all_reduce
        return emulated_workspaces(1, m * world, n, device or "cpu", _MIN_TILE)[0]

    def clear(self) -> None:
        self.entries.clear()


_REGISTRIES: dict[object, BufferRegistry] = {}


def registry_for(group) -> BufferRegistry:
    """The process-wide registry of a group (created empty, no steady shape admitted until set)."""
    reg = _REGISTRIES.get(group)
    if reg is None:
        reg = _REGISTRIES[group] = BufferRegistry(group=group)
    return reg


def gemm_allreduce(
    a_fp8: torch.Tensor, b_fp8: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, group=None,
    *, registry: BufferRegistry | None = None, fast_accum: bool = False,
) -> torch.Tensor:  # fmt: skip
    """bf16 [M, N] = sum over `group` of ``(a @ b) * a_scale * b_scale``.

    a_fp8: [M, K] e4m3; b_fp8: [K, N] (or an [N, K] weight, transposed when unambiguous; pass
    ``w.t()`` for a square weight); scales fp32, per tensor or a_scale [M] / b_scale [N].
    Steady-state shapes with peer memory take the fused path; other shapes GEMM + NCCL all_reduce.
    """
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return fp8_gemm(a_fp8, b_fp8, a_scale, b_scale, fast_accum=fast_accum)
    reg = registry if registry is not None else registry_for(group)
    a, b, sa, sb, m, n, _ = _operands(a_fp8, b_fp8, a_scale, b_scale)
    ws = reg.lookup(m, n, torch.bfloat16, a.device)
    if ws is not None and a.is_cuda and ws.world == world:
        return fused_gemm_allreduce(ws, a, b, sa, sb, fast_accum=fast_accum)
    out = fp8_gemm(a, b, sa, sb, fast_accum=fast_accum)
    dist.all_reduce(out, group=group)
    return out
