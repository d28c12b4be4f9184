"""A warm worker: every graph captured once at warm-up, sessions only replay (CPU bookkeeping).

The graph API is replaced by stand-ins (``cpu_graphs`` in conftest.py): captures run the forward
eagerly, replays do nothing, so these tests check which graphs exist, when they are captured and
that host-side state (calibration counters, cache scales' flags) follows replays; test_gpu.py checks
on the H200 that replays compute what eager steps do.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from worker.config import ModelShape, ShapeError, Switches
from worker.model import DiT
from worker.session import Worker, cond_buckets_of
from worker.telemetry import ListSink

PROD = {"ring_cache": True, "rope_at_write": True, "fp8_cache": True, "delta_rotation": True,
        "static_scales": True, "cuda_graphs": True}


def _worker(**kw) -> Worker:
    shape = ModelShape.from_name("tiny")
    return Worker(shape, device="cpu", model=DiT(shape, dtype=torch.bfloat16, fp8=True), **kw)


def test_buckets_are_powers_of_two_up_to_the_longest_prompt():
    assert cond_buckets_of(ModelShape.from_name("prod57b")) == (256, 512, 1024, 2048)
    assert cond_buckets_of(ModelShape.from_name("tiny")) == (4, 8, 16)
    with pytest.raises(ShapeError, match="must end at the shape's longest conditioning, 16"):
        _worker(cond_buckets=(4, 8))


def test_warm_up_captures_each_graph_once_and_sessions_only_replay(cpu_graphs):
    w = _worker()
    shape = w.shape
    warm = w.warm(PROD)
    W, T = shape.window, shape.new_tokens
    # per bucket: its first forward, a graph per window size until full (the first chunk calibrating),
    # the full window probed
    expected = sum(1 + math.ceil((W - b) / T) + 1 for b in w.cond_buckets)
    assert warm.runner.n_graphs == expected == cpu_graphs.made
    assert warm.runner.capture == "never"
    rng = random.Random(5)
    for _ in range(6):
        made = cpu_graphs.made
        sink = ListSink()
        L = rng.randint(*shape.cond_tokens)
        s = w.run_session(steps=2 * w.shape.reset_every + 3, realtime=False, switches=PROD, cond_tokens=L,
                          sink=sink, saturation_every=4)
        assert s.warm and s.graph_captures == 0 and s.graph_misses == 0 and cpu_graphs.made == made
        assert s.graphed_steps == s.steps  # the first chunk too: calibrating, from its own graph
        assert s.cond_tokens == L and s.first_forward_tokens == w.bucket(L) >= L
        assert s.probed_steps == len(range(4, s.steps, 4)) and s.resets == 2
        assert not w.model.calibrating  # the replays advanced the counters as eager steps would
        assert w.warmed.cache.calibrated == [True] * shape.n_blocks
        end = next(r for r in sink.rows["session"] if r["phase"] == "end")
        assert end["first_forward_tokens"] == w.bucket(L)


def test_a_session_starts_from_an_empty_window_and_fresh_calibration(cpu_graphs):
    w = _worker()
    w.warm(PROD)
    cache, runner = w.warmed.cache, w.warmed.runner
    w.run_session(steps=9, realtime=False, switches=PROD, cond_tokens=5)
    assert cache.book.n_valid == w.shape.window and not w.model.calibrating
    sites = [lin.site for lin in w.model._linears()]
    seen = []
    first_forward = runner.first_forward

    def spy(cond, c):
        seen.append((c is cache, c.book.n_valid, c.book.next_pos, list(c.calibrated),
                     [s.left for s in sites], [float(s.scale) for s in sites]))
        return first_forward(cond, c)

    runner.first_forward = spy
    w.run_session(steps=3, realtime=False, switches=PROD, cond_tokens=7)
    same, n_valid, next_pos, calibrated, left, scales = seen[0]
    assert same and n_valid == 0 and next_pos == 0 and not any(calibrated)
    assert set(left) == {1 + w.shape.passes} and set(scales) == {0.0}


def test_other_switches_are_built_in_the_background_and_the_next_session_starts_warm(cpu_graphs):
    """A session on switches the worker is not warm for (a control-plane change at its start) starts on the
    worker's warm state (its graphs: nothing eager) while theirs is built on a thread, to be swapped in once
    built; the worker never re-warms in between (no blocking warm()), and the next session starts on the
    built state."""
    w = _worker()
    w.warm(PROD)
    w.readiness.delay_s = 0.3  # the build still runs when the session ends
    other = {**PROD, "delta_rotation": False}
    s = w.run_session(steps=8, realtime=False, switches=other, cond_tokens=6)
    assert s.warm and s.graph_captures == 0 and s.graph_misses == 0  # PROD's graphs meanwhile
    (cost,) = s.flips
    assert cost["mode"] == "session_start" and cost["applied_step"] is None  # still building at its end
    assert w.warmed.switches == Switches.from_mapping(PROD)  # nothing re-warmed after the session
    assert w.readiness.wait()
    s = w.run_session(steps=8, realtime=False, switches=other, cond_tokens=6)
    assert s.warm and s.graph_captures == 0 and s.graph_misses == 0
    assert w.warmed.switches == Switches.from_mapping(other) and w.warmed.runner.capture == "never"


def test_the_inline_path_rebuilds_in_the_loop_and_rewarms_after_the_session(cpu_graphs):
    """``flip="inline"``, the plain path kept: the session runs unwarmed and the worker re-warms for the
    switches it ended on before the next one."""
    w = _worker(flip="inline")
    w.warm(PROD)
    other = {**PROD, "delta_rotation": False}
    s = w.run_session(steps=8, realtime=False, switches=other, cond_tokens=6)
    assert not s.warm and s.first_forward_tokens == 6
    assert w.warmed.switches == Switches.from_mapping(other) and w.warmed.runner.capture == "never"
    made = cpu_graphs.made
    s = w.run_session(steps=8, realtime=False, switches=other, cond_tokens=6,
                      switch_source={3: {"delta_rotation": True}}.get)
    assert s.warm and len(s.switch_events) == 1 and s.switch_events[0]["step"] == 3  # rebuilt in the loop
    assert [f["mode"] for f in s.flips] == ["inline"]
    assert w.warmed.switches == Switches.from_mapping(PROD) and cpu_graphs.made > made
    s = w.run_session(steps=8, realtime=False, switches=PROD, cond_tokens=6)
    assert s.warm and s.graph_captures == 0


def test_an_unwarmed_worker_captures_per_session_once_the_window_is_full(cpu_graphs):
    w = _worker()
    s = w.run_session(steps=10, realtime=False, switches=PROD, cond_tokens=6)
    assert not s.warm and s.graph_captures == 2 and 0 < s.graphed_steps < s.steps  # plain + probed


@pytest.mark.parametrize("preroll", [0, 5])
def test_preroll_is_bounded_by_the_playout_buffer(preroll):
    with pytest.raises(ValueError, match=r"valid: 1\.\.4 chunks"):
        _worker().run_session(steps=2, realtime=False, preroll=preroll)


def test_time_to_first_frame_is_reported_after_the_preroll():
    w = _worker()
    one = w.run_session(steps=6, preroll=1, chunk_period_s=0.05)
    three = w.run_session(steps=6, preroll=3, chunk_period_s=0.05)
    assert one.preroll == 1 and three.preroll == 3
    assert 0 < one.ttff_ms < one.wall_s * 1e3 and 0 < three.ttff_ms < three.wall_s * 1e3
    never = w.run_session(steps=2, preroll=3, chunk_period_s=0.05)  # fewer chunks than the pre-roll
    assert never.ttff_ms is None


def test_a_turn_on_a_warm_worker_keeps_replaying_its_buckets_graphs(cpu_graphs):
    """A turn's new cross K/V (another length) is padded to its bucket and copied into the windows that
    bucket's graphs read: the steps after it replay, nothing is captured, nothing runs eagerly."""
    from worker.turns import TurnInbox

    w = _worker()
    w.warm(PROD)
    made = cpu_graphs.made
    inbox = TurnInbox()

    def turn_at_step_6(step):  # polled before each step's boundary: the window is full by then
        if step == 6:
            inbox.submit(tokens=11)  # bucket 16; the prompt's is 4

    s = w.run_session(steps=10, realtime=False, switches=PROD, cond_tokens=3, turns=inbox,
                      switch_source=turn_at_step_6)
    assert s.turns == 1 and s.warm and s.graph_misses == 0 and s.graphed_steps == 10
    assert cpu_graphs.made == made and len(w.registry) == 0
    # a turn while the window still fills: that bucket's graphs know other window sizes, so the rest
    # of the fill runs eagerly (counted), then the full window replays again
    inbox.submit(tokens=11)
    s = w.run_session(steps=10, realtime=False, switches=PROD, cond_tokens=3, turns=inbox)
    assert s.turns == 1 and 0 < s.graph_misses < 10 - 3 and s.graphed_steps == 10 - s.graph_misses


def test_warm_up_runs_a_position_reset_and_sessions_share_the_workers_decoder(cpu_graphs, monkeypatch):
    """What compiles or allocates on first use happens at warm-up, and what a session needs that outlives
    no session is made once: a reset's ops (the first reset step of a worker's life took 980 ms on the
    H200: a Triton JIT), and the decoder with its stream (one per session grew reserved memory)."""
    from worker.cache import KVCache
    from worker.session import Session

    resets = []
    reset = KVCache._reset_window
    monkeypatch.setattr(KVCache, "_reset_window", lambda self, n: resets.append(n) or reset(self, n))
    w = _worker()
    w.warm(PROD)
    assert resets, "warm-up never ran a position reset"
    a, b = (Session(w, steps=3, realtime=False, switches=PROD) for _ in range(2))
    a.run()
    b.run()
    assert a.decoder is b.decoder is w.decoder(False)


def test_the_cli_warms_the_worker_once_and_passes_the_preroll(capsys):
    from api.cli import main

    assert main(["worker", "run", "--preset", "tiny", "--device", "cpu", "--steps", "4", "--sessions", "2",
                 "--no-realtime", "--preroll", "3", "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("warm: 0 CUDA graphs for prompt buckets [4, 8, 16]")  # CPU: one cache, no graphs
    import json

    sessions = [json.loads(line) for line in out[1:]]
    assert [s["preroll"] for s in sessions] == [3, 3] and all(s["warm"] for s in sessions)


def test_a_sessions_graph_counts_are_its_own(cpu_graphs):
    """graph_captures / graph_misses count this session's work on every runner it used: not the warm
    runner's lifetime totals, and not only the runner it ended with."""
    from worker.turns import TurnInbox

    w = _worker(flip="inline")  # the flip below rebuilds in the loop (background builds: tests/worker/test_flip.py)
    w.warm(PROD)
    inbox = TurnInbox()
    inbox.submit(tokens=11)  # during the fill: that bucket's graphs lack these window sizes -> misses
    first = w.run_session(steps=10, realtime=False, switches=PROD, cond_tokens=3, turns=inbox)
    assert first.graph_misses > 0
    again = w.run_session(steps=10, realtime=False, switches=PROD, cond_tokens=3)
    assert again.graph_misses == 0 and again.graph_captures == 0
    # a flip rebuilds the cache: the session's own runner captures, and those captures are this session's
    flipped = w.run_session(steps=12, realtime=False, switches=PROD, cond_tokens=3,
                            switch_source={2: {"delta_rotation": False}}.get)
    assert flipped.graph_captures == 2  # plain + probed, once the rebuilt window is full
