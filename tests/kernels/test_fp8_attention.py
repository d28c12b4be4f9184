"""fp8_attention against the fp64 truth, bounded by its precision-model reference's own error (FA3 rule)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_attention import fp8_attention, fp8_attention_lowp_ref, fp8_attention_ref
from tests.kernels.helpers import NAN_FP8, max_err, random_fp8_window, random_scale


def _inputs(H, Tq, S, D, n_valid, g, device):
    q = (torch.randn(H, Tq, D, generator=g, device=device) * 1.5).bfloat16()
    k_scale, v_scale = random_scale(H, g, device), random_scale(H, g, device)
    k = random_fp8_window(H, S, D, k_scale, g, device)
    v = random_fp8_window(H, S, D, v_scale, g, device)
    k.view(torch.uint8)[:, n_valid:] = NAN_FP8  # slots past n_valid must never be read
    v.view(torch.uint8)[:, n_valid:] = NAN_FP8
    return q, k, v, k_scale, v_scale


def check_attention(H, Tq, S, D, n_valid, qk_fp8, pv_fp8, rng, device, rel_bound):
    g, seed = rng
    q, k, v, ks, vs = _inputs(H, Tq, S, D, n_valid, g, device)
    out = fp8_attention(q, k, v, ks, vs, n_valid, qk_fp8=qk_fp8, pv_fp8=pv_fp8)
    truth = fp8_attention_ref(q, k, v, ks, vs, n_valid, compute_dtype=torch.float64).double()
    lowp = fp8_attention_lowp_ref(q, k, v, ks, vs, n_valid, qk_fp8=qk_fp8, pv_fp8=pv_fp8)
    msg = f"seed={seed} H={H} Tq={Tq} S={S} D={D} n_valid={n_valid} qk_fp8={qk_fp8} pv_fp8={pv_fp8}"
    assert out.shape == q.shape and out.dtype == torch.bfloat16, msg
    assert torch.isfinite(out).all(), f"NaN/inf (masked slots read?): {msg}"
    err, err_ref = max_err(out, truth), max_err(lowp, truth)
    atol = 2.0**-8 * truth.abs().max().item()  # one bf16 rounding of the largest output
    assert err <= 2 * err_ref + atol, f"err {err} > 2 * err_ref {err_ref} + {atol}: {msg}"
    rel = ((out.double() - truth).norm() / truth.norm()).item()
    assert rel <= rel_bound, f"relative error {rel} > {rel_bound}: {msg}"
    return rel


# (qk_fp8, pv_fp8) -> relative-error bound vs the fp64 truth: per-row FP8 Q costs ~3% on random data
MODES = {(True, False): 0.06, (True, True): 0.08, (False, True): 0.04, (False, False): 0.02}


@pytest.mark.parametrize(
    "H,Tq,S,D,n_valid",
    [(3, 19, 45, 32, 37), (5, 7, 40, 16, 40), (2, 33, 70, 64, 65), (3, 40, 64, 32, 1)],
)
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_reference(H, Tq, S, D, n_valid, mode, rng, device):
    check_attention(H, Tq, S, D, n_valid, *mode, rng, device, MODES[mode])


def test_single_valid_slot_returns_its_value(rng, device):
    """With one valid slot every query gets exactly that slot's V (softmax of one element is 1)."""
    g, seed = rng
    q, k, v, ks, vs = _inputs(3, 9, 20, 32, 1, g, device)
    out = fp8_attention(q, k, v, ks, vs, 1)
    want = (v[:, :1].float() * vs[:, None, None]).expand(3, 9, 32).bfloat16()
    assert torch.equal(out, want), f"seed={seed}"
