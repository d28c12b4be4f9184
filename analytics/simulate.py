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

Why one module over ~450 lines: one fleet model (workers, releases, incidents, the noise layers)
whose parts draw from one random stream in a fixed order; split, a seed would stop reproducing a fleet.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa

from analytics.memory import GPU_MEMORY_BYTES
from collector import catalog, records

STEP_BUDGET_MS = catalog.CHUNK_DEADLINE_MS  # 166.7 ms per 4-frame chunk
RESET_EVERY = 42
LATE_MS = 200.0  # the playout buffer absorbs jitter up to here (reset steps are absorbed too)
NEW_TOKENS = 757
GIB = 2**30
LEAK_BYTES_PER_TOKEN = 1 << 20  # the leaked fused buffer: ~1 MiB per first-forward token
INCIDENTS: tuple[str, ...] = ("august", "sync", "benign", "fix", "leak_resolution", "leak_prompt", "leak_prompt_tight",
                               "leak_session", "drift", "variance")
# incident -> (shape key the leak is keyed on, bytes per new value); "session": per session served
LEAKS: dict[str, tuple[str, float]] = {
    "leak_resolution": ("decoder_resolution", 180e6),
    "leak_prompt": ("first_forward_tokens", 24e6),
    "leak_prompt_tight": ("first_forward_tokens", 24e6),
    "leak_session": ("session", 40e6),
}
TIGHT_HEADROOM = 0.6e9  # leak_prompt_tight: steady reserved memory this far below capacity
# Session-to-session jitter of a process's peak reserved memory (bytes, sd). Calibrated on the worker's
# own telemetry: on the H200 soak (docs/PERFORMANCE.md, issue 21) one process served 95 sessions of random
# prompt length (256-2048 tokens) and its reserved memory did not move at the counter's 1 MiB resolution
# (the caching allocator keeps its segments). 8 MiB is 8x that bound, to err on the noisy side. It was
# 0.4 % of reserved memory (0.25-0.6 GB) before it was measured; ``reserved_jitter`` sets it.
RESERVED_JITTER_BYTES = 8 * 2**20
DRIFT_PER_DAY = 0.005  # drift: cache upkeep x 1.005 per day since the release started
VARIANCE_FACTOR = 2.0  # variance: step-time variance x 2
# decoder output resolutions (height, width) in rotation: 14, one drawn per session
RESOLUTIONS: tuple[tuple[int, int], ...] = tuple(
    (h, w) for h, w in ((360, 640), (432, 768), (480, 854), (540, 960), (576, 1024), (640, 1138), (704, 1088),
                        (720, 1280), (768, 1366), (810, 1440), (864, 1536), (900, 1600), (960, 1706), (1080, 1920)))
_BASE_SWITCHES = ("ring_cache", "rope_at_write", "fp8_cache", "delta_rotation", "triton_kernels", "decoder_own_gpu",
                  "static_scales")
# fp8_saturated is sampled where a GPU worker probes: step % 64 == 0 and step > 0 (step 0 calibrates
# the static scales, so its first probe is at step 64; a session shorter than 65 steps is never sampled)
FP8_SAMPLE_EVERY = 64
FP8_DRIFT_PER_100_STEPS = 1e-4  # median growth of the saturated fraction per 100 steps on a drifting cohort


class SimulationError(Exception):
    """Bad simulator options; the message lists valid values."""


@dataclass(frozen=True)
class GpuKind:
    name: str
    tp_size: int
    n_gpus: int
    memory_bytes: int  # per GPU
    reserved_bytes: int  # a healthy worker's steady reserved memory
    period_ms: float  # steady step period with every optimization on (reset steps excluded)
    power_w: float  # per GPU while stepping


GPU_KINDS: dict[str, GpuKind] = {
    "h100": GpuKind("h100", 3, 4, GPU_MEMORY_BYTES["h100"], 62 * GIB, 156.5, 620.0),
    "h200": GpuKind("h200", 3, 4, GPU_MEMORY_BYTES["h200"], 100 * GIB, 153.0, 640.0),
    "b200": GpuKind("b200", 2, 3, GPU_MEMORY_BYTES["b200"], 150 * GIB, 150.0, 880.0),
}


@dataclass(frozen=True)
class SimRelease:
    name: str
    kind: str  # baseline | august | sync | benign | fix
    start: datetime
    rollout_days: float
    leak: bool = False
    sync: bool = False
    leak_key: str | None = None  # LEAKS: a leak on every worker in scope, keyed on this shape key
    leak_bytes: float = 0.0
    tight: bool = False  # steady reserved memory TIGHT_HEADROOM below capacity
    drift_per_day: float = 0.0
    variance: float = 1.0
    scope: str = ""  # "" (every worker), a GPU kind or a switch: the workers this release's incident hits

    def hits(self, w: SimWorker) -> bool:
        return not self.scope or self.scope == w.gpu_kind or self.scope in w.switches


@dataclass(frozen=True)
class SimWorker:
    worker_id: str
    gpu_kind: str
    switches: frozenset[str]
    speed: float  # per-worker factor on step time (hardware spread)


@dataclass
class SimResult:
    start: datetime
    end: datetime
    seed: int
    releases: list[SimRelease]
    workers: list[SimWorker]
    sessions: int = 0
    steps: int = 0
    ooms: int = 0
    rows: dict[str, int] = field(default_factory=dict)

    def release(self, kind: str) -> SimRelease:
        """The first release of an incident kind ('august', 'sync', 'benign', 'fix', 'baseline')."""
        for r in self.releases:
            if r.kind == kind:
                return r
        raise SimulationError(f"no {kind!r} release; releases: {[(r.name, r.kind) for r in self.releases]}")


# ---------------------------------------------------------------------------------------------
# sinks: where the Arrow blocks go


class DirectSink:
    """Bulk path: Arrow blocks straight into ``Store.insert_arrow`` (one dedup token per block)."""

    def __init__(self, store):
        self.store = store

    def write(self, kind: str, table: pa.Table, token: str) -> None:
        self.store.insert_arrow(records.TABLES[kind], table, dedup_token=token)

    def close(self) -> None:
        pass


class ClientSink:
    """The real collector path: every row through ``collector.client.TelemetryClient.put``.

    ``put`` never blocks (it drops when the client's queue is full), so the simulator, which produces
    rows far faster than a worker, waits for the client to ship every ``backpressure_rows`` rows."""

    def __init__(self, client, flush_timeout_s: float = 30.0, backpressure_rows: int = 20_000):
        self.client = client
        self.flush_timeout_s = flush_timeout_s
        self.backpressure_rows = backpressure_rows

    def write(self, kind: str, table: pa.Table, token: str) -> None:
        for batch in table.to_batches(max_chunksize=self.backpressure_rows):
            for row in batch.to_pylist():
                self.client.put(kind, row)
            if getattr(self.client, "buffered", 0) >= self.backpressure_rows and not self.client.flush(
                timeout_s=self.flush_timeout_s
            ):
                raise SimulationError(
                    f"the collector did not take {self.backpressure_rows} rows within {self.flush_timeout_s} s "
                    f"(dropped={self.client.dropped}, failed_batches={self.client.failed_batches}); is "
                    "`livestep serve` running at that URL? (or write into the store with --direct)"
                )

    def close(self) -> None:
        if not self.client.flush(timeout_s=self.flush_timeout_s):
            raise SimulationError(
                f"the collector did not take every row within {self.flush_timeout_s} s "
                f"(dropped={self.client.dropped}, failed_batches={self.client.failed_batches}); is "
                "`livestep serve` running at that URL? (or write into the store with --direct)"
            )


def as_sink(target):
    """A Store, a TelemetryClient or a sink -> a sink."""
    if hasattr(target, "write") and hasattr(target, "close"):
        return target
    if hasattr(target, "insert_arrow"):
        return DirectSink(target)
    if hasattr(target, "put"):
        return ClientSink(target)
    raise SimulationError("target must be a Store (insert_arrow), a TelemetryClient (put) or a sink (write)")


# ---------------------------------------------------------------------------------------------
# the plan: releases, workers, sessions


def plan_releases(
    start: datetime, days: float, incidents: Sequence[str | tuple[str, float]], rollout_days: float
) -> list[SimRelease]:
    out = [SimRelease("v1.0", "baseline", start - timedelta(days=30), 0.0)]
    parsed = []
    for i, inc in enumerate(incidents):
        name, day = (inc, None) if isinstance(inc, str) else inc
        base, _, scope = name.partition(":")
        if base not in INCIDENTS:
            raise SimulationError(f"unknown incident {name!r}; valid incidents: {', '.join(INCIDENTS)}")
        if scope and scope not in GPU_KINDS and scope not in records.SWITCH_NAMES:
            raise SimulationError(f"incident scope {scope!r} is not valid: a GPU kind ({', '.join(GPU_KINDS)}) "
                                  f"or a switch ({', '.join(records.SWITCH_NAMES)})")
        if day is None:
            day = round(days * (i + 1) / (len(incidents) + 1), 2)
        if not 0 <= day < days:
            raise SimulationError(f"incident {name!r} day {day} is outside the simulated 0..{days} days")
        parsed.append((day, name))
    for n, (day, full) in enumerate(sorted(parsed), start=1):
        prev = out[-1]
        name, _, scope = full.partition(":")
        leak = prev.leak if name in ("sync", "benign") else name == "august"
        sync = prev.sync if name in ("august", "benign") else name == "sync"
        key, per = LEAKS.get(name, (None, 0.0))
        out.append(SimRelease(f"v1.{n}", name, start + timedelta(days=day), rollout_days, leak, sync, key, per,
                              name == "leak_prompt_tight", DRIFT_PER_DAY if name == "drift" else 0.0,
                              VARIANCE_FACTOR if name == "variance" else 1.0, scope))
    return out


def plan_workers(n: int, rng: np.random.Generator) -> list[SimWorker]:
    kinds = list(GPU_KINDS)
    out = []
    for i in range(n):
        on = set(_BASE_SWITCHES)
        if rng.random() < 0.75 or i == 0:  # fused all-reduce where the TP group allows it (most workers)
            on.add("fused_allreduce")
        if rng.random() < 0.9:
            on.add("cuda_graphs")
        if rng.random() < 0.5:
            on.add("compile")
        out.append(SimWorker(f"w{i:04d}", kinds[i % len(kinds)], frozenset(on), float(np.exp(rng.normal(0, 0.005)))))
    return out


@dataclass
class _Process:
    release: SimRelease
    reserved: float
    shapes: set[int] = field(default_factory=set)
    leaked: int = 0
    leak_bytes: float = 0.0
    keyed: set = field(default_factory=set)  # values of the release's leak key seen (SimRelease.leak_key)
    keyed_bytes: float = 0.0


class _Plans:
    """Column buffers for planned sessions (one entry per session)."""

    cols = ("worker", "release", "start_ms", "n_steps", "period_ms", "reserved", "buffers", "tokens", "sync",
            "resolution", "upkeep", "spread")

    def __init__(self):
        for c in self.cols:
            setattr(self, c, [])
        self.session_ids: list[str] = []

    def __len__(self):
        return len(self.session_ids)


def pinned_end(hour: int = 12, now: datetime | None = None) -> datetime:
    """An end for a fleet that must come out the same whenever it is simulated: ``hour`` o'clock UTC on
    the last Monday before ``now`` (default: the clock). The default end, "this hour", moves the day's and
    the week's boundaries through the data with the clock, and the daily and weekly detectors cut it there:
    a benign fleet raised a drift alarm when simulated at 20:00 and none at 21:00. Only the rows' dates
    move with this one (up to 8 days old: within every table's TTL)."""
    now = (now or datetime.now(UTC)).astimezone(UTC)
    monday = (now - timedelta(days=now.weekday())).replace(hour=0, minute=0, second=0, microsecond=0)
    end = monday + timedelta(hours=hour % 24)
    return end if end <= now else end - timedelta(days=7)


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
    writer = _BlockWriter(sink, result, fleet, releases, run_key, bar, block_steps, fp8_drift)
    writer.turns = _turn_plan(releases, turns, turn_queue)
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


class _BlockWriter:
    """Accumulates planned sessions and writes their steps and session rows in large Arrow blocks."""

    def __init__(self, sink, result, fleet, releases, run_key: str, bar, block_steps: int,
                 fp8_drift: tuple[str, str] | None = None):
        self.sink, self.result, self.fleet, self.releases = sink, result, fleet, releases
        self.run_key, self.seed, self.bar = run_key, result.seed, bar
        self.block = 0
        self.block_steps = block_steps
        self.plans = _Plans()
        self.pending = 0
        self.worker_names = pa.array([w.worker_id for w in fleet])
        self.release_names = pa.array([r.name for r in releases])
        # Arrow dictionaries must hold distinct values: per-worker indices into them
        kinds = sorted({w.gpu_kind for w in fleet})
        self.kind_names, self.kind_of = pa.array(kinds), np.array([kinds.index(w.gpu_kind) for w in fleet], np.int32)
        self.memory_of = np.array([GPU_KINDS[w.gpu_kind].memory_bytes for w in fleet], np.int64)
        states = sorted({records.encode_switches(w.switches) for w in fleet})
        self.switch_strs = pa.array(states)
        self.switch_of = np.array([states.index(records.encode_switches(w.switches)) for w in fleet], np.int32)
        self.power = np.array([GPU_KINDS[w.gpu_kind].power_w * GPU_KINDS[w.gpu_kind].n_gpus for w in fleet])
        self.tp = np.array([GPU_KINDS[w.gpu_kind].tp_size for w in fleet])
        self.fused = np.array(["fused_allreduce" in w.switches for w in fleet])
        self.static = np.array(["static_scales" in w.switches for w in fleet])
        self.drift_release = np.array([fp8_drift is not None and r.kind == fp8_drift[0] for r in releases])
        self.drift_kind = np.array([fp8_drift is not None and w.gpu_kind == fp8_drift[1] for w in fleet])

    def add_session(self, sid, wi, ri, t_ms, n_steps, period, reserved, buffers, tokens, res=6, upkeep=1.0,
                    spread=1.0):
        p = self.plans
        p.session_ids.append(sid)
        sync = self.releases[ri].sync and self.releases[ri].hits(self.fleet[wi])
        for c, v in zip(p.cols, (wi, ri, t_ms, n_steps, period, reserved, buffers, tokens, sync, res, upkeep, spread)):
            getattr(p, c).append(v)
        self.pending += n_steps
        if self.pending >= self.block_steps:
            self.flush()

    def flush(self) -> None:
        p = self.plans
        if not len(p):
            return
        rng = np.random.default_rng([self.seed, 2, self.block])
        token = f"sim-{self.run_key}-{self.block}"
        steps_t, sessions_t = self._build(p, rng)
        self.sink.write("step", steps_t, token + "-step")
        self.sink.write("session", sessions_t, token + "-session")
        if self.turns is not None:
            self._write_turns(p, token)
        self.result.sessions += len(p)
        self.result.steps += steps_t.num_rows
        for k, n in (("step", steps_t.num_rows), ("session", sessions_t.num_rows)):
            self.result.rows[k] = self.result.rows.get(k, 0) + n
        if self.bar is not None:
            self.bar.update(steps_t.num_rows)
        self.block += 1
        self.plans = _Plans()
        self.pending = 0

    def _build(self, p: _Plans, rng: np.random.Generator) -> tuple[pa.Table, pa.Table]:
        n = np.asarray(p.n_steps, dtype=np.int64)
        ns = len(n)
        total = int(n.sum())
        offsets = np.concatenate([[0], np.cumsum(n)[:-1]])
        si = np.repeat(np.arange(ns), n)  # session index of each step
        step = np.arange(total) - offsets[si]
        worker = np.asarray(p.worker, dtype=np.int32)[si]
        mean = np.asarray(p.period_ms)[si]
        reset = (step > 0) & (step % RESET_EVERY == 0)
        spike = rng.random(total) < 0.01
        spread = np.asarray(p.spread)[si]
        period = mean * np.exp(rng.normal(0, 0.03, total) * spread) * np.where(spike, 1.3, 1.0)
        period = np.where(reset, mean * 1.65, period)
        cs = np.cumsum(period)
        ts_ms = np.asarray(p.start_ms, dtype=np.int64)[si] + (cs - (cs[offsets] - period[offsets])[si]).astype(np.int64)
        sync = np.asarray(p.sync)[si]
        diffusion = period - 1.6 + rng.normal(0, 0.3, total)
        upkeep = (6.2 * np.exp(rng.normal(0, 0.05, total)) + np.where(reset, 97.0, 0.0)) * np.asarray(p.upkeep)[si]
        fused = self.fused[worker]
        allreduce = np.where(fused, 36.9, 50.0) * np.exp(rng.normal(0, 0.04, total))
        late = (period > LATE_MS) & ~reset
        power = self.power[worker] * np.exp(rng.normal(0, 0.03, total)) * np.where(sync, 0.7, 1.0)
        energy = power * period  # W * ms = mJ
        reserved = np.asarray(p.reserved, dtype=np.int64)[si]
        buffers = np.asarray(p.buffers, dtype=np.int64)[si]
        rel = np.asarray(p.release, dtype=np.int32)
        common = self._common(si, worker, rel[si], ts_ms, p.session_ids)
        steps = pa.table(
            {
                **common,
                "step": pa.array(step, pa.int64()),
                "diffusion_ms": np.maximum(diffusion, 0.0),
                "step_period_ms": period,
                "decode_ms": 114.0 * np.exp(rng.normal(0, 0.02, total)),
                "cache_upkeep_ms": upkeep,
                "attention_ms": 9.5 * np.exp(rng.normal(0, 0.03, total)),
                "allreduce_ms": allreduce,
                "late": late,
                "playout_depth": np.where(late, 0, 3).astype(np.int64),
                "reset_step": reset,
                "energy_mj": energy,
                "mem_allocated_bytes": (reserved * 0.92).astype(np.int64),
                "mem_reserved_bytes": reserved,
                "buffers_registered": buffers,
                "switches": pa.DictionaryArray.from_arrays(pa.array(self.switch_of[worker]), self.switch_strs),
                "fp8_saturated": self._fp8_saturated(step, si, np.asarray(p.worker, dtype=np.int32), rel),
            }
        )
        # sessions: a start row and an end row each
        streamed_s = np.bincount(si, weights=period, minlength=ns) / 1000.0
        late_n = np.bincount(si, weights=late, minlength=ns).astype(np.int64)
        stall = np.bincount(si, weights=np.where(late, period - STEP_BUDGET_MS, 0.0), minlength=ns)
        w = np.asarray(p.worker, dtype=np.int32)
        start_ms = np.asarray(p.start_ms, dtype=np.int64)
        end_ms = start_ms + (streamed_s * 1000).astype(np.int64)
        idx = np.concatenate([np.arange(ns), np.arange(ns)])
        is_end = np.concatenate([np.zeros(ns, bool), np.ones(ns, bool)])
        frames = np.where(is_end, 4 * n[idx], 0)
        sessions = pa.table(
            {
                **self._common(idx, w[idx], rel[idx], np.where(is_end, end_ms[idx], start_ms[idx]), p.session_ids),
                "phase": pa.DictionaryArray.from_arrays(pa.array(is_end.astype(np.int32)), pa.array(["start", "end"])),
                "first_forward_tokens": np.asarray(p.tokens, dtype=np.int64)[idx],
                "cond_tokens": np.asarray(p.tokens, dtype=np.int64)[idx] - NEW_TOKENS,
                "decoder_height": np.array([RESOLUTIONS[r][0] for r in p.resolution], np.int64)[idx],
                "decoder_width": np.array([RESOLUTIONS[r][1] for r in p.resolution], np.int64)[idx],
                "chunk_frames": np.full(len(idx), 4, np.int64),
                "gpu_mem_total_bytes": self.memory_of[w[idx]],  # what a worker reads from torch / NVML
                "streamed_s": np.where(is_end, streamed_s[idx], 0.0),
                "frames": frames,
                "avg_fps": pa.array(frames / np.maximum(streamed_s[idx], 1e-9), mask=~is_end),
                "late_chunks": np.where(is_end, late_n[idx], 0),
                "stall_ms": np.where(is_end, stall[idx], 0.0),
                "tp_size": self.tp[w[idx]].astype(np.int64),
                "shape": pa.array(["prod57b"] * len(idx)),
                "switches": pa.DictionaryArray.from_arrays(pa.array(self.switch_of[w[idx]]), self.switch_strs),
            }
        )
        names = [n for n in records.ARROW_SCHEMAS["session"].names if n in sessions.column_names]
        return steps, records.conform("session", sessions.select(names))  # columns added since: null

    turns: np.ndarray | None = None  # per release: its workers' turn policy is keep (else trim); None: no turns

    def _write_turns(self, p: _Plans, token: str) -> None:
        table = simulate_turns(p, self.turns, self.fleet, self.releases, np.random.default_rng([self.seed, 4, self.block]))
        if table.num_rows:
            self.sink.write("turn", table, token + "-turn")
            self.result.rows["turn"] = self.result.rows.get("turn", 0) + table.num_rows

    def _fp8_saturated(self, step, si, worker, rel) -> pa.Array:
        """Sampled steps' saturated fraction (null elsewhere and without static scales); ``si`` per step,
        ``worker`` and ``rel`` per session. Its own random stream, so every other column is what it was
        before this one existed."""
        rng = np.random.default_rng([self.seed, 3, self.block])
        total = len(step)
        sampled = (step % FP8_SAMPLE_EVERY == 0) & (step > 0) & self.static[worker][si]
        rate = FP8_DRIFT_PER_100_STEPS * np.exp(rng.normal(0, 0.8, len(worker)))  # per session
        drifting = (self.drift_release[rel] & self.drift_kind[worker])[si]
        outlier = rng.random(total) < 0.05  # an isolated clipped element now and then: far below tolerance
        healthy = np.where(outlier, 1e-7 * np.exp(rng.normal(0, 0.5, total)), 0.0)
        frac = np.where(drifting, np.minimum(rate[si] * step / 100.0, 1.0), healthy)
        return pa.array(frac, pa.float64(), mask=~sampled)

    def _common(self, si, worker, rel, ts_ms, session_ids) -> dict:
        return {
            "worker_id": pa.DictionaryArray.from_arrays(pa.array(worker, pa.int32()), self.worker_names),
            "session_id": pa.DictionaryArray.from_arrays(pa.array(si, pa.int32()), pa.array(session_ids)),
            "release": pa.DictionaryArray.from_arrays(pa.array(rel, pa.int32()), self.release_names),
            "gpu_kind": pa.DictionaryArray.from_arrays(pa.array(self.kind_of[worker]), self.kind_names),
            "ts": pa.array(ts_ms, pa.timestamp("ms", tz="UTC")),
            "simulated": pa.array(np.ones(len(ts_ms), bool)),
        }


def summarize(result: SimResult) -> Iterable[str]:
    yield (f"simulated {result.sessions} sessions, {result.steps} steps, {result.ooms} OOMs on "
           f"{len(result.workers)} workers from {result.start:%Y-%m-%d %H:%M} to {result.end:%Y-%m-%d %H:%M} UTC")
    for r in result.releases[1:]:
        yield f"  release {r.name} ({r.kind}) rolled out from {r.start:%Y-%m-%d %H:%M} over {r.rollout_days:g} days"


# ---------------------------------------------------------------------------------------------
# conversational turns (worker/turns.py's `turn` record)

TURN_EVERY_S = (2.0, 5.0)  # a turn every 2-5 s, alternating speaking and listening
DECODE_MS = 114.0
RECOMPUTE_MS_PER_TOKEN = 0.005  # the cross K/V of prod57b's 60 blocks on one TP=3 rank: ~5 ms per 1,000 tokens
TURN_DEPTH = 3  # chunks buffered at a turn's arrival (the steps' playout_depth)


def _turn_plan(releases: list[SimRelease], turns: bool, turn_queue: str | None) -> np.ndarray | None:
    """Per release: True where its workers keep the whole buffer at a turn (``turn_queue``)."""
    names = [r.name for r in releases]
    if turn_queue is not None and turn_queue not in names:
        raise SimulationError(f"turn_queue {turn_queue!r} is not a simulated release; valid: {', '.join(names)}")
    if not turns:
        if turn_queue is not None:
            raise SimulationError("turn_queue needs turns=True")
        return None
    return np.array([n == turn_queue for n in names])


def simulate_turns(p: _Plans, keep_by_release: np.ndarray, fleet: list[SimWorker], releases: list[SimRelease],
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
