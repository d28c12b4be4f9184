"""The simulator's planned sessions as Arrow blocks: ``SessionPlans`` buffers the sessions ``simulate_fleet``
plans (one entry per session), ``BlockWriter`` turns them into step, session (and turn) rows with the
per-step noise and writes them to a sink in large blocks, one dedup token per block."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from analytics.sim_fleet import (
    FP8_DRIFT_PER_100_STEPS,
    FP8_SAMPLE_EVERY,
    GPU_KINDS,
    LATE_MS,
    NEW_TOKENS,
    RESET_EVERY,
    RESOLUTIONS,
    STEP_BUDGET_MS,
)
from analytics.sim_turns import simulate_turns
from collector import records


class SessionPlans:
    """Column buffers for planned sessions (one entry per session)."""

    cols = ("worker", "release", "start_ms", "n_steps", "period_ms", "reserved", "buffers", "tokens", "sync",
            "resolution", "upkeep", "spread")

    def __init__(self):
        for c in self.cols:
            setattr(self, c, [])
        self.session_ids: list[str] = []

    def __len__(self):
        return len(self.session_ids)


class BlockWriter:
    """Accumulates planned sessions and writes their steps and session rows in large Arrow blocks."""

    def __init__(self, sink, result, fleet, releases, run_key: str, bar, block_steps: int,
                 fp8_drift: tuple[str, str] | None = None):
        self.sink, self.result, self.fleet, self.releases = sink, result, fleet, releases
        self.run_key, self.seed, self.bar = run_key, result.seed, bar
        self.block = 0
        self.block_steps = block_steps
        self.plans = SessionPlans()
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
        self.plans = SessionPlans()
        self.pending = 0

    def _build(self, p: SessionPlans, rng: np.random.Generator) -> tuple[pa.Table, pa.Table]:
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

    def _write_turns(self, p: SessionPlans, token: str) -> None:
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
