"""The worker's ``/metrics`` (``livestep worker run --metrics-port N``; off by default).

    m = WorkerMetrics(worker)                 # observes the sessions of ``Worker.run_session``
    server = serve(m.registry, "127.0.0.1", 9400)   # a thread; server.shutdown() stops it
    # or: registry = m.registry; prometheus_client.generate_latest(registry)

Nothing runs in the step loop: every value is read when Prometheus scrapes, from what the session
and its telemetry already keep (worker/telemetry.py reads step timings back from CUDA events
asynchronously; the NVML sampler thread keeps its latest reading). The step-period and diffusion
histograms are filled at scrape time from the steps emitted since the previous scrape. Sessions are
held weakly: a finished session is freed as before (the totals it contributed stay in the counters).
Names map to DCGM-exporter's where NVML reports the same field (docs/METRICS.md).
"""

from __future__ import annotations

import hmac
import ipaddress
import socketserver
import threading
import time
import weakref
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import numpy as np
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector

from collector.build_info import build_info

# seconds, dense around the 166.7 ms chunk deadline (the collector's fleet histogram has the same edges)
STEP_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.125, 0.15, 0.16, 0.1667, 0.175, 0.2, 0.25, 0.3333, 0.5, 1.0, 2.5)


class _Hist:
    """A cumulative histogram fed from a growing list of milliseconds (read past a cursor)."""

    def __init__(self):
        self.edges = np.asarray(STEP_BUCKETS_S)
        self.counts = np.zeros(len(self.edges) + 1, np.int64)
        self.sum = 0.0

    def add_ms(self, values_ms: list[float]) -> None:
        if values_ms:
            s = np.asarray(values_ms, dtype=np.float64) / 1e3
            self.counts += np.bincount(np.searchsorted(self.edges, s, side="left"), minlength=len(self.counts))
            self.sum += float(s.sum())

    def buckets(self) -> list[tuple[str, int]]:
        cum = np.cumsum(self.counts)
        return [(repr(float(e)), int(c)) for e, c in zip(self.edges, cum[:-1], strict=True)] + [("+Inf", int(cum[-1]))]


def _source_up(s) -> int | None:
    """1 while a session's HTTP control plane answers its polls, 0 while they fail; None without one."""
    failing = getattr(s.source, "failing", False)  # only the HTTP source has it (worker/switches.py)
    return None if failing is False else int(failing is None)


class WorkerMetrics(Collector):
    """Scrape-time families of one ``Worker``: registered in ``self.registry``, observer of its sessions."""

    def __init__(self, worker):
        self.worker = worker
        worker.observers.append(self)
        self._lock = threading.Lock()
        self._session: weakref.ref | None = None
        self._cursor = 0  # steps of the current session already in the histograms
        self._session_ms = 0.0  # the current session's summed step periods (its streamed time)
        self._period, self._diffusion = _Hist(), _Hist()
        self._done = {"sessions": 0, "late": 0, "stall_s": 0.0, "dropped": 0, "poll_failures": 0}  # finished sessions' totals
        # switch flips (worker/readiness.py): per mode, their count, late chunks and stall; seconds out of service
        self._flips: dict[str, list[float]] = {}  # mode -> [flips, late chunks, stall s, to new config s]
        self._out_of_service_s = 0.0
        self._started = 0
        # the last finished session's own families (fps, switches, memory, GPU, control plane), as numbers:
        # scraped between sessions they stay, so no series has a gap at each session end (the session is not kept)
        self._last: list = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- observer (called by Worker.run_session, between sessions: never in the step loop) ----------
    def session_started(self, session) -> None:
        if not session.tel.enabled:  # Worker.warm's synthetic sessions (no telemetry): not served to anyone
            return
        with self._lock:
            self._session, self._cursor, self._session_ms = weakref.ref(session), 0, 0.0
            self._started += 1

    def session_ended(self, session, summary) -> None:
        if not session.tel.enabled:
            return
        with self._lock:
            self._consume(session)
            pl = session.playout
            self._done["sessions"] += 1
            self._done["late"] += pl.late_chunks
            self._done["stall_s"] += pl.stall_s
            self._done["dropped"] += self._dropped(session)
            self._done["poll_failures"] += self._poll_failures(session)
            for f in getattr(summary, "flips", None) or []:
                acc = self._flips.setdefault(f["mode"], [0, 0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += f["late_chunks"]
                acc[2] += f["stall_ms"] / 1e3
                acc[3] += (f["to_new_config_ms"] or 0.0) / 1e3
            self._out_of_service_s += getattr(summary, "out_of_service_s", 0.0) or 0.0
            self._last = list(self._session_families(session, running=False))
            self._session = None

    # -- reading ------------------------------------------------------------------------------------
    def _consume(self, s) -> None:
        st = s.tel.stats
        n = len(st.period_ms)
        if n > self._cursor:
            new = st.period_ms[self._cursor:n]
            self._period.add_ms(new)
            self._session_ms += float(sum(new))
            self._diffusion.add_ms(st.diffusion_ms[self._cursor:n])
            self._cursor = n

    @staticmethod
    def _poll_failures(s) -> int:
        return int(getattr(s.source, "errors", 0) or 0)

    @staticmethod
    def _dropped(s) -> int:
        return int(s.tel.dropped) + int(getattr(s.sink, "dropped", 0) or 0)

    def collect(self):
        with self._lock:
            s = self._session() if self._session is not None else None
            if s is not None:
                self._consume(s)
            done = dict(self._done)
            period, diffusion = self._period.buckets(), self._diffusion.buckets()
            psum, dsum = self._period.sum, self._diffusion.sum
            started = self._started
            last = self._last
            flips, oos = {m: list(v) for m, v in self._flips.items()}, self._out_of_service_s
        w = self.worker
        yield build_info()
        yield InfoMetricFamily("livestep_worker", "The worker's identity",
                               value={"worker_id": w.worker_id, "release": w.release, "gpu_kind": w.gpu_kind,
                                      "shape": w.shape.name})
        f = HistogramMetricFamily("livestep_worker_step_period_seconds",
                                  "Gap between chunk deliveries (a held step: its own generation time); "
                                  "deadline 0.1667 s")
        f.add_metric([], period, psum)
        yield f
        f = HistogramMetricFamily("livestep_worker_step_diffusion_seconds", "Denoising time of one chunk (GPU time)")
        f.add_metric([], diffusion, dsum)
        yield f
        late, stall, dropped, polls = done["late"], done["stall_s"], done["dropped"], done["poll_failures"]
        running = s is not None and s.playout.delivered < s.n_steps
        if s is not None:
            late, stall, dropped = late + s.playout.late_chunks, stall + s.playout.stall_s, dropped + self._dropped(s)
            polls += self._poll_failures(s)
        yield CounterMetricFamily("livestep_worker_late_chunks", "Chunks delivered after their playout deadline",
                                  value=late)
        yield CounterMetricFamily("livestep_worker_stall_seconds", "Playback stalled waiting for late chunks",
                                  value=stall)
        yield CounterMetricFamily("livestep_worker_sessions", "Sessions started on this worker", value=started)
        yield CounterMetricFamily("livestep_worker_telemetry_records_dropped",
                                  "Telemetry records lost (worker side and shipping client)", value=dropped)
        yield CounterMetricFamily("livestep_worker_switch_poll_failures",
                                  "Switch polls of the control plane that failed (refused, unreachable)", value=polls)
        yield GaugeMetricFamily("livestep_worker_session_running", "1 while a session streams", value=int(running))
        yield from _flip_families(flips, oos, w)
        if s is None:
            yield from last
            return
        yield from self._session_families(s, running)

    def _session_families(self, s, running: bool):
        pl, tel = s.playout, s.tel
        now = time.perf_counter()
        depth = pl.delivered - pl.started(now, pl.delivered) if running else 0
        yield GaugeMetricFamily("livestep_worker_playout_depth_chunks", "Chunks buffered ahead of the player",
                                value=max(0, depth))
        if (up := _source_up(s)) is not None:
            yield GaugeMetricFamily("livestep_worker_switch_source_up",
                                    "1 while the control plane's switch polls succeed, 0 while they fail", value=up)
        streamed_ms = self._session_ms
        frames = pl.delivered * s.w.shape.frames_per_chunk
        if streamed_ms > 0:
            yield GaugeMetricFamily("livestep_worker_session_sustainable_fps",
                                    "Frames per second of the worker's own generation time in the current (or last) "
                                    "session: what it could sustain (above 24 when paced by the player)",
                                    value=frames / (streamed_ms / 1e3))
        if pl.streamed_s > 0:
            yield GaugeMetricFamily("livestep_worker_session_delivered_fps",
                                    "Frames per second the viewer got in the current (or last) session: frames "
                                    "delivered over playback time, stalls included (24 at most when paced)",
                                    value=frames / pl.streamed_s)
        yield InfoMetricFamily("livestep_worker_switches", "The current session's switch state (on/off)",
                               value={k: "on" if v else "off" for k, v in s.switches.as_dict().items()})
        alloc, reserved = tel.memory()  # the caching allocator's host-side counters: no sync
        yield GaugeMetricFamily("livestep_worker_memory_allocated_bytes",
                                "Tensor memory allocated (torch caching allocator; CPU: model + cache)", value=alloc)
        yield GaugeMetricFamily("livestep_worker_memory_reserved_bytes",
                                "Memory reserved (torch caching allocator; CPU: resident set)", value=reserved)
        latest = dict(getattr(tel.power, "latest", None) or {}) if tel.power is not None else {}
        if latest:
            yield from _gpu_families(latest)


def _flip_families(flips: dict[str, list[float]], out_of_service_s: float, w):
    """Switch flips of finished sessions (their ``flip_cost`` events), by how they were applied."""
    names = (("livestep_worker_flips", "Switch flips applied (mode: background, session_start, inline)"),
             ("livestep_worker_flip_late_chunks", "Late chunks from a flip's poll to 24 chunks after it took effect"),
             ("livestep_worker_flip_stall_seconds", "Playback stall over the same chunks"),
             ("livestep_worker_flip_to_new_config_seconds", "Poll to the first step on the new configuration, summed"))
    for j, (name, doc) in enumerate(names):
        f = CounterMetricFamily(name, doc, labels=["mode"])
        for mode, acc in sorted(flips.items()):
            f.add_metric([mode], acc[j])
        yield f
    yield CounterMetricFamily("livestep_worker_out_of_service_seconds",
                              "Time the worker blocked between sessions for a switch change (a re-warm)",
                              value=out_of_service_s)
    rd = getattr(w, "readiness", None)
    yield GaugeMetricFamily("livestep_worker_flip_building", "1 while a flip's target is built in the background",
                            value=int(bool(rd is not None and rd.building())))


# livestep name, help, gpu_sample field, scale, DCGM-exporter counterpart (docs/METRICS.md)
GPU_FIELDS = (
    ("livestep_worker_gpu_power_watts", "Board power draw (NVML)", "power_w", 1.0, "DCGM_FI_DEV_POWER_USAGE"),
    ("livestep_worker_gpu_sm_clock_hertz", "SM clock", "sm_clock_mhz", 1e6, "DCGM_FI_DEV_SM_CLOCK"),
    ("livestep_worker_gpu_memory_used_bytes", "Framebuffer memory used", "mem_used_bytes", 1.0, "DCGM_FI_DEV_FB_USED"),
    ("livestep_worker_gpu_temperature_celsius", "GPU temperature", "temp_c", 1.0, "DCGM_FI_DEV_GPU_TEMP"),
    ("livestep_worker_gpu_clocks_event_reasons", "Clock event (throttle) reasons, NVML bitmask", "throttle_reasons",
     1.0, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"),
)
GPU_ENERGY = ("livestep_worker_gpu_energy_joules", "Energy since the driver loaded", "energy_mj", 1e-3,
              "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")


def _gpu_families(latest: dict[int, dict]):
    for name, doc, field, scale, _ in GPU_FIELDS:
        f = GaugeMetricFamily(name, doc, labels=["gpu"])
        for idx, row in sorted(latest.items()):
            if row.get(field) is not None:
                f.add_metric([str(idx)], float(row[field]) * scale)
        yield f
    name, doc, field, scale, _ = GPU_ENERGY
    f = CounterMetricFamily(name, doc, labels=["gpu"])
    for idx, row in sorted(latest.items()):
        if row.get(field) is not None:
            f.add_metric([str(idx)], float(row[field]) * scale)
    yield f


# -- the HTTP endpoint ------------------------------------------------------------------------------

class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args):  # one line per scrape would drown the worker's log
        pass


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class MetricsTokenError(ValueError):
    """A metrics endpoint off loopback without a token (the message says which option sets it)."""


def serve(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 9400, token: str | None = None):
    """``GET /metrics`` (OpenMetrics when asked for) on a daemon thread; returns the server
    (``server.server_port``, ``server.shutdown()``). Off loopback a bearer ``token`` is required."""
    if not _is_loopback(host) and not token:
        raise MetricsTokenError(f"--metrics-host {host} is not loopback: set --metrics-token (or "
                                "LIVESTEP_METRICS_TOKEN) and give Prometheus the same bearer token")
    inner = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: the worker serves GET /metrics\n"]
        if token:
            scheme, _, got = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(got.strip().encode(), token.encode()):
                start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
                return [b"send 'Authorization: Bearer <the worker's --metrics-token>'\n"]
        return inner(environ, start_response)

    server = make_server(host, port, app, _Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="livestep-metrics", daemon=True).start()
    return server
