"""FP8 (e4m3) helpers: per-head cache quantization and FP8 GEMMs with ``torch._scaled_mm``.

    q = quantize(x, scale)                 # x: [heads, T, D], scale: fp32 [heads]; saturating
    x = dequantize(q, scale, torch.bfloat16)
    y = scaled_mm(*quantize_act(x), w_fp8, w_scale)   # x: [M, K] bf16, w_fp8: [N, K] -> [M, N] bf16

Activations are quantized per tensor (``quantize_act``: scale [], a global amax first, so two passes
over x), per row (``quantize_act_rows``: scale [M, 1], each row's amax and its quantization in one
pass; ``_scaled_mm`` then takes the weight's scale as a [1, N] row, ``col_scale``), or with a static
per-tensor scale (``StaticScale``: calibrated on a call site's first uses as the running max of
amax * margin, then fixed; quantizing is one pass with no reduction, and the GEMM takes the per-tensor
scale -- vLLM's / TensorRT's "static activation scales"; values beyond the calibrated range saturate).

Quantized = clamp(x / scale, -448, 448).to(float8_e4m3fn): never NaN/inf (contract 6). Scales are
device tensors: nothing here reads a value back to the host. Saturation under static scales is counted
on sampled steps by a ``SaturationProbe`` (elements at +-448 of the GEMM inputs, summed on the device
-- one compiled reduction per input on CUDA, inside the runner's probed CUDA graph -- copied to pinned
memory and read once the step's events are done).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0: the largest finite float8_e4m3fn


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [heads, T, D] / scale [heads] -> float8_e4m3fn, saturating."""
    return (x.float() / scale.view(-1, 1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.view(-1, 1, 1)).to(dtype)


def head_scale(x: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """Per-head scale [heads] so that margin * amax maps to 448 (floored to stay finite)."""
    amax = x.abs().amax(dim=(1, 2)).float()
    return (amax * margin).clamp(min=1e-6) / FP8_MAX


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 weight: (w_fp8 [N, K], scale fp32 [])."""
    scale = (w.abs().amax().float().clamp(min=1e-12) / FP8_MAX).reshape(())
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic FP8 of an activation in few kernels: x / (amax/448) never exceeds the
    rounding boundary of 448 (464), so no clamp is needed. Returns (x_fp8, scale fp32 [])."""
    amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    scale = amax.clamp_min(1e-12) * (1.0 / FP8_MAX)
    return (x / scale).to(FP8), scale


def quantize_act_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) dynamic FP8 of an activation [M, K]: (x_fp8, scale fp32 [M, 1]). One
    reduction per row, so a compiled caller fuses it with the producer of x into one pass."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp_min(1e-12) * (1.0 / FP8_MAX)
    return (x / scale).to(FP8), scale


def quantize_act_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 of an activation with a given per-tensor scale []: one pass, saturating at +-448."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


STATIC_MARGIN = 2.0  # calibrated amax x 2 maps to 448: later inputs may grow 2x before they saturate


class StaticScale:
    """A call site's static activation scale: the running max of amax(x) * margin / 448 over its first
    ``calls`` uses (device ops only, no host sync), then fixed. Callable as a ``Linear.quant``:
    x -> (x_fp8, scale []). ``quant`` is ``quantize_act_static`` (compiled under the compile switch)."""

    def __init__(self, device, calls: int, margin: float = STATIC_MARGIN, quant=quantize_act_static):
        self.scale = torch.zeros((), dtype=torch.float32, device=device)
        self.left, self.margin, self.quant = calls, margin, quant

    @property
    def calibrating(self) -> bool:
        return self.left > 0

    def restart(self, calls: int) -> None:
        """Calibrate afresh over the next ``calls`` uses, in the same scale tensor."""
        self.scale.zero_()
        self.left = calls

    def observe(self, x: torch.Tensor) -> None:
        """One calibration use: the scale grows to cover x (amax floored like the dynamic quantizers)."""
        amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
        torch.maximum(self.scale, amax.clamp_min(1e-12) * (self.margin / FP8_MAX), out=self.scale)
        self.left -= 1

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.left > 0:
            self.observe(x)
        return self.quant(x, self.scale)


FP8_MAX_CODE = 0x7E  # 448 in e4m3fn (S.1111.110; 0x7F is NaN): what a saturated element is stored as


def count_saturated(q: torch.Tensor) -> torch.Tensor:
    """Elements of an e4m3fn tensor at +-448 (int64 [], on q's device). With a static scale calibrated
    with margin 2, nothing reaches 448 until an input exceeds ~1.9x the calibrated range (values from 432
    round to 448), so a nonzero count means inputs drifted past what the scale covers."""
    return q.view(torch.uint8).bitwise_and(0x7F).eq(FP8_MAX_CODE).sum()


class SaturationProbe:
    """Counts one step's saturated FP8 activation elements on the device, for the step record.

        probe.start()                      # before the step (DiT.set_probe(probe) routes the GEMM inputs here)
        probe.add(x_fp8)                   # per static-scale GEMM input: device ops only
        host, total = probe.finish()       # enqueue the count's copy to pinned memory; read host
                                           # once the step's events say it is done: host / total

    The copy goes to one of ``slots`` pinned buffers in turn: more than the steps a session keeps in
    flight, so a value is read before its buffer comes round again. ``compiled`` (CUDA inputs; the session
    follows its compile switch): each input counted by one compiled reduction instead of three eager
    kernels and two temporaries. ``start`` and ``add`` may be captured in a CUDA graph (``ChunkRunner``):
    the replay zeroes and counts; ``total``, a host number, is then the captured forward's, and the
    runner sets it after each replay."""

    def __init__(self, device, slots: int = 8, compiled: bool = False):
        device = torch.device(device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.host = torch.zeros(slots, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.total = 0
        self._slot = 0
        self.compiled = compiled

    def start(self) -> None:
        self.count.zero_()
        self.total = 0

    def add(self, q: torch.Tensor) -> None:
        self.count += (_compiled_count() if self.compiled and q.is_cuda else count_saturated)(q)
        self.total += q.numel()

    def finish(self) -> tuple[torch.Tensor, int]:
        dst = self.host[self._slot]
        self._slot = (self._slot + 1) % self.host.numel()
        dst.copy_(self.count, non_blocking=True)
        return dst, self.total


_COMPILED_COUNT = None


def _compiled_count():
    """``count_saturated`` compiled once per process (a static kernel per input shape: a step has three)."""
    global _COMPILED_COUNT
    if _COMPILED_COUNT is None:
        _COMPILED_COUNT = torch.compile(count_saturated, dynamic=False)
    return _COMPILED_COUNT


def col_scale(w_scale: torch.Tensor, n: int) -> torch.Tensor:
    """A per-tensor weight scale as the [1, N] row ``_scaled_mm`` needs beside a per-row activation scale."""
    return w_scale.reshape(1, 1).expand(1, n).contiguous()


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              w_col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``(xq @ w.T) * scales``; a per-row x_scale [M, 1] pairs with the weight's [1, N] scale."""
    if x_scale.dim() == 2:
        w_scale = w_col_scale if w_col_scale is not None else col_scale(w_scale, w.shape[0])
    return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
