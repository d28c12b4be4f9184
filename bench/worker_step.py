"""The worker step waterfall (the paper's table): plain path, then each switch added, in one run.

    python bench/worker_step.py                          # one TP=3 rank of prod57b on one GPU
    python bench/worker_step.py --preset tiny --device cpu --steps 3   # smoke test on CPU
    python bench/worker_step.py --no-full                # skip the full 60-head model

For every cumulative row (plain; +ring_cache+rope_at_write; +fp8_cache; +delta_rotation; +compile;
+triton_kernels; +cuda_graphs) it builds a fresh cache, prefills the window (first forward over
the conditioning + steps until the ring has wrapped), forces one position reset (timed apart) and
times ``--steps`` steady steps: diffusion ms/step (events around the 4 passes x blocks), cache-upkeep
ms/step and attention ms/step (sums of the events the model records around each cache update and
attention call; null under CUDA graphs, where events cannot sit inside the graph). In the same
run: the rank's floor (its FP8 block GEMMs with pre-quantized inputs + bf16 SDPA over the window
and the conditioning, 240 calls each), the telemetry on/off step-time ratio of the real session
loop, and the full model (all heads) ms/step and peak memory if it fits. Prints a table and, last,
the ratio of the best row against the plain path.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from worker.cache import make_cache
from worker.config import ModelShape, Switches, tp_rank_of
from worker.fp8 import FP8, FP8_MAX
from worker.model import DiT
from worker.session import ChunkRunner, Worker
from worker.telemetry import CpuTimer, CudaTimer, ListSink

ROWS = [
    ("plain", {}),
    ("+ring_cache+rope_at_write", {"ring_cache": True, "rope_at_write": True}),
    ("+fp8_cache", {"fp8_cache": True}),
    ("+delta_rotation", {"delta_rotation": True}),
    ("+compile", {"compile": True}),
    ("+triton_kernels", {"triton_kernels": True}),
    ("+cuda_graphs", {"cuda_graphs": True}),
]


def kernels_available() -> bool:
    try:
        import kernels.delta_rotate
        import kernels.fp8_attention
        import kernels.rope_fp8_write  # noqa: F401
    except ImportError:
        return False
    return True


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_row(model: DiT, sw: Switches, steps: int, cond_tokens: int):
    """(diffusion, upkeep, attention) ms per steady step, and the reset step's diffusion ms."""
    shape, dev = model.shape, model.device
    cuda = dev.type == "cuda"
    timer = CudaTimer() if cuda else CpuTimer()
    model.set_timer(timer)
    model.set_compile(sw.compile)
    cache = make_cache(shape, sw, dev, model.dtype)
    runner = ChunkRunner(model, sw.cuda_graphs)
    g = torch.Generator(device=dev).manual_seed(0)
    cond_kv = model.first_forward(torch.randn(cond_tokens, shape.d_model, generator=g, device=dev), cache)
    T, C = shape.new_tokens, shape.latent_channels
    fill = -(-(shape.window - cond_tokens) // T) + 1  # steps until the ring has wrapped
    marks = []
    for i in range(fill + 2 + steps):
        reset = i in (fill - 1, fill + 1)  # a warm-up reset (first calls compile), then one timed apart
        timer.take()
        start = time.perf_counter()
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        with timer.span("upkeep"):
            cache.begin_step(T, reset=reset)
        _out, graphed = runner(torch.randn(T, C, generator=g, device=dev), cache, cond_kv)
        cache.end_step()
        if cuda:
            e1.record()
            marks.append((i, reset, graphed, (e0, e1), timer.take()))
        else:
            marks.append((i, reset, graphed, (time.perf_counter() - start) * 1e3, timer.take()))
    sync(dev)
    model.set_timer(type(model.timer)())
    rows = []
    for i, reset, graphed, t, spans in marks[fill:]:  # the window is full and wrapped from here
        if cuda:
            diff = t[0].elapsed_time(t[1])
            sums = {k: sum(a.elapsed_time(b) for a, b in v) for k, v in spans.items()}
        else:
            diff, sums = t, spans
        rows.append((reset, diff, None if graphed else sums.get("upkeep", 0.0),
                     None if graphed else sums.get("attention", 0.0)))
    steady = [r for r in rows if not r[0]]
    reset_ms = next(r[1] for r in rows if r[0])
    med = lambda xs: statistics.median(xs) if xs and xs[0] is not None else None
    del cache, runner, cond_kv
    return med([r[1] for r in steady]), med([r[2] for r in steady]), med([r[3] for r in steady]), reset_ms


def measure_floor(model: DiT, cond_tokens: int, reps: int = 3) -> float:
    """The rank's GEMM + attention floor per step: FP8 (or dtype) block GEMMs on pre-quantized
    inputs + SDPA over the full window and over the conditioning, for all blocks x passes."""
    s, dev = model.shape, model.device
    T, d, H, hd = s.new_tokens, s.d_model, s.heads, s.head_dim
    blk = model.blocks[0]
    lins = [(blk.qkv, d), (blk.o, H * hd), (blk.cq, d), (blk.co, H * hd), (blk.up, d), (blk.down, s.ffn_local)]
    xs = []
    for lin, k in lins:
        x = torch.randn(T, k, device=dev, dtype=model.dtype)
        if lin.scale is not None:
            xs.append(((x.float() / 2).clamp(-FP8_MAX, FP8_MAX).to(FP8), torch.tensor(2.0, device=dev)))
        else:
            xs.append((x, None))
    q = torch.randn(1, H, T, hd, device=dev, dtype=model.dtype)
    kv = torch.randn(2, 1, H, s.window, hd, device=dev, dtype=model.dtype)
    ckv = torch.randn(2, 1, H, cond_tokens, hd, device=dev, dtype=model.dtype)

    def one_block():
        for (lin, _), (x, xs_) in zip(lins, xs, strict=True):
            if lin.scale is not None:
                torch._scaled_mm(x, lin.w.t(), scale_a=xs_, scale_b=lin.scale, out_dtype=torch.bfloat16)
            else:
                x @ lin.w.t()
        F.scaled_dot_product_attention(q, kv[0], kv[1])
        F.scaled_dot_product_attention(q, ckv[0], ckv[1])

    calls = s.n_blocks * s.passes
    one_block()
    best = float("inf")
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(calls):
                one_block()
            e1.record()
            sync(dev)
            best = min(best, e0.elapsed_time(e1))
        else:
            for _ in range(calls):
                one_block()
            best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def telemetry_ratio(model: DiT, sw: Switches, steps: int, cond_tokens: int, rounds: int = 2):
    """Step time of the real session loop with telemetry on / off (alternating sessions)."""
    w = Worker(model.shape, device=model.device, model=model)
    per = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            s = w.run_session(steps=steps, realtime=False, switches=sw, sink=ListSink(), telemetry=on,
                              cond_tokens=cond_tokens, seed=1)
            per[on].append(s.loop_s / s.steps * 1e3)
    on, off = min(per[True]), min(per[False])
    return on, off, on / off


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="prod57b")
    ap.add_argument("--tp", type=int, default=3, help="measure one rank of this TP size")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6, help="steady steps timed per row")
    ap.add_argument("--cond-tokens", type=int, default=None)
    ap.add_argument("--rows", default=None, help="comma-separated row names to run (default: all)")
    ap.add_argument("--no-full", action="store_true", help="skip the full model (all heads)")
    ap.add_argument("--telemetry-steps", type=int, default=24)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    base = ModelShape.from_name(args.preset)
    shape = tp_rank_of(base, args.tp) if args.tp > 1 else base
    cond = args.cond_tokens or min(1024, shape.cond_tokens[1])
    t0 = time.perf_counter()
    model = DiT(shape, dev)
    sync(dev)
    build_s = time.perf_counter() - t0
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"# {base.name} rank 0 of TP={args.tp}: {shape.heads} heads, FFN {shape.ffn_local}, {shape.n_blocks} blocks,"
          f" {shape.new_tokens} new tokens, {shape.window}-slot window, {shape.passes} passes; {name};"
          f" torch {torch.__version__}; weights {'fp8' if model.blocks[0].qkv.scale is not None else model.dtype}"
          f" built in {build_s:.1f} s; conditioning {cond} tokens", flush=True)
    floor = measure_floor(model, cond)
    print(f"# floor (block GEMMs + SDPA, {shape.n_blocks * shape.passes} calls): {floor:.1f} ms/step", flush=True)

    have_kernels = kernels_available() and dev.type == "cuda"
    sw = {}
    results = []
    print(f"{'row':<28}{'diffusion ms':>13}{'upkeep ms':>11}{'attention ms':>14}{'reset step ms':>15}"
          f"{'x floor':>9}{'vs plain':>10}", flush=True)
    plain_ms = None
    for row, add in ROWS:
        sw = {**sw, **add}
        if args.rows and row not in args.rows.split(","):
            continue
        if row == "+triton_kernels" and not have_kernels:
            print(f"{row:<28}  (skipped: kernels not importable or not on CUDA)")
            continue
        if row in ("+cuda_graphs", "+compile") and dev.type != "cuda":
            print(f"{row:<28}  (skipped: CUDA only)")
            continue
        t_row = time.perf_counter()
        try:
            diff, upkeep, attn, reset_ms = measure_row(model, Switches.from_mapping(sw), args.steps, cond)
        except Exception as e:  # noqa: BLE001 - a row that fails is reported, the waterfall goes on
            print(f"{row:<28}  FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
            sw = {k: v for k, v in sw.items() if k not in add}
            continue
        plain_ms = plain_ms or diff
        results.append((row, diff, upkeep, attn, reset_ms))
        print(f"{row:<28}{fmt(diff):>13}{fmt(upkeep):>11}{fmt(attn):>14}{fmt(reset_ms):>15}"
              f"{diff / floor:>9.2f}{plain_ms / diff:>9.2f}x   ({time.perf_counter() - t_row:.0f} s)", flush=True)
        gc.collect()

    best_sw = Switches.from_mapping(sw)  # every switch that worked: the production configuration
    if args.telemetry_steps:
        on, off, ratio = telemetry_ratio(model, best_sw, args.telemetry_steps, cond)
        print(f"# telemetry on/off (session loop, {args.telemetry_steps} steps, switches [{best_sw.encode()}]):"
              f" {on:.2f} / {off:.2f} ms/step = {ratio:.4f}", flush=True)

    if not args.no_full and args.tp > 1 and dev.type == "cuda":
        del model
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            full = DiT(base, dev)
            full_sw = best_sw
            diff, upkeep, attn, reset_ms = measure_row(full, full_sw, max(2, args.steps // 2), cond)
            peak = torch.cuda.max_memory_allocated(dev) / 2**30
            print(f"# full {base.name} ({base.n_heads} heads) on one GPU, switches [{full_sw.encode()}]: "
                  f"{diff:.1f} ms/step, upkeep {fmt(upkeep)} ms, attention {fmt(attn)} ms, reset step "
                  f"{reset_ms:.1f} ms, peak memory {peak:.1f} GiB", flush=True)
        except torch.OutOfMemoryError as e:
            print(f"# full {base.name}: does not fit ({str(e)[:120]})")
        except Exception as e:  # noqa: BLE001 - reported, the table above stands
            print(f"# full {base.name}: FAILED {type(e).__name__}: {str(e)[:200]}")

    if results:
        best = min(results, key=lambda r: r[1])
        print(f"best row {best[0]}: {best[1]:.1f} ms/step vs plain {results[0][1]:.1f} ms/step "
              f"= {results[0][1] / best[1]:.2f}x (upkeep {fmt(results[0][2])} -> {fmt(best[2] if best[2] is not None else min((r[2] for r in results if r[2] is not None), default=None))} ms/step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
