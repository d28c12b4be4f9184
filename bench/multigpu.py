"""Issue 8: the paper's layout on one host, TP=N denoising ranks + a decoder GPU, fused all-reduce vs NCCL.

    torchrun --standalone --nproc-per-node=3 bench/multigpu.py --preset prod57b --steps 1000 \\
        [--collector http://host:8000 --token T]     # 4 GPUs visible: ranks on 0-2, GPU 3 decodes
    torchrun --standalone --nproc-per-node=2 bench/multigpu.py --preset prod57b   # TP=2 + decoder
    python bench/multigpu.py --preset small --steps 60                             # world size 1

Prints (rank 0): (1) per call at the steady shape, the fused FP8 GEMM + all-reduce vs GEMM then NCCL
all-reduce (the worker's plain path: ``_scaled_mm`` + ``all_reduce``) and the share of the all-reduce
hidden; (2) the fused-buffer registry over >= 50 first-forward prompt lengths, with the fix and with
the fault switch ``buffer_per_shape``; (3) sessions through worker/session.py: diffusion ms/step and
step period p50/p99 (reset steps apart), all optimizations on and each listed switch's plain path,
streamed to the collector when ``--collector`` is given. LAST: the per-call ratio NCCL path / fused.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import gemm_allreduce as ga
from worker import parallel
from worker.buffers import BufferRegistry
from worker.cache import make_cache
from worker.config import ModelShape, Switches
from worker.parallel import gemm_allreduce
from worker.telemetry import ListSink


def log(place, *a) -> None:
    if place.rank == 0:
        print(*a, flush=True)


def _max_over_ranks(x: float, group) -> float:
    if group is None:
        return x
    t = torch.tensor([x], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0])


GRAPHS = True  # per-call timings under CUDA graphs (the worker runs with cuda_graphs); --eager: off


def time_us(fn, iters: int, group) -> float:
    """Median us per call, the slowest rank's; ranks in lockstep. Under CUDA graphs: 10 calls per
    graph, replayed; eager: CUDA events around each call (host launch cost included when it shows)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group=group)
    per = 1
    run = fn
    if GRAPHS:
        per = 10
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(per):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        if group is not None:
            dist.barrier(group=group)
        run = graph.replay
        iters = max(5, iters // per)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return _max_over_ranks(float(np.median([s.elapsed_time(e) for s, e in ev])) * 1e3 / per, group)


def per_call(place, group, shape: ModelShape, iters: int) -> list[dict]:
    """Fused GEMM + all-reduce vs _scaled_mm then NCCL all_reduce at the steady shape (M new tokens)."""
    m, n = shape.new_tokens, shape.d_model
    ops = (("attn_out", shape.heads * shape.head_dim), ("ffn_down", shape.ffn_local))
    return [_per_call_one(name, m, n, k, group, iters) for name, k in ops]


def _per_call_one(name: str, m: int, n: int, k: int, group, iters: int) -> dict:
    a = torch.randn(m, k, device="cuda").to(ga.FP8)
    w = torch.randn(n, k, device="cuda").to(ga.FP8)
    sa = torch.tensor(0.02, device="cuda")
    sb = torch.tensor(0.03, device="cuda")
    reg = BufferRegistry(group=group, steady_m=m)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    def mm():
        return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    def nccl_path():
        c = mm()
        if group is not None:
            dist.all_reduce(c, group=group)

    def allreduce_only():
        if group is not None:
            dist.all_reduce(out, group=group)

    def fused():
        gemm_allreduce(a, w.t(), sa, sb, group, registry=reg)

    got = gemm_allreduce(a, w.t(), sa, sb, group, registry=reg).float()
    ref = ga.gemm_allreduce_ref(a, w.t(), sa, sb, group).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    def ours():
        ga.fp8_gemm(a, w.t(), sa, sb, config=ga.FUSED_CONFIG)

    t = {"gemm_us": time_us(mm, iters, group), "ours_gemm_us": time_us(ours, iters, group),
         "allreduce_us": time_us(allreduce_only, iters, group),
         "nccl_path_us": time_us(nccl_path, iters, group), "fused_us": time_us(fused, iters, group)}  # fmt: skip
    ar = t["allreduce_us"]
    # the share of the all-reduce the fused kernel hides, against its own GEMM done alone
    hidden = (t["ours_gemm_us"] + ar - t["fused_us"]) / ar if group is not None and ar > 0 else None
    return {"op": name, "m": m, "n": n, "k": k, **t, "hidden": hidden, "rel_err": err,
            "registered": len(reg)}  # fmt: skip


def registry_growth(place, worker, shape: ModelShape, lengths: list[int]) -> list[dict]:
    """First forwards of many prompt lengths (+ one steady step each): the registry, fix vs fault."""
    tp, model = worker.tp, worker.model
    out = []
    for fault in (False, True):
        sw = Switches.all_on(cuda_graphs=False, compile=False).with_(buffer_per_shape=fault)
        tp.registry = BufferRegistry(group=tp.group, steady_m=shape.new_tokens)  # a fresh one per phase
        tp.apply_switches(sw)
        sizes, used = [], []
        g = torch.Generator(device=model.device).manual_seed(0)
        for length in lengths:
            cache = make_cache(shape, sw, model.device, model.dtype)
            cond = torch.randn(length, shape.d_model, generator=g, device=model.device)
            cond_kv = model.first_forward(cond, cache)
            cache.begin_step(shape.new_tokens)
            noise = torch.randn(shape.new_tokens, shape.latent_channels, generator=g, device=model.device)
            model.denoise_chunk(noise, cache, cond_kv)
            cache.end_step()
            del cache, cond_kv
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            sizes.append(len(tp.registry))
            used.append(total - free)
        out.append({"buffer_per_shape": fault, "lengths": len(set(lengths)), "size_first": sizes[0],
                    "size_last": sizes[-1], "size_max": max(sizes), "gpu_used_growth_mb": (used[-1] - used[0]) / 2**20,
                    "registry_mb": tp.registry.nbytes / 2**20})  # fmt: skip
    tp.registry = BufferRegistry(group=tp.group, steady_m=shape.new_tokens)
    return out


class TeeSink(ListSink):
    """Keeps the rows (for percentiles) and ships them to the collector too."""

    def __init__(self, client=None):
        super().__init__()
        self.client = client

    def put(self, kind: str, row: dict) -> None:
        super().put(kind, row)
        if self.client is not None:
            self.client.put(kind, row)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.client.flush(timeout_s) if self.client is not None else True

    def close(self, timeout_s: float = 5.0) -> bool:
        return self.client.close(timeout_s) if self.client is not None else True


def _pcts(xs: list[float]) -> tuple[float | None, float | None]:
    return (float(np.percentile(xs, 50)), float(np.percentile(xs, 99))) if xs else (None, None)


def sessions(place, worker, args, client) -> list[dict]:
    """All optimizations on, then each listed switch's plain path, one session each (as fast as possible)."""
    base = Switches.all_on().with_(**{name: False for name in args.off.split(",") if name})
    runs = [("all on" + (f" but {args.off}" if args.off else ""), base, args.steps)]
    for name in [s for s in args.plain.split(",") if s]:
        runs.append((f"{name} off", base.with_(**{name: False}), args.plain_steps))
    out = []
    rng = random.Random(1)
    for label, sw, steps in runs:
        sink = TeeSink(client) if place.decodes else None
        s = worker.run_session(steps=steps, switches=sw, realtime=False, sink=sink,
                               cond_tokens=rng.randint(*worker.shape.cond_tokens))  # fmt: skip
        if not place.decodes:
            continue
        rows = sink.rows["step"][args.warmup_steps :]
        steady = [r for r in rows if not r["reset_step"]]
        resets = [r for r in rows if r["reset_step"]]
        d50, d99 = _pcts([r["diffusion_ms"] for r in steady])
        p50, p99 = _pcts([r["step_period_ms"] for r in steady])
        r50, _ = _pcts([r["diffusion_ms"] for r in resets])
        out.append({"run": label, "steps": s.steps, "diffusion_p50": d50, "diffusion_p99": d99, "period_p50": p50,
                    "period_p99": p99, "reset_steps": len(resets), "reset_diffusion_p50": r50,
                    "decode_ms": s.mean_decode_ms, "buffers_registered": s.buffers_registered,
                    "avg_fps": s.avg_fps, "session_id": s.session_id})  # fmt: skip
    return out


def _f(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="prod57b")
    p.add_argument("--steps", type=int, default=1000, help="steps of the all-on session")
    p.add_argument("--plain", default="fused_allreduce,decoder_own_gpu,cuda_graphs",
                   help="switches whose plain path gets its own session (comma-separated)")
    p.add_argument("--plain-steps", type=int, default=200)
    p.add_argument("--off", default="", help="switches kept off in every session (comma-separated)")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the percentiles")
    p.add_argument("--lengths", type=int, default=50, help="distinct first-forward prompt lengths")
    p.add_argument("--iters", type=int, default=200, help="timed calls per per-call figure")
    p.add_argument("--collector", default=None)
    p.add_argument("--token", default=None)
    p.add_argument("--skip", default="", help="sections to skip: percall,registry,sessions")
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    p.add_argument("--eager", action="store_true", help="per-call timings launched eagerly, not from CUDA graphs")
    args = p.parse_args()
    global GRAPHS
    GRAPHS = not args.eager
    if not torch.cuda.is_available():
        print("needs CUDA GPUs (torchrun, one process per denoising GPU; the next GPU decodes)")
        return 2
    place, group, control, device = parallel.init_group(decoder_own_gpu=True)
    shape = ModelShape.from_name(args.preset)
    log(place, f"# {torch.cuda.get_device_name()} x{torch.cuda.device_count()} torch {torch.__version__}; "
               f"preset {shape.name}, TP={place.tp}, decoder on GPU {place.decoder_gpu}")  # fmt: skip
    worker = parallel.TPWorker(shape, place, group, device=device, control=control, worker_id="multigpu",
                               release="bench")  # fmt: skip
    results: dict = {"tp": place.tp, "preset": shape.name, "gpus": torch.cuda.device_count()}
    skip = set(args.skip.split(","))
    client = None
    if args.collector and place.decodes:
        from collector.client import TelemetryClient

        client = TelemetryClient(args.collector, token=args.token)

    if "percall" not in skip:
        results["per_call"] = per_call(place, group, worker.shape, args.iters)
        log(place, f"\nus per call ({'CUDA graphs' if GRAPHS else 'eager'}); gemm = _scaled_mm, ours = the fused "
                   f"kernel's GEMM alone; hidden = share of the all-reduce hidden against ours")  # fmt: skip
        log(place, f"{'gemm':9s} {'M':>5} {'N':>6} {'K':>6} {'gemm':>7} {'ours':>7} {'allreduce':>9} "
                   f"{'gemm+NCCL':>9} {'fused':>7} {'hidden':>7} {'rel err':>8}")  # fmt: skip
        for r in results["per_call"]:
            log(place, f"{r['op']:9s} {r['m']:5d} {r['n']:6d} {r['k']:6d} {r['gemm_us']:7.1f} {r['ours_gemm_us']:7.1f} "
                       f"{r['allreduce_us']:9.1f} {r['nccl_path_us']:9.1f} {r['fused_us']:7.1f} "
                       f"{_f(r['hidden'], '.0%'):>7} {r['rel_err']:8.1e}")
    if "registry" not in skip:
        lo, hi = shape.cond_tokens
        lengths = random.Random(2).sample(range(lo, hi + 1), args.lengths)
        results["registry"] = registry_growth(place, worker, worker.shape, lengths)
        log(place, f"\n{'buffer_per_shape':16s} {'lengths':>7} {'size first':>10} {'size last':>9} "
                   f"{'registry MB':>11} {'GPU used growth MB':>18}")  # fmt: skip
        for r in results["registry"]:
            log(place, f"{r['buffer_per_shape']!s:16s} {r['lengths']:7d} {r['size_first']:10d} {r['size_last']:9d} "
                       f"{r['registry_mb']:11.1f} {r['gpu_used_growth_mb']:18.1f}")  # fmt: skip
    if "sessions" not in skip:
        results["sessions"] = sessions(place, worker, args, client)
        log(place, f"\n{'run':22s} {'steps':>5} {'diff p50':>8} {'diff p99':>8} {'period p50':>10} {'period p99':>10} "
                   f"{'resets':>6} {'reset p50':>9} {'decode':>7} {'buffers':>7}")  # fmt: skip
        for r in results.get("sessions", []):
            log(place, f"{r['run']:22s} {r['steps']:5d} {_f(r['diffusion_p50']):>8} {_f(r['diffusion_p99']):>8} "
                       f"{_f(r['period_p50']):>10} {_f(r['period_p99']):>10} {r['reset_steps']:6d} "
                       f"{_f(r['reset_diffusion_p50']):>9} {_f(r['decode_ms']):>7} {r['buffers_registered']:7d}")
    if client is not None:
        client.close(timeout_s=10.0)
        log(place, f"\ncollector {args.collector}: sent {client.sent}, dropped {client.dropped}, "
                   f"failed batches {client.failed_batches}")  # fmt: skip
    if args.out and place.rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    if results.get("per_call"):
        r = max(results["per_call"], key=lambda r: r["k"])
        log(place, f"\nratio per call, GEMM then NCCL / fused ({r['op']}, TP={place.tp}): "
                   f"{r['nccl_path_us'] / r['fused_us']:.3f}")  # fmt: skip
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
