"""The fused FP8 GEMM + all-reduce kernel at world size 1 vs ``torch._scaled_mm``, one H200, one run.

    python bench/gemm_allreduce.py [--m 757]
    python bench/gemm_allreduce.py --sweep [--m 757]   # every tiling in SWEEP_CONFIGS, every rank shape

Shapes: one prod57b TP=3 rank's block GEMMs at M=757 tokens (QKV 7680->3*2560, attn-out 2560->7680,
FFN up 7680->10240, FFN down 10240->7680). GPU time per call under CUDA graphs (as the worker runs
with ``cuda_graphs``), both with fp32-promoted accumulation (the default of both) and with fast
accumulation (same tiles), at the kernel's ``FUSED_CONFIG`` tiling (what the fused path runs); eager us
per call (host launch included); the fused path's push + reduce with 3 ranks emulated on this GPU.
LAST: the rate ratio kernel / _scaled_mm.

``--sweep`` times every tiling of ``SWEEP_CONFIGS`` at each shape, precise and fast accumulation,
against ``_scaled_mm`` measured in the same run. Each result is first checked against
``gemm_allreduce_ref`` (a wrong one is reported "wrong", never timed); a config that fails to compile
or launch is reported "failed: <why>" and the sweep goes on. LAST: the best config per shape and the
time-weighted ratios of the best (precise, then fast). The variants swept on 2026-11-29 (Gluon,
persistent and stream-K grids, other promotion schedules) never became the worker's and are gone from
kernels/; their figures stay in docs/PERFORMANCE.md (issue 7).
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


# tilings the kernel takes (block sizes, warps, stages, TMA or pointer loads); FUSED_CONFIG first
SWEEP_CONFIGS: tuple[ga.TileConfig, ...] = (
    ga.FUSED_CONFIG,
    ga.DEFAULT_CONFIG,
    ga.TileConfig(128, 128, 128, 8, 8, 4, tma=True),
    ga.TileConfig(128, 128, 128, 8, 4, 3, tma=True),
    ga.TileConfig(128, 128, 128, 8, 8, 3, tma=True),
    ga.TileConfig(128, 256, 128, 8, 8, 3, tma=True),
    ga.TileConfig(64, 128, 128, 16, 4, 4, tma=True),
    ga.TileConfig(64, 128, 128, 16, 4, 4),
    ga.TileConfig(256, 128, 128, 8, 8, 3),
    ga.TileConfig(64, 256, 128, 8, 4, 4),
)


def _cfg(c: ga.TileConfig) -> str:
    return c.label()


def measure(name: str, m: int, n: int, k: int) -> dict:
    a = torch.randn(m, k, device="cuda").to(ga.FP8)
    w = torch.randn(n, k, device="cuda").to(ga.FP8)  # [N, K]; b = w.t() is K-major [K, N]
    sa = torch.tensor(0.02, device="cuda")
    sb = torch.tensor(0.03, device="cuda")
    flops = 2.0 * m * n * k
    row = {"name": name, "n": n, "k": k, "flops": flops}
    cfg = ga.FUSED_CONFIG
    for fast in (False, True):
        tag = "fast" if fast else "prec"
        row[f"mm_{tag}"] = gpu_us(
            lambda fast=fast: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                               use_fast_accum=fast))  # fmt: skip
        row[f"k_{tag}"] = gpu_us(lambda fast=fast: ga.fp8_gemm(a, w.t(), sa, sb, config=cfg, fast_accum=fast))
        row[f"cfg_{tag}"] = cfg
    row["eager"] = eager_us(lambda: ga.fp8_gemm(a, w.t(), sa, sb, config=cfg))
    row["eager_mm"] = eager_us(lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    out = ga.fp8_gemm(a, w.t(), sa, sb, config=cfg).double()
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


def _check(out: torch.Tensor, a, w, sa, sb, mm: torch.Tensor) -> str | None:
    """None when `out` is within 2x _scaled_mm's own error of the reference (bf16 of the fp32 GEMM)
    + one bf16 ulp of its largest value, else why. A wrong tile, a lost or doubled K-block is far
    outside that; a different rounding of the same sum is not."""
    ref = ga.gemm_allreduce_ref(a, w.t(), sa, sb).double()
    bound = 2 * (mm.double() - ref).abs().max().item() + 2.0**-7 * ref.abs().max().item()
    err = (out.double() - ref).abs().max().item()
    if not err <= bound:  # NaN-safe
        return f"max err {err:.3g} > {bound:.3g}"
    return None


def _sweep_one(cfg: ga.TileConfig, fast: bool, a, w, sa, sb, mm, rep: int) -> tuple[float | None, str]:
    """(us per call, "<regs> regs [<n> spills]") of one variant, or (None, why): a compile/launch
    failure or a wrong result."""
    try:
        a_, b_, sa_, sb_, m, n, k = ga._operands(a, w.t(), sa, sb)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
        kern = ga._launch_gemm(a_, b_, sa_, sb_, out, m, n, k, cfg, fast_accum=fast)  # fp8_gemm's launch
        torch.cuda.synchronize()
        spills = getattr(kern, "n_spills", 0)
        regs = f"{getattr(kern, 'n_regs', '?')} regs" + (f" {spills} spills" if spills else "")
        bad = _check(out, a, w, sa, sb, mm)
        if bad:
            return None, f"wrong: {bad}"
        t = triton.testing.do_bench_cudagraph(
            lambda: ga.fp8_gemm(a, w.t(), sa, sb, config=cfg, fast_accum=fast), rep=rep, return_mode="median"
        )
        return t * 1e3, regs
    except Exception as e:  # noqa: BLE001 -- one variant's failure must not end the sweep
        try:
            torch.cuda.synchronize()
        except RuntimeError:
            pass  # a sticky CUDA error: later variants report it too
        why = str(e).strip().splitlines()
        return None, f"failed: {type(e).__name__}: {why[-1][:120] if why else ''}"


def _cell(t: float | None, mm_t: float) -> str:
    return f"{t:8.1f} {mm_t / t:6.3f}" if t is not None else f"{'-':>8} {'-':>6}"


def sweep(m: int, rep: int = 10, device: str = "cuda") -> int:
    """Every candidate at every rank shape vs _scaled_mm (precise and fast) in this run."""
    configs = SWEEP_CONFIGS
    best = {}
    for name, (n, k) in SHAPES.items():
        a = torch.randn(m, k, device=device).to(ga.FP8)
        w = torch.randn(n, k, device=device).to(ga.FP8)
        sa = torch.tensor(0.02, device=device)
        sb = torch.tensor(0.03, device=device)
        flops = 2.0 * m * n * k
        mm, mm_us = {}, {}
        for fast in (False, True):

            def call(fast=fast, a=a, w=w, sa=sa, sb=sb):
                return torch._scaled_mm(
                    a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast
                )

            mm[fast] = call()
            mm_us[fast] = gpu_us(call)
        print(f"\n## {name} M={m} N={n} K={k}: _scaled_mm prec {mm_us[False]:.1f} us, "
              f"fast {mm_us[True]:.1f} us")  # fmt: skip
        print(f"{'config':44s} | {'prec us':>8} {'ratio':>6} | {'fast us':>8} {'ratio':>6} | note")
        res: dict[bool, list] = {False: [], True: []}
        for cfg in configs:
            t_p, why_p = _sweep_one(cfg, False, a, w, sa, sb, mm[False], rep)
            t_f, why_f = _sweep_one(cfg, True, a, w, sa, sb, mm[True], rep)
            for fast, t in ((False, t_p), (True, t_f)):
                if t is not None:
                    res[fast].append((t, cfg))
            notes = [f"prec {why_p}" if why_p else "", f"fast {why_f}" if why_f else ""]  # regs or why not
            print(
                f"{cfg.label():44s} | {_cell(t_p, mm_us[False])} | {_cell(t_f, mm_us[True])} | "
                f"{'; '.join(x for x in notes if x)}",
                flush=True,
            )
        best[name] = {
            fast: (min(res[fast], key=lambda r: r[0]) if res[fast] else None, mm_us[fast], flops)
            for fast in res
        }
    print("\nbest per shape (GPU us under CUDA graphs)")
    ok = True
    for fast in (False, True):
        tag = "fast" if fast else "prec"
        for name in SHAPES:
            r, mm_t, flops = best[name][fast]
            if r is None:
                ok = False
                print(f"{tag} {name:9s} no variant worked")
                continue
            t, cfg = r
            print(
                f"{tag} {name:9s} _scaled_mm {mm_t:7.1f} us  ours {t:7.1f} us  "
                f"{flops / t / 1e6:6.1f} TFLOP/s  ratio {mm_t / t:.3f}  {cfg.label()}"
            )
    if not ok:
        print("ratio: not every shape has a working variant")
        return 1
    for fast in (True, False):  # the goal (precise) LAST
        tot_mm = sum(best[nm][fast][1] for nm in SHAPES)
        tot = sum(best[nm][fast][0][0] for nm in SHAPES)
        worst = min(best[nm][fast][1] / best[nm][fast][0][0] for nm in SHAPES)
        tag = "fast accumulation" if fast else "default (fp32-promoted) accumulation"
        print(f"ratio kernel/_scaled_mm rate, best per shape (4 rank GEMMs, time-weighted, {tag}): "
              f"{tot_mm / tot:.3f} (worst shape {worst:.3f})")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=757)
    p.add_argument("--sweep", action="store_true", help="time every SWEEP_CONFIGS tiling at every shape")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    m = args.m
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} M={m}")
    if args.sweep:
        return sweep(m)
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
