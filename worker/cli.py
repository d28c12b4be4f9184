"""``livestep worker run|bench``: a live worker session, or the step waterfall benchmark.

    livestep worker run --preset tiny --seconds 30 --collector http://127.0.0.1:8000 --token T \\
        --switch ring_cache=on --switch rope_at_write=on --release v7 --worker-id w1
    livestep worker run --preset tiny --sessions 5 --switch-source http://127.0.0.1:8000   # control plane
    livestep worker run --preset tiny --sessions 3 --telemetry-file run.arrows   # ship later: livestep replay
    livestep worker bench --preset prod57b --tp 3            # bench/worker_step.py (GPU)

Unknown presets, switch names and invalid combinations raise typed errors (``ShapeError``,
``SwitchError``) that api/cli.py prints as one line naming the valid values. A collector that is
down costs records (dropped and counted in the summary), never the session; with
``--telemetry-file`` what cannot be delivered is filed for ``livestep replay`` instead (each
session's client appends its own Arrow IPC stream to the file, fsync'd when the session ends).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from dataclasses import asdict
from pathlib import Path

from collector.flip_fields import FLIP_MODES
from worker.config import PREROLL, PRESETS, SWITCH_NAMES


def register(subparsers) -> None:
    p = subparsers.add_parser("worker", help="the serving worker: run a live session, or bench the step")
    sub = p.add_subparsers(dest="worker_command", metavar="ACTION")
    run = sub.add_parser("run", help="stream sessions (one chunk per 166.7 ms) and ship step telemetry")
    run.add_argument("--preset", default="tiny", help=f"model shape: {', '.join(PRESETS)}")
    run.add_argument("--seconds", type=float, default=30.0, help="streamed seconds per session")
    run.add_argument("--steps", type=int, default=None, help="steps per session (overrides --seconds)")
    run.add_argument("--sessions", type=int, default=1, help="sessions, one after another, on one worker")
    run.add_argument("--collector", default=None, help="collector URL (http://host:port); none = no shipping")
    run.add_argument("--token", default=None,
                     help="ingest bearer token (visible in /proc: prefer --token-file or LIVESTEP_INGEST_TOKEN)")
    run.add_argument("--token-file", default=None, metavar="PATH",
                     help="file whose first line is the ingest bearer token (default: LIVESTEP_INGEST_TOKEN)")
    run.add_argument("--telemetry-file", default=None, metavar="PATH",
                     help="Arrow IPC file for the records: alone, every record; with --collector, those it "
                          "cannot take (collector down or out of time at the end). Ship it later with "
                          "`livestep replay PATH --collector URL`; appended to if it exists")
    run.add_argument("--switch", action="append", default=[], metavar="NAME=on|off",
                     help=f"initial switch values; names: {', '.join(SWITCH_NAMES)}")
    run.add_argument("--switch-source", default=None,
                     help="control plane: its base URL http(s)://host:port (or the full .../v1/switches) or a "
                          "JSON file, polled between steps")
    run.add_argument("--release", default="dev", help="release label of this worker's telemetry (default dev)")
    run.add_argument("--worker-id", default="w0", help="worker id in telemetry and switch polls (default w0)")
    run.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if present)")
    run.add_argument("--tp", type=int, default=1,
                     help="TP group size: N ranks under torchrun (re-launched under it when N GPUs exist), "
                          "else one rank's shard alone (its shape)")
    run.add_argument("--cond-tokens", type=int, default=None, help="first-forward tokens (default: random per session)")
    run.add_argument("--no-realtime", action="store_true", help="do not wait for the player (as fast as possible)")
    run.add_argument("--turns-every", default=None, metavar="LO,HI",
                     help="conversational turns every LO-HI seconds, speaking and listening by turns (worker/turns.py)")
    run.add_argument("--playout-policy", default=None, choices=("keep", "drop_unplayed", "trim", "cover"),
                     help="what a turn does with the chunks made before it (default: the switches' turn_* "
                          "policy, keep when none is on: play them; worker/turns.py)")
    run.add_argument("--preroll", type=int, default=PREROLL, metavar="CHUNKS",
                     help=f"chunks the player buffers before playback starts, 1..4 (default {PREROLL}): each is about "
                          "one step of time to first frame, and slack before a slow step makes a chunk late")
    run.add_argument("--no-warm", action="store_true",
                     help="skip the warm-up at start (compile and CUDA-graph capture once per worker, for the "
                          "initial switches): each session then captures its own graphs once its window fills")
    run.add_argument("--flip", default="background", choices=FLIP_MODES,
                     help="how a switch flip applies (worker/readiness.py): background (the default; built on a thread, "
                          "swapped in at a step boundary, the worker never re-warms between sessions; the warm-up "
                          "also prepares each runtime switch's neighbour; while a target builds the worker holds a "
                          "second warm state: docs/PERFORMANCE.md, issue 26) or inline (the plain path: rebuilt in the "
                          "step loop, a blocking re-warm after the session); tensor parallel: inline")
    run.add_argument("--json", action="store_true", help="print each session summary as JSON")
    run.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus metrics on this port (GET /metrics; off by default; 0 = any free port)")
    run.add_argument("--metrics-host", default="127.0.0.1",
                     help="bind address of --metrics-port; off loopback --metrics-token is required")
    run.add_argument("--metrics-token", default=os.environ.get("LIVESTEP_METRICS_TOKEN"),
                     help="bearer token the scraper must send (default LIVESTEP_METRICS_TOKEN)")
    run.set_defaults(func=cmd_run)
    # every argument, --help included, goes to bench/worker_step.py (api/cli.py: passthrough)
    bench = sub.add_parser("bench", help="bench/worker_step.py: the step waterfall (GPU); --help lists its options",
                           add_help=False)
    bench.set_defaults(func=cmd_bench, passthrough=True)
    p.set_defaults(func=lambda a: p.print_help() or 0)


def cmd_run(args) -> int:
    from worker import preflight
    from worker.config import ModelShape, Switches, parse_switch_args
    from worker.device import check_device
    from worker.run_args import client_kwargs, turns_of, warm_up
    from worker.session import Worker

    ModelShape.from_name(args.preset)  # a clear error before torch spins up
    check_device(args.device)
    from worker import parallel

    args.token = preflight.ingest_token(args.token, args.token_file)
    if args.collector or args.telemetry_file:
        preflight.client_dependencies()
    if args.collector:
        preflight.collector(args.collector, args.token)
    if parallel.wants_group(args.tp):  # a real TP group: worker/parallel.py runs each rank
        return parallel.run_cli(args)
    switches = parse_switch_args(args.switch)
    w = Worker(args.preset, device=args.device, tp=args.tp, worker_id=args.worker_id, release=args.release,
               flip=args.flip)
    if args.metrics_port is not None:
        from worker.metrics import WorkerMetrics, serve

        server = serve(WorkerMetrics(w).registry, args.metrics_host, args.metrics_port, args.metrics_token)
        print(f"metrics: http://{args.metrics_host}:{server.server_port}/metrics", flush=True)
    if isinstance(args.switch_source, str) and args.switch_source.startswith(("http://", "https://")):
        preflight.switch_source(args.switch_source, args.token, w.worker_id, w.release, w.gpu_kind)
    warm_up(w, switches, args)
    for _ in range(args.sessions):
        s = w.run_session(seconds=args.seconds, steps=args.steps, collector_url=args.collector, token=args.token,
                          switches=switches, switch_source=args.switch_source, cond_tokens=args.cond_tokens,
                          realtime=not args.no_realtime, client_kwargs=client_kwargs(args),
                          turns=turns_of(args, w), playout_policy=args.playout_policy, preroll=args.preroll)
        _print_session(s, args.json)
        switches = Switches.decode(s.switches)  # the next session starts where the control plane left it
    return 0


def _print_session(s, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(s)))
        return
    fps = f"{s.avg_fps:.2f}" if s.avg_fps is not None else "-"
    print(f"session {s.session_id}: {s.steps} steps, {s.frames} frames, {fps} fps, "
          f"{s.late_chunks} late, first forward {s.first_forward_tokens} tokens, "
          f"diffusion {s.mean_diffusion_ms or 0:.2f} ms/step, switches [{s.switches}], "
          f"{len(s.switch_events)} switch changes, records sent {s.telemetry_sent} "
          + (f"filed {s.telemetry_filed} " if s.telemetry_filed else "") + f"dropped {s.telemetry_dropped}"
          + (f", FP8 inputs at +-448 at most {s.max_fp8_saturated:.2e} over {s.probed_steps} probed steps"
             if s.max_fp8_saturated is not None else ""))


def cmd_bench(args) -> int:
    script = Path(__file__).resolve().parents[1] / "bench" / "worker_step.py"
    if not script.is_file():
        raise BenchError(f"{script} is not here: bench/ ships with a source checkout of livestep, not in the wheel")
    from worker.device import check_device

    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device")
    check_device(device.parse_known_args(args.passthrough_args)[0].device)  # one line for cuda without CUDA
    sys.argv = [str(script), *args.passthrough_args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:  # the script's own argparse (--help: 0, a bad option: 2)
        return e.code if isinstance(e.code, int) else 0
    return 0


class BenchError(Exception):
    """``livestep worker bench`` cannot run here; the message says why."""
