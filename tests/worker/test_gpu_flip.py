"""On a CUDA GPU (marker gpu): a flip built in the background swaps in at a step boundary and the session goes on
replaying the target's graphs; no capture in the loop; the next session starts warm on the target.

Run on the H200: ``python -m pytest -q -m gpu tests/worker/test_gpu_flip.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.conftest import spy_on_decoder
from worker.config import ModelShape, Switches
from worker.session import Worker
from worker.streams import own_stream

pytestmark = pytest.mark.gpu

PROD = Switches.all_on(fused_allreduce=False)
SHAPE = ModelShape.from_name("small", n_blocks=2, window=2400, cond_tokens=(256, 600))


@pytest.mark.parametrize("switch", ["static_scales", "fp8_cache", "cuda_graphs", "triton_kernels"])
def test_a_background_flip_swaps_at_a_boundary_and_replays_the_targets_graphs(monkeypatch, switch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the H200: see docs/PERFORMANCE.md)")
    w = Worker(SHAPE, device="cuda")
    w.warm(PROD, neighbours=(switch,))
    seen = spy_on_decoder(monkeypatch)

    def source(step):  # the flip at step 5; at step 6's poll the build has ended: the swap is at step 6
        if step == 6:
            assert w.readiness.wait(600)
        return {switch: False} if step == 5 else None

    s = w.run_session(steps=16, realtime=False, switches=PROD, cond_tokens=300, switch_source=source)
    (ev,) = s.switch_events
    assert ev["step"] == 6 and ev["polled_step"] == 5
    assert s.graph_captures == 0 and all(torch.isfinite(x).all() for x in seen)
    if switch != "cuda_graphs":
        assert s.graph_misses == 0 and s.graphed_steps == s.steps  # the target's graphs from the swap on
    (cost,) = s.flips
    assert cost["mode"] == "background" and cost["error"] is None and cost["applied_step"] == 6
    off = PROD.with_(**{switch: False})
    assert w.warmed.switches.model_switches() == off.model_switches()
    nxt = w.run_session(steps=8, realtime=False, switches=off, cond_tokens=500)
    assert nxt.warm and nxt.graph_captures == 0 and (switch == "cuda_graphs" or nxt.graph_misses == 0)


def test_a_build_captures_beside_a_live_session_that_keeps_stepping(monkeypatch):
    """The H200 failure of 2026-12-02 08:41: the live session steps (not waiting for the build) while the
    build thread captures; the flip lands, nothing fails in either thread, every chunk is finite."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the H200: see docs/PERFORMANCE.md)")
    w = Worker(SHAPE, device="cuda")
    w.warm(PROD, neighbours=("static_scales",))
    model0, swapped = w.model, []
    # every chunk finite: a device sync on the live thread, mid-capture
    seen = spy_on_decoder(monkeypatch, lambda latents: bool(torch.isfinite(latents).all()))

    def stop():
        if not swapped and w.model is not model0:
            swapped.append(len(seen))
        return bool(swapped) and len(seen) >= swapped[0] + 20

    s = w.run_session(steps=100_000, realtime=False, switches=PROD, cond_tokens=300,
                      switch_source=lambda step: {"static_scales": False} if step == 3 else None, stop_when=stop)
    (cost,) = s.flips
    assert cost["error"] is None and cost["mode"] == "background" and cost["applied_step"] is not None
    assert s.graph_captures == 0 and all(seen) and len(seen) >= cost["applied_step"] + 20


def test_our_streams_are_never_handed_out_by_the_pool():
    """A build's capture stream and a decoder's stream are their owner's alone: 100 pool streams later
    (the pool has 32) none of them is either."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w = Worker(SHAPE, device="cuda")
    ours = {w.readiness.stream().cuda_stream, own_stream("cuda").cuda_stream}
    pool = {torch.cuda.Stream().cuda_stream for _ in range(100)}
    assert len(ours) == 2 and not ours & pool
