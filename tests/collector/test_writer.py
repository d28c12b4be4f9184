"""The block writer: merged blocks, exact replay after a crash between insert and commit, store outage."""

from __future__ import annotations

import pytest

from collector import records
from collector.spool import Spool
from collector.writer import BlockWriter
from tests.collector.helpers import step_rows, wait_for


def _t(n, start=0):
    return {"step": records.to_arrow("step", step_rows(n, start=start))}


def _counts(store):
    return (store.query_rows("SELECT count(), uniqExact(step) FROM steps")[0],
            store.query_rows("SELECT countMerge(steps) FROM session_stats")[0][0])


def test_batches_are_merged_into_one_block(store, tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 24)
    for i in range(20):
        sp.submit(f"b{i}", _t(10, start=10 * i)).result()
    w = BlockWriter(sp, lambda: store, flush_rows=1000, flush_interval_s=0.01)
    w.start()
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    sp.close()
    assert w.blocks == 1 and w.rows == 200
    assert _counts(store) == ((200, 200), 200)


def test_replay_after_crash_between_insert_and_commit_is_stored_once(store, tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 24)
    for i in range(5):
        sp.submit(f"b{i}", _t(10, start=10 * i)).result()
    crashed = BlockWriter(sp, lambda: store, flush_rows=1000)
    entries = sp.take(1000)
    sp.log_intent(entries[0].seq, entries[-1].seq)
    crashed._insert(entries, set())  # the insert lands, then the process dies before the commit is logged
    sp.close()
    assert _counts(store) == ((50, 50), 50)

    sp = Spool(tmp_path, max_bytes=1 << 24)  # restart
    sp.submit("b5", _t(10, start=50)).result()  # new traffic arrives before the replay
    w = BlockWriter(sp, lambda: store, flush_rows=1000, flush_interval_s=0.01)
    w.start()
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    sp.close()
    assert _counts(store) == ((60, 60), 60)  # the replayed block was deduplicated, table and view


def test_store_down_keeps_rows_then_stores_them_once(store, tmp_path):
    down = tmp_path / "store-down"
    down.touch()
    sp = Spool(tmp_path / "spool", max_bytes=1 << 24)
    w = BlockWriter(sp, lambda: store, flush_rows=25, flush_interval_s=0.01, retry_max_s=0.05,
                    fault_store_down_file=down)
    w.start()
    for i in range(10):
        sp.submit(f"b{i}", _t(10, start=10 * i)).result()
    wait_for(lambda: w.failures >= 3, what="writer retrying")
    assert "fault hook" in w.last_error
    assert _counts(store) == ((0, 0), 0) and sp.stats()["rows"] == 100
    down.unlink()
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    sp.close()
    assert w.last_error is None
    assert _counts(store) == ((100, 100), 100)


def test_concurrent_appends_rotations_and_commits_lose_nothing(store, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    sp = Spool(tmp_path, max_bytes=1 << 26, segment_bytes=64 * 1024)
    w = BlockWriter(sp, lambda: store, flush_rows=300, flush_interval_s=0.01)
    w.start()

    def send(k):
        for b in range(40):
            assert not sp.submit(f"{k}-{b}", _t(20, start=1000 * k + 20 * b)).result().duplicate

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(send, range(4)))
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    sp.close()
    assert w.blocks > 1 and _counts(store) == ((3200, 3200), 3200)
    assert len(list(tmp_path.glob("seg-*.log"))) <= 2  # committed segments were deleted


def test_a_batch_the_store_refuses_for_its_content_is_quarantined_and_the_rest_stored(store, tmp_path):
    """A constraint the operator added refuses batch 2 alone (a real content error, VIOLATED_CONSTRAINT):
    quarantined, with an event; the batches around it stored; after the fix, requeue stores it once."""
    import orjson
    import pyarrow as pa

    from collector.requeue import requeue

    store.command("ALTER TABLE steps ADD CONSTRAINT below_10 CHECK step < 10 OR step >= 20")
    sp = Spool(tmp_path, max_bytes=1 << 24)
    for i in range(3):
        sp.submit(f"b{i}", _t(10, start=10 * i)).result()
    w = BlockWriter(sp, lambda: store, flush_rows=1000, flush_interval_s=0.01, retry_max_s=0.01)
    w.start()
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    assert _counts(store) == ((20, 20), 20) and w.quarantined == 1 and w.last_error is None
    q = tmp_path / "quarantine" / f"{2:020d}-step.arrow"
    assert pa.ipc.open_stream(q.read_bytes()).read_all().num_rows == 10
    assert "b1" in q.with_suffix(".error.txt").read_text() and "VIOLATED_CONSTRAINT" in q.with_suffix(".error.txt").read_text()
    assert sp.quarantine_stats() == {"batches": 1, "rows": 10}
    [(detail,)] = store.query_rows("SELECT detail FROM events WHERE kind = 'batch_quarantined'")
    assert orjson.loads(detail) | {"file": None, "error": None} == {
        "spool_seq": 2, "record_kind": "step", "rows": 10, "batch_id": "b1", "file": None, "error": None}
    sp.close()

    assert [o.error is not None for o in requeue(tmp_path, store)] == [True]  # not fixed yet: kept
    assert q.exists()
    store.command("ALTER TABLE steps DROP CONSTRAINT below_10")
    [o] = requeue(tmp_path, store)
    assert (o.seq, o.kind, o.rows, o.stored, o.error) == (2, "step", 10, 10, None) and not q.exists()
    assert requeue(tmp_path, store) == []
    assert _counts(store) == ((30, 30), 30)


def test_a_missing_table_is_retried_not_quarantined_until_it_is_back(store, tmp_path):
    """A dropped table is the store's state, not the rows': the writer retries (degraded) for as long as
    it lasts, quarantines nothing, and stores every row once the table is back."""
    from collector.migrations import statements
    from tests.collector.helpers import event_row

    ddl = next(st for st in statements(store.migration_files()[0]) if "TABLE IF NOT EXISTS events" in st)
    store.command("DROP TABLE events")
    sp = Spool(tmp_path, max_bytes=1 << 24)
    sp.submit("s1", _t(10)).result()
    sp.submit("e1", {"event": records.to_arrow("event", [event_row(), event_row(session_id="s2")])}).result()
    sp.submit("s2", _t(10, start=10)).result()
    w = BlockWriter(sp, lambda: store, flush_rows=1000, flush_interval_s=0.01, retry_max_s=0.01, poison_after=3)
    w.start()
    wait_for(lambda: w.failures >= 10, what="writer retrying")
    assert w.quarantined == 0 and "UNKNOWN_TABLE" in (w.last_error or "") and w.stats()["failing_since"]
    assert sp.stats()["batches"] >= 2  # the event batch and what follows it wait
    store.command(ddl)
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    sp.close()
    assert w.quarantined == 0 and w.last_error is None and not (tmp_path / "quarantine").exists()
    assert _counts(store) == ((20, 20), 20)
    assert store.query_rows("SELECT count() FROM events")[0][0] == 2


def test_a_block_spanning_more_partitions_than_one_insert_takes_is_stored_whole(store, tmp_path):
    """101 rows over 101 days: ClickHouse refuses more than 100 partitions per insert; the writer splits."""
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC).replace(microsecond=0)
    rows = [r | {"ts": now - timedelta(days=i, hours=1)} for i, r in enumerate(step_rows(101))]
    sp = Spool(tmp_path, max_bytes=1 << 24)
    sp.submit("days", {"step": records.to_arrow("step", rows)}).result()
    w = BlockWriter(sp, lambda: store, flush_rows=1000, flush_interval_s=0.01, retry_max_s=0.01)
    w.start()
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    sp.close()
    assert w.failures == 0 and w.quarantined == 0
    assert store.query_rows("SELECT count(), uniqExact(toDate(ts)) FROM steps") == [(101, 101)]


class _RefusesBlocks:
    """The real store, refusing (while ``refuse``) a block of more than one batch, as a store refuses
    a block too large for it; ``on_batch(seq)`` runs before each one-batch insert (crash, outage)."""

    def __init__(self, store, on_batch=None):
        self.store, self.on_batch, self.refuse = store, on_batch, True

    def __getattr__(self, name):
        return getattr(self.store, name)

    def insert_arrow(self, table, arrow_table, dedup_token):
        first, last = dedup_token.split(":")[1].split("-")
        if first != last and self.refuse:
            raise RuntimeError("block too large")
        if first == last and self.on_batch is not None:
            self.on_batch(int(first))
        self.store.insert_arrow(table, arrow_table, dedup_token=dedup_token)


class _Crash(BaseException):
    """The process dies here (not an ``Exception``: nothing in the writer catches it)."""


def test_replay_after_crash_while_inserting_batch_by_batch_is_stored_once(store, tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 24)
    for i in range(3):
        sp.submit(f"b{i}", _t(10, start=10 * i)).result()

    def crash_at_second(seq):
        if seq == 2:
            raise _Crash

    crashed = BlockWriter(sp, lambda: refusing, flush_rows=1000, retry_max_s=0.01, poison_after=2)
    refusing = _RefusesBlocks(store, crash_at_second)
    entries = sp.take(1000)
    sp.log_intent(entries[0].seq, entries[-1].seq)
    try:  # refused as a block, batch 1 lands on its own, the process dies before batch 2
        crashed._insert_with_retry(entries)
    except _Crash:
        pass
    sp.close()
    assert _counts(store) == ((10, 10), 10)

    sp = Spool(tmp_path, max_bytes=1 << 24)  # restart: the store takes the whole block now
    w = BlockWriter(sp, lambda: store, flush_rows=1000, flush_interval_s=0.01)
    w.start()
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    sp.close()
    assert _counts(store) == ((30, 30), 30)  # batch 1 replayed with its own token: deduplicated


def test_store_lost_while_inserting_batch_by_batch_retries_the_same_batches(store, tmp_path):
    down = tmp_path / "store-down"
    sp = Spool(tmp_path / "spool", max_bytes=1 << 24)
    for i in range(2):
        sp.submit(f"b{i}", _t(10, start=10 * i)).result()

    def lose_store_at_second(seq):  # batch 1 landed; more traffic arrives, then the store goes away
        if seq == 2:
            if not down.exists():
                sp.submit("b2", _t(10, start=20)).result()
                down.touch()
            raise RuntimeError("connection refused")

    refusing = _RefusesBlocks(store, lose_store_at_second)
    w = BlockWriter(sp, lambda: refusing, flush_rows=1000, flush_interval_s=0.01, retry_max_s=0.01,
                    fault_store_down_file=down, poison_after=1)
    w.start()
    wait_for(lambda: down.exists() and w.failures >= 4, what="writer retrying while the store is away")
    refusing.refuse, refusing.on_batch = False, None
    down.unlink()
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    sp.close()
    assert w.quarantined == 0 and w.last_error is None
    assert _counts(store) == ((30, 30), 30)  # batch 1 not stored again inside a larger block


def test_a_quarantined_batch_stored_on_replay_leaves_no_quarantine_files(store, tmp_path):
    """Refused batch by batch, batch 2 is quarantined; the process dies before the spool commit; after
    the restart the store takes it on replay: its quarantine files go (the rows are not lost)."""
    sp = Spool(tmp_path, max_bytes=1 << 24)
    for i in range(3):
        sp.submit(f"b{i}", _t(10, start=10 * i)).result()

    def refuse_second(seq):
        if seq == 2:
            raise RuntimeError("Code: 27. DB::Exception: Cannot parse input (CANNOT_PARSE_INPUT_ASSERTION_FAILED)")

    refusing = _RefusesBlocks(store, refuse_second)
    crashed = BlockWriter(sp, lambda: refusing, flush_rows=1000, retry_max_s=0.01, poison_after=2)
    entries = sp.take(1000)
    sp.log_intent(entries[0].seq, entries[-1].seq)
    assert crashed._insert_with_retry(entries)  # batches 1 and 3 stored, 2 quarantined; no commit logged
    q = tmp_path / "quarantine" / f"{2:020d}-step.arrow"
    assert crashed.quarantined == 1 and q.exists() and q.with_suffix(".error.txt").exists()
    sp.close()
    assert _counts(store) == ((20, 20), 20)

    sp = Spool(tmp_path, max_bytes=1 << 24)  # restart: the replay goes batch by batch, the store takes batch 2
    w = BlockWriter(sp, lambda: store, flush_rows=1000, flush_interval_s=0.01)
    w.start()
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    sp.close()
    assert _counts(store) == ((30, 30), 30)
    assert sorted(p.name for p in (tmp_path / "quarantine").iterdir()) == []
    assert w.quarantined == 0 and w.stats()["unquarantined"] == 1


class _LandsThenRaises(_RefusesBlocks):
    """A remote store that commits a block and then raises (a timeout after the server committed), every
    time; ``part`` commits only those rows of it (one partition's part of a block spanning two)."""

    def __init__(self, store, part=None):
        super().__init__(store)
        self.part = part

    def insert_arrow(self, table, arrow_table, dedup_token):
        first, last = dedup_token.split(":")[1].split("-")
        if first == last:
            return self.store.insert_arrow(table, arrow_table, dedup_token=dedup_token)
        landed = arrow_table if self.part is None else arrow_table.slice(*self.part)
        self.store.insert_arrow(table, landed, dedup_token=dedup_token)
        raise TimeoutError("read timed out")


@pytest.mark.parametrize(
    "part",
    [None, (5, 10)],  # the whole block landed; rows 5-14 landed (batch 1 in part: a partition's share)
    ids=["whole-block", "part-of-block"],
)
def test_a_block_that_landed_before_its_insert_raised_stores_only_its_missing_rows_batch_by_batch(
    part, store, tmp_path
):
    sp = Spool(tmp_path, max_bytes=1 << 24)
    for i in range(3):
        sp.submit(f"b{i}", _t(10, start=10 * i)).result()
    w = BlockWriter(sp, lambda: _LandsThenRaises(store, part=part), flush_rows=1000, flush_interval_s=0.01,
                    retry_max_s=0.01, poison_after=2)
    w.start()
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    w.stop()
    sp.close()
    assert w.quarantined == 0 and w.last_error is None
    assert _counts(store) == ((30, 30), 30)


def test_the_landed_check_finds_stored_rows_of_every_kind(store, tmp_path):
    from datetime import timedelta

    from tests.collector.test_ingest_checks import ROWS

    sp = Spool(tmp_path, max_bytes=1 << 24)
    w = BlockWriter(sp, lambda: store)
    for kind, base in ROWS.items():
        # distinct rows (ts with sub-millisecond parts: the store keeps milliseconds), then one key twice
        t0 = base[0]["ts"].replace(microsecond=900)
        rows = [{**base[0], "ts": t0 + timedelta(microseconds=10_700 * i)} for i in range(4)]
        rows.append(dict(rows[-1]))
        table = records.to_arrow(kind, rows)
        assert w._not_landed(kind, table).num_rows == 5  # nothing stored yet
        store.insert_arrow(records.TABLES[kind], table.slice(0, 2), dedup_token=f"{kind}-a")
        assert w._not_landed(kind, table).to_pylist() == table.slice(2).to_pylist(), kind
        store.insert_arrow(records.TABLES[kind], table.slice(3, 1), dedup_token=f"{kind}-b")
        # the twice-present key is stored once only: both its rows are inserted (never one of two)
        assert w._not_landed(kind, table).to_pylist() == table.slice(2).to_pylist(), kind
        store.insert_arrow(records.TABLES[kind], table.take([2, 4]), dedup_token=f"{kind}-c")
        assert w._not_landed(kind, table).num_rows == 0, kind
    sp.close()
