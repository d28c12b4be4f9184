"""The block's static-scale chains at the prod57b TP=3 rank shape: compiled (the worker's ``BlockFusion.compiled``)
against the Triton kernels (``BlockFusion.triton``: kernels/norm_fp8.py, kernels/gelu_fp8.py), in one run.

    python3 bench/chains.py            # H200: us/call (CUDA-graph replays), a table, then the ratios

Each chain's three forms as the block calls them (first LayerNorm with the previous block's gated residual;
gated residual without affine; residual with affine), and GELU + quantization of the FFN hidden. For every
Triton launch config its FP8 codes are compared with the compiled chain's (fraction differing) before it is
timed; the bytes each call must move give its bandwidth.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's kernels/, not bench/kernels.py

from worker.config import ModelShape, tp_rank_of
from worker.fp8 import FP8_MAX
from worker.model import _chains


def main() -> int:
    import triton.testing as tt

    from kernels.gelu_fp8 import gelu_fp8
    from kernels.norm_fp8 import res_ln_fp8

    _, res_ln_quant, gelu_quant = (torch.compile(f) for f in _chains("static"))
    shape = tp_rank_of(ModelShape.from_name("prod57b"), 3)
    T, d, f = shape.new_tokens, shape.d_model, shape.ffn_local
    dev, bf = "cuda", torch.bfloat16
    u = torch.randn(T, f, device=dev, dtype=bf) * 2
    x, y = torch.randn(T, d, device=dev, dtype=bf), torch.randn(T, d, device=dev, dtype=bf)
    g, w, b = (torch.rand(d, device=dev, dtype=bf) + 0.5 for _ in range(3))
    s = torch.tensor(4.0 / FP8_MAX, device=dev)
    res_bytes = 3 * T * d * 2 + T * d + 3 * d * 2  # x, y in and x out (bf16); h out (fp8); g, w, b
    forms = {  # name: (compiled args, triton kwargs, bytes moved)
        "res+gate+affine": ((x, g, y, w, b, s), {"y": y, "g": g, "w": w, "b": b}, res_bytes),
        "res+gate": ((x, g, y, None, None, s), {"y": y, "g": g}, res_bytes),
        "res+affine": ((x, None, y, w, b, s), {"y": y, "w": w, "b": b}, res_bytes),
    }
    rows = []  # (chain, variant, us, GB/s, codes differing)

    def bench(chain, variant, fn, nbytes, q_ref=None):
        q = fn()
        diff = (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item() if q_ref is not None else 0.0
        us = tt.do_bench_cudagraph(fn, rep=200) * 1e3
        rows.append((chain, variant, us, nbytes / us / 1e3, diff))
        print(f"{chain:<16} {variant:<22} {us:9.2f} us/call {nbytes / us / 1e3:8.0f} GB/s   fp8 codes differing"
              f" from compiled {diff:.2e}", flush=True)
        return q

    for name, (cargs, kw, nbytes) in forms.items():
        q_ref = bench(name, "compiled", lambda cargs=cargs: res_ln_quant(*cargs)[1], nbytes)
        for warps in (4, 8, 16):
            bench(name, f"triton w{warps}", lambda kw=kw, warps=warps: res_ln_fp8(x, s, cfg={"num_warps": warps}, **kw)[1],
                  nbytes, q_ref)
    gelu_bytes = T * f * 3
    q_ref = bench("gelu", "compiled", lambda: gelu_quant(u, s)[0], gelu_bytes)
    for block, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16)):
        bench("gelu", f"triton {block} w{warps}",
              lambda block=block, warps=warps: gelu_fp8(u, s, cfg={"BLOCK": block, "num_warps": warps}), gelu_bytes, q_ref)

    print("\n| chain | variant | us/call | GB/s | FP8 codes differing from compiled |\n|---|---|---|---|---|")
    for chain, variant, us, gbs, diff in rows:
        print(f"| {chain} | {variant} | {us:.2f} | {gbs:.0f} | {diff:.2e} |")
    print("\nratios vs the compiled chain, same run (per step: the block's calls x 240):")
    for chain in (*forms, "gelu"):
        base = next(r[2] for r in rows if r[0] == chain and r[1] == "compiled")
        best = min((r for r in rows if r[0] == chain and r[1] != "compiled"), key=lambda r: r[2])
        print(f"  {chain:<16} best {best[1]:<20} {best[2]:.2f} us vs compiled {base:.2f} us = {best[2] / base:.3f}"
              f"  (saves {(base - best[2]) * 240 / 1e3:.2f} ms/step at 240 calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
