"""The demo's first step (api/demo.py): a synthetic ~24 fps session (``SessionSpec``, ``session_records``)
shipped through ``TelemetryClient``, waited for in the store, and summarized."""

from __future__ import annotations

import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from collector import catalog

CHUNK_MS = catalog.CHUNK_DEADLINE_MS  # one 4-frame chunk every 166.7 ms


# -- step 2: a session's records -----------------------------------------------------------------
@dataclass
class SessionSpec:
    """A synthetic session close to the paper's optimized worker (~24.5 fps, reset every 42 steps)."""

    steps: int = 300
    worker_id: str = "demo-w1"
    release: str = "demo"
    gpu_kind: str = "h100"
    tp_size: int = 3
    gpus: int = 4  # TP group + one decoder GPU
    shape: str = "prod57b"
    diffusion_ms: float = 157.7
    reset_every: int = 42
    reset_ms: float = 263.0
    seed: int = 0
    session_id: str = field(default_factory=lambda: f"demo-{uuid.uuid4().hex[:8]}")
    switches: str = "decoder_own_gpu,delta_rotation,fp8_cache,ring_cache,rope_at_write,triton_kernels"

    @property
    def labels(self) -> dict[str, str]:
        return {
            "worker_id": self.worker_id,
            "session_id": self.session_id,
            "release": self.release,
            "gpu_kind": self.gpu_kind,
        }


def session_records(spec: SessionSpec, end: datetime | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kind, row) pairs of one session ending at ``end`` (now): start, steps, GPU samples, end."""
    rng = random.Random(spec.seed)
    periods = []
    for i in range(spec.steps):
        diffusion = spec.reset_ms if i and i % spec.reset_every == 0 else rng.gauss(spec.diffusion_ms, 2.5)
        periods.append((diffusion, diffusion + abs(rng.gauss(1.6, 0.4))))  # decoder overlapped: +1.6 ms
    streamed_ms = sum(p for _, p in periods)
    end = end or datetime.now(UTC) - timedelta(seconds=1)
    t0 = end - timedelta(milliseconds=streamed_ms)
    first_tokens = rng.randint(200, 900)
    common = {**spec.labels, "simulated": True}
    session = {
        **common,
        "first_forward_tokens": first_tokens,
        "tp_size": spec.tp_size,
        "shape": spec.shape,
        "switches": spec.switches,
    }
    yield (
        "session",
        {
            **session,
            "ts": t0,
            "phase": "start",
            "streamed_s": 0.0,
            "frames": 0,
            "avg_fps": None,
            "late_chunks": 0,
            "stall_ms": 0.0,
        },
    )
    yield (
        "event",
        {**common, "ts": t0, "kind": "session_start", "detail": {"first_forward_tokens": first_tokens}},
    )

    depth, late_chunks, stall_ms, t = 3.0, 0, 0.0, 0.0
    energy = [0.0] * spec.gpus
    next_sample = 0.0
    for i, (diffusion, period) in enumerate(periods):
        t += period
        depth += (CHUNK_MS - period) / CHUNK_MS  # the player drains one chunk per 166.7 ms
        late = depth < 0
        if late:
            late_chunks += 1
            stall_ms += -depth * CHUNK_MS
            depth = 0.0
        depth = min(depth, 4.0)
        ts = t0 + timedelta(milliseconds=t)
        reset = i > 0 and i % spec.reset_every == 0
        yield (
            "step",
            {
                **common,
                "ts": ts,
                "step": i,
                "diffusion_ms": diffusion,
                "step_period_ms": period,
                "decode_ms": rng.gauss(114.0, 1.5),
                "cache_upkeep_ms": rng.gauss(6.2, 0.3) if not reset else 6.2 + 95.0,
                "attention_ms": rng.gauss(9.5, 0.4),
                "allreduce_ms": rng.gauss(12.0, 0.8),
                "late": late,
                "playout_depth": int(depth),
                "reset_step": reset,
                "energy_mj": spec.gpus * 650.0 * period,  # W x ms = mJ
                "mem_allocated_bytes": 58 << 30,
                "mem_reserved_bytes": 62 << 30,
                "buffers_registered": 1,
                "switches": spec.switches,
            },
        )
        if reset:
            yield (
                "event",
                {**common, "ts": ts, "kind": "reset", "detail": {"step": i, "delta_rotation": True}},
            )
        while next_sample <= t:  # NVML at 10 Hz per GPU
            sample_ts = t0 + timedelta(milliseconds=next_sample)
            for g in range(spec.gpus):
                power = rng.gauss(650.0 if g < spec.tp_size else 420.0, 15.0)
                energy[g] += power * 100.0
                yield (
                    "gpu_sample",
                    {
                        **common,
                        "ts": sample_ts,
                        "gpu_index": g,
                        "power_w": power,
                        "energy_mj": energy[g],
                        "sm_clock_mhz": 1980,
                        "mem_used_bytes": (66 if g < spec.tp_size else 30) << 30,
                        "temp_c": rng.gauss(62.0, 1.0),
                        "throttle_reasons": 0,
                    },
                )
            next_sample += 100.0
    frames = 4 * spec.steps
    streamed_s = streamed_ms / 1000.0
    yield (
        "session",
        {
            **session,
            "ts": end,
            "phase": "end",
            "streamed_s": streamed_s,
            "frames": frames,
            "avg_fps": frames / streamed_s,
            "late_chunks": late_chunks,
            "stall_ms": stall_ms,
        },
    )
    yield "event", {**common, "ts": end, "kind": "session_end", "detail": {"frames": frames}}


# -- step 3: ship it through the client ----------------------------------------------------------
def stream_session(url: str, spec: SessionSpec, token: str | None = None) -> dict[str, Any]:
    """Put every record through a ``TelemetryClient``, close it; per-kind counts and its counters."""
    from collector.client import TelemetryClient

    client = TelemetryClient(url, token=token, batch_rows=500, flush_interval_s=0.2)
    put = Counter()
    for kind, row in session_records(spec):
        client.put(kind, row)
        put[kind] += 1
    client.close(timeout_s=10.0)
    return {"put": dict(put), **client.stats()}


# -- step 4: wait until the store has it ---------------------------------------------------------
KINDS = ("step", "gpu_sample", "session", "event")


def stored_counts(store, session_id: str) -> dict[str, int]:
    from analytics.queries import stored_counts

    return stored_counts(store, session_id, KINDS)


def wait_stored(store, session_id: str, expected: dict[str, int], timeout_s: float = 15.0) -> dict[str, int]:
    """Poll the store until every kind of the session has its expected rows (or the time is up)."""
    end = time.monotonic() + timeout_s
    while True:
        got = stored_counts(store, session_id)
        if all(got.get(k, 0) >= n for k, n in expected.items()) or time.monotonic() > end:
            return got
        time.sleep(0.1)


# -- step 5: what it says ------------------------------------------------------------------------
def session_summary(store, session_id: str) -> dict[str, Any]:
    from analytics.queries import session_row

    r = session_row(store, session_id) or {"steps": 0, "fps": None, "late_chunks": 0, "period_ms_q": [],
                                           "diffusion_ms_q": []}
    steps, fps, late, period_q, diffusion_q = (r["steps"], r["fps"], r["late_chunks"], r["period_ms_q"],
                                               r["diffusion_ms_q"])
    return {
        "steps": int(steps),
        "fps": float(fps) if fps is not None and math.isfinite(fps) else None,
        "late_chunks": int(late),
        "step_period_ms_p50_p95_p99": [round(float(x), 1) for x in period_q],
        "diffusion_ms_p50_p95_p99": [round(float(x), 1) for x in diffusion_q],
    }


def print_summary(url: str, spec: SessionSpec, shipped: dict, stored: dict, summary: dict) -> None:
    from collector import records

    total_put = sum(shipped["put"].values())
    print(
        f"livestep demo: session {spec.session_id} ({spec.steps} steps, {spec.gpu_kind} x{spec.gpus}, "
        f"release {spec.release})"
    )
    print(
        f"  shipped   {total_put} records through the client: sent {shipped['sent']}, dropped "
        f"{shipped['dropped']}, failed batches {shipped['failed_batches']}, retries {shipped['retries']}"
    )
    print(
        "  stored    " + ", ".join(f"{records.TABLES[k]} {stored.get(k, 0)}/{n}" for k, n in shipped["put"].items())
    )
    fps = f"{summary['fps']:.2f}" if summary["fps"] is not None else "n/a"
    p50, p95, p99 = summary["step_period_ms_p50_p95_p99"]
    print(
        f"  session   {fps} fps, step period p50/p95/p99 {p50}/{p95}/{p99} ms, late chunks "
        f"{summary['late_chunks']}"
    )
    print("  look at")
    for path, what in (
        ("/v1/health", "liveness, store and spool"),
        ("/v1/sessions", "sessions with filters and paging"),
        (f"/v1/sessions/{spec.session_id}/steps", "this session's steps"),
        ("/docs", "the OpenAPI schema, interactive"),
    ):
        print(f"    {url}{path:<40} {what}")
