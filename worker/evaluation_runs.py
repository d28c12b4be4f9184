"""The measurements behind ``livestep evaluate``: one configuration's latents against the plain path's.

    models = Models(shape, device)                         # truth, plain and one twin per configuration
    tf = teacher_forced(models, {"fp8_cache": sw}, steps=100)   # per-step error vs the truth, same state
    fr = free_running(models, {"fp8_cache": sw}, steps=100, reruns=4)   # trajectory distances
    dr = drift_session(models, "production", sw, steps=14_400)    # teacher-forced at probes of a long session

Three numerics take part. The *truth*: the plain path in fp64 with no FP8 anywhere (``--truth fp64``,
small presets) or in bf16 without FP8 (``--truth bf16``, prod: a rank's fp64 weights do not fit one
GPU). The *plain* path: all switches off at the production numerics (FP8 weights where the shape or
``fp8`` says so, per-row dynamic activation scales, the launch cache). A *candidate*: a configuration
of switches at the same numerics. Twins share the FP8 weights; each keeps its own calibration (static
activation scales, per-head cache scales), set once per session as in serving.

Teacher forcing: before every step, the plain and candidate caches are loaded with the truth's window
(``KVCache.load_tokens``: RoPE'd and quantized with the cache's own session-calibrated scales), then
every arm denoises the same noise. The error is the truth's distance to each (``metric``), so the
trajectory's divergence never enters; the plain path's error is the low-precision reference's own.

Free running: every arm runs its own trajectory. Reruns of the plain path and candidate runs carry a
rerun perturbation (``Perturbation``): on CPU -- deterministic -- each step's noise input is multiplied
by ``1 + 2**-8 * z`` (z ~ N(0, 1) from the run's seed: one bf16 rounding step, every step, as a
nondeterministic reduction order gives); on CUDA the kernels' own nondeterminism ("auto"), or, when
reruns come out bitwise identical, the same input perturbation. Distances are to the unperturbed plain
run. ``tamper`` (tests only) breaks a candidate on purpose, to show that the judges catch it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from worker.cache import KVCache, make_cache
from worker.config import ModelShape, Switches
from worker.model import DiT

# A metric compares a candidate's latents with the reference's: [tokens, channels] each -> a float
# (bigger = further). Pluggable: a lip-sync scorer over decoded frames drops in with the same signature.
Metric = Callable[[torch.Tensor, torch.Tensor], float]
PERTURB_EPS = 2.0**-8  # the CPU rerun perturbation: one bf16 rounding step on every noise element
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
        self.truth_shape = replace(self.shape, fp8_attention=False, fp8_weights=False)
        # the same weights as the plain path's before FP8 (drawn in its dtype, then widened)
        self.truth = _widen(DiT(self.truth_shape, self.device, dtype=self.dtype, fp8=False), self.truth_dtype)
        self.base = DiT(self.shape, self.device, dtype=self.dtype, fp8=self.fp8)

    def arm(self, sw: Switches) -> DiT:
        return configure(twin(self.base), sw)

    def cache(self, model: DiT, sw: Switches) -> KVCache:
        shape = self.truth_shape if model is self.truth else self.shape
        return make_cache(shape, sw, self.device, model.dtype)


@dataclass
class Run:
    """One arm: a configured model, its cache and conditioning K/V, and what breaks it (tests only)."""

    name: str
    switches: Switches
    model: DiT
    cache: KVCache
    cond_kv: list = field(default_factory=list)
    perturb: int | None = None  # the rerun's seed (None: unperturbed)
    gen: torch.Generator | None = None

    def start(self, cond: torch.Tensor, tamper: Callable | None = None) -> None:
        if tamper is not None:
            tamper(self.model, self.cache)
        self.cond_kv = self.model.first_forward(cond, self.cache)
        if self.perturb is not None:
            self.gen = torch.Generator(device=cond.device).manual_seed(1_000_003 + self.perturb)

    def step(self, noise: torch.Tensor, reset: bool) -> torch.Tensor:
        if self.gen is not None:
            z = torch.randn(noise.shape, generator=self.gen, device=noise.device, dtype=noise.dtype)
            noise = noise * (1 + PERTURB_EPS * z)
        self.cache.begin_step(noise.shape[0], reset=reset)
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


@dataclass
class TeacherForced:
    """Per step: the plain path's error and each candidate's, against the truth from the same state."""

    steps: int
    reset: list[bool]
    plain: list[float]
    candidates: dict[str, list[float]]
    identical: dict[str, bool]  # the candidate's latents equal the plain path's at every step (no effect here)
    saturated: dict[str, list[float]] = field(default_factory=dict)  # (step, FP8 saturation share): drift_session


def teacher_forced(models: Models, candidates: dict[str, Switches], steps: int, *, metric: Metric = rel_l2,
                   seed: int = 0, tamper: dict[str, Callable] | None = None,
                   log: Callable[[str], None] | None = None) -> TeacherForced:
    """Each candidate and the plain path stepped from the truth's window and inputs, ``steps`` steps.
    ``log``: a line per arm started and at a ladder of steps (a prod-sized run takes minutes before its
    first: the compiled configurations compile then)."""
    clock = _Progress("teacher-forced", steps, log)

    shape, dev = models.shape, models.device
    cond, g = session_inputs(shape, dev, seed)
    plain_sw = Switches()
    truth = Run("truth", plain_sw, models.truth, models.cache(models.truth, plain_sw))
    plain = Run("plain", plain_sw, models.arm(plain_sw), None)
    plain.cache = models.cache(plain.model, plain_sw)
    cands = {}
    for name, sw in candidates.items():
        m = models.arm(sw)
        cands[name] = Run(name, sw, m, models.cache(m, sw))
    for r in (truth, plain, *cands.values()):
        r.start(cond, (tamper or {}).get(r.name))
        clock.say(f"{r.name} started (first forward)")
    out = TeacherForced(steps, [], [], {n: [] for n in cands}, {n: True for n in cands},
                        {n: [] for n in cands})
    for i in range(steps):
        reset = i > 0 and i % shape.reset_every == 0
        noise = _noise(shape, g, dev)
        for r in (plain, *cands.values()):
            _sync_window(truth.cache, r.cache)
        ref = truth.step(noise, reset).float()
        low = plain.step(noise, reset)
        out.reset.append(reset)
        out.plain.append(metric(low.float(), ref))
        for name, r in cands.items():
            y = r.step(noise, reset)
            out.candidates[name].append(metric(y.float(), ref))
            out.identical[name] = out.identical[name] and torch.equal(y, low)
        clock.step(i)
    return out


def probe_steps(steps: int, reset_every: int, per_interval: int = 2) -> list[int]:
    """The steps a long session is probed at: each position reset and ``per_interval - 1`` evenly spaced
    steps between, so every reset interval has the same number of probes (the drift judge's segment)."""
    offsets = sorted({round(j * reset_every / per_interval) for j in range(per_interval)})
    return [i for i in range(steps) if i % reset_every in offsets]


def drift_session(models: Models, name: str, sw: Switches, steps: int, *, metric: Metric = rel_l2, seed: int = 0,
                  per_interval: int = 2, tamper: Callable | None = None,
                  log: Callable[[str], None] | None = None) -> TeacherForced:
    """``teacher_forced`` over a long session, measured at ``probe_steps`` only. The truth runs every
    step (its trajectory is the session); at a probe the plain path and the candidate are loaded with
    its window -- quantized with the candidate's own session-calibrated cache scales -- and denoise the
    same noise with the calibration they got at the session's start. Between probes nothing of theirs
    changes (a teacher-forced arm's only state across steps is that calibration), so they are not
    stepped: a 14,400-step session costs the truth's steps and ~690 probes, not three models' steps."""
    from worker.fp8 import SaturationProbe

    shape, dev = models.shape, models.device
    cond, g = session_inputs(shape, dev, seed)
    plain_sw = Switches()
    truth = Run("truth", plain_sw, models.truth, models.cache(models.truth, plain_sw))
    plain_model = models.arm(plain_sw)
    plain = Run("plain", plain_sw, plain_model, models.cache(plain_model, plain_sw))
    m = models.arm(sw)
    cand = Run(name, sw, m, models.cache(m, sw))
    for r in (truth, plain, cand):
        r.start(cond, tamper if r is cand else None)
    probes = set(probe_steps(steps, shape.reset_every, per_interval))
    out = TeacherForced(len(probes), [], [], {name: []}, {name: True}, {name: []})
    probe = SaturationProbe(dev)
    clock = _Progress("drift", steps, log)
    for i in range(steps):
        reset = i > 0 and i % shape.reset_every == 0
        noise = _noise(shape, g, dev)
        if i in probes:
            for r in (plain, cand):
                _sync_window(truth.cache, r.cache)
        ref = truth.step(noise, reset).float()
        if i in probes:
            low = plain.step(noise, reset)
            if m.probe_ready:  # the share of the static scales' FP8 inputs at +-448 (reading it syncs)
                probe.start()
                m.set_probe(probe)
            y = cand.step(noise, reset)
            if m.probe_ready:
                m.set_probe(None)
                out.saturated[name].append((i, float(probe.count) / max(probe.total, 1)))
            out.reset.append(reset)
            out.plain.append(metric(low.float(), ref))
            out.candidates[name].append(metric(y.float(), ref))
            out.identical[name] = out.identical[name] and torch.equal(y, low)
        clock.step(i)
    return out


@dataclass
class FreeRunning:
    """Per run and step: the distance of a trajectory to the unperturbed plain run's."""

    steps: int
    perturbation: str  # "input" (PERTURB_EPS on the noise) or "nondeterminism" (the device's own)
    reruns: list[list[float]]  # [run][step]: plain rerun r vs the unperturbed plain run
    candidates: dict[str, list[list[float]]]  # per candidate [run][step]: its run r vs plain rerun r


def _trajectory(models: Models, sw: Switches, steps: int, seed: int, perturb: int | None,
                tamper: Callable | None = None, clock: _Progress | None = None) -> torch.Tensor:
    cond, g = session_inputs(models.shape, models.device, seed)
    m = models.arm(sw)
    r = Run("run", sw, m, models.cache(m, sw), perturb=perturb)
    r.start(cond, tamper)
    out = []
    for i in range(steps):
        reset = i > 0 and i % models.shape.reset_every == 0
        out.append(r.step(_noise(models.shape, g, models.device), reset).float().cpu())
        if clock is not None:
            clock.step(i)
    return torch.stack(out)


def free_running(models: Models, candidates: dict[str, Switches], steps: int, reruns: int, *,
                 metric: Metric = rel_l2, seed: int = 0, perturbation: str = "auto",
                 tamper: dict[str, Callable] | None = None, log: Callable[[str], None] | None = None) -> FreeRunning:
    """The unperturbed plain run, ``reruns`` perturbed plain reruns and ``reruns`` perturbed runs of each
    candidate (perturbation "input", "nondeterminism", or "auto": the device's own on CUDA unless its
    reruns are bitwise identical to the first run, the input perturbation on CPU)."""
    if reruns < 2:
        raise ValueError(f"reruns {reruns}: the rerun band needs at least 2 reruns")
    if perturbation not in ("auto", "input", "nondeterminism"):
        raise ValueError(f"perturbation {perturbation!r}; valid: auto, input, nondeterminism")
    plain_sw = Switches()
    clock = _Progress("free-running", steps, log)
    base = _trajectory(models, plain_sw, steps, seed, None, clock=clock)
    clock.say("plain run done")
    mode = perturbation
    if mode == "auto":
        mode = "nondeterminism" if models.device.type == "cuda" else "input"
    runs = []
    if mode == "nondeterminism":  # one unperturbed rerun says whether the device varies at all
        first = _trajectory(models, plain_sw, steps, seed, None)
        if torch.equal(first, base):
            if perturbation == "nondeterminism":
                raise RuntimeError("the plain reruns are bitwise identical on this device: no rerun band; "
                                   "use --perturbation input")
            mode = "input"
            clock.say("the device repeats the plain run bit for bit: input perturbation")
        else:
            runs.append(first)
    runs += [_trajectory(models, plain_sw, steps, seed, r if mode == "input" else None)
             for r in range(len(runs), reruns)]
    clock.say(f"{reruns} plain reruns done")

    def dist(traj: torch.Tensor, ref: torch.Tensor) -> list[float]:
        return [metric(traj[i], ref[i]) for i in range(steps)]

    out = FreeRunning(steps, mode, [dist(x, base) for x in runs], {})
    for name, sw in candidates.items():
        t = (tamper or {}).get(name)
        out.candidates[name] = [dist(_trajectory(models, sw, steps, seed, r if mode == "input" else None, t), runs[r])
                                for r in range(reruns)]
        clock.say(f"{name}: {reruns} runs done")
    return out
