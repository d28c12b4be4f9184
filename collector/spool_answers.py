"""What the spool answers a submitted batch: an ``Ack`` once it is durable, or a refusal the ingest route
turns into a status (``SpoolFullError``: 429 with Retry-After; ``KeyConflictError``: 409; any other
``SpoolError``: 503)."""

from __future__ import annotations

from dataclasses import dataclass


class SpoolError(Exception):
    """The spool cannot store a batch (disk error, closed spool)."""


class KeyConflictError(SpoolError):
    """An Idempotency-Key already names another batch (same key, different body): nothing is stored."""

    def __init__(self, key: str):
        super().__init__(f"Idempotency-Key {key!r} was already used for a different batch; a key names one "
                         "batch (send the same body on a retry, a new key for a new batch)")


class SpoolFullError(SpoolError):
    """The spool holds more than its bound of unstored bytes; retry after ``retry_after_s``."""

    def __init__(self, depth: int, bound: int, retry_after_s: int):
        super().__init__(
            f"spool holds {depth} bytes of batches not yet stored (bound {bound}); retry after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Ack:
    """What the collector answers once a batch is durable."""

    batch_id: str
    rows: dict[str, int]
    duplicate: bool
    seq: int
