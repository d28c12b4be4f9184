"""Conversational turns on the tiny model: applied at a step boundary, records that agree with the
player's log, each playout policy's buffer behaviour, and no buffer registry growth."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from worker.cache import make_cache
from worker.config import Switches
from worker.playout import Playout
from worker.session import ChunkRunner, Session, Worker
from worker.telemetry import ListSink
from worker.turns import POLICIES, TurnError, TurnInbox, TurnPlayer, TurnSchedule, check_policy, conversation

P = 1 / 6  # the chunk period


def _deliver(player, times):
    return [player.deliver(i, t) for i, t in enumerate(times)]


# -- the player, on literal delivery times ---------------------------------------------------------


def test_turn_player_without_drops_is_the_plain_playout():
    rng = random.Random(4)
    times, t = [], 0.0
    for _ in range(60):
        t += rng.uniform(0.02, 0.4)  # some chunks early, many late
        times.append(t)
    a, b = Playout(P, capacity=4), TurnPlayer(P, capacity=4)
    assert _deliver(a, times) == _deliver(b, times)
    assert (a.late_chunks, a.stall_s) == (b.late_chunks, b.stall_s) and a.late_chunks > 0
    for i in range(60):
        assert a.room(i, times[i] - 0.05) == b.room(i, times[i] - 0.05)
        assert a.wait_s(i, times[i] - 0.05) == b.wait_s(i, times[i] - 0.05)
    # the log: playback in order, a period apart unless the chunk was late
    log = b.log
    for prev, e in itertools.pairwise(log):
        assert e.played >= prev.played + P - 1e-9 and e.played >= e.arrived
        assert e.late == (e.played - prev.played > P + 1e-9)


def _full_buffer():
    """Chunks 0..5 delivered at t = 0, 0.01, ..., 0.05: playback from 0.01 (prebuffer 2), one chunk
    playing and 4 buffered (the capacity) at t = 0.1."""
    pl = TurnPlayer(P, capacity=4)
    _deliver(pl, [0.01 * i for i in range(6)])
    assert pl.buffered(0.1) == 5 and pl.started(0.1, 6) == 1
    return pl


def test_keep_plays_the_old_chunks_first():
    pl = _full_buffer()
    assert pl.apply_policy("keep", 0.1, first_new=6, cover_s=0.05) == 0
    late, _ = pl.deliver(6, 0.11)
    assert not late and pl.entry(6).played == pytest.approx(0.01 + 6 * P)  # behind all six


def test_drop_unplayed_drops_every_old_chunk_not_started_and_the_gap_is_the_wait_for_the_new_one():
    pl = _full_buffer()
    assert pl.apply_policy("drop_unplayed", 0.1, first_new=7, cover_s=0.0) == 6  # 1-5 buffered, 6 in flight
    assert [e.dropped for e in pl.log] == [False] + [True] * 5 and pl.buffered(0.1) == 0
    pl.deliver(6, 0.15)  # the old chunk in flight: dropped on arrival, never played
    assert pl.entry(6).dropped and pl.entry(6).played is None
    late, depth = pl.deliver(7, 0.25)  # the new chunk, after chunk 0 ended (0.01 + P = 0.177)
    assert late and pl.entry(7).played == 0.25 and depth == 0
    assert pl.stall_s == pytest.approx(0.25 - (0.01 + P))  # the gap, counted as a stall
    pl.deliver(8, 0.26)
    assert pl.entry(8).played == pytest.approx(0.25 + P)  # then one a period again


def test_drop_unplayed_without_a_gap_when_the_new_chunk_is_in_before_the_old_one_ends():
    pl = _full_buffer()
    pl.apply_policy("drop_unplayed", 0.1, first_new=6, cover_s=0.0)
    late, _ = pl.deliver(6, 0.12)
    assert not late and pl.entry(6).played == pytest.approx(0.01 + P) and pl.stall_s == 0


@pytest.mark.parametrize(("cover_s", "kept"), [(0.0, 0), (0.1, 1), (0.3, 2), (5.0, 5)])
def test_trim_keeps_the_old_chunks_that_cover_the_expected_wait(cover_s, kept):
    pl = _full_buffer()  # chunk 0 ends at 0.177; at t = 0.1 it has 0.077 s left
    assert pl.apply_policy("trim", 0.1, first_new=6, cover_s=cover_s) == 5 - kept
    assert [e.dropped for e in pl.log[1:]] == [False] * kept + [True] * (5 - kept)
    late, _ = pl.deliver(6, 0.1 + cover_s)
    assert pl.entry(6).played == pytest.approx(max(0.01 + (1 + kept) * P, 0.1 + cover_s))
    assert not late or kept == 5  # kept enough: no stall while the estimate holds


def test_a_drop_frees_room_for_the_producer():
    pl = _full_buffer()
    assert not pl.room(6, 0.1) and pl.wait_s(6, 0.1) > 0
    pl.apply_policy("drop_unplayed", 0.1, first_new=6, cover_s=0.0)
    assert pl.room(6, 0.1) and pl.wait_s(6, 0.1) == 0.0


def test_unknown_policy_names_the_valid_ones():
    with pytest.raises(TurnError, match="valid policies: keep, drop_unplayed, trim"):
        check_policy("skip")
    with pytest.raises(TurnError, match="valid policies"):
        Session(Worker("tiny"), steps=2, playout_policy="skip")


def test_inbox_refuses_a_turn_without_conditioning():
    with pytest.raises(TurnError, match="valid: >= 1"):
        TurnInbox().submit(tokens=0)


def test_conversation_alternates_speaking_and_listening_every_few_seconds():
    turns = conversation(60, random.Random(0), every_s=(2, 5), tokens=(4, 16))
    assert 12 <= len(turns) <= 30
    assert [sp for _, _, sp in turns] == [i % 2 == 0 for i in range(len(turns))]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(turns)]
    assert all(2 <= g <= 5 for g in gaps) and all(4 <= n <= 16 for _, n, _ in turns)


# -- live sessions ---------------------------------------------------------------------------------


class _Outputs:
    """Records every chunk's latents and the cross K/V it read (a spy on the model's entry point)."""

    def __init__(self, model):
        self.latents, self.cond = [], []
        self._f = model.denoise_chunk
        model.denoise_chunk = self

    def __call__(self, noise, cache, cond_kv):
        out = self._f(noise, cache, cond_kv)
        self.latents.append(out.clone())
        self.cond.append(cond_kv[0].k.shape[1])
        return out


def _session(policy="keep", turns=((0.6, 7, True), (1.4, 12, False)), seconds=5.0, worker=None, **kw):
    w = worker or Worker("tiny")
    sink = ListSink()
    s = Session(w, seconds=seconds, sink=sink, seed=5, cond_tokens=5, turns=TurnSchedule(list(turns)),
                playout_policy=policy, **kw)
    return s, s.run(), sink


def test_a_turn_applies_at_a_step_boundary_and_its_record_agrees_with_the_players_log():
    w = Worker("tiny")
    spy = _Outputs(w.model)
    s, summary, sink = _session(worker=w)
    rows = sink.rows["turn"]
    assert summary.turns == 2 and [r["turn"] for r in rows] == [0, 1]
    assert [r["cond_tokens"] for r in rows] == [7, 12] and [r["speaking"] for r in rows] == [True, False]
    k0, k1 = rows[0]["step"], rows[1]["step"]
    # every chunk before the turn's step read the old conditioning, every one from it on the new one
    assert spy.cond == [5] * k0 + [7] * (k1 - k0) + [12] * (len(spy.cond) - k1)
    steps = {r["step"]: r for r in sink.rows["step"]}
    for r in rows:
        e = s.playout.entry(r["step"])
        # ordered: arrival <= the previous chunk's delivery or later; generated <= played
        assert r["ts"] <= r["generated_at"] <= r["played_at"]
        assert steps[r["step"] - 1]["ts"] <= r["generated_at"]
        # the player's log: the first chunk that uses the turn, delivered and played at these times
        assert r["generated_at"] == s.tel.now_dt(e.arrived) and r["played_at"] == s.tel.now_dt(e.played)
        assert steps[r["step"]]["ts"] == r["generated_at"]
        parts = r["wait_ms"] + r["recompute_ms"] + r["generation_ms"] + r["queue_ms"]
        assert parts == pytest.approx(r["latency_ms"], abs=1e-6)
        assert r["latency_ms"] == pytest.approx((r["played_at"] - r["ts"]).total_seconds() * 1e3, abs=0.01)
        assert min(r["wait_ms"], r["recompute_ms"], r["generation_ms"], r["queue_ms"]) >= 0
        assert r["policy"] == "keep" and r["dropped_chunks"] == 0 and r["superseded"] == 0


def test_the_same_noise_gives_the_same_chunks_until_the_turn():
    """The turn changes nothing before its step (same noise, same chunks) and every chunk from it on."""
    w = Worker("tiny")
    spy = _Outputs(w.model)
    _, _, sink = _session(worker=w, turns=((0.8, 9, True),))
    k = sink.rows["turn"][0]["step"]
    with_turn = list(spy.latents)
    spy.latents.clear()
    Session(w, steps=len(with_turn), sink=ListSink(), seed=5, cond_tokens=5, realtime=False).run()
    assert all(torch.equal(a, b) for a, b in zip(with_turn[:k], spy.latents[:k], strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(with_turn[k:], spy.latents[k:], strict=True))


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_in_a_session(policy):
    s, summary, sink = _session(policy)
    rows = sink.rows["turn"]
    assert len(rows) == 2 and all(r["policy"] == policy for r in rows)
    dropped = sum(e.dropped for e in s.playout.log)
    assert dropped == sum(r["dropped_chunks"] for r in rows) == s.playout.dropped_chunks
    for r in rows:
        assert r["queue_depth"] >= 3  # real time: the tiny model keeps the buffer full
        if policy == "keep":  # behind the whole buffer: at least the chunks buffered at arrival
            assert r["dropped_chunks"] == 0 and r["latency_ms"] >= (r["queue_depth"] - 1) * P * 1e3
        elif policy == "drop_unplayed":  # every old chunk not started: at most what is left of one
            assert r["dropped_chunks"] >= r["queue_depth"] and r["latency_ms"] <= P * 1e3 + 50
        else:  # trim / cover keep the old chunks that cover their estimate of the wait and drop the rest:
            # how many depends on the step times measured (exact counts: the fake-clock tests), but never
            # more than drop_unplayed drops, and the first new chunk never plays later than under keep
            assert 0 <= r["dropped_chunks"] <= r["queue_depth"] + s.max_in_flight
            kept = r["queue_depth"] + s.max_in_flight - r["dropped_chunks"]
            assert r["latency_ms"] <= (kept + 2) * P * 1e3 + 50
    assert summary.steps == len(s.playout.log)
    if policy != "drop_unplayed":
        assert summary.late_chunks == 0


class _OnePerBoundary(TurnInbox):
    """Hands the session one waiting turn per step boundary (four turns: four recomputes)."""

    def take(self, now):
        with self._lock:
            return [self._q.popleft()] if self._q else []


def test_a_turn_never_adds_a_buffer_registry_entry():
    """The cross K/V recompute has no row-parallel output: with the fused path on, and even with the
    fault switch that keeps a buffer per first-forward shape, turns of new lengths add nothing."""
    for switches in (["fused_allreduce=on"], ["fused_allreduce=on", "buffer_per_shape=on"]):
        w = Worker("tiny")
        w.run_session(steps=3, realtime=False, cond_tokens=5, switches=switches)
        before = dict(w.registry.entries)
        inbox = _OnePerBoundary()
        sink = ListSink()
        sess = Session(w, steps=12, realtime=False, cond_tokens=5, switches=switches, sink=sink, turns=inbox)
        for n in (3, 8, 13, 16):
            inbox.submit(tokens=n)
        sess.run()
        assert sess.turns.applied == 4
        assert w.registry.entries.keys() == before.keys()  # not one new key
        assert {r["buffers_registered"] for r in sink.rows["step"]} == {len(before)}


def test_turns_arriving_within_one_step_are_coalesced():
    inbox = TurnInbox()
    s = Session(Worker("tiny"), steps=8, realtime=False, sink=ListSink(), turns=inbox)
    for n in (4, 6, 9):
        inbox.submit(tokens=n)
    s.run()
    (row,) = s.sink.rows["turn"]
    assert row["cond_tokens"] == 9 and row["superseded"] == 2 and row["step"] == 0


def test_a_turn_with_bad_conditioning_is_refused_with_the_valid_shape():
    inbox = TurnInbox()
    inbox.submit(cond=torch.randn(5, 3))
    with pytest.raises(TurnError, match=r"valid: \[tokens, 64\]"):
        Session(Worker("tiny"), steps=3, realtime=False, sink=ListSink(), turns=inbox).run()


def test_a_session_without_turns_keeps_the_plain_player():
    s = Session(Worker("tiny"), steps=3, realtime=False, sink=ListSink())
    assert type(s.playout) is Playout and s.turns is None


# -- CUDA graphs: a turn's new windows are recaptured, never replayed stale -----------------------


def test_graphs_are_recaptured_for_a_turns_cross_attention_windows(cpu_graphs):
    w = Worker("tiny")
    model, shape = w.model, w.shape
    cache = make_cache(shape, Switches(ring_cache=True, rope_at_write=True), "cpu", model.dtype)
    runner = ChunkRunner(model, use_graphs=True)  # CPU: the bookkeeping only (cpu_graphs, conftest.py)
    g = torch.Generator().manual_seed(0)
    ckv = model.first_forward(torch.randn(6, shape.d_model, generator=g), cache)
    made = []
    for i in range(10):
        if i == 6:
            ckv = model.cross_kv(torch.randn(11, shape.d_model, generator=g), cache)
        cache.begin_step(shape.new_tokens)
        runner(torch.randn(shape.new_tokens, shape.latent_channels, generator=g), cache, ckv)
        cache.end_step()
        made.append(cpu_graphs.made)
    assert made[:4] == [0] * 4 and made[4:6] == [1, 1]  # captured once the window is full
    assert made[6:] == [2] * 4  # and once more for the turn's windows, at its first step


def test_a_session_with_turns_is_freed_by_reference_counting_alone():
    """Turns hold the player, telemetry and model, never the session: no cycle for the GC to find."""
    import gc
    import weakref

    w = Worker("tiny", device="cpu")
    gc.disable()
    try:
        inbox = _OnePerBoundary()
        for n in (3, 9):
            inbox.submit(tokens=n)
        s = Session(w, steps=8, realtime=False, sink=ListSink(), turns=inbox, playout_policy="trim")
        s.run()
        assert s.turns.applied == 2
        refs = [weakref.ref(x) for x in (s, s.turns, s.playout, s.tel, s.cache)]
        del s
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()


def test_the_policies_are_the_wire_contracts():
    from collector import records

    assert POLICIES == records.PLAYOUT_POLICIES  # the worker has no pydantic: its own copy, checked here
