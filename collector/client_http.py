"""The shipping client's way to the collector: the endpoint, the Arrow body, one POST and its retries.

    poster = BatchPoster(ingest_url("http://127.0.0.1:8000"), token, timeout_s=10.0, ...)
    lost = poster.post("step", encode_arrow("step", rows), len(rows), key)   # None once acked

``post`` sends one body under its ``Idempotency-Key``; connection errors, 5xx and 429 (``Retry-After``
honoured) are retried under the same key with exponential backoff and full jitter, until
``give_up_after_s`` or ``max_attempts``, or ``deadline`` (set by the client's ``close``); a 4xx other
than 429 is never retried. A loss is returned as its reason (a ``DROP_REASONS`` key of
collector/client_ledger.py), the error itself in ``last_error``. Used by collector/client.py's sender
thread (and, through ``TelemetryClient.post_batch``, by ``livestep replay``).
"""

from __future__ import annotations

import email.utils
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pyarrow as pa

from collector import records

ARROW_CONTENT_TYPE = "application/vnd.apache.arrow.stream"
INGEST_PATH = "/v1/telemetry"


class ClientConfigError(ValueError):
    """A TelemetryClient argument out of its valid range."""


def ingest_url(url: str) -> str:
    """``http://host:port`` (or ``.../v1/telemetry``) -> the full ingest endpoint."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ClientConfigError(f"collector URL {url!r} is not valid; valid: http(s)://host[:port][/prefix]")
    path = parts.path.rstrip("/")
    if not path.endswith(INGEST_PATH):
        path += INGEST_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def encode_arrow(kind: str, rows: list[dict[str, Any]]) -> bytes:
    """Rows of one kind -> an Arrow IPC stream body (schema metadata names the kind)."""
    table = records.to_arrow(kind, rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def encode_rows(kind: str, rows: list[dict[str, Any]], log_once: Callable[..., None]) -> tuple[bytes | None, int]:
    """A batch's Arrow body and its row count; rows that cannot be encoded are left out (and logged)."""
    try:
        return encode_arrow(kind, rows), len(rows)
    except Exception:  # noqa: BLE001 - find the bad rows, keep the good ones
        good = []
        for r in rows:
            try:
                records.to_arrow(kind, [r])
                good.append(r)
            except Exception as e:  # noqa: BLE001
                log_once(f"encode:{kind}", "dropping %s row(s) that do not fit the Arrow schema: %r", kind, e)
        return (encode_arrow(kind, good), len(good)) if good else (None, 0)


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header (seconds or an HTTP date) -> seconds to wait, or None."""
    if not value:
        return None
    value = value.strip()
    try:
        s = float(value)
        return s if math.isfinite(s) and s >= 0 else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


@dataclass(frozen=True)
class RetryPolicy:
    """How one batch is retried (the module docstring): each attempt's timeout, when to give up (time and
    attempts), the backoff (exponential from ``backoff_base_s`` to ``backoff_max_s``, full jitter) and the
    longest ``Retry-After`` honoured."""

    timeout_s: float = 10.0
    give_up_after_s: float = 60.0
    max_attempts: int = 20
    backoff_base_s: float = 0.1
    backoff_max_s: float = 5.0
    max_retry_after_s: float = 30.0

    def invalid(self) -> list[str]:
        """The names of the fields out of their valid range (none: a valid policy)."""
        checks = {"timeout_s": self.timeout_s > 0, "give_up_after_s": self.give_up_after_s >= 0,
                  "max_attempts": self.max_attempts >= 1, "backoff_base_s": self.backoff_base_s > 0,
                  "backoff_max_s": self.backoff_max_s >= self.backoff_base_s,
                  "max_retry_after_s": self.max_retry_after_s >= 0}
        return [name for name, ok in checks.items() if not ok]


class BatchPoster:
    """POSTs encoded batches to ``url`` over one keep-alive connection, with its ``RetryPolicy``.

    ``deadline`` (monotonic seconds) is when the owner's ``close`` must be done: no attempt starts
    after it and a backoff ends at it; ``wake()`` cuts a backoff sleep short so it sees a new one.
    ``log_once(key, msg, *args)`` logs a warning once per key; ``on_retry()`` counts an attempt after
    the first. ``last_response`` is the latest 2xx (its body is the collector's ack).
    """

    def __init__(self, url: str | None, token: str | None, policy: RetryPolicy, *,
                 log_once: Callable[..., None], on_retry: Callable[[], None]):
        self.url = url
        self.policy = policy
        self.deadline = math.inf
        self.last_error: str | None = None
        self.last_response: httpx.Response | None = None
        self._log_once = log_once
        self._on_retry = on_retry
        self._interrupt = threading.Event()
        headers = {"Content-Type": ARROW_CONTENT_TYPE, "User-Agent": "livestep-client/1"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(headers=headers, timeout=policy.timeout_s)

    def wake(self) -> None:
        """End a backoff sleep now (the deadline moved)."""
        self._interrupt.set()

    def close(self) -> None:
        self._http.close()

    def post(self, kind: str, body: bytes, n: int, key: str) -> str | None:
        """POST one body under its idempotency key, retrying; None once acked, else why it was lost
        (a ``DROP_REASONS`` key; the error itself in ``last_error``)."""
        started = time.monotonic()
        attempt = 0
        reason = "no attempt"
        while True:
            if time.monotonic() >= self.deadline:  # close() ran out of time: not even one more try
                self.last_error = f"close() ran out of time after {attempt} attempt(s) ({reason})"
                return "close_timeout"
            attempt += 1
            end = min(started + self.policy.give_up_after_s, self.deadline)
            retry_after = None
            try:
                timeout = max(0.05, min(self.policy.timeout_s, self.deadline - time.monotonic()))
                r = self._http.post(self.url, content=body, headers={"Idempotency-Key": key}, timeout=timeout)
            except httpx.HTTPError as e:
                reason = f"{type(e).__name__}: {e}"
            else:
                if 200 <= r.status_code < 300:
                    self.last_response = r
                    return None
                if r.status_code == 429 or r.status_code >= 500:
                    reason = f"HTTP {r.status_code}"
                    retry_after = retry_after_s(r.headers.get("Retry-After"))
                    if retry_after is not None:
                        retry_after = min(retry_after, self.policy.max_retry_after_s)
                else:
                    self._log_once(
                        f"status:{r.status_code}",
                        "collector refused a %s batch of %d rows with HTTP %d (not retried): %s",
                        kind,
                        n,
                        r.status_code,
                        r.text[:500],
                    )
                    self.last_error = f"HTTP {r.status_code}: {r.text[:200]}"
                    return "unauthorized" if r.status_code in (401, 403) else "refused"
            delay = random.uniform(0.0, min(self.policy.backoff_max_s, self.policy.backoff_base_s * 2 ** (attempt - 1)))
            if retry_after is not None:
                delay = max(delay, retry_after)
            if attempt < self.policy.max_attempts and time.monotonic() + delay > end and end == self.deadline:
                self.last_error = f"close() ran out of time after {attempt} attempt(s) ({reason})"
                return "close_timeout"  # close()'s deadline came before the give-up time
            if attempt >= self.policy.max_attempts or time.monotonic() + delay > end:
                self._log_once(
                    "give_up",
                    "giving up on a %s batch of %d rows after %d attempts (%s); later give-ups are counted "
                    "in failed_batches, not logged",
                    kind,
                    n,
                    attempt,
                    reason,
                )
                self.last_error = f"gave up after {attempt} attempt(s): {reason}"[:300]
                return "gave_up"
            self._on_retry()
            self._sleep(delay)

    def _sleep(self, delay: float) -> None:
        """Back off for ``delay`` s, or less when close() sets a deadline that comes sooner."""
        wake_at = time.monotonic() + delay
        while True:
            left = min(wake_at, self.deadline) - time.monotonic()
            if left <= 0:
                return
            if self._interrupt.wait(left):
                self._interrupt.clear()
