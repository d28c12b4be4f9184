"""The DiT block's elementwise chains on one GPU at the prod57b TP=3 rank shape (757 tokens; d 7680, FFN 10240
on the rank, attention out 2560): inductor against the one-pass Triton kernels of kernels/block_chains.py.

    python bench/chains.py [--calls 20] [--budget 170] [--only res_g_wb,gelu,...]

Per chain (the worker's fused block path, ``BlockFusion``; calls per step in brackets): res_g_wb (x + g*y, then
LayerNorm modulated, FP8) [236], res_g (plain LayerNorm) [240], res_wb (x + y) [240], ln_wb (first block) [4],
gelu (tanh GELU + FP8 of [757, 10240]) [240], quant (row FP8 of the attention outputs [757, 2560]) [480].
Variants: (a) ``inductor``: the torch chain under torch.compile, exactly ``BlockFusion.compiled("row")`` /
the compiled ``quantize_act_rows`` (the baseline); (b) ``inductor+multi_kernel``: options
{"triton.multi_kernel": 2} (persistent reductions tried too); (c) ``triton``: kernels/block_chains.py at its
default config, then a few ``cfg`` (warps, rows per program). Every variant is first checked against the
eager torch chain (``ok``: the kernel tests' bound; ``loose``: within 2 e4m3 steps / 5% flipped codes, what
inductor's fp32-kept intermediates give; a ``wrong`` one is reported, not timed). Time: ``--calls`` calls on
rotating inputs (4 sets, beyond L2) captured in one CUDA graph, median replay / calls. Variants past
``--budget`` seconds are skipped (baselines and defaults run first). Prints the table, the per-step estimate,
and LAST the ratios (triton / inductor) per chain and for the step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import block_chains as bc
from worker.fp8 import quantize_act_rows
from worker.model import _chains

M, D, FFN, ATTN = 757, 7680, 10240, 2560
SETS = 4  # input sets rotated through (4 x 2 x 11.6 MB for the residual chains: beyond the 50 MB L2)
CHAINS = {  # name: (calls per step, K, what)
    "res_g_wb": (236, D, "x + g*y, LayerNorm(w, b), FP8"),
    "res_g": (240, D, "x + g*y, LayerNorm, FP8"),
    "res_wb": (240, D, "x + y, LayerNorm(w, b), FP8"),
    "ln_wb": (4, D, "LayerNorm(w, b), FP8"),
    "gelu": (240, FFN, "tanh GELU, FP8"),
    "quant": (480, ATTN, "row FP8"),
}
SWEEP = [{"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16}, {"num_warps": 32},
         {"ROWS": 2, "num_warps": 8}, {"ROWS": 2, "num_warps": 16}, {"ROWS": 4, "num_warps": 16}]


def graph_us(fn, calls: int) -> float:
    """``calls`` invocations fn(i) captured in one CUDA graph (bench/kernels.py's ``graph_ms``): us per call."""
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
    ms = do_bench(g.replay, warmup=25, rep=150, return_mode="median")
    return ms * 1000 / calls


def inputs(name: str, dev) -> list[tuple]:
    """SETS argument tuples for the chain's torch function (the worker's shapes and value ranges)."""
    _, K, _ = CHAINS[name]
    g = torch.Generator(device=dev).manual_seed(17)

    def rnd(*shape, mean=0.0, std=1.0):
        return (mean + std * torch.randn(*shape, generator=g, device=dev)).bfloat16()

    w, b, gate = rnd(K, mean=1.0, std=0.2), rnd(K, std=0.3), rnd(K, mean=0.5, std=0.3)
    sets = []
    for _ in range(SETS):
        x, y = rnd(M, K, std=2.0), rnd(M, K)
        sets.append({
            "res_g_wb": (x, gate, y, w, b), "res_g": (x, gate, y, None, None), "res_wb": (x, None, y, w, b),
            "ln_wb": (x, w, b), "gelu": (y * 2,), "quant": (y,),
        }[name])
    return sets


def torch_fn(name: str):
    ln, res, gelu = _chains(quantize_act_rows)
    return {"ln_wb": ln, "gelu": gelu, "quant": quantize_act_rows}.get(name, res)


def triton_fn(name: str, cfg: dict | None):
    if name.startswith("res"):
        return lambda x, g, y, w, b: bc.res_ln_quant_rows(x, g, y, w, b, cfg=cfg)
    if name == "ln_wb":
        return lambda x, w, b: bc.ln_quant_rows(x, w, b, cfg=cfg)
    if name == "gelu":
        return lambda u: bc.gelu_quant_rows(u, cfg=cfg)
    return lambda x: bc.quant_rows(x, cfg=cfg)


def check(got, want) -> tuple[str, str]:
    """(status, note) of a variant's outputs against the eager torch chain's on the same inputs."""
    q, s, q_ref, s_ref = got[-2], got[-1], want[-2], want[-1]
    if q.shape != q_ref.shape or q.dtype != q_ref.dtype or s.shape != s_ref.shape:
        return "wrong", f"outputs {q.dtype} {tuple(q.shape)} / {tuple(s.shape)}"
    a, r = q.float(), q_ref.float()
    if not (torch.isfinite(a).all() and torch.isfinite(s).all()):
        return "wrong", "non-finite output"
    res_ulps = 0.0
    if len(want) == 3:
        xr = want[0].float()
        ulp = torch.exp2(torch.floor(torch.log2(xr.abs().clamp_min(2.0**-126))) - 7)  # bf16's
        res_ulps = ((got[0].float() - xr).abs() / ulp).max().item()
    srel = ((s - s_ref).abs() / s_ref).max().item()
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), r.abs()).clamp_min(2.0**-6))) - 3)
    steps = ((a - r).abs() / step).max().item()
    flips = (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item()
    note = f"flips {flips:.1e}, max {steps:.0f} step, scale rel {srel:.1e}, residual {res_ulps:.1f} ulp"
    if res_ulps == 0 and srel <= 2.0**-7 and steps <= 1 and flips <= 1e-3:
        return "ok", note
    if res_ulps <= 1 and srel <= 2.0**-6 and steps <= 2 and flips <= 0.05:
        return "loose", note
    return "wrong", note


def run_variant(name: str, variant: str, fn, sets, want, calls: int, results: dict) -> None:
    try:
        status, note = check(fn(*sets[0]), want)
        us = graph_us(lambda i: fn(*sets[i % SETS]), calls) if status != "wrong" else None
    except Exception as e:  # noqa: BLE001 - one failing variant must not stop the sweep
        status, note, us = "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}", None
    results[(name, variant)] = us
    shown = f"{us:9.2f}" if us is not None else f"{'-':>9s}"
    print(f"{name:9s} {variant:34s} {shown} {status:6s} {note}", flush=True)


def compiled(name: str, options: dict | None):
    torch._dynamo.reset()  # a fresh compile per variant (the options are not part of dynamo's guards)
    return torch.compile(torch_fn(name), options=options)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--budget", type=float, default=170.0, help="seconds; later sweep variants are skipped")
    p.add_argument("--only", default="", help=f"comma-separated chains of {list(CHAINS)}")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/chains.py needs a CUDA GPU (Triton kernels timed under CUDA graphs); none found")
    names = [n for n in CHAINS if not a.only or n in a.only.split(",")]
    torch._dynamo.config.cache_size_limit = 64
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; M={M}; us per call "
          f"({a.calls} calls per CUDA graph, {SETS} rotating input sets)")
    print(f"{'chain':9s} {'variant':34s} {'us/call':>9s} status check vs the eager torch chain")
    data = {n: inputs(n, dev) for n in names}
    want = {n: torch_fn(n)(*data[n][0]) for n in names}
    results: dict[tuple[str, str], float | None] = {}
    phases = [  # baselines and defaults first, so the ratio exists whatever the budget cuts
        [(n, "inductor", lambda n=n: compiled(n, None)) for n in names],
        [(n, "triton", lambda n=n: triton_fn(n, None)) for n in names],
        [(n, f"triton {c}", lambda n=n, c=c: triton_fn(n, c)) for c in SWEEP for n in names],
        [(n, "inductor+multi_kernel", lambda n=n: compiled(n, {"triton.multi_kernel": 2})) for n in names],
    ]
    for phase in phases:
        for name, variant, make in phase:
            if time.perf_counter() - t0 > a.budget and variant not in ("inductor", "triton"):
                results[(name, variant)] = None
                print(f"{name:9s} {variant:34s} {'-':>9s} skipped (time budget {a.budget:.0f} s)", flush=True)
                continue
            try:
                fn = make()
            except Exception as e:  # noqa: BLE001
                print(f"{name:9s} {variant:34s} {'-':>9s} failed {type(e).__name__}: {e}", flush=True)
                continue
            run_variant(name, variant, fn, data[name], want[name], a.calls, results)

    print(f"\nper-step estimate (us/call x calls per step), {time.perf_counter() - t0:.0f} s sweep")
    print(f"{'chain':9s} {'calls':>5s} {'what':32s} {'inductor':>10s} {'+multi_k':>10s} {'triton':>10s} "
          f"{'best trit':>10s}  best cfg")
    tot = {"inductor": 0.0, "multi": 0.0, "triton": 0.0, "best": 0.0}
    ratios = []
    for n in names:
        calls, _, what = CHAINS[n]
        base, multi, ours = (results.get((n, v)) for v in ("inductor", "inductor+multi_kernel", "triton"))
        sweep = {v: t for (c, v), t in results.items() if c == n and v.startswith("triton") and t is not None}
        best_v = min(sweep, key=sweep.get) if sweep else None
        best = sweep.get(best_v) if best_v else None

        def ms(us, calls=calls):
            return f"{us * calls / 1000:10.3f}" if us is not None else f"{'-':>10s}"

        print(f"{n:9s} {calls:5d} {what:32s} {ms(base)} {ms(multi)} {ms(ours)} {ms(best)}  {best_v or '-'}")
        for k, v in (("inductor", base), ("multi", multi if multi is not None else base), ("triton", ours),
                     ("best", best)):
            tot[k] = tot[k] + v * calls / 1000 if (v is not None and tot[k] is not None) else None
        ratios.append((n, base, ours, best))
    print(f"{'step':9s} {'':5s} {'ms/step (multi_k: inductor where it failed)':32s} "
          + " ".join(f"{v:10.3f}" if v is not None else f"{'-':>10s}" for v in tot.values()))

    print("\nratio triton / inductor (same run; < 1 = the Triton kernels are faster)")
    for n, base, ours, best in ratios:
        r = f"{ours / base:.3f}" if base and ours else "-"
        rb = f"{best / base:.3f}" if base and best else "-"
        print(f"  {n:9s} default {r}   best cfg {rb}")
    if tot["inductor"] and tot["triton"]:
        rb = f"{tot['best'] / tot['inductor']:.3f}" if tot["best"] else "-"
        print(f"  {'step':9s} default {tot['triton'] / tot['inductor']:.3f}   best cfg {rb}   "
              f"({tot['triton']:.2f} vs {tot['inductor']:.2f} ms/step)")


if __name__ == "__main__":
    main()
