"""Flip targets made ready off the critical path: a switch flip never compiles or captures in the step loop.

    w = Worker("prod57b"); w.warm(sw, neighbours=RUNTIME_SWITCHES)   # + each one-switch neighbour's compiles
    # mid-session, a flip polled at step i: Readiness builds the target on a thread (a model view, its own
    # cache, runner and graphs, on a side stream) while the session steps its current configuration: first
    # the least a swap needs (build_quick), then the complete warm state (build_warm); the session swaps at
    # the first step boundary after the quick one is ready (carry_cache, carry_scales); the worker keeps the
    # target (later sessions swap the complete one in): nothing blocks between sessions.

What is held for readiness: at warm time every runtime switch's one-flip neighbour of the warm set runs
one short synthetic session (no graphs) on a model view, so inductor's and Triton's caches hold every
kernel a neighbour needs; its cache and activations are then freed (the GPU memory held afterwards is
the compile caches' code only). A flip builds the complete warm state of its target (every bucket's first
forward and step graphs, ``build_warm``): during the build the worker holds a second cache and its graph
pools, freed when the old state is dropped (the session's end). The graph pools are not shared across
configurations: the old one replays while the new one captures, and a pool's blocks may be reused only by
graphs that replay in capture order.

``flip="inline"`` (and tensor parallel, whose ranks must swap at one step: rank 0's builder would need a
broadcast of readiness) keeps the plain path: the flip rebuilds in the loop and the worker re-warms,
blocking, after the session. Each flip's cost is a ``flip_cost`` event (``FlipCost``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from collector.flip_fields import FLIP_MODES
from collector.switch_names import PLAYOUT_SWITCHES, SWITCH_NAMES
from worker.cache import KVCache, make_cache
from worker.config import SwitchError, Switches
from worker.decoder import DecodeJob
from worker.flips import carry_cache
from worker.fp8 import SaturationProbe
from worker.graphs import ChunkRunner
from worker.model import DiT, NullTimer
from worker.streams import own_stream

log = logging.getLogger("livestep.worker.readiness")

# the switches the control plane flips at runtime (the fault switch and the playout policies change no step's
# kernels: a policy applies at once, see Session._apply)
RUNTIME_SWITCHES: tuple[str, ...] = tuple(n for n in SWITCH_NAMES
                                          if n not in PLAYOUT_SWITCHES and n != "buffer_per_shape")
PACE_WAIT_S = 1.0  # a build waits at most this long for the live session's slack before each of its steps
BUILD_SWITCH_INTERVAL_S = 0.0005  # the GIL hand-over while a build runs (Python's default 5 ms would
# let a compiling thread hold the step loop off for that long at each hand-over)


@dataclass
class WarmState:
    """A warm worker's session state for one set of switches: a cache and graphs every session reuses,
    on the model (or model view) and saturation probe they were captured with."""

    switches: Switches
    cache: KVCache
    runner: ChunkRunner
    buckets: tuple[int, ...]
    model: DiT
    probe: SaturationProbe | None
    seconds: float = 0.0
    complete: bool = True  # every bucket's graphs (False: ``build_quick``'s, the least a live swap needs)


def model_view(model: DiT) -> DiT:
    """A DiT sharing ``model``'s weights with switch state of its own (activation quantizers, static scale
    sites, fused chains, probe, timer): a build configures and runs it while the session runs ``model``.
    Static scales start uncalibrated (fresh sites on the view's ``set_compile``)."""
    v = copy.copy(model)
    v.blocks = []
    for b in model.blocks:
        nb = copy.copy(b)
        for name in ("qkv", "cq", "ckv", "up", "o", "co", "down"):
            lin = copy.copy(getattr(b, name))
            lin.site, lin.probe = None, None
            setattr(nb, name, lin)
        nb.timer, nb.fusion = NullTimer(), None
        v.blocks.append(nb)
    v.timer = NullTimer()
    return v


class _NoDecoder:
    """A build's synthetic sessions decode nothing: the worker's decoders are warm and serve the live one."""

    placement = "none"

    def __init__(self, device):
        self.device = device

    def submit(self, latents: torch.Tensor, step: int, after=None) -> DecodeJob:
        return DecodeJob(step)


def _as_build_worker(worker, model: DiT, probe: SaturationProbe | None, warm: WarmState):
    """The worker as a build's synthetic sessions see it: the view, the target's warm state, no decoder."""
    bw = copy.copy(worker)
    bw.model, bw.probe, bw.warmed, bw.observers = model, probe, warm, []
    nodec = _NoDecoder(worker.device)
    bw.decoder = lambda own_gpu: nodec
    bw.building = True  # Session._settle: a build's own sessions settle nothing
    return bw


class BuildSuperseded(Exception):
    """A newer flip wants another target: the running build stops at its next synthetic step."""


def build_warm(worker, sw: Switches, buckets: tuple[int, ...], *, model: DiT, probe: SaturationProbe | None,
               run=None, reset_run: bool = True, first: int | None = None, graph_mode: str = "global",
               graphs: bool | None = None, pace=None, superseded=None, saturation_every: int | None = None) -> WarmState:
    """Capture every graph sessions with ``sw`` need (``Worker.warm``'s work): one synthetic session per
    conditioning bucket (``first`` first), not real time, no telemetry; with ``reset_run`` the first runs
    through a position reset (its ops compile on first use: 980 ms for the first Triton delta rotation on
    the H200), else a reset at its second step. ``run(**session kwargs)`` runs one (default: a Session on
    the worker as a build sees it); ``graphs`` False: no graphs (neighbour preparation); ``pace(step)`` is
    asked before each synthetic step (it may wait: ``Readiness.pace``); ``superseded()`` true stops the build
    at the next step (``BuildSuperseded``); ``saturation_every`` (neighbour preparation: 2) probes that often,
    one step more, so the full window's plain and probed steps both run (and compile) as a build captures them."""
    from worker.session import Session  # session.py imports this module

    t0 = time.perf_counter()
    cache = make_cache(worker.shape, sw, worker.device, model.dtype)
    runner = ChunkRunner(model, sw.cuda_graphs if graphs is None else graphs, probe=probe, capture="any")
    runner.graph_mode = graph_mode
    warm = WarmState(sw, cache, runner, buckets, model, probe)
    if run is not None:  # the worker's own sessions: they find its warm state
        worker.warmed, worker.previous = warm, None
    else:
        bw = _as_build_worker(worker, model, probe, warm)

        def run(**kw):
            return Session(bw, **kw).run()
    order = sorted(buckets, key=lambda b: b != first)  # stable: the session's bucket first
    W, T, shape = worker.shape.window, worker.shape.new_tokens, worker.shape
    for i, b in enumerate(order):
        steps = math.ceil((W - b) / T) + 2  # the fill steps, then the full window once captured, once replayed
        reset_every = None
        if i == 0:
            if reset_run:
                steps = max(steps, shape.reset_every + 1)
            else:
                reset_every = 2
        if saturation_every is not None:
            steps += 1
        run(steps=steps, switches=sw, cond_tokens=b, realtime=False, telemetry=False, seed=b,
            session_id=f"warm-{b}", reset_every=reset_every, **({"switch_source": pace} if pace else {}),
            **({"stop_when": superseded} if superseded else {}),
            **({"saturation_every": saturation_every} if saturation_every else {}))
        if superseded is not None and superseded():
            raise BuildSuperseded(f"[{sw.encode()}] superseded by a newer flip")
    if run is None:  # a flip's swap loads the live window into this cache: its write path compiled now, here
        carry_cache(cache, cache)
    runner.capture = "never"
    warm.seconds = time.perf_counter() - t0
    return warm


def build_quick(worker, sw: Switches, bucket: int, *, model: DiT, probe: SaturationProbe | None,
                graph_mode: str = "thread_local", pace=None, superseded=None) -> WarmState:
    """The least a live session's swap needs: ``bucket``'s first forward and the full window's step (calibrating,
    then plain and probed) captured on a cache of its own, its window filled with stand-in tokens first (a live
    window is full by the time a flip arrives, and graphs key on the window size). No fill-step graphs and no
    other bucket: ``complete`` False; the full state follows (``build_warm``)."""
    from worker.session import DYNAMIC_SCALES  # session.py imports this module

    t0 = time.perf_counter()
    shape, dev = worker.shape, worker.device
    cache = make_cache(shape, sw, dev, model.dtype)
    runner = ChunkRunner(model, sw.cuda_graphs, probe=probe, capture="any")
    runner.graph_mode = graph_mode
    model.act_scales = "static" if sw.static_scales else DYNAMIC_SCALES
    model.set_compile(sw.compile, triton=sw.triton_kernels)
    model.reset_act_scales()
    if probe is not None:
        probe.compiled = sw.compile
    gen = torch.Generator(device=dev).manual_seed(bucket)
    worker.register_forward(bucket, sw)
    cond_kv = runner.first_forward(torch.randn(bucket, shape.d_model, generator=gen, device=dev), cache)

    def stand_in(b: int) -> tuple[torch.Tensor, torch.Tensor]:  # a block at a time (bench/carry_memory.py)
        size = (shape.heads, shape.window, shape.head_dim)
        k = torch.randn(size, generator=gen, device=dev, dtype=model.dtype)
        return k, torch.randn(size, generator=gen, device=dev, dtype=model.dtype)

    cache.load_blocks(stand_in, shape.window, cache.book.next_pos + shape.window)  # also compiles the swap's write
    T, C = shape.new_tokens, shape.latent_channels
    for i in range(3):  # calibrating (static scales), then calibrated plain + probed, then one replay
        if pace is not None:
            pace(i)
        if superseded is not None and superseded():
            raise BuildSuperseded(f"[{sw.encode()}] superseded by a newer flip")
        cache.begin_step(T)
        worker.register_forward(T, sw)
        runner(torch.randn(T, C, generator=gen, device=dev), cache, cond_kv)
        cache.end_step()
    runner.capture = "never"
    return WarmState(sw, cache, runner, (bucket,), model, probe, time.perf_counter() - t0, complete=False)


@contextlib.contextmanager
def _build_context(device: torch.device, stream):
    """A build's thread: the worker's build stream (its own, never a pool stream that another owner may be
    handed: worker/streams.py; the step loop's stream never waits on it) and a short GIL switch interval."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, BUILD_SWITCH_INTERVAL_S))
    try:
        if device.type == "cuda":
            with torch.cuda.device(device), torch.cuda.stream(stream):
                yield
        else:
            yield
    finally:
        sys.setswitchinterval(old)


def _compile_beside_the_loop() -> None:
    """Make a build thread's compiles (its warm-ups', outside any capture) safe beside the step loop's calls.

    - Dynamo's "FX is tracing" flag is process-wide: while the build thread traces, a compiled function the
      step loop calls would raise ("Detected that you are using FX to symbolically trace a dynamo-optimized
      function"; the H200 bench of 2 Dec 08:24 lost its live session so). With ``error_on_nested_fx_trace``
      off that call runs its plain Python body (same result) instead; the worker traces nothing with FX.
    - Inductor's compile-worker pool is cached once per process (``AsyncCompile.process_pool``): once its
      sidecar has exited (``SubprocPool.running`` false) every later compile raises "Attempting to use a
      closed pool". A closed one is dropped (``shutdown_compile_workers`` clears the cache) so the next
      compile starts a fresh pool."""
    torch._dynamo.config.error_on_nested_fx_trace = False
    try:
        from torch._inductor import async_compile
    except ImportError:  # a torch without inductor: nothing compiles in a pool
        return
    pools = getattr(async_compile, "_pool_set", ())
    if any(getattr(p, "running", True) is False for p in pools):
        log.warning("inductor's compile pool was closed: dropped, the next compile starts a new one")
        async_compile.shutdown_compile_workers()


def neighbour(base: Switches, name: str) -> Switches:
    """``base`` with ``name`` flipped; where that alone is invalid (``ring_cache`` off under delta_rotation,
    ``rope_at_write`` off under ring_cache), with the fewest other runtime switches turned off with it that
    make it valid (Switches' own validation decides). Raises SwitchError when none does."""
    flip = {name: not getattr(base, name)}
    try:
        return base.with_(**flip)
    except SwitchError as e:
        first = e
    others = [n for n in RUNTIME_SWITCHES if n != name and getattr(base, n)]
    for k in (1, 2, 3):
        for extra in itertools.combinations(others, k):
            try:
                return base.with_(**flip, **dict.fromkeys(extra, False))
            except SwitchError:
                continue
    raise first


def _key(sw: Switches) -> str:
    return sw.model_switches().encode()


@dataclass
class _Build:
    switches: Switches
    first: int | None
    t_request: float
    thread: threading.Thread | None = None
    quick: WarmState | None = None  # build_quick's, for a live swap (taken once)
    quick_taken: bool = False
    superseded: bool = False  # a newer request wants other switches: stop at the next step
    warm: WarmState | None = None  # the complete one
    error: str | None = None
    t_ready: float | None = None


class Readiness:
    """A worker's flip targets: neighbours prepared at warm time, one background build at a time.

    ``request(sw)`` starts building ``sw``'s warm state (nothing when it is being built or ready); a newer
    request for other switches replaces the wanted one and starts once the running build ends (a thread
    cannot be stopped mid-capture). ``ready(sw)`` is the finished warm state or None. ``delay_s`` holds each
    build back that long first (tests: a deliberately slow build)."""

    def __init__(self, worker, mode: str = "background", delay_s: float = 0.0):
        if mode not in FLIP_MODES:
            raise ValueError(f"flip mode {mode!r}; valid: {', '.join(FLIP_MODES)}")
        self.w, self.mode, self.delay_s = worker, mode, delay_s
        self.prepared: dict[str, float] = {}  # neighbour switches (encoded) -> seconds its preparation took
        self.skipped: dict[str, str] = {}  # neighbour -> why it was not prepared (an invalid combination)
        self._lock = threading.Lock()
        self._build: _Build | None = None  # running or finished
        self._wanted: _Build | None = None  # waiting for the running build to end
        self.builds: list[dict[str, Any]] = []  # per finished build: switches, seconds, error
        # set while the live session has slack (its playout buffer nearly full, or nothing to keep up with):
        # a build launches its next step only then (the GPU is shared), or after PACE_WAIT_S
        self.gate = threading.Event()
        self.gate.set()
        self._stream: torch.cuda.Stream | None = None

    def stream(self) -> torch.cuda.Stream | None:
        """The stream every build of this worker captures on: made once, for builds alone."""
        if self._stream is None and self.w.device.type == "cuda":
            self._stream = own_stream(self.w.device)
        return self._stream

    def pace(self, step: int) -> None:
        """A build's synthetic step may start: the live session has slack (``Flips.boundary`` sets the gate)."""
        self.gate.wait(PACE_WAIT_S)

    def _superseded(self) -> bool:
        b = self._build
        return b is not None and b.superseded

    # -- at warm time ----------------------------------------------------------------------------

    def prepare_neighbours(self, base: Switches, names=RUNTIME_SWITCHES, buckets: tuple[int, ...] | None = None) -> None:
        """Each one-switch neighbour of ``base`` runs once on a model view (no graphs; by default at the
        longest bucket only, through a position reset and into the full window): its compiles and autotuning
        are done before any flip needs them, and its decoder placement exists and has decoded once. Nothing
        of it stays on the GPU but the decoder (the one a flip of ``decoder_own_gpu`` swaps to)."""
        buckets = tuple(buckets or self.w.cond_buckets[-1:])
        for name in names:
            try:
                sw = neighbour(base, name)
            except SwitchError as e:
                self.skipped[name] = str(e).split(";")[0]
                continue
            t0 = time.perf_counter()
            view = model_view(self.w.model)
            build_warm(self.w, sw, buckets, model=view, probe=SaturationProbe(self.w.device), reset_run=False,
                       graphs=False, saturation_every=2)
            shape = self.w.shape
            self.w.decoder(sw.decoder_own_gpu).submit(
                torch.zeros(shape.new_tokens, shape.latent_channels, device=self.w.device), 0)
            self.prepared[_key(sw)] = time.perf_counter() - t0
            log.info("neighbour %s=%s prepared in %.1f s", name, getattr(sw, name), self.prepared[_key(sw)])
        if self.w.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the neighbours' caches and activations: not held

    # -- a build -----------------------------------------------------------------------------------

    def request(self, sw: Switches, first: int | None = None) -> None:
        key = _key(sw)
        with self._lock:
            b = self._build
            if b is not None and _key(b.switches) == key:
                return  # building it, or built
            if b is not None and b.warm is None and b.error is None:  # another one is running: it stops at its
                self._wanted = _Build(sw, first, time.perf_counter())  # next step, then this one starts
                b.superseded = True
                return
            self._start(_Build(sw, first, time.perf_counter()))

    def _start(self, b: _Build) -> None:
        _compile_beside_the_loop()
        self._build, self._wanted = b, None
        b.thread = threading.Thread(target=self._run, args=(b,), name="livestep-flip-build", daemon=True)
        b.thread.start()

    def _run(self, b: _Build) -> None:
        w = self.w
        try:
            with _build_context(w.device, self.stream()):
                if self.delay_s:
                    time.sleep(self.delay_s)
                cuda = w.device.type == "cuda"
                if b.first is not None:  # a live session waits for it: the least its swap needs, first
                    quick = build_quick(w, b.switches, b.first, model=model_view(w.model),
                                        probe=SaturationProbe(w.device), pace=self.pace, superseded=self._superseded)
                    if cuda:
                        torch.cuda.current_stream().synchronize()  # this thread's stream only: ready to replay
                    b.quick = quick
                view = model_view(w.model)  # the quick state's view may be the live model by now: one of its own
                probe = SaturationProbe(w.device)
                warm = build_warm(w, b.switches, w.cond_buckets, model=view, probe=probe, first=b.first,
                                  reset_run=_key(b.switches) not in self.prepared, graph_mode="thread_local",
                                  pace=self.pace, superseded=self._superseded)
                if cuda:
                    torch.cuda.current_stream().synchronize()
            b.warm = warm
        except BuildSuperseded as e:
            log.info("%s", e)
            b.error = str(e)
        except Exception as e:  # a failed build leaves the session on what it runs
            log.exception("flip build for [%s] failed", b.switches.encode())
            b.error = f"{type(e).__name__}: {e}"[:300]
        b.t_ready = time.perf_counter()
        self.builds.append({"switches": b.switches.encode(), "seconds": b.t_ready - b.t_request, "error": b.error})
        with self._lock:
            if self._wanted is not None:
                self._start(self._wanted)

    def ready(self, sw: Switches) -> WarmState | None:
        with self._lock:
            b = self._build
            return b.warm if b is not None and b.warm is not None and _key(b.switches) == _key(sw) else None

    def failed(self, sw: Switches) -> str | None:
        """Why the build for ``sw`` failed before anything could be swapped in (None: it did not)."""
        with self._lock:
            b = self._build
            return b.error if b is not None and _key(b.switches) == _key(sw) and not b.quick_taken else None

    def building(self) -> bool:
        with self._lock:
            return self._wanted is not None or (self._build is not None and self._build.t_ready is None)

    def take(self, sw: Switches, complete: bool = False) -> WarmState | None:
        """A ready warm state for ``sw``, handed over (the worker now owns it): the complete one when built,
        else (``complete`` False) the quick one, once."""
        with self._lock:
            b = self._build
            if b is None or _key(b.switches) != _key(sw):
                return None
            if b.warm is not None:
                self._build = None
                return b.warm
            if not complete and b.quick is not None and not b.quick_taken:
                b.quick_taken = True
                return b.quick
            return None

    def wait(self, timeout_s: float = 600.0) -> bool:
        """Until no build runs (benches and tests between phases); False on timeout."""
        t_end = time.perf_counter() + timeout_s
        while self.building():
            if time.perf_counter() > t_end:
                return False
            time.sleep(0.01)
        return True
