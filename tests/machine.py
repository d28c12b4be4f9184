"""How much slower this machine is right now than an idle one: the factor a test scales its wall-clock
budget by, so a loaded machine (other jobs on the same cores) makes tests slower, never red.

    budget_s = 2.0 * slowdown()        # a budget stated for an idle machine, checked against now

Calibrated, not guessed: a short busy loop is timed by the wall clock and by this thread's CPU clock;
their ratio is the share of a core this process gets now (1 when idle, ~5 with ten busy loops on two
cores). The 1-minute load average per core is taken too (it sees contention that started before the
loop), the larger of the two wins, capped at ``MAX_SLOWDOWN``. Measured at most every ``EVERY_S``.
"""

from __future__ import annotations

import os
import time

MAX_SLOWDOWN = 40.0
EVERY_S = 5.0
_LOOP_CPU_S = 0.02
_last: tuple[float, float] = (-1e9, 1.0)  # (when measured, factor)


def _calibrate() -> float:
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    x = 0
    while time.thread_time() - cpu0 < _LOOP_CPU_S:
        for i in range(1000):
            x += i
    share = (time.perf_counter() - wall0) / max(time.thread_time() - cpu0, 1e-6)
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return min(MAX_SLOWDOWN, max(1.0, share, load))


def slowdown() -> float:
    """The current slowdown factor (>= 1), measured now unless measured in the last ``EVERY_S``."""
    global _last
    now = time.monotonic()
    if now - _last[0] > EVERY_S:
        _last = (now, _calibrate())
    return _last[1]
