"""The ``cover`` playout policy and the policies as switches.

cover keeps the old chunks that play until the first new chunk is in, by the device's own times (the
diffusion still queued, the recompute, a chunk's making): on a fake clock its new chunk plays at the first
chunk boundary after the estimate, without a late chunk, and the estimate reads only events already
done. The policy is a switch (at most one turn_* on; none: keep) that the control plane flips at a step
boundary without a new runner or a re-warm."""

from __future__ import annotations

import itertools

import pytest
import torch

from worker.config import ModelShape, SwitchError, Switches
from worker.model import DiT
from worker.session import Session, Worker
from worker.telemetry import ListSink, Telemetry
from worker.turns import COVER_MARGIN, TurnPlayer, TurnSchedule, cover_estimate

P = 1 / 6


def _full_buffer():
    """Chunks 0..5 delivered at t = 0..0.05: playback from 0.01; at t = 0.1 chunk 0 plays (until 0.177)
    and 1..5 are buffered (tests/worker/test_turns.py)."""
    pl = TurnPlayer(P, capacity=4)
    for i in range(6):
        pl.deliver(i, 0.01 * i)
    return pl


# -- the player, on a fake clock -------------------------------------------------------------------


@pytest.mark.parametrize(("ahead", "recompute", "make"), [(0.0, 0.026, 0.126), (0.09, 0.026, 0.126),
                                                          (0.126, 0.03, 0.13), (0.3, 0.05, 0.2)])
def test_cover_plays_the_new_chunk_at_the_first_boundary_after_the_estimate_without_a_late_chunk(
        ahead, recompute, make):
    pl = _full_buffer()
    t = 0.1
    cover = cover_estimate(ahead, recompute, make, P)
    assert cover == pytest.approx(ahead + recompute + make + COVER_MARGIN * P)
    dropped = pl.apply_policy("cover", t, first_new=6, cover_s=cover)
    kept = 5 - dropped
    end = 0.01 + P  # chunk 0 ends
    assert end + kept * P >= t + cover > end + (kept - 1) * P  # the fewest that play until it is in
    # the new chunk comes in when the device says (the estimate less its margin): on time, never late
    late, _ = pl.deliver(6, t + ahead + recompute + make)
    assert not late and pl.stall_s == 0 and pl.late_chunks == 0
    assert pl.entry(6).played == pytest.approx(end + kept * P)
    assert cover <= pl.entry(6).played - t < cover + P  # the latency: the estimate, to the next boundary
    # the chunks after it follow a period apart
    pl.deliver(7, t + 0.3)
    assert pl.entry(7).played == pytest.approx(pl.entry(6).played + P)


def test_cover_keeps_the_chunks_in_flight_that_play_before_the_new_one():
    """Old chunks not yet delivered count like buffered ones: kept in order while they cover the wait,
    the one past it dropped when it arrives."""
    pl = TurnPlayer(P, capacity=4)
    for i in range(3):
        pl.deliver(i, 0.01 * i)  # chunk 0 plays from 0.01 to 0.177, 1 and 2 buffered; 3 and 4 being made
    cover = cover_estimate(0.25, 0.03, 0.13, P)  # in at 0.1 + 0.43 = 0.527: 0.177 + 3 periods covers it
    assert pl.apply_policy("cover", 0.1, first_new=5, cover_s=cover) == 1
    for i, t in ((3, 0.2), (4, 0.35), (5, 0.51)):
        late, _ = pl.deliver(i, t)
        assert not late
    assert [e.dropped for e in pl.log] == [False] * 4 + [True, False]
    assert [e.played for e in pl.log if not e.dropped] == pytest.approx([0.01 + k * P for k in range(5)])


def test_cover_keeps_everything_while_the_player_prebuffers():
    pl = TurnPlayer(P, capacity=4, prebuffer=2)
    pl.deliver(0, 0.0)
    assert pl.start is None and pl.apply_policy("cover", 0.05, first_new=2, cover_s=0.2) == 0


# -- the estimate reads events already done, nothing else --------------------------------------------


class _Event:
    """A CUDA event as the estimate sees it: done or not (``query``), and its wall time once done."""

    def __init__(self, done: bool, wall: float | None = None):
        self.done, self.wall = done, wall

    def query(self) -> bool:
        return self.done

    def synchronize(self):  # a host sync: the estimate must never call it
        raise AssertionError("synchronize() in the step loop")


def test_device_ahead_counts_the_running_steps_rest_and_the_queued_steps_whole():
    tel = Telemetry(ListSink(), {}, "cpu", TurnPlayer(P), enabled=False)
    tel.cuda = True  # the CUDA path, on events that say whether they are done
    tel._wall = lambda ev, device: ev.wall
    step = 0.126
    for start, end in ((_Event(True, 9.0), _Event(True, 9.126)),  # finished: nothing left
                       (_Event(True, 10.0), _Event(False)),  # running since 10.0
                       (_Event(False), _Event(False))):  # queued behind it
        tel.end_step(0, end, None, False, (0, 0), 0, "")
        tel._pending[-1].start = start
    assert tel.device_busy()
    assert tel.device_ahead_s(10.05, step) == pytest.approx((step - 0.05) + step)
    assert tel.device_ahead_s(10.5, step) == pytest.approx(step)  # overran its estimate: 0 left, not < 0
    tel._pending[-1].reset = True  # the queued one resets positions: counted at a reset step's time
    assert tel.device_ahead_s(10.05, step, reset_step_s=0.2) == pytest.approx((step - 0.05) + 0.2)
    for p in tel._pending:
        p.start.done = p.diffusion_end.done = True
    assert not tel.device_busy() and tel.device_ahead_s(11.0, step) == 0.0


def test_on_the_cpu_nothing_is_ahead_and_the_estimate_is_a_chunks_making():
    s = Session(Worker("tiny"), steps=12, realtime=False, sink=ListSink(), cond_tokens=5,
                turns=TurnSchedule([]), playout_policy="cover")
    s.run()
    st = s.tel.stats
    assert len(st.make_ms) == 12 and all(m >= d - 1e-6 for m, d in zip(st.make_ms, st.diffusion_ms, strict=True))
    assert len(st.reset_make_ms) == sum(1 for i in range(1, 12) if i % s.w.shape.reset_every == 0)
    assert not s.tel.device_busy() and s.tel.device_ahead_s(0.0, 1.0) == 0.0
    cover = s.turns.cover_s("cover", 0.0, in_flight=3, chunk_s=1.0, reset=False)
    assert cover == pytest.approx(max(st.make_ms[-16:]) / 1e3 + COVER_MARGIN * P)
    reset = s.turns.cover_s("cover", 0.0, in_flight=3, chunk_s=1.0, reset=True)
    assert reset == pytest.approx(max(st.reset_make_ms[-16:]) / 1e3 + COVER_MARGIN * P)
    # before the session's first reset step, a reset step counts a step more than a chunk's making
    young = Session(Worker("tiny"), steps=4, realtime=False, sink=ListSink(), cond_tokens=5,
                    turns=TurnSchedule([]), playout_policy="cover")
    young.run()
    yt = young.tel.stats
    assert yt.reset_make_ms == [] and young.turns.cover_s("cover", 0.0, 0, 1.0, reset=True) == pytest.approx(
        (max(yt.make_ms) + max(yt.diffusion_ms)) / 1e3 + COVER_MARGIN * P)


def test_a_session_can_end_at_a_step_boundary_once_its_turns_are_settled():
    """Session(stop_when=...): asked at each boundary (bench/turns.py ends a session after its turns)."""
    sched = TurnSchedule([(0.0, 7, True), (0.0, 9, False)])
    s = Session(Worker("tiny"), steps=200, realtime=False, sink=ListSink(), cond_tokens=5, turns=sched)
    s.stop_when = lambda: s.turns.settled() and s.tel.stats.steps >= 3
    summary = s.run()
    assert s.turns.settled() and s.turns.inbox.waiting() == 0
    assert 3 <= summary.steps < 200 and len(s.sink.rows["turn"]) == 1  # the two coalesced into one


# -- the policies as switches ---------------------------------------------------------------------------


def test_at_most_one_playout_policy_switch_and_none_is_keep():
    assert Switches().playout_policy == "keep"
    assert Switches(turn_trim=True).playout_policy == "trim"
    assert Switches.all_on().playout_policy == "cover"  # production
    assert not Switches.all_on().buffer_per_shape
    for a, b in itertools.combinations(("turn_drop_unplayed", "turn_trim", "turn_cover"), 2):
        with pytest.raises(SwitchError, match="at most one of turn_drop_unplayed, turn_trim, turn_cover"):
            Switches.from_mapping({a: True, b: True})
    sw = Switches.all_on().with_policy("drop_unplayed")
    assert sw.on() - Switches.all_on().on() == {"turn_drop_unplayed"} and sw.playout_policy == "drop_unplayed"
    assert sw.with_policy("keep").model_switches() == Switches.all_on().model_switches()
    with pytest.raises(SwitchError, match="valid policies: keep, drop_unplayed, trim, cover"):
        Switches().with_policy("skip")


def test_the_session_argument_and_the_switches_pick_the_same_policy():
    a = Session(Worker("tiny"), steps=2, switches=["turn_trim=on"], turns=TurnSchedule([]))
    b = Session(Worker("tiny"), steps=2, playout_policy="trim", turns=TurnSchedule([]))
    assert a.playout_policy == b.playout_policy == a.turns.policy == "trim"
    assert a.switches == b.switches and "turn_trim" in b.switches.encode()
    c = Session(Worker("tiny"), steps=2, switches=["turn_trim=on"], playout_policy="keep")
    assert c.playout_policy == "keep" and not c.switches.turn_trim  # the argument wins


def test_the_control_plane_turns_the_policy_off_at_a_step_boundary():
    """turn_cover off at step 12 (the running fleet's control plane): turns from then on keep their old
    chunks; a request for two policies at once is refused and the session keeps its own."""
    flips = {12: {"turn_cover": False}, 16: {"turn_trim": True, "turn_drop_unplayed": True}}
    sink = ListSink()
    s = Session(Worker("tiny"), seconds=6.0, sink=sink, seed=5, cond_tokens=5, switches=["turn_cover=on"],
                switch_source=lambda step: flips.get(step), turns=TurnSchedule([(0.6, 7, True), (3.0, 9, False)]))
    summary = s.run()
    rows = sink.rows["turn"]
    assert [e["step"] for e in summary.switch_events] == [12] and "turn_cover" not in summary.switches
    assert rows[0]["step"] < 12 < rows[1]["step"]
    assert [r["policy"] for r in rows] == ["cover", "keep"]
    assert rows[0]["dropped_chunks"] > 0 and rows[1]["dropped_chunks"] == 0
    refused = [e for e in sink.rows["event"] if e["kind"] == "error" and e["detail"].get("where") == "switches"]
    assert len(refused) == 1 and "at most one of" in refused[0]["detail"]["error"]
    assert summary.dropped_chunks == rows[0]["dropped_chunks"]


def test_a_policy_flip_on_a_warm_worker_keeps_its_graphs_and_needs_no_rewarm(cpu_graphs):
    shape = ModelShape.from_name("tiny")
    w = Worker(shape, device="cpu", model=DiT(shape, dtype=torch.bfloat16, fp8=True))
    prod = Switches(ring_cache=True, rope_at_write=True, cuda_graphs=True, turn_cover=True)
    warm = w.warm(prod)
    made = cpu_graphs.made
    flips = {8: {"turn_cover": False, "turn_trim": True}}
    s = w.run_session(steps=12, realtime=False, switches=prod.with_policy("keep"), cond_tokens=3,
                      switch_source=lambda step: flips.get(step), turns=TurnSchedule([]))
    assert s.warm and s.graph_misses == 0 and s.graph_captures == 0 and cpu_graphs.made == made
    assert "turn_trim" in s.switches and [e["step"] for e in s.switch_events] == [8]
    assert w.warmed is warm  # no re-warm: a policy changes no step's work


# -- on a GPU: the device queue under cover ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["keep", "cover"])
def test_under_cover_a_step_starts_only_once_the_device_has_finished_the_one_before(policy, monkeypatch):
    """cover: at every step's start no earlier step's diffusion is still on the device (queried, never
    synchronised); keep (the plain path) runs ahead up to max_in_flight on a device-bound step. No host
    sync either way."""
    w = Worker("tiny", device="cuda")
    denoise = w.model.denoise_chunk

    def slow_denoise(noise, cache, cond_kv):  # a device-bound step: the GPU spins ~20 ms in each
        torch.cuda._sleep(40_000_000)
        return denoise(noise, cache, cond_kv)

    w.model.denoise_chunk = slow_denoise
    busy: list[int] = []
    begin = Telemetry.begin_step

    def spy(tel, step, held=False):
        busy.append(sum(not p.diffusion_end.query() for p in tel._pending))
        return begin(tel, step, held)

    monkeypatch.setattr(Telemetry, "begin_step", spy)
    s = Session(w, steps=40, realtime=False, sink=ListSink(), cond_tokens=5, playout_policy=policy,
                turns=TurnSchedule([(0.05, 9, True), (0.2, 12, False)]), sync_debug=True)
    summary = s.run()
    assert summary.steps == 40
    if policy == "cover":
        assert max(busy) == 0
    else:
        assert max(busy) >= 1  # the plain producer queues steps on the device
