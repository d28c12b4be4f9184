"""The slowdown calibration (tests/machine.py): 1 or more, and more when this process gets less of a core."""

from __future__ import annotations

import threading

from tests import machine


def test_slowdown_is_at_least_one_and_rises_when_the_core_is_shared():
    assert 1.0 <= machine.slowdown() <= machine.MAX_SLOWDOWN
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(3)]
    for t in spinners:
        t.start()
    try:  # three threads holding the GIL: the calibration loop runs about a quarter of the wall time
        assert machine._calibrate() > 1.5
    finally:
        stop.set()
        for t in spinners:
            t.join()
