"""The fused FP8 GEMM + all-reduce kernel at world size 1 vs ``torch._scaled_mm``, one H200, one run.

    python bench/gemm_allreduce.py [--m 757]

Shapes: one prod57b TP=3 rank's block GEMMs at M=757 tokens (QKV 7680->3*2560, attn-out 2560->7680,
FFN up 7680->10240, FFN down 10240->7680). GPU time per call under CUDA graphs (as the worker runs
with ``cuda_graphs``), both with fp32-promoted accumulation (the default of both) and with fast
accumulation (same tiles); every tile config `tune` tried; eager us per call (host launch included); the fused
path's push + reduce with 3 ranks emulated on this GPU. LAST: the rate ratio kernel / _scaled_mm.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import gemm_allreduce as ga

SHAPES = {  # name: (N, K) of one TP=3 rank of prod57b
    "qkv": (3 * 2560, 7680),
    "attn_out": (7680, 2560),
    "ffn_up": (10240, 7680),
    "ffn_down": (7680, 10240),
}


def gpu_us(fn) -> float:
    """Median GPU microseconds per call, replayed from a CUDA graph (no host launch cost)."""
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def eager_us(fn) -> float:
    """Median microseconds per call launched eagerly (host launch cost included when it dominates)."""
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def _cfg(c: ga.TileConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"


def measure(name: str, m: int, n: int, k: int) -> dict:
    a = torch.randn(m, k, device="cuda").to(ga.FP8)
    w = torch.randn(n, k, device="cuda").to(ga.FP8)  # [N, K]; b = w.t() is K-major [K, N]
    sa = torch.tensor(0.02, device="cuda")
    sb = torch.tensor(0.03, device="cuda")
    flops = 2.0 * m * n * k
    row = {"name": name, "n": n, "k": k, "flops": flops}
    for fast in (False, True):
        # the default (fp32-promoted) path is tuned; fast accumulation runs the same tile config
        cfg = ga.tune(m, n, k) if not fast else ga.pick_config(m, n, k)
        if fast:
            ga.TUNED[(m, n, k, True)] = cfg
        for c, ms in ga.TUNE_LOG.get((m, n, k, fast), []):
            print(f"  tune {name:9s} {_cfg(c):20s} {ms * 1e3:8.1f} us {flops / ms / 1e9:7.1f} TFLOP/s")
        tag = "fast" if fast else "prec"
        row[f"mm_{tag}"] = gpu_us(
            lambda fast=fast: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                               use_fast_accum=fast))  # fmt: skip
        row[f"k_{tag}"] = gpu_us(lambda fast=fast: ga.gemm_allreduce(a, w.t(), sa, sb, None, fast_accum=fast))
        row[f"cfg_{tag}"] = cfg
    row["eager"] = eager_us(lambda: ga.gemm_allreduce(a, w.t(), sa, sb, None))
    row["eager_mm"] = eager_us(lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    out = ga.gemm_allreduce(a, w.t(), sa, sb, None).double()
    ref = ga.gemm_allreduce_ref(a, w.t(), sa, sb).double()
    row["err"] = ((out - ref).abs().max() / ref.abs().max()).item()
    return row


def emulated_fused(m: int, world: int = 3) -> tuple[float, float, float]:
    """attn-out with `world` ranks emulated on this GPU (pushes land in local memory; on real GPUs
    they cross NVLink while later tiles compute): GEMM alone, push GEMM, reduce, us per rank-call."""
    n, k = SHAPES["attn_out"]
    wss = ga.emulated_workspaces(world, m, n, device="cuda", min_tile=64)
    a = torch.randn(m, k, device="cuda").to(ga.FP8)
    w = torch.randn(n, k, device="cuda").to(ga.FP8)
    sa = torch.tensor(0.02, device="cuda")
    sb = torch.tensor(0.03, device="cuda")
    cfg = ga.FUSED_CONFIG

    def pushes():
        for ws in wss:
            ga.push_partials(ws, a, w.t(), sa, sb, config=cfg)

    def call():
        pushes()
        for ws in wss:
            ga.reduce_tiles(ws, cfg)

    t_gemm = gpu_us(lambda: ga.fp8_gemm(a, w.t(), sa, sb, config=cfg))
    t_push = gpu_us(pushes) / world
    t_call = gpu_us(call) / world
    return t_gemm, t_push, t_call - t_push


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=757)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    m = args.m
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} M={m}")
    rows = [measure(name, m, n, k) for name, (n, k) in SHAPES.items()]
    t_gemm, t_push, t_reduce = emulated_fused(m)

    print("\nGPU us per call under CUDA graphs; prec = fp32-promoted accumulation, fast = fast accumulation")
    print(f"{'gemm':9s} {'N':>6} {'K':>6} | {'mm prec':>8} {'ours':>8} {'TFLOP/s':>8} {'ratio':>6} | "
          f"{'mm fast':>8} {'ours':>8} {'ratio':>6} | {'eager mm':>8} {'eager':>8} | {'rel err':>7}  config (prec)")
    for r in rows:
        print(f"{r['name']:9s} {r['n']:6d} {r['k']:6d} | {r['mm_prec']:8.1f} {r['k_prec']:8.1f} "
              f"{r['flops'] / r['k_prec'] / 1e6:8.1f} {r['mm_prec'] / r['k_prec']:6.3f} | "
              f"{r['mm_fast']:8.1f} {r['k_fast']:8.1f} {r['mm_fast'] / r['k_fast']:6.3f} | "
              f"{r['eager_mm']:8.1f} {r['eager']:8.1f} | {r['err']:7.1e}  {_cfg(r['cfg_prec'])}")
    print(f"\nattn_out fused path, 3 ranks emulated on one GPU (per rank-call): GEMM alone {t_gemm:.1f} us, "
          f"GEMM + push {t_push:.1f} us, reduce {t_reduce:.1f} us")
    fast = sum(r["mm_fast"] for r in rows) / sum(r["k_fast"] for r in rows)
    print(f"fast accumulation: kernel/_scaled_mm rate {fast:.3f}")
    prec = sum(r["mm_prec"] for r in rows) / sum(r["k_prec"] for r in rows)
    worst = min(r["mm_prec"] / r["k_prec"] for r in rows)
    print(f"ratio kernel/_scaled_mm rate (4 rank GEMMs, time-weighted, default accumulation): {prec:.3f} "
          f"(worst shape {worst:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
