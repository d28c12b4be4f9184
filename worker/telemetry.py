"""Sync-free step telemetry: step records read back from CUDA events when they are done.

    tel = Telemetry(sink, labels, device, playout)   # sink: collector.client.TelemetryClient or ListSink
    model.set_timer(tel.timer)                       # spans around cache upkeep / attention / all-reduce
    tel.begin_step(i); ...; ev = tel.diffusion_done(); ...; tel.end_step(i, job, reset, ...)
    tel.poll()                                       # emits every step whose events are done
    tel.drain(); tel.close()

No host-device synchronisation in the step loop: on CUDA every timing is a pair of events whose
``elapsed_time`` is read only once ``event.query()`` is true (usually a step or two later); on
CPU the ops are synchronous and ``perf_counter`` measures them. Cache-upkeep ms is the sum of the
event pairs the model records around each cache update (and the step's advance / reset); when a
step replays a CUDA graph, events cannot sit inside the graph, so upkeep and attention are null
for graphed steps (the waterfall bench measures them with graphs off). On CUDA those spans are
recorded on every 8th step only (``detail_every``; null on the others): at prod shape they are
~1,000 event records per step, host time an eager, launch-bound loop pays for. Energy is
the NVML cumulative-energy counter (``nvmlDeviceGetTotalEnergyConsumption``), sampled at ~10 Hz
by a thread that also ships ``gpu_sample`` records, interpolated at each step's start and end;
without NVML (no driver: ``NVMLError_LibraryNotFound``) energy and power are null. ``fp8_saturated``
(probed steps only, see worker/session.py) is read from pinned memory once the step's events are done.
A telemetry failure never stops a step: the record is dropped and counted (``dropped``, and per
reason in ``dropped_by``: ``put_failed`` the sink raised, ``record_failed`` a step record could
not be built from its events).
The phase timers (worker/timers.py), the NVML sampler (worker/nvml.py) and the playout clock
(worker/playout.py) live in their own modules; their names are importable from here too.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import torch

from collector.weak import weak_method
from worker.nvml import NvmlSource, PowerSampler
from worker.playout import Playout
from worker.timers import CpuTimer, CudaTimer

__all__ = ["CpuTimer", "CudaTimer", "ListSink", "NvmlSource", "Playout", "PowerSampler", "StepStats", "Telemetry",
           "rss_bytes", "weak_method"]  # the timers, NVML sampler, playout clock and weak_method live apart

log = logging.getLogger("livestep.worker.telemetry")


class ListSink:
    """An in-process sink with the client's interface (tests, benches, no collector)."""

    def __init__(self, max_rows: int | None = None):
        self.rows: dict[str, list[dict[str, Any]]] = {"step": [], "gpu_sample": [], "session": [], "event": [],
                                                      "turn": []}
        self.max_rows = max_rows
        self.dropped = 0
        self.sent = 0
        self.failed_batches = 0

    def put(self, kind: str, row: dict[str, Any]) -> None:
        if self.max_rows is not None and sum(map(len, self.rows.values())) >= self.max_rows:
            self.dropped += 1
            return
        self.rows[kind].append(row)
        self.sent += 1

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        return True


@dataclass
class _Pending:
    step: int
    start: Any  # cuda Event or perf_counter float
    diffusion_end: Any
    job: Any  # decoder.DecodeJob
    pairs: Any  # timer pairs (CUDA) or ms dict (CPU)
    reset: bool
    mem_allocated: int
    mem_reserved: int
    buffers: int
    switches: str
    graphed: bool = False
    detail: bool = True  # upkeep / attention / all-reduce spans were recorded in this step
    held: bool = False  # the player held the step back before it started
    saturation: Any = None  # (pinned int64 [] saturated elements, elements) of a probed step


@dataclass
class StepStats:
    """What the session summary needs from the emitted steps."""

    steps: int = 0
    diffusion_ms: list[float] = field(default_factory=list)
    period_ms: list[float] = field(default_factory=list)
    make_ms: list[float] = field(default_factory=list)  # a chunk's own making: its step's start -> delivery
    reset_make_ms: list[float] = field(default_factory=list)  # the same, position-reset steps only
    reset_diffusion_ms: list[float] = field(default_factory=list)  # diffusion of the position-reset steps
    upkeep_ms: list[float] = field(default_factory=list)
    attention_ms: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)
    graphed: list[bool] = field(default_factory=list)  # per emitted step: it replayed a CUDA graph
    saturated: list[float] = field(default_factory=list)  # fp8_saturated of the probed steps


class Telemetry:
    """Turns the step loop's marks into step/session/event records, without blocking the loop."""

    def __init__(self, sink, labels: dict[str, str], device, playout: Playout, gpu_indices=(),
                 enabled: bool = True, sample_power: bool = True, detail_every: int | None = None,
                 power_source=None):
        self.sink = sink
        self.labels = dict(labels)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.playout = playout
        self.enabled = enabled
        # spans around every cache update / attention call cost host time (~1,000 event records a
        # step at prod shape): on CUDA they are recorded on every 8th step, other steps report null
        self.detail_every = detail_every or (8 if self.cuda else 1)
        self.dropped = 0
        self.dropped_by: dict[str, int] = {}  # reason -> records this path lost (see the module doc)
        self.emitted: dict[str, int] = {"step": 0, "session": 0, "event": 0, "gpu_sample": 0, "turn": 0}
        self.stats = StepStats()
        self._pending: deque[_Pending] = deque()
        self._last_delivery: float | None = None
        self._held = False  # the open step was held back by the player (begin_step)
        self._wall0 = datetime.now(UTC)
        self._perf0 = time.perf_counter()
        self.timer = CudaTimer() if self.cuda else CpuTimer()
        if not enabled and self.cuda:
            self.timer.enabled = False
        self._refs: dict[int, tuple[torch.cuda.Event, float]] = {}  # GPU index -> (event, perf_counter)
        self._step_start: Any = None
        self.step = -1
        # ``power_source``: GPU readings other than this process's NVML (PowerSampler's ``source``)
        self.power = (PowerSampler(list(gpu_indices), weak_method(self._put), source=power_source)
                      if power_source is not None or (sample_power and self.cuda) else None)
        self.cpu_mem = lambda: (0, 0)

    # -- clocks --------------------------------------------------------------------------------

    def now_dt(self, perf: float | None = None) -> datetime:
        return self._wall0 + timedelta(seconds=(time.perf_counter() if perf is None else perf) - self._perf0)

    @staticmethod
    def _gpu(device) -> int:
        device = torch.device(device)
        return device.index if device.index is not None else torch.cuda.current_device()

    def sync_clock(self, device) -> None:
        """Once, before the loop: an event whose wall time is known maps GPU events to perf_counter."""
        if torch.device(device).type != "cuda" or self._gpu(device) in self._refs:
            return
        with torch.cuda.device(self._gpu(device)):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            ev.synchronize()
        self._refs[self._gpu(device)] = (ev, time.perf_counter())

    def _wall(self, ev: torch.cuda.Event, device) -> float:
        ref, t = self._refs[self._gpu(device)]
        return t + ref.elapsed_time(ev) / 1e3

    def wall(self, ev: torch.cuda.Event, device) -> float:
        """The perf_counter time of a done event recorded on ``device`` (after ``sync_clock``)."""
        return self._wall(ev, device)

    # -- records -------------------------------------------------------------------------------

    def _put(self, kind: str, row: dict[str, Any]) -> None:
        try:
            self.sink.put(kind, {**self.labels, "ts": row.pop("ts", None) or self.now_dt(), **row})
            self.emitted[kind] += 1
        except Exception as e:  # noqa: BLE001 - never let telemetry fail a step
            self._lost("put_failed")
            log.debug("telemetry record dropped: %s", e)

    def _lost(self, reason: str) -> None:
        self.dropped += 1
        self.dropped_by[reason] = self.dropped_by.get(reason, 0) + 1

    def event(self, kind: str, **detail: Any) -> None:
        self._put("event", {"kind": kind, "detail": detail})

    def session(self, **row: Any) -> None:
        self._put("session", row)

    def turn(self, row: dict[str, Any]) -> None:
        """A conversational turn (worker/turns.py); none with telemetry off (a TP rank other than 0)."""
        if self.enabled:
            self._put("turn", row)

    # -- the step loop's marks -----------------------------------------------------------------

    def begin_step(self, step: int, held: bool = False) -> None:
        """``held``: the player held this step back before it started (see ``_emit_step``)."""
        self.step = step  # the open step (the bench attributes sync warnings with it)
        self._held = held
        self.timer.enabled = self.enabled and step % self.detail_every == 0
        if self.cuda:
            ev = self.timer._event()
            ev.record()
            self._step_start = ev
        else:
            self._step_start = time.perf_counter()

    def diffusion_done(self):
        if self.cuda:
            ev = self.timer._event()
            ev.record()
            return ev
        return time.perf_counter()

    def end_step(self, step: int, diffusion_end, job, reset: bool, mem: tuple[int, int], buffers: int,
                 switches: str, graphed: bool = False, saturation=None) -> None:
        """``saturation``: ``SaturationProbe.finish()`` of a probed step (its copy enqueued before
        ``diffusion_end``), read when the step's events are done."""
        self._pending.append(_Pending(step, self._step_start, diffusion_end, job, self.timer.take(), reset,
                                      mem[0], mem[1], buffers, switches, graphed, self.timer.enabled,
                                      self._held, saturation))

    def in_flight(self) -> int:
        return len(self._pending)

    def device_busy(self) -> bool:
        """Is a step's diffusion still queued or running on the device (``event.query()``: no sync)?
        On the CPU a step is done when the loop moves on: never."""
        return self.cuda and any(not p.diffusion_end.query() for p in self._pending)

    def device_ahead_s(self, now: float, step_s: float, reset_step_s: float | None = None) -> float:
        """Seconds of diffusion the device still has queued at ``now``, reading only events already done
        (no sync): a step whose start event is done runs since its wall time, ``step_s`` long (a
        position-reset step ``reset_step_s``); one not started counts whole. 0 on the CPU (each step is
        done before the loop goes on)."""
        if not self.cuda:
            return 0.0
        ahead = 0.0
        for p in self._pending:
            if p.diffusion_end.query():
                continue
            d = reset_step_s if p.reset and reset_step_s is not None else step_s
            if p.start.query():
                ahead += max(0.0, self._wall(p.start, self.device) + d - now)
            else:
                ahead += d
        return ahead

    def oldest_done(self) -> bool:
        return not self._pending or self._done(self._pending[0])

    def _done(self, p: _Pending) -> bool:
        if not self.cuda:
            return True
        return p.diffusion_end.query() and (p.job.done_event is None or p.job.done_event.query())

    def poll(self) -> int:
        """Emit every pending step whose events are done (in order); never waits."""
        n = 0
        while self._pending and self._done(self._pending[0]):
            p = self._pending.popleft()
            try:
                self._emit_step(p)
            except Exception as e:  # noqa: BLE001
                self._lost("record_failed")
                log.warning("step %d record dropped: %s", p.step, e)
            n += 1
        return n

    def drain(self, timeout_s: float = 60.0) -> None:
        """After the loop: wait (polling) for the last steps' events, emit them."""
        deadline = time.perf_counter() + timeout_s
        while self._pending and time.perf_counter() < deadline:
            if not self.poll():
                time.sleep(0.0005)

    def _period_ms(self, p: _Pending, t_start: float, t_done: float, diffusion_ms: float,
                   decode_ms: float | None) -> float:
        """The worker's own chunk period: what the fleet's fps (frames / summed periods) is judged on.

        A worker running flat out delivers a chunk every ``period``: the wall time between deliveries.
        A worker ahead of real time is held back by the player, and the gap between deliveries is then
        the player's 166.7 ms, which says nothing about the worker (every healthy session would sit at
        exactly 24 fps). For a step the player held back (and for the first step), the period is the
        step's own generation time: the longer of diffusion and decode when the decoder overlaps the
        next diffusion (its own stream or GPU), else diffusion + decode as they ran back to back.
        """
        if self._last_delivery is not None and not p.held:
            return (t_done - self._last_delivery) * 1e3
        if p.job.overlapped:
            return max(diffusion_ms, decode_ms or 0.0)
        return (t_done - t_start) * 1e3

    def _emit_step(self, p: _Pending) -> None:
        if self.cuda:
            diffusion_ms = p.start.elapsed_time(p.diffusion_end)
            sums = {k: sum(a.elapsed_time(b) for a, b in lst) for k, lst in p.pairs.items()}
            job = p.job
            decode_ms = job.start_event.elapsed_time(job.done_event) if job.done_event is not None else None
            dev = job.frames.device if job.frames is not None else self.device
            t_done = self._wall(job.done_event, dev) if job.done_event is not None else self._wall(
                p.diffusion_end, self.device)
            t_start = self._wall(p.start, self.device)
            self.timer.give_back(p.pairs)
            self.timer._pool += (p.start, p.diffusion_end)
        else:
            diffusion_ms = (p.diffusion_end - p.start) * 1e3
            sums = p.pairs
            decode_ms = p.job.cpu_ms
            t_done = p.job.done_wall if p.job.done_wall is not None else p.diffusion_end
            t_start = p.start
        late, depth = self.playout.deliver(p.step, t_done)
        period_ms = self._period_ms(p, t_start, t_done, diffusion_ms, decode_ms)
        self._last_delivery = t_done
        timed = p.detail and not p.graphed
        upkeep = sums.get("upkeep", 0.0) if timed else None
        attention = sums.get("attention", 0.0) if timed else None
        energy = self.power.energy_between(t_start, t_done) if self.power else None
        sm_clock = self.power.clock_between(t_start, t_done) if self.power else None  # host-side samples
        saturated = None
        if p.saturation is not None and p.saturation[1] > 0:  # pinned host memory, written: no sync
            saturated = min(1.0, int(p.saturation[0]) / p.saturation[1])
        st = self.stats
        st.steps += 1
        st.diffusion_ms.append(diffusion_ms)
        st.period_ms.append(period_ms)
        st.make_ms.append((t_done - t_start) * 1e3)
        if p.reset:
            st.reset_make_ms.append((t_done - t_start) * 1e3)
            st.reset_diffusion_ms.append(diffusion_ms)
        st.graphed.append(p.graphed)
        if upkeep is not None:
            st.upkeep_ms.append(upkeep)
            st.attention_ms.append(attention)
        if decode_ms is not None:
            st.decode_ms.append(decode_ms)
        if saturated is not None:
            st.saturated.append(saturated)
        if not self.enabled:
            return
        self._put("step", {
            "ts": self.now_dt(t_done),
            "step": p.step,
            "diffusion_ms": max(0.0, diffusion_ms),
            "step_period_ms": max(0.0, period_ms),
            "decode_ms": decode_ms,
            "cache_upkeep_ms": upkeep,
            "attention_ms": attention,
            "allreduce_ms": sums.get("allreduce") if timed else None,
            "late": late,
            "playout_depth": max(0, depth),
            "reset_step": p.reset,
            "energy_mj": energy,
            "mem_allocated_bytes": p.mem_allocated,
            "mem_reserved_bytes": p.mem_reserved,
            "buffers_registered": p.buffers,
            "switches": p.switches,
            "fp8_saturated": saturated,
            "sm_clock_mhz": sm_clock,
        })

    def memory(self) -> tuple[int, int]:
        """(allocated, reserved) bytes: the caching allocator's counters (host-side, no sync)."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        return self.cpu_mem()

    def close(self) -> None:
        """Stop the sampler thread (joined: its last sample is put now). Idempotent. Call it before
        the session's last records and before the sink closes: nothing of ours is put after that."""
        if self.power:
            self.power.close()


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
