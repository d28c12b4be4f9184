"""The fused all-reduce's buffer registry: a long-lived worker's one growing allocation, bounded.

    reg = BufferRegistry(group=group, steady_m=757)
    ws = reg.fused_workspace(m, n, device, world)   # the fused path's buffer, or None: take NCCL

Symmetric buffers of the fused GEMM + all-reduce (kernels/gemm_allreduce.py) are keyed by the
steady-state shape (M, N, dtype): calls of any other M (first forwards: the prompt length varies per
session) take GEMM + NCCL ``all_reduce`` and never allocate. The fault switch ``buffer_per_shape``
reproduces the August incident: a buffer per distinct M, unbounded. ``len(registry)`` is the
telemetry field ``buffers_registered``. ``fused_workspace`` is the one place that decides between the
fused path and NCCL (worker/parallel.py's row-parallel linears and ``gemm_allreduce`` both ask it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kernels.gemm_allreduce import (
    _MIN_TILE,
    GemmAllReduceError,
    SymmetricWorkspace,
    emulated_workspaces,
    symmetric_workspace,
)

log = logging.getLogger("livestep.worker.buffers")


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

    def fused_workspace(self, m: int, n: int, device, world: int) -> SymmetricWorkspace | None:
        """The fused path's workspace for an [M, N] bf16 output over ``world`` ranks, or None when the
        call must take GEMM + NCCL: M not admitted, not on CUDA, or no peer memory for this group
        (the registry then holds a same-sized stand-in, so the fault switch's growth is still real)."""
        ws = self.lookup(m, n, torch.bfloat16, device)
        if ws is None or torch.device(device).type != "cuda" or getattr(ws, "world", 1) != world:
            return None
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
