"""On a CUDA GPU (marker gpu): a warm worker's replays compute what eager steps do, without a host
sync, and its memory stays flat over many sessions with the cyclic collector off.

Run on the H200: ``python -m pytest -q -m gpu tests/worker/test_gpu_warm.py``.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from tests.worker.conftest import spy_on_decoder
from worker.config import ModelShape, Switches
from worker.session import Worker

pytestmark = pytest.mark.gpu

PROD = Switches.all_on()
SHAPE = ModelShape.from_name("small", n_blocks=2, window=2400, cond_tokens=(256, 600))


def _latents(monkeypatch, worker: Worker, **kw) -> list[torch.Tensor]:
    """Every chunk's latents as the decoder receives them (a host copy: this test may sync)."""
    with monkeypatch.context() as m:
        seen = spy_on_decoder(m)
        worker.run_session(realtime=False, **kw)
    return seen


def test_warm_replays_compute_what_the_unwarmed_session_computes(monkeypatch):
    warm, cold = Worker(SHAPE, device="cuda"), Worker(SHAPE, device="cuda")
    warm.warm(PROD)
    kw = {"steps": 14, "switches": PROD, "cond_tokens": 512, "seed": 11}  # a bucket: no padding
    a = _latents(monkeypatch, warm, **kw)
    b = _latents(monkeypatch, cold, **kw)
    assert len(a) == len(b) == 14
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        rel = ((x - y).norm() / y.norm()).item()
        assert rel < 2e-2, f"step {i}: warm replay differs from the eager/lazy session by {rel:.3g}"
        assert torch.isfinite(x).all()


def test_a_warm_session_replays_every_step_without_a_host_sync():
    w = Worker(SHAPE, device="cuda")
    w.warm(PROD)
    s = w.run_session(steps=12, realtime=False, switches=PROD, cond_tokens=300, sync_debug=True)
    assert s.warm and s.graphed_steps == 12 and s.graph_captures == 0 and s.graph_misses == 0


def test_memory_stays_flat_over_sessions_with_the_cyclic_collector_off():
    w = Worker(SHAPE, device="cuda")
    w.warm(PROD)
    rng = random.Random(3)
    allocated, reserved = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(30):
            w.run_session(steps=rng.randint(8, 20), realtime=False, switches=PROD,
                          cond_tokens=rng.randint(*SHAPE.cond_tokens))
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
            reserved.append(torch.cuda.memory_reserved())
    finally:
        gc.enable()
    grew = allocated[-1] - allocated[4]
    assert grew <= 4 << 20, f"allocated grew {grew / 2**20:.1f} MiB from session 5 to 30: {allocated}"
    assert reserved[-1] - reserved[4] <= 64 << 20, reserved
