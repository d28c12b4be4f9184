"""Turn latency per playout policy, side by side in one real-time session of the worker's loop.

    python bench/turns.py --preset tiny --device cpu --turns 6 --every 0.8,1.6    # CPU smoke test, ~30 s
    python bench/turns.py --turns 100 --every 1,2                                 # H200: one TP=3 rank of prod57b

One session of the real loop (worker/session.py, real time: the player takes a chunk every 166.7 ms from
a buffer of 4) gets ``3 x --turns`` turns (worker/turns.py), the policies taking turns (keep,
drop_unplayed, trim, keep, ...) so each meets the same load; speaking and listening alternate, each
turn's conditioning length uniform in the shape's range, the gaps uniform in ``--every`` seconds. The
worker is warmed first (``Worker.warm``: compile once, every CUDA graph captured per conditioning bucket),
as in production. Per policy: turns, turn
latency p50 / p95 (arrival of the conditioning -> the first played frame that uses it, as the worker's
player clocks it), each part's median (wait for the step in progress, cross-attention recompute,
generation of the first chunk, queue), chunks dropped, late chunks (those delivered after a turn of
that policy and before the next turn) and the stall they cost the player. Last: each policy's median
latency against ``keep`` (the plain path) in the same run.

On a warm worker a turn's conditioning is padded to its bucket and its cross K/V copied into the windows the
bucket's graphs read (worker/session.py ``_turn_cross``): no capture. ``--no-warm``: the session's own cache
and lazy capture, where a turn's new windows are recaptured at its first step (in its generation time).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from worker.config import ModelShape, Switches, parse_switch_args
from worker.session import Session, Worker
from worker.telemetry import ListSink
from worker.turns import POLICIES, TurnSchedule

PLAIN_CPU = ["cuda_graphs=off", "compile=off", "triton_kernels=off", "decoder_own_gpu=off"]


def schedule(turns_per_policy: int, every: tuple[float, float], tokens: tuple[int, int], seed: int,
             policies: tuple[str, ...]) -> list[tuple[float, int, bool, str]]:
    rng = random.Random(seed)
    out, t = [], 1.5
    for k in range(turns_per_policy * len(policies)):
        out.append((t, rng.randint(*tokens), k % 2 == 0, policies[k % len(policies)]))
        t += rng.uniform(*every)
    return out


def _q(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1] if len(xs) > 1 else xs[0]


def summarize(rows: list[dict], log, policies: tuple[str, ...]) -> list[dict]:
    """Per policy: latency quantiles, parts' medians, drops, and the late chunks after its turns."""
    arrivals = sorted((r["_arrived"], r["policy"]) for r in rows)
    late: dict[str, list[float]] = {p: [] for p in policies}
    prev_stall = 0.0
    for e in log:
        if e.dropped:
            continue
        stall, prev_stall = e.stall_s - prev_stall, e.stall_s
        if not e.late:
            continue
        owner = [p for t, p in arrivals if t <= e.arrived]
        if owner:
            late[owner[-1]].append(stall * 1e3)
    out = []
    for p in policies:
        mine = [r for r in rows if r["policy"] == p]
        if not mine:
            continue
        lat = [r["latency_ms"] for r in mine]
        out.append({
            "policy": p, "turns": len(mine), "p50_ms": _q(lat, 0.5), "p95_ms": _q(lat, 0.95),
            **{f"{part}_ms": statistics.median(r[f"{part}_ms"] for r in mine)
               for part in ("wait", "recompute", "generation", "queue")},
            "dropped": sum(r["dropped_chunks"] for r in mine), "late_chunks": len(late[p]),
            "stall_ms": sum(late[p]),
        })
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="prod57b")
    ap.add_argument("--tp", type=int, default=None, help="one rank of this TP size (default: 3 for prod57b, else 1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--turns", type=int, default=100, help="turns per policy")
    ap.add_argument("--every", default="2,5", help="seconds between turns: lo,hi (uniform)")
    ap.add_argument("--tokens", default=None, help="conditioning length range lo,hi (default: the shape's)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--switch", action="append", default=[], metavar="NAME=on|off",
                    help="changes to the production switches (every one on, fused_allreduce off; on CPU also "
                         "cuda_graphs, compile, triton_kernels, decoder_own_gpu off)")
    ap.add_argument("--no-warm", action="store_true", help="no Worker.warm: lazy capture in the session")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the table and every turn record here")
    a = ap.parse_args()
    policies = tuple(a.policies.split(","))
    every = tuple(float(x) for x in a.every.split(","))
    tp = a.tp or (3 if a.preset == "prod57b" else 1)
    shape = ModelShape.from_name(a.preset)
    tokens = tuple(int(x) for x in a.tokens.split(",")) if a.tokens else shape.cond_tokens
    cuda = a.device.startswith("cuda")
    base = Switches.all_on(fused_allreduce=False)
    switches = parse_switch_args([*([] if cuda else PLAIN_CPU), *a.switch], base=base)
    w = Worker(a.preset, device=a.device, tp=tp)
    t0 = time.perf_counter()
    if not a.no_warm:
        w.warm(switches)
    warm_s = time.perf_counter() - t0
    items = schedule(a.turns, every, tokens, a.seed, policies)
    sink = ListSink()
    # steps for the schedule and 3 s more, plus the chunks the drops skip (the producer runs ahead by those)
    steps = int((items[-1][0] + 3.0) * 6) + int(4.5 * sum(it[3] != "keep" for it in items))
    sess = Session(w, steps=steps, switches=switches, sink=sink, seed=a.seed + 1,
                   turns=TurnSchedule(items), playout_policy=policies[0])
    s = sess.run()
    rows = sink.rows["turn"]
    for r in rows:  # perf_counter arrival, for the late chunks' attribution
        r["_arrived"] = sess.tel._perf0 + (r["ts"] - sess.tel._wall0).total_seconds()
    table = summarize(rows, sess.playout.log, policies)
    print(f"# {a.preset} rank of tp={tp} on {w.gpu_kind}, switches [{s.switches}], {s.steps} steps, "
          f"{len(rows)} turns of {len(items)} sent, warm-up {warm_s:.1f} s ({'warm' if s.warm else 'not warm'}), "
          f"session {s.wall_s:.1f} s, "
          f"mean diffusion {s.mean_diffusion_ms or 0:.1f} ms/step, {s.late_chunks} late chunks in all")
    head = ["policy", "turns", "p50_ms", "p95_ms", "wait_ms", "recompute_ms", "generation_ms", "queue_ms",
            "dropped", "late_chunks", "stall_ms"]
    print(" | ".join(head))
    for row in table:
        print(" | ".join(f"{row[h]:.1f}" if isinstance(row[h], float) else str(row[h]) for h in head))
    base = next((r for r in table if r["policy"] == "keep"), None)
    if base is not None:
        print("p50 latency vs keep (same run): " + ", ".join(
            f"{r['policy']} {r['p50_ms'] / base['p50_ms']:.3f}x" for r in table if r["policy"] != "keep"))
    if a.json:
        clean = [{k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in r.items()} for r in rows]
        Path(a.json).write_text(json.dumps({"table": table, "turns": clean}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
