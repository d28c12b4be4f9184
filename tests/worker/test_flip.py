"""A flip built off the critical path (worker/readiness.py): the session keeps playing its configuration while
the target is built on a thread, swaps at a step boundary, and the worker never re-warms between sessions.

The graph API is replaced by stand-ins (``cpu_graphs``, conftest.py): the build's captures run eagerly on
its thread, replays do nothing; the builder is held back by ``readiness.delay_s`` (a deliberately slow build).
"""

from __future__ import annotations

import torch

from worker.config import ModelShape, Switches
from worker.flips import FLIP_COST_STEPS, carry_cache
from worker.model import DiT
from worker.readiness import RUNTIME_SWITCHES, model_view, neighbour
from worker.session import Worker
from worker.switches import ScriptedFlip
from worker.telemetry import ListSink

PROD = {"ring_cache": True, "rope_at_write": True, "fp8_cache": True, "delta_rotation": True,
        "static_scales": True, "cuda_graphs": True}


def _worker(**kw) -> Worker:
    shape = ModelShape.from_name("tiny")
    return Worker(shape, device="cpu", model=DiT(shape, dtype=torch.bfloat16, fp8=True), **kw)


def test_a_slow_build_keeps_the_session_playing_and_swaps_at_a_step_boundary(cpu_graphs):
    w = _worker()
    w.warm(PROD)
    w.readiness.delay_s = 0.8  # about 5 chunks of 166.7 ms: the session plays on meanwhile
    flip = ScriptedFlip(w, {"delta_rotation": False})
    sink = ListSink()
    s = w.run_session(steps=400, switches=PROD, cond_tokens=6, sink=sink, switch_source=flip.poll,
                      stop_when=flip.stop)
    assert s.late_chunks == 0 and s.stall_ms == 0  # real time throughout: nothing waited on the build
    (ev,) = s.switch_events
    assert ev["polled_step"] == 3 and ev["step"] > 3 and ev["changed"] == {"delta_rotation": False}
    by_step = {r["step"]: r["switches"] for r in sink.rows["step"]}
    old, new = Switches.from_mapping(PROD).encode(), Switches.from_mapping({**PROD, "delta_rotation": False}).encode()
    assert all(by_step[i] == old for i in range(ev["step"])) and all(
        by_step[i] == new for i in range(ev["step"], s.steps))  # one boundary, no step in between
    assert s.graph_captures == 0  # the build captured on its thread, not the session
    (cost,) = [e["detail"] for e in sink.rows["event"] if e["kind"] == "flip_cost"]
    assert cost["mode"] == "background" and cost["late_chunks"] == 0 and cost["stall_ms"] == 0
    assert cost["step"] == 3 and cost["applied_step"] == ev["step"] and cost["to_new_config_ms"] >= 800
    assert cost["out_of_service_ms"] is not None and cost["error"] is None
    assert s.flips == [cost]
    # the worker kept the target (the swap's quick state, then the complete one built behind it): the next
    # session starts warm on it, nothing captured or re-warmed
    assert w.warmed.switches == Switches.from_mapping({**PROD, "delta_rotation": False})
    assert w.readiness.wait()
    made = cpu_graphs.made
    nxt = w.run_session(steps=8, realtime=False, switches={**PROD, "delta_rotation": False}, cond_tokens=11)
    assert nxt.warm and nxt.graph_captures == 0 and nxt.graph_misses == 0 and cpu_graphs.made == made
    assert w.warmed.complete


def test_a_session_on_a_quick_state_attaches_to_the_complete_one(cpu_graphs, monkeypatch):
    """The swap runs on the least it needs (its bucket's first forward and full-window step); the worker keeps
    that quick state while the complete one builds, and a session on another bucket starts on the last
    complete state (its graphs: nothing eager, no capture) and swaps the complete target in at a step
    boundary once it is ready."""
    import threading

    import worker.readiness

    release = threading.Event()
    full = worker.readiness.build_warm

    def held(*a, **k):  # the complete build waits for the test
        release.wait(60)
        return full(*a, **k)

    w = _worker()
    w.warm(PROD)
    monkeypatch.setattr(worker.readiness, "build_warm", held)
    flip = ScriptedFlip(w, {"delta_rotation": False}, after=2)
    s = w.run_session(steps=400, switches=PROD, cond_tokens=6, switch_source=flip.poll, stop_when=flip.stop)
    assert len(s.switch_events) == 1 and not w.warmed.complete and w.warmed.buckets == (8,)  # the quick state

    def source(step):
        if step == 2:
            release.set()
            assert w.readiness.wait()

    off = {**PROD, "delta_rotation": False}
    s = w.run_session(steps=6, realtime=False, switches=off, cond_tokens=11, switch_source=source)
    assert s.warm and s.graph_captures == 0 and s.graph_misses == 0
    (cost,) = s.flips
    assert cost["mode"] == "session_start" and cost["applied_step"] == 2 and w.warmed.complete
    assert cost["changed"] == {"delta_rotation": False} and s.switches == Switches.from_mapping(off).encode()
    assert w.previous is None  # the complete target replaced it


def test_a_flip_back_before_the_target_is_ready_applies_nothing(cpu_graphs):
    w = _worker()
    w.warm(PROD)
    w.readiness.delay_s = 0.5
    flips = {2: {"delta_rotation": False}, 3: {"delta_rotation": True}}
    s = w.run_session(steps=6, realtime=False, switches=PROD, cond_tokens=6, switch_source=flips.get)
    assert s.switch_events == [] and s.flips == [] and s.switches == Switches.from_mapping(PROD).encode()


def test_a_failed_build_falls_back_to_the_plain_path(cpu_graphs, monkeypatch):
    import worker.readiness

    def broken(*a, **k):
        raise RuntimeError("capture failed")

    w = _worker()
    w.warm(PROD)
    monkeypatch.setattr(worker.readiness, "build_warm", broken)
    monkeypatch.setattr(worker.readiness, "build_quick", broken)

    def source(step):  # the flip at step 2; at step 3 the (failed) build has ended
        if step == 3:
            w.readiness.wait()
        return {"delta_rotation": False} if step == 2 else None

    s = w.run_session(steps=6, realtime=False, switches=PROD, cond_tokens=6, switch_source=source)
    (cost,) = s.flips
    assert cost["mode"] == "inline" and "capture failed" in cost["error"] and cost["applied_step"] in (2, 3)  # the boundary that saw the failure
    assert s.switches == Switches.from_mapping({**PROD, "delta_rotation": False}).encode()


def test_carry_cache_moves_the_window_in_place():
    shape = ModelShape.from_name("tiny")
    sw = Switches.from_mapping(PROD)
    from worker.cache import make_cache, rebuild_cache

    src = make_cache(shape, sw, "cpu", torch.float32)
    model = DiT(shape, dtype=torch.float32)
    model.first_forward(torch.randn(6, shape.d_model), src)
    for _ in range(3):
        src.begin_step(shape.new_tokens)
        model.denoise_chunk(torch.randn(shape.new_tokens, shape.latent_channels), src, model.cross_kv(
            torch.randn(6, shape.d_model), src))
        src.end_step()
    other = sw.with_(delta_rotation=False)
    dst = make_cache(shape, other, "cpu", torch.float32)
    k0 = dst.k[0]
    carry_cache(src, dst)
    ref = rebuild_cache(src, other)
    assert dst.k[0] is k0  # the tensors its graphs read
    assert dst.book.n_valid == ref.book.n_valid and dst.book.next_pos == ref.book.next_pos
    assert torch.equal(dst.k[0], ref.k[0]) and torch.equal(dst.v[0], ref.v[0])


def test_a_model_view_shares_weights_and_owns_its_switch_state():
    shape = ModelShape.from_name("tiny")
    model = DiT(shape, dtype=torch.bfloat16, fp8=True)
    model.reset_act_scales()
    view = model_view(model)
    view.act_scales = "row"
    view.set_compile(False)
    assert view.blocks[0].qkv.w is model.blocks[0].qkv.w
    assert model.blocks[0].qkv.site is not None and view.blocks[0].qkv.site is None  # the live one untouched
    assert model.act_scales == "static"


def test_neighbours_are_prepared_at_warm_time_and_hold_no_cache(cpu_graphs):
    w = _worker()
    w.warm(PROD, neighbours=RUNTIME_SWITCHES)
    # ring_cache off alone is invalid under delta_rotation: its neighbour turns delta_rotation off with it
    assert w.readiness.skipped == {}
    assert neighbour(Switches.from_mapping(PROD), "ring_cache") == Switches.from_mapping(
        {**PROD, "ring_cache": False, "delta_rotation": False})
    assert len(w.readiness.prepared) == len(RUNTIME_SWITCHES)
    assert w.warmed.switches == Switches.from_mapping(PROD)
    assert FLIP_COST_STEPS > 0


def test_flip_costs_reach_the_workers_metrics(cpu_graphs):
    from prometheus_client import generate_latest

    from worker.metrics import WorkerMetrics

    w = _worker(flip="inline")
    m = WorkerMetrics(w)
    w.warm(PROD)
    w.run_session(steps=6, realtime=False, switches=PROD, cond_tokens=6, switch_source={2: {"compile": True}}.get)
    text = generate_latest(m.registry).decode()
    assert 'livestep_worker_flips_total{mode="inline"} 1.0' in text
    assert "livestep_worker_out_of_service_seconds_total" in text and "livestep_worker_flip_building 0.0" in text


def test_a_newer_flip_supersedes_the_running_build(cpu_graphs):
    """Flipped off, then on again before the off target is ready: the off build stops at its next step and the
    build of the newest target starts at once (a flip back never waits for a stale target's build)."""
    import threading

    w = _worker()
    w.warm(PROD)
    gate = threading.Event()

    def pace(step):  # the builds advance when the test lets them
        gate.wait(60)

    w.readiness.pace = pace
    off = Switches.from_mapping({**PROD, "delta_rotation": False})
    w.readiness.request(off, first=8)
    w.readiness.request(Switches.from_mapping({**PROD, "fp8_cache": False}), first=8)
    gate.set()
    assert w.readiness.wait()
    done = w.readiness.builds
    assert [b["switches"] for b in done] == [off.encode(), Switches.from_mapping({**PROD, "fp8_cache": False}).encode()]
    assert "superseded" in done[0]["error"] and done[1]["error"] is None


def test_a_flip_while_attached_at_start_is_its_own_flip(cpu_graphs, monkeypatch):
    """A session that starts on switches still building (attached) and is flipped by the control plane: the
    control plane's flip is the one recorded, polled at its step, built and swapped in."""
    import threading

    import worker.readiness

    release = threading.Event()
    quick = worker.readiness.build_quick

    w = _worker()
    w.warm(PROD)
    off = {**PROD, "delta_rotation": False}
    monkeypatch.setattr(worker.readiness, "build_quick", lambda *a, **k: (release.wait(60), quick(*a, **k))[1])  # held

    def source(step):
        if step == 2:
            return {"fp8_cache": False}
        if step == 3:
            release.set()
            assert w.readiness.wait()
        return None

    s = w.run_session(steps=6, realtime=False, switches=off, cond_tokens=6, switch_source=source)
    costs = [c for c in s.flips if c["step"] >= 0]  # it ran PROD (warm) until the swap: both changed then
    assert len(costs) == 1 and costs[0]["step"] == 2
    assert costs[0]["changed"] == {"delta_rotation": False, "fp8_cache": False}
    assert costs[0]["applied_step"] == 3 and s.switches == Switches.from_mapping({**off, "fp8_cache": False}).encode()


def test_a_build_compiles_nothing_inside_a_capture(cpu_graphs, monkeypatch):
    """A flip's build of a configuration whose compiled functions never ran at the shapes and variants it
    captures (no neighbour preparation) compiles them in its eager warm-ups, never inside a capture (on
    the H200 inductor's first-call autotune there invalidated the capture): ``CompileInCapture`` would
    fail the build."""
    import torch._dynamo
    import torch._dynamo.callback

    import worker.graphs
    import worker.model
    from worker.fp8 import SaturationProbe
    from worker.readiness import build_quick, build_warm

    compiles: list[bool] = []  # per compile: inside a capture?

    def seen(_args):
        compiles.append(worker.graphs.capturing())

    monkeypatch.setattr(worker.model, "COMPILE_ON_CPU", True)
    torch._dynamo.reset()
    torch._dynamo.callback.callback_handler.register_start_callback(seen)
    try:
        w = _worker()
        base = {**PROD, "compile": True}
        w.warm(base)
        target = neighbour(Switches.from_mapping(base), "static_scales")
        n0 = len(compiles)
        q = build_quick(w, target, 6, model=model_view(w.model), probe=SaturationProbe(w.device))
        full = build_warm(w, target, w.cond_buckets, model=model_view(w.model), probe=SaturationProbe(w.device),
                          first=6, reset_run=False, graph_mode="thread_local")
    finally:
        torch._dynamo.callback.callback_handler.start_callbacks.remove(seen)
    assert len(compiles) > n0  # the build did compile (its target's variants were new) ...
    assert not any(compiles)  # ... and never inside a capture
    for state in (q, full):  # every capture had its warm-up first
        assert state.runner.captures > 0 and state.runner.warmups >= state.runner.captures


def test_nothing_compiles_inside_a_capture_its_compiled_functions_run_eagerly(cpu_graphs):
    """Inside a capture a compiled function whose guards fail (a shape its warm-up did not see), or one never
    compiled, runs its ops eagerly with the same result instead of compiling (inductor's first call would
    break the capture); outside, compiling is back."""
    import torch._dynamo

    import worker.graphs

    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2 + 1, dynamic=False)
    never = torch.compile(lambda x: x - 1, dynamic=False)
    double(torch.ones(3))  # the warm-up: compiled for [3]
    runner = object.__new__(worker.graphs.ChunkRunner)
    runner.graph_mode = "thread_local"
    compiles: list[bool] = []

    def seen(_args):
        compiles.append(worker.graphs.capturing())

    torch._dynamo.callback.callback_handler.register_start_callback(seen)
    try:
        with runner._capturing(cpu_graphs(), None):
            a, b = double(torch.ones(5)), never(torch.ones(3))
        assert torch.equal(a, torch.full((5,), 3.0)) and torch.equal(b, torch.zeros(3)) and not compiles
        never(torch.ones(3))
        assert compiles == [False]  # outside a capture it compiles
    finally:
        torch._dynamo.callback.callback_handler.start_callbacks.remove(seen)
