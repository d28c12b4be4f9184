"""What serving and scraping the worker's /metrics costs the step: sessions with it vs without, same run.

    python bench/metrics_overhead.py --preset tiny --device cpu            # CPU smoke run (~1 min)
    python bench/metrics_overhead.py                                       # CUDA: prod57b one TP=3 rank

Alternating whole sessions of the real loop (``Worker.run_session``, all production switches of the
preset, ``realtime=False``: flat out, so any cost shows in the period) on one worker: "off" with no
metrics, "on" with ``WorkerMetrics`` observing the session, its HTTP endpoint up, and a scraper
thread GETting ``/metrics`` (OpenMetrics) every ``--scrape-every`` seconds (1.0: the issue's rate).
The order alternates per round. The figure is the median step period (wall time between chunk
deliveries) over the steady steps (after the window fill and any graph capture), and the ratio on/off;
host syncs are counted in ``set_sync_debug_mode("warn")`` on CUDA (process-wide: a sync in the
scraper's thread would count too). Prints a table and, last, the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import urllib.request

import torch

from worker.config import ModelShape, parse_switch_args
from worker.metrics import WorkerMetrics, serve
from worker.model import DiT
from worker.session import Worker
from worker.telemetry import ListSink

PROD = ["ring_cache=on", "rope_at_write=on", "fp8_cache=on", "delta_rotation=on", "static_scales=on"]
CUDA_ONLY = ["triton_kernels=on", "cuda_graphs=on"]


class _Recorder:
    """An observer that keeps each session's step stats (plain lists, no tensors) for the table."""

    def __init__(self):
        self.stats = []

    def session_started(self, s) -> None:
        pass

    def session_ended(self, s, summary) -> None:
        self.stats.append(s.tel.stats)


class _Scraper(threading.Thread):
    def __init__(self, url: str, every_s: float):
        super().__init__(daemon=True)
        self.url, self.every_s = url, every_s
        self.active, self.stop = threading.Event(), threading.Event()
        self.scrapes, self.bytes, self.errors = 0, 0, 0

    def run(self) -> None:
        req = urllib.request.Request(self.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        while not self.stop.is_set():
            if self.active.wait(0.05):
                try:
                    with urllib.request.urlopen(req, timeout=5) as r:
                        self.bytes += len(r.read())
                        self.errors += r.status != 200
                    self.scrapes += 1
                except OSError:
                    self.errors += 1
                self.stop.wait(self.every_s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="default: prod57b on CUDA (one TP=3 rank), tiny on CPU")
    p.add_argument("--tp", type=int, default=None, help="the rank's TP size (default 3 for prod57b, else 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=None, help="steps per session (default: ~20 s of steps)")
    p.add_argument("--rounds", type=int, default=4, help="on/off session pairs, order alternating")
    p.add_argument("--scrape-every", type=float, default=1.0, help="seconds between scrapes")
    p.add_argument("--switch", action="append", default=None, help="override the switches (NAME=on|off)")
    p.add_argument("--warm", action="store_true", help="Worker.warm first (graphs captured once per worker)")
    args = p.parse_args()
    dev = torch.device(args.device)
    preset = args.preset or ("prod57b" if dev.type == "cuda" else "tiny")
    tp = args.tp or (3 if preset == "prod57b" else 1)
    from worker.config import tp_rank_of

    base = ModelShape.from_name(preset)
    shape = tp_rank_of(base, tp, 0) if tp > 1 else base
    sw = parse_switch_args(args.switch if args.switch is not None else PROD + (CUDA_ONLY if dev.type == "cuda" else []))
    model = DiT(shape, dev)
    cond = shape.cond_tokens[0]
    fill = -(-(shape.window - cond) // shape.new_tokens)
    w = Worker(shape, device=dev, model=model)
    metrics = WorkerMetrics(w)
    w.observers.remove(metrics)  # observes only the "on" sessions
    rec = _Recorder()
    w.observers.append(rec)

    def session(on: bool, steps: int) -> tuple[float, int]:
        """One session; "on": the metrics observe it, their endpoint is up and scraped meanwhile."""
        syncs = []
        server = scraper = None
        if on:
            w.observers.append(metrics)
            server = serve(metrics.registry, "127.0.0.1", 0)
            scraper = _Scraper(f"http://127.0.0.1:{server.server_port}/metrics", args.scrape_every)
            scraper.start()
            scraper.active.set()

        def show(message, *a, **k):
            if "synchroniz" in str(message).lower():
                syncs.append(str(message)[:80])

        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                w.run_session(steps=steps, realtime=False, switches=sw, sink=ListSink(), cond_tokens=cond,
                              seed=1, sync_debug="warn" if dev.type == "cuda" else False)
        finally:
            if on:
                scraper.stop.set()
                scraper.join(10)
                server.shutdown()
                w.observers.remove(metrics)
                totals["scrapes"] += scraper.scrapes
                totals["errors"] += scraper.errors
                totals["bytes"] += scraper.bytes
        return time.perf_counter() - t0, len(syncs)

    totals = {"scrapes": 0, "errors": 0, "bytes": 0}

    steps = args.steps
    if steps is None:  # ~20 s of steps, measured on a short warm-up session
        wall, _ = session(False, fill + 20)
        per = wall / (fill + 20)
        steps = max(fill + 60, int(20 / max(per, 1e-4)))
    else:
        session(False, fill + 8)  # warm-up: compile, autotune, allocate
    if args.warm:
        w.warm(sw, (w.bucket(cond),))  # every graph captured once: sessions only replay (the serving path)
    first = fill + 2  # the capture step's period (cuda_graphs) and the one after it are not steady
    med: dict[bool, list[float]] = {True: [], False: []}
    allp: dict[bool, list[float]] = {True: [], False: []}
    syncs: dict[bool, list[int]] = {True: [], False: []}
    print(f"# {preset} (TP={tp} rank) on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, "
          f"switches [{sw.encode()}], {steps} steps per session, {args.rounds} rounds, scrape every "
          f"{args.scrape_every:g} s", flush=True)
    for r in range(args.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            _, n_sync = session(on, steps)
            periods = rec.stats[-1].period_ms[first:]
            med[on].append(statistics.median(periods))
            allp[on] += periods
            syncs[on].append(n_sync)
        print(f"round {r}: on {med[True][-1]:.3f} ms, off {med[False][-1]:.3f} ms, "
              f"ratio {med[True][-1] / med[False][-1]:.4f}; scrapes so far {totals['scrapes']}", flush=True)
    on, off = statistics.median(allp[True]), statistics.median(allp[False])
    ratios = [a / b for a, b in zip(med[True], med[False], strict=True)]
    print()
    print("| variant | median step period (ms) | steps | host syncs per session | scrapes |")
    print("|---|---|---|---|---|")
    print(f"| /metrics off | {off:.3f} | {len(allp[False])} | {syncs[False]} | 0 |")
    print(f"| /metrics served + scraped every {args.scrape_every:g} s | {on:.3f} | {len(allp[True])} | "
          f"{syncs[True]} | {totals['scrapes']} ({totals['errors']} failed, "
          f"{totals['bytes'] / max(totals['scrapes'], 1):.0f} B each) |")
    print(f"per-round ratios: {', '.join(f'{x:.4f}' for x in ratios)} (range {min(ratios):.4f}-{max(ratios):.4f})")
    print(f"ratio on/off (median step period, same run): {on / off:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
