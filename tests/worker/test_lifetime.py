"""What a long-lived worker process accumulates: nothing a finished session held may outlive it.

A session's tensors must be freed by reference counting when the session ends. Anything kept alive
only by a reference cycle waits for Python's cyclic collector, which on a GPU worker means the KV
ring, graphs and buffers of every finished session (issue 21: +1.2 GB a session on the H200). These
tests run with the collector disabled and look at what only it could free.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from worker.session import Session, Worker

PROD_LIKE = ["ring_cache=on", "rope_at_write=on", "fp8_cache=on", "delta_rotation=on", "static_scales=on"]


def _ours(o) -> bool:
    mod = getattr(type(o), "__module__", "") or ""
    return isinstance(o, torch.Tensor) or mod.split(".")[0] in ("worker", "collector", "kernels")


def _cyclic_garbage(run) -> list[str]:
    """Type names of our objects (and tensors) that only the cyclic collector would free after ``run``."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = sorted({type(o).__qualname__ for o in gc.garbage if _ours(o)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
    return found


@pytest.mark.parametrize("switches", [[], PROD_LIKE], ids=["plain", "prod-like"])
def test_a_finished_session_leaves_nothing_to_the_cyclic_collector(switches):
    w = Worker("tiny", device="cpu")
    w.run_session(steps=3, realtime=False, switches=switches)  # warm: process-wide caches are not leaks

    def sessions():
        for _ in range(3):
            w.run_session(steps=12, realtime=False, switches=switches, cond_tokens=None)

    assert _cyclic_garbage(sessions) == []


def test_a_session_with_a_switch_flip_and_a_down_collector_leaves_no_cycle():
    """The paths a plain run does not take: a cache rebuilt mid-session, the real shipping client (its
    sender thread) against a port nobody listens on, a probe on every step."""
    w = Worker("tiny", device="cpu")
    flips = {4: {"ring_cache": True, "rope_at_write": True, "delta_rotation": True}}

    def session():
        w.run_session(steps=10, realtime=False, switches=["static_scales=on"], switch_source=flips.get,
                      collector_url="http://127.0.0.1:9", client_kwargs={"timeout_s": 0.2},
                      saturation_every=1)

    assert _cyclic_garbage(session) == []


def test_a_finished_session_is_freed_by_reference_counting_alone():
    w = Worker("tiny", device="cpu")
    gc.disable()
    try:
        s = Session(w, steps=8, realtime=False)
        s.run()
        refs = [weakref.ref(x) for x in (s, s.cache, s.tel, s.playout)]  # the decoder is the worker's
        del s
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()
