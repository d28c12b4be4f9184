"""The spool's storage: append-only, fsync'd segment files of records, and the payload they hold.

    storage = SegmentStorage(dir, segment_bytes=64 << 20)
    last_seq = storage.scan(on_record)                # at start: every record, torn tails truncated
    storage.open_active(next_seq)
    entries = storage.append([(seq, batch_id, rows, payload), ...])   # one write + one fsync
    payload = storage.read(entry)                     # crc-checked
    storage.rotate_if_stored(committed_seq, min_bytes); storage.delete(storage.stored(committed_seq))

Layout of ``dir``: ``seg-<first seq>.log`` segments of records ``[magic u32 len u64 seq u32
crc32][payload]``; a payload is a batch id and one Arrow IPC stream per kind (``encode_payload``).
A torn tail (a crash mid-write: never acked) is truncated at start; a failed append is truncated
away at once, so a segment stays well-formed. This is the storage of the OpenTelemetry collector's
persistent queue (exporterhelper): it knows records and files, not batches, keys or the store.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

from collector.records import ARROW_SCHEMAS, RECORD_KINDS

MAGIC = b"LSP1"
HEADER = struct.Struct("<4sIQI")  # magic, payload length, seq, crc32(payload)
_SEG_PREFIX, _SEG_SUFFIX = "seg-", ".log"


class StorageCorruptError(Exception):
    """A record read back does not match its header (seq or crc)."""


@dataclass
class Entry:
    """One stored record: where it lies and what batch it holds."""

    seq: int
    segment: Path
    offset: int  # of the payload
    length: int  # of the payload
    batch_id: str
    rows: dict[str, int]
    appended_at: float = field(default_factory=time.monotonic)
    nrows: int = field(init=False)

    def __post_init__(self) -> None:
        self.nrows = sum(self.rows.values())

    @property
    def nbytes(self) -> int:
        return HEADER.size + self.length


# -- durable files -------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically with ``data`` (tmp + fsync + rename + fsync dir)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def append_durable(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def spool_uid(directory: Path | str) -> str | None:
    """The spool's identity (``spool.id``: part of every deduplication token), None if it has none yet."""
    p = Path(directory) / "spool.id"
    return (p.read_text().strip() or None) if p.exists() else None


def ensure_spool_uid(directory: Path) -> str:
    """The spool's identity, made (durably) the first time."""
    uid = spool_uid(directory)
    if uid is None:
        uid = uuid.uuid4().hex
        write_durable(directory / "spool.id", uid.encode())
    return uid


# -- the payload ---------------------------------------------------------------------------------
class IpcStream(NamedTuple):
    """An already-encoded Arrow IPC stream of a kind's canonical schema (spooled as is, not re-encoded);
    ``table``, when given, is the same rows decoded (kept for the writer, which then skips decoding)."""

    data: bytes
    num_rows: int
    table: pa.Table | None = None


def encode_payload(batch_id: str, tables: dict[str, pa.Table | IpcStream]) -> tuple[bytes, dict[str, int]]:
    """Batch id + one Arrow IPC stream per kind -> payload bytes, rows per kind."""
    bid = batch_id.encode()
    kinds = [k for k in RECORD_KINDS if k in tables and tables[k].num_rows]
    parts = [struct.pack("<H", len(bid)), bid, struct.pack("<B", len(kinds))]
    rows = {}
    for kind in kinds:
        t = tables[kind]
        if isinstance(t, IpcStream):
            ipc = t.data
        else:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, t.schema) as w:
                w.write_table(t)
            ipc = sink.getvalue().to_pybytes()
        kb = kind.encode()
        parts += [struct.pack("<B", len(kb)), kb, struct.pack("<II", t.num_rows, len(ipc)), ipc]
        rows[kind] = t.num_rows
    return b"".join(parts), rows


def decode_head(payload: bytes) -> tuple[str, dict[str, int], list[tuple[str, int, int]]]:
    """Payload -> (batch id, rows per kind, [(kind, ipc offset, ipc length)])."""
    (n,) = struct.unpack_from("<H", payload, 0)
    pos = 2
    batch_id = payload[pos : pos + n].decode()
    pos += n
    (nk,) = struct.unpack_from("<B", payload, pos)
    pos += 1
    rows, parts = {}, []
    for _ in range(nk):
        (kl,) = struct.unpack_from("<B", payload, pos)
        pos += 1
        kind = payload[pos : pos + kl].decode()
        pos += kl
        nrows, ln = struct.unpack_from("<II", payload, pos)
        pos += 8
        rows[kind] = nrows
        parts.append((kind, pos, ln))
        pos += ln
    return batch_id, rows, parts


# each kind's schema as an IPC stream's first message, byte for byte (what our writers emit)
_SCHEMA_MESSAGES = tuple((ARROW_SCHEMAS[k].serialize().to_pybytes(), ARROW_SCHEMAS[k]) for k in RECORD_KINDS)
_HEAD = max(len(m) for m, _ in _SCHEMA_MESSAGES)


def read_ipc_stream(data: bytes | pa.Buffer) -> tuple[pa.Schema, pa.Table, int]:
    """An Arrow IPC stream -> (schema, table, bytes consumed). A stream that opens with a canonical
    schema message (byte for byte) skips decoding the schema: only its record batches are read."""
    br = pa.BufferReader(data)
    head = bytes(memoryview(data)[:_HEAD])
    for message, schema in _SCHEMA_MESSAGES:
        if head.startswith(message):
            br.seek(len(message))
            reader = pa.ipc.MessageReader.open_stream(br)
            batches = []
            while True:
                try:
                    batches.append(pa.ipc.read_record_batch(reader.read_next_message(), schema))
                except StopIteration:
                    return schema, pa.Table.from_batches(batches, schema), br.tell()
    reader = pa.ipc.open_stream(br)
    return reader.schema, reader.read_all(), br.tell()


def decode_payload(payload: bytes) -> tuple[str, dict[str, pa.Table]]:
    batch_id, _, parts = decode_head(payload)
    buf = pa.py_buffer(payload)
    tables = {kind: read_ipc_stream(buf.slice(off, ln))[1] for kind, off, ln in parts}
    return batch_id, tables


# -- the segments --------------------------------------------------------------------------------
class SegmentStorage:
    """The segment files of one spool directory. Thread-safe: appends, rotation and deletion hold one
    lock (reads open their own handles)."""

    def __init__(self, directory: Path, segment_bytes: int):
        self.dir = Path(directory)
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._segments: dict[Path, list[Entry]] = {}  # every segment's records, in seq order
        self._active_path: Path | None = None
        self._active = None

    def _paths(self) -> list[Path]:
        return sorted(self.dir.glob(f"{_SEG_PREFIX}*{_SEG_SUFFIX}"))

    def scan(self, on_record: Callable[[Entry, bytes], None]) -> int:
        """Index every record of every segment (``on_record(entry, payload)`` for each, in order);
        truncate torn tails. Returns the highest seq found (0: none)."""
        last = 0
        for seg in self._paths():
            recs = self._segments.setdefault(seg, [])
            with open(seg, "r+b") as f:
                data = f.read()
                pos = good_end = 0
                while pos + HEADER.size <= len(data):
                    magic, ln, seq, crc = HEADER.unpack_from(data, pos)
                    start = pos + HEADER.size
                    if magic != MAGIC or start + ln > len(data) or zlib.crc32(data[start : start + ln]) != crc:
                        break
                    payload = data[start : start + ln]
                    batch_id, rows, _ = decode_head(payload)
                    entry = Entry(seq, seg, start, ln, batch_id, rows)
                    recs.append(entry)
                    on_record(entry, payload)
                    last = max(last, seq)
                    pos = good_end = start + ln
                if good_end < len(data):  # torn tail: never acked (the fsync did not complete)
                    f.truncate(good_end)
                    f.flush()
                    os.fsync(f.fileno())
        return last

    def open_active(self, first_seq: int) -> None:
        """Start appending to a new segment named for ``first_seq`` (call once, after ``scan``)."""
        with self._lock:
            self._open(first_seq)

    def _open(self, first_seq: int) -> None:
        path = self.dir / f"{_SEG_PREFIX}{first_seq:020d}{_SEG_SUFFIX}"
        self._active = open(path, "ab", buffering=0)  # noqa: SIM115 (the active segment, held open until rotated)
        fsync_dir(self.dir)
        self._active_path = path
        self._segments.setdefault(path, [])

    def append(self, records: list[tuple[int, str, dict[str, int], bytes]]) -> list[Entry]:
        """Write ``(seq, batch id, rows, payload)`` records: one write, one fsync. On any failure the
        partial write is truncated away and the error raised (nothing of it stays)."""
        with self._lock:
            buf = bytearray()
            base = self._active.tell()
            new = []
            for seq, batch_id, rows, payload in records:
                buf += HEADER.pack(MAGIC, len(payload), seq, zlib.crc32(payload))
                new.append(Entry(seq, self._active_path, base + len(buf), len(payload), batch_id, rows))
                buf += payload
            try:
                view = memoryview(buf)
                while view:  # unbuffered: a failed write leaves nothing behind in a buffer
                    view = view[self._active.write(view):]
                os.fsync(self._active.fileno())
            except BaseException:
                try:  # drop a partial write so the segment stays well-formed (and the offset with it)
                    self._active.truncate(base)
                    self._active.seek(base)
                except OSError:
                    pass
                raise
            self._segments[self._active_path].extend(new)
            if self._active.tell() >= self.segment_bytes:
                self._rotate(new[-1].seq + 1)
            return new

    def _rotate(self, next_seq: int) -> None:
        self._active.close()
        self._open(next_seq)

    def rotate_if_stored(self, committed_seq: int, min_bytes: int, next_seq: int) -> bool:
        """Rotate the active segment away when every record in it is stored (seq <= ``committed_seq``)
        and it holds ``min_bytes``: its space can then be given back like any stored segment's."""
        with self._lock:
            recs = self._segments.get(self._active_path, [])
            if not recs or recs[-1].seq > committed_seq or self._active.tell() < min_bytes:
                return False
            self._rotate(next_seq)
            return True

    def stored(self, committed_seq: int) -> dict[Path, list[Entry]]:
        """The non-active segments whose every record is stored (seq <= ``committed_seq``)."""
        with self._lock:
            return {s: list(recs) for s, recs in self._segments.items()
                    if s != self._active_path and all(e.seq <= committed_seq for e in recs)}

    def delete(self, segments: list[Path]) -> None:
        """Remove stored segments (durably)."""
        with self._lock:
            for s in segments:
                self._segments.pop(s, None)
        for s in segments:
            s.unlink(missing_ok=True)
        if segments:
            fsync_dir(self.dir)

    def read(self, entry: Entry, handle=None) -> bytes:
        """An entry's payload read back from its segment (crc-checked). ``handle``: an open ``rb`` file
        of ``entry.segment`` to reuse."""
        f = handle if handle is not None else open(entry.segment, "rb")  # noqa: SIM115 (closed below)
        try:
            f.seek(entry.offset - HEADER.size)
            head = f.read(HEADER.size)
            payload = f.read(entry.length)
        finally:
            if handle is None:
                f.close()
        magic, _, seq, crc = HEADER.unpack(head)
        if magic != MAGIC or seq != entry.seq or zlib.crc32(payload) != crc:
            raise StorageCorruptError(f"spool record {entry.seq} in {entry.segment.name} is corrupt")
        return payload

    def close(self) -> None:
        with self._lock:
            if self._active is not None:
                self._active.close()
