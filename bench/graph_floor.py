"""Why the rank's floor is slower as one CUDA graph than launched op by op: each floor op apart.

    python3 bench/graph_floor.py       # H200: ms per step for each op (240 calls), eager vs one graph

bench/worker_step.py's floor (the six block GEMMs on pre-quantized FP8 inputs + SDPA over the window and
over the conditioning, 240 calls each) ran 110-114 ms launched one by one and 121-122 ms captured as one
CUDA graph (2026-11-29). The step itself replays a graph, so whatever the graph costs the floor it costs the
step too. Here each op alone runs 240 times eagerly and as one graph, then the whole block (all eight ops)
240 times both ways; the torch profiler counts the kernels (and memsets) one call launches. A table, then
the ratio of the whole floor as a graph against it eager.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.config import ModelShape, tp_rank_of
from worker.fp8 import FP8, FP8_MAX
from worker.model import DiT

CALLS = 240


def timed(fn, graph: bool, reps: int = 3) -> float:
    """Best of ``reps`` of CALLS x fn, ms: launched one by one, or captured once and replayed."""
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(CALLS):
                fn()
        run = g.replay
        run()
    else:
        def run():
            for _ in range(CALLS):
                fn()
    best = float("inf")
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1))
    return best


def kernels_in(fn) -> tuple[int, int]:
    """(kernels, memsets) one call of fn launches on the GPU."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    mem = sum("memset" in n.lower() for n in names)
    return len(names) - mem, mem


def main() -> int:
    shape = tp_rank_of(ModelShape.from_name("prod57b"), 3)
    model = DiT(dataclasses.replace(shape, n_blocks=1), device="cuda")  # block 0's weights, as the floor uses
    s, blk, dev = model.shape, model.blocks[0], "cuda"
    T, d, H, hd = s.new_tokens, s.d_model, s.heads, s.head_dim
    ops = {}
    for name, lin, k in (("qkv", blk.qkv, d), ("o", blk.o, H * hd), ("cq", blk.cq, d), ("co", blk.co, H * hd),
                         ("up", blk.up, d), ("down", blk.down, s.ffn_local)):
        x = (torch.randn(T, k, device=dev) / 2).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        one = torch.tensor(2.0, device=dev)
        ops[f"gemm {name} {T}x{k}x{lin.w.shape[0]}"] = (
            lambda x=x, lin=lin, one=one: torch._scaled_mm(x, lin.w.t(), scale_a=one, scale_b=lin.scale,
                                                           out_dtype=torch.bfloat16))
    q = torch.randn(1, H, T, hd, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(2, 1, H, s.window, hd, device=dev, dtype=torch.bfloat16)
    ckv = torch.randn(2, 1, H, 1024, hd, device=dev, dtype=torch.bfloat16)
    ops[f"sdpa window {s.window}"] = lambda: F.scaled_dot_product_attention(q, kv[0], kv[1])
    ops["sdpa conditioning 1024"] = lambda: F.scaled_dot_product_attention(q, ckv[0], ckv[1])
    fns = list(ops.values())
    ops["whole block (the floor)"] = lambda: [f() for f in fns]

    print(f"{'op (x240)':<34}{'eager ms':>10}{'graph ms':>10}{'graph/eager':>13}{'kernels':>9}{'memsets':>9}")
    rows = []
    for name, fn in ops.items():
        eager, graph = timed(fn, False), timed(fn, True)
        k, m = kernels_in(fn)
        rows.append((name, eager, graph))
        print(f"{name:<34}{eager:>10.2f}{graph:>10.2f}{graph / eager:>13.3f}{k:>9}{m:>9}", flush=True)
    name, eager, graph = rows[-1]
    print(f"whole floor as one graph / launched one by one = {graph / eager:.3f} ({graph:.1f} / {eager:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
