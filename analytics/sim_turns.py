"""Conversational turns for simulated sessions (worker/turns.py's ``turn`` record): when they come, what
each part of a turn's latency takes, and the release whose workers keep the whole playout buffer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from analytics.sim_fleet import STEP_BUDGET_MS, SimRelease, SimulationError, SimWorker

if TYPE_CHECKING:
    from analytics.sim_blocks import SessionPlans

TURN_EVERY_S = (2.0, 5.0)  # a turn every 2-5 s, alternating speaking and listening
DECODE_MS = 114.0
RECOMPUTE_MS_PER_TOKEN = 0.005  # the cross K/V of prod57b's 60 blocks on one TP=3 rank: ~5 ms per 1,000 tokens
TURN_DEPTH = 3  # chunks buffered at a turn's arrival (the steps' playout_depth)


def turn_plan(releases: list[SimRelease], turns: bool, turn_queue: str | None) -> np.ndarray | None:
    """Per release: True where its workers keep the whole buffer at a turn (``turn_queue``)."""
    names = [r.name for r in releases]
    if turn_queue is not None and turn_queue not in names:
        raise SimulationError(f"turn_queue {turn_queue!r} is not a simulated release; valid: {', '.join(names)}")
    if not turns:
        if turn_queue is not None:
            raise SimulationError("turn_queue needs turns=True")
        return None
    return np.array([n == turn_queue for n in names])


def simulate_turns(p: SessionPlans, keep_by_release: np.ndarray, fleet: list[SimWorker], releases: list[SimRelease],
                   rng: np.random.Generator) -> pa.Table:
    """The turns of planned sessions as one Arrow block of the `turn` kind: a turn every
    ``TURN_EVERY_S`` from 1-3 s in, alternating speaking (a few hundred conditioning tokens) and listening
    (a few dozen). Parts as the worker measures them: wait (the step in progress), recompute (per token),
    generation (the first chunk's step and decode), queue (``trim``: the rest of the chunk playing, now and
    then a short stall when the estimate is short; ``keep``: the buffered chunks too)."""
    cols: dict[str, list] = {k: [] for k in ("si", "t_ms", "turn", "speaking")}
    for si, (start, n, period) in enumerate(zip(p.start_ms, p.n_steps, p.period_ms, strict=True)):
        dur = n * period
        t, k = float(rng.uniform(1000, 3000)), 0
        while t < dur - 1000:
            cols["si"].append(si)
            cols["t_ms"].append(t)
            cols["turn"].append(k)
            cols["speaking"].append(k % 2 == 0)
            t += float(rng.uniform(*TURN_EVERY_S)) * 1000
            k += 1
    si = np.asarray(cols["si"], dtype=np.int64)
    m = len(si)
    worker = np.asarray(p.worker, dtype=np.int32)[si] if m else np.zeros(0, np.int32)
    rel = np.asarray(p.release, dtype=np.int32)[si] if m else np.zeros(0, np.int32)
    period = np.asarray(p.period_ms)[si] if m else np.zeros(0)
    speaking = np.asarray(cols["speaking"], dtype=bool)
    t_ms = np.asarray(cols["t_ms"])
    keep = keep_by_release[rel] if m else np.zeros(0, bool)
    tokens = np.where(speaking, np.clip(rng.lognormal(np.log(300), 0.5, m), 16, 2048),
                      rng.integers(4, 65, m)).astype(np.int64)
    wait = rng.uniform(0, 1, m) * period
    recompute = tokens * RECOMPUTE_MS_PER_TOKEN * np.exp(rng.normal(0, 0.1, m))
    generation = (period + DECODE_MS) * np.exp(rng.normal(0, 0.03, m))
    rest = rng.uniform(0, 1, m) * STEP_BUDGET_MS  # what is left of the chunk playing
    short = rng.random(m) < 0.02  # trim's estimate fell short: a stall instead of a queue
    stall = np.where(~keep & short, rng.uniform(5, 60, m), 0.0)
    queue = np.where(keep, rest + (TURN_DEPTH - 1) * STEP_BUDGET_MS * np.exp(rng.normal(0, 0.02, m)),
                     np.where(short, 0.0, rest))
    latency = wait + recompute + generation + queue
    start_ms = np.asarray(p.start_ms, dtype=np.int64)[si] if m else np.zeros(0, np.int64)
    ts = start_ms + t_ms.astype(np.int64)
    kinds = sorted({w.gpu_kind for w in fleet})
    kind_of = np.array([kinds.index(w.gpu_kind) for w in fleet], np.int32)
    sched = pa.timestamp("ms", tz="UTC")
    return pa.table({
        "worker_id": pa.DictionaryArray.from_arrays(pa.array(worker, pa.int32()), pa.array([w.worker_id for w in fleet])),
        "session_id": pa.array(np.asarray(p.session_ids, dtype=object)[si] if m else [], pa.string()),
        "release": pa.DictionaryArray.from_arrays(pa.array(rel, pa.int32()), pa.array([r.name for r in releases])),
        "gpu_kind": pa.DictionaryArray.from_arrays(pa.array(kind_of[worker] if m else [], pa.int32()), pa.array(kinds)),
        "ts": pa.array(ts, sched),
        "simulated": pa.array(np.ones(m, bool)),
        "turn": pa.array(cols["turn"], pa.int64()),
        "step": pa.array((t_ms // np.maximum(period, 1.0)).astype(np.int64) + 1, pa.int64()),
        "speaking": pa.array(speaking),
        "cond_tokens": pa.array(tokens, pa.int64()),
        "policy": pa.array(np.where(keep, "keep", "trim").tolist(), pa.string()),
        "queue_depth": pa.array(np.full(m, TURN_DEPTH), pa.int64()),
        "dropped_chunks": pa.array(np.where(keep, 0, TURN_DEPTH - 1), pa.int64()),
        "superseded": pa.array(np.zeros(m, np.int64)),
        "wait_ms": wait, "recompute_ms": recompute, "generation_ms": generation, "queue_ms": queue,
        "latency_ms": latency, "stall_ms": stall,
        "generated_at": pa.array(ts + (wait + recompute + generation).astype(np.int64), sched),
        "played_at": pa.array(ts + latency.astype(np.int64), sched),
    })
