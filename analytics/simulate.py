"""Fleet simulator: weeks of realistic telemetry for many workers, with the paper's incidents injected.

    from analytics.simulate import simulate_fleet
    sim = simulate_fleet(store, weeks=3, incidents=["august", "fix"], seed=1)      # bulk, into a Store
    sim = simulate_fleet(TelemetryClient(url), weeks=1, workers=4)                # the real collector path
    sim.releases  # [SimRelease('v1.0', baseline ...), SimRelease('v1.1', 'august', ...), ...]

Workers of three GPU kinds run sessions back to back (lognormal lengths, a first-forward prompt
length drawn per session), one step row per 4-frame chunk. A release rolls out over
``rollout_days`` (each worker upgrades at its own moment; a deploy restarts the worker process).
Noise comes in the layers a fleet has: per GPU kind and day, per worker, per session, per step.

Incidents, each a new release (``incidents=["august", ("sync", 10), "benign"]``, optional day):
- ``august``: the fused all-reduce kernel keeps a buffer per distinct first-forward token count, on
  workers that run ``fused_allreduce``: reserved memory and ``buffers_registered`` grow with each new
  prompt length until the process runs out of memory (an ``oom`` event, a restart); fps drops as the
  allocator fragments.
- ``sync``: one host-device sync per step (the ``.item()`` bug): step time +65%.
- ``benign``: a release with no real change.
- ``fix``: fuse only the steady-state shape (ends the leak) and drop the sync.
- ``leak_resolution``: every worker keeps +180 MB per new decoder output resolution (14 in rotation,
  one drawn per session); a leak keyed on a shape that is not the prompt.
- ``leak_prompt``: every worker keeps +24 MB per new first-forward length (the fused kernel's real
  buffer, m x d_model x 2 bytes, is 15-30 MB per prompt length on the H200); ``leak_prompt_tight``:
  the same leak on a release whose steady reserved memory sits ``TIGHT_HEADROOM`` below capacity.
- ``leak_session``: every worker keeps +40 MB per session served (whatever its shape).
- ``drift``: cache upkeep grows 0.5% a day, compounded from the release's start (no release boundary).
- ``variance``: step-time spread (session to session and step to step) x sqrt(2): twice the variance,
  the same median.
An incident takes a scope after a colon: a GPU kind (``"sync:h100"``) or a switch (``"sync:compile"``,
only workers running it); it then changes only those workers (a leak, a sync, a drift, a variance).

Every session also carries the contract's other shape columns (``collector.records.SHAPE_KEYS``):
conditioning tokens (first-forward tokens less the chunk's), a decoder resolution drawn from
``RESOLUTIONS``, frames per chunk and TP size. These draws use their own random stream, so every
other column is what it was before they existed.

FP8 saturation (``fp8_saturated``, sampled on the steps a GPU worker probes: every 64th from step 64;
every worker runs ``static_scales``): healthy sessions stay at zero or isolated outliers (< 1e-6). ``fp8_drift=("august",
"b200")`` makes the static scales drift on that release's sessions of that GPU kind: the saturated
fraction grows with the step index (a per-session rate, lognormal around 1e-4 per 100 steps), so most of
their sampled sessions saturate past ``analytics.saturation.SATURATED_FRACTION``.

Every row is marked ``simulated=True``. Deterministic for a seed (and the same window): re-running
into the same store lands once (each block carries a dedup token).

The parts: ``analytics.sim_fleet`` (the fleet's model and plans), ``analytics.sim_blocks`` (sessions into
Arrow blocks), ``analytics.sim_turns`` (conversational turns), ``analytics.sim_sinks`` (where blocks go).
Each draws from its own seeded stream, and this module keeps the order of the draws, so a seed still
reproduces a fleet.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np

from analytics.sim_blocks import BlockWriter
from analytics.sim_fleet import (
    GPU_KINDS,
    INCIDENTS,
    LEAK_BYTES_PER_TOKEN,
    LEAKS,
    NEW_TOKENS,
    RESERVED_JITTER_BYTES,
    RESOLUTIONS,
    STEP_BUDGET_MS,
    TIGHT_HEADROOM,
    GpuKind,
    SimRelease,
    SimResult,
    SimulationError,
    SimWorker,
    pinned_end,
    plan_releases,
    plan_workers,
)
from analytics.sim_sinks import ClientSink, DirectSink, as_sink
from analytics.sim_turns import simulate_turns, turn_plan
from collector import records

__all__ = [  # the simulator's public names, imported from here
    "GPU_KINDS",
    "INCIDENTS",
    "LEAKS",
    "LEAK_BYTES_PER_TOKEN",
    "NEW_TOKENS",
    "RESERVED_JITTER_BYTES",
    "RESOLUTIONS",
    "STEP_BUDGET_MS",
    "TIGHT_HEADROOM",
    "ClientSink",
    "DirectSink",
    "GpuKind",
    "SimRelease",
    "SimResult",
    "SimWorker",
    "SimulationError",
    "as_sink",
    "pinned_end",
    "plan_releases",
    "plan_workers",
    "simulate_fleet",
    "simulate_turns",
    "summarize",
]


@dataclass
class _Process:
    release: SimRelease
    reserved: float
    shapes: set[int] = field(default_factory=set)
    leaked: int = 0
    leak_bytes: float = 0.0
    keyed: set = field(default_factory=set)  # values of the release's leak key seen (SimRelease.leak_key)
    keyed_bytes: float = 0.0



def simulate_fleet(
    target,
    *,
    weeks: float = 3,
    incidents: Sequence[str | tuple[str, float]] = (),
    seed: int = 0,
    workers: int = 8,
    sessions_per_day: float = 24,
    session_median_s: float = 30.0,
    rollout_days: float = 2.0,
    end: datetime | None = None,
    block_steps: int = 1_000_000,
    progress: bool | None = None,
    fp8_drift: tuple[str, str] | None = None,
    turns: bool = False,
    turn_queue: str | None = None,
    reserved_jitter: float = RESERVED_JITTER_BYTES,
) -> SimResult:
    """Simulate ``weeks`` of fleet telemetry ending at ``end`` (default: this hour) into ``target``.

    ``target``: a Store (bulk Arrow blocks), a TelemetryClient (the collector path) or a sink.
    Incident days count from the simulation start. ``fp8_drift``: (release kind, GPU kind) whose static
    FP8 scales drift (module docstring). ``turns``: conversational turns too (``simulate_turns``);
    ``turn_queue``: the release (name) whose workers keep the whole playout buffer at each turn (the
    ``keep`` policy instead of ``trim``: a turn-latency regression). ``reserved_jitter``: the sd (bytes) of
    a process's peak reserved memory from session to session (``RESERVED_JITTER_BYTES``, measured).
    Returns what was simulated.
    """
    if fp8_drift is not None and (fp8_drift[0] not in ("baseline", *INCIDENTS) or fp8_drift[1] not in GPU_KINDS):
        raise SimulationError(f"fp8_drift {fp8_drift!r} is not valid: (release kind, GPU kind), release kinds "
                              f"{', '.join(('baseline', *INCIDENTS))}; GPU kinds {', '.join(GPU_KINDS)}")
    if workers < 1 or sessions_per_day <= 0 or session_median_s <= 0 or weeks <= 0 or reserved_jitter < 0:
        raise SimulationError("workers >= 1, sessions_per_day > 0, session_median_s > 0, weeks > 0 and "
                              "reserved_jitter >= 0 are required")
    end = (end or datetime.now(UTC).replace(minute=0, second=0, microsecond=0)).astimezone(UTC)
    days = weeks * 7
    start = end - timedelta(days=days)
    rng = np.random.default_rng([seed, 0])
    releases = plan_releases(start, days, incidents, rollout_days)
    fleet = plan_workers(workers, rng)
    result = SimResult(start, end, seed, releases, fleet)
    sink = as_sink(target)
    n_days = int(np.ceil(days)) + 1
    day_noise = {k: np.exp(rng.normal(0, 0.003, n_days)) for k in GPU_KINDS}
    # each worker upgrades to each release at its own moment in the rollout
    upgrade_at = [
        [r.start + timedelta(days=r.rollout_days * float(u)) for r, u in zip(releases, rng.random(len(releases)))]
        for _ in fleet
    ]
    # sessions_per_day is honoured on average: the idle gap fills the period minus a mean session
    mean_idle_s = max(86400.0 / sessions_per_day - session_median_s * np.exp(0.8**2 / 2), 1.0)
    start_ms = int(start.timestamp() * 1000)
    end_ms = int(end.timestamp() * 1000)
    expected = int(workers * days * sessions_per_day * session_median_s * 1.4 / (STEP_BUDGET_MS / 1000))
    bar = _progress(progress, expected)
    run_key = f"{seed}-{start_ms}-" + _options_key(weeks, incidents, workers, sessions_per_day, session_median_s,
                                                    rollout_days, *([fp8_drift] if fp8_drift else []))
    writer = BlockWriter(sink, result, fleet, releases, run_key, bar, block_steps, fp8_drift)
    writer.turns = turn_plan(releases, turns, turn_queue)
    oom_rows: list[dict] = []
    for wi, w in enumerate(fleet):
        wrng = np.random.default_rng([seed, 1, wi])
        srng = np.random.default_rng([seed, 4, wi])  # the newer shape columns' own stream
        kind = GPU_KINDS[w.gpu_kind]
        t_ms = start_ms + int(wrng.exponential(mean_idle_s) * 1000)
        proc: _Process | None = None
        seq = 0
        while True:
            t = datetime.fromtimestamp(t_ms / 1000, UTC)
            ri = max(i for i, u in enumerate(upgrade_at[wi]) if u <= t) if t >= upgrade_at[wi][0] else 0
            rel = releases[ri]
            if proc is None or proc.release is not rel:  # a deploy restarts the worker process
                proc = _Process(rel, kind.reserved_bytes * float(np.exp(wrng.normal(0, 0.01))))
                if rel.tight and rel.hits(w):
                    proc.reserved = kind.memory_bytes - TIGHT_HEADROOM
            if wrng.random() < 0.02:  # gone within a second (connection dropped)
                duration_s = float(wrng.uniform(0.2, 1.5))
            else:
                duration_s = float(np.clip(wrng.lognormal(np.log(session_median_s), 0.8), 1.0, 7200.0))
            n_steps = max(1, int(duration_s * 1000 / STEP_BUDGET_MS))
            tokens = NEW_TOKENS + int(np.clip(wrng.lognormal(np.log(120), 0.7), 4, 2048))
            if t_ms + duration_s * 1000 * 1.2 >= end_ms:
                break
            res = int(srng.integers(len(RESOLUTIONS)))
            seq += 1
            sid = f"s{seed}-{w.worker_id}-{seq:06d}"
            leaking = rel.leak and "fused_allreduce" in w.switches
            if leaking and tokens not in proc.shapes:
                add = tokens * LEAK_BYTES_PER_TOKEN
                if proc.reserved + proc.leak_bytes + add > kind.memory_bytes:
                    oom_rows.append(_oom_row(w, rel, sid, t_ms, proc, add, kind, tokens))
                    proc = None  # the process dies; the supervisor restarts it
                    t_ms += int(wrng.uniform(30, 90) * 1000)
                    continue
                proc.leaked += 1
                proc.leak_bytes += add
            proc.shapes.add(tokens)
            if rel.leak_key and rel.hits(w):
                value = {"decoder_resolution": res, "first_forward_tokens": tokens, "session": seq}[rel.leak_key]
                if value not in proc.keyed:
                    if proc.reserved + proc.leak_bytes + proc.keyed_bytes + rel.leak_bytes > kind.memory_bytes:
                        oom_rows.append(_oom_row(w, rel, sid, t_ms, proc, rel.leak_bytes, kind, tokens))
                        proc = None
                        t_ms += int(wrng.uniform(30, 90) * 1000)
                        continue
                    proc.keyed.add(value)
                    proc.keyed_bytes += rel.leak_bytes
            hit = rel.hits(w)
            base_buffers = 1 if "fused_allreduce" in w.switches else 0
            period = (
                kind.period_ms
                * w.speed
                * day_noise[w.gpu_kind][int((t_ms - start_ms) // 86_400_000)]
                * float(np.exp(wrng.normal(0, 0.012)))  # session-to-session spread
                * (1.0 if "fused_allreduce" in w.switches else 1.01)
                * (1.0 if "cuda_graphs" in w.switches else 1.005)
                * (1.65 if rel.sync and hit else 1.0)
                * (1.0 + 0.002 * proc.leaked)  # fragmentation as leaked buffers pile up
            )
            reserved = proc.reserved + float(wrng.normal(0, 1.0)) * reserved_jitter + proc.leak_bytes + proc.keyed_bytes
            if rel.tight and hit:
                reserved = min(reserved, kind.memory_bytes - 1.0)
            age_days = (t_ms - rel.start.timestamp() * 1000) / 86_400_000
            upkeep = (1.0 + rel.drift_per_day) ** max(age_days, 0.0) if hit else 1.0
            spread = float(np.sqrt(rel.variance)) if hit else 1.0
            if spread != 1.0:  # the session-to-session draw above, widened around the same median
                period *= float(np.exp(srng.normal(0, 0.012 * np.sqrt(spread**2 - 1))))
            writer.add_session(sid, wi, ri, t_ms, n_steps, period, reserved, base_buffers + proc.leaked, tokens,
                               res, upkeep, spread)
            gap_s = 5.0 + wrng.exponential(mean_idle_s)
            t_ms += int((duration_s + gap_s) * 1000)
    writer.flush()
    if oom_rows:
        sink.write("event", records.to_arrow("event", oom_rows), f"sim-{run_key}-oom")
        result.rows["event"] = len(oom_rows)
    result.ooms = len(oom_rows)
    sink.close()
    if bar is not None:
        bar.close()
    return result


def _options_key(*options) -> str:
    import hashlib

    return hashlib.sha256(repr(options).encode()).hexdigest()[:12]


def _oom_row(w: SimWorker, rel: SimRelease, sid: str, t_ms: int, proc: _Process, add: float, kind: GpuKind, tokens):
    detail = {
        "mem_reserved_bytes": int(proc.reserved + proc.leak_bytes),
        "requested_bytes": int(add),
        "capacity_bytes": kind.memory_bytes,
        "buffers_registered": proc.leaked + 1,
        "first_forward_tokens": tokens,
    }
    return {"worker_id": w.worker_id, "session_id": sid, "release": rel.name, "gpu_kind": w.gpu_kind,
                "ts": datetime.fromtimestamp(t_ms / 1000, UTC), "simulated": True, "kind": "oom", "detail": json.dumps(detail)}


def _progress(progress: bool | None, total: int):
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", unit_scale=True, desc="simulate", mininterval=1.0)


def summarize(result: SimResult) -> Iterable[str]:
    yield (f"simulated {result.sessions} sessions, {result.steps} steps, {result.ooms} OOMs on "
           f"{len(result.workers)} workers from {result.start:%Y-%m-%d %H:%M} to {result.end:%Y-%m-%d %H:%M} UTC")
    for r in result.releases[1:]:
        yield f"  release {r.name} ({r.kind}) rolled out from {r.start:%Y-%m-%d %H:%M} over {r.rollout_days:g} days"

