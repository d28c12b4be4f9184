"""Soak: one worker process serving many sessions back to back, the cyclic collector off throughout.

    python bench/soak.py                                    # one TP=3 rank of prod57b, 100 sessions
    python bench/soak.py --sessions 100 --min-seconds 2 --max-seconds 4 --telemetry-file $OUT/soak.arrows
    python bench/soak.py --preset tiny --device cpu --sessions 5 --min-seconds 0.5 --max-seconds 1   # smoke

Phases, in one process:
1. ``Worker.warm`` with every production switch (all on, ``fused_allreduce`` off as in the fleet's
   defaults): its time and the graphs it captured.
2. Steady step, same run: the warm path's graphed steady step against today's path (a session on its
   own cache, graphs captured once its window is full), alternating ``--ab-rounds`` times, not real
   time; the median diffusion ms of the steady steps (window full) of each.
3. ``--sessions`` real-time sessions of random prompt length and random length in
   [--min-seconds, --max-seconds], with ``gc.disable()`` from before the first session to after the
   last. Per session: allocated and reserved GPU memory after it, late chunks, time to first frame,
   records sent and dropped, graphs captured during it.
The records go through the real shipping client into ``--telemetry-file`` (replay them into a
collector with ``livestep replay``), or into memory when none is given.

Prints the table, then the summary (memory after session N vs after session 5, late chunks in all,
TTFF p50/p95, records dropped), and last the steady-step ratio warm / today's path.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.session_args import add_session_args, steady_ms
from worker.config import ModelShape, Switches, tp_rank_of
from worker.session import Worker
from worker.telemetry import ListSink

CHUNK_S = 4 / 24


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="prod57b")
    ap.add_argument("--tp", type=int, default=None,
                    help="the rank shape of a TP group of this size (rank 0); default 3 for prod57b, else 1")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--min-seconds", type=float, default=10.0, help="shortest session (streamed seconds)")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="longest session (streamed seconds)")
    ap.add_argument("--long-every", type=int, default=0,
                    help="every Nth session lasts --long-seconds instead (0: none), so short soaks still cross "
                         "position resets (one every reset_every steps)")
    ap.add_argument("--long-seconds", type=float, default=8.0, help="length of those sessions")
    add_session_args(ap, "soak", ab_steps=40)
    args = ap.parse_args()

    base = ModelShape.from_name(args.preset)
    tp = args.tp if args.tp is not None else (3 if args.preset == "prod57b" else 1)
    shape = tp_rank_of(base, tp) if tp > 1 else base
    cuda = args.device.startswith("cuda")
    sw = Switches.all_on(fused_allreduce=False) if cuda else Switches.all_on(
        fused_allreduce=False, cuda_graphs=False, compile=False, triton_kernels=False, decoder_own_gpu=False)
    w = Worker(shape, device=args.device, worker_id=args.worker_id, release=args.release)
    mem = (lambda: (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())) if cuda else (lambda: (0, 0))
    print(f"# {shape.name}: {args.device}, switches [{sw.encode()}], buckets {w.cond_buckets}", flush=True)

    t0 = time.perf_counter()
    warm = w.warm(sw)
    print(f"# warm: {warm.runner.n_graphs} graphs in {warm.seconds:.1f} s "
          f"({time.perf_counter() - t0:.1f} s with the first compiles)", flush=True)

    # -- steady step: warm path vs today's (own cache, lazy capture), same run ---------------------
    fill = (shape.window // shape.new_tokens) + 2
    cond = shape.cond_tokens[1]
    ratios, warm_ms, cold_ms = [], [], []
    for _ in range(args.ab_rounds):
        for path in ("cold", "warm"):
            saved = w.warmed
            if path == "cold":
                w.warmed = None  # today's path: the session's own cache, graphs once the window is full
            sink = ListSink()
            w.run_session(steps=fill + args.ab_steps, realtime=False, switches=sw, sink=sink, cond_tokens=cond)
            w.warmed = saved
            (cold_ms if path == "cold" else warm_ms).append(steady_ms(sink, fill))
        ratios.append(warm_ms[-1] / cold_ms[-1])
    if ratios:
        print(f"# steady step: warm {statistics.median(warm_ms):.2f} ms, today's path "
              f"{statistics.median(cold_ms):.2f} ms (rounds {', '.join(f'{r:.4f}' for r in ratios)})", flush=True)

    # -- the soak ------------------------------------------------------------------------------
    rng = random.Random(args.seed)
    rows = []
    gc.collect()
    gc.disable()
    client = None
    try:
        from collector.client import NullClient, TelemetryClient

        if args.telemetry_file:
            client = TelemetryClient(None, telemetry_file=args.telemetry_file)
        for n in range(1, args.sessions + 1):
            seconds = rng.uniform(args.min_seconds, args.max_seconds)
            if args.long_every and n % args.long_every == 0:
                seconds = args.long_seconds
            L = rng.randint(*shape.cond_tokens)
            sink = client if client is not None else NullClient()  # NullClient: keeps nothing, loses nothing
            before = sink.stats()
            s = w.run_session(seconds=seconds, switches=sw, cond_tokens=L, sink=sink, preroll=args.preroll,
                              session_id=f"soak-{args.seed}-{n:04d}")
            if cuda:
                torch.cuda.synchronize()
            alloc, res = mem()
            rows.append({"n": n, "steps": s.steps, "cond": L, "ff": s.first_forward_tokens, "alloc": alloc, "res": res,
                             "late": s.late_chunks, "ttff": s.ttff_ms,
                             # sent: acked or filed; the summary's dropped is the shared client's total so far
                             # plus the session's own path's: this session's share is the difference
                             "sent": sink.stats()["sent"] + sink.stats()["filed"] - before["sent"] - before["filed"],
                             "dropped": s.telemetry_dropped - before["dropped"],
                             "resets": s.resets, "captures": s.graph_captures, "misses": s.graph_misses, "warm": s.warm})
            r = rows[-1]
            print(f"{n:4d} {r['steps']:5d} {L:5d} {r['ff']:5d} {alloc / 2**30:9.3f} {res / 2**30:9.3f} "
                  f"{r['late']:4d} {r['ttff'] or float('nan'):8.1f} {r['sent']:7d} {r['dropped']:4d} "
                  f"{r['captures']:3d} {r['misses']:3d}", flush=True)
    finally:
        if client is not None:
            client.close(timeout_s=30.0)
        gc.enable()

    print("\n   n steps  cond    ff alloc GiB  resv GiB late  ttff ms    sent drop cap miss  (above)")
    k = min(5, len(rows))
    a5, aN = rows[k - 1]["alloc"], rows[-1]["alloc"]
    ttff = sorted(r["ttff"] for r in rows if r["ttff"] is not None)
    p = (lambda q: ttff[min(len(ttff) - 1, int(q * len(ttff)))]) if ttff else (lambda q: float("nan"))
    print(f"\nsessions {len(rows)}, cyclic GC off throughout")
    print(f"allocated after session {k}: {a5 / 2**30:.3f} GiB; after session {len(rows)}: {aN / 2**30:.3f} GiB "
          f"(+{(aN - a5) / 2**20:.1f} MiB; goal <= +256 MiB)")
    print(f"reserved after session {k}: {rows[k - 1]['res'] / 2**30:.3f} GiB; after {len(rows)}: "
          f"{rows[-1]['res'] / 2**30:.3f} GiB")
    print(f"late chunks: {sum(r['late'] for r in rows)} in {len(rows)} sessions (from the first played chunk on; "
          f"{sum(r['resets'] for r in rows)} position resets among their steps)")
    print(f"time to first frame: p50 {p(0.5):.1f} ms, p95 {p(0.95):.1f} ms, max {ttff[-1] if ttff else float('nan'):.1f} ms")
    print(f"records sent {sum(r['sent'] for r in rows)}, dropped {sum(r['dropped'] for r in rows)}; "
          f"graphs captured during sessions {sum(r['captures'] for r in rows)}, misses {sum(r['misses'] for r in rows)}")
    if ratios:
        print(f"steady step ratio warm / today's path: {statistics.median(ratios):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
