"""One serving process: a model (this rank's shard), its warm state and flip readiness; runs sessions one by one.

    worker = Worker("tiny"); worker.warm(switches)          # once per worker: compile, every CUDA graph
    worker.run_session(steps=50, switches=switches); worker.run_session(...)   # sessions only replay

Sessions themselves (the step loop, the playout clock, switches between steps) are worker/session.py; flips
built off the critical path are worker/readiness.py.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from collector.gpu_kinds import canonical_gpu_kind
from worker.buffers import BufferRegistry
from worker.config import ModelShape, ShapeError, Switches, parse_switch_args, tp_rank_of
from worker.decoder import Decoder
from worker.fp8 import SaturationProbe
from worker.model import DiT
from worker.readiness import Readiness, WarmState, build_warm

if TYPE_CHECKING:
    from worker.session import Session, SessionSummary

log = logging.getLogger("livestep.worker.session")


def _as_switches(sw) -> Switches:
    if sw is None:
        return Switches()
    if isinstance(sw, Switches):
        return sw
    if isinstance(sw, dict):
        return Switches.from_mapping(sw)
    return parse_switch_args(list(sw))


def cond_buckets_of(shape: ModelShape) -> tuple[int, ...]:
    """The first-forward lengths a warm worker pads a prompt to: powers of two over the shape's
    conditioning range, its maximum last (prod57b: 256, 512, 1024, 2048)."""
    lo, hi = shape.cond_tokens
    out, b = [], 1 << max(0, math.ceil(math.log2(lo)))
    while b < hi:
        out.append(b)
        b *= 2
    return (*out, hi)


class Worker:
    """A model (this rank's shard) and the process-wide buffer registry; runs sessions one by one.

    ``warm(switches)`` captures, once, every CUDA graph a session needs (a first forward per
    conditioning bucket, the calibrating first chunk, the window's fill steps, the steady step plain
    and probed) on a cache the worker keeps; a session with those switches then restarts that cache
    and only replays: its first chunk comes after one graphed first forward and one graphed step.
    A warm worker pads a prompt to its bucket (``cond_buckets``), so that few shapes exist: the cost
    is the padding's tokens in the first forward and in the cross-attention (zero rows; a model
    trained without padding would need a key mask there). A switch flip (the control plane's, in a
    session, or a session started on other switches) is built in the background and swapped in at a step
    boundary (``flip="background"``, worker/readiness.py); the worker keeps the target as its warm state
    and never blocks between sessions. ``flip="inline"`` is the plain path: the flip rebuilds in the loop
    and the worker re-warms, blocking, after the session. Unwarmed, a session builds its own cache and
    captures lazily, once the window is full, as before.
    """

    def __init__(self, shape: str | ModelShape = "tiny", device=None, tp: int = 1, rank: int = 0,
                 worker_id: str = "w0", release: str = "dev", model: DiT | None = None,
                 cond_buckets: tuple[int, ...] | None = None, flip: str = "background"):
        base = ModelShape.from_name(shape) if isinstance(shape, str) else shape
        self.shape = tp_rank_of(base, tp, rank) if tp > 1 else base
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.worker_id, self.release = worker_id, release
        cuda = self.device.type == "cuda"
        # the kind rules and detectors key on (NVIDIA H200 -> h200), and the memory a time to OOM is taken of
        self.gpu_kind = canonical_gpu_kind(torch.cuda.get_device_name(self.device)) if cuda else "cpu"
        self.gpu_mem_total_bytes = torch.cuda.get_device_properties(self.device).total_memory if cuda else None
        self.model = model if model is not None else DiT(self.shape, self.device)
        if self.device.type == "cpu" and self.shape.d_model <= 256:
            torch.set_num_threads(1)  # a tiny model is 10x slower when two threads contend per op
        self._registry = BufferRegistry(steady_m=self.shape.new_tokens)
        self.observers: list = []  # told of each session's start and end, between sessions (worker/metrics.py)
        self.cond_buckets = tuple(sorted(cond_buckets)) if cond_buckets else cond_buckets_of(self.shape)
        hi = self.shape.cond_tokens[1]
        if self.cond_buckets[0] < 1 or self.cond_buckets[-1] != hi:
            raise ShapeError(f"cond_buckets {self.cond_buckets} must end at the shape's longest "
                             f"conditioning, {hi}; valid: 1 <= b <= {hi}, the largest == {hi}")
        # the saturation probe's buffers are what a probed graph counts into: one per worker
        self.probe = SaturationProbe(self.device)
        self.warmed: WarmState | None = None
        self.previous: WarmState | None = None  # the last complete warm state while a quick one is adopted
        self.readiness = Readiness(self, flip)
        self._decoders: dict[bool, Decoder] = {}

    def decoder(self, own_gpu: bool) -> Decoder:
        """The worker's decoder for this placement, made once: its weights, and on one GPU its own
        stream, whose freed blocks the caching allocator reuses only for that stream (a stream per
        session grew reserved memory by ~290 MB a session on the H200 with allocated flat)."""
        if own_gpu not in self._decoders:
            self._decoders[own_gpu] = Decoder(self.shape, self.device, own_gpu=own_gpu)
        return self._decoders[own_gpu]

    def bucket(self, tokens: int) -> int:
        """The first-forward length a warm worker runs a prompt of ``tokens`` at (longer than every
        bucket, only possible when a caller asks for it: as is, eagerly)."""
        return next((b for b in self.cond_buckets if b >= tokens), tokens)

    def warm(self, switches=None, buckets: tuple[int, ...] | None = None, neighbours=()) -> WarmState:
        """Capture every graph sessions with ``switches`` need, once: one synthetic session per
        conditioning bucket, not real time, no telemetry (``readiness.build_warm``). Without CUDA graphs
        (CPU, or the switch off) the worker still keeps one cache for them and compiles once. Each switch
        in ``neighbours`` (e.g. ``readiness.RUNTIME_SWITCHES``) then has its one-flip neighbour's compiles
        done (``Readiness.prepare_neighbours``), so that a flip's background build only captures."""
        sw = _as_switches(switches)
        buckets = tuple(buckets or self.cond_buckets)
        warm = build_warm(self, sw, buckets, model=self.model, probe=self.probe, run=self.run_session)
        log.info("warm: %d graphs for %d buckets in %.1f s", warm.runner.n_graphs, len(buckets), warm.seconds)
        if neighbours:
            self.readiness.prepare_neighbours(sw, neighbours, buckets)
        return warm

    def adopt(self, warm: WarmState) -> None:
        """A built warm state (a flip's target) becomes the worker's: its model view and probe too. A quick one
        (one bucket's graphs) keeps the complete state it replaces as ``previous``: a session on another bucket
        starts there until the target's complete state is built (``Session._serve_warm_meanwhile``)."""
        old = self.warmed
        if warm.complete:
            self.previous = None
        elif old is not None and old.complete and old is not warm:
            self.previous = old
        self.warmed, self.model, self.probe = warm, warm.model, warm.probe

    def settle(self, s: Session) -> float:
        """After session ``s``, before its end record: a warm worker whose session ended on other switches
        takes the target it swapped in, or the finished build, or starts one (the next session attaches
        to it); on the plain path (``flip="inline"``, tensor parallel) re-warms, blocking. Returns the
        seconds it blocked."""
        warm = self.warmed
        if getattr(self, "building", False) or warm is None or warm.runner.capture != "never":
            return 0.0  # not warm, or a build's / warm()'s own session
        final = s.switches.model_switches()
        if final == warm.switches.model_switches() and (warm.complete or not s.background):
            return 0.0
        t0 = time.perf_counter()
        target = s.flips.target
        if not s.background:
            log.info("switches changed to [%s]: re-warming", final.encode())
            self.warm(final, warm.buckets)
        elif (ready := self.readiness.take(final, complete=True)) is not None:
            self.adopt(ready)
        elif target is not None and target.switches.model_switches() == final:
            self.adopt(target)  # the quick state until the complete one is built (the next session attaches)
        else:
            self.readiness.request(final)
        return time.perf_counter() - t0

    def warm_for(self, switches: Switches) -> WarmState | None:
        """The warm state when it was made for these switches (the playout policy aside: it changes no
        step's work)."""
        if self.warmed is None or self.warmed.switches.model_switches() != switches.model_switches():
            return None
        return self.warmed

    @property
    def registry(self) -> BufferRegistry:
        """The fused all-reduce's buffer registry (worker/buffers.py): at world size 1 a local
        stand-in of the same size, so the fault switch's leak shows without a TP group."""
        return self._registry

    def register_forward(self, tokens: int, sw: Switches) -> None:
        """The fused path's buffer for a forward of ``tokens`` (steady shape only; every shape under
        ``buffer_per_shape``); nothing when neither switch is on."""
        if sw.fused_allreduce or sw.buffer_per_shape:
            self.registry.buffer_per_shape = sw.buffer_per_shape
            self.registry.lookup(tokens, self.shape.d_model, torch.bfloat16, self.device)

    def run_session(self, **kw) -> SessionSummary:
        from worker.session import Session  # session.py imports this module

        return self.observed(Session(self, **kw))

    def observed(self, s: Session) -> SessionSummary:
        """Run ``s``, telling the observers (worker/metrics.py) of its start and end."""
        for o in self.observers:
            o.session_started(s)
        summary = None
        try:
            summary = s.run()
        finally:
            for o in self.observers:
                o.session_ended(s, summary)
        return summary
