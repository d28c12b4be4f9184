"""The fused all-reduce's buffer registry (worker/buffers.py): bounded to the steady shape, the fault
switch's leak, and the one fused-or-NCCL decision, on CPU (stand-in workspaces of real size)."""

from __future__ import annotations

import pytest
import torch

from kernels.gemm_allreduce import GemmAllReduceError
from worker.buffers import BufferRegistry
from worker.parallel import gemm_allreduce


def test_first_forward_shapes_never_enter_the_registry():
    reg = BufferRegistry(steady_m=757)
    for prompt in (300, 512, 1024, 2048):  # first forwards: prompt length varies per session
        assert reg.lookup(prompt, 64) is None
    assert len(reg) == 0
    ws = reg.lookup(757, 64)
    assert ws is not None and reg.lookup(757, 64) is ws
    for prompt in range(256, 2048, 97):
        assert reg.lookup(prompt, 64) is None
    assert len(reg) == 1


def test_buffer_per_shape_grows_per_prompt_length():
    reg = BufferRegistry(steady_m=757, buffer_per_shape=True)
    reg.lookup(757, 64)
    sizes = []
    for prompt in (300, 301, 512, 300, 2048):
        assert reg.lookup(prompt, 64) is not None
        sizes.append(len(reg))
    assert sizes == [2, 3, 4, 4, 5]  # one buffer per distinct M, never released: the leak
    assert reg.nbytes > 0


def test_registry_is_bounded_and_says_what_it_admits():
    reg = BufferRegistry(steady_m=757, capacity=2)
    reg.lookup(757, 64)
    reg.lookup(757, 128)
    with pytest.raises(GemmAllReduceError, match="steady_m=757"):
        reg.lookup(757, 256)
    assert len(reg) == 2


def test_the_fused_path_is_chosen_only_for_admitted_shapes_on_cuda_with_peer_memory():
    reg = BufferRegistry(steady_m=757)
    assert reg.fused_workspace(300, 64, "cpu", 1) is None and len(reg) == 0  # a first forward: NCCL
    assert reg.fused_workspace(757, 64, "cpu", 1) is None  # admitted, registered, but not on CUDA
    assert len(reg) == 1
    assert reg.fused_workspace(757, 64, "cpu", 3) is None  # a stand-in of world 1 serves no group of 3


def test_world_size_one_is_the_plain_fp8_gemm(monkeypatch):
    import kernels.gemm_allreduce as ga

    seen = []
    monkeypatch.setattr("worker.parallel.fp8_gemm", lambda *a, **kw: seen.append(a) or "plain")
    a, w = torch.zeros(4, 8), torch.zeros(8, 16)
    assert gemm_allreduce(a, w, torch.ones(()), torch.ones(()), group=None) == "plain" and len(seen) == 1
    assert ga.fp8_gemm is not None
