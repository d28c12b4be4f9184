"""The shipping client the worker uses: ``put()`` a record, a background thread ships it.

    client = TelemetryClient("http://127.0.0.1:8000", token="...")   # or make_client(url_or_None)
    client.put("step", {"worker_id": "w1", ..., "ts": datetime.now(UTC)})   # never blocks, never raises
    ...
    client.close(timeout_s=5.0)                                      # ship what is left, stop

``put`` appends to a bounded in-memory buffer; when the buffer is full the record is dropped and
counted in ``dropped`` (a telemetry failure never stops a step). A daemon thread batches rows per
record kind by size (``batch_rows``) and age (``flush_interval_s``), encodes each batch as one Arrow
IPC stream body (``records.to_arrow``, one kind per body) and POSTs it to ``/v1/telemetry`` over a
keep-alive connection. Each batch gets an ``Idempotency-Key`` before its first attempt and is
retried under it (collector/client_http.py: connection errors, 5xx, 429) until ``give_up_after_s``
or ``max_attempts``; a 4xx other than 429 is never retried. Given-up and refused batches count in ``failed_batches`` and their rows in ``dropped``.
``close`` still takes records while it ships the rest (a sampler thread's last samples go out with
them); only a record put after its final sweep is lost.

Every dropped row is a real loss (never stored by this client), counted under its reason
(``DROP_REASONS``; ``stats()["dropped_by"]``). Drops show up in telemetry too: at most every
``report_drops_s`` (and at close) the client ships a ``telemetry_dropped`` event (labels of the
latest record; detail: ``where: "client"``, ``dropped``: rows lost since the last event,
``reasons``: those rows per reason, ``last_error``, and the running totals); the worker reports
its own losses with ``where: "worker"``. Rows lost while the collector cannot be reached at close,
or put after close, cannot ride an event: they are in the counters only.
A client still open when the interpreter exits is closed then (atexit, ``AT_EXIT_TIMEOUT_S``).

Record now, ship later: with ``telemetry_file=PATH`` (``livestep worker run --telemetry-file``) the
sender thread appends each batch it cannot deliver -- every batch when no URL is given; else one
given up after retries, one still unsent when ``close`` runs out of time, or one whose token the
collector refused (401/403) -- to a telemetry file (collector/telemetry_file.py) with the batch's
Idempotency-Key, counted in ``filed``, not in ``dropped``. ``livestep replay PATH --collector URL``
ships them later under the same keys (collector/replay.py). Writing the file happens in the sender
thread only: it never blocks or fails a step (a failed write is a loss, reason ``file_error``).

Imports only pyarrow, httpx, orjson, ``collector.records``, ``collector.telemetry_file`` and ``collector.weak``
(no server code): the GPU machine has no fastapi/chdb. ``NullClient`` has the same interface and ships nothing ("no collector").
This module is the queue and the sender thread (batching, close, the file fallback); one POST and its
retries are collector/client_http.py's, the counters and the drop event collector/client_ledger.py's
(their public names are importable from here too), and the retry policy ``RetryPolicy``. It stays
one module because ``put``/``flush``/``close`` and the sender thread share one lock and one close protocol
(the deadline, the final sweep, rows abandoned in flight); apart, that protocol would be spread over two
files.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Self

from collector import records
from collector.client_http import (  # noqa: F401 (re-exported: the worker, bench and tests import them here)
    ARROW_CONTENT_TYPE,
    INGEST_PATH,
    BatchPoster,
    ClientConfigError,
    RetryPolicy,
    encode_arrow,
    encode_rows,
    ingest_url,
    retry_after_s,
)
from collector.client_ledger import DROP_REASONS, FILED_INSTEAD, DropReporter, Ledger  # noqa: F401 (as above)
from collector.telemetry_file import TelemetryFileWriter
from collector.weak import weak_method

log = logging.getLogger("livestep.client")

_KINDS = frozenset(records.RECORD_KINDS)

_LIVE: weakref.WeakSet[TelemetryClient] = weakref.WeakSet()
AT_EXIT_TIMEOUT_S = 2.0
FILE_GRACE_S = 30.0  # close(): the most it waits past its deadline for the telemetry file's writes


@atexit.register
def _close_at_exit() -> None:
    """A process that exits without ``close()`` still ships what it buffered (briefly, bounded)."""
    for client in list(_LIVE):
        client.close(timeout_s=AT_EXIT_TIMEOUT_S)



def _ledger_counter(name: str, doc: str | None = None) -> property:
    """A read-only client attribute that is the ledger's counter ``name`` (collector/client_ledger.py)."""
    return property(lambda self: getattr(self._ledger, name), doc=doc)


class TelemetryClient:
    """Batches records in a background thread and ships them to the collector (see module doc).

    ``url`` None: no collector, every batch goes to ``telemetry_file`` (one of the two is needed).
    Counters (rows unless named otherwise): ``sent`` acked by the collector; ``filed`` written to
    the telemetry file (to be replayed: not lost); ``dropped`` never stored, per reason in
    ``stats()["dropped_by"]`` (``DROP_REASONS``); ``failed_batches`` batches lost (refused, given
    up); ``retries`` attempts after the first.
    """

    def __init__(
        self,
        url: str | None,
        token: str | None = None,
        batch_rows: int = 1000,
        flush_interval_s: float = 0.5,
        max_queue: int = 100_000,
        *,
        timeout_s: float = 10.0,
        give_up_after_s: float = 60.0,
        max_attempts: int = 20,
        backoff_base_s: float = 0.1,
        backoff_max_s: float = 5.0,
        max_retry_after_s: float = 30.0,
        report_drops_s: float | None = 10.0,
        telemetry_file: str | Path | None = None,
    ):
        policy = RetryPolicy(timeout_s, give_up_after_s, max_attempts, backoff_base_s, backoff_max_s,
                             max_retry_after_s)
        checks = {"batch_rows": batch_rows >= 1, "flush_interval_s": flush_interval_s > 0, "max_queue": max_queue >= 1,
                  "report_drops_s": report_drops_s is None or report_drops_s > 0}
        bad = [name for name, ok in checks.items() if not ok] + policy.invalid()
        if bad:
            raise ClientConfigError(
                f"invalid {', '.join(bad)}: batch_rows, max_queue, max_attempts >= 1; flush_interval_s, "
                f"timeout_s, backoff_base_s > 0; backoff_max_s >= backoff_base_s; others >= 0"
            )
        if not url and telemetry_file is None:
            raise ClientConfigError("a collector URL or a telemetry file is needed (or use NullClient)")
        self.url = ingest_url(url) if url else None
        self.batch_rows = batch_rows
        self.flush_interval_s = flush_interval_s
        self.max_queue = max_queue
        self.report_drops_s = report_drops_s

        try:
            self._file = TelemetryFileWriter(telemetry_file) if telemetry_file is not None else None
        except (OSError, ValueError) as e:
            raise ClientConfigError(f"telemetry file {telemetry_file}: {e}") from e
        self._poster = BatchPoster(self.url, token, policy, log_once=weak_method(self._log_once),
                                   on_retry=weak_method(self._count_retry))  # weakly: no client <-> poster cycle

        self._lock = threading.Lock()  # guards the buffer, the ledger and the flush waiters
        self._queue: deque[tuple[str, dict[str, Any]]] = deque()
        self._ledger = Ledger()
        self._flush_waiters: list[threading.Event] = []
        self._wake = threading.Event()  # the sender has work (a full batch, a flush, close)
        self._closing = False
        self._stopped = False
        self._logged: set[str] = set()
        self._last_error: str | None = None  # why the latest batch was lost
        self._drops = DropReporter(report_drops_s)  # sender thread only
        self._last_ok = True  # the latest batch was acked

        self._thread = threading.Thread(target=self._run, name="livestep-telemetry", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # -- the worker's side: never blocks, never raises -----------------------------------------
    def put(self, kind: str, row: dict[str, Any]) -> None:
        """Queue one record of ``kind`` (a ``records.RECORD_KINDS`` name); drop and count if full."""
        try:
            with self._lock:
                # accepted until the sender's final sweep (``_stopped``): rows put while close() ships
                # the rest go out with it (the sampler thread's last samples, the session's end)
                reason = ("after_close" if self._stopped else "unknown_kind" if kind not in _KINDS
                          else "queue_full" if self._ledger.buffered >= self.max_queue else None)
                if reason is not None:
                    self._ledger.count_drop(reason, 1)
                    return
                self._queue.append((kind, row))
                self._ledger.buffered += 1
                n = len(self._queue)
            if n % self.batch_rows == 0:
                self._wake.set()
        except Exception:  # noqa: BLE001 - put() must never raise into the step loop
            return

    sent = _ledger_counter("sent")
    filed = _ledger_counter("filed", "Rows written to the telemetry file (``livestep replay`` ships them).")
    dropped = _ledger_counter("dropped")
    failed_batches = _ledger_counter("failed_batches")
    retries = _ledger_counter("retries")
    buffered = _ledger_counter("buffered", "Rows put and not yet acked, filed or dropped.")

    def stats(self) -> dict[str, Any]:
        """The counters; ``dropped_by``: rows lost per reason (``DROP_REASONS``), summing to ``dropped``."""
        with self._lock:
            return self._ledger.stats()

    def _count_retry(self) -> None:
        with self._lock:
            self._ledger.retries += 1

    # -- shutdown -------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Ship everything put so far now; True when it was all shipped within ``timeout_s``.

        Never raises. False when the time ran out or a batch was refused or given up meanwhile;
        losses before the call show in ``dropped``/``failed_batches``, not here.
        """
        try:
            done = threading.Event()
            with self._lock:
                if self._stopped:
                    return self._ledger.buffered == 0
                failed_before = self._ledger.failed_batches
                self._flush_waiters.append(done)
            self._wake.set()
            ok = done.wait(max(0.0, timeout_s))
            with self._lock:
                return ok and self._ledger.failed_batches == failed_before
        except Exception:  # noqa: BLE001
            return False

    def close(self, timeout_s: float = 5.0) -> bool:
        """Ship what is buffered (retrying until ``timeout_s`` at most), stop the thread.

        Rows put meanwhile (another thread still producing) are shipped too, up to the final sweep;
        rows still buffered when the time runs out are counted in ``dropped`` (``close_timeout``),
        as are later ``put``s (``after_close``). A request already in flight when the time runs out
        is not cut short: its rows count as ``close_timeout`` now, and move back to ``sent`` (or
        ``filed``) if the collector acks them after all -- the counters never leave a row uncounted.
        With a telemetry file, what is left at the deadline is filed, and close() waits up to
        ``FILE_GRACE_S`` more for those local writes (a request in flight ends first: its timeout). Returns True when every row ever put was
        acked or filed (``dropped == 0``). Idempotent; never raises.
        """
        try:
            with self._lock:
                already = self._closing
                self._closing = True
                self._poster.deadline = min(self._poster.deadline, time.monotonic() + max(0.0, timeout_s))
            if not already:
                self.flush(timeout_s)
            with self._lock:
                self._stopped = True
            self._poster.wake()
            self._wake.set()
            # past the deadline the sender only files what is left (local writes): with a file it gets
            # FILE_GRACE_S for them, so a starved CPU does not turn a filed batch into a loss
            grace = FILE_GRACE_S if self._file is not None else 0.5
            self._thread.join(max(0.0, self._poster.deadline - time.monotonic()) + grace)
            with self._lock:
                if self._ledger.buffered:
                    if self._thread.is_alive():  # a request outlived the deadline: lost unless acked later
                        self._ledger.abandoned = self._ledger.buffered
                    else:
                        self._queue.clear()
                        self._ledger.buffered = 0
                    self._ledger.count_drop("close_timeout", self._ledger.buffered or self._ledger.abandoned)
                ok = self._ledger.buffered == 0 and self._ledger.dropped == 0
            return ok
        except Exception:  # noqa: BLE001
            return False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the sender thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:  # the sender's own resources: it is the file's only writer
            self._poster.close()
            if self._file is not None:
                try:
                    self._file.close()
                except Exception as e:  # noqa: BLE001 - what was written stays readable (no end marker)
                    self._log_once("file_close", "telemetry file %s not closed cleanly: %r", self._file.path, e)

    def _loop(self) -> None:
        pending: dict[str, list[dict[str, Any]]] = {k: [] for k in records.RECORD_KINDS}
        first_at: dict[str, float] = {}
        while True:
            now = time.monotonic()
            waits = [first_at[k] + self.flush_interval_s - now for k in first_at]
            self._wake.wait(max(0.0, min(waits, default=self.flush_interval_s)))
            self._wake.clear()
            with self._lock:
                taken, self._queue = self._queue, deque()
                waiters, self._flush_waiters = self._flush_waiters, []
                stopping = self._stopped
            now = time.monotonic()
            for kind, row in taken:
                pending[kind].append(row)
                first_at.setdefault(kind, now)
            if taken and self.report_drops_s is not None:
                self._drops.remember_labels(taken[-1][1])
            if self._drop_event_due(now, force=stopping):
                pending["event"].append(self._drop_event())
                first_at.setdefault("event", now)
            force = bool(waiters) or stopping or self._closing
            for kind in records.RECORD_KINDS:
                rows = pending[kind]
                while len(rows) >= self.batch_rows:
                    self._ship(kind, rows[: self.batch_rows])
                    rows = pending[kind] = rows[self.batch_rows :]
                    first_at[kind] = now
                if rows and (force or now - first_at[kind] >= self.flush_interval_s):
                    self._ship(kind, rows)
                    pending[kind] = []
                if not pending[kind]:
                    first_at.pop(kind, None)
            for w in waiters:
                w.set()
            if stopping:
                return

    # -- dropped records show up in telemetry ------------------------------------------------------
    def _drop_event_due(self, now: float, force: bool) -> bool:  # sender thread
        # closing with the collector unreachable: the event would be lost as well
        hopeless = self._closing and self._file is None and (not self._last_ok or now >= self._poster.deadline)
        return self._drops.due(now, self._ledger.dropped, force, hopeless)

    def _drop_event(self) -> dict[str, Any]:
        """A ``telemetry_dropped`` event: rows lost since the last one (it rides the same path)."""
        with self._lock:
            dropped, failed, by = self._ledger.dropped, self._ledger.failed_batches, dict(self._ledger.dropped_by)
            self._ledger.buffered += 1
        return self._drops.event(dropped, failed, by, self._last_error)

    def _ship(self, kind: str, rows: list[dict[str, Any]]) -> None:
        """Send one batch until acked, refused or given up; settle the counters. Never raises."""
        n, settled = len(rows), 0
        key = uuid.uuid4().hex  # the batch's Idempotency-Key, fixed before its first attempt
        try:
            body, n_ok = encode_rows(kind, rows, self._log_once)
            self._settle(dropped=n - n_ok, reason="unencodable")
            settled = n - n_ok
            if body is None:
                return
            lost = self._post(kind, body, n_ok, key) if self.url else "no_collector"
            if lost in FILED_INSTEAD and self._file is not None:
                lost = self._to_file(key, kind, n_ok, body)
                if lost is None:
                    self._last_ok = True
                    self._settle(filed=n_ok)
                    settled = n
                    return
            self._last_ok = lost is None
            if lost is None:
                self._settle(sent=n_ok)
            else:
                self._settle(dropped=n_ok, reason=lost, failed=1)
            settled = n
        except Exception as e:  # noqa: BLE001 - the sender thread must survive anything
            self._log_once(
                f"internal:{type(e).__name__}", "telemetry batch of %d %s rows lost: %r", n, kind, e
            )
            self._last_error = f"internal: {type(e).__name__}: {e}"[:300]
            self._settle(dropped=n - settled, reason="internal", failed=1)

    def _settle(self, sent: int = 0, dropped: int = 0, reason: str = "", failed: int = 0, filed: int = 0) -> None:
        with self._lock:
            self._ledger.settle(sent, dropped, reason, failed, filed)

    def _to_file(self, key: str, kind: str, n: int, body: bytes) -> str | None:
        """Append the batch to the telemetry file; None once written, else ``file_error``."""
        try:
            self._file.write(key, kind, n, body)
            return None
        except Exception as e:  # noqa: BLE001 - disk full, file closed...: a loss, never an exception
            self._log_once("file_error", "telemetry file %s: batch of %d %s rows lost: %r", self._file.path, n, kind, e)
            self._last_error = f"telemetry file: {type(e).__name__}: {e}"[:300]
            return "file_error"

    def post_batch(self, kind: str, body: bytes, rows: int, key: str) -> tuple[str | None, dict | None]:
        """POST one encoded batch under ``key`` now, in the caller's thread, with this client's retry
        policy: ``(None, the collector's ack)`` once acked, else ``(why it was lost, None)`` with the
        error in ``last_error``. For ``livestep replay``; touches no counter but ``retries``."""
        if self.url is None:
            return "no_collector", None
        lost = self._post(kind, body, rows, key)
        if lost is not None:
            return lost, None
        try:
            return None, self._poster.last_response.json()
        except ValueError:
            return None, {}

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def _post(self, kind: str, body: bytes, n: int, key: str) -> str | None:
        """``BatchPoster.post``: None once acked, else why it was lost (the error in ``_last_error``)."""
        lost = self._poster.post(kind, body, n, key)
        if lost is not None:
            self._last_error = self._poster.last_error
        return lost

    def _log_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)


class NullClient:
    """The same interface as ``TelemetryClient``; ships nothing (no collector configured)."""

    url = None
    sent = 0
    filed = 0
    dropped = 0
    failed_batches = 0
    retries = 0
    buffered = 0

    def put(self, kind: str, row: dict[str, Any]) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"sent": 0, "filed": 0, "dropped": 0, "failed_batches": 0, "retries": 0, "buffered": 0,
                "dropped_by": {}}

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        return True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def make_client(url: str | None, token: str | None = None, **kwargs: Any) -> TelemetryClient | NullClient:
    """A ``TelemetryClient`` for ``url`` and/or ``telemetry_file=``, or a ``NullClient`` when neither is given."""
    if url or kwargs.get("telemetry_file") is not None:
        return TelemetryClient(url, token=token, **kwargs)
    return NullClient()
