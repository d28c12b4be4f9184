"""res_ln_fp8 and gelu_fp8 (the block's static-scale chains) against the torch chains and the fp64 truth.

Two checks against the truth computed in fp64 from the same inputs (the residual as stored, in x's dtype):
in FP8 units before rounding, the kernel's error may be at most twice the torch chain's own plus one FP8
step of the smallest normal (the FlashAttention-3 rule the other kernel tests use); and its FP8 codes equal
the truth rounded to e4m3, but for at most 0.5% of them, one step away (a max error is dominated by the
values near 448, where a step is 32, so it alone would miss a LayerNorm off by 1-3%). Awkward widths (not
powers of two), bf16 and fp32 inputs, scales small enough that some values saturate.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gelu_fp8 import gelu_fp8, gelu_fp8_ref
from kernels.norm_fp8 import res_ln_fp8, res_ln_fp8_ref
from kernels.rope import FP8_DTYPE, FP8_MAX, interpreting
from tests.kernels.helpers import max_err

ATOL = 2.0**-9  # one e4m3 step at the bottom of the range


def _fp8_err(q: torch.Tensor, truth: torch.Tensor) -> float:
    assert q.dtype == FP8_DTYPE
    assert torch.isfinite(q.float()).all(), "NaN/inf in the FP8 output"
    return max_err(q.double(), truth.clamp(-FP8_MAX, FP8_MAX))


def _ordinal(q: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as signed step counts from zero (adjacent values differ by 1, across zero too)."""
    c = q.view(torch.uint8).to(torch.int16)
    return torch.where(c >= 0x80, -(c & 0x7F), c)


def assert_codes_near_truth(q: torch.Tensor, truth: torch.Tensor, msg: str, frac: float = 0.005) -> None:
    """q's codes equal the fp64 truth rounded to e4m3 but for at most ``frac`` of them, each one step off."""
    steps = (_ordinal(q) - _ordinal(truth.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))).abs()
    assert int(steps.max()) <= 1, f"a code {int(steps.max())} steps from the truth: {msg}"
    off = float((steps > 0).float().mean())
    assert off <= frac, f"{off:.2%} of codes off the truth (at most {frac:.1%}): {msg}"


def _saturating_scale(h: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A static scale that maps 0.5-0.8 x amax(h) to 448: the largest values saturate, as inputs past
    the calibrated range do."""
    frac = 0.5 + 0.3 * torch.rand((), generator=g, device=h.device, dtype=torch.float64)
    return (h.abs().max() * frac / FP8_MAX).float()


def _inputs(M, N, dtype, g, device):
    x = torch.randn(M, N, generator=g, device=device).to(dtype) * 2 + 0.5
    y = torch.randn(M, N, generator=g, device=device).to(dtype)
    gate = (torch.rand(N, generator=g, device=device) + 0.25).to(dtype)
    w = (1 + 0.3 * torch.randn(N, generator=g, device=device)).to(dtype)
    b = (0.2 * torch.randn(N, generator=g, device=device)).to(dtype)
    return x, y, gate, w, b


@pytest.mark.parametrize("M,N", [(5, 37), (3, 200), (9, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["ln", "ln_affine", "res", "res_gate_affine", "res_gate"])
def test_res_ln_fp8_matches_the_torch_chain(M, N, dtype, form, rng, device):
    g, seed = rng
    x, y, gate, w, b = _inputs(M, N, dtype, g, device)
    kw = {"y": y if form.startswith("res") else None, "g": gate if "gate" in form else None,
          "w": w if "affine" in form else None, "b": b if "affine" in form else None}
    x_new = res_ln_fp8_ref(x, torch.tensor(1.0, device=device), **kw)[0]  # the residual as stored
    h = F.layer_norm(x_new.double(), (N,), w.double() if kw["w"] is not None else None,
                     b.double() if kw["b"] is not None else None)  # the truth: LayerNorm in fp64
    scale = _saturating_scale(h, g)
    truth = h / scale.double()
    x_k, q_k = res_ln_fp8(x, scale, **kw)
    x_r, q_r = res_ln_fp8_ref(x, scale, **kw)
    msg = f"seed={seed} M={M} N={N} {dtype} {form}"
    assert_codes_near_truth(q_k, truth, msg)
    if kw["y"] is not None:
        torch.testing.assert_close(x_k, x_r, msg=msg)
        assert x_k.dtype == x.dtype and x_k.data_ptr() != x.data_ptr(), msg
    else:
        assert x_k is x, msg  # nothing added: the residual is x itself
    err, err_ref = _fp8_err(q_k, truth), _fp8_err(q_r, truth)
    assert err <= 2 * err_ref + ATOL, f"err {err} > 2 * err_ref {err_ref} + {ATOL}: {msg}"
    assert (truth.abs() > FP8_MAX).any(), f"the scale should make some values saturate: {msg}"
    big = truth.abs() > FP8_MAX * 1.1  # clearly beyond the range: exactly +-448
    assert torch.equal(q_k.float()[big], torch.sign(truth[big]).float() * FP8_MAX), msg


@pytest.mark.parametrize("shape", [(7, 45), (3, 1000), (4099,)])  # 4099: more than one block, a ragged tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_fp8_matches_the_torch_chain(shape, dtype, rng, device):
    g, seed = rng
    u = (torch.randn(shape, generator=g, device=device) * 3).to(dtype)
    h = F.gelu(u.double(), approximate="tanh")
    scale = _saturating_scale(h, g)
    truth = h / scale.double()
    q_k, q_r = gelu_fp8(u, scale), gelu_fp8_ref(u, scale)
    msg = f"seed={seed} shape={shape} {dtype}"
    assert q_k.shape == u.shape, msg
    assert_codes_near_truth(q_k, truth, msg)
    err, err_ref = _fp8_err(q_k, truth), _fp8_err(q_r, truth)
    assert err <= 2 * err_ref + ATOL, f"err {err} > 2 * err_ref {err_ref} + {ATOL}: {msg}"
    assert (truth.abs() > FP8_MAX * 1.1).any(), msg
    big = truth.abs() > FP8_MAX * 1.1
    assert torch.equal(q_k.float()[big], torch.sign(truth[big]).float() * FP8_MAX), msg


def test_bad_inputs_are_refused(device):
    x = torch.randn(4, 8, device=device)
    s = torch.tensor(0.1, device=device)
    with pytest.raises(AssertionError, match="fp32"):
        res_ln_fp8(x, s.double())
    with pytest.raises(AssertionError, match="gate needs"):
        res_ln_fp8(x, s, g=torch.ones(8, device=device))
    with pytest.raises(AssertionError, match="w and b"):
        res_ln_fp8(x, s, w=torch.ones(8, device=device))
    with pytest.raises(AssertionError, match="must match"):
        res_ln_fp8(x, s, y=torch.randn(4, 9, device=device))
    with pytest.raises(AssertionError, match="contiguous"):
        gelu_fp8(x.t(), s)


def _fp32_chains():
    """The static chains in torch ops with one rounding, from fp32 (the kernels' precision; the model's own
    eager chains round the LayerNorm and the GELU to bf16 first, which moves 2% of the codes)."""
    from worker.model import BlockFusion
    from worker.rope import apply_rope_tables

    def quant(h, s):
        return (h.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s

    def ln_quant(x, w, b, s):
        return quant(F.layer_norm(x.float(), (x.shape[-1],), None if w is None else w.float(),
                                  None if b is None else b.float()), s)

    def res_ln_quant(x, g, y, w, b, s):
        x = torch.addcmul(x, g, y) if g is not None else x + y
        return (x, *ln_quant(x, w, b, s))

    def gelu_quant(u, s):
        return quant(F.gelu(u.float(), approximate="tanh"), s)

    return BlockFusion(ln_quant, res_ln_quant, apply_rope_tables, gelu_quant, "static")


@pytest.mark.skipif(not interpreting(), reason="a CPU model: the kernels run in Triton's interpreter (on a GPU:"
                    " tests/worker/test_gpu.py compares the Triton chains with the compiled ones)")
def test_the_model_with_triton_chains_equals_the_fp32_torch_chains():
    """A tiny FP8 DiT, static scales, fused blocks: the chains as these kernels (``BlockFusion.triton``)
    and as torch ops in fp32, each calibrating on the same inputs: the same latents (up to a rare FP8 code
    one step off), and near the model's own eager chains."""
    from tests.worker.test_model import _fp8_chunks
    from worker.config import ModelShape
    from worker.model import BlockFusion, DiT

    model = DiT(ModelShape.from_name("tiny"), dtype=torch.bfloat16, fp8=True)
    fusion, used = BlockFusion.triton(), []
    gelu_quant = fusion.gelu_quant
    fusion.gelu_quant = lambda *a: used.append(1) or gelu_quant(*a)
    torch_fp32 = _fp8_chunks(model, _fp32_chains()).float()
    model.reset_act_scales()
    triton_chains = _fp8_chunks(model, fusion).float()
    model.reset_act_scales()
    eager = _fp8_chunks(model, BlockFusion.eager("static")).float()
    assert used and torch.isfinite(triton_chains).all()
    rel = (triton_chains - torch_fp32).norm() / torch_fp32.norm()
    assert rel < 1e-3, rel
    assert (eager - torch_fp32).norm() / torch_fp32.norm() < 0.05
