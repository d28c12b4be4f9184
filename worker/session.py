"""A streaming session: first forward over the conditioning, then steady steps on a playout clock.

    summary = run_session(shape="tiny", seconds=5, collector_url="http://127.0.0.1:8000", token=T,
                          switches=["ring_cache=on", "rope_at_write=on"], switch_source=URL_or_file)
    worker = Worker("tiny"); worker.warm(switches)          # once per worker: compile, every CUDA graph
    worker.run_session(steps=50, switches=switches); worker.run_session(...)   # sessions only replay

Each step denoises one chunk (``shape.passes`` passes over all blocks), hands the latents to the
decoder (which overlaps the next step when it has its own GPU or stream), and leaves its timing
events to ``Telemetry``, which reads them back once done. The player takes one chunk per 166.7 ms
from a buffer of a few chunks; the producer waits while the buffer is full (real time), and a chunk
that arrives after its due time is a stall, counted. Switches are polled between steps from the
source (HTTP control plane, file or callable) and applied at the next step boundary without ending
the session (the cache is rebuilt holding the same window), each change reported as a
``switch_applied`` event. With ``cuda_graphs`` on CUDA a warm worker (``Worker.warm``) replays graphs
captured once for the worker (worker/graphs.py) on its own cache; an unwarmed session captures the
step once its window is full (the cache's advance/reset stays eager outside the graph either way).
What a session made is freed by reference counting when it ends (tests/worker/test_lifetime.py).
A flip of the step's work on a warm worker is built in the background and swapped in at a step boundary
(worker/readiness.py, worker/flips.py); the Worker that runs sessions is worker/process.py. This module is
over 450 lines because the step loop and what it does between steps (switches, turns, the playout wait, the
end records) share the session's state; each of those that grew a life of its own lives in its own module.

With ``static_scales`` (FP8 activations quantized with per-tensor scales calibrated on the session's
first forward and chunk; off: per-token dynamic scales), one step in ``saturation_every`` (64 on CUDA,
8 on CPU) runs with a ``SaturationProbe`` (under ``cuda_graphs`` a second graph, the step's plus the
counting) and its record carries ``fp8_saturated``: the share
of the step's FP8 GEMM-input elements at +-448 (clipped, or rounded up from |x / scale| >= 432), the sign
that inputs outgrew their calibration.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from collector import catalog
from collector.flip_fields import FLIP_COST_KIND
from collector.switch_names import PLAYOUT_SWITCHES, SWITCH_NAMES
from worker.cache import CACHE_SWITCHES, KVCache, make_cache, rebuild_cache
from worker.config import (
    PREROLL,
    ModelShape,
    ShapeError,
    SwitchError,
    Switches,
)
from worker.decoder import Decoder
from worker.flips import FlipCost, Flips, carry_cache, carry_scales
from worker.fp8 import SaturationProbe
from worker.graphs import ChunkRunner
from worker.process import Worker, _as_switches, cond_buckets_of  # noqa: F401 - re-exported: Worker runs Sessions
from worker.readiness import WarmState
from worker.switches import SwitchSource, make_source
from worker.telemetry import ListSink, Playout, Telemetry, rss_bytes, weak_method
from worker.turns import TurnInbox, TurnPlayer, Turns, check_policy

log = logging.getLogger("livestep.worker.session")

CHUNK_PERIOD_S = catalog.CHUNK_DEADLINE_MS / 1000  # 166.7 ms: four frames at 24 fps (collector/catalog.py)
DYNAMIC_SCALES = "row"  # DiT.act_scales with static_scales off: per-token scales, the plain path
SATURATION_EVERY = {"cuda": 64, "cpu": 8}  # a saturation probe every N steps (Session's default)


@dataclass
class SessionSummary:
    session_id: str
    shape: str
    steps: int
    frames: int
    streamed_s: float
    avg_fps: float | None
    late_chunks: int
    stall_ms: float
    first_forward_tokens: int
    switches: str
    switch_events: list[dict[str, Any]] = field(default_factory=list)
    resets: int = 0
    wraps: int = 0
    buffers_registered: int = 0
    records: dict[str, int] = field(default_factory=dict)
    telemetry_sent: int = 0
    telemetry_filed: int = 0  # written to the client's telemetry file, for `livestep replay` (not lost)
    telemetry_dropped: int = 0
    telemetry_failed_batches: int = 0
    wall_s: float = 0.0
    loop_s: float = 0.0  # the step loop alone (first forward excluded), until the last record
    mean_diffusion_ms: float | None = None
    mean_upkeep_ms: float | None = None
    mean_attention_ms: float | None = None
    mean_decode_ms: float | None = None
    power_error: str | None = None
    graphed_steps: int = 0  # steps that replayed a captured CUDA graph
    probed_steps: int = 0  # steps whose FP8 saturation was counted (static_scales on)
    max_fp8_saturated: float | None = None  # the largest share of FP8 GEMM inputs at +-448
    turns: int = 0  # conversational turns applied (worker/turns.py)
    dropped_chunks: int = 0  # chunks made and never played: the turns' playout policy dropped them
    cond_tokens: int = 0  # the prompt's conditioning length (first_forward_tokens: after bucketing)
    ttff_ms: float | None = None  # session start -> the player's first frame (None: never started)
    preroll: int = 0  # chunks buffered before playback started
    warm: bool = False  # ran on the worker's warm cache and graphs (Worker.warm)
    graph_captures: int = 0  # CUDA graphs captured during this session (0 on a warm worker)
    graph_misses: int = 0  # steps a warm worker ran eagerly for want of a graph
    flips: list[dict[str, Any]] = field(default_factory=list)  # each flip's cost (the flip_cost events)
    out_of_service_s: float = 0.0  # the worker blocked after the session for its switches (a re-warm)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


class Session:
    def __init__(self, worker: Worker, seconds: float | None = None, steps: int | None = None,
                 collector_url: str | None = None, token: str | None = None, switches=None,
                 switch_source=None, session_id: str | None = None, cond_tokens: int | None = None,
                 realtime: bool = True, sink=None, seed: int | None = None, telemetry: bool = True,
                 chunk_period_s: float = CHUNK_PERIOD_S, playout_capacity: int = 4, max_in_flight: int = 3,
                 client_kwargs: dict | None = None, sync_debug: bool | str = False, detail_every: int | None = None,
                 saturation_every: int | None = None, turns: TurnInbox | None = None,
                 playout_policy: str | None = None, preroll: int = PREROLL, power_source=None,
                 stop_when=None, reset_every: int | None = None):
        self.w = worker
        self.reset_every = reset_every or worker.shape.reset_every  # a position reset every N steps
        # any host sync in the loop raises (True / "error") or warns ("warn": the bench counts them)
        self.sync_mode = "error" if sync_debug is True else (sync_debug or None)
        if self.sync_mode not in (None, "warn", "error"):
            raise ValueError(f"sync_debug {sync_debug!r}; valid: False, True, 'warn', 'error'")
        self.sync_debug = bool(self.sync_mode) and worker.device.type == "cuda"
        shape = worker.shape
        if steps is None:
            steps = max(1, round((seconds if seconds is not None else 10.0) / chunk_period_s))
        self.n_steps = steps
        self.switches = _as_switches(switches)
        if playout_policy is not None:  # the argument overrides the switches' turn_* (worker/turns.py)
            self.switches = self.switches.with_policy(check_policy(playout_policy))
        self.start_switches = self.switches
        self.session_id = session_id or uuid.uuid4().hex[:16]
        rng = random.Random(seed if seed is not None else self.session_id)
        lo, hi = shape.cond_tokens
        self.cond_tokens = cond_tokens if cond_tokens is not None else rng.randint(lo, hi)
        if not 1 <= self.cond_tokens <= shape.window - shape.new_tokens:
            raise ShapeError(f"cond_tokens {self.cond_tokens} out of range; valid: 1..{shape.window - shape.new_tokens}")
        self.seed = rng.randrange(2**31)
        self.realtime = realtime
        # () -> bool, asked at each step boundary: end the session there (a bench; one process: under tensor
        # parallel every rank must run the same steps)
        self.stop_when = stop_when
        self.max_in_flight = max_in_flight
        self.labels = {"worker_id": worker.worker_id, "session_id": self.session_id,
                       "release": worker.release, "gpu_kind": worker.gpu_kind}
        self._own_sink = sink is None
        if sink is None and (collector_url or (client_kwargs or {}).get("telemetry_file")):
            from collector.client import TelemetryClient  # lazily: only with a collector

            sink = TelemetryClient(collector_url, token=token, **(client_kwargs or {}))
        self.sink = sink if sink is not None else ListSink()
        self.source: SwitchSource = make_source(switch_source, worker.worker_id, worker.release,
                                                worker.gpu_kind, token)
        if not 1 <= preroll <= playout_capacity:
            raise ValueError(f"preroll {preroll!r}; valid: 1..{playout_capacity} chunks (the playout buffer)")
        self.playout_policy = self.switches.playout_policy  # what a turn does to old chunks (worker/turns.py)
        self.playout = (TurnPlayer if turns is not None else Playout)(chunk_period_s, capacity=playout_capacity,
                                                                      prebuffer=preroll)
        gpus = sorted({i for i in (worker.device.index or 0, torch.cuda.device_count() - 1)
                       if worker.device.type == "cuda"})
        self.tel = Telemetry(self.sink, self.labels, worker.device, self.playout, gpus, enabled=telemetry,
                             detail_every=detail_every, power_source=power_source)
        self.tel.cpu_mem = weak_method(self._cpu_mem, (0, 0))  # no cycle session <-> telemetry
        self.saturation_every = (SATURATION_EVERY.get(worker.device.type, 8) if saturation_every is None
                                 else saturation_every)
        if self.saturation_every < 1:
            raise ValueError(f"saturation_every {saturation_every!r}; valid: a positive number of steps")
        self.probe = worker.probe if telemetry else None
        self.turns = (Turns(turns, self.playout_policy, self.playout, self.tel, worker.model, self.seed + 1,
                            cross=weak_method(self._turn_cross)) if turns is not None else None)
        self.switch_events: list[dict[str, Any]] = []
        self.loop_s = 0.0
        self.cache: KVCache | None = None
        self.decoder: Decoder | None = None
        self.runner: ChunkRunner | None = None
        self._runner_marks: list[tuple[ChunkRunner, int, int]] = []  # (runner, captures, misses) at first use
        # flips built off the critical path (worker/readiness.py): a warm worker on one rank
        self.background = (worker.readiness.mode == "background" and worker.warmed is not None
                           and getattr(worker, "tp", None) is None)
        self.flips = Flips()
        self.warm_state: WarmState | None = None  # the warm state whose cache and graphs this session runs
        self.cond: torch.Tensor | None = None  # the conditioning in force (unpadded): a swap recomputes its cross K/V
        self.out_of_service_s = 0.0

    def _cpu_mem(self) -> tuple[int, int]:
        held = self.w.model.nbytes + (self.cache.nbytes if self.cache else 0) + self.w.registry.nbytes
        return held, rss_bytes()

    # -- switches -------------------------------------------------------------------------------

    def _apply(self, new: Switches, step: int) -> None:
        """A validated change at this step boundary: a playout policy at once; a change of the step's work
        built in the background on a warm worker (swapped in later, ``Flips.boundary``), else in the loop."""
        old = self.switches
        changed = old.changes_to(new)
        wanted = self.flips.wanted
        if (wanted is not None and wanted.model_switches() != old.model_switches()
                and new.model_switches() == old.model_switches()):
            self.flips.drop()  # flipped back before the target was ready
        if not changed:
            return
        if self.background and changed.keys() - PLAYOUT_SWITCHES.keys():
            self.flips.want(self, new, step, changed)
            return
        if changed.keys() - PLAYOUT_SWITCHES.keys():
            pl = self.playout
            cost = FlipCost(changed, new.encode(), "inline", step, time.perf_counter(), pl.late_chunks, pl.stall_s)
            self._apply_inline(new, step, cost)
            self.flips.add_inline(cost)
        else:
            self._apply_inline(new, step)

    def _apply_inline(self, new: Switches, step: int, cost: FlipCost | None = None) -> None:
        """The plain path: the cache rebuilt, the model reconfigured and a new runner, in the loop."""
        old = self.switches
        changed = old.changes_to(new)
        t0 = time.perf_counter()
        if any(k in CACHE_SWITCHES for k in changed):
            self.cache = rebuild_cache(self.cache, new)
        if "static_scales" in changed:  # the new quantizers (static: fresh sites, calibrating afresh)
            self._set_act_scales(new)
        if changed.keys() & {"static_scales", "compile", "triton_kernels"}:
            self.w.model.set_compile(new.compile, triton=new.triton_kernels)
        if "decoder_own_gpu" in changed:
            self.decoder = self.w.decoder(new.decoder_own_gpu)
            self.tel.sync_clock(self.decoder.device)
        self.switches = new
        self.playout_policy = new.playout_policy
        if self.turns is not None:
            self.turns.policy = new.playout_policy
        if changed.keys() - PLAYOUT_SWITCHES.keys():  # a policy alone changes no step's work: same runner
            self.runner = self._runner()
            self.warm_state = None
        if cost is not None:
            cost.applied_step, cost.t_applied = step, time.perf_counter()
            cost.apply_ms = (cost.t_applied - t0) * 1e3
        self._applied(step, changed, new, cost)

    def _applied(self, step: int, changed: dict, new: Switches, cost: FlipCost | None) -> None:
        if not changed:
            return  # a session-start build swapped in: no switch changed
        ev = {"step": step, "changed": changed, "switches": new.encode()}
        if cost is not None and cost.polled_step != step:
            ev["polled_step"] = cost.polled_step
        self.switch_events.append(ev)
        self.tel.event("switch_applied", **ev)

    def _swap(self, warm: WarmState, new: Switches, step: int, cost: FlipCost) -> list:
        """A built target in at this step boundary: the window carried into its cache, the static scales into
        its model view, the conditioning's cross K/V into the windows its graphs read. Returns that cross K/V."""
        old_model, view = self.w.model, warm.model
        changed = self.switches.changes_to(new)
        carry_cache(self.cache, warm.cache)
        carry_scales(old_model, view, self.w.shape.passes)
        old_model.set_timer(_null_timer())
        old_model.set_probe(None)
        view.set_timer(self.tel.timer)
        self.w.model, self.cache, self.runner, self.warm_state = view, warm.cache, warm.runner, warm
        self._runner_marks.append((warm.runner, warm.runner.captures, warm.runner.misses))
        if self.probe is not None and warm.probe is not None:
            self.probe = self.w.probe = warm.probe
            self.probe.compiled = new.compile
        if "decoder_own_gpu" in changed:
            self.decoder = self.w.decoder(new.decoder_own_gpu)
            self.tel.sync_clock(self.decoder.device)
        self.switches = new
        self.playout_policy = new.playout_policy
        if self.turns is not None:
            self.turns.policy, self.turns.model = new.playout_policy, view
        cond_kv = self._cross_now(None)
        self._applied(step, changed, new, cost)
        return cond_kv

    def _cross_now(self, cond_kv):
        """The conditioning's cross K/V on the current model and cache (after a swap or an inline rebuild
        whose cross windows no longer fit); on a warm runner, in the windows of its bucket's graphs."""
        if self.cond is None:
            return cond_kv
        return self._turn_cross(self.cond, self.cache)

    def _serve_warm_meanwhile(self) -> Switches | None:
        """A session whose switches have no complete warm state yet (a flip's target still building, or only
        its quick state, which holds one prompt bucket's graphs) starts on the worker's last complete warm state
        instead of running eagerly (on the H200 an eager prod57b step is late: 22-31 late chunks per session
        after a flip, 2026-12-02), and its switches swap in at a step boundary once built. Returns the
        wanted switches (this session now runs the complete state's), or None when it starts on its own."""
        w = self.w
        if not self.background:
            return None
        own = w.warm_for(self.switches)
        if own is not None and (own.complete or w.bucket(self.cond_tokens) in own.buckets):
            return None
        fallback = next((c for c in ((w.warmed if own is None else None), w.previous)
                         if c is not None and c.complete), None)
        if fallback is None:
            return None
        wanted = self.switches
        if fallback is not w.warmed:
            w.adopt(fallback)  # the quick state is dropped: the complete one follows from its build
        self.switches = fallback.switches.with_policy(wanted.playout_policy)
        self.playout_policy = self.switches.playout_policy
        return wanted

    def _set_act_scales(self, sw: Switches) -> None:
        self.w.model.act_scales = "static" if sw.static_scales else DYNAMIC_SCALES

    def _probe_step(self, i: int) -> SaturationProbe | None:
        """This step's saturation probe: on every ``saturation_every``-th step once static scales are
        calibrated (None on the others)."""
        if self.probe is None or i % self.saturation_every or not self.w.model.probe_ready:
            return None
        self.probe.start()
        return self.probe

    def _turn_cross(self, cond: torch.Tensor, cache: KVCache) -> list:
        """A turn's cross K/V: on the worker's warm graphs, the conditioning padded to its bucket and the
        windows copied into the ones that bucket's graphs read; else as computed."""
        model = self.w.model
        self.cond = cond
        if self.warm_state is None or self.runner is not self.warm_state.runner:
            return model.cross_kv(cond, cache)
        pad = self.w.bucket(cond.shape[0]) - cond.shape[0]
        if pad > 0:
            cond = torch.cat([cond, cond.new_zeros(pad, cond.shape[1])])
        return self.runner.adopt_cross(model.cross_kv(cond, cache))

    def _runner(self) -> ChunkRunner:
        """The worker's warm runner on its warm cache, else one of this session's own for the current
        switches (captures once the window is full); the probe counts with compiled kernels under compile."""
        if self.probe is not None:
            self.probe.compiled = self.switches.compile
        warm = self.w.warm_for(self.switches)
        if warm is not None and self.cache is warm.cache:
            runner = warm.runner
            self.warm_state = warm
        else:  # with a background build coming (a warm worker), eager until it is swapped in: no capture here
            runner = ChunkRunner(self.w.model, self.switches.cuda_graphs, probe=self.probe,
                                 capture="never" if self.background else "full")
        self._runner_marks.append((runner, runner.captures, runner.misses))  # its counts before this session
        return runner

    def _graph_counts(self) -> tuple[int, int]:
        """Graphs captured and steps run eagerly for want of one, by this session, on every runner it used
        (a warm worker's runner counts over the worker's life)."""
        marks = {id(r): (r, c, m) for r, c, m in reversed(self._runner_marks)}  # each runner's first mark
        return (sum(r.captures - c for r, c, _ in marks.values()),
                sum(r.misses - m for r, _, m in marks.values()))

    def _poll_switches(self, step: int) -> None:
        try:
            m = self.source.poll(step)
        except Exception as e:  # noqa: BLE001
            self.tel.event("error", step=step, where="switch_source", error=str(e))
            return
        if m is None:
            return
        unknown = sorted(set(m) - set(SWITCH_NAMES))
        if unknown:  # a newer control plane's switch: the rest of the update still applies
            self.tel.event("error", step=step, where="switches",
                           error=f"unknown switch(es) {unknown} ignored; valid switches: {', '.join(SWITCH_NAMES)}")
            m = {k: v for k, v in m.items() if k not in unknown}
        try:
            # a delta applies to the newest wanted state (a pending flip's target), else to what runs
            base = self.start_switches if self.source.full_state else (self.flips.wanted or self.switches)
            new = Switches.from_mapping({**base.as_dict(), **m})
        except SwitchError as e:  # refused: the session keeps its switches
            self.tel.event("error", step=step, where="switches", error=str(e))
            return
        self._apply(new, step)

    # -- the loop -------------------------------------------------------------------------------


    def run(self) -> SessionSummary:
        w, shape, tel = self.w, self.w.shape, self.tel
        dev = w.device
        self.t_start = t_wall0 = time.perf_counter()
        if (self.background and not getattr(w.warm_for(self.switches), "complete", False)
                and (ready := w.readiness.take(self.switches, complete=True)) is not None):  # built since the last one
            w.adopt(ready)
        wanted = self._serve_warm_meanwhile()
        warm = w.warm_for(self.switches)
        self.started_warm = warm is not None and warm.runner.capture == "never"
        if warm is not None:  # the worker's cache, restarted in place: its graphs read these tensors
            self.cache = warm.cache
            self.cache.restart()
            self.ff_tokens = w.bucket(self.cond_tokens)
            if wanted is not None:  # on the last complete state: the wanted switches swap in once built
                self.flips.want(self, wanted, -1, self.switches.changes_to(wanted))
            elif self.background and not warm.complete:  # a flip's quick state: attach to its complete one
                self.flips.want(self, self.switches, -1, {})
        else:
            self.cache = make_cache(shape, self.switches, dev, w.model.dtype)
            self.ff_tokens = self.cond_tokens
            if self.background:  # a warm worker on other switches: their warm state, built meanwhile
                self.flips.want(self, self.switches, -1, {})
        self.decoder = w.decoder(self.switches.decoder_own_gpu)
        self.runner = self._runner()
        tel.sync_clock(dev)
        tel.sync_clock(self.decoder.device)
        gen = torch.Generator(device=dev).manual_seed(self.seed)
        common = {"first_forward_tokens": self.ff_tokens, "tp_size": shape.tp_size, "shape": shape.name,
                  "cond_tokens": self.cond_tokens, "decoder_height": shape.frame_h, "decoder_width": shape.frame_w,
                  "chunk_frames": shape.frames_per_chunk,  # the shape keys of records.SHAPE_KEYS
                  "gpu_mem_total_bytes": w.gpu_mem_total_bytes}
        tel.session(phase="start", streamed_s=0.0, frames=0, avg_fps=None, late_chunks=0, stall_ms=0.0,
                    preroll=self.playout.prebuffer, switches=self.switches.encode(), **common)
        tel.event("session_start", shape=shape.name, first_forward_tokens=self.ff_tokens,
                  cond_tokens=self.cond_tokens, switches=self.switches.encode(), warm=warm is not None)
        model = w.model
        model.set_timer(tel.timer)
        self._set_act_scales(self.switches)
        model.set_compile(self.switches.compile, triton=self.switches.triton_kernels)
        model.reset_act_scales()  # static activation scales: this session calibrates its own
        try:
            cond = self.cond = torch.randn(self.cond_tokens, shape.d_model, generator=gen, device=dev)
            if self.ff_tokens > self.cond_tokens:  # a warm worker's bucket: zero rows after the prompt
                cond = torch.cat([cond, cond.new_zeros(self.ff_tokens - self.cond_tokens, shape.d_model)])
            self.w.register_forward(self.ff_tokens, self.switches)
            cond_kv = self.runner.first_forward(cond, self.cache)
            tel.timer.take()  # the first forward is not a step
            T, C = shape.new_tokens, shape.latent_channels
            t_loop = time.perf_counter()
            if self.turns is not None:
                self.turns.start(t_loop)
            if self.sync_debug:
                torch.cuda.set_sync_debug_mode(self.sync_mode)
            for i in range(self.n_steps):
                if self.stop_when is not None and self.stop_when():
                    break
                self._poll_switches(i)
                cond_kv = self.flips.boundary(self, i, cond_kv)
                held = self._wait_for_room(i, stop=self.turns.due if self.turns else None)
                if self.turns is not None:
                    req, superseded = self._take_turn()
                    if req is not None:  # a turn, at this step boundary
                        cond_kv = self.turns.apply(i, req, superseded, cond_kv, self.cache, tel.in_flight(),
                                                   self._chunk_s(), reset=i > 0 and i % self.reset_every == 0)
                        held = self._wait_for_room(i) or held
                tel.begin_step(i, held=held)
                if self.turns is not None:
                    self.turns.step_begun(i)
                reset = i > 0 and i % self.reset_every == 0
                with tel.timer.span("upkeep"):
                    did_reset = self.cache.begin_step(T, reset=reset)
                noise = torch.randn(T, C, generator=gen, device=dev)
                self.w.register_forward(T, self.switches)
                probe = self._probe_step(i)
                latents, graphed = self.runner(noise, self.cache, cond_kv, probe=probe)
                saturation = None
                if probe is not None:
                    saturation = probe.finish()  # before diffusion_done: read when its event is done
                self.cache.end_step()
                done = tel.diffusion_done()
                job = self.decoder.submit(latents, i, after=done if tel.cuda else None)
                tel.end_step(i, done, job, did_reset, tel.memory(), len(w.registry), self.switches.encode(),
                             graphed=graphed, saturation=saturation)
                if did_reset:
                    tel.event("reset", step=i, resets=self.cache.book.resets)
                tel.poll()
                if self.turns is not None:
                    self.turns.collect()
            if self.sync_debug:
                torch.cuda.set_sync_debug_mode("default")
            tel.drain()
            if self.turns is not None:
                self.turns.collect()
            self.loop_s = time.perf_counter() - t_loop
        except torch.OutOfMemoryError as e:
            tel.event("oom", error=str(e)[:500])
            raise
        finally:
            if self.sync_debug:
                torch.cuda.set_sync_debug_mode("default")
            self.w.model.set_timer(_null_timer())  # the model now (a flip's swap installs its view)
            self.w.model.set_probe(None)
            self.source.close()
        self.graph_captures, self.graph_misses = self._graph_counts()
        return self._finish(t_wall0, common)

    def _take_turn(self):
        """The turn to apply at this step boundary, if any: (request, superseded) or (None, 0). Under
        tensor parallel every rank takes the same (worker/parallel.py ``TPSession``)."""
        return self.turns.take()

    def _chunk_s(self) -> float:
        """The recent chunk period (the longest of the last 8 periods: trim's estimate, which keeps it as
        measured on the H200; the periods include the player's pacing, see worker/turns.py)."""
        recent = self.tel.stats.period_ms[-8:]
        return max(recent) / 1e3 if recent else self.playout.period_s

    def _short_queue(self) -> bool:
        """The ``cover`` policy keeps the device queue short in a session with turns: a step starts once
        the device has finished the one before, so a turn waits for the step in progress alone."""
        return self.turns is not None and self.playout_policy == "cover"

    def _wait_for_room(self, i: int, stop=None) -> bool:
        """Real time: wait while the player's buffer is full; never more than a few steps in flight (one
        on the device under ``cover``, polled with ``event.query()``: no sync); ``stop()`` true (a turn
        arrived): return at once.

        Returns whether the player held this step back (the worker was ahead of real time)."""
        tel = self.tel
        held = False
        while True:
            tel.poll()
            if stop is not None and stop():
                return held
            now = time.perf_counter()
            if tel.in_flight() >= self.max_in_flight and not tel.oldest_done():
                time.sleep(0.0005)
                continue
            if self._short_queue() and tel.device_busy():
                time.sleep(0.0002)
                continue
            wait = self.playout.wait_s(i, now) if self.realtime else 0.0
            if wait <= 0:
                return held
            held = True
            time.sleep(min(wait, 0.005))

    def _finish(self, t_wall0: float, common: dict) -> SessionSummary:
        tel, pl = self.tel, self.playout
        tel.close()  # the sampler's last sample is put now, before the end records and the sink's close
        self.out_of_service_s = self.w.settle(self)  # the worker's switches for the next session
        self.flip_records = self.flips.records(self, self.out_of_service_s * 1e3)
        for rec in self.flip_records:
            tel.event(FLIP_COST_KIND, **rec)
        frames = pl.delivered * self.w.shape.frames_per_chunk
        # streamed seconds and fps as the store computes them (session_stats): from the worker's own
        # chunk periods (telemetry._period_ms), so fps says what the worker can sustain; the player's
        # view is in late_chunks and stall_ms
        self.ttff_ms = None if pl.start is None else (pl.start - self.t_start) * 1e3
        streamed = sum(tel.stats.period_ms) / 1000
        fps = frames / streamed if streamed > 0 else None
        tel.session(phase="end", streamed_s=streamed, frames=frames, avg_fps=fps, late_chunks=pl.late_chunks,
                    stall_ms=pl.stall_s * 1e3, switches=self.switches.encode(), ttff_ms=self.ttff_ms,
                    preroll=pl.prebuffer, **common)
        tel.event("session_end", frames=frames, avg_fps=fps, late_chunks=pl.late_chunks)
        if tel.dropped:  # records the worker's own path lost (failed to build or put); the client
            # reports the rows it dropped itself, in its own telemetry_dropped events (where=client)
            tel.event("telemetry_dropped", where="worker", dropped=tel.dropped, reasons=dict(tel.dropped_by))
        if self._own_sink:
            self.sink.close(timeout_s=2.0)  # ships what it can; the rest counts as dropped
        else:
            self.sink.flush(timeout_s=2.0)
        st = tel.stats
        return SessionSummary(
            session_id=self.session_id, shape=self.w.shape.name, steps=st.steps, frames=frames,
            streamed_s=streamed, avg_fps=fps, late_chunks=pl.late_chunks, stall_ms=pl.stall_s * 1e3,
            first_forward_tokens=self.ff_tokens, switches=self.switches.encode(),
            switch_events=self.switch_events, resets=self.cache.book.resets, wraps=self.cache.book.wraps,
            buffers_registered=len(self.w.registry), records=dict(tel.emitted),
            telemetry_sent=int(getattr(self.sink, "sent", 0)), telemetry_filed=int(getattr(self.sink, "filed", 0)),
            telemetry_dropped=int(getattr(self.sink, "dropped", 0)) + tel.dropped,
            telemetry_failed_batches=int(getattr(self.sink, "failed_batches", 0)),
            wall_s=time.perf_counter() - t_wall0, loop_s=self.loop_s, mean_diffusion_ms=_mean(st.diffusion_ms),
            mean_upkeep_ms=_mean(st.upkeep_ms), mean_attention_ms=_mean(st.attention_ms),
            mean_decode_ms=_mean(st.decode_ms), power_error=tel.power.error if tel.power else None,
            graphed_steps=sum(st.graphed), probed_steps=len(st.saturated),
            max_fp8_saturated=max(st.saturated) if st.saturated else None,
            turns=self.turns.applied if self.turns is not None else 0,
            dropped_chunks=getattr(pl, "dropped_chunks", 0),
            cond_tokens=self.cond_tokens, ttff_ms=self.ttff_ms, preroll=pl.prebuffer,
            warm=self.started_warm,
            graph_captures=self.graph_captures, graph_misses=self.graph_misses,
            flips=self.flip_records, out_of_service_s=self.out_of_service_s,
        )


def _null_timer():
    from worker.model import NullTimer

    return NullTimer()


def run_session(shape: str | ModelShape = "tiny", seconds: float | None = None, steps: int | None = None,
                collector_url: str | None = None, token: str | None = None, switches=None, switch_source=None,
                release: str = "dev", worker_id: str = "w0", device=None, worker: Worker | None = None,
                **kw) -> SessionSummary:
    """One session on a fresh (or given) worker: the lead's demo and the CLI call this."""
    w = worker or Worker(shape, device=device, worker_id=worker_id, release=release)
    return w.run_session(seconds=seconds, steps=steps, collector_url=collector_url, token=token,
                         switches=switches, switch_source=switch_source, **kw)
