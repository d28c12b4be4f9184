"""The simulated fleet's model: its constants, GPU kinds, releases (one per injected incident), workers and
result, and the plans of releases and workers that ``analytics.simulate.simulate_fleet`` draws sessions from
(``analytics.simulate``'s docstring describes the incidents).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np

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
