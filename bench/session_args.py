"""What the worker benches that serve sessions (bench/flip.py, bench/soak.py) share: their common options
and the median steady step of a session's records."""

from __future__ import annotations

import argparse
import statistics

from worker.telemetry import ListSink


def add_session_args(ap: argparse.ArgumentParser, name: str, ab_steps: int) -> None:
    """The steady-step comparison, playout, telemetry-file and label options; ``name`` labels the release
    and the worker (``--release name``, ``--worker-id name-w0``)."""
    ap.add_argument("--ab-rounds", type=int, default=2, help="steady-step comparison rounds (0: skip)")
    ap.add_argument("--ab-steps", type=int, default=ab_steps, help="steady steps per comparison session")
    ap.add_argument("--preroll", type=int, default=2, help="chunks buffered before playback starts")
    ap.add_argument("--telemetry-file", default=None, help="write every record here (Arrow IPC) for livestep replay")
    ap.add_argument("--release", default=name)
    ap.add_argument("--worker-id", default=f"{name}-w0")
    ap.add_argument("--seed", type=int, default=0)


def steady_ms(sink: ListSink, fill: int) -> float:
    """The median diffusion ms of the steps after the first ``fill`` (the window full); NaN when none."""
    ms = [r["diffusion_ms"] for r in sink.rows["step"][fill:] if r["diffusion_ms"] is not None]
    return statistics.median(ms) if ms else float("nan")
