"""The collector's Prometheus metrics: ingest counters, and the spool/writer/fleet state read at scrape time.

    m = IngestMetrics()                       # per app (app.state.ingest_metrics), counted by collector/routes.py
    m.accepted(rows); m.refused(429); m.refused_rows(429, rows); m.deduplicated()
    fleet = FleetCounters(); writer.observe_block = fleet.observe   # the writer thread counts each stored block
    registry.register(CollectorState(app.state))                     # spool bytes, oldest row, writer, store errors

Counters on the request path are plain integer adds under one lock (no label lookups per request);
everything else is read when Prometheus scrapes. The fleet counters (chunks, late chunks, the step
period histogram per release and GPU kind; sessions and sessions at or below 24 fps) are counted by
the block writer's thread once a block is stored, off the request path: they are what the shipped
alert rules (deploy/prometheus/rules.yml) watch. They keep the ``MAX_RELEASES`` releases most recently
stored: an older release's series leave the exposition (Prometheus marks them stale), so the label's
cardinality stays bounded however many releases a fleet rolls through.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from collector import catalog
from collector.state import collector_state

log = logging.getLogger("livestep.collector.metrics")

# step period buckets (seconds), dense around the 166.7 ms deadline of one 4-frame chunk at 24 fps
PERIOD_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.125, 0.15, 0.16, 0.1667, 0.175, 0.2, 0.25, 0.3333, 0.5, 1.0, 2.5)
BLOCK_ROWS_BUCKETS = (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
FPS_FLOOR = catalog.FPS_BUDGET  # a session at or below it is counted (the fleet figure of analytics/fps.py)
MIN_STREAMED_S = catalog.MIN_STREAMED_S  # sessions shorter than this are not judged (as the fleet figures)
MAX_RELEASES = 16  # fleet counters kept for the releases most recently stored (bounded label cardinality)

# refusals: HTTP status -> the reason label
REASONS = {400: "unreadable", 401: "unauthenticated", 403: "forbidden", 413: "too_large",
           415: "unsupported_media_type", 422: "invalid", 429: "spool_full", 503: "spool_error"}


class IngestMetrics:
    """What ``POST /v1/telemetry`` counts: rows accepted by kind, batches refused by status and reason
    (rows too, where the batch was read), retries answered as duplicates."""

    def __init__(self):
        self._lock = threading.Lock()
        self.rows_accepted: dict[str, int] = defaultdict(int)
        self.rows_refused: dict[tuple[str, str], int] = defaultdict(int)  # (kind, reason)
        self.batches_accepted = 0
        self.batches_refused: dict[tuple[int, str], int] = defaultdict(int)  # (status, reason)
        self.batches_deduplicated = 0

    def accepted(self, rows: dict[str, int]) -> None:
        with self._lock:
            self.batches_accepted += 1
            for kind, n in rows.items():
                self.rows_accepted[kind] += n

    def refused(self, status: int) -> None:
        """A batch answered ``status`` (any refusal, before or after its body was read)."""
        with self._lock:
            self.batches_refused[(status, REASONS.get(status, "other"))] += 1

    def refused_rows(self, status: int, rows: dict[str, int]) -> None:
        """The rows of a batch that was read and then refused: invalid values (422), or the spool could
        not take it (429, 503)."""
        reason = REASONS.get(status, "other")
        with self._lock:
            for kind, n in rows.items():
                self.rows_refused[(kind, reason)] += n

    def deduplicated(self) -> None:
        with self._lock:
            self.batches_deduplicated += 1

    def families(self):
        with self._lock:
            acc, ref = dict(self.rows_accepted), dict(self.rows_refused)
            b_acc, b_ref, dedup = self.batches_accepted, dict(self.batches_refused), self.batches_deduplicated
        f = CounterMetricFamily("livestep_collector_rows_accepted", "Rows stored in the spool (acked), by record kind",
                                labels=["kind"])
        for kind, n in sorted(acc.items()):
            f.add_metric([kind], n)
        yield f
        f = CounterMetricFamily("livestep_collector_rows_refused",
                                "Rows of refused batches that were read (invalid values, spool full or failing), by kind and reason",
                                labels=["kind", "reason"])
        for (kind, reason), n in sorted(ref.items()):
            f.add_metric([kind, reason], n)
        yield f
        yield CounterMetricFamily("livestep_collector_batches_accepted", "Batches acked (durable in the spool)",
                                  value=b_acc)
        f = CounterMetricFamily("livestep_collector_batches_refused",
                                "Batches answered 4xx/5xx, by HTTP status and reason (429: spool full)",
                                labels=["status", "reason"])
        for (status, reason), n in sorted(b_ref.items()):
            f.add_metric([str(status), reason], n)
        yield f
        yield CounterMetricFamily("livestep_collector_batches_deduplicated",
                                  "Retried batches answered from the idempotency keys (stored once)", value=dedup)


def _counts(table: pa.Table, keys: list[str]) -> dict[tuple, pa.Table]:
    """The table's rows grouped by the values of ``keys`` (few groups: one release and GPU kind per worker)."""
    if table.num_rows == 0:
        return {}
    combos = table.select(keys).group_by(keys).aggregate([])
    if combos.num_rows == 1:
        return {tuple(combos.column(k)[0].as_py() for k in keys): table}
    out = {}
    for row in combos.to_pylist():
        mask = None
        for k in keys:
            m = pc.equal(table.column(k), row[k])
            mask = m if mask is None else pc.and_(mask, m)
        out[tuple(row[k] for k in keys)] = table.filter(mask)
    return out


class FleetCounters:
    """Per release and GPU kind, from the blocks the writer stored: chunks, late chunks, the step period
    histogram; sessions judged and those at or below 24 fps; rows per stored block by kind."""

    def __init__(self, max_releases: int = MAX_RELEASES):
        self._lock = threading.Lock()
        self.max_releases = max_releases
        self._last_seen: dict[str, int] = {}  # release -> the block count when it was last stored
        self._blocks = 0
        self.chunks: dict[tuple[str, str], int] = defaultdict(int)
        self.late: dict[tuple[str, str], int] = defaultdict(int)
        self.period: dict[tuple[str, str], np.ndarray] = {}  # cumulative bucket counts (+Inf last)
        self.period_sum: dict[tuple[str, str], float] = defaultdict(float)
        self.sessions: dict[tuple[str, str], int] = defaultdict(int)
        self.slow_sessions: dict[tuple[str, str], int] = defaultdict(int)
        self.block_rows: dict[str, np.ndarray] = {}
        self.block_rows_sum: dict[str, int] = defaultdict(int)
        self._edges = np.asarray(PERIOD_BUCKETS_S)
        self._block_edges = np.asarray(BLOCK_ROWS_BUCKETS)

    def observe(self, kind: str, table: pa.Table) -> None:
        """A block (or a batch of a split block) of ``kind`` is in the store. Never raises into the writer."""
        try:
            self._observe(kind, table)
        except Exception:  # metrics must not cost a stored block
            log.exception("fleet counters: a %s block was not counted", kind)

    def _observe(self, kind: str, table: pa.Table) -> None:
        n = table.num_rows
        b = np.zeros(len(self._block_edges) + 1, np.int64)
        b[int(np.searchsorted(self._block_edges, n, side="left"))] += 1
        groups = {}
        if kind == "step":
            for key, t in _counts(table, ["release", "gpu_kind"]).items():
                s = t.column("step_period_ms").to_numpy() / 1e3
                h = np.bincount(np.searchsorted(self._edges, s, side="left"), minlength=len(self._edges) + 1)
                groups[key] = (t.num_rows, int(pc.sum(t.column("late")).as_py() or 0), h, float(s.sum()))
        elif kind == "session":
            ends = table.filter(pc.equal(table.column("phase"), "end"))
            for key, t in _counts(ends, ["release", "gpu_kind"]).items():
                judged = pc.fill_null(pc.greater_equal(t.column("streamed_s"), MIN_STREAMED_S), False)
                slow = pc.and_(judged, pc.fill_null(pc.less_equal(t.column("avg_fps"), FPS_FLOOR), False))
                groups[key] = (int(pc.sum(judged).as_py() or 0), int(pc.sum(slow).as_py() or 0))
        with self._lock:
            self.block_rows[kind] = self.block_rows.get(kind, np.zeros_like(b)) + b
            self.block_rows_sum[kind] += n
            for key, g in groups.items():
                if kind == "step":
                    self.chunks[key] += g[0]
                    self.late[key] += g[1]
                    self.period[key] = self.period.get(key, np.zeros_like(g[2])) + g[2]
                    self.period_sum[key] += g[3]
                else:
                    self.sessions[key] += g[0]
                    self.slow_sessions[key] += g[1]
            self._blocks += 1
            for release, _ in groups:
                self._last_seen[release] = self._blocks
            if len(self._last_seen) > self.max_releases:
                self._prune()

    def _prune(self) -> None:
        """Forget the releases stored least recently, beyond ``max_releases`` (under the lock)."""
        keep = set(sorted(self._last_seen, key=self._last_seen.__getitem__)[-self.max_releases:])
        self._last_seen = {r: n for r, n in self._last_seen.items() if r in keep}
        for d in (self.chunks, self.late, self.period, self.period_sum, self.sessions, self.slow_sessions):
            for key in [k for k in d if k[0] not in keep]:
                del d[key]

    def families(self):
        with self._lock:
            chunks, late, sessions, slow = dict(self.chunks), dict(self.late), dict(self.sessions), dict(self.slow_sessions)
            period = {k: v.copy() for k, v in self.period.items()}
            psum = dict(self.period_sum)
            brows = {k: v.copy() for k, v in self.block_rows.items()}
            bsum = dict(self.block_rows_sum)
        labels = ["release", "gpu_kind"]
        for name, doc, data in (
            ("livestep_fleet_chunks", "Chunks (steps) stored, by release and GPU kind", chunks),
            ("livestep_fleet_late_chunks", "Chunks delivered after their playout deadline (a stall)", late),
            ("livestep_fleet_sessions", f"Sessions ended that streamed at least {MIN_STREAMED_S:g} s", sessions),
            ("livestep_fleet_slow_sessions", f"Of those, sessions whose fps was at or below {FPS_FLOOR:g}", slow),
        ):
            f = CounterMetricFamily(name, doc, labels=labels)
            for key, n in sorted(data.items()):
                f.add_metric(list(key), n)
            yield f
        f = HistogramMetricFamily("livestep_fleet_step_period_seconds",
                                  "Step period (gap between chunk deliveries) of stored steps; deadline 0.1667 s",
                                  labels=labels)
        for key, counts in sorted(period.items()):
            f.add_metric(list(key), _buckets(PERIOD_BUCKETS_S, counts), psum[key])
        yield f
        f = HistogramMetricFamily("livestep_collector_writer_block_rows",
                                  "Rows per block the writer inserted, by record kind", labels=["kind"])
        for kind, counts in sorted(brows.items()):
            f.add_metric([kind], _buckets(BLOCK_ROWS_BUCKETS, counts), bsum[kind])
        yield f


def _buckets(edges, counts: np.ndarray) -> list[tuple[str, int]]:
    cum = np.cumsum(counts)
    return [(_le(e), int(c)) for e, c in zip(edges, cum[:-1], strict=True)] + [("+Inf", int(cum[-1]))]


def _le(x: float) -> str:
    return repr(float(x))


class CollectorState(Collector):
    """Scrape-time state of a collector app (``app.state``): its ingest counters, the spool, the writer,
    the fleet counters."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        st = self.state
        ingest = getattr(st, "ingest_metrics", None)
        if ingest is not None:
            yield from ingest.families()
        fleet = getattr(st, "fleet_counters", None)
        if fleet is not None:
            yield from fleet.families()
        spool = getattr(st, "spool", None)
        if spool is not None:
            s = spool.stats()
            yield GaugeMetricFamily("livestep_collector_spool_bytes", "Bytes in the spool not yet in the store",
                                    value=s["bytes"])
            yield GaugeMetricFamily("livestep_collector_spool_max_bytes", "The spool's bound (429 beyond it)",
                                    value=s["max_bytes"])
            yield GaugeMetricFamily("livestep_collector_spool_rows", "Rows in the spool not yet in the store",
                                    value=s["rows"])
            yield GaugeMetricFamily("livestep_collector_spool_oldest_row_age_seconds",
                                    "Age of the oldest spooled row not yet in the store: the writer's lag "
                                    "(0 when the spool is empty)", value=s["oldest_age_s"])
            q = spool.quarantine_stats()  # now, not ever: `livestep spool requeue` empties it
            yield GaugeMetricFamily("livestep_collector_quarantine_batches",
                                    "Batches in the spool's quarantine now: refused by the store for their content",
                                    value=q["batches"])
            yield GaugeMetricFamily("livestep_collector_quarantine_rows", "Rows in the spool's quarantine now",
                                    value=q["rows"])
        w = getattr(st, "writer", None)
        if w is not None:
            ws = w.stats()
            yield GaugeMetricFamily("livestep_collector_writer_up", "1 while the block writer thread runs",
                                    value=1 if ws["alive"] else 0)
            yield CounterMetricFamily("livestep_collector_writer_blocks", "Blocks inserted into the store",
                                      value=ws["blocks"])
            yield CounterMetricFamily("livestep_collector_writer_rows", "Rows inserted into the store",
                                      value=ws["rows"])
            yield CounterMetricFamily("livestep_collector_store_errors",
                                      "Failed store inserts (each retried; rows stay in the spool)",
                                      value=ws["failures"])
            yield CounterMetricFamily("livestep_collector_batches_quarantined",
                                      "Batches the store kept refusing, set aside in the spool's quarantine",
                                      value=ws["quarantined"])
            state = collector_state(True, spool, w)  # /v1/health's judgement, the store's ping aside
            yield GaugeMetricFamily("livestep_collector_degraded",
                                    "1 while an acked row is not on its way into the store (writer down or "
                                    "retrying, batches in quarantine; /v1/health says why)",
                                    value=1 if state["status"] == "degraded" else 0)
            yield GaugeMetricFamily("livestep_collector_writer_failing_seconds",
                                    "How long the writer's inserts have been failing (0: the last one succeeded)",
                                    value=state["writer"]["failing_for_s"] or 0.0)
            if ws.get("last_insert_at"):
                yield GaugeMetricFamily("livestep_collector_writer_last_insert_timestamp_seconds",
                                        "Unix time of the writer's last stored block", value=ws["last_insert_at"])
