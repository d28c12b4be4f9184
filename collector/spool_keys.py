"""The spool's batch ids, their namespaces, and the index of the ids it has seen (deduplication).

    bid = keyed_id(scope, key, digest)     # "<token scope>/<key>#<body digest>": a client's Idempotency-Key
    bid = unkeyed_id(digest)               # "sha256:<body digest>": a batch sent without a key
    index = KeyIndex(max_ids=1_000_000)
    index.remember(bid, rows); index.known(bid); index.other_batch_for_key(bid, inflight)

Three namespaces, told apart by form (one declaration each, below): unkeyed ids, keyed ids (scoped
per ingest token, with the body's digest so a key reused for another body is a 409), and the bare
keys a previous release spooled before keys were scoped. A client's key is looked up only among its
own token's keyed ids and among previous-release ids, never as a spool id of another namespace: a
key spelled ``sha256:<digest>`` or like another token's scoped id is just a key (issue 30). A
previous release's bare key is a duplicate only for the same rows: the index keeps a digest of each
such batch's rows (``content_digest``, computed when its segment is read at start, kept in
``keys.log`` after the segment is deleted); one without a digest (its segment gone before this
release) is never a duplicate, and the batch is stored under its scoped id.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import orjson
import pyarrow as pa

from collector.records import RECORD_KINDS, conform

_UNKEYED = re.compile(r"sha256:[0-9a-f]{64}")
_KEYED = re.compile(r"(?:open|[0-9a-f]{16})/.+#[0-9a-f]{32}", re.DOTALL)
KEY_DIGEST_CHARS = 32  # of a keyed id's body digest


def unkeyed_id(digest: str) -> str:
    """The id of a batch sent without a key: its body's sha256."""
    return f"sha256:{digest}"


def keyed_id(scope: str, key: str, digest: str) -> str:
    """The id of a keyed batch: the sender's token scope, its key, its body's digest."""
    return f"{scope}/{key}#{digest[:KEY_DIGEST_CHARS]}"


def key_of(batch_id: str) -> str | None:
    """The ``<scope>/<key>`` part of a keyed batch id; None for any other id."""
    return batch_id.rpartition("#")[0] if _KEYED.fullmatch(batch_id) else None


def is_previous_release(batch_id: str) -> bool:
    """An id of neither form: a bare key a release before scoped keys spooled."""
    return _UNKEYED.fullmatch(batch_id) is None and _KEYED.fullmatch(batch_id) is None


def content_digest(tables: Mapping[str, pa.Table]) -> str:
    """A digest of a batch's rows (per kind, as the canonical schema holds them), whatever their encoding
    on the wire or in the spool: equal for the same rows sent as JSON or Arrow, by any release."""
    h = hashlib.sha256()
    for kind in RECORD_KINDS:
        t = tables.get(kind)
        if t is None or not t.num_rows:
            continue
        h.update(kind.encode() + b"\0")
        h.update(orjson.dumps(conform(kind, t).to_pylist(), default=str))
    return h.hexdigest()


class KeyIndex:
    """The ids of batches spooled (stored or not), newest last, at most ``max_ids``. Not thread-safe:
    the spool calls it under its lock."""

    def __init__(self, max_ids: int):
        self.max_ids = max_ids
        self._rows: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._by_key: dict[str, str] = {}  # ``key_of`` -> that batch id
        self._previous: dict[str, str | None] = {}  # previous release's bare key -> digest of its rows

    def remember(self, batch_id: str, rows: dict[str, int], digest: str | None = None) -> None:
        self._rows[batch_id] = rows
        self._rows.move_to_end(batch_id)
        key = key_of(batch_id)
        if key is not None:
            self._by_key[key] = batch_id
        elif is_previous_release(batch_id):
            self._previous[batch_id] = digest or self._previous.get(batch_id)
        while len(self._rows) > self.max_ids:
            old, _ = self._rows.popitem(last=False)
            k = key_of(old)
            if k is not None and self._by_key.get(k) == old:
                del self._by_key[k]
            self._previous.pop(old, None)

    def known(self, batch_id: str) -> dict[str, int] | None:
        """Rows per kind of a batch spooled under exactly this id."""
        return self._rows.get(batch_id)

    def __contains__(self, batch_id: str) -> bool:
        return batch_id in self._rows

    def other_batch_for_key(self, batch_id: str, inflight: Iterable[str]) -> str | None:
        """Another batch id with ``batch_id``'s key (its body differs), spooled or in ``inflight``."""
        key = key_of(batch_id)
        if key is None:
            return None
        other = self._by_key.get(key)
        if other is None:
            other = next((b for b in inflight if key_of(b) == key), None)
        return other if other != batch_id else None

    def previous_release_key(self, key: str) -> bool:
        return key in self._previous

    def previous_release_duplicate(self, key: str, tables: Mapping[str, pa.Table]) -> dict[str, int] | None:
        """Rows of the batch a previous release spooled under the bare ``key`` when ``tables`` are the
        same rows; None otherwise (no such batch, other rows, or rows no longer known)."""
        if key not in self._previous:
            return None
        digest = self._previous[key]
        if digest is None or digest != content_digest(tables):
            return None
        return self._rows.get(key)

    def wants_digest(self, batch_id: str) -> bool:
        """A previous release's id whose rows' digest is not known yet (read it from the segment)."""
        return is_previous_release(batch_id) and self._previous.get(batch_id) is None

    # -- keys.log: one line per id whose segment was deleted ---------------------------------------
    def log_line(self, batch_id: str, rows: dict[str, int]) -> bytes:
        digest = self._previous.get(batch_id)
        return batch_id.encode() + b"\t" + orjson.dumps(rows) + (b"\t" + digest.encode() if digest else b"") + b"\n"

    def load_line(self, line: bytes) -> None:
        """One ``keys.log`` line (a torn or malformed one is skipped: it never completed)."""
        parts = line.split(b"\t")
        try:
            if len(parts) not in (2, 3):
                return
            self.remember(parts[0].decode(), orjson.loads(parts[1]), parts[2].decode() if len(parts) == 3 else None)
        except (ValueError, orjson.JSONDecodeError):
            return

    def newest(self) -> list[tuple[str, dict[str, int]]]:
        """Every id remembered, oldest first (``keys.log``'s compaction)."""
        return list(self._rows.items())
