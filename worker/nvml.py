"""GPU readings through NVML (nvidia-ml-py): ``NvmlSource`` reads power, the cumulative energy counter,
SM clock, memory, temperature and throttle reasons; ``PowerSampler`` reads them at ~10 Hz in a thread,
ships ``gpu_sample`` records and keeps the energy and clock history a step's energy and mean clock are
interpolated from. Without a driver (``NVMLError_LibraryNotFound``) power and energy are null, never an error."""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from typing import Any

log = logging.getLogger("livestep.worker.telemetry")

class NvmlSource:
    """The NVML readings of some GPUs (nvidia-ml-py); raises at construction without a driver."""

    def __init__(self, gpu_indices: list[int]):
        import pynvml

        pynvml.nvmlInit()
        self._nv = pynvml
        self._handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in gpu_indices]
        self.gpus = tuple(i for i, _ in self._handles)

    @staticmethod
    def _read(h, fn, *args):
        try:
            return fn(h, *args)
        except Exception:  # noqa: BLE001
            return None

    def read(self) -> list[tuple[int, dict[str, Any]]]:
        """Per GPU: (index, the ``gpu_sample`` fields); a reading NVML refuses is None."""
        nv, rd = self._nv, self._read
        throttle = (nv.nvmlDeviceGetCurrentClocksEventReasons if hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons")
                    else nv.nvmlDeviceGetCurrentClocksThrottleReasons)
        out = []
        for idx, h in self._handles:
            energy = rd(h, nv.nvmlDeviceGetTotalEnergyConsumption)
            power = rd(h, nv.nvmlDeviceGetPowerUsage)
            mem = rd(h, nv.nvmlDeviceGetMemoryInfo)
            out.append((idx, {
                "power_w": None if power is None else power / 1000.0,
                "energy_mj": None if energy is None else float(energy),
                "sm_clock_mhz": rd(h, nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
                "mem_used_bytes": None if mem is None else int(mem.used),
                "temp_c": _float(rd(h, nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)),
                "throttle_reasons": rd(h, throttle),
            }))
        return out


class PowerSampler:
    """~10 Hz readings of the session's GPUs: gpu_sample records + an energy history.

    ``source``: what is read (``.gpus``, ``.read()`` as ``NvmlSource``, and optionally its own
    ``interval_s``); default NVML on ``gpu_indices``. ``close()`` stops the thread and joins it,
    so its last sample is put before the caller's next record (the session's end) and before the
    sink closes.
    """

    def __init__(self, gpu_indices: list[int], emit, interval_s: float = 0.1, source=None):
        self.available = False
        self.error: str | None = None
        self._hist: deque[tuple[float, float]] = deque(maxlen=4096)  # (perf_counter, energy mJ summed)
        self._clocks: deque[tuple[float, float]] = deque(maxlen=4096)  # (perf_counter, mean SM clock MHz)
        self.latest: dict[int, dict] = {}  # GPU index -> its last gpu_sample row (worker/metrics.py reads it)
        self._emit = emit  # weak_method(Telemetry._put): the sampler never keeps its telemetry alive
        self.interval_s = interval_s
        self._stop = threading.Event()
        try:
            self._source = source if source is not None else NvmlSource(gpu_indices)
            self.interval_s = getattr(self._source, "interval_s", interval_s)
            self.available = bool(self._source.gpus)
        except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound (no driver), module missing, ...: power is null
            self.error = f"{type(e).__name__}: {e}"
            return
        self._thread = threading.Thread(target=self._run, name="livestep-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            total = 0.0
            try:
                readings = self._source.read()
            except Exception as e:  # noqa: BLE001 - a failing reading never ends the thread
                log.debug("GPU reading failed: %s", e)
                readings = []
            clocks = []
            for idx, fields in readings:
                total += float(fields.get("energy_mj") or 0)
                if fields.get("sm_clock_mhz") is not None:
                    clocks.append(float(fields["sm_clock_mhz"]))
                self.latest[idx] = row = {"gpu_index": idx, **fields}
                self._emit("gpu_sample", row)
            self._hist.append((t, total))
            if clocks:
                self._clocks.append((t, sum(clocks) / len(clocks)))
            self._stop.wait(self.interval_s)

    def energy_between(self, t0: float, t1: float) -> float | None:
        """Energy (mJ) between two perf_counter times, interpolated from the samples.

        A step is emitted a few ms after it ends, usually before the next ~100 ms sample: up to two
        sample intervals past the last sample the energy is extrapolated at the last measured power
        (without that, most steps would report none)."""
        h = list(self._hist)
        if not self.available or len(h) < 2 or t1 < t0 or t0 < h[0][0] or t1 > h[-1][0] + 2 * self.interval_s:
            return None
        return max(0.0, _interp(h, t1) - _interp(h, t0))

    def clock_between(self, t0: float, t1: float) -> float | None:
        """Mean SM clock (MHz) of the GPUs over [t0, t1]: of the samples taken in it, else the last one
        before t1 when at most two sample intervals old (a step shorter than the interval); else None."""
        h = list(self._clocks)
        inside = [c for t, c in h if t0 <= t <= t1]
        if inside:
            return sum(inside) / len(inside)
        i = bisect.bisect_right(h, (t1, float("inf"))) - 1
        return h[i][1] if i >= 0 and t1 - h[i][0] <= 2 * self.interval_s else None

    def close(self) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(timeout=max(1.0, 10 * self.interval_s))


def _float(v):
    return None if v is None else float(v)


def _interp(h: list[tuple[float, float]], t: float) -> float:
    i = bisect.bisect_left(h, (t, float("-inf")))
    if i <= 0:
        return h[0][1]
    if i >= len(h):  # past the last sample: the last segment's power carries on
        (ta, ea), (tb, eb) = h[-2], h[-1]
        return eb + (eb - ea) * (t - tb) / max(tb - ta, 1e-9)
    (ta, ea), (tb, eb) = h[i - 1], h[i]
    return ea + (eb - ea) * (t - ta) / max(tb - ta, 1e-9)
