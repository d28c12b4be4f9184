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
                 steps=8, reruns=2)
    assert set(r["overall"]) == {"fp8_cache", "static_scales", "triton_kernels", "compile", "production"}
    assert all(v in ("pass", "fail", "no_effect") for v in r["overall"].values()), r["overall"]
    assert not r["series"]["teacher_forced"]["identical"]["triton_kernels"]  # the kernels run on CUDA
    assert r["perturbation"] in ("nondeterminism", "input")
