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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.worker_step import floor_ops, time_calls
from worker.config import ModelShape, tp_rank_of
from worker.model import DiT

CALLS = 240
COND_TOKENS = 1024  # bench/worker_step.py's default conditioning


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
    ops = floor_ops(model, COND_TOKENS)
    fns = list(ops.values())
    ops["whole block (the floor)"] = lambda: [f() for f in fns]

    print(f"{'op (x240)':<34}{'eager ms':>10}{'graph ms':>10}{'graph/eager':>13}{'kernels':>9}{'memsets':>9}")
    rows = []
    for name, fn in ops.items():
        eager, graph = time_calls(fn, CALLS, model.device), time_calls(fn, CALLS, model.device, graph=True)
        k, m = kernels_in(fn)
        rows.append((name, eager, graph))
        print(f"{name:<34}{eager:>10.2f}{graph:>10.2f}{graph / eager:>13.3f}{k:>9}{m:>9}", flush=True)
    name, eager, graph = rows[-1]
    print(f"whole floor as one graph / launched one by one = {graph / eager:.3f} ({graph:.1f} / {eager:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
