"""The measurements behind ``livestep evaluate``: every arm's latents against the truth's, per weight seed.

    models = Models(shape, device)                          # truth, plain and one twin per configuration
    impls = evaluation_implementations.available(device)    # correct implementations of the plain path
    tf = teacher_forced(models, {"fp8_cache": sw}, steps=100, implementations=impls)  # per-step error, same state
    fr = free_running(models, {"fp8_cache": sw}, steps=100, implementations=impls)    # trajectories vs the truth's

Three numerics take part. The *truth*: the plain path in fp64 with no FP8 anywhere (``--truth fp64``,
small presets) or in bf16 without FP8 (``--truth bf16``, prod: a rank's fp64 weights do not fit one
GPU). The *plain* path: all switches off, attention reading as the preset runs it (FP8 re-quantized per
read on small/prod57b, bf16 on tiny), FP8 weights (production's regime, on every preset), per-row dynamic
activation scales, the launch cache; ``Models.numerics()`` states it in the result. An *implementation*: the plain
path computed another correct way (worker/evaluation_implementations.py: SDPA backend, GEMM reduction
order); their spread is the acceptance band. A *candidate*: a configuration of switches at the same
numerics. Twins share the FP8 weights; each keeps its own calibration (static activation scales,
per-head cache scales), set once per session as in serving.

Teacher forcing: before every probed step, the plain, implementation and candidate caches are loaded
with the truth's window (``KVCache.load_tokens``: RoPE'd and quantized with the cache's own
session-calibrated scales), then every arm denoises the same noise. The error is the truth's distance
to each (``metric``), so the trajectory's divergence never enters. The truth runs every step; the
other arms only at ``probes`` (default: every step; a long run probes each position reset, the steps
right after it and a stride between: a teacher-forced arm's only state across steps is its calibration).

Free running: every arm runs its own trajectory from the same conditioning and noise; the distance of
each to the truth's trajectory, per step (so a switch *more* accurate than the plain path is nearer the
truth, and passes). With ``frames``, the decoded frames too (worker/evaluation_frames.py).
``tamper`` (tests only) breaks a candidate on purpose, to show that the judges catch it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from worker.cache import KVCache, make_cache
from worker.config import ModelShape, Switches
from worker.evaluation_implementations import Implementation, apply
from worker.model import DiT

# A metric compares a candidate's latents with the reference's: [tokens, channels] each -> a float
# (bigger = further). Pluggable: a lip-sync scorer over decoded frames drops in with the same signature.
Metric = Callable[[torch.Tensor, torch.Tensor], float]
DYNAMIC_SCALES = "row"  # the plain path's activation scales (worker/session.py's DYNAMIC_SCALES)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp64."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max())


def cosine_distance(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(1 - torch.nn.functional.cosine_similarity(x.double().flatten(), ref.double().flatten(), dim=0))


METRICS: dict[str, Metric] = {"rel_l2": rel_l2, "max_abs": max_abs, "cosine": cosine_distance}


def load_metric(spec: str) -> tuple[str, Metric]:
    """A metric by name (``METRICS``) or ``package.module:function`` (a callable with ``Metric``'s signature)."""
    if spec in METRICS:
        return spec, METRICS[spec]
    mod, sep, fn = spec.partition(":")
    if not sep:
        raise ValueError(f"unknown metric {spec!r}; valid: {', '.join(METRICS)} or package.module:function")
    import importlib

    return spec, getattr(importlib.import_module(mod), fn)


def twin(model: DiT) -> DiT:
    """A DiT sharing ``model``'s weights (and modulation tables) with its own linears' quantizers and
    static scales, fusion and compile state: another configuration of the same weights."""
    t = copy.copy(model)
    t._fusions = {}
    t.blocks = []
    for blk in model.blocks:
        b = copy.copy(blk)
        b.__dict__.pop("row_parallel", None)
        for name in ("qkv", "cq", "ckv", "up", "o", "co", "down"):
            lin = replace(getattr(blk, name))
            lin.site = lin.probe = None
            setattr(b, name, lin)
        b.fusion = None
        t.blocks.append(b)
    return t


def configure(model: DiT, sw: Switches) -> DiT:
    """The model's share of ``sw`` as a session sets it: activation scales, compile, Triton chains. On CPU
    with Triton's interpreter (``TRITON_INTERPRET=1``) the static-scale chains run as the Triton kernels."""
    model.act_scales = "static" if sw.static_scales else DYNAMIC_SCALES
    model.set_compile(sw.compile, triton=sw.triton_kernels)
    model.reset_act_scales()
    if (model.device.type == "cpu" and sw.triton_kernels and sw.static_scales and model.fp8
            and os.environ.get("TRITON_INTERPRET") == "1"):
        from worker.model import BlockFusion

        model.set_fusion(BlockFusion.triton())
    return model


def _widen(model: DiT, dtype: torch.dtype) -> DiT:
    """``model`` (no FP8) with every weight and table cast to ``dtype``, values unchanged."""
    if dtype == model.dtype:
        return model
    model.dtype = dtype
    for name in ("t_embed", "patch_in", "patch_out"):
        setattr(model, name, getattr(model, name).to(dtype))
    model._temb = {t: e.to(dtype) for t, e in model._temb.items()}
    for b in model.blocks:
        for name in ("qkv", "cq", "ckv", "up", "o", "co", "down"):
            getattr(b, name).w = getattr(b, name).w.to(dtype)
        b.table = b.table.to(dtype)
        b.mods = {t: tuple(x.to(dtype) for x in m) for t, m in b.mods.items()}
    return model


@dataclass
class Models:
    """The truth, the plain path and the candidates' twins of one preset on one device."""

    shape: ModelShape
    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    fp8: bool = True
    truth_dtype: torch.dtype = torch.float64
    truth: DiT = field(init=False)
    base: DiT = field(init=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        # The plain arm is the switches-off path of the preset as the fleet runs it: its attention reads
        # (``shape.fp8_attention``: FP8 on small/prod57b, bf16 on tiny) are never changed here. Its weights
        # are production's regime (``fp8``: FP8 GEMMs, as prod57b, on every preset and device) so that the
        # switches that act on FP8 GEMMs (static_scales, triton_kernels) act on tiny too.
        self.truth_shape = replace(self.shape, fp8_attention=False, fp8_weights=False)
        # the same weights as the plain path's before FP8 (drawn in its dtype, then widened)
        self.truth = _widen(DiT(self.truth_shape, self.device, dtype=self.dtype, fp8=False), self.truth_dtype)
        self.base = DiT(self.shape, self.device, dtype=self.dtype, fp8=self.fp8)

    def arm(self, sw: Switches, impl: Implementation | None = None) -> DiT:
        m = configure(twin(self.base), sw)
        return apply(m, impl) if impl is not None else m

    def numerics(self) -> dict[str, str]:
        """What the plain arm computes in, for the result's JSON (``numerics``)."""
        return {"weights": "fp8" if self.fp8 else str(self.dtype).removeprefix("torch."),
                "attention_reads": "fp8" if self.shape.fp8_attention else "bf16",
                "truth": str(self.truth_dtype).removeprefix("torch.") + ", no FP8",
                "note": "plain arm: every switch off, attention reads as the preset runs them; weights in "
                        "production's regime (FP8 GEMMs, as prod57b) on every preset"}

    def run(self, name: str, sw: Switches, impl: Implementation | None = None) -> Run:
        """An arm: the truth (``name == "truth"``), or a twin with ``sw`` (and ``impl``) and its own cache."""
        m = self.truth if name == "truth" else self.arm(sw, impl)
        return Run(name, sw, m, self.cache(m, sw, impl), impl=impl)

    def cache(self, model: DiT, sw: Switches, impl: Implementation | None = None) -> KVCache:
        shape = self.truth_shape if model is self.truth else self.shape
        if impl is not None and impl.fp8_reads:
            shape = replace(shape, fp8_attention=True)
        return make_cache(shape, sw, self.device, model.dtype)


@dataclass
class Run:
    """One arm: a configured model, its cache and conditioning K/V, and what breaks it (tests only)."""

    name: str
    switches: Switches
    model: DiT
    cache: KVCache
    cond_kv: list = field(default_factory=list)
    impl: Implementation | None = None  # a correct implementation of the plain path (its SDPA backend)

    def start(self, cond: torch.Tensor, tamper: Callable | None = None) -> None:
        if tamper is not None:
            tamper(self.model, self.cache)
        with self._context():
            self.cond_kv = self.model.first_forward(cond, self.cache)

    def _context(self):
        import contextlib

        return self.impl.context() if self.impl is not None else contextlib.nullcontext()

    def step(self, noise: torch.Tensor, reset: bool) -> torch.Tensor:
        self.cache.begin_step(noise.shape[0], reset=reset)
        with self._context():
            out = self.model.denoise_chunk(noise, self.cache, self.cond_kv)
        self.cache.end_step()
        return out


def session_inputs(shape: ModelShape, device, seed: int, cond_tokens: int | None = None):
    """The conditioning [L, d] and a generator for the steps' noise, the same for every arm."""
    g = torch.Generator(device=device).manual_seed(seed)
    lo, hi = shape.cond_tokens
    n = cond_tokens or (lo + hi) // 2
    cond = torch.randn(n, shape.d_model, generator=g, device=device)
    return cond, g


def _noise(shape: ModelShape, g: torch.Generator, device) -> torch.Tensor:
    return torch.randn(shape.new_tokens, shape.latent_channels, generator=g, device=device)


def _sync_window(src: KVCache, dst: KVCache) -> None:
    """Load ``src``'s committed window into ``dst`` (its own calibrated scales kept; dst's dtype)."""
    k, v, next_pos = src.export_tokens()
    dst.load_tokens(k.to(dst.dtype), v.to(dst.dtype), next_pos)


class _Progress:
    """Log lines with the seconds since the run began: at steps 1, 2, 5, 10, 20, 50, 100, 200, 500 and
    every 1,000 after; reading a step's result has synced by then, so the times are the device's."""

    LADDER = (1, 2, 5, 10, 20, 50, 100, 200, 500)

    def __init__(self, what: str, steps: int, log: Callable[[str], None] | None):
        import time

        self.what, self.steps, self.log, self.t0, self._now = what, steps, log, time.perf_counter(), time.perf_counter

    def say(self, msg: str) -> None:
        if self.log is not None:
            self.log(f"{self.what}: {msg} at {self._now() - self.t0:.1f} s")

    def step(self, i: int) -> None:
        n = i + 1
        if n in self.LADDER or n % 1000 == 0 or n == self.steps:
            self.say(f"step {n}/{self.steps}")


def _drop(name: str, e: Exception, arms: dict, series: dict, dropped: dict[str, str], clock: _Progress) -> None:
    """A band member that cannot run here (an op its implementation needs refused on this device) leaves the
    band with its reason (``dropped``), instead of ending a run that may be a device call's only one."""
    dropped[name] = f"{type(e).__name__}: {e}"[:500]
    arms.pop(name, None)
    series.pop(name, None)
    clock.say(f"{name} dropped from the band: {dropped[name][:200]}")


def resets_at(steps: int, reset_every: int) -> list[bool]:
    """Whether step i is a position reset (the session's every ``reset_every``-th step, never the first)."""
    return [i > 0 and i % reset_every == 0 for i in range(steps)]


def probe_steps(steps: int, reset_every: int, tail: int, stride: int) -> list[int]:
    """The steps a long teacher-forced run measures: each position reset and the ``tail`` steps after it
    (the reset class), and every ``stride``-th step besides (the steady class)."""
    resets = resets_at(steps, reset_every)
    near = {i + j for i in range(steps) if resets[i] for j in range(tail + 1)}
    return [i for i in range(steps) if i in near or i % max(stride, 1) == 0]


@dataclass
class TeacherForced:
    """Per probed step: the plain path's error, each implementation's and each candidate's, against the
    truth from the same state; ``step`` and ``reset`` say which session step each entry is."""

    steps: int
    step: list[int]
    reset: list[bool]
    plain: list[float]
    candidates: dict[str, list[float]]
    identical: dict[str, bool]  # the candidate's latents equal the plain path's at every step (no effect here)
    implementations: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "step": self.step, "reset": self.reset, "plain": self.plain,
                "candidates": self.candidates, "identical": self.identical, "implementations": self.implementations}


def teacher_forced(models: Models, candidates: dict[str, Switches], steps: int, *, metric: Metric = rel_l2,
                   seed: int = 0, tamper: dict[str, Callable] | None = None, implementations=(),
                   probes: list[int] | None = None, log: Callable[[str], None] | None = None,
                   dropped: dict[str, str] | None = None) -> TeacherForced:
    """The truth for ``steps`` steps; at each of ``probes`` (default every step) the plain path, each
    implementation and each candidate stepped from the truth's window and inputs. ``log``: a line per arm
    started and at a ladder of steps (a prod-sized run takes minutes before its first: compiles)."""
    clock = _Progress("teacher-forced", steps, log)
    shape, dev = models.shape, models.device
    cond, g = session_inputs(shape, dev, seed)
    plain_sw = Switches()
    truth = models.run("truth", plain_sw)
    plain = models.run("plain", plain_sw)
    dropped = {} if dropped is None else dropped
    impls = {i.name: models.run(i.name, plain_sw, i) for i in implementations if i.name not in dropped}
    cands = {name: models.run(name, sw) for name, sw in candidates.items()}
    out = TeacherForced(steps, [], [], [], {n: [] for n in cands}, {n: True for n in cands}, {n: [] for n in impls})
    for r in (truth, plain, *impls.values(), *cands.values()):
        try:
            r.start(cond, (tamper or {}).get(r.name) if r.name in cands else None)
        except RuntimeError as e:
            if r.name not in impls:
                raise
            _drop(r.name, e, impls, out.implementations, dropped, clock)
            continue
        clock.say(f"{r.name} started (first forward)")
    want = set(range(steps) if probes is None else probes)
    resets = resets_at(steps, shape.reset_every)
    for i in range(steps):
        noise = _noise(shape, g, dev)
        if i in want:
            for r in (plain, *impls.values(), *cands.values()):
                _sync_window(truth.cache, r.cache)
        ref = truth.step(noise, resets[i]).float()
        if i in want:
            low = plain.step(noise, resets[i])
            out.step.append(i)
            out.reset.append(resets[i])
            out.plain.append(metric(low.float(), ref))
            for name, r in list(impls.items()):
                try:
                    out.implementations[name].append(metric(r.step(noise, resets[i]).float(), ref))
                except RuntimeError as e:
                    _drop(name, e, impls, out.implementations, dropped, clock)
            for name, r in cands.items():
                y = r.step(noise, resets[i])
                out.candidates[name].append(metric(y.float(), ref))
                out.identical[name] = out.identical[name] and torch.equal(y, low)
        clock.step(i)
    return out


@dataclass
class FreeRunning:
    """Per step: each trajectory's distance to the truth's (same conditioning and noise); with frames,
    the decoded frames' scores against the truth's (worker/evaluation_frames.py), per arm and step."""

    steps: int
    plain: list[float]
    candidates: dict[str, list[float]]
    implementations: dict[str, list[float]]
    frames: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # arm -> score -> [step]

    def as_dict(self) -> dict:
        return {"steps": self.steps, "plain": self.plain, "candidates": self.candidates,
                "implementations": self.implementations, "frames": self.frames}


def free_running(models: Models, candidates: dict[str, Switches], steps: int, *, metric: Metric = rel_l2,
                 seed: int = 0, implementations=(), frames: bool = False, tamper: dict[str, Callable] | None = None,
                 log: Callable[[str], None] | None = None, dropped: dict[str, str] | None = None) -> FreeRunning:
    """The truth, the plain path, each implementation and each candidate, each on its own trajectory for
    ``steps`` steps from the same conditioning and noise; every arm steps in lockstep (nothing is kept but
    the truth's current latents). ``frames``: decode every arm's chunk and score it against the truth's."""
    clock = _Progress("free-running", steps, log)
    shape, dev = models.shape, models.device
    cond, g = session_inputs(shape, dev, seed)
    plain_sw = Switches()
    truth = models.run("truth", plain_sw)
    arms = {"plain": models.run("plain", plain_sw)}
    dropped = {} if dropped is None else dropped
    implementations = [i for i in implementations if i.name not in dropped]
    arms |= {i.name: models.run(i.name, plain_sw, i) for i in implementations}
    arms |= {name: models.run(name, sw) for name, sw in candidates.items()}
    members = {i.name for i in implementations}
    dist: dict[str, list[float]] = {n: [] for n in arms}
    for r in (truth, *arms.values()):
        try:
            r.start(cond, (tamper or {}).get(r.name) if r.name in candidates else None)
        except RuntimeError as e:
            if r.name not in members:
                raise
            _drop(r.name, e, arms, dist, dropped, clock)
            continue
        clock.say(f"{r.name} started (first forward)")
    view = None
    if frames:
        from worker.evaluation_frames import FrameView

        view = FrameView(shape, dev)
    scores: dict[str, dict[str, list[float]]] = {n: {"psnr": [], "ssim": [], "flicker": []} for n in arms} if frames else {}
    prev: dict[str, tuple | None] = dict.fromkeys(arms)
    resets = resets_at(steps, shape.reset_every)
    for i in range(steps):
        noise = _noise(shape, g, dev)
        ref = truth.step(noise, resets[i]).float()
        for name, r in list(arms.items()):
            try:
                y = r.step(noise, resets[i]).float()
            except RuntimeError as e:
                if name not in members:
                    raise
                _drop(name, e, arms, dist, dropped, clock)
                scores.pop(name, None)
                continue
            dist[name].append(metric(y, ref))
            if view is not None:
                got, prev[name] = view.compare(y, ref, prev[name])
                for k, v in got.items():
                    scores[name][k].append(v)
        clock.step(i)
    impl_names = [i.name for i in implementations if i.name not in dropped]
    return FreeRunning(steps, dist.pop("plain"), {n: dist[n] for n in candidates},
                       {n: dist[n] for n in impl_names}, scores)
