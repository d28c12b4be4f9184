"""A hold-out fleet: telemetry with known answers from a model that is not ``analytics.simulate``'s.

    res = generate(store, scenario="power_capped", seed=3, end=pinned_end(), days=14, onset_day=7)

The detectors were tuned on the simulator's fleet; to know they catch more than its incidents, this
generator writes a different fleet (its own step-time model, session lengths, prompt buckets, GPU samples
at the worker's rate and throttle reasons, the real worker's device names ``NVIDIA H200`` ...) and posts
every record through the collector's own Arrow ingest checks (``collector.routes.parse_body``: the wire
contract, with its canonical GPU kinds) before storing it. Nothing here is shared with the simulator.

Scenarios (``SCENARIOS``; release ``v2`` rolls out from ``onset_day`` over a day, ``v1`` before it):

- ``healthy``: v2 changes nothing;
- ``power_capped``: from the onset, the ``POWER_KIND`` GPUs sit at their power cap: 70% of their samples
  carry SW_POWER_CAP (0x4), SM clock -15% and diffusion +20% (no release involved);
- ``session_age``: v2's diffusion grows 0.02 ms per step within each session (resets every 16 steps);
- ``long_prompts``: v2's diffusion +15% only in sessions with first_forward_tokens > 1,500;
- ``longer_sessions``: v2's sessions are twice as long, per-step behaviour unchanged (a trap);
- ``longer_sessions_slower``: the trap's mix with a real change: v2's sessions twice as long and its
  diffusion ``SLOWER`` slower on every step;
- ``drift``: diffusion drifts +0.5% a day from the onset on every kind (no release);
- ``switch_cause``: v2 is +15% on the workers that run ``SWITCH`` (one per GPU kind), on every kind;
- ``real_leak``: v2 leaks ``LEAK_BYTES`` of reserved memory per session on every worker; each worker
  reports its GPU's total memory (a real H200's), so the time to OOM needs no table of kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa

from collector import records
from collector.switch_names import PRODUCTION_OFF

SCENARIOS: tuple[str, ...] = ("healthy", "power_capped", "session_age", "long_prompts", "longer_sessions",
                              "longer_sessions_slower", "drift", "switch_cause", "real_leak")
# device name (what torch reports) -> (diffusion ms, SM clock MHz, power W, power cap W, total memory bytes)
DEVICES: dict[str, tuple[float, float, float, float, int]] = {
    "NVIDIA H100 80GB HBM3": (138.0, 1980.0, 560.0, 700.0, 85_520_809_984),
    "NVIDIA H200": (126.0, 1980.0, 600.0, 700.0, 150_110_011_392),
    "NVIDIA B200": (104.0, 1965.0, 820.0, 1000.0, 191_514_353_664),
}
POWER_KIND = "NVIDIA H100 80GB HBM3"
SWITCH = "cuda_graphs"  # switch_cause: on for one worker of each kind, off for the others
LEAK_BYTES = 400 * 2**20
PROMPT_BUCKETS = (512, 768, 1024, 1280, 1536, 1792, 2048)
LONG_PROMPT = 1500
SLOWER = 0.04  # longer_sessions_slower: per step
RESET_EVERY = 16
SAMPLE_EVERY = 3  # one GPU sample per this many steps (~2 Hz at 6 steps/s: the detectors read minutes)
PERIOD_MS = 166.7
BATCH_ROWS = 50_000


@dataclass
class Holdout:
    start: datetime
    end: datetime
    onset: datetime
    scenario: str
    releases: list[str]
    workers: dict[str, str] = field(default_factory=dict)  # worker -> device name
    kinds: set[str] = field(default_factory=set)  # canonical, as stored
    release: str = "v2"  # the release the scenario is about (v1 where no release changes)


class HoldoutError(Exception):
    pass


def _post(store, kind: str, cols: dict[str, list | np.ndarray], token: str) -> None:
    """Encode as the worker's Arrow body, pass the collector's ingest checks, store."""
    from collector.routes import ARROW_STREAM, parse_body

    schema = records.ARROW_SCHEMAS[kind]
    n_rows = len(next(iter(cols.values())))
    table = pa.Table.from_arrays([pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(n_rows, f.type)
                                  for f in schema], schema=schema)
    for i in range(0, n_rows, BATCH_ROWS):  # the worker's batch size, under the collector's per-request bound
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as w:
            w.write_table(table.slice(i, BATCH_ROWS))
        parsed = parse_body(ARROW_STREAM, sink.getvalue().to_pybytes())[kind]
        t = getattr(parsed, "table", None) or parsed
        store.insert_arrow(records.TABLES[kind], t, dedup_token=f"{token}-{i}")


def generate(store, *, scenario: str, seed: int, end: datetime, days: float = 14.0, onset_day: float = 7.0,
             workers_per_kind: int = 3, sessions_per_day: float = 40.0, median_steps: int = 60) -> Holdout:
    if scenario not in SCENARIOS:
        raise HoldoutError(f"unknown scenario {scenario!r}; valid: {', '.join(SCENARIOS)}")
    rng = np.random.default_rng([seed, 29])
    end = end.astimezone(UTC)
    start, onset = end - timedelta(days=days), end - timedelta(days=days - onset_day)
    release_change = scenario not in ("power_capped", "drift")
    res = Holdout(start, end, onset, scenario, ["v1", "v2"] if release_change else ["v1"],
                  release="v2" if release_change else "v1")
    cols: dict[str, dict[str, list]] = {k: {} for k in ("step", "gpu_sample", "session")}

    def add(kind, **c):
        for n, v in c.items():
            cols[kind].setdefault(n, []).append(v if isinstance(v, np.ndarray) else np.asarray(v))

    oom_rows = []
    for d_i, (device, (diff0, clock0, power0, cap_w, total)) in enumerate(DEVICES.items()):
        for k in range(workers_per_kind):
            wid = f"hw{d_i}{k}"
            res.workers[wid] = device
            switches = set(records.SWITCH_NAMES) - set(PRODUCTION_OFF)  # the production set
            if k != 0:
                switches.discard(SWITCH)
            sw = records.encode_switches(switches)
            upgrade = onset + timedelta(days=float(rng.random())) if release_change else end + timedelta(days=1)
            worker_speed = float(np.exp(rng.normal(0, 0.01)))
            t = start + timedelta(seconds=float(rng.uniform(0, 3600)))
            reserved0, leaked, i = 60 * 2**30 + int(rng.integers(0, 64)) * 2**21, 0, 0
            while True:
                rel = "v2" if t >= upgrade else "v1"
                steps = max(8, int(median_steps * np.exp(rng.normal(0, 0.5))))
                if rel == "v2" and scenario in ("longer_sessions", "longer_sessions_slower"):
                    steps *= 2
                ff = int(rng.choice(PROMPT_BUCKETS))
                n = np.arange(steps)
                reset = (n % RESET_EVERY == RESET_EVERY - 1)
                diff = diff0 * worker_speed * np.exp(rng.normal(0, 0.01)) * np.exp(rng.normal(0, 0.02, steps))
                diff = np.where(reset, diff * 1.3, diff)
                day_of = (t - onset).total_seconds() / 86400
                capped = scenario == "power_capped" and device == POWER_KIND and t >= onset
                throttle_p, clock = 0.02, clock0
                if capped:
                    diff, throttle_p, clock = diff * 1.2, 0.7, clock0 * 0.85
                if scenario == "drift" and day_of > 0:
                    diff = diff * (1 + 0.005 * day_of)
                if rel == "v2":
                    if scenario == "session_age":
                        diff = diff + 0.02 * n
                    elif scenario == "long_prompts" and ff > LONG_PROMPT or scenario == "switch_cause" and SWITCH in switches:
                        diff = diff * 1.15
                    elif scenario == "longer_sessions_slower":
                        diff = diff * (1 + SLOWER)
                    elif scenario == "real_leak":
                        leaked += LEAK_BYTES
                if reserved0 + leaked > total - 2 * 2**30:  # out of memory: the process restarts
                    oom_rows.append((wid, f"{wid}-s{i}", rel, device, t, total))
                    leaked = 0
                reserved = reserved0 + leaked
                period = np.maximum(diff + 14.0, PERIOD_MS) + rng.exponential(0.5, steps)
                ts_ms = int(t.timestamp() * 1000) + np.concatenate([[0], np.cumsum(period[:-1])]).astype(np.int64)
                sid = f"{wid}-s{i}"
                common = {"worker_id": np.full(steps, wid), "session_id": np.full(steps, sid),
                              "release": np.full(steps, rel), "gpu_kind": np.full(steps, device),
                              "simulated": np.zeros(steps, bool)}
                add("step", **common, ts=ts_ms, step=n, diffusion_ms=diff, step_period_ms=period,
                    decode_ms=np.full(steps, 9.0), cache_upkeep_ms=np.full(steps, 2.0), late=period > PERIOD_MS + 20,
                    playout_depth=np.full(steps, 2), reset_step=reset, energy_mj=power0 * period,
                    mem_allocated_bytes=np.full(steps, reserved - 2**30), mem_reserved_bytes=np.full(steps, reserved),
                    buffers_registered=np.full(steps, 3), switches=np.full(steps, sw))
                m = n[::SAMPLE_EVERY]
                thr = rng.random(len(m)) < throttle_p
                add("gpu_sample", **{c: v[::SAMPLE_EVERY] for c, v in common.items()}, ts=ts_ms[::SAMPLE_EVERY] + 5,
                    gpu_index=np.zeros(len(m), np.int64),
                    power_w=np.where(thr, cap_w - rng.uniform(0, 3, len(m)), power0 * np.exp(rng.normal(0, 0.04, len(m)))),
                    sm_clock_mhz=np.where(thr, clock * 0.97, clock0 if not capped else clock * 1.1).astype(np.int64),
                    temp_c=np.full(len(m), 55.0), throttle_reasons=np.where(thr, 0x4, 0).astype(np.int64))
                streamed = float(period.sum()) / 1000
                for phase, ts in (("start", ts_ms[0]), ("end", ts_ms[-1])):
                    add("session", worker_id=[wid], session_id=[sid], release=[rel], gpu_kind=[device], ts=[ts],
                        simulated=[False], phase=[phase], first_forward_tokens=[ff],
                        streamed_s=[streamed if phase == "end" else 0.0], frames=[4 * steps if phase == "end" else 0],
                        avg_fps=[4 * steps / streamed if phase == "end" else None],
                        late_chunks=[int((period > PERIOD_MS + 20).sum()) if phase == "end" else 0], stall_ms=[0.0],
                        tp_size=[1], shape=["prod57b"], switches=[sw], cond_tokens=[ff - 757 if ff > 757 else 1],
                        decoder_height=[480], decoder_width=[832], chunk_frames=[4], gpu_mem_total_bytes=[total])
                i += 1
                t = datetime.fromtimestamp(ts_ms[-1] / 1000, UTC) + timedelta(
                    seconds=float(rng.exponential(86400 / sessions_per_day)))
                if t >= end - timedelta(minutes=10):
                    break
    for kind, c in cols.items():
        flat = {n: np.concatenate(v) for n, v in c.items()}
        flat["ts"] = pa.array(flat["ts"].astype("int64"), pa.timestamp("ms", tz="UTC"))
        _post(store, kind, flat, f"holdout-{scenario}-{seed}-{kind}")
    if oom_rows:
        import orjson

        _post(store, "event", {"worker_id": [r[0] for r in oom_rows], "session_id": [r[1] for r in oom_rows],
                               "release": [r[2] for r in oom_rows], "gpu_kind": [r[3] for r in oom_rows],
                               "ts": pa.array([r[4] for r in oom_rows], pa.timestamp("ms", tz="UTC")),
                               "simulated": [False] * len(oom_rows), "kind": ["oom"] * len(oom_rows),
                               "detail": [orjson.dumps({"capacity_bytes": r[5]}).decode() for r in oom_rows]},
              f"holdout-{scenario}-{seed}-oom")
    from collector.gpu_kinds import canonical_gpu_kind

    res.kinds = {canonical_gpu_kind(d) for d in DEVICES}
    return res
