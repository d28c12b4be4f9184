"""``livestep evaluate`` on a CUDA GPU (marker gpu; CI has none): the small preset's switches that act only
on CUDA run there (the Triton kernels change the latents), and every judge comes back with a verdict.

Run on the H200: ``python -m pytest -q -m gpu tests/worker/test_evaluate_gpu.py`` (a few minutes: compiles).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_small_on_cuda_judges_every_switch_and_the_cuda_only_ones_act():
    pytest.importorskip("scipy")
    from worker.evaluate import evaluate

    r = evaluate("small", "cuda", ["fp8_cache", "static_scales", "triton_kernels", "compile", "production"],
                 steps=8, seeds=2, frames=False, implementations=["sdpa_math", "gemm_ksplit", "fp8_tensorwise"])
    assert set(r["overall"]) == {"fp8_cache", "static_scales", "triton_kernels", "compile", "production"}
    # 8 steps hold no position reset of small (every 42): the reset class is unjudged, so no pass
    assert all(v in ("incomplete", "fail", "no_effect") for v in r["overall"].values()), r["overall"]
    assert r["device_type"] == "cuda" and r["numerics"]["attention_reads"] == "fp8"
    assert "fp8_reads" not in r["implementations"]  # small's plain path reads FP8: it is the plain path
    assert not all(run["identical"]["triton_kernels"] for run in r["series"]["teacher_forced"]["runs"])
