"""Conversational turns: new conditioning mid-session, applied at a step boundary, and what the player
does with the chunks made with the old one.

    inbox = TurnInbox(); inbox.submit(tokens=40)          # the agent's side, from any thread
    Session(worker, turns=inbox, playout_policy="trim")   # or turns=TurnSchedule(conversation(30, rng, ...))

A turn (the agent's audio or text tokens for the next utterance, of any length) waits for the step in
progress; at the next step boundary every block's cross-attention K/V is recomputed for it
(``DiT.cross_kv``: a column-parallel GEMM per block over the new length, no row-parallel output, so no
all-reduce and no buffer registry entry), and every chunk from that step on uses it. The player
(``TurnPlayer``) then applies the session's playout policy to the chunks made with the old
conditioning that have not started playing, buffered or still being made:

- ``keep`` (the plain path): play them; the turn waits behind up to ``capacity`` chunks (667 ms).
- ``drop_unplayed``: drop them all; the first new chunk plays on arrival, after a gap no longer than
  the time to make it (the steps ahead of it, the recompute, its own step) less what is left of the
  chunk playing now.
- ``trim`` (the middle): keep only as many as cover the expected time until the first new chunk
  arrives (the recent chunk period x the steps ahead of it and its own, plus the last recompute and
  ``margin`` chunk periods), drop the rest. Its estimate reads periods, which include the player's
  pacing (167 ms, not the device's step), and the producer still runs up to ``max_in_flight`` steps
  ahead of the device: on the H200 it kept ~2 chunks too many (614 ms p50, docs/PERFORMANCE.md).
- ``cover`` (the production policy, switch ``turn_cover``): trim's rule on the device's own times
  (``cover_estimate``): the diffusion still queued on the device (``Telemetry.device_ahead_s``: only
  events already done are read), the largest recent recompute, the largest recent time to make a
  chunk (a position-reset step's own for a reset step, ahead or the first new one), and ``COVER_MARGIN``
  periods for what no event measures. And the session keeps the device queue short (``Session._wait_for_room``:
  a step starts once the device has finished the one before, polled with ``event.query()``), so a turn
  waits for at most the step in progress: the playout buffer, not the device queue, protects against
  stalls. What it costs: the old chunks dropped (their GPU work thrown away) and the producer's
  reaction time between steps while it catches up.

Which policy a session runs is a switch (``Switches.playout_policy``: at most one of turn_drop_unplayed,
turn_trim, turn_cover on; none is keep), flipped by the control plane at a step boundary like any other.
Under tensor parallel rank 0 takes the turns and hands each, with its conditioning, to the other ranks
at the same step boundary (worker/parallel.py ``TPSession._take_turns``: a host-side gloo broadcast).

A turn's latency runs from its arrival to the start of playback of its first chunk, as the player's
clock says, in four parts that sum to it: wait (for the step in progress, on the device: until the
recompute starts), recompute (the cross K/V), generation (the first chunk's step, start to delivery)
and queue (the rest: the producer held back by a full buffer, the old chunks played before it).
Turns that arrive within one step are coalesced: the latest applies, the others count as superseded.
"""

from __future__ import annotations

import bisect
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from worker.playout import Playout

POLICIES: tuple[str, ...] = ("keep", "drop_unplayed", "trim", "cover")
TRIM_MARGIN = 0.5  # trim: chunk periods kept beyond the estimate (the estimate's error)
# cover: chunk periods beyond its estimate. The step-time spread is in the estimate already (the largest
# of the last RECENT steps); this covers what no event measures: the host's reaction between the step
# ahead finishing and the new step's launch (sub-millisecond polls, a graph launch) and the drift of the
# event -> perf_counter mapping over a session.
COVER_MARGIN = 0.1
RECENT = 16  # steps (and recomputes) the cover estimate takes its largest times from


class TurnError(ValueError):
    """An unknown playout policy or a conditioning of a bad shape."""


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise TurnError(f"playout policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    return policy


# ---------------------------------------------------------------------------------------------
# Where turns come from


@dataclass
class TurnRequest:
    """One turn's conditioning: ``tokens`` long (``cond`` [tokens, d_model], or seeded random)."""

    tokens: int
    speaking: bool = True  # the character's next utterance (False: it listens)
    cond: torch.Tensor | None = None
    arrived: float = 0.0  # perf_counter
    policy: str | None = None  # this turn's playout policy (None: the session's; bench/turns.py alternates)


class TurnInbox:
    """Turns submitted from any thread (the voice agent's side); the session takes them between steps."""

    def __init__(self):
        self._q: deque[TurnRequest] = deque()
        self._lock = threading.Lock()

    def submit(self, tokens: int | None = None, cond: torch.Tensor | None = None, speaking: bool = True) -> None:
        """A turn of ``tokens`` (seeded random conditioning) or of ``cond`` [tokens, d_model]: kept as a
        host float32 copy, made here in the caller's thread (the step loop copies it to the device,
        and under tensor parallel broadcasts it from the host)."""
        if cond is not None:
            cond = cond.detach().to("cpu", torch.float32)
            tokens = cond.shape[0]
        if tokens is None or tokens < 1:
            raise TurnError(f"a turn needs conditioning: tokens {tokens!r}; valid: >= 1, or a [L, d] tensor")
        with self._lock:
            self._q.append(TurnRequest(int(tokens), speaking, cond, time.perf_counter()))

    def start(self, t0: float) -> None:
        """The session's step loop starts at perf_counter ``t0``."""

    def take(self, now: float) -> list[TurnRequest]:
        """The turns arrived by ``now``, oldest first."""
        with self._lock:
            out = [r for r in self._q if r.arrived <= now]
            for _ in out:
                self._q.popleft()
        return out

    def due(self, now: float) -> bool:
        with self._lock:
            return bool(self._q) and self._q[0].arrived <= now

    def waiting(self) -> int:
        """Turns not taken yet (a schedule's: arrived or not)."""
        with self._lock:
            return len(self._q)


class TurnSchedule(TurnInbox):
    """Turns arriving at fixed seconds after the step loop starts: (at_s, tokens, speaking[, policy]) each."""

    def __init__(self, items: list[tuple]):
        super().__init__()
        self.items = sorted(items, key=lambda it: it[0])
        for it in self.items:
            if len(it) > 3 and it[3] is not None:
                check_policy(it[3])

    def start(self, t0: float) -> None:
        with self._lock:
            self._q = deque(TurnRequest(int(it[1]), bool(it[2]), None, t0 + it[0], it[3] if len(it) > 3 else None)
                            for it in self.items)


def conversation(seconds: float, rng: random.Random, every_s: tuple[float, float] = (2.0, 5.0),
                 tokens: tuple[int, int] = (4, 16), first_s: float = 1.0) -> list[tuple[float, int, bool]]:
    """A turn every ``every_s`` seconds (uniform), alternating speaking and listening, ``tokens`` long
    (uniform): a schedule for ``TurnSchedule`` (tests, bench/turns.py)."""
    out, t, speaking = [], first_s, True
    while t < seconds:
        out.append((t, rng.randint(*tokens), speaking))
        t += rng.uniform(*every_s)
        speaking = not speaking
    return out


# ---------------------------------------------------------------------------------------------
# The player


@dataclass
class Played:
    """One chunk in the player's log: delivered at ``arrived``; playback from ``played`` (None: dropped,
    or prebuffering still); ``stall_s``: the player's stall so far once it is in."""

    step: int
    arrived: float
    played: float | None = None
    dropped: bool = False
    late: bool = False
    stall_s: float = 0.0


class TurnPlayer(Playout):
    """``Playout`` that can drop chunks not yet started (a turn's policy) and logs every chunk.

    A dropped chunk leaves the timeline: the chunks after it take its place (slot = index - dropped
    before it), so the player goes from the chunk playing to the next one kept. With nothing dropped it
    is ``Playout`` (same due times, lateness and room)."""

    def __init__(self, period_s: float = 1 / 6, capacity: int = 4, prebuffer: int = 2):
        super().__init__(period_s, capacity, prebuffer)
        self.log: list[Played] = []
        self._dropped: list[int] = []  # sorted chunk indices
        self.dropped_chunks = 0

    def slot(self, i: int) -> int:
        return i - bisect.bisect_left(self._dropped, i)

    def _is_dropped(self, i: int) -> bool:
        j = bisect.bisect_left(self._dropped, i)
        return j < len(self._dropped) and self._dropped[j] == i

    def deliver(self, i: int, t: float) -> tuple[bool, int]:
        assert i == self.delivered, (i, self.delivered)
        self.delivered += 1
        if self._is_dropped(i):
            self.log.append(Played(i, t, None, dropped=True, stall_s=self.stall_s))
            return False, self.buffered(t)
        s = self.slot(i)
        entry = Played(i, t)
        self.log.append(entry)
        if self.start is None:
            if s + 1 >= self.prebuffer:
                self.start = t
                for e in self.log:
                    if not e.dropped:
                        e.played = self.start + self.slot(e.step) * self.period_s
        else:
            due = self.start + s * self.period_s + self.stall_s
            if t > due:
                entry.late = True
                self.late_chunks += 1
                self.stall_s += t - due
            entry.played = max(t, due)
        entry.stall_s = self.stall_s
        return entry.late, self.buffered(t)

    def buffered(self, t: float) -> int:
        """Chunks delivered and kept whose playback has not begun by t."""
        n = self.slot(self.delivered)
        return n - self.started(t, n)

    def room(self, i: int, t: float) -> bool:
        s = self.slot(i)
        return s - self.started(t, s) < self.capacity

    def wait_s(self, i: int, t: float) -> float:
        if self.room(i, t) or self.start is None:
            return 0.0
        k = self.slot(i) - self.capacity
        return max(0.0, self.start + k * self.period_s + self.stall_s - t) + 1e-4

    @property
    def streamed_s(self) -> float:
        return (self.delivered - self.dropped_chunks) * self.period_s + self.stall_s

    def apply_policy(self, policy: str, t: float, first_new: int, cover_s: float) -> int:
        """At time t the chunks from ``first_new`` on use a turn's conditioning: keep or drop, per
        ``policy``, the older ones not started; ``cover_s``: the expected seconds until the first new
        chunk arrives (``trim`` and ``cover`` keep the old chunks that play until then). Returns the
        chunks dropped."""
        check_policy(policy)
        first_slot = self.started(t, self.slot(first_new))
        lo = max(0, first_new - 64)  # never more than the buffer + the steps in flight
        old = [i for i in range(lo, first_new) if not self._is_dropped(i) and self.slot(i) >= first_slot]
        if policy == "keep" or not old:
            return 0
        keep = 0
        if policy in ("trim", "cover"):
            if self.start is None:
                keep = len(old)
            else:  # the chunk playing now ends at `end`; keep enough to play until the new one is in
                end = self.start + first_slot * self.period_s + self.stall_s
                keep = min(len(old), max(0, math.ceil((t + cover_s - end) / self.period_s)))
        gone = old[keep:]
        for i in gone:
            bisect.insort(self._dropped, i)
            if i < len(self.log):  # delivered already: off the timeline, never played
                self.log[i].dropped, self.log[i].played = True, None
        self.dropped_chunks += len(gone)
        return len(gone)

    def entry(self, step: int) -> Played | None:
        """The log's entry of chunk ``step`` (None: not delivered yet)."""
        if step >= len(self.log):
            return None
        e = self.log[step]
        assert e.step == step
        return e


# ---------------------------------------------------------------------------------------------
# The session's turn bookkeeping


@dataclass
class _Turn:
    n: int
    req: TurnRequest
    superseded: int
    step: int  # the first step that uses it
    depth: int  # chunks buffered for the player at arrival
    dropped: int = 0
    policy: str = "keep"
    stall0: float = 0.0
    marks: dict = field(default_factory=dict)  # r0, r1, g0: perf_counter floats (CPU) or CUDA events


def cover_estimate(ahead_s: float, recompute_s: float, make_s: float, period_s: float,
                   margin: float = COVER_MARGIN) -> float:
    """``cover``'s expected seconds from now until the first chunk with a turn's conditioning is
    delivered: the diffusion the device still has queued, then the recompute, then that chunk's own
    making (its step's start -> delivery), plus ``margin`` chunk periods."""
    return ahead_s + recompute_s + make_s + margin * period_s


class Turns:
    """A session's turns: takes them at step boundaries, recomputes the cross K/V, applies the policy,
    and emits a ``turn`` record once the first chunk that uses a turn has its playback time."""

    def __init__(self, inbox: TurnInbox, policy: str, player: TurnPlayer, tel, model, seed: int,
                 margin: float = TRIM_MARGIN, cross=None):
        self.inbox, self.policy, self.player, self.tel, self.model = inbox, check_policy(policy), player, tel, model
        # conditioning [L, d], cache -> the cross K/V windows (a warm worker's: padded to a bucket and
        # copied into the windows its graphs read)
        self.cross = cross or model.cross_kv
        self.margin = margin
        self.cuda = model.device.type == "cuda"
        self.gen = torch.Generator(device=model.device).manual_seed(seed)  # apart from the noise's
        self.pending: deque[_Turn] = deque()
        self.applied = 0
        self.emitted = 0
        self.last_recompute_s = 0.0
        self.recomputes: deque[float] = deque(maxlen=RECENT)  # measured, seconds (cover's estimate)

    def start(self, t0: float) -> None:
        self.inbox.start(t0)

    def settled(self) -> bool:
        """Every turn of the inbox taken and every applied one's record emitted."""
        return not self.pending and not self.inbox.waiting()

    def due(self) -> bool:
        return self.inbox.due(time.perf_counter())

    def take(self) -> tuple[TurnRequest | None, int]:
        """The latest turn arrived by now and how many earlier ones it supersedes (None, 0: none)."""
        reqs = self.inbox.take(time.perf_counter())
        return (reqs[-1], len(reqs) - 1) if reqs else (None, 0)

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _depth_at(self, t: float) -> int:
        """Chunks buffered for the player at time t (this step boundary's recent past): O(chunks since t)."""
        pl = self.player
        kept = pl.slot(pl.delivered)
        for e in reversed(pl.log):
            if e.arrived <= t:
                break
            kept -= not e.dropped
        return max(0, kept - pl.started(t, kept))

    def cover_s(self, policy: str, now: float, in_flight: int, chunk_s: float, reset: bool) -> float:
        """The expected seconds from ``now`` until the first new chunk is in, as ``policy`` estimates it
        (the recompute launched already; on the CPU it is done by now)."""
        period = self.player.period_s
        if policy == "trim":  # the steps ahead and its own at the recent period, the last recompute
            return chunk_s * (in_flight + 1) + self.margin * period + (self.last_recompute_s if self.cuda else 0.0)
        st = self.tel.stats
        steps = st.diffusion_ms[-RECENT:]
        step_s = max(steps) / 1e3 if steps else period
        makes = st.make_ms[-RECENT:]
        make_s = max(makes) / 1e3 if makes else step_s
        # a position-reset step (every reset_every steps: rarer than RECENT) by its own recent times; none
        # measured yet in this session: twice a step's, until one is
        reset_step_s = max(st.reset_diffusion_ms[-RECENT:]) / 1e3 if st.reset_diffusion_ms else 2 * step_s
        if reset:
            make_s = max(st.reset_make_ms[-RECENT:]) / 1e3 if st.reset_make_ms else make_s + step_s
        if not self.cuda:  # every step ahead and the recompute are done: the new chunk's making only
            return cover_estimate(0.0, 0.0, make_s, period)
        recompute_s = max(self.recomputes) if self.recomputes else step_s  # none measured: one step's worth
        return cover_estimate(self.tel.device_ahead_s(now, step_s, reset_step_s), recompute_s, make_s, period)

    def apply(self, step: int, req: TurnRequest, superseded: int, cond_kv, cache, in_flight: int,
              chunk_s: float, reset: bool = False):
        """At the boundary before ``step``: turn ``req`` (superseding ``superseded`` earlier ones) -> the
        cross K/V the chunks use from ``step`` on. ``in_flight``: old chunks still being made;
        ``chunk_s``: the recent chunk period (trim's estimate); ``reset``: ``step`` resets positions."""
        d = self.model.shape.d_model
        if req.cond is None:
            cond = torch.randn(req.tokens, d, generator=self.gen, device=self.model.device)
        elif req.cond.ndim != 2 or req.cond.shape[1] != d:
            raise TurnError(f"turn conditioning of shape {tuple(req.cond.shape)}; valid: [tokens, {d}]")
        else:
            cond = req.cond.to(self.model.device, non_blocking=True)
        t = _Turn(self.applied, req, superseded, step, self._depth_at(req.arrived), stall0=self.player.stall_s)
        self.applied += 1
        t.marks["r0"] = self._mark()
        new_kv = self.cross(cond, cache)
        t.marks["r1"] = self._mark()
        t.policy = req.policy or self.policy
        now = time.perf_counter()
        cover = self.cover_s(t.policy, now, in_flight, chunk_s, reset) if t.policy in ("trim", "cover") else 0.0
        t.dropped = self.player.apply_policy(t.policy, now, step, cover)
        self.pending.append(t)
        return new_kv

    def step_begun(self, step: int) -> None:
        """Right after ``Telemetry.begin_step``: the generation of a turn's first chunk starts."""
        for t in self.pending:
            if t.step == step and "g0" not in t.marks:
                t.marks["g0"] = self._mark()

    def _wall(self, m) -> float:
        return self.tel.wall(m, self.model.device) if self.cuda else m

    def collect(self) -> None:
        """Emit the turns whose first chunk was delivered and has its playback time (never waits)."""
        while self.pending:
            t = self.pending[0]
            e = self.player.entry(t.step)
            if e is None or e.played is None or "g0" not in t.marks:
                return
            if self.cuda and not all(m.query() for m in t.marks.values()):
                return
            self.pending.popleft()
            self._emit(t, e)

    def _emit(self, t: _Turn, e: Played) -> None:
        arrived = t.req.arrived
        r0, r1, g0 = (self._wall(t.marks[k]) for k in ("r0", "r1", "g0"))
        r0 = max(r0, arrived)
        r1 = max(r1, r0)
        self.last_recompute_s = r1 - r0
        self.recomputes.append(r1 - r0)
        g0 = min(max(g0, r1), e.arrived)
        played = max(e.played, e.arrived)
        wait, recompute, generation = r0 - arrived, r1 - r0, e.arrived - g0
        latency = played - arrived
        self.emitted += 1
        self.tel.turn({
            "ts": self.tel.now_dt(arrived),
            "turn": t.n,
            "step": t.step,
            "speaking": t.req.speaking,
            "cond_tokens": t.req.tokens,
            "policy": t.policy,
            "queue_depth": t.depth,
            "dropped_chunks": t.dropped,
            "superseded": t.superseded,
            "wait_ms": wait * 1e3,
            "recompute_ms": recompute * 1e3,
            "generation_ms": generation * 1e3,
            "queue_ms": max(0.0, latency - wait - recompute - generation) * 1e3,
            "latency_ms": latency * 1e3,
            "stall_ms": max(0.0, e.stall_s - t.stall0) * 1e3,
            "generated_at": self.tel.now_dt(e.arrived),
            "played_at": self.tel.now_dt(played),
        })
