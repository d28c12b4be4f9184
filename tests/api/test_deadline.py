"""``_Deadline`` (api/http_limits.py): a connection's deadline never fires before its seconds of real
time, even when the loop's timer fires early (uvloop counts from a cached clock, in whole ms)."""

from __future__ import annotations

import asyncio
import time

import uvloop

from api.http_limits import _Deadline, _NeverEarly


class _EarlyLoop:
    """A loop whose timers fire at once: the worst case of an early timer."""

    def __init__(self):
        self.armed = []

    def call_later(self, delay, fn):
        self.armed.append(delay)
        return self  # its handle: cancel() is all a handle needs here

    def cancel(self):
        pass


def test_an_early_timer_re_arms_for_what_is_left_and_does_not_fire():
    loop, fired = _EarlyLoop(), []
    d = _Deadline(loop, 0.2, fired.append, "closed")
    d._fire()  # the loop fires it now, ~0.2 s early
    assert fired == [] and len(loop.armed) == 2 and 0.19 < loop.armed[1] <= 0.201 + 1e-3
    time.sleep(0.21)
    d._fire()
    assert fired == ["closed"]


def test_on_uvloop_it_never_fires_before_its_deadline():
    async def main():
        loop, closed = asyncio.get_running_loop(), []
        t0 = time.monotonic()
        never_early = _NeverEarly(loop)  # the loop as a connection's protocol sees it
        deadlines = [never_early.call_later(0.05, lambda: closed.append(time.monotonic() - t0)) for _ in range(50)]
        time.sleep(0.03)  # noqa: ASYNC251 - blocking on purpose: the loop's cached clock goes stale by this much
        await asyncio.sleep(0.2)
        return deadlines, closed

    _, closed = uvloop.run(main())
    assert len(closed) == 50 and min(closed) >= 0.05


def test_cancel_stops_it():
    async def main():
        loop, fired = asyncio.get_running_loop(), []
        _Deadline(loop, 0.02, fired.append, 1).cancel()
        await asyncio.sleep(0.05)
        return fired

    assert uvloop.run(main()) == []
