"""Step-phase timers: what the model calls around cache upkeep, attention and all-reduce. ``CudaTimer``
records CUDA event pairs per kind (read back later by ``worker.telemetry.Telemetry`` once they are done:
no host-device sync); ``CpuTimer`` measures with ``perf_counter`` (CPU ops are synchronous)."""

from __future__ import annotations

import time

import torch


class _EventSpan:
    __slots__ = ("kind", "start", "timer")

    def __init__(self, timer: CudaTimer, kind: str):
        self.timer, self.kind = timer, kind

    def __enter__(self):
        self.start = self.timer._event()
        self.start.record()
        return self

    def __exit__(self, *exc):
        end = self.timer._event()
        end.record()
        self.timer.pairs.setdefault(self.kind, []).append((self.start, end))
        return False


class CudaTimer:
    """Records event pairs per kind for the open step; events are pooled and reused."""

    def __init__(self):
        self.pairs: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        self._pool: list[torch.cuda.Event] = []
        self.enabled = True

    def _event(self) -> torch.cuda.Event:
        return self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)

    def span(self, kind: str):
        if not self.enabled or torch.cuda.is_current_stream_capturing():
            from worker.model import _NULL_SPAN

            return _NULL_SPAN
        return _EventSpan(self, kind)

    def take(self) -> dict[str, list]:
        pairs, self.pairs = self.pairs, {}
        return pairs

    def give_back(self, pairs: dict[str, list]) -> None:
        for lst in pairs.values():
            for a, b in lst:
                self._pool += (a, b)


class _CpuSpan:
    __slots__ = ("kind", "t0", "timer")

    def __init__(self, timer: CpuTimer, kind: str):
        self.timer, self.kind = timer, kind

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        acc = self.timer.ms
        acc[self.kind] = acc.get(self.kind, 0.0) + (time.perf_counter() - self.t0) * 1e3
        return False


class CpuTimer:
    def __init__(self):
        self.ms: dict[str, float] = {}
        self.enabled = True

    def span(self, kind: str):
        if not self.enabled:
            from worker.model import _NULL_SPAN

            return _NULL_SPAN
        return _CpuSpan(self, kind)

    def take(self) -> dict[str, float]:
        ms, self.ms = self.ms, {}
        return ms
