"""A session's switch flips: the swap of a built target at a step boundary, and what each flip cost.

    flips = Flips()                                   # one per session (worker/session.py)
    flips.want(session, new, step, changed)           # a polled flip: its target builds (worker/readiness.py)
    cond_kv = flips.boundary(session, step, cond_kv)  # each step boundary: swap in once ready
    details = flips.records(session, out_of_service_ms)   # the flip_cost events (collector/flip_fields.py)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from collector.flip_fields import FLIP_COST_FIELDS
from worker.cache import KVCache
from worker.config import Switches
from worker.model import DiT

if TYPE_CHECKING:
    from worker.readiness import WarmState

FLIP_COST_STEPS = 24  # the chunks after a flip's swap (4 s) over which its stall and late chunks count


def carry_cache(old: KVCache, new: KVCache) -> None:
    """``new`` (a target's warm cache, whose tensors its graphs read) takes ``old``'s window in place:
    ``rebuild_cache``'s carry-over without allocating a cache, a block at a time (the live swap's transient
    memory is one block's, not the window's)."""
    window = old.export_blocks()  # read before the restart: ``old`` may be ``new`` (a build compiling this path)
    new.restart()
    new.load_blocks(*window)
    new.book.wraps, new.book.resets = old.book.wraps, old.book.resets


def carry_scales(old: DiT, new: DiT, passes: int) -> None:
    """Static activation scales at a swap: calibrated ones carry over (the session's own, in the view's
    scale tensors its graphs read); with static scales newly on, the view's sites calibrate over the next
    chunk (the cross K/V site over the swap's cross recompute)."""
    pairs = [(a.site, b.site) for ba, bb in zip(old.blocks, new.blocks, strict=True)
             for a, b in zip(ba.linears, bb.linears, strict=True) if b.site is not None]
    if not pairs:
        return
    if all(a is not None for a, _ in pairs):
        torch._foreach_copy_([b.scale for _, b in pairs], [a.scale for a, _ in pairs])
        for a, b in pairs:
            b.left = a.left
        return
    for blk in new.blocks:
        for lin in blk.linears:
            if lin.site is not None:
                lin.site.restart(1 if lin is blk.ckv else passes)


@dataclass
class FlipCost:
    """One applied flip and what it cost the live session: from the poll that brought it to
    ``FLIP_COST_STEPS`` chunks after the first step on the new configuration."""

    changed: dict[str, bool]
    switches: str
    mode: str
    polled_step: int
    t_poll: float
    late0: int
    stall0_s: float
    applied_step: int | None = None
    t_applied: float | None = None
    apply_ms: float | None = None  # the swap's own time at the boundary (inline: the whole rebuild)
    build_s: float | None = None
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def record(self, late: int, stall_s: float, steps_observed: int, out_of_service_ms: float | None) -> dict[str, Any]:
        """The ``flip_cost`` event's detail (collector/flip_fields.py ``FLIP_COST_FIELDS``)."""
        to_new = None if self.t_applied is None else (self.t_applied - self.t_poll) * 1e3
        out = {"step": self.polled_step, "applied_step": self.applied_step, "changed": self.changed,
                "switches": self.switches, "mode": self.mode, "late_chunks": late - self.late0,
                "stall_ms": (stall_s - self.stall0_s) * 1e3, "steps_observed": steps_observed,
                "to_new_config_ms": to_new, "apply_ms": self.apply_ms, "build_ms":
                None if self.build_s is None else self.build_s * 1e3, "out_of_service_ms": out_of_service_ms,
                "error": self.error}
        assert out.keys() == FLIP_COST_FIELDS.keys(), sorted(out.keys() ^ FLIP_COST_FIELDS.keys())
        return out


class Flips:
    """A session's flips under ``flip="background"``: the wanted target, the swap at the first step boundary
    after it is ready, and each flip's cost. Methods take the session (no reference cycle: a session's
    memory is freed by reference counting, tests/worker/test_lifetime.py)."""

    def __init__(self):
        self.pending: FlipCost | None = None
        self.wanted: Switches | None = None
        self.target: WarmState | None = None  # the last warm state swapped in (the worker adopts it after)
        self.costs: list[FlipCost] = []
        self._closed: dict[int, tuple[int, float, int]] = {}  # id(cost) -> (late, stall_s, steps) at its window end

    def want(self, s, new: Switches, step: int, changed: dict[str, bool]) -> None:
        """A flip polled at ``step`` (-1: the session started on switches the worker is not warm for): the
        build starts (or the wanted target changes); the session steps on."""
        if self.pending is not None and self.pending.polled_step < 0 <= step:
            self.pending = None  # a control-plane flip while attached to a build at start: that flip is what counts
        if self.pending is None:
            pl = s.playout
            self.pending = FlipCost(changed, new.encode(), "background" if step >= 0 else "session_start", step,
                                    time.perf_counter(), pl.late_chunks, pl.stall_s)
        else:  # a newer poll before the last target was ready: one flip, to the newest target
            self.pending.changed = s.switches.changes_to(new)
            self.pending.switches = new.encode()
        self.wanted = new
        s.w.readiness.request(new, first=s.w.bucket(s.cond_tokens))

    def drop(self) -> None:
        """The wanted target is the configuration running (flipped back before it was ready)."""
        self.pending = self.wanted = None

    def boundary(self, s, step: int, cond_kv):
        """At a step boundary: swap in the wanted target if ready (-> the cross K/V its graphs read), and close
        the cost windows that have run ``FLIP_COST_STEPS`` chunks; ``cond_kv`` as is otherwise."""
        pl = s.playout
        for c in self.costs:
            if id(c) not in self._closed and pl.delivered >= c.applied_step + FLIP_COST_STEPS:
                self._closed[id(c)] = (pl.late_chunks, pl.stall_s, FLIP_COST_STEPS)
        if self.pending is None:
            return cond_kv
        rd = s.w.readiness
        ahead = step - pl.started(time.perf_counter(), step)  # chunks made and not yet playing
        if not s.realtime or s.warm_state is None or ahead >= pl.capacity - 1:
            rd.gate.set()  # slack (or an eager session that cannot keep up anyway: build at full speed)
        else:
            rd.gate.clear()
        warm = rd.take(self.wanted)
        if warm is None:
            err = rd.failed(self.wanted)
            if err is None:
                return cond_kv
            c, new = self.pending, self.wanted  # the build failed: the plain path, in the loop
            self.drop()
            c.error, c.mode = err, "inline"
            s._apply_inline(new, step, c)
            self.costs.append(c)
            return cond_kv
        c, new = self.pending, self.wanted
        self.drop()
        t0 = time.perf_counter()
        cond_kv = s._swap(warm, new, step, c)
        c.applied_step, c.t_applied, c.apply_ms, c.build_s = step, time.perf_counter(), \
            (time.perf_counter() - t0) * 1e3, warm.seconds
        self.target = warm
        self.costs.append(c)
        return cond_kv

    def add_inline(self, c: FlipCost) -> None:
        self.costs.append(c)

    def records(self, s, out_of_service_ms: float | None) -> list[dict[str, Any]]:
        """Every flip of the session (applied or still building at its end), as ``flip_cost`` details."""
        if not getattr(s.w, "building", False):
            s.w.readiness.gate.set()  # between sessions a build runs at full speed
        pl = s.playout
        out = []
        for c in [*self.costs, *([self.pending] if self.pending is not None else [])]:
            late, stall, steps = self._closed.get(id(c), (pl.late_chunks, pl.stall_s, None))
            if steps is None:
                steps = 0 if c.applied_step is None else max(0, pl.delivered - c.applied_step)
            out.append(c.record(late, stall, steps, out_of_service_ms))
        return out
