"""Where every row put into the shipping client ends: sent, filed, or dropped under a reason.

    ledger = Ledger(); ledger.buffered += 1; ...; ledger.settle(sent=n)   # the caller holds its lock
    reporter = DropReporter(report_drops_s=10.0); event = reporter.event(ledger.dropped, ...)

``Ledger`` is collector/client.py's accounting (not locked itself: ``TelemetryClient`` holds its lock
around every use); ``stats()`` is the client's ``stats()``. ``DropReporter`` builds the
``telemetry_dropped`` event that reports the drops since the last one (it rides the same path as any
record).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# why a row was lost: the keys of ``stats()["dropped_by"]`` and of a telemetry_dropped event's ``reasons``
DROP_REASONS: dict[str, str] = {
    "queue_full": "put while max_queue rows were buffered",
    "unknown_kind": "not a record kind of the wire contract",
    "unencodable": "the row does not fit its kind's Arrow schema",
    "refused": "the collector refused the batch (a 4xx other than 401, 403, 429: not retried)",
    "unauthorized": "the collector refused the token (401/403: not retried)",
    "gave_up": "the batch failed after retries (give_up_after_s or max_attempts)",
    "close_timeout": "still buffered when close() ran out of time",
    "after_close": "put after close()'s final sweep",
    "file_error": "the batch could not be written to the telemetry file",
    "internal": "the client failed on the batch (a bug; logged)",
}
# lost on the way to the collector, whole and well-formed: kept in the telemetry file when there is one
FILED_INSTEAD = frozenset(("gave_up", "close_timeout", "unauthorized", "no_collector"))
LABELS = ("worker_id", "session_id", "release", "gpu_kind")  # who a drop event is about


@dataclass
class Ledger:
    """The client's counters (rows unless named otherwise); ``dropped_by`` sums to ``dropped``."""

    sent: int = 0
    filed: int = 0
    dropped: int = 0
    dropped_by: dict[str, int] = field(default_factory=dict)
    failed_batches: int = 0  # batches
    retries: int = 0  # attempts after the first
    buffered: int = 0  # rows put and not yet acked/filed/dropped (queued + batched + in flight)
    abandoned: int = 0  # rows in flight that close() counted as close_timeout (see TelemetryClient.close)

    def count_drop(self, reason: str, n: int) -> None:
        """Rows lost for ``reason``."""
        if n > 0:
            self.dropped += n
            self.dropped_by[reason] = self.dropped_by.get(reason, 0) + n

    def settle(self, sent: int = 0, dropped: int = 0, reason: str = "", failed: int = 0, filed: int = 0) -> None:
        """A batch's rows reached their end (rows close() had counted as lost move to their real one)."""
        if self.abandoned:  # rows close() counted as close_timeout while in flight: their real fate
            k = min(self.abandoned, sent + filed + dropped)
            self.abandoned -= k
            self.dropped -= k
            self.dropped_by["close_timeout"] -= k
            if not self.dropped_by["close_timeout"]:
                del self.dropped_by["close_timeout"]
        self.sent += sent
        self.filed += filed
        self.count_drop(reason, dropped)
        self.failed_batches += failed
        self.buffered -= sent + dropped + filed

    def stats(self) -> dict[str, Any]:
        return {"sent": self.sent, "filed": self.filed, "dropped": self.dropped,
                "failed_batches": self.failed_batches, "retries": self.retries, "buffered": self.buffered,
                "dropped_by": dict(self.dropped_by)}


class DropReporter:
    """The ``telemetry_dropped`` events of one client (its sender thread only): at most every
    ``report_drops_s`` (None: never), about the labels of the latest record put."""

    def __init__(self, report_drops_s: float | None):
        self.report_drops_s = report_drops_s
        self.labels: dict[str, Any] | None = None
        self._reported_dropped = 0
        self._reported_by: dict[str, int] = {}  # dropped_by at the last drop event
        self._last_report = -math.inf

    def remember_labels(self, row: Any) -> None:
        if isinstance(row, dict) and all(isinstance(row.get(k), str) for k in LABELS):
            self.labels = {k: row[k] for k in LABELS}
            self.labels["simulated"] = bool(row.get("simulated", False))

    def due(self, now: float, dropped: int, force: bool, hopeless: bool) -> bool:
        """An event is to go out now; ``hopeless``: it could not be delivered (closing, unreachable)."""
        if self.report_drops_s is None or self.labels is None or dropped <= self._reported_dropped:
            return False
        if hopeless:
            return False
        return force or now - self._last_report >= self.report_drops_s

    def event(self, dropped: int, failed: int, by: dict[str, int], last_error: str | None) -> dict[str, Any]:
        """A ``telemetry_dropped`` event: rows lost since the last one."""
        new = dropped - self._reported_dropped
        reasons = {k: n - self._reported_by.get(k, 0) for k, n in by.items() if n > self._reported_by.get(k, 0)}
        self._reported_dropped, self._reported_by, self._last_report = dropped, by, time.monotonic()
        detail = {"where": "client", "dropped": new, "reasons": reasons, "last_error": last_error,
                  "dropped_total": dropped, "failed_batches_total": failed}
        return {**self.labels, "ts": datetime.now(UTC), "kind": "telemetry_dropped", "detail": detail}
