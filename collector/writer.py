"""The block writer: spooled batches -> ClickHouse, merged across requests into large blocks.

    writer = BlockWriter(spool, get_store, flush_rows=200_000, flush_interval_s=0.5)
    writer.start(); ...; writer.stop()

One background thread takes the oldest uncommitted batches from the spool (up to ``flush_rows``
rows, or whatever is there once the oldest waited ``flush_interval_s``), logs the block's spool
range (intent), inserts one Arrow table per kind with the deduplication token
``<spool id>:<first seq>-<last seq>:<kind>``, then marks the range committed. A logged range is
pinned until it is committed: a crash between insert and commit (or a retry) replays the same range
with the same tokens, which ClickHouse deduplicates. A kind's rows that span more partitions than
the store takes in one insert (``max_partitions_per_insert_block``, collector/limits.py) go in as
several inserts of whole partitions, the token suffixed ``#<part>/<parts>``.

Transient or permanent. Any failure is transient -- retried with jittered exponential backoff for as
long as it lasts, the spool keeping the rows (429 once full), health saying ``degraded`` -- unless the
store refuses the data itself: a type or constraint error (``refuses_content``, by ClickHouse's error
code), as opposed to the store's own state (down, read-only, too many parts, a memory limit, a dropped
table). A block refused for its content, or refused ``poison_after`` times while the store answers
pings, goes in batch by batch: the split is logged first (with the kinds already stored as a block),
and from then on the block's other kinds go in only batch by batch, with the tokens
``<spool id>:<seq>-<seq>:<kind>``, in this process and in any replay after a crash, so every acked
row is stored once. A block insert that raised may still have landed (a remote server that committed
before the client timed out; or only the parts of some partitions: an insert is atomic per partition)
and a batch token cannot deduplicate against the block's, so before each batch goes in alone the
store is asked which of its rows are there already (by row key: worker, session, ts and the kind's
own key column) and only the others are inserted (collector/store.py ``not_landed``). Only the batch-by-batch path asks: the happy path
runs no extra query. A batch whose own insert fails transiently is retried (same token) until it goes
in. Only a batch the store refuses for its content, alone, three times, is quarantined
(``<spool>/quarantine/<seq>-<kind>.arrow``, an Arrow IPC stream, plus a ``batch_quarantined`` event in
the store) so it cannot hold up the batches behind it; quarantine is never final: ``livestep spool
requeue`` (collector/requeue.py) inserts it under the same token once the operator fixed the cause.
A batch quarantined and then stored after all (a replay after a restart: the crash came before the
spool commit) has its quarantine files removed again (``unquarantined``).

"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from collector import limits as store_limits
from collector.records import ARROW_SCHEMAS, TABLES, conform, to_arrow
from collector.spool import Entry, Spool
from collector.store import Store, not_landed

log = logging.getLogger("livestep.collector.writer")


# ClickHouse error codes that refuse the data itself (reproducible on the batch alone): types, parsing,
# value ranges, constraints. Anything else -- the store down, read-only, out of memory or parts, a table
# missing -- is about the store's state and is retried for as long as it lasts.
CONTENT_ERROR_CODES = frozenset({
    6,    # CANNOT_PARSE_TEXT
    26,   # CANNOT_PARSE_QUOTED_STRING
    27,   # CANNOT_PARSE_INPUT_ASSERTION_FAILED
    38,   # CANNOT_PARSE_DATE
    41,   # CANNOT_PARSE_DATETIME
    53,   # TYPE_MISMATCH
    70,   # CANNOT_CONVERT_TYPE
    72,   # CANNOT_PARSE_NUMBER
    117,  # INCORRECT_DATA
    131,  # TOO_LARGE_STRING_SIZE
    321,  # VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE
    349,  # CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN
    407,  # DECIMAL_OVERFLOW
    469,  # VIOLATED_CONSTRAINT
})
_CODE = re.compile(r"\bCode: (\d+)\b")


def refuses_content(err: BaseException) -> bool:
    """The store refused the rows themselves (a type or constraint error), not for its own state."""
    m = _CODE.search(str(err))
    return m is not None and int(m.group(1)) in CONTENT_ERROR_CODES


def batch_token(uid: str, seq: int, kind: str) -> str:
    """The deduplication token of one spooled batch's ``kind`` rows inserted alone (batch by batch,
    and ``livestep spool requeue``)."""
    return f"{uid}:{seq}-{seq}:{kind}"


def insert_parts(store: Store, limits: store_limits.Limits, kind: str, table: pa.Table, token: str) -> None:
    """One kind's rows under ``token``, as inserts of at most the store's partitions per insert each
    (several: the token suffixed ``#<part>/<parts>``, the same parts on every replay)."""
    parts = store_limits.split_by_partitions(limits, kind, table)
    for i, part in enumerate(parts):
        store.insert_arrow(TABLES[kind], part, dedup_token=token if len(parts) == 1 else f"{token}#{i}/{len(parts)}")


LIMITS_EVERY_S = 300.0  # the store's limits are read again this often (before a block)


class StoreUnavailableError(Exception):
    """The store cannot take inserts now (down, unreachable, or held down by the fault hook)."""


class BlockWriter:
    """Moves spooled batches into the store in order, exactly once."""

    def __init__(
        self,
        spool: Spool,
        get_store: Callable[[], Store],
        flush_rows: int = 200_000,
        flush_interval_s: float = 0.5,
        retry_max_s: float = 5.0,
        fault_store_down_file: Path | None = None,
        poison_after: int = 20,
        fault_refuse_writes_file: Path | None = None,
        fault_pause_before_commit_file: Path | None = None,
    ):
        self.spool = spool
        self.get_store = get_store
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.retry_max_s = retry_max_s
        self.fault_file = fault_store_down_file
        self.refuse_file = fault_refuse_writes_file
        self.pause_file = fault_pause_before_commit_file
        self.poison_after = poison_after
        self.quarantined = 0
        self.unquarantined = 0  # quarantined batches the store took after all (their files removed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.blocks = 0
        self.rows = 0
        self.failures = 0
        self.last_error: str | None = None
        self.last_insert_at: float | None = None  # time.time()
        # called with (kind, table) once a block (or a split block's batch) is stored: collector/metrics.py
        self.observe_block: Callable[[str, pa.Table], None] | None = None
        self.failing_since: float | None = None  # time.time() of the first failure of the current run
        self._limits: store_limits.Limits | None = None
        self._limits_at = 0.0

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spool-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the block in flight (what is left stays in the spool for the next start)."""
        self._stop.set()
        self.spool.wake()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict:
        return {
            "alive": self.alive,
            "blocks": self.blocks,
            "rows": self.rows,
            "failures": self.failures,
            "quarantined": self.quarantined,
            "unquarantined": self.unquarantined,
            "last_error": self.last_error,
            "last_insert_at": self.last_insert_at,
            "failing_since": self.failing_since,
        }

    @property
    def limits(self) -> store_limits.Limits:
        """The store's limits as the writer read them (sql/'s values until the store answered); never
        blocks (ingest reads the retention window here)."""
        return self._limits or store_limits.DEFAULT

    def _read_limits(self) -> None:
        """(Re)read the store's limits: at start, then every ``LIMITS_EVERY_S`` (an operator's ALTER)."""
        if self._limits is None or time.monotonic() - self._limits_at > LIMITS_EVERY_S:
            try:
                self._limits = store_limits.read_limits(self.get_store(), strict=True)
                self._limits_at = time.monotonic()
            except Exception as e:  # noqa: BLE001 (store not reachable yet: sql/'s values meanwhile, asked again)
                log.debug("store limits not read yet: %s", e)

    def _failed(self, err: BaseException | str) -> None:
        self.failures += 1
        self.last_error = (err if isinstance(err, str) else f"{type(err).__name__}: {err}")[:500]
        if self.failing_since is None:
            self.failing_since = time.time()

    def _succeeded(self) -> None:
        self.last_error, self.failing_since = None, None
        self.last_insert_at = time.time()

    def _backoff(self, attempt: int) -> None:
        self._stop.wait(min(self.retry_max_s, 0.05 * 2 ** min(attempt, 30)) * (0.5 + random.random() / 2))

    def insert_table(self, kind: str, table: pa.Table, token: str) -> None:
        if self.refuse_file is not None and self.refuse_file.exists():
            raise StoreUnavailableError(f"Code: 252. DB::Exception: Too many parts (TOO_MANY_PARTS), drill: the "
                                        f"fault hook file {self.refuse_file} refuses writes")
        insert_parts(self.get_store(), self.limits, kind, table, token)

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._read_limits()
            intent = self.spool.recovered_intent  # a logged block not committed yet: pinned until it is
            if intent is not None:  # replay exactly that block, the same way (whole or batch by batch)
                entries = self.spool.entries_between(*intent)
                split = self.spool.recovered_split
                if not entries:
                    self.spool.mark_committed(intent[1])  # nothing of it is left uncommitted
                    continue
            else:
                entries = self._next_block()
                if not entries:
                    continue
                self.spool.log_intent(entries[0].seq, entries[-1].seq)
                split = None
            if self._insert_with_retry(entries, split):
                self._pause_before_commit()
                self.spool.mark_committed(entries[-1].seq)

    def _pause_before_commit(self) -> None:
        """The drill hook: hold the block stored and not committed while the pause file exists (a
        kill -9 aimed here makes the next start replay it)."""
        if self.pause_file is None or not self.pause_file.exists():
            return
        paused = self.pause_file.with_name(self.pause_file.name + ".paused")
        paused.touch()
        while self.pause_file.exists() and not self._stop.is_set():
            self._stop.wait(0.01)
        paused.unlink(missing_ok=True)

    def _next_block(self) -> list[Entry]:
        """Wait until a block is due: ``flush_rows`` rows waiting, or the oldest is old enough."""
        while not self._stop.is_set():
            entries = self.spool.take(self.flush_rows)
            if not entries:
                self.spool.wait(self.flush_interval_s)
                continue
            rows = sum(e.nrows for e in entries)
            age = time.monotonic() - entries[0].appended_at
            if rows >= self.flush_rows or age >= self.flush_interval_s:
                return entries
            self._stop.wait(min(self.flush_interval_s - age, 0.05))
        return []

    def _insert_with_retry(self, entries: list[Entry], split: frozenset[str] | None = None) -> bool:
        """Insert the logged block ``entries`` until it is in (False only when stopped). ``split``: the
        block goes batch by batch (the split was logged), these kinds being already stored whole."""
        done: set[str] = set()  # kinds of this block already in the store (their token is spent)
        attempt = 0
        while not self._stop.is_set():
            if split is not None:
                return self._insert_one_by_one(entries, split)
            try:
                self._insert(entries, done)
                self._succeeded()
                return True
            except Exception as e:  # noqa: BLE001 (store down, network, chDB: keep the rows, retry)
                self._failed(e)
                if attempt == 0:
                    log.warning("insert of spool %d-%d failed, retrying: %s",
                                entries[0].seq, entries[-1].seq, self.last_error)
                if (refuses_content(e) or attempt + 1 >= self.poison_after) and self._store_answers():
                    # logged before any batch goes in alone: a replay must use the same tokens
                    split = frozenset(done)
                    self.spool.log_split(entries[0].seq, entries[-1].seq, split)
                    continue
            attempt += 1
            self._backoff(attempt)
        return False

    def _store_answers(self) -> bool:
        """The store is up (so repeated failures are about the data, not the store)."""
        if self.fault_file is not None and self.fault_file.exists():
            return False
        try:
            return self.get_store().ping()
        except Exception:  # noqa: BLE001 (an unreachable store is a plain "no")
            return False

    def _insert_one_by_one(self, entries: list[Entry], done: frozenset[str]) -> bool:
        """The block goes in batch by batch (split logged): its kinds not ``done``, each batch under its
        own deterministic token (a replay after a crash here is deduplicated too) and without the rows
        already stored (the block may have landed before its insert raised). A batch the store refuses
        for its content, alone, three times, is quarantined so it cannot hold up the rest; any other
        failure is retried, same batch, same token, for as long as it lasts. False: stopped."""
        for e in entries:
            for kind, tables in self.spool.read([e]).items():
                if kind not in done and not self._insert_batch(e, kind, tables[0]):
                    return False
        self.blocks += 1
        self._succeeded()
        return True

    def _insert_batch(self, e: Entry, kind: str, table: pa.Table) -> bool:
        refused = 0  # content refusals of this batch alone
        attempt = 0
        while not self._stop.is_set():
            try:
                # rows of it that landed with a block insert that raised are not inserted again
                missing = self._not_landed(kind, table)
                if missing.num_rows:
                    self.insert_table(kind, missing, batch_token(self.spool.uid, e.seq, kind))
                self.rows += table.num_rows
                if self.observe_block is not None:
                    self.observe_block(kind, table)
                if self.spool.unquarantine(e.seq, kind):  # refused before a restart, stored now
                    self.unquarantined += 1
                    log.warning("spool batch %d (%s) quarantined earlier is stored now: quarantine files "
                                "removed", e.seq, kind)
                return True
            except Exception as err:  # noqa: BLE001
                self._failed(err)
                if refuses_content(err):
                    refused += 1
                    if refused >= 3:
                        self._quarantine(e, kind, table, self.last_error or "")
                        return True
                attempt += 1
                self._backoff(attempt)
        return False

    def _quarantine(self, e: Entry, kind: str, table: pa.Table, error: str) -> None:
        """Keep the batch aside (files in the spool), say so in the log and as an event in the store."""
        path = self.spool.quarantine(e, kind, table, error)
        self.quarantined += 1
        log.error("spool batch %d (%s, %d rows) refused by the store for its content, quarantined in %s "
                  "(fix the cause, then `livestep spool requeue`): %s", e.seq, kind, table.num_rows, path,
                  error[:300])
        event = {"worker_id": f"collector@{socket.gethostname()}"[:128], "session_id": f"spool:{self.spool.uid}",
                 "release": "collector", "gpu_kind": "none", "ts": datetime.now(UTC), "kind": "batch_quarantined",
                 "detail": {"spool_seq": e.seq, "record_kind": kind, "rows": table.num_rows,
                            "batch_id": e.batch_id, "file": os.fspath(path), "error": error[:2000]}}
        try:
            ev = to_arrow("event", [event])
            self.get_store().insert_arrow(TABLES["event"], ev, dedup_token=f"{self.spool.uid}:quarantine:{e.seq}:{kind}")
        except Exception as err:  # noqa: BLE001 (the files and the log still say it)
            log.warning("batch_quarantined event not stored: %s", f"{type(err).__name__}: {err}"[:300])

    def _not_landed(self, kind: str, table: pa.Table) -> pa.Table:
        if self.fault_file is not None and self.fault_file.exists():
            raise StoreUnavailableError(f"store held down by the fault hook file {self.fault_file}")
        return not_landed(self.get_store(), kind, table)

    def _insert(self, entries: list[Entry], done: set[str]) -> None:
        if self.fault_file is not None and self.fault_file.exists():
            raise StoreUnavailableError(f"store held down by the fault hook file {self.fault_file}")
        first, last = entries[0].seq, entries[-1].seq
        for kind, tables in self.spool.read(entries).items():
            if kind in done:
                continue
            # one contiguous record batch: chDB turns every Arrow chunk into its own block (500 chunks
            # insert ~3x slower than the same rows in one, and leave more parts to merge)
            tables = [conform(kind, t) for t in tables]  # batches spooled before a column was added
            block = (pa.concat_tables(tables) if len(tables) > 1 else tables[0]).combine_chunks()
            block = block.cast(ARROW_SCHEMAS[kind]) if block.schema != ARROW_SCHEMAS[kind] else block
            self.insert_table(kind, block, f"{self.spool.uid}:{first}-{last}:{kind}")
            done.add(kind)
            if self.observe_block is not None:
                self.observe_block(kind, block)
        self.blocks += 1
        self.rows += sum(e.nrows for e in entries)
