"""Turn latency per playout policy, side by side in one run of the worker's real-time loop.

    python bench/turns.py --preset tiny --device cpu --turns 6 --every 0.8,1.6    # CPU smoke test, ~1 min
    python bench/turns.py --turns 100 --every 1,1.6 --policies keep,drop_unplayed,cover   # H200, ~8 min

One warm worker (``Worker.warm``: compile once, every CUDA graph captured per conditioning bucket, as in
production) runs one real-time session per policy (worker/session.py: the player takes a chunk every
166.7 ms from a buffer of 4), each with the policy's switch on (worker/turns.py) and the same schedule:
``--turns`` turns, speaking and listening alternating, each turn's conditioning length uniform in the
shape's range, the gaps uniform in ``--every`` seconds. A session per policy, so that each policy meets
the load it makes itself (``cover`` also keeps the device queue short: a session-wide behaviour).

Per policy: turns, turn latency p50 / p95 (arrival of the conditioning -> the first played frame that
uses it, as the worker's player clocks it), each part's median (wait for the step in progress,
cross-attention recompute, generation of the first chunk, queue); what the policy costs: chunks dropped
(made and never played), the GPU time thrown away with them (dropped x the session's mean diffusion),
late chunks and the stall they cost the player (the whole session's), and the session's mean diffusion
and step count. Each row prints as its session ends (a run cut short keeps its rows; ``--json`` is
rewritten after each). Last: each policy's median latency against ``keep`` (the plain path) in the same
run.

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
from worker.turns import POLICIES, TurnSchedule, check_policy

PLAIN_CPU = ["cuda_graphs=off", "compile=off", "triton_kernels=off", "decoder_own_gpu=off"]


def schedule(turns: int, every: tuple[float, float], tokens: tuple[int, int], seed: int) -> list[tuple[float, int, bool]]:
    """``turns`` turns from 1.5 s on (the player has started), speaking and listening alternating."""
    rng = random.Random(seed)
    out, t = [], 1.5
    for k in range(turns):
        out.append((t, rng.randint(*tokens), k % 2 == 0))
        t += rng.uniform(*every)
    return out


def _q(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1] if len(xs) > 1 else xs[0]


def summarize(policy: str, rows: list[dict], s) -> dict:
    """One policy's session: latency quantiles, the parts' medians, and what the policy cost."""
    lat = [r["latency_ms"] for r in rows]
    diffusion = s.mean_diffusion_ms or 0.0
    return {
        "policy": policy, "turns": len(rows), "p50_ms": _q(lat, 0.5) if lat else float("nan"),
        "p95_ms": _q(lat, 0.95) if lat else float("nan"),
        **{f"{part}_ms": statistics.median(r[f"{part}_ms"] for r in rows) if rows else float("nan")
           for part in ("wait", "recompute", "generation", "queue")},
        "dropped": s.dropped_chunks, "dropped_gpu_s": s.dropped_chunks * diffusion / 1e3,
        "late_chunks": s.late_chunks, "stall_ms": s.stall_ms, "steps": s.steps, "diffusion_ms": diffusion,
    }


class _LastTurnPlus:
    """Session.stop_when: true ``after_s`` seconds after every turn was taken and its record emitted."""

    def __init__(self, after_s: float):
        self.after_s, self.session, self.at = after_s, None, None

    def __call__(self) -> bool:
        if self.at is None and self.session.turns.settled():
            self.at = time.perf_counter()
        return self.at is not None and time.perf_counter() - self.at >= self.after_s


HEAD = ["policy", "turns", "p50_ms", "p95_ms", "wait_ms", "recompute_ms", "generation_ms", "queue_ms",
        "dropped", "dropped_gpu_s", "late_chunks", "stall_ms", "steps", "diffusion_ms"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="prod57b")
    ap.add_argument("--tp", type=int, default=None, help="one rank of this TP size (default: 3 for prod57b, else 1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--turns", type=int, default=100, help="turns per policy (one session each)")
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
    policies = tuple(check_policy(p) for p in a.policies.split(","))
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
    items = schedule(a.turns, every, tokens, a.seed)
    print(f"# {a.preset} rank of tp={tp} on {w.gpu_kind}, switches [{switches.model_switches().encode()}], "
          f"{len(items)} turns per policy, ~{items[-1][0] + 3:.0f} s a session, warm-up {warm_s:.1f} s", flush=True)
    print(" | ".join(HEAD), flush=True)
    table, records = [], {}
    for policy in policies:
        sink = ListSink()
        # at most: the schedule and 3 s more, plus the chunks drops skip (the producer runs ahead by those);
        # the session ends a second after its last turn's record
        steps = int((items[-1][0] + 3.0) * 6) + (0 if policy == "keep" else 6 * len(items))
        done = _LastTurnPlus(1.0)
        sess = Session(w, steps=steps, switches=switches.with_policy(policy), sink=sink, seed=a.seed + 1,
                       turns=TurnSchedule(items), stop_when=done)
        done.session = sess
        s = sess.run()
        rows = sink.rows["turn"]
        row = summarize(policy, rows, s)
        table.append(row)
        print(" | ".join(f"{row[h]:.1f}" if isinstance(row[h], float) else str(row[h]) for h in HEAD), flush=True)
        records[policy] = [{k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in r.items()} for r in rows]
        if a.json:
            Path(a.json).write_text(json.dumps({"table": table, "turns": records}, indent=1))
    base = next((r for r in table if r["policy"] == "keep"), None)
    if base is not None:
        print("p50 latency vs keep (same run): " + ", ".join(
            f"{r['policy']} {r['p50_ms'] / base['p50_ms']:.3f}x" for r in table if r["policy"] != "keep"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
