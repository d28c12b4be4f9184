"""The durable spool: accepted batches land here (fsync'd) before the collector acks them.

    spool = Spool(dir, max_bytes=1 << 30)
    ack = spool.submit("batch-1", {"step": arrow_table}).result()   # durable once this returns
    entries = spool.take(max_rows=200_000)         # the writer: oldest uncommitted batches, in order
    spool.log_intent(entries[0].seq, entries[-1].seq); ...insert...; spool.mark_committed(entries[-1].seq)

The queue of the OpenTelemetry collector's persistent queue (exporterhelper), in three parts, each
its own module and testable alone: this queue (uncommitted batches in order, the bound, duplicate
and key checks, group-committed appends, what the sender may take), its storage
(collector/spool_storage.py: segment files, the payload codec; collector/spool_journal.py: the
writer's intent/commit log; collector/spool_keys.py: the ids seen; collector/spool_quarantine.py:
the dead letters) and the sender (collector/writer.py), which reaches the queue only through the
methods below. Besides the segments, ``dir`` holds ``writer.log`` (the journal), ``keys.log`` (ids of
batches whose segment was deleted, so a late retry is still recognised) and ``spool.id`` (this
spool's identity, part of every deduplication token). Appends are group-committed: one write and
one fsync for every batch queued meanwhile. The writer gets the batches this process appended from
memory, as they were validated (up to ``RECENT_BYTES``); after a restart, or beyond that bound, they
are read back from their segment. Space is given back once the store has the data: stored segments
are deleted, and the active one is rotated away when all of it is stored (``RECLAIM_BYTES``, or at
once after an append failed: a full disk recovers when the writer drains it). The append paths (threads
and the event loop), the bound and the duplicate checks share one lock and one in-flight table, so they
stay here; what stands alone (storage, journal, ids, dead letters, and what a submit answers:
collector/spool_answers.py) does.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from collector.spool_answers import Ack, KeyConflictError, SpoolError, SpoolFullError
from collector.spool_journal import Journal
from collector.spool_keys import KeyIndex, content_digest, key_of
from collector.spool_quarantine import Quarantine, Quarantined, quarantine_paths, quarantined  # noqa: F401 (re-exported)
from collector.spool_storage import (  # noqa: F401 (re-exported: the wire codec's users import it from here)
    HEADER,
    Entry,
    IpcStream,
    SegmentStorage,
    StorageCorruptError,
    append_durable,
    decode_payload,
    encode_payload,
    ensure_spool_uid,
    fsync_dir,
    read_ipc_stream,
    spool_uid,
    write_durable,
)

RECENT_BYTES = 64 << 20  # decoded batches kept in memory for the writer (beyond: read back from disk)
RECLAIM_BYTES = 4 << 20  # a fully stored active segment this big is rotated away (sooner once a write failed)


@dataclass
class _Pending:
    batch_id: str
    payload: bytes
    rows: dict[str, int]
    future: Future
    tables: dict[str, pa.Table] | None = None  # the payload decoded, if the caller had it


class Spool:
    """Accepted batches in order, durable before the ack, taken by the block writer until committed."""

    def __init__(self, directory: Path | str, max_bytes: int, segment_bytes: int = 64 << 20,
                 keys_max: int = 1_000_000):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.keys_max = keys_max
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._entries: deque[Entry] = deque()  # uncommitted, in seq order
        self._keys = KeyIndex(keys_max)  # every batch id seen (collector/spool_keys.py)
        self._inflight: dict[str, Future] = {}
        self._depth_bytes = 0  # uncommitted + queued bytes
        self._recent: dict[int, dict[str, pa.Table]] = {}  # seq -> tables of recent appends (for ``read``)
        self._recent_bytes = 0
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._closed = False
        self._write_error: str | None = None  # why the last append failed (disk full), until one succeeds
        self._refused_bytes = 0  # the last batch refused for the bound (0 once one is taken)
        self.uid = ensure_spool_uid(self.dir)
        self._journal = Journal(self.dir)  # the block logged and not committed yet is replayed first
        self._quarantine = Quarantine(self.dir)
        self._load_keys_log()
        self._storage = SegmentStorage(self.dir, segment_bytes)
        self._next_seq = max(self._journal.committed, self._storage.scan(self._recovered)) + 1
        self._storage.open_active(self._next_seq)
        self._give_back_space()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="spool-io")
        self._write_lock = threading.Lock()  # the appender thread and the I/O executor both append
        self._loop_pending: list[tuple[_Pending, asyncio.Future]] = []
        self._loop_flushing = False
        self._appender = threading.Thread(target=self._append_loop, name="spool-append", daemon=True)
        self._appender.start()

    # -- startup ---------------------------------------------------------------------------------
    def _load_keys_log(self) -> None:
        p = self.dir / "keys.log"
        if p.exists():
            for line in p.read_bytes().splitlines():
                self._keys.load_line(line)

    def _recovered(self, e: Entry, payload: bytes) -> None:
        """One record found at start: remembered, and queued unless the store has it."""
        digest = content_digest(decode_payload(payload)[1]) if self._keys.wants_digest(e.batch_id) else None
        self._keys.remember(e.batch_id, e.rows, digest)
        if e.seq > self._journal.committed:
            self._entries.append(e)
            self._depth_bytes += e.nbytes

    # -- idempotency (collector/spool_keys.py) ---------------------------------------------------
    def key_conflict(self, batch_id: str) -> bool:
        """True when ``batch_id``'s key already names a different batch (its body differs)."""
        with self._lock:
            return self._keys.other_batch_for_key(batch_id, self._inflight) is not None

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
            if self._keys.other_batch_for_key(batch_id, self._inflight) is not None:
                raise KeyConflictError(key_of(batch_id).partition("/")[2])
        payload, rows = encode_payload(batch_id, tables)
        fut: Future = Future()
        with self._lock:
            if batch_id in self._keys or batch_id in self._inflight:  # a twin request won the race
                return self._dup_future(batch_id), None
            if self._keys.other_batch_for_key(batch_id, self._inflight) is not None:  # same key, other body, won
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
        with self._write_lock:  # seqs are handed out in the order the storage writes them
            seq = self._next_seq
            try:
                new = self._storage.append([(seq + i, it.batch_id, it.rows, it.payload) for i, it in enumerate(items)])
            except Exception as e:  # noqa: BLE001 (disk full, I/O error: every waiting request must get an answer)
                with self._lock:
                    self._write_error = f"{type(e).__name__}: {e}"[:300]
                    for it in items:
                        self._inflight.pop(it.batch_id, None)
                        self._depth_bytes -= HEADER.size + len(it.payload)
                for it in items:
                    it.future.set_exception(SpoolError(f"spool write failed: {e}"))
                return
            self._next_seq = seq + len(items)
            with self._cond:  # (still under the write lock: entries queue in seq order)
                self._write_error = None
                for it, e in zip(items, new, strict=True):
                    self._entries.append(e)
                    self._keys.remember(it.batch_id, it.rows)
                    self._inflight.pop(it.batch_id, None)
                    if it.tables is not None and self._recent_bytes + e.length <= RECENT_BYTES:
                        self._recent[e.seq] = it.tables
                        self._recent_bytes += e.length
                self._cond.notify_all()
        for it, e in zip(items, new, strict=True):
            it.future.set_result(Ack(it.batch_id, it.rows, False, e.seq))

    # -- read and commit (the block writer) ------------------------------------------------------
    def wait(self, timeout: float) -> None:
        """Block until some batch is waiting, ``wake`` is called, or ``timeout``."""
        with self._cond:
            if not self._entries:
                self._cond.wait(timeout)

    def wake(self) -> None:
        """Wake a writer blocked in ``wait`` (it is stopping)."""
        with self._cond:
            self._cond.notify_all()

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
                if tables is None:  # not appended by this process (or beyond RECENT_BYTES): from disk
                    f = handles.get(e.segment)
                    if f is None:
                        f = handles[e.segment] = stack.enter_context(open(e.segment, "rb"))
                    try:
                        tables = decode_payload(self._storage.read(e, f))[1]
                    except StorageCorruptError as err:
                        raise SpoolError(str(err)) from err
                for kind, t in tables.items():
                    out.setdefault(kind, []).append(t)
        return out

    @property
    def recovered_intent(self) -> tuple[int, int] | None:
        """The block logged and not committed yet (a crash before its commit): replayed first, as is."""
        return self._journal.intent

    @property
    def recovered_split(self) -> frozenset[str] | None:
        """That block's split, when it was going in batch by batch (see ``log_split``)."""
        return self._journal.split

    @property
    def committed_seq(self) -> int:
        return self._journal.committed

    def log_intent(self, first: int, last: int) -> None:
        """Record the block about to be inserted, before inserting it (replays re-form the same block)."""
        self._journal.log_intent(first, last)

    def log_split(self, first: int, last: int, stored: frozenset[str]) -> None:
        """Record that the logged block ``first..last`` goes in batch by batch from now on, its
        ``stored`` kinds being in the store already as a whole (a replay inserts the rest batch by
        batch with the same per-batch tokens)."""
        self._journal.log_split(first, last, stored)

    def mark_committed(self, last: int) -> None:
        """Every batch up to ``last`` is in the store: forget them, give their space back."""
        self._journal.log_commit(last)
        with self._lock:
            while self._entries and self._entries[0].seq <= last:
                e = self._entries.popleft()
                self._depth_bytes -= e.nbytes
                if self._recent.pop(e.seq, None) is not None:
                    self._recent_bytes -= e.length
            failed = self._write_error is not None
        with self._write_lock:  # no append in between: the seq the next segment starts at is known
            self._storage.rotate_if_stored(last, 0 if failed else RECLAIM_BYTES, self._next_seq)
        self._give_back_space()

    def _give_back_space(self) -> None:
        """Delete the segments whose batches are all stored, recording their ids in ``keys.log`` first
        (so a late retry is still recognised); on a full disk, the other way round."""
        done = self._storage.stored(self._journal.committed)
        if not done:
            return
        with self._lock:
            lines = b"".join(self._keys.log_line(e.batch_id, e.rows) for recs in done.values() for e in recs)
        kp = self.dir / "keys.log"
        if kp.exists() and kp.stat().st_size > 200 * self.keys_max:  # compact: keep the newest keys
            with self._lock:
                keep = b"".join(self._keys.log_line(k, r) for k, r in self._keys.newest()[-self.keys_max :])
            write_durable(kp, keep)
        try:
            append_durable(kp, lines)
        except OSError:  # the disk is full: free the stored segments first, then record their ids
            self._storage.delete(list(done))
            append_durable(kp, lines)
        else:
            self._storage.delete(list(done))
        with self._lock:
            self._write_error = None  # space was freed: the next append tells

    # -- dead letters (collector/spool_quarantine.py) ----------------------------------------------
    def quarantine(self, entry: Entry, kind: str, table: pa.Table, error: str) -> Path:
        """Keep a batch's ``kind`` rows the store refuses aside (an Arrow IPC stream + the error)."""
        return self._quarantine.put(entry.seq, kind, table, entry.batch_id, error)

    def unquarantine(self, seq: int, kind: str) -> bool:
        """Forget the quarantined ``kind`` rows of batch ``seq`` (the store took them after all, e.g.
        on a replay after a restart). True if there were any."""
        return self._quarantine.remove(seq, kind)

    def quarantine_stats(self) -> dict:
        return self._quarantine.stats()

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
                "committed_seq": self._journal.committed,
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
        self._storage.close()
        self._journal.close()
