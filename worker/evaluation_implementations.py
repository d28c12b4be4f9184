"""Correct implementations of the plain path: the members of ``livestep evaluate``'s acceptance band.

    impls = available(device)                 # those that run here: SDPA backends, K-split GEMMs, FP8 reads
    model = apply(models.arm(Switches()), impl)  # the plain arm computing with that implementation
    with impl.context(): model.denoise_chunk(...)

The band a candidate is judged against is the spread, around the plain path, of implementations that
are all *correct* -- the same mathematics, another order of floating-point operations: another SDPA
backend (math, memory-efficient, flash: each tiles and accumulates the softmax differently), another
GEMM reduction (the K dimension split in two and the partial products summed in the other order, in
fp32 -- a split-K GEMM -- or accumulated in bf16 across eight K partials, as a kernel that keeps its
partial sums in the output dtype does: the plain path's GEMMs output bf16, so bf16 accumulation is what
it allows). None of them is wrong; a serving stack changes between them with a
library upgrade, a GPU kind or a shape.

Two members compute the plain path's function at the fleet's own FP8 precision: ``fp8_tensorwise`` (one
activation scale per GEMM input instead of one per row) and ``fp8_reads`` (attention reads the window
re-quantized to FP8 with fresh per-head scales at every read -- exactly what the plain path of the
production presets does, ``ModelShape.fp8_attention``; on a preset whose plain path reads bf16, tiny, it
is the production read of the same window). A member is "correct" here in the sense of the precision the
fleet accepts for its plain path, as MLPerf Inference accepts a quantized implementation within a quality
target of the fp32 reference (Reddi et al., "MLPerf Inference Benchmark", ISCA 2020, sec. III-D) and as
FlashAttention-3 judges its FP8 attention by its error against an fp64 reference relative to a baseline
implementation's (Shah et al., "FlashAttention-3", NeurIPS 2024, sec. 4.3). The plain arm itself stays
the switches-off path of the preset as the fleet runs it; ``fp8_reads`` is a named member, reported
with its ratio in the result's ``band.members``, so what it lets through is visible: on tiny it is what
lets ``fp8_cache`` (an FP8 store with session-calibrated scales) pass -- judged, as on prod57b, by the
error it adds over per-read FP8, the read the production plain path already makes. So "as accurate as the plain path" means "within the spread these
give", not "bit-identical", and not a synthetic input jitter (the H200 repeats runs bit for bit: issue 31).
The reduction-order sensitivity of floating-point sums is the subject of the numerical-reproducibility
literature (Demmel & Nguyen, "Fast reproducible floating-point summation", ARITH 2013; Higham, "Accuracy
and Stability of Numerical Algorithms", 2nd ed., ch. 4 "Summation"): the error bound of a sum depends on
its order, and a change of order is the variation a correct implementation may bring.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from worker.model import DiT, Linear

_SDPA = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


@dataclass(frozen=True)
class Implementation:
    """One correct implementation of the plain path: ``sdpa`` forces an SDPA backend, ``ksplit`` computes
    every GEMM as two K halves summed in the other order ("fp32": partials in fp32; "bf16": each partial
    rounded to bf16 before the sum)."""

    name: str
    sdpa: str | None = None
    ksplit: str | None = None
    act_scales: str | None = None  # FP8 activation scales of another granularity ("tensor": one per GEMM input)
    fp8_reads: bool = False  # attention reads the window re-quantized to FP8 per read (the prod presets' plain path)

    def context(self):
        return sdpa_kernel([_SDPA[self.sdpa]]) if self.sdpa else contextlib.nullcontext()


IMPLEMENTATIONS: tuple[Implementation, ...] = (
    Implementation("sdpa_math", sdpa="math"),
    Implementation("sdpa_efficient", sdpa="efficient"),
    Implementation("sdpa_flash", sdpa="flash"),
    Implementation("gemm_ksplit", ksplit="fp32"),
    Implementation("gemm_bf16_accumulate", ksplit="bf16"),
    Implementation("fp8_tensorwise", act_scales="tensor"),
    Implementation("fp8_reads", fp8_reads=True),
)
KSPLIT = {"fp32": 2, "bf16": 8}  # K parts: a split-K GEMM (fp32 partials); bf16 accumulation across 8 partials
NAMES = tuple(i.name for i in IMPLEMENTATIONS)


def _sdpa_runs(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this SDPA backend takes the model's attention (bf16, [1, H, T, D]) on this device."""
    q = torch.randn(1, 2, 8, 16, device=device, dtype=dtype)
    try:
        with sdpa_kernel([_SDPA[backend]]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
    except RuntimeError:
        return False
    return True


def available(device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
              names: list[str] | None = None, fp8_attention: bool = False) -> list[Implementation]:
    """The implementations that run on ``device`` (named ones only, when given; unknown names refused).
    ``fp8_attention``: the preset's plain path already reads FP8 (prod57b), so ``fp8_reads`` *is* the plain
    path there, not another implementation of it, and is left out."""
    bad = sorted(set(names or ()) - set(NAMES))
    if bad:
        raise ValueError(f"unknown implementation(s) {bad}; valid: {', '.join(NAMES)}")
    device = torch.device(device)
    out = []
    for impl in IMPLEMENTATIONS:
        if names is not None and impl.name not in names:
            continue
        if impl.sdpa and not _sdpa_runs(impl.sdpa, device, dtype):
            continue
        if impl.fp8_reads and fp8_attention:
            continue
        out.append(impl)
    return out


@dataclass
class SplitKLinear(Linear):
    """``Linear`` with its K dimension split in ``parts`` and the partial products summed last part first,
    in ``accumulate`` (each partial rounded to it first)."""

    accumulate: torch.dtype = torch.float32
    parts: int = 2

    def _bounds(self, K: int) -> list[tuple[int, int]]:
        step = max(16, -(-K // self.parts) // 16 * 16)  # FP8 GEMMs take K in multiples of 16
        return [(a, min(a + step, K)) for a in reversed(range(0, K, step))]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bounds = self._bounds(x.shape[-1])
        if self.scale is None:
            parts = [(x[..., a:b].float() @ self.w[:, a:b].float().t()).to(self.accumulate) for a, b in bounds]
        else:
            xq, xs = self.quant(x)
            ws = self.col_scale if xs.dim() == 2 else self.scale
            parts = [torch._scaled_mm(xq[:, a:b].contiguous(), self.w[:, a:b].contiguous().t(), scale_a=xs,
                                      scale_b=ws, out_dtype=self.accumulate) for a, b in bounds]
        y = parts[0]
        for p in parts[1:]:
            y = y + p
        return y.to(x.dtype if self.scale is None else torch.bfloat16)


def apply(model: DiT, impl: Implementation) -> DiT:
    """``model`` (a plain arm, ``twin`` of the base: its own Linear objects) computing with ``impl``'s GEMMs.
    The SDPA backend is a context around its steps (``impl.context()``)."""
    if impl.act_scales is not None and model.fp8:
        model.act_scales = impl.act_scales
        model.set_compile(False)
        model.reset_act_scales()
    if impl.ksplit is None:
        return model
    acc = torch.float32 if impl.ksplit == "fp32" else torch.bfloat16
    for blk in model.blocks:
        for name in ("qkv", "cq", "ckv", "up", "o", "co", "down"):
            lin = getattr(blk, name)
            setattr(blk, name, SplitKLinear(**{f: getattr(lin, f) for f in Linear.__dataclass_fields__},
                                            accumulate=acc, parts=KSPLIT[impl.ksplit]))
    return model
