"""CUDA graphs of the step: captured once per worker, replayed by every session.

    runner = ChunkRunner(model, use_graphs=True, probe=worker.probe, capture="any")  # warm-up
    cond_kv = runner.first_forward(cond, cache)        # a graph per conditioning length (bucket)
    latents, graphed = runner(noise, cache, cond_kv, probe=None)
    runner.capture = "never"                           # a warm worker's sessions only replay

A graph is valid for the host-side state it was captured in, so each one is keyed by that state:
the window size its attention reads (``cache.book.window_after``), probed or not, the conditioning it
cross-attends to (a first-forward graph's outputs, by identity) and the static activation scales'
calibration counters (``DiT.calibration_state``: a calibrating step observes its inputs, a calibrated
one does not; a step's key leaves out the cross K/V input's, which only first forwards and turns use).
A turn's new cross K/V is copied into the windows of the first forward of its (bucketed) length
(``adopt_cross``), so the steps after it replay that bucket's graphs. A replay restores the counters the captured run left, so host and device agree as if
the step had run eagerly. The cache's per-step advance / reset (``begin_step``) stays eager, outside
the graphs, and writes the index buffers they read (``KVCache._keep``: one buffer per shape, so a
graph captured in one session reads the same tensors in the next).

``capture``: "full" captures once the window is full and the scales calibrated (a session's own
runner, e.g. after a switch flip rebuilt the cache); "any" captures every step and first forward it
meets (``Worker.warm``: the fill steps, the calibrating first chunk, one first forward per bucket);
"never" only replays, running eagerly on a miss (counted in ``misses``). The graphs of one
conditioning share a memory pool: they replay one after another on one stream and each output is
copied out (or, for the first forward's cross K/V, kept alive) before the next replays.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo.callback

from worker.cache import KVCache
from worker.fp8 import SaturationProbe
from worker.model import DiT

CAPTURE_MODES = ("full", "any", "never")
GRAPH_MODES = ("global", "thread_local")
# tests of the bookkeeping on CPU set this (with torch.cuda's graph API replaced by stand-ins)
GRAPHS_ON_CPU = False


class CompileInCapture(RuntimeError):
    """torch.compile started compiling inside one of our CUDA-graph captures: its first call of a kernel
    (inductor's autotune benchmark synchronizes) would invalidate the capture. Every capture runs after an
    eager warm-up of exactly what it records, so this is a bug: the capture is refused before it starts."""


_CAPTURE = threading.local()  # .on: this thread is inside a capture (CPU tests: the stand-ins' too)


def capturing() -> bool:
    """This thread is inside a ChunkRunner capture."""
    return getattr(_CAPTURE, "on", False)


@torch._dynamo.callback.on_compile_start
def _refuse_compile_in_capture(_args) -> None:
    # dynamo calls this in the compiling thread before it traces (the outermost compile of the process)
    if capturing():
        raise CompileInCapture("torch.compile inside a CUDA-graph capture: its warm-up did not run what it records")


class _Flagged:
    """A capture context, with ``capturing()`` true inside it on this thread, and torch.compile's stance
    ``eager_on_recompile`` meanwhile: a compiled function whose guards fail inside the capture (or that never
    compiled) runs its ops eagerly, which capture, instead of compiling, which would break the capture (the
    warm-up before each capture compiles what it records; yet on the H200, 2026-12-02 11:00 UTC, a flip's
    build beside a live session met a recompile at capture time only). ``CompileInCapture`` stays as the
    guard against a compile that gets past the stance."""

    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        self.inner.__enter__()
        _EAGER_ON_RECOMPILE.enter()
        _CAPTURE.on = True

    def __exit__(self, *exc):
        _CAPTURE.on = False
        _EAGER_ON_RECOMPILE.exit()
        return self.inner.__exit__(*exc)


class _SharedStance:
    """A torch.compile stance held while any capture runs: the stance is process-wide and captures on two
    threads may overlap (a build beside a session's own capture), so the first one in sets it and the last
    one out restores what was there before."""

    def __init__(self, stance: str):
        self.stance, self.lock, self.held, self.ctx = stance, threading.Lock(), 0, None

    def enter(self) -> None:
        with self.lock:
            if self.held == 0:
                self.ctx = torch.compiler.set_stance(self.stance)
                self.ctx.__enter__()
            self.held += 1

    def exit(self) -> None:
        with self.lock:
            self.held -= 1
            if self.held == 0:
                self.ctx.__exit__(None, None, None)
                self.ctx = None


_EAGER_ON_RECOMPILE = _SharedStance("eager_on_recompile")


@dataclass
class _Graph:
    """One captured chunk: replay after copying the step's noise into ``noise``; ``out`` is overwritten."""

    graph: torch.cuda.CUDAGraph
    noise: torch.Tensor
    out: torch.Tensor
    probe: SaturationProbe | None  # the probe whose count it zeroes and sums (None: plain)
    total: int  # the probe's element total for one replay
    state_after: tuple  # the calibration counters the captured forward left
    cond_kv: list  # the cross windows it reads: kept alive (and their id, its key, never reused)


@dataclass
class _FirstForward:
    """One captured first forward: replay after copying the conditioning into ``cond``."""

    graph: torch.cuda.CUDAGraph
    cond: torch.Tensor
    cond_kv: list  # the cross-attention windows, graph outputs the step graphs read
    state_after: tuple
    calibrated_after: list[bool]


class _ThreadLocalCapture:
    """``torch.cuda.graph`` without its device-wide synchronize and ``empty_cache``, capturing on the calling
    thread's current stream in ``capture_error_mode="thread_local"``."""

    def __init__(self, graph, pool):
        self.graph, self.pool = graph, pool

    def __enter__(self):
        self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def __exit__(self, *exc):
        self.graph.capture_end()
        return False


class ChunkRunner:
    """Denoises one chunk (and runs the first forward) eagerly or by replaying a captured CUDA graph.

    The graphs hold the 4 passes x blocks of a step. A step with a ``SaturationProbe`` replays a graph
    that also counts the saturation of every static-scale GEMM input (eager steps route the inputs to
    the probe directly). With the worker's ``probe`` given and the scales calibrated, the plain and the
    probed graph are captured at the same step after a warm-up of each: under tensor parallel every rank then
    runs the same forwards (ranks > 0 have no probe and capture the plain graph at that step).
    """

    def __init__(self, model: DiT, use_graphs: bool, probe: SaturationProbe | None = None,
                 capture: str = "full"):
        if capture not in CAPTURE_MODES:
            raise ValueError(f"capture {capture!r}; valid: {', '.join(CAPTURE_MODES)}")
        self.model = model
        self.use_graphs = use_graphs and (model.device.type == "cuda" or GRAPHS_ON_CPU)
        self.probe = probe
        self.capture = capture
        self.cache: KVCache | None = None  # the one cache whose buffers the graphs read and write
        self._graphs: dict[tuple, _Graph] = {}
        self._ff: dict[tuple, _FirstForward] = {}
        self._pools: dict[int, Any] = {}  # id(cond_kv) -> the memory pool of its graphs
        self.graph_mode = "global"  # GRAPH_MODES: how a capture treats other threads' CUDA calls
        self.captures = 0  # graphs captured (steps and first forwards)
        self.misses = 0  # steps and first forwards run eagerly where a graph was wanted (capture="never")
        self.warmups = 0  # eager warm-up forwards run before captures (one per captured variant)

    @property
    def n_graphs(self) -> int:
        return len(self._graphs) + len(self._ff)

    def _bind(self, cache: KVCache) -> bool:
        """Graphs for ``cache`` only: the first cache seen; another one runs eagerly."""
        if self.cache is None:
            self.cache = cache
        return self.cache is cache

    def _pool(self, cond_kv) -> Any:
        key = id(cond_kv)
        if key not in self._pools:
            self._pools[key] = torch.cuda.graph_pool_handle()
        return self._pools[key]

    def _capturing(self, graph, pool):
        """The capture context: "global" is ``torch.cuda.graph`` (it synchronizes the device and empties the
        allocator's cache first, and any other thread's unsafe CUDA call during the capture is an error);
        "thread_local" (a flip's build on its own thread, worker/readiness.py) captures on this thread's
        stream with no device sync, so the step loop's thread keeps launching and allocating meanwhile."""
        if self.graph_mode == "global":
            return _Flagged(torch.cuda.graph(graph, pool=pool))
        return _Flagged(_ThreadLocalCapture(graph, pool))

    # -- the first forward ---------------------------------------------------------------------

    def first_forward(self, cond: torch.Tensor, cache: KVCache) -> list:
        """Conditioning [L, d] -> cross-attention windows; the window prefilled with it (DiT.first_forward)."""
        model = self.model
        cache.begin_step(cond.shape[0])
        try:
            if not (self.use_graphs and self._bind(cache)):
                return model.prefill(cond, cache)
            key = (cond.shape[0], model.calibration_state(), tuple(cache.calibrated))
            g = self._ff.get(key)
            if g is None:
                if self.capture != "any":
                    self.misses += self.capture == "never"
                    return model.prefill(cond, cache)
                g = self._capture_first_forward(key, cond, cache)
            g.cond.copy_(cond)
            g.graph.replay()
            model.set_calibration_state(g.state_after)
            cache.calibrated = list(g.calibrated_after)
            return g.cond_kv
        finally:
            cache.end_step()

    def _capture_first_forward(self, key: tuple, cond: torch.Tensor, cache: KVCache) -> _FirstForward:
        model = self.model
        state, calibrated = key[1], list(key[2])
        static = cond.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles, autotunes, allocates
            self.warmups += 1
            model.prefill(static, cache)
        torch.cuda.current_stream().wait_stream(side)
        model.set_calibration_state(state)  # the capture must record what the warm-up did
        cache.calibrated = list(calibrated)
        graph = torch.cuda.CUDAGraph()
        cond_kv_box: list = []
        pool = self._pool(cond_kv_box)
        with self._capturing(graph, pool):
            cond_kv_box.extend(model.prefill(static, cache))
        g = _FirstForward(graph, static, cond_kv_box, model.calibration_state(), list(cache.calibrated))
        self._ff[key] = g
        self.captures += 1
        model.set_calibration_state(state)  # the replay that follows advances them again
        cache.calibrated = list(calibrated)
        return g

    def adopt_cross(self, cond_kv: list) -> list:
        """A turn's new cross windows (worker/turns.py), copied in place into the windows of this runner's
        first forward of the same length, which its step graphs read; the windows as given when there
        is none (their steps then run eagerly, or capture anew outside a warm worker)."""
        for (length, *_), g in self._ff.items():
            if length != cond_kv[0].n or len(g.cond_kv) != len(cond_kv):
                continue
            for dst, src in zip(g.cond_kv, cond_kv, strict=True):
                for name in ("k", "v", "k_scale", "v_scale"):
                    d, s = getattr(dst, name), getattr(src, name)
                    if (d is None) != (s is None) or (d is not None and d.shape != s.shape):
                        return cond_kv
                    if d is not None:
                        d.copy_(s)
            return g.cond_kv
        return cond_kv

    # -- a step ----------------------------------------------------------------------------------

    def __call__(self, noise: torch.Tensor, cache: KVCache, cond_kv,
                 probe: SaturationProbe | None = None) -> tuple[torch.Tensor, bool]:
        model = self.model
        if self.use_graphs and self._bind(cache):
            full = cache.book.n_valid == cache.shape.window and not model.calibrating
            state = model.calibration_state(step_only=True)
            key = (id(cond_kv), cache.book.window_after, probe is not None, state)
            g = self._graphs.get(key)
            if g is None and (self.capture == "any" or (self.capture == "full" and full)):
                self._capture(noise, cache, cond_kv, probe, state)
                g = self._graphs[key]
            if g is not None:
                g.noise.copy_(noise)
                g.graph.replay()
                model.set_calibration_state(g.state_after, step_only=True)
                if probe is not None:
                    probe.total = g.total  # the count itself was zeroed and summed by the replay
                return g.out.clone(), True
            self.misses += self.capture == "never"
        model.set_probe(probe)
        try:
            return model.denoise_chunk(noise, cache, cond_kv), False
        finally:
            model.set_probe(None)

    def _capture(self, noise: torch.Tensor, cache: KVCache, cond_kv, probe: SaturationProbe | None,
                 state: tuple) -> None:
        """After an eager warm-up on a side stream of each variant it captures, at this step's state and
        shapes (compiles, autotunes, allocates: nothing compiles inside a capture, ``CompileInCapture``),
        every graph this step may need that is missing: this step's, and with a probe known (this step's or the worker's), static scales calibrated and the window full, both
        the plain and the probed one (a probe in the window's fill steps, every few steps only, runs them
        eagerly). The same warm-ups at each capture point keep the forwards -- and under tensor parallel
        their all-reduces -- the same on every rank (ranks > 0 capture the plain graph only and warm it up
        as often as rank 0 warms up its two)."""
        model = self.model
        n = cache.book.window_after
        known = probe if probe is not None else self.probe
        want = [probe]
        if known is not None and model.probe_ready and n == cache.shape.window:
            want = [None, known]
        want = [p for p in want if (id(cond_kv), n, p is not None, state) not in self._graphs]
        warm = list(want)
        if model.probe_ready and n == cache.shape.window:  # as many warm-ups on every rank (their all-reduces
            warm += warm[-1:] * (2 - len(warm))  # match): a rank with no probe warms the plain variant twice
        static_noise = noise.clone()
        pool = self._pool(cond_kv)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # each variant it captures (plain, probed) runs once first, as captured
                for p in warm:
                    model.set_calibration_state(state, step_only=True)
                    model.set_probe(p)
                    self.warmups += 1
                    model.denoise_chunk(static_noise, cache, cond_kv)
            torch.cuda.current_stream().wait_stream(side)
            for p in want:
                model.set_calibration_state(state, step_only=True)  # each capture records the step as now
                model.set_probe(p)
                g = torch.cuda.CUDAGraph()
                with self._capturing(g, pool):
                    if p is not None:
                        p.start()  # the count's zeroing is part of the graph
                    out = model.denoise_chunk(static_noise, cache, cond_kv)
                after = model.calibration_state(step_only=True)
                self._graphs[(id(cond_kv), n, p is not None, state)] = _Graph(
                    g, static_noise, out, p, p.total if p is not None else 0, after, cond_kv)
                self.captures += 1
        finally:
            model.set_probe(None)
            model.set_calibration_state(state, step_only=True)
