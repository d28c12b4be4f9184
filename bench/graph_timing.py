"""GPU timing the kernel benches share (bench/kernels.py, bench/attention.py): ``calls`` invocations of a
function captured in one CUDA graph (after a warm-up on a side stream), the median replay (triton's
``do_bench``)."""

from __future__ import annotations

import torch
from triton.testing import do_bench


def median_ms(fn) -> float:
    """Median ms of ``fn()`` (``do_bench``: 25 ms warm-up, 200 ms of repetitions)."""
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def graph_ms(fn, calls: int) -> float:
    """Capture ``calls`` invocations fn(i) in one CUDA graph; median replay time in ms."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return median_ms(g.replay)
