"""Flip: every runtime switch flipped off and back on at random steps of live real-time sessions.

    python bench/flip.py --telemetry-file $OUT/flip.arrows          # one TP=3 rank of prod57b, production switches
    python bench/flip.py --preset tiny --device cpu                  # smoke (CPU: graphs, compile, Triton are no-ops)

Phases, in one process (one warm worker, ``flip="background"``, worker/readiness.py):
1. ``Worker.warm`` with the production switches (``fused_allreduce`` off: it needs a TP group of >= 2 GPUs),
   then each flipped switch's neighbour prepared (compiles only): time and the reserved memory it leaves.
2. Steady step, same run: sessions not real time on the warm worker with the readiness machinery
   (``flip="background"``) and without it (``"inline"``), alternating ``--ab-rounds`` times; the median
   diffusion ms of their steady steps.
3. Per switch (a neighbour: ``ring_cache`` off takes ``delta_rotation`` with it, ``rope_at_write`` off the
   ring and FP8 cache too): a real-time session on the production switches whose control plane flips it
   off at a random step; the next session (on the flipped switches: its time to first frame) flips it
   back on at a random step; the session after that (production again) gives the second time to first
   frame. Prompt lengths cycle over every bucket. A flip session runs until ``--after`` chunks past
   the swap (or ``--max-seconds``).
Per switch and direction: late chunks and stall from the poll to ``--after`` chunks past the swap, poll
-> first step on the new configuration, the time of the build swapped in (the quick one), the next session's
TTFF, whether it started warm, its late chunks and steps run eagerly (it starts on the quick state until the
complete one is swapped in), time out of service, and the reserved memory the build held above the steady level (peak) and
after the session. Last line: the steady-step ratio with / without the readiness machinery.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.session_args import add_session_args, steady_ms
from worker.config import ModelShape, Switches, tp_rank_of
from worker.readiness import RUNTIME_SWITCHES, neighbour
from worker.session import Worker
from worker.switches import ScriptedFlip
from worker.telemetry import ListSink

PRODUCTION_FLIPS = ("static_scales", "triton_kernels", "fp8_cache", "cuda_graphs", "compile", "delta_rotation",
                    "decoder_own_gpu", "ring_cache", "rope_at_write")  # fused_allreduce: TP >= 2 GPUs only


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="prod57b")
    ap.add_argument("--tp", type=int, default=None,
                    help="the rank shape of a TP group of this size (rank 0); default 3 for prod57b, else 1")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--switches", default=None, help="comma-separated switches to flip (default: every production one)")
    ap.add_argument("--after", type=int, default=24, help="chunks past the swap a flip session runs")
    ap.add_argument("--max-seconds", type=float, default=90.0,
                    help="a flip session's longest run (it ends earlier, --after chunks past the swap)")
    ap.add_argument("--next-seconds", type=float, default=1.5, help="the session after the last flip back")
    ap.add_argument("--budget-s", type=float, default=None, help="flip no further switch after this many seconds")
    add_session_args(ap, "flip", ab_steps=30)
    args = ap.parse_args()
    t_start = time.perf_counter()
    logging.basicConfig(level=logging.WARNING, format="# %(levelname)s %(name)s: %(message)s")
    logging.getLogger("livestep.worker.readiness").setLevel(logging.INFO)  # a failed build's traceback

    base = ModelShape.from_name(args.preset)
    tp = args.tp if args.tp is not None else (3 if args.preset == "prod57b" else 1)
    shape = tp_rank_of(base, tp) if tp > 1 else base
    cuda = args.device.startswith("cuda")
    sw = Switches.all_on(fused_allreduce=False) if cuda else Switches.all_on(
        fused_allreduce=False, triton_kernels=False, decoder_own_gpu=False)
    names = tuple(args.switches.split(",")) if args.switches else PRODUCTION_FLIPS
    bad = sorted(set(names) - set(RUNTIME_SWITCHES))
    if bad:
        ap.error(f"--switches {bad} unknown; valid: {', '.join(RUNTIME_SWITCHES)}")
    w = Worker(shape, device=args.device, worker_id=args.worker_id, release=args.release)
    reserved = torch.cuda.memory_reserved if cuda else (lambda: 0)
    peak = torch.cuda.max_memory_reserved if cuda else (lambda: 0)
    print(f"# {shape.name}: {args.device}, switches [{sw.encode()}], buckets {w.cond_buckets}, flips {list(names)}",
          flush=True)

    t0 = time.perf_counter()
    warm = w.warm(sw)
    print(f"# warm: {warm.runner.n_graphs} graphs in {warm.seconds:.1f} s ({time.perf_counter() - t0:.1f} s with "
          f"the first compiles); reserved {reserved() / 2**30:.3f} GiB", flush=True)
    t0 = time.perf_counter()
    w.readiness.prepare_neighbours(sw, names)
    res_steady = reserved()
    each = ", ".join(f"[{k}] {v:.1f} s" for k, v in w.readiness.prepared.items())
    print(f"# neighbours prepared in {time.perf_counter() - t0:.1f} s ({each}); skipped "
          f"{w.readiness.skipped or 'none'}; reserved {res_steady / 2**30:.3f} GiB", flush=True)

    # -- steady step with / without the readiness machinery, same run ------------------------------
    fill = (shape.window // shape.new_tokens) + 2
    cond = shape.cond_tokens[1]
    ms = {"background": [], "inline": []}
    ratios = []
    for _ in range(args.ab_rounds):
        for mode in ("inline", "background"):
            w.readiness.mode = mode
            sink = ListSink()
            w.run_session(steps=fill + args.ab_steps, realtime=False, switches=sw, sink=sink, cond_tokens=cond)
            ms[mode].append(steady_ms(sink, fill))
        ratios.append(ms["background"][-1] / ms["inline"][-1])
    w.readiness.mode = "background"
    if ratios:
        print(f"# steady step: with readiness {statistics.median(ms['background']):.2f} ms, without "
              f"{statistics.median(ms['inline']):.2f} ms", flush=True)

    # -- the flips ---------------------------------------------------------------------------------
    rng = random.Random(args.seed)
    buckets = list(w.cond_buckets)
    lo = shape.cond_tokens[0]
    n_session = [0]

    def prompt() -> int:
        b = buckets[n_session[0] % len(buckets)]
        prev = ([lo - 1] + buckets)[buckets.index(b)]
        return rng.randint(max(lo, prev + 1), b)

    client = None
    if args.telemetry_file:
        from collector.client import TelemetryClient

        client = TelemetryClient(None, telemetry_file=args.telemetry_file)

    def session(switches: Switches, change: dict | None, label: str):
        n_session[0] += 1
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sink = client if client is not None else ListSink()
        kw = {}
        ctl = None
        if change is not None:
            ctl = ScriptedFlip(w, change, rng.randint(4, 12), args.after, round(args.max_seconds * 6))
            kw = {"steps": ctl.max_steps + 1, "switch_source": ctl.poll, "stop_when": ctl.stop}
        else:
            kw = {"seconds": args.next_seconds}
        s = w.run_session(switches=switches, cond_tokens=prompt(), sink=sink, preroll=args.preroll,
                          session_id=f"flip-{args.seed}-{n_session[0]:03d}-{label}", **kw)
        # no device synchronize here: a build may be capturing on its thread (a device-wide sync invalidates a
        # capture in any mode); the allocator's counters are host-side
        return s, peak(), reserved()

    rows, failed = [], []
    gc.collect()
    gc.disable()
    try:
        for name in names:
            if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
                print(f"# budget of {args.budget_s:.0f} s spent: {name} and after not flipped", flush=True)
                break
            try:
                off = neighbour(sw, name)
            except Exception as e:  # noqa: BLE001 - an invalid neighbour is reported, not fatal
                print(f"# {name}: no valid neighbour ({e})", flush=True)
                continue
            to_off = sw.changes_to(off)
            to_on = {k: not v for k, v in to_off.items()}
            done = []  # (session, peak, reserved) of off, on, next: what ran before a failure is still reported
            try:
                done.append(session(sw, to_off, f"{name}-off"))
                done.append(session(off, to_on, f"{name}-on"))  # the next session of the off flip
                done.append(session(sw, None, f"{name}-next"))  # the next session of the on flip
            except Exception as e:  # noqa: BLE001 - a failed session is a row of the table, not a lost run
                print(f"# {name}: session {len(done) + 1} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                failed.append(f"{name}: {type(e).__name__}")
            for direction, i in (("off", 0), ("on", 1)):
                if len(done) < i + 2:
                    continue
                (s, pk, res), (nxt, _, _) = done[i], done[i + 1]
                f = next((f for f in s.flips if f["step"] >= 0), {})  # the control plane's flip
                row = {"switch": name, "dir": direction, "late": f.get("late_chunks"), "stall": f.get("stall_ms"),
                       "to_new": f.get("to_new_config_ms"), "build": f.get("build_ms"), "apply": f.get("apply_ms"),
                       "mode": f.get("mode"), "ttff": nxt.ttff_ms, "next_warm": nxt.warm,
                       "oos": s.out_of_service_s * 1e3, "held_peak": (pk - res_steady) / 2**20,
                       "held_after": (res - res_steady) / 2**20, "res": res, "session_late": s.late_chunks,
                       "misses": s.graph_misses, "captures": s.graph_captures,
                       "next_late": nxt.late_chunks, "next_misses": nxt.graph_misses, "error": f.get("error")}
                rows.append(row)
                print(_line(row), flush=True)
    except KeyboardInterrupt:  # timeout -s INT: the table of what ran still prints
        print("# interrupted: the flips so far", flush=True)
        failed.append("interrupted")
    finally:
        gc.enable()
        if not w.readiness.wait(120):  # a build thread still capturing at exit aborts the interpreter
            print("# a build was still running 120 s after the last session", flush=True)
        if client is not None:
            client.close(timeout_s=10.0)

    print("\n| switch | dir | late chunks | stall ms | poll → new config ms | build ms | swap ms | next TTFF ms | next warm "
          "| next late / eager steps | out of service ms | held peak MiB | held after MiB | captures in session |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_line(r, md=True))
    late = sum(r["late"] or 0 for r in rows)
    stall = sum(r["stall"] or 0 for r in rows)
    ttff = sorted(r["ttff"] for r in rows if r["ttff"] is not None)
    to_new = sorted(r["to_new"] for r in rows if r["to_new"] is not None)
    pct = max((r["held_peak"] for r in rows), default=0.0) * 2**20 / max(res_steady, 1) * 100
    print(f"\nflips {len(rows)}: late chunks {late}, stall {stall:.1f} ms; poll -> new config max "
          f"{to_new[-1] if to_new else float('nan'):.0f} ms; next-session TTFF p95 "
          f"{ttff[min(len(ttff) - 1, int(0.95 * len(ttff)))] if ttff else float('nan'):.1f} ms; out of service "
          f"{sum(r['oos'] for r in rows):.1f} ms; build memory peak {pct:.1f}% of the steady reserved "
          f"{res_steady / 2**30:.3f} GiB; wall {time.perf_counter() - t_start:.0f} s")
    print(f"# builds: {w.readiness.builds}")
    if failed:
        print(f"# failed or cut short: {', '.join(failed)}")
    if ratios:
        print(f"steady step ratio with / without readiness machinery: {statistics.median(ratios):.4f}")
    return 1 if failed else 0


def _line(r: dict, md: bool = False) -> str:
    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    cells = [r["switch"], r["dir"], f(r["late"], "d"), f(r["stall"]), f(r["to_new"], ".0f"), f(r["build"], ".0f"),
             f(r["apply"]), f(r["ttff"]), "yes" if r["next_warm"] else "no", f"{r['next_late']} / {r['next_misses']}",
             f(r["oos"]), f(r["held_peak"], ".0f"),
             f(r["held_after"], ".0f"), f(r["captures"], "d")]
    err = f"  build error: {r['error'][:160]}" if r.get("error") else ""
    return "| " + " | ".join(cells) + " |" if md else "  ".join(str(c) for c in cells) + f"  ({r['mode']}){err}"


if __name__ == "__main__":
    raise SystemExit(main())
