"""The block's compiled elementwise chains (worker/model.py ``_chains``, static scales) at the prod57b TP=3
rank shape, against their earlier formulation (per-element division by the scale, inductor's lowering of
``F.gelu(tanh)``), each compiled with and without coordinate-descent tuning (the worker uses it).

    python3 bench/chains.py            # H200: us/call (CUDA-graph replays), then the ratios vs the old chain

Each variant's FP8 codes are compared with the old chain's (fraction differing) before it is timed.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from worker.config import ModelShape, tp_rank_of
from worker.fp8 import FP8, FP8_MAX
from worker.model import _chains


def _quant_div(h, s):
    return (h / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def gelu_quant_old(u, s):
    return _quant_div(F.gelu(u, approximate="tanh"), s)


def res_ln_quant_old(x, g, y, w, b, s):
    x = torch.addcmul(x, g, y)
    return (x, *_quant_div(F.layer_norm(x, (x.shape[-1],), w, b), s))


def main() -> int:
    import triton.testing as tt

    _, res_ln_quant, gelu_quant = _chains("static")
    shape = tp_rank_of(ModelShape.from_name("prod57b"), 3)
    T, d, f = shape.new_tokens, shape.d_model, shape.ffn_local
    dev, bf = "cuda", torch.bfloat16
    u = torch.randn(T, f, device=dev, dtype=bf)
    x, y = torch.randn(T, d, device=dev, dtype=bf), torch.randn(T, d, device=dev, dtype=bf)
    g, w, b = (torch.randn(d, device=dev, dtype=bf) for _ in range(3))
    s = torch.tensor(4.0 / FP8_MAX, device=dev)
    cases = {
        ("gelu_quant", "old"): (gelu_quant_old, (u, s)),
        ("gelu_quant", "model"): (gelu_quant, (u, s)),
        ("res_ln_quant", "old"): (res_ln_quant_old, (x, g, y, w, b, s)),
        ("res_ln_quant", "model"): (res_ln_quant, (x, g, y, w, b, s)),
    }
    us = {}
    for cdt in (False, True):
        torch._dynamo.reset()
        ref = {}
        for (chain, form), (fn, args) in cases.items():
            cf = torch.compile(fn, dynamic=False, options={"coordinate_descent_tuning": cdt})
            q = cf(*args)[-2]
            ref.setdefault(chain, q)
            diff = (q.view(torch.uint8) != ref[chain].view(torch.uint8)).float().mean().item()
            t = tt.do_bench_cudagraph(lambda cf=cf, args=args: cf(*args), rep=200) * 1e3
            us[chain, form, cdt] = t
            print(f"{chain:<13} {form:<6} coordinate descent {'on ' if cdt else 'off'} {t:9.2f} us/call"
                  f"   fp8 codes differing from old {diff:.2e}", flush=True)
    print("ratios vs the old chain without coordinate descent, same run:")
    for (chain, form, cdt), t in us.items():
        print(f"  {chain:<13} {form:<6} coordinate descent {'on ' if cdt else 'off'} {t / us[chain, 'old', False]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
