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
and the conditioning, 240 calls each; launched one by one, the issue's floor, and as one CUDA graph, the
way the graphed step runs; bench/graph_floor.py times each op both ways), the telemetry on/off step-time
ratio of the real session loop, and the full model (all heads) ms/step and peak memory if it fits. Prints a table and, last,
the ratio of the best row against the plain path.

The row +fused_blocks is +cuda_graphs with the blocks' elementwise chains compiled
(``model.BlockFusion``: residual + LayerNorm + FP8 quantization, the query's RoPE, GELU + quantization);
the rows before it run with ``fuse_blocks`` off, so both are measured in the same run. The next row,
+row_scales, quantizes activations per token (``DiT.act_scales = "row"``: no global amax, one pass);
+static_scales quantizes with static per-tensor scales (``DiT.act_scales = "static"``: calibrated on the
first forward and chunk, then fixed: no reduction in the chains, per-tensor GEMM scaling); the last,
+triton_chains, runs those chains as the Triton kernels of kernels/norm_fp8.py and kernels/gelu_fp8.py
(``DiT.triton_chains``; the rows before it: the compiled chains). The last, +attention_fp8_dots, is the
production step (+triton_chains) with that switch on: the FP8 attention kernel's all-FP8 precision pair
(kernels/fp8_attention.py ``FAST``; outside the quality band, off in production) -- its ratio to
+triton_chains is printed last when both ran (``--rows +triton_chains,+attention_fp8_dots``). Telemetry
and the full model run the fastest row's settings without the switches production keeps off.

"upkeep GPU ms": the GPU time of one step's cache upkeep with the row's ops (begin_step + the 240
``cache.update`` calls on the row's full window, new K/V fixed) captured as one CUDA graph and
replayed: free of the host launch stalls that the eager rows' event spans include, and defined
under CUDA graphs too, where events cannot sit inside the step's graph.

``--floor-rounds N``: the floor and the fastest row measured again, alternately, N times in the same
process; the median ratio and its range say how much of a difference is the machine's drift (the floor
alone moved 107-117 ms between two H200 leases on 2026-11-29, the step 129-133).

Telemetry on/off: whole sessions of the real loop (``Session``, all switches of the best row),
alternating on/off for ``--telemetry-rounds`` rounds; each session runs its window fill and graph
capture, then ``--telemetry-steps`` steady steps; the figure is the median step period (wall time
between chunk deliveries) over the steady steps only, with host syncs counted per step
(``set_sync_debug_mode("warn")``, attributed to the open step).

Saturation probe (with static_scales): one more session of the real loop with a probe every
``--probe-every`` steps; the probed steps replay the probed graph, so their diffusion ms against the plain
graphed steps' is the probe's cost, printed with what it amortizes to at the session default (one step
in 64), the step that captures both graphs (once per session, when the window is full), the first
probed step, and the largest ``fp8_saturated`` seen.

``--profile``: torch.profiler (CUDA activity; CUPTI sees the kernels inside CUDA graphs) over
``--profile-replays`` replays of the +cuda_graphs and +fused_blocks rows: GPU time per step by group
(GEMMs, attention, upkeep/rope/quant, norms/elementwise, other) and the top kernels.

    python3 bench/worker_step.py --steps 6 --telemetry-steps 40 --profile --no-full --trace-dir $OUT
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from collector.switch_names import PRODUCTION_OFF
from worker.cache import make_cache
from worker.config import ModelShape, Switches, tp_rank_of
from worker.fp8 import FP8, FP8_MAX
from worker.model import DiT
from worker.session import SATURATION_EVERY, ChunkRunner, Session, Worker
from worker.telemetry import ListSink
from worker.timers import CpuTimer, CudaTimer

ROWS = [
    ("plain", {}),
    ("+ring_cache+rope_at_write", {"ring_cache": True, "rope_at_write": True}),
    ("+fp8_cache", {"fp8_cache": True}),
    ("+delta_rotation", {"delta_rotation": True}),
    ("+compile", {"compile": True}),
    ("+triton_kernels", {"triton_kernels": True}),
    ("+cuda_graphs", {"cuda_graphs": True}),
    ("+fused_blocks", {}),  # model.fuse_blocks: BlockFusion under compile (not a switch)
    ("+row_scales", {}),  # model.act_scales = "row": per-token FP8 activation scales, one pass
    ("+static_scales", {"static_scales": True}),  # model.act_scales = "static": calibrated per-tensor scales
    ("+triton_chains", {}),  # model.triton_chains: the static chains as Triton kernels, not compiled
    ("+attention_fp8_dots", {"attention_fp8_dots": True}),  # FP8 attention's all-FP8 pair (off in production)
]
FUSED_ROW = "+fused_blocks"
ROW_SCALES_ROW = "+row_scales"
STATIC_ROW = "+static_scales"
CHAINS_ROW = "+triton_chains"
# the model settings (not switches) of the rows after +cuda_graphs: fuse_blocks, act_scales, triton_chains
FAST_ROW = "+attention_fp8_dots"
MODEL_ROWS = {FUSED_ROW: (True, "tensor", False), ROW_SCALES_ROW: (True, "row", False),
              STATIC_ROW: (True, "static", False), CHAINS_ROW: (True, "static", True),
              FAST_ROW: (True, "static", True)}
PLAIN_MODEL = (False, "tensor", False)
FUSED_ROWS = tuple(MODEL_ROWS)
PROFILED_ROWS = ("+cuda_graphs", *FUSED_ROWS)

# kernel name -> group, first match wins (names lower-cased)
GROUPS = [
    ("attention", re.compile(r"attn|attention|flash|fmha|sdpa|softmax")),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|scaled_mm|splitk|\bmm\b|addmm")),
    ("norms/elementwise", re.compile(r"layer_norm|layernorm|res_ln|gelu_fp8")),
    ("upkeep/rope/quant", re.compile(r"rope|fp8|float8|e4m3|quant|vector_norm|absmax|maxops|normtwo|norminf|"
                                     r"index_copy|index_put|scatter|delta|rotate|remainder|arange|cos|sin")),
    ("norms/elementwise", re.compile(r"elementwise|gelu|add|mul|div|copy|cat|neg|roll|triton_|fill|reduce")),
]


def kernel_group(name: str) -> str:
    n = name.lower()
    return next((g for g, rx in GROUPS if rx.search(n)), "other")


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


def upkeep_gpu_ms(model: DiT, cache, reps: int = 5) -> float | None:
    """GPU ms of one step's cache upkeep with this cache's ops: begin_step + passes x blocks
    ``cache.update`` as one CUDA graph (warmed on a side stream first). Leaves the cache's book
    advanced: call it last on a cache that is thrown away. None off CUDA."""
    if model.device.type != "cuda":
        return None
    s = model.shape
    g = torch.Generator(device=model.device).manual_seed(7)
    kv = torch.randn(2, s.heads, s.new_tokens, s.head_dim, generator=g, device=model.device).to(model.dtype)

    def step():
        cache.begin_step(s.new_tokens)
        for _ in range(s.passes):
            for b in range(s.n_blocks):
                cache.update(b, kv[0], kv[1])
        cache.end_step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    del graph
    return statistics.median(times)


def fill_steps(shape: ModelShape, cond_tokens: int) -> int:
    """Steps after the first forward until the window is full (ceil of the slots left / new tokens)."""
    return -(-(shape.window - cond_tokens) // shape.new_tokens)


def measure_row(model: DiT, sw: Switches, steps: int, cond_tokens: int, settings=PLAIN_MODEL,
                profile_replays: int = 0):
    """(diffusion, upkeep, attention) ms per steady step, the reset step's diffusion ms, the torch
    profiler over ``profile_replays`` more steady steps (None without), and the upkeep GPU ms.
    ``settings``: the model's (fuse_blocks, act_scales, triton_chains) for the row."""
    shape, dev = model.shape, model.device
    cuda = dev.type == "cuda"
    timer = CudaTimer() if cuda else CpuTimer()
    model.set_timer(timer)
    model.fuse_blocks, model.act_scales, model.triton_chains = settings
    # every row compiles afresh: the chains of earlier rows (other act_scales) would otherwise count
    # against dynamo's recompile limit (8 per function) and push a later row's chain back to eager
    torch._dynamo.reset()
    model.set_compile(sw.compile, triton=sw.triton_kernels)
    if model.triton_chains and model.blocks and model.blocks[0].fusion is not model._fusions.get("triton"):
        raise RuntimeError("the Triton chains are not installed (triton_kernels off, or Triton missing)")
    cache = make_cache(shape, sw, dev, model.dtype)
    runner = ChunkRunner(model, sw.cuda_graphs)
    g = torch.Generator(device=dev).manual_seed(0)
    cond_kv = model.first_forward(torch.randn(cond_tokens, shape.d_model, generator=g, device=dev), cache)
    T, C = shape.new_tokens, shape.latent_channels
    fill = fill_steps(shape, cond_tokens) + 1  # steps until the ring has wrapped
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
    prof = None
    if profile_replays:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(profile_replays):
                cache.begin_step(T)
                runner(torch.randn(T, C, generator=g, device=dev), cache, cond_kv)
                cache.end_step()
            sync(dev)
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
    del runner, cond_kv
    try:
        upkeep_gpu = upkeep_gpu_ms(model, cache)
    except Exception as e:  # noqa: BLE001 - the row's other figures stand
        print(f"#   upkeep graph failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        upkeep_gpu = None
    del cache
    return (med([r[1] for r in steady]), med([r[2] for r in steady]), med([r[3] for r in steady]), reset_ms,
            prof, upkeep_gpu)


def kernel_times(prof, cuda: bool) -> list[tuple[str, float, int]]:
    """(name, total us, calls) per kernel (CUDA: every device event CUPTI saw, graph replays
    included; CPU: aten ops' self time, for the smoke test)."""
    acc: dict[str, list] = {}
    if cuda:
        for e in prof.profiler.kineto_results.events():
            if e.device_type() != torch.autograd.DeviceType.CUDA:
                continue
            a = acc.setdefault(e.name(), [0.0, 0])
            a[0] += e.duration_ns() / 1e3
            a[1] += 1
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                acc[e.key] = [e.self_cpu_time_total, e.count]
    return sorted(((k, v[0], v[1]) for k, v in acc.items()), key=lambda r: -r[1])


def print_profile(row: str, prof, cuda: bool, replays: int, step_ms: float | None, top: int = 25) -> None:
    ks = kernel_times(prof, cuda)
    total = sum(k[1] for k in ks) / 1e3 / replays
    groups: dict[str, list[float]] = {}
    for name, us, n in ks:
        g = groups.setdefault(kernel_group(name), [0.0, 0])
        g[0] += us / 1e3 / replays
        g[1] += n / replays
    unit = "GPU" if cuda else "CPU self"
    print(f"# profile {row}: {replays} steady steps, {unit} time {total:.1f} ms/step in"
          f" {sum(k[2] for k in ks) / replays:.0f} kernels/step"
          + (f"; step {step_ms:.1f} ms -> {step_ms - total:.1f} ms/step not covered by kernels (gaps)"
             if step_ms and cuda else ""), flush=True)
    for g, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"#   {g:<20}{ms:>9.1f} ms/step {100 * ms / max(total, 1e-9):>5.1f}%  {n:>7.0f} kernels/step")
    print(f"#   top {top} kernels (ms/step, calls/step, group):")
    for name, us, n in ks[:top]:
        print(f"#   {us / 1e3 / replays:>8.2f} {n / replays:>6.0f}  {kernel_group(name):<18} {name[:110]}")


def floor_ops(model: DiT, cond_tokens: int) -> dict:
    """The rank's floor as named ops, one block's worth: FP8 (or dtype) GEMMs of block 0's weights on
    pre-quantized inputs, SDPA over the full window and over the conditioning (bench/graph_floor.py times
    them apart)."""
    s, dev = model.shape, model.device
    T, d, H, hd = s.new_tokens, s.d_model, s.heads, s.head_dim
    blk = model.blocks[0]
    ops = {}
    for name, lin, k in (("qkv", blk.qkv, d), ("o", blk.o, H * hd), ("cq", blk.cq, d), ("co", blk.co, H * hd),
                         ("up", blk.up, d), ("down", blk.down, s.ffn_local)):
        x = torch.randn(T, k, device=dev, dtype=model.dtype)
        if lin.scale is not None:
            xq, two = (x.float() / 2).clamp(-FP8_MAX, FP8_MAX).to(FP8), torch.tensor(2.0, device=dev)
            op = lambda xq=xq, two=two, lin=lin: torch._scaled_mm(
                xq, lin.w.t(), scale_a=two, scale_b=lin.scale, out_dtype=torch.bfloat16)
        else:
            op = lambda x=x, lin=lin: x @ lin.w.t()
        ops[f"gemm {name} {T}x{k}x{lin.w.shape[0]}"] = op
    q = torch.randn(1, H, T, hd, device=dev, dtype=model.dtype)
    kv = torch.randn(2, 1, H, s.window, hd, device=dev, dtype=model.dtype)
    ckv = torch.randn(2, 1, H, cond_tokens, hd, device=dev, dtype=model.dtype)
    ops[f"sdpa window {s.window}"] = lambda: F.scaled_dot_product_attention(q, kv[0], kv[1])
    ops[f"sdpa conditioning {cond_tokens}"] = lambda: F.scaled_dot_product_attention(q, ckv[0], ckv[1])
    return ops


def time_calls(fn, calls: int, dev: torch.device, reps: int = 3, graph: bool = False) -> float:
    """Best of ``reps`` runs of ``calls`` x fn, ms: launched one by one, or with ``graph`` (CUDA)
    captured once as one CUDA graph and replayed (after one warm-up call either way)."""
    cuda = dev.type == "cuda"
    fn()
    g = None
    if graph and cuda:
        sync(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        g.replay()

    def run():
        if g is not None:
            g.replay()
        else:
            for _ in range(calls):
                fn()

    best = float("inf")
    for _ in range(reps):
        sync(dev)
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            run()
            e1.record()
            sync(dev)
            best = min(best, e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            run()
            best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def measure_floor(model: DiT, cond_tokens: int, reps: int = 3, graph: bool = False) -> float:
    """The rank's GEMM + attention floor per step: ``floor_ops`` for all blocks x passes, launched one by
    one (the floor of issue 6), or with ``graph`` (CUDA) captured as one CUDA graph and replayed like the
    graphed step: no launch gaps, so a floor the host cannot slow down."""
    ops = list(floor_ops(model, cond_tokens).values())
    return time_calls(lambda: [op() for op in ops], model.shape.n_blocks * model.shape.passes, model.device,
                      reps, graph)


def telemetry_ratio(model: DiT, sw: Switches, steady: int, cond_tokens: int, rounds: int = 3, stop=lambda: False):
    """Steady-state step period (median wall time between chunk deliveries, graphed steps after the
    capture) of the real session loop, telemetry on vs off, in alternating sessions; host syncs per
    session counted in warn mode and attributed to the open step."""
    shape, dev = model.shape, model.device
    w = Worker(shape, device=dev, model=model)
    fill = fill_steps(shape, cond_tokens)  # eager steps until the window is full
    n_steps = fill + 2 + steady
    per: dict[bool, list[float]] = {True: [], False: []}
    diff: dict[bool, list[float]] = {True: [], False: []}
    syncs: dict[bool, list[int]] = {True: [], False: []}
    syncs_all: dict[bool, list[int]] = {True: [], False: []}
    sites: dict[str, int] = {}
    ratios = []
    for r in range(rounds):
        if r and stop():  # past the deadline: the rounds done so far stand
            break
        meds = {}
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            sess = Session(w, steps=n_steps, realtime=False, switches=sw, sink=ListSink(), telemetry=on,
                           cond_tokens=cond_tokens, seed=1, sync_debug="warn")
            log: list[tuple[int, str]] = []

            def show(message, category, filename, lineno, file=None, line=None, sess=sess, log=log):
                if "synchroniz" in str(message).lower():  # set_sync_debug_mode's warning, not others
                    log.append((sess.tel.step, f"{Path(filename).name}:{lineno} {str(message)[:60]}"))

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                sess.run()
            st = sess.tel.stats
            g0 = st.graphed.index(True) if True in st.graphed else fill  # the capture step (or window full)
            first = g0 + 2  # its period holds the capture; the next one is the first graphed-to-graphed
            periods = st.period_ms[first:]
            per[on] += periods
            diff[on] += st.diffusion_ms[first:]
            meds[on] = statistics.median(periods)
            syncs[on].append(sum(1 for step, _ in log if step >= first))
            syncs_all[on].append(len(log))
            for step, site in log:
                if step >= first:
                    sites[site] = sites.get(site, 0) + 1
        ratios.append(meds[True] / meds[False])
    on, off = statistics.median(per[True]), statistics.median(per[False])
    return {"on": on, "off": off, "ratio": on / off, "ratios": ratios, "n": (len(per[True]), len(per[False])),
            "diff_on": statistics.median(diff[True]), "diff_off": statistics.median(diff[False]),
            "syncs": syncs, "syncs_all": syncs_all, "sites": sites}


def probe_cost(model: DiT, sw: Switches, steady: int, cond_tokens: int, every: int = 4) -> dict:
    """Diffusion ms of the capture step, of the probed steps (the probed graph, counting saturation) and
    of the plain graphed ones in one session of the real loop, after the window is full; the largest
    ``fp8_saturated`` seen."""
    shape, dev = model.shape, model.device
    w = Worker(shape, device=dev, model=model)
    fill = fill_steps(shape, cond_tokens)
    sink = ListSink()
    sess = Session(w, steps=fill + 2 + steady, realtime=False, switches=sw, sink=sink, cond_tokens=cond_tokens,
                   seed=1, saturation_every=every)
    sess.run()
    rows = sink.rows["step"][fill:]  # from the first step with the window full: the first probe captures
    graphed = sess.tel.stats.graphed[fill:]
    probed = [r["diffusion_ms"] for r in rows if r["fp8_saturated"] is not None]
    plain = [r["diffusion_ms"] for r, g in list(zip(rows, graphed, strict=True))[2:] if g and r["fp8_saturated"] is None]
    sat = [r["fp8_saturated"] for r in rows if r["fp8_saturated"] is not None]
    if len(probed) < 2 or not plain:
        raise RuntimeError(f"too few probed ({len(probed)}) or graphed ({len(plain)}) steady steps to compare")
    return {"capture": rows[0]["diffusion_ms"], "first": probed[0], "probed": statistics.median(probed[1:]),
            "graphed": statistics.median(plain), "n": (len(probed) - 1, len(plain)), "max_saturated": max(sat)}


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="prod57b")
    ap.add_argument("--tp", type=int, default=None, help="measure one rank of this TP size (default: 3 for prod57b, else 1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6, help="steady steps timed per row")
    ap.add_argument("--cond-tokens", type=int, default=None)
    ap.add_argument("--rows", default=None, help="comma-separated row names to run (default: all)")
    ap.add_argument("--no-full", action="store_true", help="skip the full model (all heads)")
    ap.add_argument("--telemetry-steps", type=int, default=40, help="steady steps per telemetry session (0: skip)")
    ap.add_argument("--telemetry-rounds", type=int, default=3, help="alternating on/off session pairs")
    ap.add_argument("--probe-every", type=int, default=4, help="saturation probe session: a probe every N steps (0: skip)")
    ap.add_argument("--floor-rounds", type=int, default=0,
                    help="then N rounds of (floor, fastest row) alternating: the ratio's spread (0: skip)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler breakdown of the graphed rows")
    ap.add_argument("--profile-replays", type=int, default=3)
    ap.add_argument("--trace-dir", default=None, help="also write each profile as a Chrome trace (.json.gz) here")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="skip what remains (rows, telemetry rounds, full model) once this many seconds passed")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    late = lambda: args.deadline_s is not None and time.perf_counter() - t_start > args.deadline_s
    dev = torch.device(args.device)
    base = ModelShape.from_name(args.preset)
    args.tp = args.tp or (3 if base.name == "prod57b" else 1)
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
    floor_graph = measure_floor(model, cond, graph=True) if dev.type == "cuda" else None
    print(f"# floor (block GEMMs + SDPA, {shape.n_blocks * shape.passes} calls): {floor:.1f} ms/step"
          + (f"; as one CUDA graph: {floor_graph:.1f} ms/step" if floor_graph else ""), flush=True)

    have_kernels = kernels_available() and dev.type == "cuda"
    sw = {}
    results = []
    print(f"{'row':<28}{'diffusion ms':>13}{'upkeep ms':>11}{'upkeep GPU ms':>15}{'attention ms':>14}"
          f"{'reset step ms':>15}{'x floor':>9}{'vs plain':>10}", flush=True)
    plain_ms = None
    cuda = dev.type == "cuda"
    profiled = PROFILED_ROWS if cuda else ("+delta_rotation",)  # CPU: the smoke test of the profile path
    profiles = []
    row_sw = {}  # row -> its switches
    for row, add in ROWS:
        sw = {**sw, **add}
        if args.rows and row not in args.rows.split(","):
            continue
        if row == "+triton_kernels" and not have_kernels:
            print(f"{row:<28}  (skipped: kernels not importable or not on CUDA)")
            continue
        if row in ("+cuda_graphs", "+compile", *FUSED_ROWS) and not cuda:
            print(f"{row:<28}  (skipped: CUDA only)")
            continue
        if row in FUSED_ROWS and not model.fp8:
            print(f"{row:<28}  (skipped: needs FP8 weights)")
            continue
        if late():
            print(f"{row:<28}  (skipped: past --deadline-s)")
            continue
        t_row = time.perf_counter()
        replays = args.profile_replays if (args.profile and row in profiled) else 0
        try:
            diff, upkeep, attn, reset_ms, prof, upkeep_gpu = measure_row(
                model, Switches.from_mapping(sw), args.steps, cond, MODEL_ROWS.get(row, PLAIN_MODEL),
                profile_replays=replays)
        except Exception as e:  # noqa: BLE001 - a row that fails is reported, the waterfall goes on
            print(f"{row:<28}  FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            sw = {k: v for k, v in sw.items() if k not in add}
            continue
        plain_ms = plain_ms or diff
        results.append((row, diff, upkeep, attn, reset_ms, upkeep_gpu))
        row_sw[row] = dict(sw)
        print(f"{row:<28}{fmt(diff):>13}{fmt(upkeep):>11}{fmt(upkeep_gpu, 2):>15}{fmt(attn):>14}{fmt(reset_ms):>15}"
              f"{diff / floor:>9.2f}{plain_ms / diff:>9.2f}x   ({time.perf_counter() - t_row:.0f} s)", flush=True)
        if prof is not None:
            profiles.append((row, prof, diff))
            if args.trace_dir:
                path = Path(args.trace_dir) / f"profile_{row.strip('+')}.json.gz"
                prof.export_chrome_trace(str(path))
        gc.collect()
    for row, prof, diff in profiles:
        print_profile(row, prof, cuda, args.profile_replays, diff)
    del profiles
    gc.collect()

    fastest = min(results, key=lambda r: r[1])[0] if results else None
    best_model = MODEL_ROWS.get(fastest, PLAIN_MODEL)  # the fastest row's model settings
    # every switch that worked: the production configuration (static_scales only if its row was fastest:
    # the sessions below set the model's activation scaling from the switch)
    best_sw = Switches.from_mapping({**{k: v for k, v in sw.items() if k not in PRODUCTION_OFF},
                                     "static_scales": best_model[1] == "static"})
    model.fuse_blocks, model.act_scales, model.triton_chains = best_model
    fused_ok = best_model[0]
    rounds = []
    if args.floor_rounds and fastest and not late():
        t_rounds = time.perf_counter()
        for _ in range(args.floor_rounds):
            fl = measure_floor(model, cond)
            fg = measure_floor(model, cond, graph=True) if cuda else fl  # CPU: no graphs, the same floor
            ms = measure_row(model, Switches.from_mapping(row_sw[fastest]), args.steps, cond, best_model)[0]
            rounds.append((fl, ms, ms / fl, fg))
        ratios = sorted(r[2] for r in rounds)
        graph_ratios = sorted(r[1] / r[3] for r in rounds)
        print(f"# floor rounds ({fastest}, floor then row, x {len(rounds)}): floor ms "
              f"{', '.join(f'{r[0]:.1f}' for r in rounds)}; step ms {', '.join(f'{r[1]:.1f}' for r in rounds)};"
              f" ratios {', '.join(f'{r[2]:.3f}' for r in rounds)}; median {statistics.median(ratios):.3f}"
              f" (range {ratios[0]:.3f}-{ratios[-1]:.3f})"
              + (f"; floor as one graph ms {', '.join(f'{r[3]:.1f}' for r in rounds)}, ratios"
                 f" {', '.join(f'{r[1] / r[3]:.3f}' for r in rounds)}, median {statistics.median(graph_ratios):.3f}"
                 if cuda else "") + f"  ({time.perf_counter() - t_rounds:.0f} s)", flush=True)
    if args.telemetry_steps and not late():
        t_tel = time.perf_counter()
        try:
            r = telemetry_ratio(model, best_sw, args.telemetry_steps, cond, args.telemetry_rounds,
                                stop=lambda: args.deadline_s is not None
                                and time.perf_counter() - t_start > args.deadline_s + 40)
            print(f"# telemetry on/off (sessions alternating x {len(r['ratios'])} rounds, steady graphed steps only:"
                  f" {r['n'][0]} / {r['n'][1]} steps; switches [{best_sw.encode()}]"
                  f"{', fused blocks' if fused_ok else ''}, {model.act_scales} activation scales): median step period {r['on']:.2f} / {r['off']:.2f}"
                  f" ms = {r['ratio']:.4f}; per-round ratios {', '.join(f'{x:.4f}' for x in r['ratios'])};"
                  f" diffusion (GPU) {r['diff_on']:.2f} / {r['diff_off']:.2f} ms; host syncs in steady steps:"
                  f" on {r['syncs'][True]}, off {r['syncs'][False]} (whole loop incl. fill and capture: on"
                  f" {r['syncs_all'][True]}, off {r['syncs_all'][False]})  ({time.perf_counter() - t_tel:.0f} s)",
                  flush=True)
            for site, n in sorted(r["sites"].items(), key=lambda kv: -kv[1])[:10]:
                print(f"#   steady-step sync x{n}: {site}")
        except Exception as e:  # noqa: BLE001 - reported, the table above stands
            print(f"# telemetry on/off: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)

    if args.probe_every and best_sw.static_scales and args.telemetry_steps and not late():
        t_probe = time.perf_counter()
        try:
            pc = probe_cost(model, best_sw, args.telemetry_steps, cond, args.probe_every)
            extra = pc["probed"] - pc["graphed"]
            print(f"# saturation probe (1 step in {args.probe_every}): probed steps {pc['probed']:.2f} ms diffusion"
                  f" (n={pc['n'][0]}), graphed steps {pc['graphed']:.2f} ms (n={pc['n'][1]}): {extra:+.2f} ms per"
                  f" probed step = {extra / SATURATION_EVERY['cuda']:+.3f} ms/step at the default 1 in"
                  f" {SATURATION_EVERY['cuda']}; the step that captures (window full) {pc['capture']:.0f} ms,"
                  f" the first probed step {pc['first']:.0f} ms;"
                  f" max fp8_saturated"
                  f" {pc['max_saturated']:.2e}  ({time.perf_counter() - t_probe:.0f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - reported, the table above stands
            print(f"# saturation probe: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)

    if not args.no_full and args.tp > 1 and dev.type == "cuda" and not late():
        del model
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            full = DiT(base, dev)
            full_sw = best_sw
            diff, upkeep, attn, reset_ms, _, _ = measure_row(full, full_sw, max(2, args.steps // 2), cond,
                                                             best_model)
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
        gpu_upkeep = [(r[0], r[5]) for r in results if r[5] is not None]
        if gpu_upkeep:
            print("# upkeep GPU ms/step (graph of one step's upkeep): "
                  + ", ".join(f"{name} {ms:.2f}" for name, ms in gpu_upkeep))
        rounds_note = (f" (floor rounds: median {statistics.median(r[2] for r in rounds):.3f}x)" if rounds else "")
        graph_note = f", {best[1] / floor_graph:.2f}x its graph {floor_graph:.1f}" if floor_graph else ""
        print(f"best row {best[0]}: {best[1]:.1f} ms/step = {best[1] / floor:.2f}x floor {floor:.1f}{rounds_note}"
              f"{graph_note}; "
              f"vs plain {results[0][1]:.1f} ms/step = {results[0][1] / best[1]:.2f}x")
        by_row = {r[0]: r[1] for r in results}
        if CHAINS_ROW in by_row and FAST_ROW in by_row:
            print(f"{FAST_ROW}: {by_row[FAST_ROW]:.1f} ms/step vs the production step ({CHAINS_ROW}) "
                  f"{by_row[CHAINS_ROW]:.1f} ms/step = {by_row[FAST_ROW] / by_row[CHAINS_ROW]:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
