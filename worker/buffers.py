"""The fused all-reduce's buffer registry: bounded to the steady-state shape, or (fault) per shape.

    reg = BufferRegistry(steady_tokens=757, width=d_model, device=dev, dtype=torch.bfloat16)
    buf = reg.get(tokens, per_shape=switches.buffer_per_shape)   # a [tokens, width] buffer

The paper's August incident: the fused kernel kept a buffer for every first-forward token count,
and the prompt length varies per session, so memory grew with every new length until OOM. The fix
keeps a persistent buffer for the steady-state shape only; other shapes get a transient buffer
(first forwards use NCCL). With the fault switch ``buffer_per_shape`` on, every distinct token
count is registered and kept (``len(reg)`` = buffers_registered in the step records). One
registry per worker process, shared by its sessions (worker/parallel.py reuses it).
"""

from __future__ import annotations

import threading

import torch


class BufferRegistry:
    def __init__(self, steady_tokens: int, width: int, device, dtype: torch.dtype):
        self.steady_tokens, self.width = steady_tokens, width
        self.device, self.dtype = torch.device(device), dtype
        self._buffers: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, tokens: int, per_shape: bool = False) -> torch.Tensor:
        """A [tokens, width] buffer: registered if steady-state (or always, under the fault switch)."""
        if tokens != self.steady_tokens and not per_shape:
            return torch.empty(tokens, self.width, device=self.device, dtype=self.dtype)
        with self._lock:
            buf = self._buffers.get(tokens)
            if buf is None:
                buf = torch.zeros(tokens, self.width, device=self.device, dtype=self.dtype)
                self._buffers[tokens] = buf
            return buf

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
