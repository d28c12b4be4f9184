"""The durable spool: accepted batches land here (fsync'd) before the collector acks them.

    spool = Spool(dir, max_bytes=1 << 30)
    ack = spool.submit("batch-1", {"step": arrow_table}).result()   # durable once this returns
    entries = spool.take(max_rows=200_000)         # the writer: oldest uncommitted batches, in order
    spool.log_intent(entries[0].seq, entries[-1].seq); ...insert...; spool.mark_committed(entries[-1].seq)

Layout of ``dir``: ``seg-<first seq>.log`` append-only segments of records
``[magic u32 len u64 seq u32 crc32][payload]`` (payload = batch id + one Arrow IPC stream per kind),
``writer.log`` (``intent a b`` before a block insert, ``split a b <kinds>`` before the block goes
in batch by batch (the kinds already stored whole, or ``-``), ``commit b`` after it: a replay after a
crash re-forms exactly the same block, the same way, so its deduplication tokens match), ``keys.log`` (ids of
batches whose segment was deleted, so a late retry is still recognised) and ``spool.id`` (this
spool's identity, part of every deduplication token). Appends are group-committed: one write and
one fsync for every batch queued meanwhile. A torn tail (crash mid-write) is truncated at start;
it was never acked. The writer gets the batches this process appended from memory, as they were
validated (up to ``RECENT_BYTES``); after a restart, or beyond that bound, they are read back from
their segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

from collector.records import ARROW_SCHEMAS, RECORD_KINDS
from collector.spool_keys import KeyIndex, content_digest, key_of

MAGIC = b"LSP1"
HEADER = struct.Struct("<4sIQI")  # magic, payload length, seq, crc32(payload)
_SEG_PREFIX, _SEG_SUFFIX = "seg-", ".log"
RECENT_BYTES = 64 << 20  # decoded batches kept in memory for the writer (beyond: read back from disk)
RECLAIM_BYTES = 4 << 20  # a fully stored active segment this big is rotated away (sooner once a write failed)


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


@dataclass
class Entry:
    """One spooled batch: where its record lies and what it holds."""

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


@dataclass
class _Pending:
    batch_id: str
    payload: bytes
    rows: dict[str, int]
    future: Future
    tables: dict[str, pa.Table] | None = None  # the payload decoded, if the caller had it


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically with ``data`` (tmp + fsync + rename + fsync dir)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _append_durable(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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


def _decode_head(payload: bytes) -> tuple[str, dict[str, int], list[tuple[str, int, int]]]:
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
    batch_id, _, parts = _decode_head(payload)
    buf = pa.py_buffer(payload)
    tables = {kind: read_ipc_stream(buf.slice(off, ln))[1] for kind, off, ln in parts}
    return batch_id, tables


class Quarantined(NamedTuple):
    """One quarantined batch's rows of one kind, as ``BlockWriter`` left them."""

    seq: int
    kind: str
    path: Path  # the Arrow IPC stream (``path.with_suffix(".error.txt")``: why)
    rows: int


def quarantine_paths(directory: Path, seq: int, kind: str) -> tuple[Path, Path]:
    """The quarantine files of batch ``seq``'s ``kind`` rows: (Arrow IPC stream, error text)."""
    path = Path(directory) / "quarantine" / f"{seq:020d}-{kind}.arrow"
    return path, path.with_suffix(".error.txt")


def quarantined(directory: Path | str) -> list[Quarantined]:
    """The quarantined batches of the spool in ``directory``, in spool order."""
    out = []
    for p in sorted((Path(directory) / "quarantine").glob("*-*.arrow")):
        seq, _, kind = p.stem.partition("-")
        if not seq.isdigit() or kind not in ARROW_SCHEMAS:
            continue
        try:
            rows = sum(b.num_rows for b in pa.ipc.open_stream(p.read_bytes()))
        except (OSError, pa.ArrowException):
            rows = 0
        out.append(Quarantined(int(seq), kind, p, rows))
    return out


def spool_uid(directory: Path | str) -> str | None:
    """The spool's identity (part of every deduplication token), None if it has none yet."""
    p = Path(directory) / "spool.id"
    return (p.read_text().strip() or None) if p.exists() else None


class Spool:
    """Append-only, fsync'd segments of accepted batches, read in order by the block writer."""

    def __init__(self, directory: Path | str, max_bytes: int, segment_bytes: int = 64 << 20,
                 keys_max: int = 1_000_000):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.keys_max = keys_max
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._entries: deque[Entry] = deque()  # uncommitted, in seq order
        self._keys = KeyIndex(keys_max)  # every batch id seen (collector/spool_keys.py)
        self._inflight: dict[str, Future] = {}
        self._segments: dict[Path, list[tuple[int, str, dict[str, int]]]] = {}  # seg -> [(seq, id, rows)]
        self._depth_bytes = 0  # uncommitted + queued bytes
        self._recent: dict[int, dict[str, pa.Table]] = {}  # seq -> tables of recent appends (for ``read``)
        self._recent_bytes = 0
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._closed = False
        self._write_error: str | None = None  # why the last append failed (disk full), until one succeeds
        self._refused_bytes = 0  # the last batch refused for the bound (0 once one is taken)
        self.uid = self._load_uid()
        # the block logged and not committed yet (replayed first), and its split (see ``log_split``)
        self.committed_seq, self.recovered_intent, self.recovered_split = self._read_writer_log()
        self._load_keys_log()
        self._next_seq = self._scan_segments()
        self._compact_writer_log()
        self._drop_committed_segments()
        self._active_path, self._active = self._open_segment(self._next_seq)
        self._io_lock = threading.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="spool-io")
        self._loop_pending: list[tuple[_Pending, asyncio.Future]] = []
        self._loop_flushing = False
        self._appender = threading.Thread(target=self._append_loop, name="spool-append", daemon=True)
        self._appender.start()

    # -- startup ---------------------------------------------------------------------------------
    def _load_uid(self) -> str:
        p = self.dir / "spool.id"
        if p.exists():
            uid = p.read_text().strip()
            if uid:
                return uid
        uid = uuid.uuid4().hex
        _write_durable(p, uid.encode())
        return uid

    def _read_writer_log(self) -> tuple[int, tuple[int, int] | None, frozenset[str] | None]:
        committed, intent, split = 0, None, None
        p = self.dir / "writer.log"
        if p.exists():
            for line in p.read_text().splitlines():
                parts = line.split()
                try:
                    if parts[0] == "commit" and len(parts) == 2:
                        committed = max(committed, int(parts[1]))
                    elif parts[0] == "intent" and len(parts) == 3:
                        intent, split = (int(parts[1]), int(parts[2])), None
                    elif parts[0] == "split" and len(parts) == 4 and (int(parts[1]), int(parts[2])) == intent:
                        split = frozenset(k for k in parts[3].split(",") if k != "-")
                except (ValueError, IndexError):
                    continue  # a torn last line: the intent/commit it held never completed
        if intent is not None and intent[1] <= committed:
            intent, split = None, None
        return committed, intent, split

    def _compact_writer_log(self) -> None:
        text = f"commit {self.committed_seq}\n"
        if self.recovered_intent:
            text += f"intent {self.recovered_intent[0]} {self.recovered_intent[1]}\n"
            if self.recovered_split is not None:
                text += self._split_line(*self.recovered_intent, self.recovered_split)
        _write_durable(self.dir / "writer.log", text.encode())
        self._wlog = open(self.dir / "writer.log", "ab")  # noqa: SIM115 (held open: appended per block)
        self._wlog_lines = 2

    def _load_keys_log(self) -> None:
        p = self.dir / "keys.log"
        if not p.exists():
            return
        for line in p.read_bytes().splitlines():
            self._keys.load_line(line)

    def _segment_paths(self) -> list[Path]:
        return sorted(self.dir.glob(f"{_SEG_PREFIX}*{_SEG_SUFFIX}"))

    def _scan_segments(self) -> int:
        """Index every record of every segment; truncate torn tails; return the next seq."""
        last_seq = self.committed_seq
        for seg in self._segment_paths():
            recs = self._segments.setdefault(seg, [])
            good_end = 0
            with open(seg, "r+b") as f:
                data = f.read()
                pos = 0
                while pos + HEADER.size <= len(data):
                    magic, ln, seq, crc = HEADER.unpack_from(data, pos)
                    start = pos + HEADER.size
                    if magic != MAGIC or start + ln > len(data) or zlib.crc32(data[start : start + ln]) != crc:
                        break
                    payload = data[start : start + ln]
                    batch_id, rows, _ = _decode_head(payload)
                    recs.append((seq, batch_id, rows))
                    digest = content_digest(decode_payload(payload)[1]) if self._keys.wants_digest(batch_id) else None
                    self._keys.remember(batch_id, rows, digest)
                    if seq > self.committed_seq:
                        self._entries.append(Entry(seq, seg, start, ln, batch_id, rows))
                        self._depth_bytes += HEADER.size + ln
                    last_seq = max(last_seq, seq)
                    pos = start + ln
                    good_end = pos
                if good_end < len(data):  # torn tail: never acked (the fsync did not complete)
                    f.truncate(good_end)
                    f.flush()
                    os.fsync(f.fileno())
        return last_seq + 1

    def _open_segment(self, first_seq: int):
        path = self.dir / f"{_SEG_PREFIX}{first_seq:020d}{_SEG_SUFFIX}"
        f = open(path, "ab", buffering=0)  # noqa: SIM115 (the active segment, held open until rotated)
        _fsync_dir(self.dir)
        with self._lock:
            self._segments.setdefault(path, [])
        return path, f

    # -- idempotency (collector/spool_keys.py) ---------------------------------------------------
    def _other_batch_for_key(self, batch_id: str) -> str | None:
        """(under the lock) Another batch id with ``batch_id``'s key, stored or in flight."""
        return self._keys.other_batch_for_key(batch_id, self._inflight)

    def key_conflict(self, batch_id: str) -> bool:
        """True when ``batch_id``'s key already names a different batch (its body differs)."""
        with self._lock:
            return self._other_batch_for_key(batch_id) is not None

    def known(self, batch_id: str) -> dict[str, int] | None:
        """Rows per kind of the batch spooled under exactly ``batch_id`` (None: none)."""
        with self._lock:
            return self._keys.known(batch_id)

    def previous_release_key(self, key: str) -> bool:
        """A release before scoped keys spooled a batch under the bare ``key``."""
        with self._lock:
            return self._keys.previous_release_key(key)

    def previous_release_duplicate(self, key: str, tables: dict[str, pa.Table | IpcStream]) -> dict[str, int] | None:
        """Rows of the batch a release before scoped keys spooled under the bare ``key``, when ``tables``
        hold the same rows (a retry across the upgrade); None otherwise."""
        decoded = {k: (t.table if t.table is not None else read_ipc_stream(t.data)[1]) if isinstance(t, IpcStream) else t
                   for k, t in tables.items()}
        with self._lock:
            return self._keys.previous_release_duplicate(key, decoded)

    # -- append (request threads) ----------------------------------------------------------------
    def submit(self, batch_id: str, tables: dict[str, pa.Table | IpcStream]) -> Future:
        """Queue a batch; the future resolves to an ``Ack`` once it is fsync'd (or a duplicate is seen).

        Raises ``SpoolFullError`` when the spool is over its bound. For threads; the collector's event
        loop uses ``submit_async``.
        """
        fut, pending = self._register(batch_id, tables)
        if pending is not None:
            self._queue.put(pending)
        return fut

    async def submit_async(self, batch_id: str, tables: dict[str, pa.Table | IpcStream]) -> Ack:
        """``submit`` for an event loop: batches queued meanwhile share one write + fsync, done in the
        spool's I/O thread, and the loop is woken once per group (not once per batch)."""
        fut, pending = self._register(batch_id, tables)
        if pending is None:  # a duplicate: answered now, or when its first copy lands
            return fut.result() if fut.done() else await asyncio.wrap_future(fut)
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._loop_pending.append((pending, waiter))
        if not self._loop_flushing:
            self._loop_flushing = True
            loop.create_task(self._flush_loop_pending(loop))
        return await waiter

    async def _flush_loop_pending(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while self._loop_pending:
                group, self._loop_pending = self._loop_pending, []
                try:
                    await loop.run_in_executor(self._io, self._write, [p for p, _ in group])
                except Exception as e:  # noqa: BLE001 (executor gone at shutdown: every waiter gets an answer)
                    for p, _ in group:
                        if not p.future.done():
                            p.future.set_exception(SpoolError(f"spool write not done: {e}"))
                for p, waiter in group:
                    if waiter.done():  # the request was cancelled (client gone): the batch is stored anyway
                        continue
                    if p.future.exception() is not None:
                        waiter.set_exception(p.future.exception())
                    else:
                        waiter.set_result(p.future.result())
        finally:
            self._loop_flushing = False

    def _register(self, batch_id: str, tables: dict[str, pa.Table | IpcStream]) -> tuple[Future, _Pending | None]:
        """Duplicate check, bound check, and the record to write (None for a duplicate)."""
        with self._lock:
            if self._closed:
                raise SpoolError("spool is closed (server shutting down); retry")
            if batch_id in self._keys or batch_id in self._inflight:
                return self._dup_future(batch_id), None
            if self._other_batch_for_key(batch_id) is not None:
                raise KeyConflictError(key_of(batch_id).partition("/")[2])
        payload, rows = encode_payload(batch_id, tables)
        fut: Future = Future()
        with self._lock:
            if batch_id in self._keys or batch_id in self._inflight:  # a twin request won the race
                return self._dup_future(batch_id), None
            if self._other_batch_for_key(batch_id) is not None:  # same key, other body, won the race
                raise KeyConflictError(key_of(batch_id).partition("/")[2])
            size = HEADER.size + len(payload)
            if self._depth_bytes > 0 and self._depth_bytes + size > self.max_bytes:
                self._refused_bytes = size
                raise SpoolFullError(self._depth_bytes, self.max_bytes, retry_after_s=1)
            self._refused_bytes = 0
            self._depth_bytes += size
            self._inflight[batch_id] = fut
        decoded = {k: t.table if isinstance(t, IpcStream) else t for k, t in tables.items() if k in rows}
        known = all(t is not None for t in decoded.values())  # (``in`` would compare tables with ==)
        return fut, _Pending(batch_id, payload, rows, fut, decoded if known else None)

    def _dup_future(self, batch_id: str) -> Future:
        """(under the lock) An ack marked duplicate: now if stored, else when the first copy lands."""
        fut: Future = Future()
        rows = self._keys.known(batch_id)
        if rows is not None:
            fut.set_result(Ack(batch_id, rows, True, -1))
            return fut

        def _chain(f: Future) -> None:
            if f.exception() is not None:
                fut.set_exception(f.exception())
            else:
                a = f.result()
                fut.set_result(Ack(a.batch_id, a.rows, True, a.seq))

        self._inflight[batch_id].add_done_callback(_chain)
        return fut

    def _append_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            items = [item]
            stop = False
            while len(items) < 4096:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                items.append(nxt)
            self._write(items)
            if stop:
                return

    def _write(self, items: list[_Pending]) -> None:
        with self._io_lock:  # the appender thread and the I/O executor both append
            self._write_locked(items)

    def _write_locked(self, items: list[_Pending]) -> None:
        buf = bytearray()
        new: list[Entry] = []
        base = self._active.tell()
        try:
            seq = self._next_seq
            for it in items:
                buf += HEADER.pack(MAGIC, len(it.payload), seq, zlib.crc32(it.payload))
                new.append(Entry(seq, self._active_path, base + len(buf), len(it.payload), it.batch_id, it.rows))
                buf += it.payload
                seq += 1
            view = memoryview(buf)
            while view:  # unbuffered: a failed write leaves nothing behind in a buffer
                view = view[self._active.write(view):]
            os.fsync(self._active.fileno())
        except Exception as e:  # noqa: BLE001 (disk full, I/O error: every waiting request must get an answer)
            try:  # drop a partial write so the segment stays well-formed (and the offset with it)
                self._active.truncate(base)
                self._active.seek(base)
            except OSError:
                pass
            with self._lock:
                self._write_error = f"{type(e).__name__}: {e}"[:300]
                for it in items:
                    self._inflight.pop(it.batch_id, None)
                    self._depth_bytes -= HEADER.size + len(it.payload)
            for it in items:
                it.future.set_exception(SpoolError(f"spool write failed: {e}"))
            return
        self._next_seq = seq
        with self._cond:
            self._write_error = None
            recs = self._segments[self._active_path]
            for it, e in zip(items, new, strict=True):
                self._entries.append(e)
                self._keys.remember(it.batch_id, it.rows)
                self._inflight.pop(it.batch_id, None)
                recs.append((e.seq, it.batch_id, it.rows))
                if it.tables is not None and self._recent_bytes + e.length <= RECENT_BYTES:
                    self._recent[e.seq] = it.tables
                    self._recent_bytes += e.length
            self._cond.notify_all()
        for it, e in zip(items, new, strict=True):
            it.future.set_result(Ack(it.batch_id, it.rows, False, e.seq))
        if self._active.tell() >= self.segment_bytes:
            self._active.close()
            path, f = self._open_segment(self._next_seq)
            with self._lock:
                self._active_path, self._active = path, f

    # -- read and commit (the block writer) ------------------------------------------------------
    def wait(self, timeout: float) -> None:
        """Block until some batch is waiting (or ``timeout``)."""
        with self._cond:
            if not self._entries:
                self._cond.wait(timeout)

    def take(self, max_rows: int) -> list[Entry]:
        """The oldest uncommitted batches, in order, up to ``max_rows`` rows (at least one batch)."""
        out, n = [], 0
        with self._lock:
            for e in self._entries:
                if out and n + e.nrows > max_rows:
                    break
                out.append(e)
                n += e.nrows
        return out

    def entries_between(self, first: int, last: int) -> list[Entry]:
        with self._lock:
            return [e for e in self._entries if first <= e.seq <= last]

    def read(self, entries: list[Entry]) -> dict[str, list[pa.Table]]:
        """The Arrow tables of ``entries``, per kind, in spool order: batches appended by this process
        from memory (up to ``RECENT_BYTES``), the others read back from their segment (crc-checked)."""
        out: dict[str, list[pa.Table]] = {}
        handles: dict[Path, object] = {}
        with self._lock:
            recent = [self._recent.get(e.seq) for e in entries]
        with contextlib.ExitStack() as stack:
            for e, tables in zip(entries, recent, strict=True):
                if tables is not None:  # appended by this process: the rows as validated, no disk read
                    for kind, t in tables.items():
                        out.setdefault(kind, []).append(t)
                    continue
                f = handles.get(e.segment)
                if f is None:
                    f = handles[e.segment] = stack.enter_context(open(e.segment, "rb"))
                f.seek(e.offset - HEADER.size)
                head = f.read(HEADER.size)
                payload = f.read(e.length)
                magic, _, seq, crc = HEADER.unpack(head)
                if magic != MAGIC or seq != e.seq or zlib.crc32(payload) != crc:
                    raise SpoolError(f"spool record {e.seq} in {e.segment.name} is corrupt")
                _, tables = decode_payload(payload)
                for kind, t in tables.items():
                    out.setdefault(kind, []).append(t)
        return out

    def _quarantined(self, seq: int, kind: str) -> tuple[Path, Path]:
        return quarantine_paths(self.dir, seq, kind)

    def quarantine_stats(self) -> dict:
        """The batches waiting in quarantine (for health): rescanned when the directory changed
        (``livestep spool requeue`` may have emptied it from another process)."""
        qdir = self.dir / "quarantine"
        try:
            stamp = qdir.stat().st_mtime_ns
        except FileNotFoundError:
            return {"batches": 0, "rows": 0}
        cached = getattr(self, "_qstats", None)
        if cached is None or cached[0] != stamp:
            found = quarantined(self.dir)
            cached = self._qstats = (stamp, {"batches": len(found), "rows": sum(q.rows for q in found)})
        return dict(cached[1])

    def quarantine(self, entry: Entry, kind: str, table: pa.Table, error: str) -> Path:
        """Keep a batch's ``kind`` rows the store refuses aside (an Arrow IPC stream + the error)."""
        path, err = self._quarantined(entry.seq, kind)
        path.parent.mkdir(exist_ok=True)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        _write_durable(path, sink.getvalue().to_pybytes())
        _write_durable(err, f"batch {entry.batch_id}\n{error}\n".encode())
        return path

    def unquarantine(self, seq: int, kind: str) -> bool:
        """Forget the quarantined ``kind`` rows of batch ``seq`` (the store took them after all, e.g.
        on a replay after a restart): remove its files durably. True if there were any."""
        path, err = self._quarantined(seq, kind)
        removed = False
        for p in (path, err, *(q.with_suffix(q.suffix + ".tmp") for q in (path, err))):  # _write_durable's tmp
            try:
                p.unlink()
                removed = True
            except FileNotFoundError:
                pass
        if removed:
            _fsync_dir(path.parent)
        return removed

    def _log(self, line: str) -> None:
        self._wlog.write(line.encode())
        self._wlog.flush()
        os.fsync(self._wlog.fileno())
        self._wlog_lines += 1

    def log_intent(self, first: int, last: int) -> None:
        """Record the block about to be inserted, before inserting it (replays re-form the same block)."""
        self._log(f"intent {first} {last}\n")
        with self._lock:
            self.recovered_intent, self.recovered_split = (first, last), None

    @staticmethod
    def _split_line(first: int, last: int, stored: frozenset[str]) -> str:
        return f"split {first} {last} {','.join(sorted(stored)) or '-'}\n"

    def log_split(self, first: int, last: int, stored: frozenset[str]) -> None:
        """Record that the logged block ``first..last`` goes in batch by batch from now on, its
        ``stored`` kinds being in the store already as a whole (a replay inserts the rest batch by
        batch with the same per-batch tokens)."""
        self._log(self._split_line(first, last, stored))
        with self._lock:
            self.recovered_split = frozenset(stored)

    def mark_committed(self, last: int) -> None:
        """Every batch up to ``last`` is in the store: forget them, delete segments fully stored."""
        self._log(f"commit {last}\n")
        with self._lock:
            self.committed_seq = last
            self.recovered_intent, self.recovered_split = None, None
            while self._entries and self._entries[0].seq <= last:
                e = self._entries.popleft()
                self._depth_bytes -= e.nbytes
                if self._recent.pop(e.seq, None) is not None:
                    self._recent_bytes -= e.length
        self._reclaim_active()
        self._drop_committed_segments()
        if self._wlog_lines > 10_000:
            self._wlog.close()
            self._compact_writer_log()

    def _reclaim_active(self) -> None:
        """Rotate the active segment away once every batch in it is stored and it holds
        ``RECLAIM_BYTES``, or at once after an append failed: a full disk gets its space back when the
        store has the data (before, only non-active segments were deleted, and a disk filled by the
        active one stayed full: issue 30). The old segment is then deleted like any stored one."""
        with self._io_lock:  # no append in between
            with self._lock:
                recs = self._segments.get(self._active_path, [])
                if (not recs or recs[-1][0] > self.committed_seq
                        or (self._active.tell() < RECLAIM_BYTES and self._write_error is None)):
                    return
            self._active.close()
            path, f = self._open_segment(self._next_seq)
            with self._lock:
                self._active_path, self._active = path, f

    def _drop_committed_segments(self) -> None:
        with self._lock:  # the appender adds segments and records concurrently
            active = getattr(self, "_active_path", None)
            done = {s: recs for s, recs in self._segments.items()
                    if s != active and all(seq <= self.committed_seq for seq, _, _ in recs)}
            for s in done:
                del self._segments[s]
        if not done:
            return
        with self._lock:
            lines = b"".join(self._keys.log_line(bid, rows) for recs in done.values() for _, bid, rows in recs)
        kp = self.dir / "keys.log"
        if kp.exists() and kp.stat().st_size > 200 * self.keys_max:  # compact: keep the newest keys
            with self._lock:
                keep = b"".join(self._keys.log_line(k, r) for k, r in self._keys.newest()[-self.keys_max :])
            _write_durable(kp, keep)
        try:
            _append_durable(kp, lines)
        except OSError:  # the disk is full: free the stored segments first, then record their ids
            for s in done:
                s.unlink(missing_ok=True)
            _fsync_dir(self.dir)
            _append_durable(kp, lines)
            with self._lock:
                self._write_error = None
            return
        for s in done:
            s.unlink(missing_ok=True)
        _fsync_dir(self.dir)
        with self._lock:
            self._write_error = None  # space was freed: the next append tells

    # -- state -----------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            oldest = self._entries[0].appended_at if self._entries else None
            return {
                "batches": len(self._entries),
                "rows": sum(e.nrows for e in self._entries),
                "bytes": self._depth_bytes,
                "max_bytes": self.max_bytes,
                "oldest_age_s": round(time.monotonic() - oldest, 3) if oldest is not None else 0.0,
                "last_seq": self._next_seq - 1,
                "committed_seq": self.committed_seq,
                "refusing": self._refusing(),
            }

    def _refusing(self) -> str | None:
        """(under the lock) Why ingest is refused for space now, None when it is not."""
        if self._write_error is not None:
            return f"spool cannot write (disk full?): {self._write_error}"
        if self._refused_bytes and self._depth_bytes + self._refused_bytes > self.max_bytes:
            return f"spool full: {self._depth_bytes} bytes not yet stored (bound {self.max_bytes})"
        return None

    @property
    def depth(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        """Finish queued appends, then close the files (uncommitted batches stay for the next start)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._appender.join()
        self._io.shutdown(wait=True)
        self._active.close()
        self._wlog.close()
